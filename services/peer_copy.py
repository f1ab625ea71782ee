"""Copying cached prefix blocks between workers over the KV transfer layer: peer fetch and replication.

The worker that lacks a prefix another worker holds (a prefill or colocated worker: the taker) expects a
transfer under a fresh id in a ``TensorSink`` served by a KV transfer server of its own, and asks the
holder (any worker: what its prefix cache holds) to push those blocks there, with the cluster's secret,
the checksums and the deadlines of the KV hand-off. The holder may still be computing them (the router
saw that prefill in flight): it waits up to ``wait_s`` for them, then sends the longest run it has. The
header's block hashes must continue the taker's cached chain exactly, so a block evicted meanwhile only
shortens the copy, and anything else is refused, never placed. Received blocks go into the taker's
prefix cache as blocks read from the pool are; a copy that fails leaves the prompt to be computed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import torch

from engine.engine import Engine
from kvstore.hashing import block_hashes
from kvstore.transfer import TransferRejected
from kvstore.transfer.grpc import KVTransferClients, KVTransferServer
from kvstore.transfer.sink import TensorSink
from kvstore.transfer.wire import TransferHeader
from services.engine_loop import EngineLoop
from services.messages import PrefixFetch
from services.pool_link import FetchedBlocks

log = logging.getLogger(__name__)

_POLL_S = 0.02  # how often a holder looks whether the blocks it is computing are cached yet
_CALL_SLACK_S = 5.0  # the holder's call may take this long beyond its wait and transfer deadline


class PrefixCopier:
    """A worker's two sides of prefix copies: ``push`` (as a holder; every worker) and ``take`` (as the
    taker; only with ``host``: the address its transfer server binds and peers push to)."""

    def __init__(self, engine: Engine, loop: EngineLoop, secret: str, host: str | None) -> None:
        self.engine, self.loop = engine, loop
        self.clients = KVTransferClients(secret)
        self.sink = TensorSink()
        self._server = None if host is None else KVTransferServer(self.sink, host=host, secret=secret).start()

    @property
    def address(self) -> str | None:
        return None if self._server is None else self._server.target

    # ---- the taker -----------------------------------------------------------------------------------
    async def take(self, token_ids: list[int], fetch: PrefixFetch, have: int, timeout_s: float,
                   salt: bytes) -> FetchedBlocks:
        """Copy the blocks of ``token_ids`` (hashed under ``salt``, as ``fetch.salt`` should say) after the first
        ``have`` (this engine's) that ``fetch.source`` holds (never the block of the last token, which is
        computed for its logits, nor a residual the engine keeps exact); placing them is the caller's, on the
        engine thread. A copy that fails gives no blocks: they are computed instead."""
        size = self.engine.block_size
        usable = self.engine.reusable_prefix_blocks(len(token_ids))
        if self._server is None or min(fetch.blocks, usable) <= have:
            return FetchedBlocks(fetch.source, None)
        # The router knows the holder has fetch.blocks (in-flight prompts are tracked coarsely); it sends
        # whatever longer run it has.
        expected = block_hashes(token_ids[: usable * size], size, salt)[have:]
        copy_id = f"copy-{uuid.uuid4().hex}"
        self.sink.expect_sized(copy_id, lambda header: self._destination(header, expected))
        try:
            sent, seconds = await asyncio.wait_for(
                fetch.actor.push_prefix.remote(copy_id, token_ids[: usable * size], have,
                                               min(fetch.blocks, usable), self.address, fetch.wait_s, timeout_s,
                                               fetch.salt),
                fetch.wait_s + timeout_s + _CALL_SLACK_S)
            if not sent:
                return FetchedBlocks(fetch.source, None)
            tensor = self.sink.wait(copy_id, 0.0).tensor  # committed before the holder's push was acknowledged
        except Exception as exc:  # a dead, slow or evicting holder: the prompt is computed instead
            log.warning("prefix copy from %s failed, computing those tokens: %r", fetch.source, exc)
            return FetchedBlocks(fetch.source, None)
        finally:
            self.sink.forget(copy_id)
        return FetchedBlocks(fetch.source, tensor.to(self.engine.device), have,
                             tensor.numel() * tensor.element_size(), seconds, (("peer", sent),))

    def _destination(self, header: TransferHeader, expected: list[int]) -> torch.Tensor:
        """Where a pushed copy lands, once its header proved it continues this engine's chain."""
        kv, n = self.engine.kv_cache, len(header.block_hashes)
        shape = list(kv.payload_shape(n))
        shape[2] = n  # blocks only: no window columns
        if header.model != self.engine.model_id or header.kv_format != kv.kv_format \
                or header.torch_dtype != kv.payload_dtype or list(header.shape) != shape:
            raise TransferRejected(f"{header.request_id}: expected {self.engine.model_id} {kv.kv_format} "
                                   f"{kv.payload_dtype} {shape}, got {header.model} {header.kv_format} "
                                   f"{header.dtype} {list(header.shape)}")
        if not 0 < n <= len(expected) or header.block_hashes != expected[:n]:
            raise TransferRejected(f"{header.request_id}: the blocks do not continue this worker's prefix")
        return torch.empty(header.shape, dtype=header.torch_dtype)

    # ---- the holder ----------------------------------------------------------------------------------
    async def push(self, copy_id: str, token_ids: list[int], skip_blocks: int, wait_blocks: int, address: str,
                   wait_s: float, timeout_s: float, salt: bytes) -> tuple[int, float]:
        """Push the cached full blocks of ``token_ids`` (hashed under ``salt``) after the first ``skip_blocks``
        to ``address``, waiting up to ``wait_s`` until ``wait_blocks`` are cached (a prefill of them may be
        running); returns how many were sent (0: none) and the seconds the transfer took (the wait left out:
        the router learns the link from it)."""
        engine = self.engine
        want = wait_blocks * engine.block_size
        until = time.monotonic() + wait_s
        while engine.cached_prefix_len(token_ids, salt) < want and time.monotonic() < until:  # lock-free reads
            await asyncio.sleep(_POLL_S)
        tensor, hashes = await self.loop.acall(engine.export_cached_prefix, token_ids, skip_blocks, None, salt)
        if tensor is None:
            return 0, 0.0
        header = TransferHeader.describe(copy_id, engine.model_id, tensor.shape, tensor.dtype, hashes,
                                         kv_format=engine.kv_cache.kv_format)
        start = time.perf_counter()
        await asyncio.to_thread(self.clients.get(address).push, header, tensor, timeout_s)
        return len(hashes), time.perf_counter() - start
