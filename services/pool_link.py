"""A worker's link to the KV pool: publish its block events, share computed prefixes, load missing ones.

``publish`` (the engine loop's block-event sink) only buffers the engine's block events (the publisher
thread sends them in batches), so a step never waits on Redis. After a prefill (and after a decode, so the
next chat turn finds the answer too) the sequence's full blocks go to the host tier, to the Redis tier,
where any worker can fetch them, and (when configured) to this worker's disk tier, whose writer thread
keeps them across restarts. Before a prefill, prefix blocks this engine lacks are read from those tiers
(host, then disk, then Redis: the local disk reads faster than Redis, see docs/BENCHMARKS.md); the worker
places them in its prefix cache in the engine call that admits the request, so the engine computes only
the rest. This happens whatever the routing policy: the worker itself weighs a Redis read against
recomputing (``FetchCost``); its own tiers always win.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.block_events import BlockEvent, BlockRemoved, BlockStored
from engine.engine import Engine
from kvstore.disk_tier import DiskTier
from kvstore.hashing import block_hashes
from kvstore.payload import BlockLayout, BlockTier, HostTier, RedisTier, fetch_prefix
from kvstore.pool import POOL_HOLDER, KVPool
from kvstore.publisher import PoolPublisher
from router.estimator import PrefillModel
from services.background import BackgroundTasks
from services.engine_loop import EngineLoop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedBlocks:
    """Prefix blocks read from the pool or copied from a peer for one prompt, to be placed in the prefix
    cache on the engine thread (in the call that admits the request), and what they cost."""

    source: str  # "pool", or the worker they were copied from
    tensor: torch.Tensor | None  # K/V of blocks first_block .. first_block + n (block axis 2); None: none
    first_block: int = 0
    nbytes: int = 0  # bytes that crossed a link (Redis reads, a peer copy): the router's link fit
    seconds: float = 0.0
    counts: tuple[tuple[str, int], ...] = ()  # blocks per tier ("host", "disk", "redis", "peer"), in order

    @property
    def blocks(self) -> int:
        return 0 if self.tensor is None else self.tensor.shape[2]


class FetchCost:
    """Whether reading blocks from the shared Redis tier beats computing them here: this worker's prefill
    model (its start-up profile) against the read rate it measured on its earlier reads. Until a read was
    measured, reading wins (and measures); without a prefill model it always does."""

    def __init__(self, prefill: PrefillModel | None, block_size: int, block_bytes: int, alpha: float = 0.3):
        self.prefill, self.block_size, self.block_bytes, self.alpha = prefill, block_size, block_bytes, alpha
        self.seconds_per_byte: float | None = None

    def worth_reading(self, first_block: int, num_blocks: int) -> bool:
        if self.prefill is None or self.seconds_per_byte is None:
            return True
        read_s = num_blocks * self.block_bytes * self.seconds_per_byte
        # The marginal cost of those tokens: the rest of the prompt is computed either way.
        compute_s = self.prefill.predict(num_blocks * self.block_size, first_block * self.block_size) \
            - self.prefill.fixed_s
        return read_s < compute_s

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            rate = seconds / nbytes
            old = self.seconds_per_byte
            self.seconds_per_byte = rate if old is None else old + self.alpha * (rate - old)


class PoolLink:
    def __init__(self, redis_url: str, worker_id: str, engine: Engine, redis_max_bytes: int,
                 host_max_bytes: int = 256 << 20, disk_dir: str | None = None,
                 disk_max_bytes: int = 0, prefill_model: PrefillModel | None = None) -> None:
        self.engine = engine
        self.block_size = engine.block_size
        self.pool = KVPool(redis_url, engine.model_id, engine.block_size)
        self.publisher = PoolPublisher(self.pool, worker_id)
        kv = engine.kv_cache  # blocks of another KV format (or dtype, or shape) are misses, never used
        layout = BlockLayout(str(kv.payload_dtype).removeprefix("torch."), kv.block_shape, kv.kv_format)
        self.host = HostTier(engine.model_id, host_max_bytes, layout, *self.publisher.callbacks("host"))
        self.redis = RedisTier(self.pool, redis_max_bytes, layout)
        # Per worker and model, so workers sharing a disk never share files; a restart with the same id
        # finds (and publishes) its blocks again.
        self.disk = None if disk_dir is None else DiskTier(
            Path(disk_dir) / worker_id / f"{engine.model_id}-{engine.block_size}", engine.model_id,
            disk_max_bytes, layout, *self.publisher.callbacks("disk"))
        self._own = [t for t in (self.host, self.disk) if t is not None]  # fastest first; Redis after them
        self.fetch_cost = FetchCost(prefill_model, self.block_size, math.prod(kv.block_shape) * kv.payload_dtype.itemsize)
        self._sharing = BackgroundTasks("a write to the pool's tiers")
        self.publisher.start()

    def publish(self, events: list[BlockEvent]) -> None:
        """Buffer the engine's block events for the pool, in order (a block can be stored, evicted and
        stored again within one batch)."""
        for event in events:
            match event:
                case BlockStored(hashes):
                    self.publisher.on_stored(hashes)
                case BlockRemoved(hashes):
                    self.publisher.on_removed(hashes)

    async def read_prefix(self, prompt_ids: list[int], have: int, salt: bytes) -> FetchedBlocks:
        """Read the prefix blocks after the first ``have`` (this engine's), hashed under ``salt``
        (``Engine.prefix_salt``), from the host, disk and Redis tiers, Redis only where ``fetch_cost`` says
        reading beats recomputing. Only the blocks the engine reuses count: never the last token's (computed
        for its logits), nor a residual it keeps exact."""
        usable = self.engine.reusable_prefix_blocks(len(prompt_ids))
        hashes = block_hashes(prompt_ids[: usable * self.block_size], self.block_size, salt)
        if have >= len(hashes):
            return FetchedBlocks("pool", None)
        reads = [_Read(t, self.fetch_cost if t is self.redis else None, len(hashes)) for t in (*self._own, self.redis)]
        blocks = await asyncio.to_thread(fetch_prefix, hashes[have:], reads)
        shared = reads[-1]
        self.fetch_cost.observe(shared.nbytes, shared.seconds)
        tensor = torch.stack(blocks, dim=2).to(self.engine.device) if blocks else None
        return FetchedBlocks("pool", tensor, have, shared.nbytes, shared.seconds,
                             tuple((r.name, r.blocks) for r in reads if r.blocks))

    async def store_prefix(self, loop: EngineLoop, token_ids: list[int], skip_blocks: int, salt: bytes) -> None:
        """Share the cached full blocks of ``token_ids`` (hashed under ``salt``) after the first ``skip_blocks``
        (those were shared when computed) through the host, Redis and disk tiers: a prompt just computed, or a finished
        sequence's answer, which the next chat turn's prompt carries.

        Only the copy out of the KV cache happens before this returns; the writes to the tiers run in the
        background, off the request's critical path.
        """
        tensor, hashes = await loop.acall(self.engine.export_cached_prefix, token_ids, skip_blocks, None, salt)
        if tensor is None:
            return
        self._sharing.spawn(self._share(tensor, hashes))

    async def wait_shared(self) -> None:
        """Wait until the background writes started so far have reached the tiers."""
        await self._sharing.wait()

    async def _share(self, tensor: torch.Tensor, hashes: list[int]) -> None:
        stored = (await asyncio.to_thread(self.pool.longest_prefix, hashes)).get(POOL_HOLDER, 0)  # already there
        # The disk keeps its own copy of what Redis has (Redis may evict it first); it skips what it holds.
        first = stored if self.disk is None else min(stored, next(
            (i for i, h in enumerate(hashes) if h not in self.disk), len(hashes)))
        if first < len(hashes):
            blocks = list(tensor[:, :, first: len(hashes)].cpu().unbind(2))
            await asyncio.to_thread(self._put, hashes[first:], blocks, stored - first)

    def _put(self, hashes: list[int], blocks: list[torch.Tensor], skip: int) -> None:
        """Blocks to the tiers; the first ``skip`` are in Redis already."""
        if self.disk is not None:
            self.disk.put_blocks(hashes, blocks)  # only queued: the writer thread writes them
        self.host.put_blocks(hashes[skip:], blocks[skip:])
        self.redis.put_blocks(hashes[skip:], blocks[skip:])

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()  # writes what is queued; its last events go out with the publisher's retire
        self.publisher.stop()
        self.pool.close()


class _Read:
    """One tier's part in a ``load_prefix``: the blocks it handed out and, for Redis, the bytes and time
    they took; ``cost`` (Redis only) may decline a read that recomputing would beat."""

    def __init__(self, tier: BlockTier, cost: FetchCost | None, total: int) -> None:
        self.tier, self.cost, self.total = tier, cost, total
        self.name = type(tier).__name__.removesuffix("Tier").lower()
        self.blocks, self.nbytes, self.seconds = 0, 0, 0.0

    def get_prefix(self, hashes: list[int]) -> list[torch.Tensor]:
        first = self.total - len(hashes)  # the prompt block hashes[0] is (the reads continue one run)
        if self.cost is not None and not self.cost.worth_reading(first, len(hashes)):
            return []
        start = time.perf_counter()
        blocks = self.tier.get_prefix(hashes)
        self.seconds += time.perf_counter() - start
        self.blocks += len(blocks)
        self.nbytes += sum(b.numel() * b.element_size() for b in blocks)
        return blocks
