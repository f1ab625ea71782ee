"""``x @ W.T`` for integer weights (``engine/int_weights.py``: AWQ, GPTQ and compressed-tensors checkpoints):
W4A16 and W8A16, one Triton launch a projection.

The weight stays packed, two 4-bit codes a byte ``[N, K / 2]`` or an 8-bit one ``[N, K]``, with float32 scales
and uint8 zeros ``[N, groups]``, so a decode step reads half a byte (or one) a weight instead of two. A program
computes a ``BLOCK_M x BLOCK_N`` tile of the output: each ``BLOCK_K`` slice of the weight is read a byte per
``8 / BITS`` rows of the slice (a 4-bit byte loaded for both of its codes, from the same cache line) and shifted
to its code; code minus zero (-255..255, exact in every float type) goes into the tensor-core product in x's
dtype, and the float32 partial sum is scaled by its rows' scale for that slice (``BLOCK_K`` divides the group,
so one scale and zero per row cover it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._tile import _codes_minus_zero
from engine.kernels.common import slice_k, weight_matmul_launch


@triton.jit
def _int_matmul_kernel(
    X, W, S, Z, Y, M, N, K, stride_xm, stride_wn, stride_sn, stride_zn, stride_ym,
    GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    per_byte: tl.constexpr = 8 // BITS
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_m, in_n = offs_m < M, offs_n < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[None, :].to(tl.int64) * stride_wn + (offs_k // per_byte)[:, None]
    shift = ((offs_k % per_byte) * BITS)[:, None]  # 4-bit: even rows of the slice in the low nibble
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = offs_k + k0 < K
        x = tl.load(x_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
        packed = tl.load(w_ptrs, mask=in_k[:, None] & in_n[None, :], other=0)
        group = k0 // GROUP
        zero = tl.load(Z + offs_n.to(tl.int64) * stride_zn + group, mask=in_n, other=0)
        scale = tl.load(S + offs_n.to(tl.int64) * stride_sn + group, mask=in_n, other=0.0)
        codes = _codes_minus_zero(packed, shift, zero, BITS)
        if UPCAST:
            x = x.to(tl.float32)
        acc += tl.dot(x, codes.to(x.dtype), input_precision=PREC) * scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // per_byte
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def int_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bits: int) -> torch.Tensor:
    """``x`` ``[M, K]`` (fp32, fp16 or bf16) times the dequantized weight ``[N, K]`` transposed: ``[M, N]`` in
    x's dtype. ``packed`` uint8 ``[N, K / 2]`` with 4-bit codes (column 2j in byte j's low nibble) or ``[N, K]``
    with 8-bit ones, ``scales`` float32 and ``zeros`` uint8 ``[N, groups]``, the groups splitting K evenly into
    multiples of 16 (or one group a row)."""
    m, k = x.shape
    n, groups = scales.shape
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    cols = k * bits // 8
    if packed.dtype != torch.uint8 or packed.shape != (n, cols) or k % (8 // bits) or packed.stride(1) != 1:
        raise ValueError(f"packed {bits}-bit codes must be uint8 [{n}, {cols}] with contiguous rows, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    if scales.dtype != torch.float32 or zeros.dtype != torch.uint8 or zeros.shape != scales.shape:
        raise ValueError(f"scales must be float32 and zeros uint8 of one shape, got {scales.dtype} "
                         f"{tuple(scales.shape)} and {zeros.dtype} {tuple(zeros.shape)}")
    group = k // groups
    if group * groups != k or (groups > 1 and group % 16):
        raise ValueError(f"{groups} groups must split K = {k} into multiples of 16")
    x, y, grid, options = weight_matmul_launch(x, n)
    if m == 0:
        return y
    _int_matmul_kernel[grid](
        x, packed, scales, zeros, y, m, n, k, x.stride(0), packed.stride(0), scales.stride(0), zeros.stride(0),
        y.stride(0), GROUP=group, BITS=bits, BLOCK_K=slice_k(group, k, x.dtype), **options,
    )
    return y
