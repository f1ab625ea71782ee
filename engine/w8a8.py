"""W8A8: int8 weights times int8 activations, the matmul in integers, for compressed-tensors' int-quantized
checkpoints whose activations are int8 scaled a token as they run (RedHat's w8a8 releases; vLLM runs them
so as ``CompressedTensorsW8A8Int8``), and for a 16-bit checkpoint loaded with ``--quantization w8a8_int8``
(its weights rounded to int8 a row as they load, by ``quantize_int8_rows``).

Each row (a token) of a projection's input is quantized as it runs: its absmax maps to 127
(``scale = absmax / 127``, ``code = round(x * 127 / absmax)``, half to even, as vLLM's dynamic int8 quantizer
computes it; on GPUs in one launch, ``engine/kernels/int8_rows.py``). The weight holds int8 values
``[out, in]`` with a float32 scale a row.
``torch._int_mm`` multiplies the codes with int32 sums, which are exact, and the two scales turn them back
into ``x @ W.T`` in float32 (the bias added there too), then ``--dtype``. On CPUs with VNNI that is oneDNN's
int8 GEMM, on GPUs cuBLASLt's on the int8 tensor cores: both about twice the 16-bit matmul rate, and a decode
step reads a byte a weight. A mixture's experts run the same way (``engine/moe.py``; on GPUs
``engine/kernels/moe_experts.py``, the int8 tiles multiplied in its one launch a matrix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import IntQuant

INT8_MAX = 127.0
CUDA_MIN_ROWS = 17  # cuBLASLt's int8 GEMM behind torch._int_mm takes more than 16 rows
# how RedHat's w8a8 releases hold their projections, and the same weights without the activation scheme
# (benchmarks and tests write checkpoints so), by the name benchmarks give them
W8A8_RELEASES = IntQuant("compressed-tensors", 0, zero_points=False, bits=8, packed=False, int8_activations=True)
W8A16_ROWS = IntQuant("compressed-tensors", 0, zero_points=False, bits=8, packed=False)
INT8_ROW_FORMATS = {"w8a8": W8A8_RELEASES, "w8a16": W8A16_ROWS}


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, in]`` -> (int8 codes ``[T, in]``, float32 scales ``[T, 1]``): each row's absmax maps to 127
    (a row of zeros to zeros)."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    return torch.round(x32 * scale.reciprocal()).clamp_(-128, 127).to(torch.int8), scale


def int8_matmul(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``codes`` ``[T, in]`` @ ``weight`` ``[out, in]``.T, both int8, as int32 ``[T, out]``. On a GPU fewer than
    ``CUDA_MIN_ROWS`` rows are padded with zeros to it (the padding's sums are dropped)."""
    rows = codes.shape[0]
    if codes.is_cuda and rows < CUDA_MIN_ROWS:
        codes = F.pad(codes, (0, 0, 0, CUDA_MIN_ROWS - rows))
    return torch._int_mm(codes, weight.t())[:rows]


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with ``x`` quantized a row at a time (``quantize_int8_rows``):
    ``weight`` int8 ``[out, in]``, ``weight_scale`` float32 ``[out, 1]``; the result in ``x.dtype``."""
    rows = x.reshape(-1, x.shape[-1])
    codes, scales = kernels.int8_rows(rows) if rows.is_cuda and kernels.triton_available() else quantize_int8_rows(rows)
    out = int8_matmul(codes, weight).to(torch.float32).mul_(scales).mul_(weight_scale.view(1, -1))
    if bias is not None:
        out += bias
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
