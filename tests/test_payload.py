"""KV block payload tiers (kvstore.payload): host LRU, Redis with a byte cap, headers and checksums."""

from __future__ import annotations

import logging

import pytest
import torch

from kvstore.events import PoolEvent, PoolMirror
from kvstore.hashing import block_hashes, salt_for
from kvstore.payload import (
    BlockError,
    BlockLayout,
    HostTier,
    RedisTier,
    decode_block,
    encode_block,
    fetch_prefix,
    read_block,
)
from kvstore.pool import POOL_HOLDER, KVPool, hex_of
from services.local_redis import LocalRedis, free_port

pytestmark = pytest.mark.redis

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, kv_heads, head_dim
HASHES = block_hashes(list(range(4 * 12)), 4, salt_for("tiny"))


def blocks(n: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=g).to(dtype) for _ in range(n)]


def block_bytes() -> int:
    return len(encode_block("tiny", HASHES[0], blocks(1)[0]))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_redis_tier_round_trips_blocks(pool, dtype):
    tier = RedisTier(pool, max_bytes=1 << 20, layout=BlockLayout(str(dtype).removeprefix("torch."), SHAPE))
    data = blocks(4, dtype)
    assert tier.put_blocks(HASHES[:4], data)
    got = tier.get_blocks(HASHES[:5])
    assert got[4] is None
    for a, b in zip(got[:4], data, strict=True):
        assert a.dtype == dtype and torch.equal(a, b)


@pytest.mark.timeout(30)
def test_eviction_keeps_redis_under_cap_and_publishes_evictions(pool, redis_url, redis_client):
    cap = 4 * block_bytes() + 10
    tier = RedisTier(pool, max_bytes=cap)
    mirror = PoolMirror(redis_url, "tiny", 4, ttl_s=30)
    try:
        mirror.poll()
        for i in range(0, 12, 3):  # 12 blocks in batches of 3 through a 4-block cap
            assert tier.put_blocks(HASHES[i:i + 3], blocks(3))
            stored = sum(redis_client.strlen(k) for k in redis_client.scan_iter(pool.ns + "p:*"))
            assert stored == tier.nbytes() <= cap
        assert [b is not None for b in tier.get_blocks(HASHES)] == [False] * 8 + [True] * 4

        events = [PoolEvent.from_fields(f) for _, f in redis_client.xrange(pool.stream)]
        removed = [h for e in events if e.worker == POOL_HOLDER and e.op == "removed" for h in e.hashes]
        assert sorted(removed) == sorted(HASHES[:8])
        assert pool.longest_prefix(HASHES[8:]) == {POOL_HOLDER: 4}
        assert pool.longest_prefix(HASHES) == {}
        mirror.poll()
        assert mirror.longest_prefix(HASHES[8:]) == {POOL_HOLDER: 4}
        assert mirror.longest_prefix(HASHES) == {}
    finally:
        mirror.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("read", ["get_blocks", "get_prefix"])
def test_eviction_is_least_recently_used(pool, read):
    tier = RedisTier(pool, max_bytes=3 * block_bytes())
    tier.put_blocks(HASHES[:3], blocks(3))
    assert len(getattr(tier, read)([HASHES[0], HASHES[5]])) >= 1  # block 0 is now the most recently used
    tier.put_blocks([HASHES[3]], blocks(1))
    assert [b is not None for b in tier.get_blocks(HASHES[:4])] == [True, False, True, True]


@pytest.mark.timeout(30)
def test_a_prefix_read_fetches_only_the_leading_blocks_redis_holds():
    """A fresh prompt's look into Redis (every prefill makes one) reads no block: one script call finds
    that nothing leads, where a GET for each of its blocks would cost a round trip's worth of commands."""
    with LocalRedis() as server:  # private: its command counts are this test's alone
        pool = KVPool(server.url, "tiny", 4, ttl_s=30)
        try:
            tier = RedisTier(pool, max_bytes=1 << 20)
            data = blocks(3)
            tier.put_blocks(HASHES[:2] + [HASHES[3]], data)  # block 2 missing: the run stops there
            pool.client.config_resetstat()
            got = tier.get_prefix(HASHES[:8])
            assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, data, strict=False))
            assert pool.client.info("commandstats")["cmdstat_get"]["calls"] == 2
            assert tier.get_prefix(HASHES[4:]) == []
            assert tier.get_prefix(HASHES[2:4]) == []  # a later block held does not make a prefix
            assert pool.client.info("commandstats")["cmdstat_get"]["calls"] == 2
        finally:
            pool.close()


@pytest.mark.timeout(30)
def test_corrupted_payload_is_a_miss_and_is_recomputed(pool, redis_client, caplog):
    tier = RedisTier(pool, max_bytes=1 << 20)
    data = blocks(3)
    tier.put_blocks(HASHES[:3], data)
    key = pool.ns + "p:" + hex_of(HASHES[1])
    raw = bytearray(redis_client.get(key))
    raw[-5] ^= 0xFF  # one flipped byte in the tensor bytes
    redis_client.set(key, bytes(raw))

    with caplog.at_level(logging.ERROR, logger="kvstore.payload"):
        got = tier.get_blocks(HASHES[:3])
    assert got[1] is None and torch.equal(got[0], data[0]) and torch.equal(got[2], data[2])
    assert "checksum" in caplog.text
    assert len(tier.get_prefix(HASHES[:3])) == 1  # the prefix now stops at the discarded block
    assert pool.longest_prefix(HASHES[:3]) == {POOL_HOLDER: 1}  # the bad block left the index

    tier.put_blocks([HASHES[1]], [data[1]])  # the caller recomputes it
    assert all(torch.equal(a, b) for a, b in zip(tier.get_prefix(HASHES[:3]), data, strict=True))


