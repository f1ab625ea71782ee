"""Triton kernels for the GPU engine: paged decode and prefill attention, the K/V cache write, the
residual add fused with RMSNorm, RoPE in place, a mixture of experts' matmuls, the LoRA adapters of a
decode batch (``engine/model.py`` uses them all on the Triton backend), fp8 and integer weights' matmuls
and W8A8's per-row int8 quantization (on every CUDA step).

The attention and write kernels take one layer's cache as ``k_cache``/``v_cache``
``[num_blocks, block_size, kv_heads, head_dim]`` (``KVCache.data[layer, 0]`` and ``[layer, 1]``), or a
quantized layer's int8/fp8 code views with their scales (``common.QuantizedKV``).
Importing this package never imports triton: the kernel functions load on first access, so the CPU path
can ask ``triton_available()`` first. The torch references in ``engine.kernels.reference`` need only torch.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

# public name -> module that defines it (imported on first attribute access, never cached here, so a
# test that reloads a module under TRITON_INTERPRET=1 is seen by later lookups)
_LAZY = {
    "apply_rope": "engine.kernels.rope",
    "fused_add_rms_norm": "engine.kernels.add_rms_norm",
    "fp8_matmul": "engine.kernels.fp8_gemm",
    "fused_moe": "engine.kernels.moe_experts",
    "int_matmul": "engine.kernels.int_gemm",
    "int8_rows": "engine.kernels.int8_rows",
    "lora_grouped": "engine.kernels.lora_matmul",
    "paged_decode_attention": "engine.kernels.paged_decode",
    "paged_prefill_attention": "engine.kernels.paged_prefill",
    "write_kv": "engine.kernels.kv_write",
}

__all__ = ["apply_rope", "fp8_matmul", "fused_add_rms_norm", "fused_moe", "int8_rows", "int_matmul", "lora_grouped",
           "paged_decode_attention", "paged_prefill_attention", "triton_available", "write_kv"]


@cache
def triton_available() -> bool:
    """Whether triton imports here (it says nothing about a GPU: without one the kernels only run
    under ``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install failing in its own import code
        return False
    return True


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
