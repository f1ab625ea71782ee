"""Rotary position embedding applied to q and k in place (Triton), one program per token.

The model rotates with ``x * cos + rotate_half(x) * sin`` (transformers' form: ``cos``/``sin`` are
``cat(freqs, freqs)``, ``rotate_half`` swaps the halves and negates the second): six elementwise kernels
and four temporaries per layer. Here each token's q and k heads are read once, rotated in float32 and
written back over themselves (q and k may be strided views of the fused qkv projection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import next_power_of_2


@triton.jit
def _rotate_heads(X, t, stride_t, stride_h, cos, sin, offs_d, dmask,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < NUM_HEADS) & dmask[None, :]
    first = X + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = X.dtype.element_ty
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
    Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HALF
    cos = tl.load(Cos + t * stride_ct + offs_d, mask=dmask, other=0.0).to(tl.float32)  # both halves equal
    sin = tl.load(Sin + t * stride_ct + offs_d, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(Q, t, stride_qt, stride_qh, cos, sin, offs_d, dmask, Q_HEADS, HALF, BLOCK_QH)
    _rotate_heads(K, t, stride_kt, stride_kh, cos, sin, offs_d, dmask, K_HEADS, HALF, BLOCK_KH)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q`` ``[T, q_heads, head_dim]`` and ``k`` ``[T, kv_heads, head_dim]`` in place by ``cos``/
    ``sin`` ``[T, 1, head_dim]`` (``engine.model.rope_cos_sin``); head_dim contiguous in all four."""
    tokens, _, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [tokens, heads, even head_dim]")
    if cos.shape != (tokens, 1, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [{tokens}, 1, {head_dim}]")
    if any(x.stride(-1) != 1 for x in (q, k, cos, sin)) or cos.stride() != sin.stride():
        raise ValueError("head_dim must be contiguous in q, k, cos and sin (cos and sin laid out alike)")
    if tokens == 0:
        return
    _rope_kernel[(tokens,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        Q_HEADS=q.shape[1], K_HEADS=k.shape[1], HALF=head_dim // 2, BLOCK_QH=next_power_of_2(q.shape[1]),
        BLOCK_KH=next_power_of_2(k.shape[1]), BLOCK_D=next_power_of_2(head_dim // 2),
    )
