"""A worker's link to the KV pool: publish its block events, share computed prefixes, load missing ones.

``publish`` (the engine loop's block-event sink) only buffers the engine's block events (the publisher
thread sends them in batches), so a step never waits on Redis. After a prefill the request's full blocks
go to the host tier, to the Redis tier, where any worker can fetch them, and (when configured) to this
worker's disk tier, whose writer thread keeps them across restarts; before a prefill, prefix blocks this
engine lacks are taken from those tiers (host, then disk, then Redis: the local disk reads faster than
Redis, see docs/BENCHMARKS.md) and placed in its prefix cache, so the engine computes only the rest.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from engine.block_events import BlockEvent, BlockRemoved, BlockStored
from engine.engine import Engine
from kvstore.disk_tier import DiskTier
from kvstore.hashing import block_hashes, salt_for
from kvstore.payload import BlockLayout, HostTier, RedisTier, fetch_prefix
from kvstore.pool import POOL_HOLDER, KVPool
from kvstore.publisher import PoolPublisher
from services.engine_loop import EngineLoop

log = logging.getLogger(__name__)


class PoolLink:
    def __init__(self, redis_url: str, worker_id: str, engine: Engine, redis_max_bytes: int,
                 host_max_bytes: int = 256 << 20, disk_dir: str | None = None,
                 disk_max_bytes: int = 0) -> None:
        self.engine = engine
        self.block_size = engine.block_size
        self._salt = salt_for(engine.model_id)
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
        self._tiers = [t for t in (self.host, self.disk, self.redis) if t is not None]  # fastest first
        self._sharing: set[asyncio.Task] = set()  # background writes to the tiers
        self.hit_tokens: dict[str, int] = {}  # prompt tokens placed from each tier ("host", ...), for the metrics
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

    async def load_prefix(self, loop: EngineLoop, prompt_ids: list[int], shared: bool = True) -> int:
        """Place prefix blocks this engine lacks from the host/disk/Redis tiers; returns how many were placed.
        ``shared=False`` leaves out the Redis tier: only this worker's own tiers, which the pool index lists
        under its name and the router counts as its local prefix.

        Only blocks before the prompt's last token count: that token is always computed for its logits.
        """
        usable = (len(prompt_ids) - 1) // self.block_size
        hashes = block_hashes(prompt_ids[: usable * self.block_size], self.block_size, self._salt)
        own = [t for t in self._tiers if t is not self.redis]
        if not shared and not any(h in t for t in own for h in hashes):
            return 0  # nothing to place: spare the engine thread the prefix lookup
        local = await loop.acall(self.engine.cached_prefix_len, prompt_ids) // self.block_size
        if local >= len(hashes):
            return 0
        served: dict[str, int] = {}
        tiers = [_Counted(t, served) for t in (self._tiers if shared else own)]
        blocks = await asyncio.to_thread(fetch_prefix, hashes[local:], tiers)
        if not blocks:
            return 0
        placed = await loop.acall(self._place, prompt_ids, local, blocks)
        if placed:
            for tier, n in served.items():
                self.hit_tokens[tier] = self.hit_tokens.get(tier, 0) + n * self.block_size
        return placed

    def _place(self, prompt_ids: list[int], local: int, blocks: list[torch.Tensor]) -> int:
        """Engine thread: insert fetched blocks after the ``local`` cached ones, if those are still cached."""
        if self.engine.cached_prefix_len(prompt_ids) // self.block_size < local:
            return 0  # evicted meanwhile: the fetched blocks no longer continue a cached chain
        fetched = torch.stack(blocks, dim=2).to(self.engine.device)
        shape = list(fetched.shape)
        shape[2] += local
        full = torch.empty(shape, dtype=fetched.dtype, device=fetched.device)
        full[:, :, local:] = fetched  # the first ``local`` blocks are cached already and are not placed
        return self.engine.insert_cached_blocks(prompt_ids[: shape[2] * self.block_size], full)

    async def store_request_blocks(self, loop: EngineLoop, request_id: str) -> None:
        """Share a prefilled request's full blocks through the host, Redis and disk tiers.

        Only the copy out of the KV cache happens before this returns (the request still holds its blocks);
        the writes to the tiers run in the background, off the request's critical path.
        """
        engine = self.engine
        tensor, hashes = await loop.acall(lambda: engine.export_blocks(engine.request_block_ids(request_id)))
        task = asyncio.create_task(self._share(tensor, hashes))
        self._sharing.add(task)
        task.add_done_callback(self._sharing.discard)

    async def wait_shared(self) -> None:
        """Wait until the background writes started so far have reached the tiers."""
        while self._sharing:
            await asyncio.gather(*self._sharing, return_exceptions=True)

    async def _share(self, tensor: torch.Tensor, hashes: list[int]) -> None:
        stored = self.pool.longest_prefix(hashes).get(POOL_HOLDER, 0)  # leading blocks the tier already has
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


class _Counted:
    """A tier that counts the blocks it hands out, by tier name ("host" for HostTier, ...)."""

    def __init__(self, tier, served: dict[str, int]) -> None:
        self.tier, self.served = tier, served
        self.name = type(tier).__name__.removesuffix("Tier").lower()

    def get_prefix(self, hashes: list[int]) -> list[torch.Tensor]:
        blocks = self.tier.get_prefix(hashes)
        self.served[self.name] = self.served.get(self.name, 0) + len(blocks)
        return blocks
