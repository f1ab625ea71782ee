"""Host-side helpers shared by the kernel launchers (no jitted code lives here, so reloading a kernel
module under ``TRITON_INTERPRET=1`` never depends on another module's decoration)."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when ``@triton.jit`` builds interpreter functions (CPU emulation) instead of GPU kernels."""
    try:
        from triton import knobs
        return bool(knobs.runtime.interpret)
    except ImportError:  # triton < 3.4 has no knobs module; it reads the environment directly
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def upcast(dtype: torch.dtype) -> bool:
    """Whether a kernel should compute on fp32 copies of its tiles.

    The interpreter emulates bfloat16 arithmetic wrongly (a bf16 ``a + b`` or ``tl.dot`` comes back as
    garbage) while its conversions are exact, so bf16 tiles are upcast there. On a GPU every dtype keeps
    its native tensor-core path."""
    return interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches get exact dots: Triton's default tf32 would cost ~1e-3 relative error in the scores.
    For fp16/bf16 operands the setting has no effect ("tf32" is Triton's own default)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def default_tile(dtype: torch.dtype) -> int:
    """Key (and query) tile length: 64 for 16-bit caches; 32 for fp32, whose pipelined K/V tiles at
    head_dim 128 would otherwise outgrow an SM's shared memory."""
    return 32 if dtype == torch.float32 else 64


def check_tile(name: str, n: int) -> int:
    """Tiles are powers of two (``tl.arange``) and at least 16 (the smallest ``tl.dot`` side on GPUs)."""
    if n < 16 or n & (n - 1):
        raise ValueError(f"{name}={n} must be a power of two >= 16")
    return n


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate one layer's K and V caches, each ``[num_blocks, block_size, kv_heads, head_dim]`` (any
    strides, head_dim contiguous); returns that shape."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "[num_blocks, block_size, kv_heads, head_dim]")
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError("k_cache and v_cache must share dtype and device")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of the caches must be contiguous")
    nb, bs, hkv, d = k_cache.shape
    return nb, bs, hkv, d
