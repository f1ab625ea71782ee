"""The decode side of the KV handoff: leases of reserved blocks, and the endpoints KV arrives at.

``HandoffReceiver`` holds the leases (blocks reserved per request, with a deadline). A transfer is
accepted only for a live, unfilled lease whose shape matches; its bytes are written straight into the
reserved blocks as they arrive (``engine/kv_import.py``: no staging copy of the payload), and the lease
counts as filled only after the checksum matched. Until then the blocks are in no sequence's table, so a
corrupt or cut transfer is never read: its lease is released. Transfers come over gRPC (a server this
receiver runs), shared memory from a prefill worker on this node (``receive_shared``: the payload is
mapped and copied in) or a collective channel per prefill worker, opened on demand and kept in a bounded pool
(``kvstore/transfer/channel_pool.py``): a prefill worker asks for its channel's address before each
transfer, which holds the channel until the transfer ends, and receives run on a thread pool of the
same bound, so N x M pairs never pin more groups or threads than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ray

from engine.engine import Engine
from engine.kv_import import BlockImport
from kvstore.transfer import TransferError, TransferRejected
from kvstore.transfer.channel_pool import ChannelPool
from kvstore.transfer.collective import CollectiveChannel, backend_for
from kvstore.transfer.grpc import KVTransferServer
from kvstore.transfer.ipc import SharedPayload, copy_shared
from kvstore.transfer.wire import TransferHeader
from services.engine_loop import EngineLoop
from services.messages import KVTarget


def kv_payload_shape(engine: Engine, num_blocks: int) -> tuple[int, ...]:
    """Shape of ``num_blocks`` blocks of K/V as they travel (``KVCache.export_blocks``): ``[layers, 2, n,
    block_size, kv_heads, head_dim]``, or ``[layers, 1, n (+ window columns), record_bytes]`` quantized."""
    return engine.kv_cache.payload_shape(num_blocks)


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    deadline: float
    filled: bool = False
    busy: bool = False  # a transfer into it is in flight: it owns the blocks until it ends
    # Dropped while busy: the engine's new name for its blocks, which the transfer's end frees (the request
    # id itself is free again at once).
    released_as: str | None = None


class HandoffReceiver:
    """The decode worker's leases and its KV endpoints (a gRPC server; collective channels on demand)."""

    def __init__(self, worker_id: str, engine: Engine, loop: EngineLoop, secret: str, max_channels: int = 16,
                 channel_idle_s: float = 300.0) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.loop = loop
        self._leases: dict[str, Lease] = {}
        self._released = itertools.count()  # names for the blocks of leases dropped mid-transfer
        self._lock = threading.Lock()
        self.channels: ChannelPool[CollectiveChannel] = ChannelPool(max_channels, channel_idle_s,
                                                                    lambda _peer, channel: channel.close())
        # One receive at a time per channel: as many threads as channels serve them all.
        self.receive_threads = ThreadPoolExecutor(max_channels, thread_name_prefix="kv-recv")
        self._node = ray.util.get_node_ip_address()
        # Bound to the address peers use (the node's), not every interface; pushes must carry the secret.
        self._server = KVTransferServer(self, host=self._node, secret=secret)
        self._server.start()

    @property
    def grpc_address(self) -> str:
        """host:port of this receiver's KV transfer server."""
        return f"{self._node}:{self._server.port}"

    def target(self) -> KVTarget:
        context = ray.get_runtime_context()
        return KVTarget(self.worker_id, self.grpc_address, str(self.engine.device), context.get_node_id(),
                        context.current_actor)

    def stop(self) -> None:
        self._server.stop()
        self.channels.close_all()
        self.receive_threads.shutdown(wait=False, cancel_futures=True)

    # leases (called from the actor's event loop)
    def add_lease(self, request_id: str, block_ids: list[int], deadline: float) -> None:
        with self._lock:
            self._leases[request_id] = Lease(request_id, block_ids, deadline)

    def has_lease(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

    def take_filled_lease(self, request_id: str) -> Lease:
        """Hand a filled lease to the batch; it stops being a lease (the request owns its blocks now)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or not lease.filled:
                raise TransferRejected(f"no filled KV lease for {request_id!r}")
            del self._leases[request_id]
        return lease

    def drop_lease(self, request_id: str) -> bool:
        """Forget a lease that never joined the batch; True when the caller must free its blocks now. A
        lease a transfer is still writing into keeps its blocks until that transfer ends (which frees them),
        so no late write lands in blocks another request was given meanwhile; they are renamed in the engine
        at once, so a retry of the request may reserve again."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None or not lease.busy:
                return lease is not None
            lease.released_as = f"{request_id}#released-{next(self._released)}"
        self.loop.call(self.engine.rename_reservation, request_id, lease.released_as)  # before the free
        return False

    def expired_leases(self, now: float) -> list[str]:
        with self._lock:
            return [rid for rid, lease in self._leases.items() if lease.deadline < now and not lease.busy]

    # transfers (called from gRPC threads or worker threads)
    def _claim(self, header: TransferHeader) -> Lease:
        kv = self.engine.kv_cache
        if header.kv_format != kv.kv_format:
            raise TransferRejected(f"{header.request_id}: KV in format {header.kv_format!r}, this worker's "
                                   f"cache holds {kv.kv_format!r}")
        with self._lock:
            lease = self._leases.get(header.request_id)
            if lease is None or lease.filled or lease.busy:
                raise TransferRejected(f"no open KV lease for request {header.request_id!r}")
            shape = kv_payload_shape(self.engine, len(lease.block_ids))
            if header.model != self.engine.model_id or header.shape != shape \
                    or header.torch_dtype != kv.payload_dtype:
                raise TransferRejected(
                    f"{header.request_id}: expected {self.engine.model_id} {kv.payload_dtype} "
                    f"{list(shape)}, got {header.model} {header.dtype} {list(header.shape)}")
            lease.busy = True
        return lease

    def _fill(self, lease: Lease, arrived: BlockImport | None) -> None:
        """Finish a verified transfer into the lease's blocks (or release the claim when ``arrived`` is None)."""
        try:
            if arrived is not None:
                if arrived.needs_engine_thread:
                    self.loop.call(arrived.finish).result()
                else:
                    arrived.finish()
        finally:
            with self._lock:
                lease.busy = False
                lease.filled = arrived is not None and lease.released_as is None
            if lease.released_as is not None:
                self.loop.call(self.engine.release, lease.released_as)  # on the engine thread, after the rename

    def begin(self, header: TransferHeader) -> _LeaseWriter:  # KVSink, for the gRPC server
        lease = self._claim(header)
        return _LeaseWriter(self, lease, BlockImport(self.engine.kv_cache, lease.block_ids))

    async def collective_address(self, prefill_id: str, hold_s: float, fresh: bool) -> str:
        """The ``tcp://`` address of the channel ``prefill_id``'s next transfer uses, held for it until the
        transfer ends or ``hold_s`` passes. ``fresh``: the prefill side has no channel to us (first use, or
        it closed its end), so any channel we still hold for it is replaced.

        In a thread: a new channel's listening store connects to itself, and torch formats that socket's
        address with a reverse DNS lookup (seconds where DNS is slow); an evicted one's group is torn down.
        On this worker's event loop that would stall every stream it serves."""
        return await asyncio.to_thread(self._hold_channel, prefill_id, hold_s, fresh)

    async def close_collective(self, prefill_id: str) -> None:
        """The prefill side closed its end of our pair (its pool evicted it): close ours (in a thread, as
        ``collective_address`` tears channels down)."""
        await asyncio.to_thread(self._close_channel, prefill_id)

    def _hold_channel(self, prefill_id: str, hold_s: float, fresh: bool) -> str:
        channel = self.channels.get(prefill_id)
        if channel is None or channel.broken or fresh:
            channel = CollectiveChannel("decode", f"tcp://{self._node}:0", backend_for(self.engine.device),
                                        device=self.engine.device)
        self.channels.hold(prefill_id, channel, time.monotonic() + hold_s)  # may close the LRU idle one
        return channel.init_method

    def _close_channel(self, prefill_id: str) -> None:
        channel = self.channels.pop(prefill_id)
        if channel is not None:
            channel.close()

    def _refuse(self, channel: CollectiveChannel, header: TransferHeader, timeout_s: float) -> None:
        """The sender of a refused transfer is already sending: take its bytes into the rotating buffers
        and drop them, so it finishes now (not at its deadline, holding a thread and the pair) and the pair
        stays in step for the next transfer. One larger than this whole cache cannot be legitimate: the
        pair is closed instead, which fails the sender too."""
        if header.total_bytes > self.engine.kv_cache.data.nbytes:
            channel.close()
            return
        with contextlib.suppress(TransferError):  # a failed drain leaves the pair broken: closed below
            channel.recv_into(header, _Discard(), timeout_s=timeout_s)

    def receive_collective(self, prefill_id: str, header: TransferHeader, timeout_s: float) -> int:
        channel = self.channels.get(prefill_id)
        if channel is None:
            raise TransferRejected(f"no collective channel from {prefill_id}")
        try:
            self._receive_into_lease(channel, header, timeout_s)
        finally:
            self.channels.release(prefill_id, channel)
            if channel.broken and self.channels.get(prefill_id) is channel:
                self._close_channel(prefill_id)  # out of step after a failure: the next transfer opens a new pair
        return header.total_bytes

    def _receive_into_lease(self, channel: CollectiveChannel, header: TransferHeader, timeout_s: float) -> None:
        try:
            lease = self._claim(header)
        except TransferRejected:
            self._refuse(channel, header, timeout_s)
            raise
        with self._filling(lease) as incoming:
            channel.recv_into(header, incoming, timeout_s=timeout_s)

    def receive_shared(self, header: TransferHeader, shared: SharedPayload) -> int:
        """Copy a payload a prefill worker on this node shares (``kvstore/transfer/ipc.py``) into its lease.
        ``IpcUnavailable`` (it cannot be mapped here) leaves the lease open for another transport."""
        if shared.nbytes != header.total_bytes:
            raise TransferRejected(f"{header.request_id}: shared {shared.nbytes} B, header says "
                                   f"{header.total_bytes}")
        with self._filling(self._claim(header)) as incoming:
            copy_shared(shared, incoming)
        return header.total_bytes

    @contextlib.contextmanager
    def _filling(self, lease: Lease) -> Iterator[BlockImport]:
        """The import into a claimed lease: filled when the block completes, released when it raises."""
        arrived = None
        try:
            incoming = BlockImport(self.engine.kv_cache, lease.block_ids)
            yield incoming
            arrived = incoming
        finally:
            self._fill(lease, arrived)


class _Discard:
    """A ``recv_into`` writer that drops every piece (a refused transfer's bytes)."""

    def write(self, offset: int, data: object) -> None:
        pass


class _LeaseWriter:
    """Writes one gRPC transfer straight into the lease's blocks; the lease is filled on commit."""

    def __init__(self, receiver: HandoffReceiver, lease: Lease, arrival: BlockImport) -> None:
        self._receiver, self._lease, self._arrival = receiver, lease, arrival

    def write(self, offset: int, data: memoryview) -> None:
        self._arrival.write(offset, data)

    def commit(self) -> None:
        self._receiver._fill(self._lease, self._arrival)

    def abort(self, reason: str) -> None:
        self._receiver._fill(self._lease, None)
