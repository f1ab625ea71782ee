"""KV block bytes in two tiers: a bounded LRU in the worker's host memory, and Redis bounded by
``max_bytes`` with LRU eviction published as pool events (holder ``POOL_HOLDER``, tier ``redis``).

A stored block is ``b"TPKV" | u32 header length | JSON header | raw bytes``; the header names the model,
block hash, layers, dtype and shape, and carries a CRC-32 of the raw bytes. A block whose header does not
match what the reader asked for, or whose checksum fails, is logged as an error and treated as a miss:
it is never returned. Tensors go in and come out; the stored form is plain bytes (no pickle).
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Protocol

import torch

from kvstore.names import POOL_HOLDER
from kvstore.pool import TIERS, KVPool, execute, hex_of, lua_script, new_epoch
from kvstore.transfer.wire import DTYPES, as_bytes, checksum, dtype_name, tensor_from_bytes

log = logging.getLogger(__name__)

MAGIC = b"TPKV"
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 1 << 16  # a header is ~200 bytes of JSON; a larger length field is damage


class BlockError(ValueError):
    """A stored block failed its header or checksum check."""


class LayoutMismatch(BlockError):
    """A sound block in another layout or KV format than the reader's: a miss, not damage."""


@dataclass(frozen=True)
class BlockLayout:
    """What a reader expects of every block: dtype name, shape (``[layers, 2, block_size, heads, dim]``; a
    quantized cache's ``[layers, 1, record_bytes]``) and KV cache format (``engine/kv_format.py``)."""

    dtype: str
    shape: tuple[int, ...]
    kv_format: str = "auto"


def layout_format(layout: BlockLayout | None) -> str:
    """The KV format a tier writes its blocks in."""
    return "auto" if layout is None else layout.kv_format


