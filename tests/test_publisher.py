"""A worker's pool publisher (kvstore.publisher): buffered engine events, batching, full replaces."""

from __future__ import annotations

import pytest

from kvstore.events import PoolEvent
from kvstore.hashing import block_hashes, salt_for
from kvstore.pool import KVPool
from kvstore.publisher import PoolPublisher

pytestmark = pytest.mark.redis

HASHES = block_hashes(list(range(4 * 10)), 4, salt_for("tiny"))


def events(pool: KVPool, client) -> list[PoolEvent]:
    return [PoolEvent.from_fields(f) for _, f in client.xrange(pool.stream)]


@pytest.mark.timeout(30)
def test_first_flush_replaces_stale_entries_from_an_earlier_life(pool):
    pool.heartbeat("w1")
    pool.publish_stored("w1", HASHES[5:])  # what a crashed worker with the same id left behind
    pub = PoolPublisher(pool, "w1")
    pub.on_stored(HASHES[:3])
    pub.beat()
    assert pub.flush()
    assert pool.longest_prefix(HASHES) == {"w1": 3}
    assert pool.longest_prefix(HASHES[5:]) == {}


@pytest.mark.timeout(30)
def test_events_are_batched_in_order_in_one_flush(pool, redis_client):
    pub = PoolPublisher(pool, "w1")
    pub.beat()
    pub.flush()
    start = len(events(pool, redis_client))
    before = redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]
    pub.on_stored(HASHES[:4])
    pub.on_stored(HASHES[4:6])  # merged with the previous call
    pub.on_removed(HASHES[2:4])
    pub.on_stored(HASHES[2:3], tier="host")
    assert pub.flush()
    assert redis_client.info("commandstats")["cmdstat_evalsha"]["calls"] - before == 3
    new = events(pool, redis_client)[start:]
    assert [(e.op, len(e.hashes)) for e in new] == [("stored", 6), ("removed", 2), ("stored", 1)]
    assert [e.seq for e in new] == [new[0].seq, new[0].seq + 1, new[0].seq + 2]
    assert pool.longest_prefix(HASHES) == {"w1": 3}


@pytest.mark.timeout(30)
def test_host_tier_callbacks_publish_under_the_host_tier(pool):
    pub = PoolPublisher(pool, "w1")
    on_stored, on_removed = pub.callbacks("host")
    pub.on_stored(HASHES[:2])
    on_stored(HASHES[:4])
    pub.on_removed(HASHES[:4])  # gone from the device, still in host memory
    pub.beat()
    pub.flush()
    assert pool.longest_prefix(HASHES) == {"w1": 4}
    on_removed(HASHES[1:4])
    pub.flush()
    assert pool.longest_prefix(HASHES) == {"w1": 1}


@pytest.mark.timeout(30)
def test_stop_with_retire_removes_the_worker(pool):
    pub = PoolPublisher(pool, "w1", flush_interval_s=0.01)
    pub.on_stored(HASHES[:3])
    pub.start()
    pub.stop(retire=False)
    assert pool.longest_prefix(HASHES) == {"w1": 3}
    pub.start()
    pub.stop(retire=True)
    assert pool.longest_prefix(HASHES) == {}
