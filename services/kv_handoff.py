"""The KV handoff between a prefill worker and a decode worker's lease, over gRPC or a collective.

Sender (prefill side): ``HandoffSender.open`` starts a transfer before the prompt is computed. In
layer-wise mode an engine hook exports layer l of every request whose prompt completes in the running
step as soon as that layer is written, so the bytes leave while later layers compute; otherwise the
whole KV is exported after the first token. ``Handoff.finish`` waits for the receiver's ack.

Receiver (decode side): ``HandoffReceiver`` holds the leases (blocks reserved per request, with a
deadline). A transfer is accepted only for a live, unfilled lease whose shape matches; its bytes land in a
staging tensor and are imported into the reserved blocks only after the checksum matched, so a corrupt or
cut transfer never reaches the KV cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass

import ray
import torch

from engine.engine import Engine
from kvstore.hashing import block_hashes, salt_for
from kvstore.transfer import PeerLost, TransferError, TransferRejected
from kvstore.transfer.collective import CollectiveChannel, backend_for, pick_transport
from kvstore.transfer.grpc import KVTransferClient, KVTransferServer, PushCall
from kvstore.transfer.wire import LayerFeed, TransferHeader, as_bytes
from services.engine_loop import EngineLoop


def _payload_shape(engine: Engine, num_blocks: int) -> tuple[int, ...]:
    cfg = engine.model_config
    return (cfg.num_layers, 2, num_blocks, engine.block_size, cfg.num_kv_heads, cfg.head_dim)


# ---- decode side ----------------------------------------------------------------------------------------------
@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    deadline: float
    filled: bool = False
    busy: bool = False  # a transfer into it is in flight


class HandoffReceiver:
    """The decode worker's leases and its KV endpoints (a gRPC server; collective channels on demand)."""

    def __init__(self, worker_id: str, engine: Engine, loop: EngineLoop) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.loop = loop
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._channels: dict[str, CollectiveChannel] = {}
        self._node = ray.util.get_node_ip_address()
        # Bound to every interface on a cluster node; the address others use is the node's own.
        self._server = KVTransferServer(self, host="0.0.0.0" if self._node != "127.0.0.1" else "127.0.0.1")
        self._server.start()

    def target(self) -> dict:
        return {"worker_id": self.worker_id, "grpc": f"{self._node}:{self._server.port}",
                "device": str(self.engine.device), "actor": ray.get_runtime_context().current_actor}

    def stop(self) -> None:
        self._server.stop()
        for channel in self._channels.values():
            channel.close()

    # leases (called from the actor's event loop)
    def add_lease(self, request_id: str, block_ids: list[int], deadline: float) -> None:
        with self._lock:
            self._leases[request_id] = Lease(request_id, block_ids, deadline)

    def take_filled_lease(self, request_id: str) -> Lease:
        """Hand a filled lease to the batch; it stops being a lease (the request owns its blocks now)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or not lease.filled:
                raise TransferRejected(f"no filled KV lease for {request_id!r}")
            del self._leases[request_id]
        return lease

    def drop_lease(self, request_id: str) -> bool:
        """Forget a lease that never joined the batch; True when there was one (its blocks must be freed)."""
        with self._lock:
            return self._leases.pop(request_id, None) is not None

    def expired_leases(self, now: float) -> list[str]:
        with self._lock:
            return [rid for rid, lease in self._leases.items() if lease.deadline < now and not lease.busy]

    # transfers (called from gRPC threads or worker threads)
    def _claim(self, header: TransferHeader) -> Lease:
        expected = _payload_shape(self.engine, 0)
        with self._lock:
            lease = self._leases.get(header.request_id)
            if lease is None or lease.filled or lease.busy:
                raise TransferRejected(f"no open KV lease for request {header.request_id!r}")
            shape = expected[:2] + (len(lease.block_ids),) + expected[3:]
            if header.model != self.engine.model_id or header.shape != shape \
                    or header.torch_dtype != self.engine.kv_cache.dtype:
                raise TransferRejected(
                    f"{header.request_id}: expected {self.engine.model_id} {self.engine.kv_cache.dtype} "
                    f"{list(shape)}, got {header.model} {header.dtype} {list(header.shape)}")
            lease.busy = True
        return lease

    def _fill(self, lease: Lease, staging: torch.Tensor | None) -> None:
        """Import verified bytes into the lease's blocks (or release the claim when ``staging`` is None)."""
        try:
            if staging is not None:
                self.loop.call(self.engine.import_blocks, lease.block_ids, staging).result()
        finally:
            with self._lock:
                lease.busy = False
                lease.filled = staging is not None

    def begin(self, header: TransferHeader) -> _LeaseWriter:  # KVSink, for the gRPC server
        lease = self._claim(header)
        return _LeaseWriter(self, lease, torch.empty(header.shape, dtype=header.torch_dtype))

    def open_collective(self, prefill_id: str) -> str:
        """A channel for one prefill worker (replacing a broken one); returns its ``tcp://`` address."""
        old = self._channels.pop(prefill_id, None)
        if old is not None:
            old.close()
        channel = CollectiveChannel("decode", f"tcp://{self._node}:0", backend_for(self.engine.device),
                                    device=self.engine.device)
        self._channels[prefill_id] = channel
        return channel.init_method

    def receive_collective(self, prefill_id: str, header: TransferHeader, timeout_s: float) -> int:
        channel = self._channels.get(prefill_id)
        if channel is None:
            raise TransferRejected(f"no collective channel from {prefill_id}")
        lease = self._claim(header)
        staging = None
        try:
            staging = channel.recv(header, timeout_s=timeout_s)
        finally:
            self._fill(lease, staging)
        return header.total_bytes


