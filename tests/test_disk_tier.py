"""The disk tier (kvstore.disk_tier): files per block under a byte budget with LRU, written behind, checked
on read (a damaged file is a miss), reindexed after a restart; and a restarted worker serving a resumed
session from its disk with the output of a cold run."""

from __future__ import annotations

import asyncio
import logging
import os
import random

import openai
import pytest
import torch
from live_helpers import wait_until
from test_pool_engine import GREEDY, _engine, _generate, load_prefix

from kvstore.disk_tier import TMP_SUFFIX, DiskTier
from kvstore.hashing import block_hashes, salt_for
from kvstore.payload import BlockLayout, encode_block
from router.estimator import PrefillModel
from services.engine_loop import EngineLoop
from services.pool_link import PoolLink

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, kv_heads, head_dim
HASHES = block_hashes(list(range(4 * 8)), 4, salt_for("tiny"))


def blocks(n: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=g).to(dtype) for _ in range(n)]


BLOCK_BYTES = len(encode_block("tiny", HASHES[0], blocks(1)[0]))


class Recorder:
    """The tier's on_stored/on_removed, in order."""

    def __init__(self) -> None:
        self.stored: list[int] = []
        self.removed: list[int] = []

    def tier(self, root, max_bytes: int = 1 << 20, **kwargs) -> DiskTier:
        return DiskTier(root, "tiny", max_bytes, on_stored=self.stored.extend, on_removed=self.removed.extend,
                        **kwargs)


def written(tier: DiskTier, hashes, data) -> DiskTier:
    tier.put_blocks(hashes, data)
    assert tier.flush(10)
    return tier


def files_under(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_through_one_file_each_in_fanout_directories(tmp_path, dtype):
    rec = Recorder()
    layout = BlockLayout(str(dtype).removeprefix("torch."), SHAPE)
    data = blocks(4, dtype)
    tier = written(rec.tier(tmp_path, layout=layout), HASHES[:4], data)
    try:
        got = tier.get_prefix(HASHES[:6])
        assert len(got) == 4
        assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(got, data, strict=True))
        names = files_under(tmp_path)
        assert names == sorted(os.path.relpath(tier.path_of(h), tmp_path) for h in HASHES[:4])
        assert all(n.split(os.sep)[0] == n.split(os.sep)[1][:2] for n in names)  # fan-out by hash prefix
        assert tier.nbytes == sum(os.path.getsize(tier.path_of(h)) for h in HASHES[:4])
        assert rec.stored == HASHES[:4] and rec.removed == []
        assert tier.put_blocks(HASHES[:4], data) == 0  # already on disk: nothing queued
    finally:
        tier.close()


@pytest.mark.timeout(30)
def test_budget_evicts_the_least_recently_used_files(tmp_path):
    rec = Recorder()
    data = blocks(4)
    tier = written(rec.tier(tmp_path, max_bytes=3 * BLOCK_BYTES), HASHES[:3], data[:3])
    try:
        assert len(tier.get_prefix(HASHES[:1])) == 1  # block 0 is now the most recently used
        written(tier, HASHES[3:4], data[3:4])
        assert rec.removed == [HASHES[1]]
        assert not tier.path_of(HASHES[1]).exists() and HASHES[1] not in tier
        assert [h in tier for h in HASHES[:4]] == [True, False, True, True]
        on_disk = sum(os.path.getsize(os.path.join(tmp_path, n)) for n in files_under(tmp_path))
        assert on_disk == tier.nbytes <= 3 * BLOCK_BYTES
    finally:
        tier.close()


@pytest.mark.timeout(30)
def test_restart_reindexes_the_files_and_enforces_the_budget_on_start(tmp_path):
    data = blocks(4)
    first = Recorder().tier(tmp_path)
    written(first, HASHES[:4], data).close()
    for age, h in enumerate(HASHES[:4]):  # block 0 written last: the newest
        os.utime(first.path_of(h), ns=(10**18 - age * 10**9,) * 2)
    stray = first.path_of(HASHES[5])
    stray.with_name(stray.name + TMP_SUFFIX).write_bytes(b"half a block")  # a write cut short by a crash

    rec = Recorder()
    tier = rec.tier(tmp_path, max_bytes=2 * BLOCK_BYTES)
    try:
        assert sorted(rec.stored) == sorted(HASHES[:2]) and rec.removed == []
        assert files_under(tmp_path) == sorted(os.path.relpath(tier.path_of(h), tmp_path) for h in HASHES[:2])
        assert tier.nbytes == 2 * BLOCK_BYTES
        got = tier.get_prefix(HASHES[:4])
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, data, strict=False))
    finally:
        tier.close()


