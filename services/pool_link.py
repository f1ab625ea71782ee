"""A worker's link to the KV pool: publish its block events, share computed prefixes, load missing ones.

``publish`` (the engine loop's block-event sink) only buffers the engine's block events (the publisher
thread sends them in batches), so a step never waits on Redis. After a prefill the request's full blocks
go to the host tier and to the Redis tier, where any worker can fetch them; before a prefill, prefix
blocks this engine lacks are taken from those tiers and placed in its prefix cache, so the engine
computes only the rest.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from engine.block_events import BlockEvent, BlockRemoved, BlockStored
from engine.engine import Engine
from kvstore.hashing import block_hashes, salt_for
from kvstore.payload import BlockLayout, HostTier, RedisTier, fetch_prefix
from kvstore.pool import POOL_HOLDER, KVPool
from kvstore.publisher import PoolPublisher
from services.engine_loop import EngineLoop

log = logging.getLogger(__name__)


class PoolLink:
    def __init__(self, redis_url: str, worker_id: str, engine: Engine, redis_max_bytes: int,
                 host_max_bytes: int = 256 << 20) -> None:
        self.engine = engine
        self.block_size = engine.block_size
        self._salt = salt_for(engine.model_id)
        self.pool = KVPool(redis_url, engine.model_id, engine.block_size)
        self.publisher = PoolPublisher(self.pool, worker_id)
        cfg = engine.model_config
        layout = BlockLayout(str(engine.kv_cache.dtype).removeprefix("torch."),
                             (cfg.num_layers, 2, engine.block_size, cfg.num_kv_heads, cfg.head_dim))
        self.host = HostTier(engine.model_id, host_max_bytes, layout, *self.publisher.callbacks("host"))
        self.redis = RedisTier(self.pool, redis_max_bytes, layout)
        self._sharing: set[asyncio.Task] = set()  # background writes to the tiers
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

    async def load_prefix(self, loop: EngineLoop, prompt_ids: list[int]) -> int:
        """Place prefix blocks this engine lacks from the host/Redis tiers; returns how many were placed.

        Only blocks before the prompt's last token count: that token is always computed for its logits.
        """
        usable = (len(prompt_ids) - 1) // self.block_size
        hashes = block_hashes(prompt_ids[: usable * self.block_size], self.block_size, self._salt)
        local = await loop.acall(self.engine.cached_prefix_len, prompt_ids) // self.block_size
        if local >= len(hashes):
            return 0
        blocks = await asyncio.to_thread(fetch_prefix, hashes[local:], [self.host, self.redis])
        if not blocks:
            return 0
        return await loop.acall(self._place, prompt_ids, local, blocks)

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
        """Share a prefilled request's full blocks through the host and Redis tiers.

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
        if stored < len(hashes):
            blocks = list(tensor[:, :, stored: len(hashes)].cpu().unbind(2))
            await asyncio.to_thread(self._put, hashes[stored:], blocks)

    def _put(self, hashes: list[int], blocks: list[torch.Tensor]) -> None:
        self.host.put_blocks(hashes, blocks)
        self.redis.put_blocks(hashes, blocks)

    def close(self) -> None:
        self.publisher.stop()
        self.pool.close()
