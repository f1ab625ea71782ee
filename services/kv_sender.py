"""The prefill side of the KV handoff: push a request's KV into a decode worker's lease.

``HandoffSender.open`` starts a transfer before the prompt is computed. In layer-wise mode an engine hook
exports layer l of every request whose prompt completes in the running step as soon as that layer is
written, so the bytes leave while later layers compute; otherwise the whole KV is exported after the
first token. ``Handoff.finish`` waits for the receiver's ack; ``cancel`` and ``close`` end it on any path.
"""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from engine.engine import Engine
from kvstore.hashing import block_hashes, salt_for
from kvstore.transfer import PeerLost, TransferError
from kvstore.transfer.collective import CollectiveChannel, backend_for, pick_transport
from kvstore.transfer.grpc import KVTransferClients, PushCall
from kvstore.transfer.wire import LayerFeed, TransferHeader
from services.engine_loop import EngineLoop
from services.kv_receiver import kv_payload_shape
from services.messages import KVTarget


class HandoffSender:
    def __init__(self, worker_id: str, transport: str, layerwise: bool, engine: Engine, loop: EngineLoop,
                 secret: str) -> None:
        self.worker_id = worker_id
        self.mode = transport
        self.layerwise = layerwise
        self.engine = engine
        self.loop = loop
        self._salt = salt_for(engine.model_id)
        self.clients = KVTransferClients(secret)  # the cluster's secret: receivers refuse pushes without it
        self._channels: dict[str, CollectiveChannel] = {}
        self._pair_locks: dict[str, asyncio.Lock] = {}
        self._feeds: dict[str, LayerFeed] = {}  # request -> per-layer feed, filled on the engine thread
        self._layer_lock = threading.Lock()
        if layerwise:
            loop.add_layer_hook(self._on_layer_done)

    def _on_layer_done(self, layer: int, completing: dict[str, list[int]]) -> None:
        """Engine thread, inside a step: ship layer ``layer`` of every prompt that completes in it
        (``completing``: request id -> block table)."""
        with self._layer_lock:
            for request_id, table in completing.items():
                feed = self._feeds.get(request_id)
                if feed is None:
                    continue
                feed.put(self.engine.kv_cache.export_layer(layer, table[: feed.num_blocks]))
                if layer == self.engine.model_config.num_layers - 1:
                    feed.close()

    def transport_for(self, kv_target: KVTarget) -> str:
        return pick_transport(self.mode, self.engine.device, kv_target.device)

    def open(self, request_id: str, prompt_ids: list[int], kv_target: KVTarget, deadline: float) -> Handoff:
        num_blocks = -(-len(prompt_ids) // self.engine.block_size)
        kv = self.engine.kv_cache
        header = TransferHeader.describe(
            request_id, self.engine.model_id, kv_payload_shape(self.engine, num_blocks), kv.payload_dtype,
            block_hashes(prompt_ids, self.engine.block_size, self._salt), layerwise=self.layerwise,
            kv_format=kv.kv_format,
        )
        feed = None
        if self.layerwise:
            feed = _Feed(num_blocks)
            with self._layer_lock:
                self._feeds[request_id] = feed
        return Handoff(self, header, kv_target, deadline, feed)

    def _forget(self, request_id: str) -> None:
        with self._layer_lock:
            self._feeds.pop(request_id, None)

    def pair_lock(self, decode_id: str) -> asyncio.Lock:
        return self._pair_locks.setdefault(decode_id, asyncio.Lock())

    def drop_channel(self, decode_id: str) -> None:
        channel = self._channels.pop(decode_id, None)
        if channel is not None:
            channel.close()

    async def channel(self, kv_target: KVTarget) -> CollectiveChannel:
        decode_id = kv_target.worker_id
        channel = self._channels.get(decode_id)
        if channel is None:
            init_method = await kv_target.actor.open_collective.remote(self.worker_id)
            channel = CollectiveChannel("prefill", init_method, backend_for(self.engine.device),
                                        device=self.engine.device)
            self._channels[decode_id] = channel
        return channel


class _Feed(LayerFeed):
    """A LayerFeed that also tells the actor's event loop when its first layer is ready."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.num_blocks = num_blocks
        self._loop = asyncio.get_running_loop()
        self.first_layer = asyncio.Event()

    def put(self, layer: torch.Tensor) -> None:
        super().put(layer)
        if not self.first_layer.is_set():
            self._loop.call_soon_threadsafe(self.first_layer.set)

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        self._loop.call_soon_threadsafe(self.first_layer.set)


class Handoff:
    """One request's transfer: started at ``open``, awaited with ``finish``, ended by ``close``."""

    def __init__(self, sender: HandoffSender, header: TransferHeader, kv_target: KVTarget, deadline: float,
                 feed: _Feed | None) -> None:
        self.sender, self.header, self.kv_target, self.deadline, self.feed = sender, header, kv_target, deadline, feed
        self.transport = sender.transport_for(kv_target)
        self._push: PushCall | None = None
        self._collective: asyncio.Task | None = None
        self._started = time.perf_counter()
        if feed is not None:
            self._start(feed)

    def _remaining(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    def _start(self, payload) -> None:
        self._started = time.perf_counter()
        if self.transport == "grpc":
            client = self.sender.clients.get(self.kv_target.grpc_address)
            self._push = client.start_push(self.header, payload, self._remaining())
        else:
            self._collective = asyncio.create_task(self._send_collective(payload))

    async def _send_collective(self, payload) -> None:
        # A pair carries one transfer at a time, and both ends must take them in the same order: the
        # sender holds the pair from the first computed layer until the receiver has every byte.
        if self.feed is not None:
            await self.feed.first_layer.wait()
        async with self.sender.pair_lock(self.kv_target.worker_id):
            self._started = time.perf_counter()
            channel = await self.sender.channel(self.kv_target)
            receive = self.kv_target.actor.receive_collective.remote(
                self.sender.worker_id, self.header, self._remaining())
            send = asyncio.to_thread(channel.send, self.header, payload, self._remaining())
            try:
                await asyncio.gather(send, receive)
            except PeerLost:
                self.sender.drop_channel(self.kv_target.worker_id)  # the next transfer opens a new pair
                raise

    async def finish(self) -> tuple[int, float, float]:
        """Wait until the receiver has the KV; (bytes, seconds since the transfer started, seconds the
        bytes were moving: less the waits for layers still being computed, which are no link's time)."""
        if self.feed is None:  # whole-request mode: export now that the prompt is computed
            engine = self.sender.engine
            num_blocks = self.header.shape[2] - engine.kv_cache.window_columns  # the rest: the window
            tensor = await self.sender.loop.acall(
                lambda: engine.kv_cache.export_blocks(engine.request_block_ids(self.header.request_id)
                                                      [:num_blocks]))
            self._start(tensor)
        if self._push is not None:
            await asyncio.to_thread(self._push.result)
        else:
            await self._collective
        seconds = time.perf_counter() - self._started
        return self.header.total_bytes, seconds, seconds - (self.feed.waited_s if self.feed is not None else 0.0)

    def cancel(self) -> None:
        if self.feed is not None:
            self.feed.fail(TransferError("prefill ended before its KV was complete"))
        if self._push is not None:
            self._push.cancel()
        if self._collective is not None:
            self._collective.cancel()

    def close(self) -> None:
        self.sender._forget(self.header.request_id)