@pytest.mark.timeout(30)
def test_corrupted_truncated_or_misnamed_files_are_misses(tmp_path, caplog):
    rec = Recorder()
    data = blocks(4)
    tier = written(rec.tier(tmp_path), HASHES[:4], data)
    try:
        path = tier.path_of(HASHES[1])
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0xFF  # one flipped byte in the tensor bytes
        path.write_bytes(bytes(raw))
        with caplog.at_level(logging.ERROR, logger="kvstore.disk_tier"):
            got = tier.get_prefix(HASHES[:4])
        assert len(got) == 1 and torch.equal(got[0], data[0])
        assert "checksum" in caplog.text
        assert rec.removed == [HASHES[1]] and not path.exists() and HASHES[1] not in tier

        with open(tier.path_of(HASHES[2]), "r+b") as f:
            f.truncate(BLOCK_BYTES // 2)
        assert tier.get_prefix(HASHES[2:4]) == []
        tier.path_of(HASHES[3]).write_bytes(tier.path_of(HASHES[0]).read_bytes())  # block 0's bytes, 3's name
        assert tier.get_prefix(HASHES[3:4]) == []
        assert rec.removed == HASHES[1:4] and len(tier) == 1

        written(tier, HASHES[1:4], data[1:4])  # the caller recomputes and shares them again
        assert all(torch.equal(a, b) for a, b in zip(tier.get_prefix(HASHES[:4]), data, strict=True))
    finally:
        tier.close()


@pytest.mark.timeout(30)
def test_a_full_disk_drops_the_write_logs_once_and_recovers(tmp_path, caplog):
    rec = Recorder()
    tier = rec.tier(tmp_path)
    try:
        for h in HASHES[:2]:  # the device behind these two temp files is full
            tmp = tier.path_of(h).with_name(tier.path_of(h).name + TMP_SUFFIX)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.symlink_to("/dev/full")
        with caplog.at_level(logging.WARNING, logger="kvstore.disk_tier"):
            written(tier, HASHES[:2], blocks(2))
            assert tier.get_prefix(HASHES[:2]) == [] and tier.dropped == 2 and rec.stored == []
            assert len(caplog.records) == 1 and "No space left" in caplog.text  # two failures, one warning
            written(tier, HASHES[:2], blocks(2))  # the temp files are gone: writes work again
        assert len(tier.get_prefix(HASHES[:2])) == 2 and rec.stored == HASHES[:2]
        assert "works again" in caplog.text
        assert files_under(tmp_path) == sorted(os.path.relpath(tier.path_of(h), tmp_path) for h in HASHES[:2])
    finally:
        tier.close()


@pytest.mark.timeout(30)
def test_an_unreadable_file_is_a_miss(tmp_path, caplog):
    rec = Recorder()
    tier = written(rec.tier(tmp_path), HASHES[:2], blocks(2))
    try:
        path = tier.path_of(HASHES[1])
        path.unlink()
        path.mkdir()  # opening it fails with an OS error, not a missing file
        with caplog.at_level(logging.WARNING, logger="kvstore.disk_tier"):
            assert len(tier.get_prefix(HASHES[:2])) == 1
        assert "reading block" in caplog.text and rec.removed == [HASHES[1]] and HASHES[1] not in tier
    finally:
        tier.close()


@pytest.mark.timeout(30)
def test_a_backlog_beyond_its_cap_is_dropped_instead_of_waiting(tmp_path):
    data = blocks(5)
    tier = Recorder().tier(tmp_path, max_pending_bytes=2 * data[0].numel() * data[0].element_size())
    try:
        assert tier.put_blocks(HASHES[:5], data) == 2
        assert tier.flush(10)
        assert len(tier) == 2 and tier.dropped == 3
    finally:
        tier.close()


@pytest.mark.timeout(30)
def test_close_writes_what_is_queued_and_stops_the_writer(tmp_path):
    data = blocks(6)
    tier = Recorder().tier(tmp_path)
    tier.put_blocks(HASHES[:6], data)
    tier.close()
    assert not tier._thread.is_alive()
    assert len(tier) == 6 and all(tier.path_of(h).exists() for h in HASHES[:6])
    assert tier.put_blocks(HASHES[6:7], blocks(1)) == 0  # closed: nothing is queued any more, nothing read
    assert tier.get_prefix(HASHES[:6]) == []

    dropping = Recorder().tier(tmp_path / "dropping")
    dropping.put_blocks(HASHES[:6], data)
    dropping.close(drain=False)
    assert not dropping._thread.is_alive() and dropping.flush(0)
    assert len(dropping) + dropping.dropped == 6
    assert not any(n.endswith(TMP_SUFFIX) for n in files_under(tmp_path / "dropping"))


@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_restarted_worker_serves_a_resumed_session_from_disk(redis_url, redis_client, serving_model_dir,
                                                                 tmp_path):
    """Engine A computes a prompt and shares it; A stops (its device and host tiers are gone) and Redis loses
    the blocks; A restarted on the same disk finds them, publishes them, and its output equals a cold run."""
    prompt = random.Random(3).choices(range(3, 250), k=100)
    disk = {"disk_dir": str(tmp_path), "disk_max_bytes": 64 << 20}

    async def run() -> None:
        aio = asyncio.get_running_loop()
        cold = EngineLoop(_engine(serving_model_dir), aio)
        try:
            expected, cached_cold = await _generate(cold, "cold", prompt, GREEDY)
        finally:
            cold.stop()

        loop = EngineLoop(_engine(serving_model_dir), aio)
        link = PoolLink(redis_url, "engine-a", loop.engine, redis_max_bytes=64 << 20, **disk)
        loop.set_block_event_sink(link.publish)
        try:
            await _generate(loop, "turn-1", prompt, GREEDY, prefill_only=True)
            await link.store_prefix(loop, prompt, 0, loop.engine.prefix_salt(None))
            await link.wait_shared()
            await loop.acall(loop.engine.release, "turn-1")
        finally:
            link.close()  # drains the disk writer
            loop.stop()
        redis_client.flushdb()

        loop = EngineLoop(_engine(serving_model_dir), aio)
        link = PoolLink(redis_url, "engine-a", loop.engine, redis_max_bytes=64 << 20, **disk)
        loop.set_block_event_sink(link.publish)
        try:
            link.publisher.beat()  # registered now (its thread does it too, at its own pace)
            assert link.publisher.flush()
            hashes = block_hashes(prompt, loop.engine.block_size, salt_for(loop.engine.model_id))
            holders = link.pool.longest_prefix(hashes)
            assert len(link.host) == 0 and link.redis.get_prefix(hashes) == []  # only the disk has them
            placed, tiers = await load_prefix(loop, link, prompt)
            tokens, cached = await _generate(loop, "turn-2", prompt, GREEDY)
        finally:
            link.close()
            loop.stop()
        block_size = loop.engine.block_size
        assert holders == {"engine-a": len(hashes)}  # the restarted worker published its disk
        assert placed == (len(prompt) - 1) // block_size and tiers == {"disk": placed}
        assert cached == placed * block_size > 0 and cached_cold == 0
        assert tokens == expected

    asyncio.run(run())


@pytest.mark.redis
@pytest.mark.timeout(120)
def test_redis_blocks_are_read_only_when_reading_beats_recomputing(redis_url, redis_client, serving_model_dir):
    """Whatever the routing policy, a worker reads what another put in Redis, unless its own prefill model
    says computing those tokens is faster than its measured Redis read rate."""
    prompt = random.Random(4).choices(range(3, 250), k=70)

    async def run() -> tuple[int, int, int]:
        aio = asyncio.get_running_loop()
        loops = [EngineLoop(_engine(serving_model_dir), aio) for _ in range(3)]
        free_compute = PrefillModel(per_pair_s=0.0, per_token_s=1e-12, fixed_s=0.0)
        links = [PoolLink(redis_url, f"engine-{n}", lp.engine, redis_max_bytes=64 << 20, prefill_model=model)
                 for n, lp, model in zip("abc", loops, (None, None, free_compute), strict=True)]
        try:
            await _generate(loops[0], "on-a", prompt, GREEDY, prefill_only=True)
            await links[0].store_prefix(loops[0], prompt, 0, loops[0].engine.prefix_salt(None))
            await links[0].wait_shared()
            links[2].fetch_cost.observe(1 << 20, 0.001)  # a measured read: 1 GB/s, slower than "free" compute
            return ((await load_prefix(loops[1], links[1], prompt))[0],
                    (await load_prefix(loops[2], links[2], prompt))[0], loops[1].engine.block_size)
        finally:
            for link, lp in zip(links, loops, strict=True):
                link.close()
                lp.stop()

    read, declined, block_size = asyncio.run(run())
    assert read == (len(prompt) - 1) // block_size and declined == 0


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_serve_gives_each_prefill_worker_its_disk_tier(start_server, tmp_path):
    server = start_server(prefill=1, decode=1, kv_transport="grpc", kv_disk_dir=str(tmp_path))
    try:
        c = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)
        c.chat.completions.create(model=server.model_id, max_tokens=2, temperature=0.0,
                                  messages=[{"role": "user", "content": "tell me about tide pools " * 6}])
        worker_dir = tmp_path / "prefill-0"
        assert wait_until(lambda: any(worker_dir.rglob("*.kv")), 30)  # written behind, after the prefill
        assert not (tmp_path / "decode-0").exists() or not any((tmp_path / "decode-0").rglob("*.kv"))
    finally:
        server.stop()
