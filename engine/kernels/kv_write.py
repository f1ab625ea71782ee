"""Write new K/V rows into their slots of one layer's paged cache (Triton).

Slot ``s`` is token offset ``s % block_size`` of block ``s // block_size`` (the runner's slot mapping),
so the cache is addressed through its 4-D strides and the layer view never has to be contiguous.
A negative slot writes nothing: padded rows (a CUDA-graph batch rounded up) carry slot -1, as in vLLM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import check_paged_cache, next_power_of_2


@triton.jit
def _kv_write_kernel(
    K, V, KCache, VCache, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
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
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst_k = KCache + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = VCache + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(dst_k, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(VCache.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k[t]``/``v[t]`` (each ``[num_tokens, kv_heads, head_dim]``, head_dim contiguous) at slot
    ``slot_mapping[t]`` of ``k_cache``/``v_cache`` (each ``[num_blocks, block_size, kv_heads, head_dim]``),
    casting to the cache dtype; rows with a negative slot are skipped."""
    _, block_size, num_heads, head_dim = check_paged_cache(k_cache, v_cache)
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (num_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} must be "
                         f"[num_tokens, {num_heads}, {head_dim}]")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} needs one slot per token ({k.shape[0]})")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the head_dim axis of k and v must be contiguous")
    if k.shape[0] == 0:
        return
    _kv_write_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=next_power_of_2(num_heads),
        BLOCK_D=next_power_of_2(head_dim), PAGE=block_size,
    )
