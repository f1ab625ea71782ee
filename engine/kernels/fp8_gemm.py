"""``x @ W.T`` for fp8 weights (``engine/weight_quant.py``): W8A16, one Triton launch a projection.

The weight stays in e4m3 codes ``[N, K]`` with float32 scales ``[N, ceil(K / k_block)]``, so a decode step reads
one byte a weight instead of two: on a memory-bound step that is most of the time. A program computes a
``BLOCK_M x BLOCK_N`` tile of the output: each ``BLOCK_K`` slice of the codes is converted to x's dtype (exact:
every e4m3 value is a bf16 and an fp16 value), multiplied with x's slice on the tensor cores, and the
float32 partial sum is scaled by its rows' scale for that slice (``BLOCK_K`` divides ``k_block``, so one
scale per row covers it). With one scale per row (``k_block`` = K) the scale is applied once at the end.
On GPUs before sm_89, which have no e4m3 type in Triton, the codes are read as bytes and converted with
integer ops (``_tile._e4m3_bytes_as_half``, 2^-8 times their value; the scale takes the 2^8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import common
from engine.kernels._tile import _e4m3_bytes_as_half
from engine.kernels.common import slice_k, weight_matmul_launch


@triton.jit
def _fp8_matmul_kernel(
    X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    K_BLOCK: tl.constexpr, SCALE_AT_END: tl.constexpr, CODES_AS_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_m, in_n = offs_m < M, offs_n < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_ptrs = S + offs_n.to(tl.int64) * stride_sn
    byte_scale = 256.0 if CODES_AS_BYTES else 1.0  # codes read as bytes come out 2^-8 times their value
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = offs_k + k0 < K
        x = tl.load(x_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
        codes = tl.load(w_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
        if CODES_AS_BYTES:
            codes = _e4m3_bytes_as_half(codes)
        if UPCAST:
            x = x.to(tl.float32)
        w = codes.to(x.dtype)
        if SCALE_AT_END:
            acc = tl.dot(x, w, acc, input_precision=PREC)
        else:
            scale = tl.load(s_ptrs + k0 // K_BLOCK, mask=in_n, other=0.0)
            acc += tl.dot(x, w, input_precision=PREC) * (scale * byte_scale)[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALE_AT_END:
        acc = acc * (tl.load(s_ptrs, mask=in_n, other=0.0) * byte_scale)[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def fp8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, k_block: int) -> torch.Tensor:
    """``x`` ``[M, K]`` (fp32, fp16 or bf16) times the dequantized ``codes`` ``[N, K]`` (float8 e4m3) transposed:
    ``[M, N]`` in x's dtype. ``scales`` ``[N, ceil(K / k_block)]`` float32; a ``k_block`` below K must be a
    multiple of 16."""
    m, k = x.shape
    n = codes.shape[0]
    if codes.dtype != torch.float8_e4m3fn or codes.shape[1] != k or codes.stride(1) != 1:
        raise ValueError(f"codes must be float8_e4m3fn [N, {k}] with contiguous rows, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if scales.dtype != torch.float32 or scales.shape != (n, -(-k // k_block)) or scales.stride(1) != 1:
        raise ValueError(f"scales must be float32 [{n}, {-(-k // k_block)}], got {scales.dtype} {tuple(scales.shape)}")
    if k_block < k and k_block % 16:
        raise ValueError(f"k_block {k_block} must be a multiple of 16 (or cover the whole row, {k})")
    x, y, grid, options = weight_matmul_launch(x, n)
    if m == 0:
        return y
    as_bytes = common.fp8_codes_as_bytes(codes.device)
    _fp8_matmul_kernel[grid](
        x, codes.view(torch.uint8) if as_bytes else codes, scales, y, m, n, k,
        x.stride(0), codes.stride(0), scales.stride(0), y.stride(0),
        K_BLOCK=k_block, SCALE_AT_END=k_block >= k, CODES_AS_BYTES=as_bytes,
        BLOCK_K=slice_k(k_block, k, x.dtype), **options,
    )
    return y
