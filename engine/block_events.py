"""Block events: full blocks registered in, or evicted from, the block manager's prefix cache.

Plain data queued in the order it happens (as vLLM v1's block pool does) and handed out by
``BlockManager.take_events``; the worker forwards them to the KV pool, so the engine never calls out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    hashes: list[int]  # chain hashes (``kvstore.hashing``) of blocks now findable in the prefix cache


@dataclass(frozen=True)
class BlockRemoved:
    hashes: list[int]  # chain hashes of cached blocks that were evicted (overwritten)


BlockEvent = BlockStored | BlockRemoved
