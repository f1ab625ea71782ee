"""What travels between prefill and decode: a header (who, what shape, which blocks) and raw tensor bytes.

Nothing received is ever unpickled: the header is a protobuf (or plain fields handed over by the caller),
the payload is the tensor's bytes in C order, read back with the header's dtype and shape. Payloads are
layer-major (``[num_layers, ...]``, the KV cache layout) and a layer's bytes are contiguous on the wire,
so a layer-wise sender can ship layer i while layer i+1 is still being computed.
"""

from __future__ import annotations

import math
import queue
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import crc32c
import torch

from kvstore.transfer import TransferError
from tidepool.v1 import kv_transfer_pb2

MAX_CHUNK_BYTES = 4 << 20  # gRPC messages stay far below its limits; collectives send whole layers

# An allowlist, so a header from the network can never name an arbitrary torch attribute.
DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn,
               torch.float8_e5m2, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
}


def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``value`` (so a stream can be checked piece by piece).

    CRC-32C runs on the CPU's CRC instruction (the crc32c package's C extension reads any buffer in
    place): about 3x zlib's CRC-32 on this machine, so the check costs far less than the copy it guards.
    Both ends must agree: it is fixed.
    """
    return crc32c.crc32c(data, value)


def flat_bytes(data: torch.Tensor | memoryview | bytes) -> torch.Tensor:
    """A flat uint8 tensor over ``data``'s bytes without a copy: a contiguous tensor (any dtype, bfloat16
    included, on any device) or a host buffer (a read-only one, such as gRPC's bytes, is only read)."""
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8)
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is not writable
        return torch.frombuffer(data, dtype=torch.uint8)


def device_checksum(data: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over ``data``'s bytes read as int32 words, computed where the tensor is (GPU memory
    included, no copy to the host): the plain sum catches any changed bits (a flipped bit moves it by a
    power of two, never by a multiple of 2**64), the position-weighted one moved or swapped words.
    Integer arithmetic wraps identically everywhere, so sender and receiver agree whatever their order of
    summation."""
    flat = flat_bytes(data)
    if len(flat) % 4:
        flat = torch.cat([flat, flat.new_zeros(4 - len(flat) % 4)])
    words = flat.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, len(words) + 1, dtype=torch.int64, device=data.device)
    return torch.stack([words.sum(), (words * weights).sum()])


def dtype_name(dtype: torch.dtype | str) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}")
    return name


@dataclass
class TransferHeader:
    """Describes one request's KV payload. ``checksum`` 0 means "sent after the bytes" (layer-wise).
    ``kv_format`` names the KV cache format the bytes are in (``engine/kv_format.py``): a receiver never
    imports KV of another format."""

    request_id: str
    model: str
    dtype: str
    shape: tuple[int, ...]
    block_hashes: list[int] = field(default_factory=list)
    num_layers: int = 1
    checksum: int = 0
    total_bytes: int = 0
    layerwise: bool = False
    kv_format: str = "auto"

    @classmethod
    def describe(cls, request_id: str, model: str, shape: Iterable[int], dtype: torch.dtype | str,
                 block_hashes: Iterable[int] = (), layerwise: bool = False,
                 checksum: int = 0, kv_format: str = "auto") -> TransferHeader:
        """A header for a payload of ``shape``/``dtype`` whose first dimension is the layer."""
        shape = tuple(int(d) for d in shape)
        name = dtype_name(dtype)
        header = cls(request_id=request_id, model=model, dtype=name, shape=shape,
                     block_hashes=[int(h) for h in block_hashes], num_layers=shape[0] if shape else 0,
                     checksum=checksum, total_bytes=math.prod(shape) * DTYPES[name].itemsize,
                     layerwise=layerwise, kv_format=kv_format)
        header.validate()
        return header

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def layer_bytes(self) -> int:
        return self.total_bytes // self.num_layers

    def validate(self) -> None:
        """Raise ValueError unless the fields agree with each other (run on every header received)."""
        if not self.request_id:
            raise ValueError("header has no request_id")
        itemsize = DTYPES[dtype_name(self.dtype)].itemsize
        if self.total_bytes != math.prod(self.shape) * itemsize:
            raise ValueError(f"total_bytes {self.total_bytes} != shape {list(self.shape)} x {itemsize} B")
        if not self.shape or self.num_layers != self.shape[0] or self.num_layers < 1:
            raise ValueError(f"num_layers {self.num_layers} is not the leading dim of shape {list(self.shape)}")

    def to_proto(self) -> kv_transfer_pb2.KVHeader:
        return kv_transfer_pb2.KVHeader(
            request_id=self.request_id, model=self.model, block_hashes=self.block_hashes,
            num_layers=self.num_layers, dtype=self.dtype, shape=list(self.shape), checksum=self.checksum,
            total_bytes=self.total_bytes, layerwise=self.layerwise, kv_format=self.kv_format)

    @classmethod
    def from_proto(cls, msg: kv_transfer_pb2.KVHeader) -> TransferHeader:
        header = cls(request_id=msg.request_id, model=msg.model, dtype=msg.dtype, shape=tuple(msg.shape),
                     block_hashes=list(msg.block_hashes), num_layers=msg.num_layers,
                     checksum=msg.checksum, total_bytes=msg.total_bytes, layerwise=msg.layerwise,
                     kv_format=msg.kv_format or "auto")
        header.validate()
        return header


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order: zero-copy (and writable) for a contiguous CPU tensor, else a host copy.

    Viewing as uint8 handles every dtype alike, bfloat16 included (numpy has no bfloat16).
    """
    flat = flat_bytes(tensor.detach().contiguous())
    return memoryview((flat if flat.device.type == "cpu" else flat.cpu()).numpy())


