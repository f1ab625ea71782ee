"""The prefill side of the KV handoff: push a request's KV into a decode worker's lease.

``HandoffSender.open`` starts a transfer before the prompt is computed. In layer-wise mode an engine hook
exports layer l of every request whose prompt completes in the running step as soon as that layer is
written, so the bytes leave while later layers compute; otherwise the whole KV is exported after the
first token. A layer-wise transfer takes its stream (or collective pair) only when the first layer is ready,
so a prompt still queued holds nothing on the receiver. A decode worker on the same node may instead map
the whole payload from shared memory (``ipc``: CUDA IPC on GPUs; ``kvstore/transfer/ipc.py``); one that
cannot (another GPU it cannot see, no room in /dev/shm) gets the fallback transport from then on.
A transfer into a lease that still waits for decode room (``PendingLease``) first waits for it
(``DecodeWorker.wait_for_lease``); the KV computed meanwhile leaves in one go once the lease has its
blocks. ``Handoff.finish`` waits for the receiver's ack without holding a thread; ``cancel`` and ``close``
end it on any path.

Collective channels live in a bounded pool (``kvstore/transfer/channel_pool.py``), one per decode worker,
least recently used closed beyond ``max_channels`` (and both ends told); the blocking sends run on a thread
pool of the same bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray
import torch
from ray.exceptions import RayTaskError

from engine.engine import Engine
from kvstore.hashing import block_hashes
from kvstore.transfer import IpcUnavailable, TransferError
from kvstore.transfer.channel_pool import ChannelPool
from kvstore.transfer.collective import CollectiveChannel, backend_for
from kvstore.transfer.grpc import KVTransferClients, PushCall
from kvstore.transfer.ipc import PayloadShare, SegmentPool
from kvstore.transfer.transports import fallback_transport, pick_transport
from kvstore.transfer.wire import LayerFeed, TransferHeader, leave_device
from services.engine_loop import EngineLoop
from services.kv_receiver import kv_payload_shape
from services.messages import KVTarget
from services.worker_client import raised_in_worker

log = logging.getLogger(__name__)


class HandoffSender:
    def __init__(self, worker_id: str, transport: str, layerwise: bool, engine: Engine, loop: EngineLoop,
                 secret: str, max_channels: int = 16, channel_idle_s: float = 300.0) -> None:
        self.worker_id = worker_id
        self.mode = transport
        self.layerwise = layerwise
        self.engine = engine
        self.loop = loop
        self.clients = KVTransferClients(secret)  # the cluster's secret: receivers refuse pushes without it
        # decode worker -> (our end of the pair, its actor, told to close its end when we close ours)
        self.channels: ChannelPool[tuple[CollectiveChannel, object]] = ChannelPool(
            max_channels, channel_idle_s, self._close_pair)
        self.send_threads = ThreadPoolExecutor(max_channels, thread_name_prefix="kv-send")
        self._pair_locks: dict[str, asyncio.Lock] = {}
        self._feeds: dict[str, LayerFeed] = {}  # request -> per-layer feed, filled on the engine thread
        self._layer_lock = threading.Lock()
        # On CUDA, layers bound for gRPC are copied to pinned host memory on this stream (wire.leave_device).
        self._copy_stream = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
        self.node_id = ray.get_runtime_context().get_node_id()
        self._no_ipc: set[str] = set()  # decode workers on this node that could not map our memory
        self.segments = SegmentPool()  # host payloads shared with decode workers on this node
        if transport in ("ipc", "auto"):
            orphans = SegmentPool.remove_orphans()
            if orphans:
                log.warning("removed %d shared-memory segments of dead senders: %s", len(orphans), orphans)
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
                # the table still holds the blocks this step's window passes: only the hand-off's leave
                exported = self.engine.kv_cache.export_layer(layer, [table[i] for i in feed.blocks])
                feed.put(*leave_device(exported, self._copy_stream if feed.to_host else None))
                if layer == self.engine.model_config.num_layers - 1:
                    feed.close()

    def transport_for(self, kv_target: KVTarget) -> str:
        same_node = kv_target.node_id == self.node_id and kv_target.worker_id not in self._no_ipc
        return pick_transport(self.mode, self.engine.device, kv_target.device, same_node)

    def ipc_refused(self, kv_target: KVTarget, exc: IpcUnavailable) -> str:
        """``kv_target`` could not map our memory: it gets the fallback transport from now on (this
        transfer included)."""
        log.warning("KV to %s cannot go through shared memory (%s); using the fallback from now on",
                    kv_target.worker_id, exc)
        self._no_ipc.add(kv_target.worker_id)
        return fallback_transport(self.engine.device, kv_target.device)

    def open(self, request_id: str, prompt_ids: list[int], kv_target: KVTarget, deadline: float, salt: bytes,
             lease: PendingLease | None = None) -> Handoff:
        """A hand-off of ``prompt_ids``' K/V (its blocks hashed under ``salt``) into ``kv_target``'s lease."""
        blocks = self.engine.handoff_blocks(len(prompt_ids))
        kv = self.engine.kv_cache
        transport = self.transport_for(kv_target)
        # A shared payload is copied at memory speed once the prompt is done: nothing left to overlap.
        layerwise = self.layerwise and transport != "ipc"
        header = TransferHeader.describe(
            request_id, self.engine.model_id, kv_payload_shape(self.engine, len(blocks)), kv.payload_dtype,
            block_hashes(prompt_ids, self.engine.block_size, salt), layerwise=layerwise,
            kv_format=kv.kv_format,
        )
        feed = None
        if layerwise:
            feed = _Feed(blocks, to_host=transport == "grpc")
            with self._layer_lock:
                self._feeds[request_id] = feed
        return Handoff(self, header, kv_target, transport, deadline, feed, lease)

    def _forget(self, request_id: str) -> None:
        with self._layer_lock:
            self._feeds.pop(request_id, None)

    def pair_lock(self, decode_id: str) -> asyncio.Lock:
        return self._pair_locks.setdefault(decode_id, asyncio.Lock())

    async def hold_channel(self, kv_target: KVTarget, until: float) -> CollectiveChannel:
        """Our end of the pair with ``kv_target``, held for one transfer until ``release_channel`` (or the
        monotonic ``until``). The decode worker names the channel it holds for us; a different one (it
        evicted ours, or either end broke) replaces ours."""
        self.channels.close_idle()
        decode_id = kv_target.worker_id
        held = self.channels.get(decode_id)
        if held is not None and held[0].broken:
            self._close_pair(decode_id, self.channels.pop(decode_id))
            held = None
        address = await kv_target.actor.collective_address.remote(self.worker_id, until - time.monotonic(),
                                                                   held is None)
        if held is None or held[0].init_method != address:
            if held is not None:
                self.channels.pop(decode_id)[0].close()  # the decode worker already replaced its end
            held = (CollectiveChannel("prefill", address, backend_for(self.engine.device), device=self.engine.device),
                    kv_target.actor)
        self.channels.hold(decode_id, held, until)
        return held[0]

    def release_channel(self, decode_id: str, channel: CollectiveChannel) -> None:
        held = self.channels.get(decode_id)
        if held is not None and held[0] is channel:
            self.channels.release(decode_id, held)
            if channel.broken:  # out of step after a failure: the next transfer opens a new pair
                self._close_pair(decode_id, self.channels.pop(decode_id))

    def _close_pair(self, decode_id: str, pair: tuple[CollectiveChannel, object]) -> None:
        channel, actor = pair
        channel.close()
        actor.close_collective.remote(self.worker_id)  # fire and forget: a dead peer has nothing to close


class PendingLease:
    """A decode lease still waiting for room (``DecodeWorker.reserve`` returned False). ``at_head`` ends when
    it is first in line for blocks (or has them): the prefill worker computes the prompt from then on;
    ``granted`` ends when it has them, and the KV push waits for it. Either raises the decode worker's reason
    when the lease will never come (OutOfBlocksError: no room in time; ReservationReleased)."""

    def __init__(self, kv_target: KVTarget, request_id: str, deadline: float) -> None:
        self.at_head = self._start(kv_target, request_id, deadline, at_head=True)
        self.granted = self._start(kv_target, request_id, deadline, at_head=False)

    @staticmethod
    def _start(kv_target: KVTarget, request_id: str, deadline: float, at_head: bool) -> asyncio.Future:
        async def wait() -> None:
            try:
                await kv_target.actor.wait_for_lease.remote(request_id, max(0.001, deadline - time.monotonic()),
                                                            at_head)
            except RayTaskError as exc:  # the decode worker's own exception, not Ray's stand-in
                raise raised_in_worker(exc) from exc

        task = asyncio.ensure_future(wait())
        # Read a failure even when nobody awaits it (the prefill ended another way): no "never retrieved".
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return task

    def close(self) -> None:
        self.at_head.cancel()
        self.granted.cancel()


class _Feed(LayerFeed):
    """A LayerFeed that also tells the actor's event loop when its first layer is ready."""

    def __init__(self, blocks: list[int], to_host: bool) -> None:
        super().__init__()
        # blocks: the table indices the hand-off carries; to_host: the layers leave through host memory
        self.blocks, self.to_host = blocks, to_host
        self._loop = asyncio.get_running_loop()
        self.first_layer = asyncio.Event()

    def put(self, layer: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        super().put(layer, ready)
        if not self.first_layer.is_set():
            self._loop.call_soon_threadsafe(self.first_layer.set)

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        self._loop.call_soon_threadsafe(self.first_layer.set)


class Handoff:
    """One request's transfer: started at ``open`` (layer-wise) or ``finish``, ended by ``close``."""

    def __init__(self, sender: HandoffSender, header: TransferHeader, kv_target: KVTarget, transport: str,
                 deadline: float, feed: _Feed | None, lease: PendingLease | None) -> None:
        self.sender, self.header, self.kv_target, self.deadline, self.feed = sender, header, kv_target, deadline, feed
        self.transport = transport
        self.lease = lease
        self._push: PushCall | None = None
        self._started = time.perf_counter()
        self._sending: asyncio.Task | None = None
        if feed is not None:
            self._begin(feed)

    def _begin(self, payload) -> None:
        self._sending = asyncio.create_task(self._send(payload))
        # Read a failure even when nobody awaits it (the prefill ended another way): no "never retrieved".
        self._sending.add_done_callback(lambda task: task.cancelled() or task.exception())

    def _remaining(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    async def _send(self, payload) -> None:
        if self.lease is not None:  # the decode reservation waits for room: the KV waits here for it
            await asyncio.shield(self.lease.granted)  # (shielded: a cancelled send leaves the prefill's wait)
        if self.transport == "ipc":
            try:
                return await self._share(payload)
            except IpcUnavailable as exc:  # nothing was written: the same KV goes the other way
                self.transport = self.sender.ipc_refused(self.kv_target, exc)
        if self.feed is not None:  # nothing is opened on the receiver while the prompt waits to be computed
            await self.feed.first_layer.wait()
        if self.transport == "grpc":
            self._started = time.perf_counter()
            client = self.sender.clients.get(self.kv_target.grpc_address)
            self._push = client.start_push(self.header, payload, self._remaining())
            await self._push.wait()
            return
        # A pair carries one transfer at a time, and both ends must take them in the same order: the
        # sender holds the pair from the first computed layer until the receiver has every byte.
        decode_id = self.kv_target.worker_id
        async with self.sender.pair_lock(decode_id):
            self._started = time.perf_counter()
            channel = await self.sender.hold_channel(self.kv_target, self.deadline)
            try:
                receive = self.kv_target.actor.receive_collective.remote(
                    self.sender.worker_id, self.header, self._remaining())
                send = asyncio.get_running_loop().run_in_executor(
                    self.sender.send_threads, channel.send, self.header, payload, self._remaining())
                # Both ends finish before the pair is released (a refusing receiver ends the pair, so the
                # send stops at once); the receiver's failure says why, so it is raised first.
                sent, received = await asyncio.gather(send, receive, return_exceptions=True)
                for outcome in (received, sent):
                    if isinstance(outcome, BaseException):
                        raise outcome
            finally:
                self.sender.release_channel(decode_id, channel)

    async def _share(self, payload: torch.Tensor) -> None:
        """Hand the payload over in shared memory: the decode worker copies it into the lease and returns."""
        self._started = time.perf_counter()
        making = asyncio.get_running_loop().run_in_executor(self.sender.send_threads, PayloadShare, payload,
                                                            self.sender.segments)
        try:
            share = await asyncio.shield(making)
        except asyncio.CancelledError:  # the share is still being made: close it once it exists
            making.add_done_callback(lambda made: made.cancelled() or made.exception() or made.result().close())
            raise
        with share:  # closed after the receiver's return (an ack) or failure: ipc.py's lifetime rule
            await self.kv_target.actor.receive_shared.remote(self.header, share.shared)

    async def finish(self) -> tuple[int, float, float]:
        """Wait until the receiver has the KV; (bytes, seconds since the transfer started, seconds the
        bytes were moving: less the waits for layers still being computed, which are no link's time)."""
        if self._sending is None:  # whole-request mode: export now that the prompt is computed
            engine = self.sender.engine
            num_blocks = self.header.shape[2] - engine.kv_cache.window_columns  # the rest: the window
            tensor = await self.sender.loop.acall(
                lambda: engine.kv_cache.export_blocks(engine.request_block_ids(self.header.request_id)
                                                      [:num_blocks]))
            self._begin(tensor)
        await self._sending
        seconds = time.perf_counter() - self._started
        return self.header.total_bytes, seconds, seconds - (self.feed.waited_s if self.feed is not None else 0.0)

    def cancel(self) -> None:
        if self.feed is not None:
            self.feed.fail(TransferError("prefill ended before its KV was complete"))
        if self._push is not None:
            self._push.cancel()
        if self._sending is not None:
            self._sending.cancel()

    def close(self) -> None:
        self.sender._forget(self.header.request_id)
