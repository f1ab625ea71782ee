"""KV between two processes on one node through shared memory: the receiver maps the sender's payload.

The sender wraps a request's exported payload in a ``PayloadShare``: on CUDA the device tensor itself,
described by torch's CUDA IPC handles (no byte crosses the host); on the host a POSIX shared-memory
segment the payload is copied into. Its ``shared`` (a ``SharedPayload``, plain picklable fields) travels
in the call that hands the transfer over (a Ray call, a pipe). The receiver's ``copy_shared`` maps it,
writes all of it through a writer (a lease's ``BlockImport``: straight into the reserved blocks, on CUDA
on the receiver's current stream), checks it and unmaps it before returning: its return is the ack. A
sender reuses host segments (``SegmentPool``): a fresh one costs a page fault and a zeroed page per 4 KiB.

Lifetime rule: the sender keeps the share open, and its bytes unchanged, until the receiver returned (or
failed); then it closes it (the device tensor dropped; the host segment back to its pool after an ack,
else unlinked, since the receiver may still read it). Unlinking a segment the receiver still maps is safe
(its mapping lives until it unmaps), and torch's caching allocator does not reuse device memory another
process still maps. Each CUDA share maps the whole allocator segment the
tensor lives in; the receiver reads only the tensor's bytes. Ordering on CUDA: the share records an event
on the sender's current stream, and mapping makes the receiver's current stream wait for it, so the export
that filled the tensor is complete before the receiver's copy. A sender that dies is cleaned up by
multiprocessing's resource tracker, which unlinks the segments it created, or, if the tracker died with it, by
the next sender on the node (``SegmentPool.remove_orphans``: the segments are named after their creator's
pid).

Integrity: the sender's check (CRC-32C of the segment; on CUDA ``wire.device_checksum``, computed in device
memory) travels with the description, and the receiver recomputes it over the mapped bytes after its copy,
so the bytes it read are the bytes that were checked (a sender breaking the lifetime rule is caught; the
copy itself is a memcpy by the CPU or the GPU's copy engine, and is not checked again).

A pair that cannot share memory (the processes are on different nodes, the receiver cannot see the
sender's GPU, /dev/shm has no room) raises ``IpcUnavailable``: the caller falls back to another transport.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Protocol

import torch
from torch.multiprocessing.reductions import reduce_tensor

from kvstore.transfer import ChecksumMismatch, IpcUnavailable, TransferRejected
from kvstore.transfer.wire import as_bytes, checksum, device_checksum

SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux; its free space bounds a host share
_PREFIX = "tidepool-kv-"  # + the creating process's pid + a counter: orphans can be told by their pid
_names = itertools.count()


class PayloadWriter(Protocol):
    """Where ``copy_shared`` puts the payload: all of it in one write at offset 0."""

    def write(self, offset: int, data: memoryview | torch.Tensor) -> None: ...


@dataclass(frozen=True)
class SharedPayload:
    """What another process on the node needs to read a payload: its description, the sender's check,
    and either the host segment's name or torch's CUDA IPC handles (``rebuild(*args)`` maps the tensor)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    check: tuple[int, ...]
    segment: str | None = None
    rebuild: Callable[..., torch.Tensor] | None = None
    args: tuple = ()


def payload_check(data: torch.Tensor | memoryview) -> tuple[int, ...]:
    """The check a share carries: the two device sums of a CUDA tensor, CRC-32C of host bytes."""
    if isinstance(data, torch.Tensor):
        return tuple(int(v) for v in device_checksum(data).tolist())
    return (checksum(data),)


