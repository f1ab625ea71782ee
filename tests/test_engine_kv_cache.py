"""Paged KV cache: block export/import (whole and per layer), copy_block, and decoding that continues
on another cache from imported blocks exactly as it would have on the original (the disaggregation path)."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache
from engine.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.timeout(120)


def test_export_import_blocks_and_layers(tiny):
    _, cfg = tiny
    src, dst = KVCache(cfg, 8, 16, "float32", "cpu"), KVCache(cfg, 8, 16, "float32", "cpu")
    src.data.normal_()
    blocks = src.export_blocks([3, 1])
    assert blocks.shape == (cfg.num_layers, 2, 2, 16, cfg.num_kv_heads, cfg.head_dim) and blocks.is_contiguous()
    assert src.block_nbytes == blocks.numel() * 4 // 2
    # the auto format travels and pools exactly as before: the attention dtype, [layers, 2, n, B, H, D]
    assert src.payload_shape(2) == tuple(blocks.shape) and src.payload_dtype == torch.float32
    assert src.block_shape == (cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim) and src.window_columns == 0
    dst.import_blocks([0, 5], blocks)
    assert torch.equal(dst.data[:, :, 0], src.data[:, :, 3]) and torch.equal(dst.data[:, :, 5], src.data[:, :, 1])
    layer = src.export_layer(2, [4])
    assert layer.shape == (2, 1, 16, cfg.num_kv_heads, cfg.head_dim)
    dst.import_layer(2, [7], layer)
    assert torch.equal(dst.data[2, :, 7], src.data[2, :, 4])
    dst.copy_block(0, 6)
    assert torch.equal(dst.data[:, :, 6], src.data[:, :, 3])
    with pytest.raises(ValueError, match="shape"):
        dst.import_blocks([0], blocks)


def greedy_decode(runner: ModelRunner, last: int, start: int, table: list[int], steps: int) -> list[int]:
    out = []
    for i in range(steps):
        last = int(runner.run([SeqChunk([last], start + i, table)])[0].argmax())
        out.append(last)
    return out


def test_decode_continues_identically_from_imported_blocks(tiny):
    model, cfg = tiny
    prefill = ModelRunner(model, cfg, KVCache(cfg, 8, 16, torch.float32, "cpu"))
    decode = ModelRunner(model, cfg, KVCache(cfg, 8, 16, torch.float32, "cpu"))
    prompt = list(range(40, 80))  # 40 tokens: 2 full blocks + 8 in a third
    src_table, dst_table = [2, 0, 5, 6], [7, 3, 1, 4]
    exported = []
    first = int(prefill.run([SeqChunk(prompt, 0, src_table)],
                            on_layer_done=lambda layer: exported.append(layer))[0].argmax())
    assert exported == list(range(cfg.num_layers))  # called once per layer, in order
    decode.kv_cache.import_blocks(dst_table[:3], prefill.kv_cache.export_blocks(src_table[:3]))
    assert greedy_decode(decode, first, 40, dst_table, 10) == greedy_decode(prefill, first, 40, src_table, 10)