def tensor_from_bytes(data: bytes | bytearray | memoryview, dtype: str, shape: Iterable[int]) -> torch.Tensor:
    """A new CPU tensor holding a copy of ``data`` read as ``dtype``/``shape``."""
    out = torch.empty(tuple(shape), dtype=DTYPES[dtype_name(dtype)])
    view = as_bytes(out)
    if len(data) != len(view):
        raise ValueError(f"{len(data)} bytes for a {list(out.shape)} {dtype} tensor of {len(view)} bytes")
    view[:] = data
    return out


def piece_ranges(header: TransferHeader, piece_bytes: int) -> list[tuple[int, int]]:
    """The layer ranges a payload travels in: one layer each when layer-wise, else runs of whole layers
    of at most ``piece_bytes`` (or one layer, if a layer is larger), so small payloads take few messages.
    Sender and receiver derive the same ranges from the header alone."""
    per = 1 if header.layerwise else max(1, piece_bytes // max(1, header.layer_bytes))
    return [(start, min(start + per, header.num_layers)) for start in range(0, header.num_layers, per)]


def payload_pieces(header: TransferHeader, payload: torch.Tensor | Iterable[torch.Tensor],
                   piece_bytes: int) -> Iterator[torch.Tensor]:
    """Yield the payload as the tensors of ``piece_ranges``, checking it against the header.

    Layer-wise, ``payload`` may be an iterable of per-layer tensors, each pulled only when the sender is
    ready for it (so layer i leaves while layer i+1 is computed); otherwise it is the whole tensor.
    """
    if header.layerwise:
        layers = payload.unbind(0) if isinstance(payload, torch.Tensor) else payload
        count = 0
        for layer in layers:
            if count == header.num_layers:
                raise TransferError(f"payload has more than the header's {header.num_layers} layers")
            if layer.dtype != header.torch_dtype or layer.numel() * layer.element_size() != header.layer_bytes:
                raise TransferError(f"layer {count} is {layer.dtype} {list(layer.shape)}, header says "
                                    f"{header.dtype} with {header.layer_bytes} bytes per layer")
            count += 1
            yield layer
        if count != header.num_layers:
            raise TransferError(f"payload ended after {count} of {header.num_layers} layers")
        return
    if (not isinstance(payload, torch.Tensor) or tuple(payload.shape) != header.shape
            or payload.dtype != header.torch_dtype):
        raise TransferError("a payload that is not layer-wise must be the whole tensor the header describes")
    for start, end in piece_ranges(header, piece_bytes):
        yield payload[start:end]


def leave_device(layer: torch.Tensor, copy_stream: torch.cuda.Stream | None
                 ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Hand a layer computed on the current CUDA stream to a sender thread without synchronising that
    stream (which holds the rest of the forward pass): (the layer, the event after which it is complete).
    With ``copy_stream`` the layer is copied to pinned host memory on it (for a transport that sends from
    the host); without, it stays in device memory (NCCL). A host tensor is returned as it is."""
    if layer.device.type != "cuda":
        return layer, None
    ready = torch.cuda.Event()
    if copy_stream is None:
        ready.record()
        return layer, ready
    copy_stream.wait_stream(torch.cuda.current_stream(layer.device))
    with torch.cuda.stream(copy_stream):
        host = torch.empty(layer.shape, dtype=layer.dtype, pin_memory=True)
        host.copy_(layer, non_blocking=True)
        layer.record_stream(copy_stream)  # its memory is not reused before the copy is done
        ready.record(copy_stream)
    return host, ready


class LayerFeed:
    """An iterable of per-layer tensors filled from the producer's thread (e.g. a model's on_layer_done).

    The producer must end it with ``close()`` (all layers put) or ``fail(exc)`` (prefill aborted): a
    sender blocked on the next layer waits until then.
    """

    _END = object()

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.waited_s = 0.0  # the consumer's time blocked on layers not yet produced (not link time)

    def put(self, layer: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        """``ready``: on CUDA, the event after which ``layer`` holds its bytes (the consumer waits on it,
        so the producer never synchronises its stream)."""
        self._queue.put((layer, ready))

    def close(self) -> None:
        self._queue.put(self._END)

    def fail(self, exc: BaseException) -> None:
        self._queue.put(exc)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            start = time.perf_counter()
            item = self._queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise TransferError(f"layer producer failed: {item}") from item
            layer, ready = item
            if ready is not None:  # the layer is still being computed or copied out
                ready.synchronize()
            self.waited_s += time.perf_counter() - start
            yield layer