class SegmentPool:
    """Host segments a sender reuses. The first write into a fresh tmpfs segment faults in and zeroes every
    page (about 1.2 GB/s here, against 7 GB/s into one already written), so a segment whose transfer was
    acked goes back here for the next payload that fits. Sizes are rounded up to powers of two (1 MiB at
    least); at most ``max_idle_bytes`` wait idle, the least recently returned unlinked first."""

    def __init__(self, max_idle_bytes: int = 256 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[SharedMemory] = []  # least recently returned first
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> SharedMemory:
        with self._lock:
            fits = [seg for seg in self._idle if seg.size >= nbytes]
            if fits:
                segment = min(fits, key=lambda seg: seg.size)
                self._idle.remove(segment)
                return segment
        size = max(1 << 20, 1 << (nbytes - 1).bit_length())
        free = shutil.disk_usage(SHM_DIR).free
        if size > free:  # writing past a full tmpfs would kill this process with SIGBUS, not fail
            raise IpcUnavailable(f"a {nbytes} B payload does not fit the {free} B free in {SHM_DIR}")
        try:
            return SharedMemory(f"{_PREFIX}{os.getpid()}-{next(_names)}", create=True, size=size)
        except OSError as exc:
            raise IpcUnavailable(f"no shared-memory segment of {size} B: {exc}") from exc

    def give(self, segment: SharedMemory) -> None:
        with self._lock:
            self._idle.append(segment)
            while sum(seg.size for seg in self._idle) > self.max_idle_bytes:
                _unlink(self._idle.pop(0))

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(seg.size for seg in self._idle)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for segment in idle:
            _unlink(segment)

    @staticmethod
    def remove_orphans() -> list[str]:
        """Unlink the segments of senders on this node that died without closing them (the resource tracker
        normally does, unless it was killed with them); returns their names."""
        removed = []
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(SHM_DIR):
                pid = name.removeprefix(_PREFIX).split("-")[0]
                if name.startswith(_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(SHM_DIR, name))
                        removed.append(name)
        return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _unlink(segment: SharedMemory) -> None:
    segment.close()
    segment.unlink()


class PayloadShare:
    """The sender's side of one shared payload, open until ``close`` (also a context manager: a clean exit
    is an ack, and the host segment goes back to ``pool``; any other exit unlinks it, since a receiver may
    still be reading it)."""

    def __init__(self, payload: torch.Tensor, pool: SegmentPool | None = None) -> None:
        payload = payload.detach().contiguous()
        shape, nbytes = tuple(payload.shape), payload.numel() * payload.element_size()
        self._tensor: torch.Tensor | None = None
        self._segment: SharedMemory | None = None
        self._pool = pool
        if payload.is_cuda:
            self._tensor = payload  # kept alive and unchanged until close (the lifetime rule)
            rebuild, args = reduce_tensor(payload)
            self.shared = SharedPayload(shape, payload.dtype, nbytes, payload_check(payload),
                                        rebuild=rebuild, args=args)
            return
        self._segment = (pool or SegmentPool()).take(nbytes)
        data = self._segment.buf[:nbytes]
        try:
            data[:] = as_bytes(payload)
            check = payload_check(data)
        finally:
            data.release()  # the segment closes only without views on it
        self.shared = SharedPayload(shape, payload.dtype, nbytes, check, segment=self._segment.name)

    def close(self, acked: bool = False) -> None:
        """Release the payload's memory, once the receiver returned (``acked``) or failed; idempotent."""
        self._tensor = None
        if self._segment is not None:
            segment, self._segment = self._segment, None
            if acked and self._pool is not None:
                self._pool.give(segment)
            else:
                _unlink(segment)

    def __enter__(self) -> PayloadShare:
        return self

    def __exit__(self, exc_type: type | None, *_exc: object) -> None:
        self.close(acked=exc_type is None)


def copy_shared(shared: SharedPayload, writer: PayloadWriter) -> None:
    """Map ``shared``, write all of its bytes through ``writer``, check them and unmap it. Raises
    ``IpcUnavailable`` when it cannot be mapped in this process, ``ChecksumMismatch`` when the bytes read
    are not the bytes the sender checked (nothing written may then be used)."""
    if shared.segment is None:
        _copy_device(shared, writer)
    else:
        _copy_host(shared, writer)


def _verify(shared: SharedPayload, got: tuple[int, ...]) -> None:
    if got != shared.check:
        raise ChecksumMismatch(f"shared payload changed under the copy: check {got}, sender's {shared.check}")


def _copy_host(shared: SharedPayload, writer: PayloadWriter) -> None:
    # Mapped by its file, read-only, not through SharedMemory: that would register the segment with this
    # process's resource tracker, which unlinks it at exit (or, shared with the sender's, forgets the
    # sender's registration): the sender owns the segment.
    name = shared.segment
    if not name.startswith(_PREFIX) or "/" in name:  # only a sender's segment, never another file
        raise TransferRejected(f"{name!r} is not a KV payload segment")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except OSError as exc:  # gone (the sender closed it), or another node's
        raise IpcUnavailable(f"cannot map shared-memory segment {name!r} here: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size < shared.nbytes:
            raise IpcUnavailable(f"segment {name!r} holds {size} B, the payload {shared.nbytes}")
        # Populated in one call: cheaper than faulting the pages in one by one during the copy.
        mapping = mmap.mmap(fd, shared.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    data = memoryview(mapping)
    try:
        writer.write(0, data)
        _verify(shared, payload_check(data))
    finally:
        # A failed write's traceback may still hold a view: then the mapping goes with the last one.
        with contextlib.suppress(BufferError):
            data.release()
            mapping.close()


def _copy_device(shared: SharedPayload, writer: PayloadWriter) -> None:
    if not torch.cuda.is_available():
        raise IpcUnavailable("a shared CUDA payload needs a process that sees a CUDA device")
    try:
        mapped = shared.rebuild(*shared.args)
    except RuntimeError as exc:  # e.g. the sender's GPU is not visible to this process
        raise IpcUnavailable(f"cannot map the sender's device memory here: {exc}") from exc
    try:
        writer.write(0, mapped)  # on the current stream, which the mapping made wait for the sender's event
        _verify(shared, payload_check(mapped))  # the same stream: after the copy; reading it back syncs
    finally:
        del mapped  # unmapped before the return, which is the sender's ack
