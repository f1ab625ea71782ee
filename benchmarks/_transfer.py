"""What the KV transfer benchmarks share (transfer_bw.py between Ray actors, transfer_gpu.py between two
processes on a GPU): the KV shape, its header, and the sink that writes gRPC pushes into reserved blocks.

The KV is bf16 of 32 layers x 4 KV heads x 64 channels, 16-token blocks: 512 KiB a block, so sizes are
rounded to whole blocks.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.kv_import import BlockImport
from kvstore.transfer.wire import MAX_CHUNK_BYTES, TransferHeader, flat_bytes

SHAPE = ModelConfig("LlamaForCausalLM", 256, 256, 256, num_layers=32, num_heads=8, num_kv_heads=4, head_dim=64)
BLOCK_SIZE = 16
BLOCK_BYTES = 2 * SHAPE.num_layers * BLOCK_SIZE * SHAPE.num_kv_heads * SHAPE.head_dim * 2  # K and V, bf16
RAW_AHEAD = 4  # gloo-raw: messages in flight, as the collective channel keeps them


def kv_header(request_id: str, num_blocks: int, layerwise: bool = False) -> TransferHeader:
    shape = (SHAPE.num_layers, 2, num_blocks, BLOCK_SIZE, SHAPE.num_kv_heads, SHAPE.head_dim)
    return TransferHeader.describe(request_id, "bench", shape, torch.bfloat16, layerwise=layerwise)


def blocks_for(sizes_mib: str) -> list[int]:
    """``--sizes`` ("1,16,256", MiB) as whole blocks, at least one each."""
    return [max(1, round(float(s) * (1 << 20) / BLOCK_BYTES)) for s in sizes_mib.split(",")]


class BlockSink:
    """A KVSink writing each push straight into the receiver's reserved blocks (as a decode worker's does):
    ``reserved(header)`` names the blocks of ``cache`` a push lands in."""

    def __init__(self, cache: KVCache, reserved: Callable[[TransferHeader], list[int]]) -> None:
        self._cache, self._reserved, self.done = cache, reserved, threading.Event()
        self.error: str | None = None

    def begin(self, header: TransferHeader) -> BlockSink.Writer:
        return BlockSink.Writer(self, BlockImport(self._cache, self._reserved(header)))

    class Writer:
        def __init__(self, sink: BlockSink, arrival: BlockImport) -> None:
            self._sink, self._arrival = sink, arrival

        def write(self, offset: int, data: memoryview) -> None:
            self._arrival.write(offset, data)

        def commit(self) -> None:
            self._arrival.finish()
            self._sink.done.set()

        def abort(self, reason: str) -> None:
            self._sink.error = reason
            self._sink.done.set()


def raw_gloo_group(store: dist.Store, rank: int) -> dist.ProcessGroup:
    """gloo-raw's pair (rank 0 receives, 1 sends): a plain gloo group beside the channel's."""
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=120))


def raw_gloo_send(group: dist.ProcessGroup, payload: torch.Tensor) -> None:
    """gloo-raw: the payload's bytes in messages of the channel's size, nothing done to them."""
    flat, in_flight = flat_bytes(payload), deque()
    for start in range(0, len(flat), MAX_CHUNK_BYTES):
        in_flight.append(group.send([flat[start:start + MAX_CHUNK_BYTES]], 0, 0))
        while len(in_flight) > RAW_AHEAD:
            in_flight.popleft().wait()
    for work in in_flight:
        work.wait()


def raw_gloo_recv(group: dist.ProcessGroup, nbytes: int) -> None:
    """gloo-raw: receive ``nbytes`` into a few rotating buffers and drop them (no check, no placing)."""
    ring = [torch.empty(MAX_CHUNK_BYTES, dtype=torch.uint8) for _ in range(RAW_AHEAD)]
    sizes = [min(MAX_CHUNK_BYTES, nbytes - start) for start in range(0, nbytes, MAX_CHUNK_BYTES)]

    def post(m: int) -> dist.Work:
        return group.recv([ring[m % RAW_AHEAD][:sizes[m]]], 1, 0)

    posted = deque(post(m) for m in range(min(RAW_AHEAD, len(sizes))))
    for i in range(len(sizes)):
        posted.popleft().wait()
        if i + RAW_AHEAD < len(sizes):
            posted.append(post(i + RAW_AHEAD))
