"""Every LoRA adapter of a decode batch in two launches per layer (Punica's BGMV, as vLLM and SGLang run it).

The torch path adds each adapter's ``x A^T B^T`` on its rows: a gather, two matmuls and a scatter per
adapter and layer, launched from the host, and a different launch sequence for every mix of adapters, which
no CUDA graph can hold. Here each row reads its own adapter's slot of the stacked pairs
(``engine/lora_slots.py``): ``shrink`` computes ``y = x A[s]^T`` (one program a row, float32, ``cap`` wide)
and ``expand`` adds ``y B[s]^T`` into the layer's output (one program a row and output tile). A row of the
base model (index -1) loads nothing and writes nothing. Shapes depend only on the stacks and the row count,
so a captured decode graph serves any mix of adapters loaded at replay time. A row re-reads its adapter's A
(``cap x in``), which rows of one adapter share through the L2 cache: meant for decode batches, not prompts
(those keep the per-adapter matmuls).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import next_power_of_2

_TILE_ELEMENTS = 8192


@triton.jit
def _lora_shrink_kernel(X, Index, A, Y, stride_x, stride_a0, stride_a1, stride_y, K,
                        CAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(Index + row).to(tl.int64)
    # a base-model row (slot -1) masks every load off (its bounds are 0) and keeps its pointers in bounds
    k_end = tl.where(slot >= 0, K, 0)
    r_mask = tl.arange(0, BLOCK_R) < tl.where(slot >= 0, CAP, 0)
    slot = tl.maximum(slot, 0)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(X + row * stride_x + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(A + slot * stride_a0 + offs_r[:, None] * stride_a1 + offs_k[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(Y + row * stride_y + offs_r, acc, mask=offs_r < CAP)


@triton.jit
def _lora_expand_kernel(Y, Index, B, Out, stride_y, stride_b0, stride_b1, stride_o, N,
                        CAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(Index + row).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = offs_r < tl.where(slot >= 0, CAP, 0)
    n_mask = offs_n < tl.where(slot >= 0, N, 0)  # a base-model row writes nothing
    slot = tl.maximum(slot, 0)
    y = tl.load(Y + row * stride_y + offs_r, mask=r_mask, other=0.0)
    b = tl.load(B + slot * stride_b0 + offs_n[:, None] * stride_b1 + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(b * y[None, :], axis=1)
    out = tl.load(Out + row * stride_o + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs_n, (out + delta).to(Out.dtype.element_ty), mask=n_mask)


def lora_grouped(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 index: torch.Tensor) -> torch.Tensor:
    """``out[t] += x[t] A[index[t]]^T B[index[t]]^T`` for every row whose ``index`` is >= 0, in place.

    ``x``: ``[T, in]``; ``out``: ``[T, out]``; ``a``: ``[slots, cap, in]`` and ``b``: ``[slots, out, cap]``
    (contiguous last axes); ``index``: ``[T]`` integers, -1 for a row of the base model. Returns ``out``."""
    rows, k = x.shape
    slots, cap, n = a.shape[0], a.shape[1], b.shape[1]
    if a.shape[2] != k or b.shape != (slots, n, cap) or out.shape != (rows, n) or index.shape != (rows,):
        raise ValueError(f"x {tuple(x.shape)}, out {tuple(out.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)} "
                         f"and index {tuple(index.shape)} do not fit (x [T, in], out [T, out], A [slots, cap, in], "
                         "B [slots, out, cap], index [T])")
    if x.stride(-1) != 1 or out.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("the last axes of x, out, A and B must be contiguous")
    if rows == 0:
        return out
    y = torch.empty(rows, cap, dtype=torch.float32, device=x.device)
    block_r = max(next_power_of_2(cap), 16)
    # tiles of about 8k elements (64 float32 registers a thread at 4 warps), wider for smaller ranks
    block_k = block_n = max(16, min(128, _TILE_ELEMENTS // block_r))
    _lora_shrink_kernel[(rows,)](x, index, a, y, x.stride(0), a.stride(0), a.stride(1), y.stride(0), k,
                                 CAP=cap, BLOCK_R=block_r, BLOCK_K=block_k)
    _lora_expand_kernel[(rows, triton.cdiv(n, block_n))](y, index, b, out, y.stride(0), b.stride(0), b.stride(1),
                                                         out.stride(0), n, CAP=cap, BLOCK_R=block_r,
                                                         BLOCK_N=block_n)
    return out
