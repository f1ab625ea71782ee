"""Write new K/V rows into their slots of one layer's paged cache (Triton), quantizing them for int8.

Slot ``s`` is token offset ``s % block_size`` of block ``s // block_size`` (the runner's slot mapping),
so the cache is addressed through its 4-D strides and the layer view never has to be contiguous.
A negative slot writes nothing: padded rows (a CUDA-graph batch rounded up) carry slot -1, as in vLLM.

With ``quant`` (an int8 cache: the caches are its code views) each token's heads are quantized as
``engine/kv_quant.quantize_int8`` does, bit for bit: scale = amax / 127 rounded to fp16 (1 for an all-zero
head), code = x / scale rounded half to even, so either writer leaves the same record.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import QuantizedKV, check_paged_cache, next_power_of_2


@triton.jit
def _quantize_int8(x):
    """``x`` [rows, cols] fp32 -> (codes as fp32 integers in [-127, 127], one fp16 scale per row). IEEE
    divisions and an exact half-to-even rounding (floor(y + 0.5) is exact for |y| <= 127.5) keep the codes
    equal to torch's."""
    scale = tl.minimum(tl.math.div_rn(tl.max(tl.abs(x), 1), 127.0), 65504.0).to(tl.float16)
    scale = tl.where(scale > 0, scale, 1.0).to(tl.float16)
    y = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
    r = tl.floor(y + 0.5)
    r = tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)  # ties to even
    return tl.minimum(tl.maximum(r, -127.0), 127.0), scale


@triton.jit
def _kv_write_kernel(
    K, V, KCache, VCache, Slots, KScale, VScale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_sb, stride_st,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, SCALED: tl.constexpr,
):
    t = tl.program_id(0)  # one program per token: all its heads are one [BLOCK_H, BLOCK_D] tile
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    dst_k = KCache + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = VCache + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    if SCALED:
        k, k_scale = _quantize_int8(k.to(tl.float32))
        v, v_scale = _quantize_int8(v.to(tl.float32))
        scales = blk * stride_sb + off * stride_st + offs_h
        tl.store(KScale + scales, k_scale, mask=offs_h < NUM_HEADS)
        tl.store(VScale + scales, v_scale, mask=offs_h < NUM_HEADS)
    tl.store(dst_k, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(VCache.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, quant: QuantizedKV | None = None) -> None:
    """Store ``k[t]``/``v[t]`` (each ``[num_tokens, kv_heads, head_dim]``, head_dim contiguous) at slot
    ``slot_mapping[t]`` of ``k_cache``/``v_cache`` (each ``[num_blocks, block_size, kv_heads, head_dim]``),
    casting to the cache dtype, or with ``quant`` quantized into int8 codes and their per-token scales
    (``quant.k_scale``/``v_scale`` ``[num_blocks, block_size, kv_heads, 1]``; no windows); rows with a
    negative slot are skipped."""
    _, block_size, num_heads, head_dim = check_paged_cache(k_cache, v_cache)
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (num_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} must be "
                         f"[num_tokens, {num_heads}, {head_dim}]")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} needs one slot per token ({k.shape[0]})")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the head_dim axis of k and v must be contiguous")
    if quant is not None and (k_cache.dtype != torch.int8 or quant.k_window is not None
                              or quant.k_scale.stride() != quant.v_scale.stride()
                              or quant.k_scale.shape != (*k_cache.shape[:3], 1) or quant.k_scale.stride(2) != 1):
        raise ValueError("a quantizing write takes int8 codes with per-token scales [num_blocks, block_size, "
                         "kv_heads, 1] sharing strides, and no windows")
    if k.shape[0] == 0:
        return
    k_scale, v_scale = (k_cache, v_cache) if quant is None else (quant.k_scale, quant.v_scale)
    _kv_write_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=next_power_of_2(num_heads),
        BLOCK_D=next_power_of_2(head_dim), PAGE=block_size, SCALED=quant is not None,
    )