def encode_block(model_id: str, block_hash: int, tensor: torch.Tensor, kv_format: str = "auto") -> bytes:
    raw = as_bytes(tensor)
    header = json.dumps({"model": model_id, "hash": hex_of(block_hash), "layers": tensor.shape[0],
                         "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                         "kv_format": kv_format, "crc32c": checksum(raw)}).encode()
    return b"".join((_PREFIX.pack(MAGIC, len(header)), header, raw))


@dataclass(frozen=True)
class _Header:
    dtype: str
    shape: tuple[int, ...]
    crc: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def _check_header(header_bytes: bytes | memoryview, model_id: str, block_hash: int,
                  layout: BlockLayout | None) -> _Header:
    """The header's layout and checksum; ``BlockError`` unless it is this model's block ``block_hash``
    (``LayoutMismatch`` if it is, in another layout or format than ``layout``)."""
    try:
        header = json.loads(bytes(header_bytes))
        model, h, layers, dtype = header["model"], header["hash"], header["layers"], header["dtype"]
        shape, crc, kv_format = tuple(header["shape"]), header["crc32c"], header.get("kv_format", "auto")
    except (ValueError, KeyError, TypeError) as e:
        raise BlockError(f"unreadable block header: {e}") from e
    if model != model_id or h != hex_of(block_hash):
        raise BlockError(f"header names model {model!r} block {h}, expected {model_id!r} {hex_of(block_hash)}")
    if dtype not in DTYPES or not shape or not all(type(d) is int and d >= 0 for d in shape) or layers != shape[0]:
        raise BlockError(f"bad header layout: dtype {dtype}, layers {layers}, shape {shape}")
    if layout is not None and (dtype, shape, kv_format) != (layout.dtype, layout.shape, layout.kv_format):
        raise LayoutMismatch(f"block is {kv_format} {dtype}{list(shape)}, reader expects {layout.kv_format} "
                         f"{layout.dtype}{list(layout.shape)}")
    return _Header(dtype, shape, crc)


def _header_length(prefix: bytes | memoryview) -> int:
    try:
        magic, size = _PREFIX.unpack_from(prefix)
    except struct.error as e:
        raise BlockError(f"unreadable block header: {e}") from e
    if magic != MAGIC or size > MAX_HEADER_BYTES:
        raise BlockError(f"not a stored block (magic {bytes(magic)!r}, header length {size})")
    return size


def decode_block(data: bytes, model_id: str, block_hash: int, layout: BlockLayout | None = None) -> torch.Tensor:
    """The block's tensor; raises ``BlockError`` unless header and checksum match."""
    size = _header_length(data)
    header = _check_header(memoryview(data)[_PREFIX.size:_PREFIX.size + size], model_id, block_hash, layout)
    raw = memoryview(data)[_PREFIX.size + size:]
    if len(raw) != header.nbytes or checksum(raw) != header.crc:
        raise BlockError("checksum or length mismatch")
    return tensor_from_bytes(raw, header.dtype, header.shape)


def read_block(f: BinaryIO, model_id: str, block_hash: int, layout: BlockLayout | None = None) -> torch.Tensor:
    """``decode_block`` of a stored block read from the unbuffered file ``f``: the raw bytes are read
    straight into the new tensor and checked there, so a page-cached block costs one copy and one
    checksum pass, not the three passes of reading the file, checking it and copying it out."""
    prefix = f.read(_PREFIX.size)
    header_bytes = f.read(_header_length(prefix))
    header = _check_header(header_bytes, model_id, block_hash, layout)
    if os.fstat(f.fileno()).st_size - f.tell() != header.nbytes:  # before allocating what the header says
        raise BlockError("checksum or length mismatch")
    out = torch.empty(header.shape, dtype=DTYPES[header.dtype])
    view, got = as_bytes(out), 0
    while got < len(view) and (n := f.readinto(view[got:])):
        got += n
    if got != len(view) or checksum(view) != header.crc:
        raise BlockError("checksum or length mismatch")
    return out


class BlockTier(Protocol):
    def get_prefix(self, hashes: Sequence[int]) -> list[torch.Tensor]: ...


def fetch_prefix(hashes: Sequence[int], tiers: Sequence[BlockTier]) -> list[torch.Tensor]:
    """Blocks for the longest leading run of ``hashes`` the tiers hold, in order, fastest tier first
    (e.g. ``[host, disk, redis]``): at each position the first tier not yet asked there continues the
    run, so a hole in one tier is filled from another and the first can go on after it."""
    out: list[torch.Tensor] = []
    missed_at = [-1] * len(tiers)  # the position each tier last stopped at
    while len(out) < len(hashes):
        i = next((i for i, at in enumerate(missed_at) if at < len(out)), None)
        if i is None:
            break
        out.extend(tiers[i].get_prefix(hashes[len(out):]))
        missed_at[i] = len(out)
    return out


def _prefix(blocks: list[torch.Tensor | None]) -> list[torch.Tensor]:
    n = next((i for i, b in enumerate(blocks) if b is None), len(blocks))
    return blocks[:n]  # type: ignore[return-value]


class HostTier:
    """A bounded LRU of encoded blocks in this process's memory. ``on_stored``/``on_removed`` (e.g. from
    ``PoolPublisher.callbacks("host")``) hear which hashes entered and left it."""

    def __init__(self, model_id: str, max_bytes: int, layout: BlockLayout | None = None,
                 on_stored: Callable[[list[int]], None] | None = None,
                 on_removed: Callable[[list[int]], None] | None = None) -> None:
        self.model_id, self.max_bytes, self.layout = model_id, max_bytes, layout
        self.on_stored, self.on_removed = on_stored, on_removed
        self.nbytes = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def put_blocks(self, hashes: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        encoded = [(h, encode_block(self.model_id, h, t, layout_format(self.layout)))
                   for h, t in zip(hashes, tensors, strict=True)]
        stored: list[int] = []
        with self._lock:
            for h, data in encoded:
                old = self._blocks.pop(h, None)
                self.nbytes += len(data) - (len(old) if old is not None else 0)
                self._blocks[h] = data
                if old is None:
                    stored.append(h)
            evicted = self._evict_locked()
        self._notify(stored, evicted)

    def get_blocks(self, hashes: Sequence[int]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        bad: list[int] = []
        with self._lock:
            found = [self._blocks.get(h) for h in hashes]
            for h, data in zip(hashes, found, strict=True):
                if data is not None:
                    self._blocks.move_to_end(h)
        for h, data in zip(hashes, found, strict=True):
            out.append(None if data is None else self._decode(h, data, bad))
        if bad:
            with self._lock:
                for h in bad:
                    self.nbytes -= len(self._blocks.pop(h, b""))
            self._notify([], bad)
        return out

    def get_prefix(self, hashes: Sequence[int]) -> list[torch.Tensor]:
        return _prefix(self.get_blocks(hashes))

    def _decode(self, h: int, data: bytes, bad: list[int]) -> torch.Tensor | None:
        try:
            return decode_block(data, self.model_id, h, self.layout)
        except BlockError as e:
            log.error("host tier: block %s rejected (%s); treating it as a miss", hex_of(h), e)
            bad.append(h)
            return None

    def _evict_locked(self) -> list[int]:
        evicted = []
        while self.nbytes > self.max_bytes and self._blocks:
            h, data = self._blocks.popitem(last=False)
            self.nbytes -= len(data)
            evicted.append(h)
        return evicted

    def _notify(self, stored: list[int], removed: list[int]) -> None:
        if stored and self.on_stored:
            self.on_stored(stored)
        if removed and self.on_removed:
            self.on_removed(removed)


# kvstore/lua/payload_*.lua take the Redis tier's holder name and bit from Python, where they are defined.
_BIND = f"local holder, tierbit = '{POOL_HOLDER}', {TIERS['redis']}\n"
_COMMIT = _BIND + lua_script("payload_prelude", "payload_commit")
_TOUCH = _BIND + lua_script("payload_prelude", "payload_touch")
_DISCARD = _BIND + lua_script("payload_prelude", "payload_discard")
_LEADING = _BIND + lua_script("payload_prelude", "payload_leading")


class RedisTier:
    """Blocks in Redis under the pool's namespace, shared by every worker of the model. Writes that
    push the total past ``max_bytes`` evict the least recently used blocks; each put and eviction is
    published in the pool index. A batch is one pipeline: native SET/GET for the bytes plus one Lua
    call for the accounting, index and events."""

    ORPHAN_TTL_S = 600  # bytes whose commit never ran (a connection lost mid-batch) expire

    def __init__(self, pool: KVPool, max_bytes: int, layout: BlockLayout | None = None) -> None:
        self.pool, self.max_bytes, self.layout = pool, max_bytes, layout
        self._commit = pool.script(_COMMIT)
        self._touch = pool.script(_TOUCH)
        self._discard = pool.script(_DISCARD)
        self._leading = pool.script(_LEADING)

    def _key(self, h: int) -> str:
        return f"{self.pool.ns}p:{hex_of(h)}"

    def put_blocks(self, hashes: Sequence[int], tensors: Sequence[torch.Tensor]) -> bool:
        """Store blocks in one round trip; False (and logged) when Redis dropped them."""
        encoded = [encode_block(self.pool.model_id, h, t, layout_format(self.layout))
                   for h, t in zip(hashes, tensors, strict=True)]
        if not encoded:
            return True

        def send() -> bool:
            pipe = self.pool.client.pipeline(transaction=False)
            for h, data in zip(hashes, encoded, strict=True):
                pipe.set(self._key(h), data, ex=self.ORPHAN_TTL_S)
            pipe.evalsha(self._commit.sha, 0, self.pool.ns, self.pool.stream_maxlen, new_epoch(), self.max_bytes,
                         *map(hex_of, hashes))
            execute(pipe)
            return True
        return self.pool.run(send, False)

    def get_blocks(self, hashes: Sequence[int]) -> list[torch.Tensor | None]:
        """Each block, or None for a miss, a bad block, or Redis unreachable; one round trip."""
        return self._read(hashes, touch=True)

    def get_prefix(self, hashes: Sequence[int]) -> list[torch.Tensor]:
        """The leading blocks up to the first miss. One script call finds how many lead (and marks them
        used), then only those are read: a fresh prompt, whose first block is missing, costs one small
        round trip instead of a GET for each of its blocks."""
        if not hashes:
            return []
        leading = self.pool.run(lambda: int(self.pool.client.evalsha(self._leading.sha, 0, self.pool.ns,
                                                                    *map(hex_of, hashes))), 0)
        return _prefix(self._read(hashes[:leading], touch=False))

    def _read(self, hashes: Sequence[int], touch: bool) -> list[torch.Tensor | None]:
        if not hashes:
            return []

        def fetch() -> list:
            pipe = self.pool.client.pipeline(transaction=False)
            for h in hashes:
                pipe.get(self._key(h))
            if touch:
                pipe.evalsha(self._touch.sha, 0, self.pool.ns, *map(hex_of, hashes))
            return execute(pipe)[: len(hashes)]
        raw = self.pool.run(fetch, [None] * len(hashes))
        out: list[torch.Tensor | None] = [None] * len(hashes)
        bad = []
        for i, data in enumerate(raw):
            if data is not None:
                try:
                    out[i] = decode_block(data, self.pool.model_id, hashes[i], self.layout)
                except LayoutMismatch:
                    pass  # another deployment's format (e.g. a quantized cache) sharing this Redis: not ours to drop
                except BlockError as e:
                    log.error("redis tier: block %s rejected (%s); treating it as a miss", hex_of(hashes[i]), e)
                    bad.append(hashes[i])
        if bad:
            self.discard(bad)
        return out

    def discard(self, hashes: Sequence[int]) -> bool:
        """Remove blocks (e.g. ones that failed their check) and publish their removal."""
        args = [self.pool.ns, self.pool.stream_maxlen, new_epoch(), *map(hex_of, hashes)]
        return self.pool.run(lambda: self.pool.client.evalsha(self._discard.sha, 0, *args) is not None, False)

    def nbytes(self) -> int | None:
        """Payload bytes stored in Redis (None while unreachable)."""
        return self.pool.run(lambda: int(self.pool.client.get(self.pool.ns + "pbytes") or 0), None)
