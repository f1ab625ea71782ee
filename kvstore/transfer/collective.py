"""KV transfer over torch.distributed point-to-point: one two-rank process group per prefill-decode pair.

Each channel builds its own store and group (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on a TCPStore)
instead of the process-wide default group, so a worker can hold channels to several peers and a peer's
death breaks only its own channel. The decode side (rank 0) hosts the store, so its address exists
before the prefill side connects; the group itself is created lazily, on the first transfer.

The header travels out of band (the caller hands it over, e.g. in a Ray call); the collective carries
the payload (one message per layer when ``header.layerwise``, else runs of whole layers of up to 4 MiB;
sends pipelined; receives posted ahead, all at once into a whole tensor or a few at a time into rotating
buffers whose pieces a writer places, e.g. straight into KV blocks; checksums computed while later pieces
are in flight) and then a trailer ``[check, check, status, tag]``. A sender whose layer producer fails still sends the remaining layers (as
zeros) with status "aborted", so the channel stays aligned for the next request. A timeout or lost
connection mid-transfer leaves the two sides out of step: the channel is torn down and every later call
raises ``PeerLost``; the caller opens a new channel (or picks another pair).

Limits: one transfer at a time per channel, and both sides must handle the pair's transfers in the same
order (NCCL ignores tags; the trailer's tag catches a mix-up). The check is CRC-32C of the bytes on the
host (gloo), or on GPUs (NCCL) ``wire.device_checksum``, computed in device memory, so checking never copies
the KV to the host; a header's own ``checksum`` (CRC-32C) is compared only on the host path. Gloo picks its network interface from the hostname
(``GLOO_SOCKET_IFNAME`` overrides it on multi-homed nodes).
"""

from __future__ import annotations

import socket
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from kvstore.transfer import ChecksumMismatch, PeerLost, TransferCancelled, TransferError, TransferTimeout
from kvstore.transfer.wire import (
    MAX_CHUNK_BYTES,
    TransferHeader,
    as_bytes,
    checksum,
    device_checksum,
    flat_bytes,
    payload_pieces,
    piece_ranges,
)

ROLES = {"decode": 0, "prefill": 1}
_OK, _ABORTED = 0, 1
_MAX_IN_FLIGHT = 4  # pieces sent but not yet confirmed, per transfer
_RECV_AHEAD = 4  # receives posted at once into rotating buffers (recv_into): memory of 4 pieces at most


class _Digest:
    """The running check over a transfer's pieces, in order: CRC-32C on the host, or on the device a pair of
    integer sums (``device_checksum``) folded piece by piece, so no byte leaves device memory for it."""

    _FOLD = 1_000_003  # order-sensitive folding of the pieces' sums

    def __init__(self, on_device: bool, device: torch.device) -> None:
        self.on_device, self.device = on_device, device
        self.value: int | torch.Tensor = torch.zeros(2, dtype=torch.int64, device=device) if on_device else 0

    def add(self, data: torch.Tensor) -> None:
        if self.on_device:
            self.value = self.value * self._FOLD + device_checksum(data)
        else:
            self.value = checksum(as_bytes(data), self.value)

    def words(self) -> torch.Tensor:
        """The check as the trailer's first two int64 words, on the channel's device."""
        if self.on_device:
            return self.value
        return torch.tensor([self.value, 0], dtype=torch.int64, device=self.device)


class PieceWriter(Protocol):
    """Where ``recv_into`` puts each received piece: ``offset`` is its place in the payload's bytes."""

    def write(self, offset: int, data: torch.Tensor) -> None: ...


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _new_group(backend: str, store: dist.Store, rank: int, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == "nccl" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        # Above every transfer deadline, so our wait notices a stalled peer and aborts the pair before
        # NCCL's watchdog would end the whole process.
        options._timeout = 2 * timeout + timedelta(seconds=60)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    raise ValueError(f"backend {backend!r} is not available in this torch build")


def _listening_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """The rank-0 store, listening on ``host`` alone: given only a port, a TCPStore listens on every
    interface of the node."""
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    store = dist.TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False, timeout=timeout,
                          master_listen_fd=sock.fileno())
    sock.detach()  # the store owns (and closes) the listening socket now
    return store


