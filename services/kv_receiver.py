"""The decode side of the KV handoff: leases of reserved blocks, and the endpoints KV arrives at.

``HandoffReceiver`` holds the leases (blocks reserved per request, with a deadline). A transfer is
accepted only for a live, unfilled lease whose shape matches; its bytes land in a staging tensor and are
imported into the reserved blocks only after the checksum matched, so a corrupt or cut transfer never
reaches the KV cache. Transfers come over gRPC (a server this receiver runs) or a collective channel
per prefill worker, opened on demand.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import ray
import torch

from engine.engine import Engine
from kvstore.transfer import TransferRejected
from kvstore.transfer.collective import CollectiveChannel, backend_for
from kvstore.transfer.grpc import KVTransferServer
from kvstore.transfer.wire import TransferHeader, as_bytes
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
    busy: bool = False  # a transfer into it is in flight


class HandoffReceiver:
    """The decode worker's leases and its KV endpoints (a gRPC server; collective channels on demand)."""

    def __init__(self, worker_id: str, engine: Engine, loop: EngineLoop, secret: str) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.loop = loop
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._channels: dict[str, CollectiveChannel] = {}
        self._node = ray.util.get_node_ip_address()
        # Bound to the address peers use (the node's), not every interface; pushes must carry the secret.
        self._server = KVTransferServer(self, host=self._node, secret=secret)
        self._server.start()

    def target(self) -> KVTarget:
        return KVTarget(self.worker_id, f"{self._node}:{self._server.port}", str(self.engine.device),
                        ray.get_runtime_context().current_actor)

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
