"""Each row of a matrix quantized to int8 in one launch (Triton): W8A8's activations (``engine/w8a8.py``).

The torch path takes six passes over the rows (float copy, absolute value, absmax, reciprocal, product,
rounding); here one program a row reads it once for its absmax and once more for its codes. The arithmetic is
the torch path's: ``scale = max(absmax / 127, the smallest normal float)`` and ``code = rint(x * (1 / scale))``
clamped to [-128, 127], each division rounded as IEEE rounds it, so the codes and scales are the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import next_power_of_2

_TINY = torch.finfo(torch.float32).tiny


@triton.jit
def _round_half_even(y):
    """``y`` rounded to the nearest integer, ties to even (torch.round's rule)."""
    r = tl.floor(y + 0.5)
    return tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)


@triton.jit
def _int8_rows_kernel(X, Codes, Scales, cols, stride_x, tiny, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    absmax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, cols, BLOCK):
        x = tl.load(X + row * stride_x + c0 + offs, mask=c0 + offs < cols, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(absmax, axis=0), 127.0), tiny)
    inverse = tl.div_rn(1.0, scale)
    for c0 in range(0, cols, BLOCK):
        mask = c0 + offs < cols
        x = tl.load(X + row * stride_x + c0 + offs, mask=mask, other=0.0).to(tl.float32)
        codes = tl.minimum(tl.maximum(_round_half_even(x * inverse), -128.0), 127.0)
        tl.store(Codes + row * cols + c0 + offs, codes.to(tl.int8), mask=mask)
    tl.store(Scales + row, scale)


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, cols]`` (a contiguous last axis) -> (int8 codes ``[rows, cols]``, float32 scales
    ``[rows, 1]``): each row's absmax maps to 127, a row of zeros to zeros."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [rows, cols] with contiguous columns")
    rows, cols = x.shape
    codes = torch.empty(rows, cols, dtype=torch.int8, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _int8_rows_kernel[(rows,)](x, codes, scales, cols, x.stride(0), _TINY,
                                   BLOCK=min(1024, next_power_of_2(cols)),
                                   enable_fp_fusion=False)  # x * inverse rounded before the + 0.5, as torch does
    return codes, scales
