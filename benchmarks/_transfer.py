"""What the KV transfer benchmarks share (transfer_bw.py between Ray actors, transfer_gpu.py between two
processes on a GPU): the KV shape, its header, and the sink that writes gRPC pushes into reserved blocks.

The KV is bf16 of 32 layers x 4 KV heads x 64 channels, 16-token blocks: 512 KiB a block, so sizes are
rounded to whole blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.kv_import import BlockImport
from kvstore.transfer.wire import TransferHeader

SHAPE = ModelConfig("LlamaForCausalLM", 256, 256, 256, num_layers=32, num_heads=8, num_kv_heads=4, head_dim=64)
BLOCK_SIZE = 16
BLOCK_BYTES = 2 * SHAPE.num_layers * BLOCK_SIZE * SHAPE.num_kv_heads * SHAPE.head_dim * 2  # K and V, bf16


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
