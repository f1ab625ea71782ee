"""Pool events and the in-memory mirror (kvstore.events), with heartbeats, gaps and a Redis restart."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from live_helpers import wait_until

from kvstore.events import PoolMirror
from kvstore.hashing import block_hashes, salt_for
from kvstore.pool import KVPool
from kvstore.publisher import PoolPublisher
from services.local_redis import LocalRedis

pytestmark = pytest.mark.redis

SALT = salt_for("tiny")
WAIT_S = 20.0  # a failed wait reports well inside a test's 60 s timeout


def chain(start: int, blocks: int) -> list[int]:
    return block_hashes(list(range(start, start + 4 * blocks)), 4, SALT)


@pytest.fixture
def mirror(redis_url, redis_client):
    m = PoolMirror(redis_url, "tiny", 4, ttl_s=30)
    yield m
    m.stop()


@pytest.mark.timeout(60)
def test_mirror_agrees_with_redis_under_random_churn(pool, mirror):
    rng = random.Random(0)
    chains = [chain(1000 * i, 12) for i in range(6)]
    workers = [f"w{i}" for i in range(5)]
    for w in workers:
        pool.heartbeat(w)
    mirror.poll()
    for _ in range(200):
        w, c = rng.choice(workers), rng.choice(chains)
        lo = rng.randrange(len(c))
        part = c[lo:rng.randrange(lo, len(c)) + 1]
        if rng.random() < 0.7:
            pool.publish_stored(w, part, tier=rng.choice(["device", "host"]))
        else:
            pool.publish_removed(w, part)
        if rng.random() < 0.2:
            mirror.poll()
    mirror.poll()
    for c in chains:
        for cut in (0, 3, 7):
            assert mirror.longest_prefix(c[cut:]) == pool.longest_prefix(c[cut:])
    assert mirror.resyncs == 0


@pytest.mark.timeout(60)
def test_dropped_event_triggers_resync_and_mirror_converges(pool, mirror, redis_client):
    c = chain(0, 10)
    pool.heartbeat("w1")
    pool.publish_stored("w1", c[:3])
    mirror.poll()
    pool.publish_stored("w1", c[3:6])
    lost = redis_client.xrevrange(pool.stream, count=1)[0][0]
    redis_client.xdel(pool.stream, lost)  # the mirror never sees seq 2
    pool.publish_stored("w1", c[6:])
    mirror.poll()
    assert mirror.resyncs == 1
    assert mirror.longest_prefix(c) == pool.longest_prefix(c) == {"w1": 10}


@pytest.mark.timeout(60)
def test_dropped_last_event_is_caught_by_the_census(redis_url, pool, redis_client):
    mirror = PoolMirror(redis_url, "tiny", 4, ttl_s=30, census_interval_s=0)  # census every poll
    try:
        c = chain(0, 6)
        pool.heartbeat("w1")
        pool.publish_stored("w1", c[:2])
        mirror.poll()
        pool.publish_stored("w1", c[2:])
        redis_client.xdel(pool.stream, redis_client.xrevrange(pool.stream, count=1)[0][0])
        mirror.poll()  # no later event shows a gap; the census's sequence number does
        assert mirror.resyncs == 1
        assert mirror.longest_prefix(c) == {"w1": 6}
    finally:
        mirror.stop()


@pytest.mark.timeout(60)
def test_worker_that_stops_heartbeating_disappears_after_ttl(redis_url, redis_client):
    pool = KVPool(redis_url, "tiny", 4, ttl_s=1.0)
    mirror = PoolMirror(redis_url, "tiny", 4, ttl_s=1.0)
    try:
        c = chain(0, 4)
        pool.heartbeat("alive")
        pool.heartbeat("silent")
        pool.publish_stored("alive", c[:2])
        pool.publish_stored("silent", c)
        mirror.poll()
        assert pool.longest_prefix(c) == mirror.longest_prefix(c) == {"alive": 2, "silent": 4}
        assert mirror.workers() == ["alive", "silent"]

        def only_alive() -> bool:
            pool.heartbeat("alive")
            mirror.poll()
            return pool.longest_prefix(c) == mirror.longest_prefix(c) == {"alive": 2}
        assert wait_until(only_alive, WAIT_S)
        assert mirror.workers() == ["alive"]
        assert pool.cleanup() == ["silent"]  # and its holdings leave Redis
        assert not redis_client.exists(pool.ns + "w:silent")
        assert mirror.indexed_blocks == 4
        mirror.poll()  # the drop event empties its holdings in the mirror too
        assert mirror.indexed_blocks == 2
        assert mirror.longest_prefix(c) == {"alive": 2}
    finally:
        pool.close()
        mirror.stop()


@pytest.mark.timeout(60)
def test_redis_killed_and_restarted_mid_run():
    with LocalRedis() as server:
        pool = KVPool(server.url, "tiny", 4, ttl_s=5)
        publisher = PoolPublisher(pool, "w1", flush_interval_s=0.02, heartbeat_interval_s=0.2)
        mirror = PoolMirror(server.url, "tiny", 4, ttl_s=5)
        c = chain(0, 8)
        try:
            publisher.start()
            mirror.start(interval_s=0.02)
            publisher.on_stored(c[:5])
            assert wait_until(lambda: mirror.longest_prefix(c) == {"w1": 5}, WAIT_S)

            server.kill()
            publisher.on_stored(c[5:])  # published while Redis is down: dropped, then republished
            for _ in range(20):  # lookups and polls while down: misses, never an exception
                assert pool.longest_prefix(c) == {}
                mirror.poll()
            server.restart()

            assert wait_until(lambda: pool.longest_prefix(c) == {"w1": 8}, WAIT_S)
            assert wait_until(lambda: mirror.longest_prefix(c) == {"w1": 8}, WAIT_S)
            assert mirror.rebuilds >= 2  # the first build, and one after the restart
        finally:
            publisher.stop(retire=False)
            mirror.stop()
            pool.close()


@pytest.mark.timeout(60)
def test_router_side_modules_do_not_import_torch():
    code = "import sys, kvstore.pool, kvstore.events, kvstore.publisher; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