@pytest.mark.timeout(30)
def test_header_mismatch_is_a_miss(pool, redis_client):
    tier = RedisTier(pool, max_bytes=1 << 20)
    tier.put_blocks(HASHES[:1], blocks(1))
    # the bytes of block 0 under block 1's key: a valid checksum but the wrong block hash
    redis_client.set(pool.ns + "p:" + hex_of(HASHES[1]), redis_client.get(pool.ns + "p:" + hex_of(HASHES[0])))
    assert tier.get_blocks([HASHES[1]]) == [None]
    other_layout = RedisTier(pool, max_bytes=1 << 20, layout=BlockLayout("bfloat16", SHAPE))
    assert other_layout.get_blocks([HASHES[0]]) == [None]
    with pytest.raises(ValueError, match="model"):
        decode_block(encode_block("tiny", HASHES[2], blocks(1)[0]), "other-model", HASHES[2])


def test_a_block_of_another_kv_format_is_a_miss_that_stays_for_its_owner(pool):
    full = RedisTier(pool, max_bytes=1 << 20, layout=BlockLayout("float32", SHAPE))
    full.put_blocks(HASHES[:1], blocks(1))
    quantized = RedisTier(pool, max_bytes=1 << 20, layout=BlockLayout("float32", SHAPE, kv_format="int8"))
    assert quantized.get_blocks([HASHES[0]]) == [None]
    (block,) = full.get_blocks([HASHES[0]])  # not discarded by the other format's reader
    assert torch.equal(block, blocks(1)[0])


@pytest.mark.timeout(30)
def test_host_tier_is_a_bounded_lru_that_reports_changes():
    stored, removed = [], []
    tier = HostTier("tiny", max_bytes=3 * block_bytes(), on_stored=stored.extend, on_removed=removed.extend)
    data = blocks(4)
    tier.put_blocks(HASHES[:3], data[:3])
    tier.get_blocks([HASHES[0]])
    tier.put_blocks([HASHES[3]], data[3:])
    assert tier.nbytes <= 3 * block_bytes() and len(tier) == 3
    assert stored == HASHES[:4] and removed == [HASHES[1]]
    assert torch.equal(tier.get_blocks([HASHES[3]])[0], data[3])


@pytest.mark.timeout(30)
def test_fetch_prefix_continues_across_tiers_until_the_first_miss(pool):
    data = blocks(8)
    host = HostTier("tiny", max_bytes=1 << 20)
    redis_tier = RedisTier(pool, max_bytes=1 << 20)
    host.put_blocks(HASHES[:3], data[:3])
    redis_tier.put_blocks(HASHES[:6], data[:6])
    redis_tier.put_blocks(HASHES[7:8], data[7:8])  # after a hole: not part of the prefix
    got = fetch_prefix(HASHES[:8], [host, redis_tier])
    assert len(got) == 6
    assert all(torch.equal(a, b) for a, b in zip(got, data, strict=False))


@pytest.mark.timeout(30)
def test_fetch_prefix_fills_a_hole_from_a_slower_tier_and_goes_on_in_the_faster_one(pool):
    data = blocks(9)
    host = HostTier("tiny", max_bytes=1 << 20)
    redis_tier = RedisTier(pool, max_bytes=1 << 20)
    host.put_blocks(HASHES[:3] + HASHES[5:8], data[:3] + data[5:8])
    redis_tier.put_blocks(HASHES[3:5], data[3:5])  # the host tier's hole
    got = fetch_prefix(HASHES[:9], [host, redis_tier])
    assert len(got) == 8
    assert all(torch.equal(a, b) for a, b in zip(got, data, strict=False))


@pytest.mark.timeout(30)
def test_redis_tier_fails_soft_when_unreachable():
    pool = KVPool(f"redis://127.0.0.1:{free_port()}/0", "tiny", 4)
    tier = RedisTier(pool, max_bytes=1 << 20)
    assert tier.put_blocks(HASHES[:2], blocks(2)) is False
    assert tier.get_blocks(HASHES[:2]) == [None, None]
    assert tier.get_prefix(HASHES[:2]) == []
    pool.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_read_block_from_a_file_equals_decode_block_and_refuses_any_damage(tmp_path, dtype):
    block = torch.randn(2, 2, 4, 2, 8).to(dtype)
    stored = encode_block("tiny", HASHES[0], block)
    path = tmp_path / "block.kv"

    def read(data: bytes) -> torch.Tensor:
        path.write_bytes(data)
        with open(path, "rb", buffering=0) as f:
            return read_block(f, "tiny", HASHES[0], BlockLayout(str(dtype).removeprefix("torch."), block.shape))

    assert torch.equal(read(stored), decode_block(stored, "tiny", HASHES[0]))
    assert torch.equal(read(stored), block)
    header_end = stored.index(b"}") + 1
    damaged = [stored[:n] for n in (0, 3, 8, header_end - 1, header_end, len(stored) - 1)]  # truncated
    damaged += [stored + b"\0", stored[:-1] + bytes([stored[-1] ^ 1]),  # longer; one bit flipped
                b"XXXX" + stored[4:], stored[:4] + (1 << 30).to_bytes(4, "little") + stored[8:]]  # magic; length
    for i, data in enumerate(damaged):
        with pytest.raises(BlockError):
            read(data)
            pytest.fail(f"damage {i} was not detected")
