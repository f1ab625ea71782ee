"""A worker's local disk tier for KV blocks (Mooncake's SSD level), under the host tier.

One file per block, ``root/<first two hex digits>/<16 hex digits>.kv``, in the payload tiers' encoding
(``kvstore.payload.encode_block``: header + CRC-32). One file per block because a prefix run then reads
as one open + one read per block, an LRU eviction is one unlink, and a damaged file costs one block; an
append-only segment would need compaction to evict anything. A file is written to ``<name>.tmp`` and
renamed, so a reader sees a whole file or none. Files are not fsynced: one torn by a power loss fails its
length or checksum check and is a miss, like any corrupted or truncated file, never a wrong block.

Writes are behind: ``put_blocks`` only queues the tensors (up to ``max_pending_bytes``; beyond that the
blocks are dropped, the tier being a cache) and returns; a writer thread encodes them, deletes least
recently used files until the block fits ``max_bytes``, and writes. A full disk or any I/O error turns
into a dropped write or a miss, logged once per outage.

On start the files already under ``root`` (a restarted worker's) are indexed, oldest modification first
in the LRU, and count toward the budget (the oldest are deleted while over it); ``on_stored`` hears
them, so the worker publishes what it can serve again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from itertools import takewhile
from pathlib import Path
from typing import BinaryIO

import torch

from kvstore.payload import BlockError, BlockLayout, encode_block, layout_format, read_block
from kvstore.pool import hex_of

log = logging.getLogger(__name__)

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


def _hash_of(name: str) -> int | None:
    """The block hash a file name stands for, or None for a name the tier did not write."""
    stem = name.removesuffix(SUFFIX)
    if len(stem) != 16 or stem == name:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


def _create(path: Path) -> BinaryIO:
    """``path`` opened for writing; its fan-out directory is made on first use."""
    try:
        return open(path, "wb")
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "wb")


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DiskTier:
    """Blocks as files under ``root`` with a byte budget and LRU eviction, written by a background thread.
    ``on_stored``/``on_removed`` (e.g. ``PoolPublisher.callbacks("disk")``) hear which hashes entered and
    left it. ``close`` stops the writer (draining what is queued, or dropping it)."""

    def __init__(self, root: str | os.PathLike, model_id: str, max_bytes: int,
                 layout: BlockLayout | None = None,
                 on_stored: Callable[[list[int]], None] | None = None,
                 on_removed: Callable[[list[int]], None] | None = None,
                 max_pending_bytes: int = 64 << 20, readers: int = 4) -> None:
        self.root = Path(root)
        self.model_id, self.max_bytes, self.layout = model_id, max_bytes, layout
        self.max_pending_bytes = max_pending_bytes
        self.on_stored, self.on_removed = on_stored, on_removed
        self.nbytes = 0
        self.dropped = 0  # blocks never written: backlog full, larger than the budget, or an I/O error
        self._files: OrderedDict[int, int] = OrderedDict()  # hash -> file size, least recently used first
        self._queue: deque[tuple[int, torch.Tensor]] = deque()
        self._queued: set[int] = set()  # hashes in the queue or being written
        self._pending_bytes = 0  # their bytes
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self._failing: set[str] = set()  # "read"/"write" while an I/O error has been logged and not cleared
        self._index_existing()
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix=f"kv-disk-reader-{self.root.name}")
        self._thread = threading.Thread(target=self._write_loop, name=f"kv-disk-writer-{self.root.name}",
                                        daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._files

    def path_of(self, block_hash: int) -> Path:
        name = hex_of(block_hash)
        return self.root / name[:2] / (name + SUFFIX)

    # ---- writes (behind) ---------------------------------------------------------------------------------
    def put_blocks(self, hashes: Sequence[int], tensors: Sequence[torch.Tensor]) -> int:
        """Queue blocks for the writer (those already on disk are skipped); returns how many were queued.
        Never waits on the disk: blocks that would grow the backlog past ``max_pending_bytes`` are dropped.
        The tensors are kept until written: the caller hands over copies it will not change."""
        queued = 0
        with self._changed:
            if self._closed:
                return 0
            for h, t in zip(hashes, tensors, strict=True):
                size = _size(t)
                if h in self._files or h in self._queued:
                    continue
                if self._pending_bytes + size > self.max_pending_bytes:
                    self.dropped += 1
                    continue
                self._queue.append((h, t))
                self._queued.add(h)
                self._pending_bytes += size
                queued += 1
            self._changed.notify_all()
        return queued

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block is written (or dropped); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pending_bytes == 0, timeout_s)

    def close(self, drain: bool = True) -> None:
        """Stop the writer thread, after writing what is queued (``drain``) or dropping it."""
        with self._changed:
            self._closed = True
            if not drain:
                self.dropped += len(self._queue)
                self._pending_bytes -= sum(_size(t) for _, t in self._queue)
                self._queue.clear()
                self._queued.clear()
            self._changed.notify_all()
        self._thread.join()
        self._readers.shutdown()

    def _write_loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                h, tensor = self._queue.popleft()
            try:
                self._write(h, tensor)
            except Exception:  # a bug must not silently end the writer: log it, drop the block, go on
                log.exception("disk tier %s: writing block %s failed", self.root, hex_of(h))
                self._count_dropped()
            with self._changed:
                self._queued.discard(h)
                self._pending_bytes -= _size(tensor)
                self._changed.notify_all()

    def _write(self, h: int, tensor: torch.Tensor) -> None:
        data = encode_block(self.model_id, h, tensor, layout_format(self.layout))
        if len(data) > self.max_bytes:
            self._count_dropped()
            return
        with self._lock:  # room first, so the directory never holds more than the budget
            evicted = self._evict_locked(self.max_bytes - len(data))
        self._notify([], evicted)
        path = self.path_of(h)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        try:
            with _create(tmp) as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            self._io_error("write", f"writing block {hex_of(h)}", e)
            self._count_dropped()
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return
        self._io_ok("write")
        with self._lock:
            self._files[h] = len(data)
            self.nbytes += len(data)
        self._notify([h], [])

    def _count_dropped(self) -> None:
        with self._lock:
            self.dropped += 1

    def _evict_locked(self, keep_bytes: int) -> list[int]:
        """Delete least recently used files until at most ``keep_bytes`` remain (caller holds the lock)."""
        evicted = []
        while self.nbytes > keep_bytes and self._files:
            h, size = self._files.popitem(last=False)
            self.nbytes -= size
            self._unlink(h)
            evicted.append(h)
        return evicted

    # ---- reads -------------------------------------------------------------------------------------------
    def get_prefix(self, hashes: Sequence[int]) -> list[torch.Tensor]:
        """The leading blocks up to the first miss (a block not on disk, unreadable, or failing its check).
        The run's files are read and checked by several threads at once: reads and CRC-32 release the GIL,
        so one block's checksum overlaps the next one's I/O. After a miss, the reads not started yet are
        cancelled and those under way are waited for, so whatever they drop (and report) is dropped when
        this returns."""
        if self._closed:
            return []
        reads = [self._readers.submit(self._read, h) for h in takewhile(self.__contains__, hashes)]
        out: list[torch.Tensor] = []
        for i, read in enumerate(reads):
            block = read.result()
            if block is None:
                for later in reads[i + 1:]:
                    later.cancel()
                wait(reads[i + 1:])
                break
            out.append(block)
        return out

    def _read(self, h: int) -> torch.Tensor | None:
        with self._lock:
            if h not in self._files:
                return None
            self._files.move_to_end(h)
        try:
            with open(self.path_of(h), "rb", buffering=0) as f:
                block = read_block(f, self.model_id, h, self.layout)
        except (OSError, BlockError) as e:
            if isinstance(e, BlockError):
                log.error("disk tier: block %s rejected (%s); treating it as a miss", hex_of(h), e)
            elif not isinstance(e, FileNotFoundError):  # not found: evicted meanwhile, or deleted by hand
                self._io_error("read", f"reading block {hex_of(h)}", e)
            self._forget(h)
            return None
        self._io_ok("read")
        return block

    def _forget(self, h: int) -> None:
        """Drop a block that could not be served from the index and the disk."""
        with self._lock:
            size = self._files.pop(h, None)
            if size is None:
                return
            self.nbytes -= size
            self._unlink(h)
        self._notify([], [h])

    # ---- start-up, errors, notifications -----------------------------------------------------------------
    def _index_existing(self) -> None:
        found: list[tuple[int, int, int]] = []  # (mtime, hash, size)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for sub in os.scandir(self.root):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                for entry in os.scandir(sub.path):
                    if entry.name.endswith(TMP_SUFFIX):  # a write cut short by a crash
                        os.unlink(entry.path)
                        continue
                    h = _hash_of(entry.name)
                    if h is not None and hex_of(h)[:2] == sub.name and entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        found.append((st.st_mtime_ns, h, st.st_size))
        except OSError as e:
            self._io_error("read", f"indexing {self.root}", e)
        found.sort()
        with self._lock:
            for _, h, size in found:
                self._files[h] = size
                self.nbytes += size
            self._evict_locked(self.max_bytes)
            kept = list(self._files)
        if found:
            log.info("disk tier %s: %d blocks from a previous run", self.root, len(kept))
        self._notify(kept, [])

    def _unlink(self, h: int) -> None:
        try:
            self.path_of(h).unlink(missing_ok=True)
        except OSError as e:
            self._io_error("write", f"deleting block {hex_of(h)}", e)

    def _io_error(self, kind: str, what: str, e: OSError) -> None:
        if kind not in self._failing:
            self._failing.add(kind)
            log.warning("disk tier %s: %s failed (%s); serving misses until it works again",
                        self.root, what, e)

    def _io_ok(self, kind: str) -> None:
        if kind in self._failing:
            self._failing.discard(kind)
            log.warning("disk tier %s: %s works again", self.root, kind)

    def _notify(self, stored: list[int], removed: list[int]) -> None:
        if stored and self.on_stored:
            self.on_stored(stored)
        if removed and self.on_removed:
            self.on_removed(removed)
