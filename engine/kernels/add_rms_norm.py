"""Residual add fused with the RMSNorm that follows it (Triton), as each decoder layer runs them.

A layer does ``h = h + attn_out`` then ``post_attention_layernorm(h)`` (and the same around the MLP):
two passes over ``[tokens, hidden]`` plus the norm's float32 temporaries. Here one program per row reads
both inputs once, writes the sum back into the residual in place (vLLM's ``fused_add_rms_norm``) and the
normalized row out. The arithmetic follows ``engine.model.RMSNorm`` and torch's add: the sum rounded to
the activation dtype, float32 statistics, the normalized row cast back, then scaled by the weight in the
activation dtype (Gemma's norm, ``scale_first``: scaled by its float32 weight, then cast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import next_power_of_2


@triton.jit
def _add_rms_norm_kernel(
    X, Residual, Weight, Out, stride_x, stride_r, stride_o, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, SCALE_FIRST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    dtype = Residual.dtype.element_ty
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(dtype)  # the residual stream keeps the activation dtype, as torch's add rounds it
    tl.store(Residual + row * stride_r + offs, h, mask=mask)
    h32 = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h32 * h32, 0) / HIDDEN + eps)
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    y = h32 * inv_rms
    if not SCALE_FIRST:
        y = y.to(dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * y).to(Out.dtype.element_ty), mask=mask)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None, scale_first: bool = False) -> torch.Tensor:
    """``residual += x`` in place, then RMSNorm of the new residual with ``weight`` and ``eps``.

    ``x``/``residual``: ``[tokens, hidden]`` with a contiguous hidden axis, same dtype; ``weight``:
    ``[hidden]``; ``scale_first``: Gemma's norm (its float32 weight scales the row before the cast). Returns
    ``out`` (allocated like ``residual`` when None)."""
    if x.dim() != 2 or x.shape != residual.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be [tokens, hidden] "
                         f"and weight {tuple(weight.shape)} [hidden]")
    if x.dtype != residual.dtype:
        raise ValueError(f"x dtype {x.dtype} != residual dtype {residual.dtype}")
    out = torch.empty_like(residual) if out is None else out
    if out.shape != residual.shape:
        raise ValueError(f"out {tuple(out.shape)} must be shaped like residual {tuple(residual.shape)}")
    if x.stride(-1) != 1 or residual.stride(-1) != 1 or out.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError("the hidden axis of x, residual, out and weight must be contiguous")
    if x.shape[0] == 0:
        return out
    hidden = x.shape[1]
    _add_rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), eps,
        HIDDEN=hidden, BLOCK=next_power_of_2(hidden), SCALE_FIRST=scale_first,
    )
    return out