class CollectiveChannel:
    """One end of a prefill-decode pair. ``role`` "decode" binds ``init_method`` (port 0: any free port)."""

    def __init__(self, role: str, init_method: str, backend: str = "gloo", timeout_s: float = 60.0,
                 device: str | torch.device = "cpu", check_on_device: bool | None = None) -> None:
        """``check_on_device``: check the bytes where they are (``device_checksum``) instead of CRC-32C on
        the host; default: on NCCL. Both ends of a pair must agree."""
        self.role, self.rank = role, ROLES[role]
        self.backend, self.device = backend, torch.device(device)
        self.check_on_device = backend == "nccl" if check_on_device is None else check_on_device
        # On CUDA, transfers run on a stream of their own: NCCL then waits for nothing but their pieces,
        # not for the engine's work queued on the default stream.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.timeout_s = timeout_s
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or url.port is None:
            raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
        self._host = url.hostname
        store_timeout = timedelta(seconds=timeout_s)
        self._store = _listening_store(self._host, url.port, store_timeout) if self.rank == 0 else None
        self.init_method = f"tcp://{self._host}:{self._store.port if self._store else url.port}"
        self._group = None
        self._broken: str | None = None
        self._lock = threading.Lock()  # one transfer at a time: point-to-point messages pair up in order

    @property
    def broken(self) -> bool:
        """Whether the channel was torn down (closed, or out of step after a failure): open a new one."""
        return self._broken is not None

    def send(self, header: TransferHeader, payload: torch.Tensor | Iterable[torch.Tensor],
             timeout_s: float | None = None) -> None:
        """Send the payload: per layer when ``header.layerwise`` (layers pulled as they are produced),
        else the whole tensor in runs of whole layers of up to 4 MiB. Blocks until every piece is out."""
        with self._transfer(timeout_s) as deadline, torch.cuda.stream(self._stream):
            if self._stream is not None and isinstance(payload, torch.Tensor):
                # a whole payload was exported on the engine's stream; layers come with their own events
                self._stream.wait_stream(torch.cuda.default_stream(self.device))
            group, tag = self._connect(), _tag(header)
            pieces = payload_pieces(header, payload, MAX_CHUNK_BYTES)
            in_flight: deque[tuple[dist.Work, torch.Tensor]] = deque()  # keeps each piece alive until sent
            digest, failure = _Digest(self.check_on_device, self.device), None
            for start, end in piece_ranges(header, MAX_CHUNK_BYTES):
                try:
                    data = flat_bytes(next(pieces).to(self.device).contiguous())
                except Exception as exc:  # StopIteration too: a generator that raised is exhausted
                    # The receiver is waiting for these bytes: send zeros and flag the trailer instead.
                    failure = failure or exc
                    data = torch.zeros((end - start) * header.layer_bytes, dtype=torch.uint8, device=self.device)
                in_flight.append((group.send([data], 1 - self.rank, tag), data))
                digest.add(data)  # overlaps the send in flight
                while len(in_flight) > _MAX_IN_FLIGHT:
                    self._wait(in_flight.popleft()[0], deadline)
            status = torch.tensor([_OK if failure is None else _ABORTED, tag], dtype=torch.int64, device=self.device)
            trailer = torch.cat([digest.words(), status])
            in_flight.append((group.send([trailer], 1 - self.rank, tag), trailer))
            for work, _ in in_flight:
                self._wait(work, deadline)
        if failure is not None:
            raise TransferCancelled(f"{header.request_id}: payload failed, receiver told: {failure}") \
                from failure

    def recv(self, header: TransferHeader, out: torch.Tensor | None = None,
             timeout_s: float | None = None) -> torch.Tensor:
        """Receive the payload described by ``header`` into ``out`` (allocated on the channel's device)."""
        if out is None:
            out = torch.empty(header.shape, dtype=header.torch_dtype, device=self.device)
        if tuple(out.shape) != header.shape or out.dtype != header.torch_dtype or not out.is_contiguous():
            raise TransferError(f"{header.request_id}: out is {out.dtype} {list(out.shape)}, header says "
                                f"{header.dtype} {list(header.shape)}")
        # Views: the bytes land in ``out``, in the pieces the sender derives from the same header; every
        # receive is posted up front, so the sender never waits for us between pieces.
        views = [flat_bytes(out[start:end]) for start, end in piece_ranges(header, MAX_CHUNK_BYTES)]
        self._receive(header, lambda i, _size: views[i], None, len(views) + 1, timeout_s)
        return out

    def recv_into(self, header: TransferHeader, writer: PieceWriter, timeout_s: float | None = None) -> None:
        """Receive the payload piece by piece into a few rotating buffers, handing each to
        ``writer.write(offset, piece)`` once checksummed (e.g. straight into reserved KV blocks), so no
        buffer of the whole payload is ever held; ``_RECV_AHEAD`` receives stay posted meanwhile."""
        largest = max(end - start for start, end in piece_ranges(header, MAX_CHUNK_BYTES)) * header.layer_bytes
        ring = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(_RECV_AHEAD)]
        self._receive(header, lambda i, size: ring[i % _RECV_AHEAD][:size], writer.write, _RECV_AHEAD, timeout_s)

    def _receive(self, header: TransferHeader, buffer: Callable[[int, int], torch.Tensor],
                 deliver: Callable[[int, torch.Tensor], None] | None, ahead: int, timeout_s: float | None) -> None:
        """Receive piece i into ``buffer(i, size)`` with up to ``ahead`` receives posted, checksum it and
        ``deliver(offset, piece)``; then the trailer. A piece's buffer is reused ``ahead`` pieces later."""
        sizes = [(end - start) * header.layer_bytes for start, end in piece_ranges(header, MAX_CHUNK_BYTES)]
        # On CUDA the pieces' checks and deliveries queue on the channel's stream too; reading the checks
        # back below waits for all of it, so every byte is in place when this returns.
        with self._transfer(timeout_s) as deadline, torch.cuda.stream(self._stream):
            group, tag = self._connect(), _tag(header)
            trailer = torch.zeros(4, dtype=torch.int64, device=self.device)

            def post(m: int) -> dist.Work:  # message m: piece m, or the trailer after the last piece
                return group.recv([trailer if m == len(sizes) else buffer(m, sizes[m])], 1 - self.rank, tag)

            posted = deque(post(m) for m in range(min(ahead, len(sizes) + 1)))
            digest, offset = _Digest(self.check_on_device, self.device), 0
            for i, size in enumerate(sizes):
                self._wait(posted.popleft(), deadline)
                data = buffer(i, size)
                digest.add(data)  # overlaps the next pieces' arrival
                if deliver is not None:
                    deliver(offset, data)
                offset += size
                if i + ahead <= len(sizes):
                    posted.append(post(i + ahead))  # into the buffer piece i just left
            self._wait(posted.popleft(), deadline)
            ours, (*sent, status, tag) = digest.words().tolist(), trailer.tolist()
        if tag != _tag(header):
            raise TransferError(f"{header.request_id}: received another request's KV (tag {tag})")
        if status == _ABORTED:
            raise TransferCancelled(f"{header.request_id}: the sender's layer producer failed")
        promised = header.checksum not in (0, ours[0]) and not self.check_on_device
        if ours != sent or promised:
            raise ChecksumMismatch(f"{header.request_id}: received check {ours}, sender said {sent} "
                                   f"(header {header.checksum:#x})")

    def close(self) -> None:
        """Tear the group down; later calls raise PeerLost."""
        with self._lock:
            self._teardown("closed")

    @contextmanager
    def _transfer(self, timeout_s: float | None) -> Iterator[float]:
        with self._lock:
            if self._broken is not None:
                raise PeerLost(f"channel {self.init_method} is down: {self._broken}")
            yield time.monotonic() + min(self.timeout_s, self.timeout_s if timeout_s is None else timeout_s)

    def _connect(self):
        """The pair's group, created on first use (blocks until the peer joins, up to the timeout)."""
        if self._group is None:
            try:
                if self.backend == "nccl":
                    torch.cuda.set_device(self.device)
                store = self._store or dist.TCPStore(self._host, int(self.init_method.rsplit(":", 1)[1]),
                                                     is_master=False, timeout=timedelta(seconds=self.timeout_s))
                self._group = _new_group(self.backend, store, self.rank, timedelta(seconds=self.timeout_s))
                self._store = store  # keep the client store alive as long as the group
            except RuntimeError as exc:
                self._teardown(f"could not join the peer: {exc}")
                raise PeerLost(f"{self.init_method}: could not join the peer: {exc}") from exc
        return self._group

    def _wait(self, work: dist.Work, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise RuntimeError("Timed out: the transfer's deadline passed")
            work.wait(timedelta(seconds=remaining))
        except RuntimeError as exc:
            # The two sides are out of step now (a message half sent or half received): end the pair.
            timed_out = time.monotonic() >= deadline - 0.1  # by the clock, not the backend's wording
            self._teardown(f"{'timeout' if timed_out else 'peer lost'}: {exc}")
            raise (TransferTimeout if timed_out else PeerLost)(f"{self.init_method}: {exc}") from exc

    def _teardown(self, reason: str) -> None:
        self._broken = self._broken or reason
        if self._group is not None:
            self._group.abort()  # the peer's pending and later operations fail at once
        self._group = self._store = None


def _tag(header: TransferHeader) -> int:
    """A per-request message tag, so gloo never matches one request's bytes with another's receive."""
    return zlib.crc32(header.request_id.encode()) & 0x7FFFFFFF
