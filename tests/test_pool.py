"""The Redis prefix index (kvstore.pool) against a real redis-server."""

from __future__ import annotations

import pytest
import redis

from kvstore.events import PoolMirror
from kvstore.hashing import block_hashes, salt_for
from kvstore.pool import KVPool
from services.local_redis import LocalRedis, free_port

pytestmark = pytest.mark.redis

SALT = salt_for("tiny")


def chain(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, 4, SALT)


@pytest.mark.timeout(30)
def test_longest_prefix_three_workers_overlapping_chains_and_mirror_agrees(pool, redis_url):
    system = list(range(16))  # a 4-block prefix every prompt shares
    a = chain(system + list(range(100, 124)))  # 10 blocks
    b = chain(system + list(range(100, 108)) + list(range(300, 316)))  # shares 6 blocks with a
    for w in ("w1", "w2", "w3"):
        pool.heartbeat(w)
    pool.publish_stored("w1", a)  # all of chain a
    pool.publish_stored("w2", b[:8])  # system + 2 shared blocks + 2 of its own
    pool.publish_stored("w3", a[:4], tier="host")  # only the system prompt
    pool.publish_stored("w3", a[5:9])  # blocks past a hole do not count

    assert pool.longest_prefix(a) == {"w1": 10, "w2": 6, "w3": 4}
    assert pool.longest_prefix(b) == {"w1": 6, "w2": 8, "w3": 4}
    assert pool.longest_prefix(chain(list(range(500, 516)))) == {}

    mirror = PoolMirror(redis_url, "tiny", 4, ttl_s=30)
    try:
        mirror.poll()
        for query in (a, b, a[:3], b[2:], chain(list(range(500, 516)))):
            assert mirror.longest_prefix(query) == pool.longest_prefix(query)
    finally:
        mirror.stop()


@pytest.mark.timeout(30)
def test_longest_prefix_with_many_holders_of_a_shared_prefix(pool, redis_url):
    c = chain(list(range(4 * 40)))
    expected = {}
    for i in range(40):  # more holders than the per-holder lookup takes: the chain walk answers
        w = f"w{i}"
        pool.heartbeat(w)
        pool.publish_stored(w, c[: i + 1] + c[i + 2:])  # a hole right after its prefix
        expected[w] = i + 1
    assert pool.longest_prefix(c) == expected
    assert pool.longest_prefix(c[:30]) == {w: min(n, 30) for w, n in expected.items()}
    mirror = PoolMirror(redis_url, "tiny", 4, ttl_s=30)
    try:
        mirror.poll()
        assert mirror.longest_prefix(c) == expected
    finally:
        mirror.stop()


@pytest.mark.timeout(30)
def test_longest_prefix_of_a_chain_longer_than_one_script_call_batch(pool):
    c = chain(list(range(4 * 2500)))  # 2,500 blocks: the per-holder check runs in 1,000-block pieces
    pool.heartbeat("w1")
    pool.heartbeat("w2")
    pool.publish_stored("w1", c)
    pool.publish_stored("w2", c[:1200] + c[1201:])
    assert pool.longest_prefix(c) == {"w1": 2500, "w2": 1200}


@pytest.mark.timeout(30)
def test_longest_prefix_is_one_round_trip(pool, monkeypatch):
    hashes = chain(list(range(400)))  # 100 blocks
    pool.heartbeat("w1")
    pool.publish_stored("w1", hashes)
    # The pool's own commands: the server's command stats count every client of the shared test Redis.
    sent = []
    execute = pool.client.execute_command
    monkeypatch.setattr(pool.client, "execute_command", lambda *args, **kw: sent.append(args[0]) or execute(*args, **kw))
    assert pool.longest_prefix(hashes) == {"w1": 100}
    assert sent == ["EVALSHA"]


@pytest.mark.timeout(30)
def test_removing_one_tier_keeps_the_others(pool):
    h = chain(list(range(8)))
    pool.heartbeat("w1")
    pool.publish_stored("w1", h, tier="device")
    pool.publish_stored("w1", h, tier="host")
    pool.publish_removed("w1", h, tier="device")
    assert pool.longest_prefix(h) == {"w1": 2}
    pool.publish_removed("w1", h[1:])  # every tier
    assert pool.longest_prefix(h) == {"w1": 1}


@pytest.mark.timeout(30)
def test_keys_are_namespaced_by_model_and_block_size(pool, redis_url):
    other_size = KVPool(redis_url, "tiny", 8, ttl_s=30)
    other_model = KVPool(redis_url, "other", 4, ttl_s=30)
    h = chain(list(range(8)))
    pool.heartbeat("w1")
    pool.publish_stored("w1", h)
    for other in (other_size, other_model):
        other.heartbeat("w1")
        assert other.longest_prefix(h) == {}
        other.close()
    assert pool.longest_prefix(h) == {"w1": 2}


@pytest.mark.timeout(30)
def test_replace_holdings_sets_exactly_the_given_state(pool):
    h = chain(list(range(16)))
    pool.heartbeat("w1")
    pool.publish_stored("w1", h[2:])  # stale entries from an earlier life
    assert pool.replace_holdings("w1", {h[0]: 1, h[1]: 2})
    assert pool.longest_prefix(h) == {"w1": 2}
    assert pool.longest_prefix(h[2:]) == {}


@pytest.mark.timeout(30)
def test_password_in_url_is_used():
    with LocalRedis() as server:
        redis.Redis(port=server.port).config_set("requirepass", "s3cret")
        good = KVPool(f"redis://:s3cret@127.0.0.1:{server.port}/0", "tiny", 4)
        bad = KVPool(f"redis://:wrong@127.0.0.1:{server.port}/0", "tiny", 4)
        h = chain(list(range(8)))
        assert good.heartbeat("w1") is True
        assert good.publish_stored("w1", h)
        assert good.longest_prefix(h) == {"w1": 2}
        assert bad.longest_prefix(h) == {}  # refused, and fail-soft: no exception
        assert bad.publish_stored("w1", h) is False
        good.close()
        bad.close()


@pytest.mark.timeout(30)
def test_unreachable_redis_fails_soft():
    pool = KVPool(f"redis://127.0.0.1:{free_port()}/0", "tiny", 4)
    h = chain(list(range(8)))
    assert pool.longest_prefix(h) == {}
    assert pool.publish_stored("w1", h) is False
    assert pool.heartbeat("w1") is None
    assert pool.cleanup() == []
    assert not pool.up
    pool.close()