class _LeaseWriter:
    """Receives one gRPC transfer into host staging; imports into the lease's blocks on commit."""

    def __init__(self, receiver: HandoffReceiver, lease: Lease, staging: torch.Tensor) -> None:
        self._receiver, self._lease, self._staging = receiver, lease, staging
        self._bytes = as_bytes(staging)

    def write(self, offset: int, data: memoryview) -> None:
        self._bytes[offset:offset + len(data)] = data

    def commit(self) -> None:
        self._receiver._fill(self._lease, self._staging.to(self._receiver.engine.device))

    def abort(self, reason: str) -> None:
        self._receiver._fill(self._lease, None)


# ---- prefill side ---------------------------------------------------------------------------------------------
class HandoffSender:
    def __init__(self, worker_id: str, transport: str, layerwise: bool, engine: Engine, loop: EngineLoop) -> None:
        self.worker_id = worker_id
        self.mode = transport
        self.layerwise = layerwise
        self.engine = engine
        self.loop = loop
        self._salt = salt_for(engine.model_id)
        self._clients: dict[str, KVTransferClient] = {}
        self._channels: dict[str, CollectiveChannel] = {}
        self._pair_locks: dict[str, asyncio.Lock] = {}
        self._feeds: dict[str, LayerFeed] = {}  # request -> per-layer feed, filled on the engine thread
        self._layer_lock = threading.Lock()
        if layerwise:
            loop.add_layer_hook(self._on_layer_done)

    def _on_layer_done(self, layer: int) -> None:
        """Engine thread, inside a step: ship layer ``layer`` of every prompt that completes in it."""
        with self._layer_lock:
            for request_id, table in self.engine.prefill_completing.items():
                feed = self._feeds.get(request_id)
                if feed is None:
                    continue
                feed.put(self.engine.kv_cache.export_layer(layer, table[: feed.num_blocks]))
                if layer == self.engine.model_config.num_layers - 1:
                    feed.close()

    def transport_for(self, kv_target: dict) -> str:
        return pick_transport(self.mode, self.engine.device, kv_target["device"])

    def open(self, request_id: str, prompt_ids: list[int], kv_target: dict, deadline: float) -> Handoff:
        num_blocks = -(-len(prompt_ids) // self.engine.block_size)
        header = TransferHeader.describe(
            request_id, self.engine.model_id, _payload_shape(self.engine, num_blocks), self.engine.kv_cache.dtype,
            block_hashes(prompt_ids, self.engine.block_size, self._salt), layerwise=self.layerwise,
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

    def client(self, target: str) -> KVTransferClient:
        if target not in self._clients:
            self._clients[target] = KVTransferClient(target)
        return self._clients[target]

    async def channel(self, kv_target: dict) -> CollectiveChannel:
        decode_id = kv_target["worker_id"]
        channel = self._channels.get(decode_id)
        if channel is None:
            init_method = await kv_target["actor"].open_collective.remote(self.worker_id)
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

    def __init__(self, sender: HandoffSender, header: TransferHeader, kv_target: dict, deadline: float,
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
            client = self.sender.client(self.kv_target["grpc"])
            self._push = client.start_push(self.header, payload, self._remaining())
        else:
            self._collective = asyncio.create_task(self._send_collective(payload))

    async def _send_collective(self, payload) -> None:
        # A pair carries one transfer at a time, and both ends must take them in the same order: the
        # sender holds the pair from the first computed layer until the receiver has every byte.
        if self.feed is not None:
            await self.feed.first_layer.wait()
        async with self.sender.pair_lock(self.kv_target["worker_id"]):
            self._started = time.perf_counter()
            channel = await self.sender.channel(self.kv_target)
            receive = self.kv_target["actor"].receive_collective.remote(
                self.sender.worker_id, dataclasses.asdict(self.header), self._remaining())
            send = asyncio.to_thread(channel.send, self.header, payload, self._remaining())
            try:
                await asyncio.gather(send, receive)
            except PeerLost:
                self.sender.drop_channel(self.kv_target["worker_id"])  # the next transfer opens a new pair
                raise

    async def finish(self) -> tuple[int, float]:
        """Wait until the receiver has the KV; (bytes, seconds since the bytes started to leave)."""
        if self.feed is None:  # whole-request mode: export now that the prompt is computed
            engine = self.sender.engine
            tensor = await self.sender.loop.acall(
                lambda: engine.kv_cache.export_blocks(engine.request_block_ids(self.header.request_id)
                                                      [: self.header.shape[2]]))
            self._start(tensor)
        if self._push is not None:
            await asyncio.to_thread(self._push.result)
        else:
            await self._collective
        return self.header.total_bytes, time.perf_counter() - self._started

    def cancel(self) -> None:
        if self.feed is not None:
            self.feed.fail(TransferError("prefill ended before its KV was complete"))
        if self._push is not None:
            self._push.cancel()
        if self._collective is not None:
            self._collective.cancel()

    def close(self) -> None:
        self.sender._forget(self.header.request_id)
