"""FP8 weights: checkpoints published in fp8 (``quantization_config.quant_method`` ``"fp8"`` or
``"compressed-tensors"``) and ``--quantization fp8`` on a 16-bit one, for the decoder's projections (q/k/v,
o, gate/up, down; a mixture's experts and shared expert too, never its router).

A projection holds e4m3 codes ``[out, in]`` and float32 scales ``[out, ceil(in / k_block)]``: one scale per
output row and ``k_block`` input columns. Every checkpoint layout (``engine.config.read_quantization``) maps
onto that one (the loader expands a block's scale to its rows), so packing q/k/v or gate/up into one matrix
packs their scales row by row too:

* block-wise (``weight_block_size: [n, k]``, ``weight_scale_inv`` ``[ceil(out / n), ceil(in / k)]``): Qwen3's
  and DeepSeek's fp8 releases, transformers' ``FineGrainedFP8Config``;
* per tensor (no block size, ``weight_scale`` a scalar): vLLM's and AutoFP8's fp8 format;
* compressed-tensors' fp8 weights (llm-compressor, RedHat's and Neural Magic's releases): ``weight_scale``
  per tensor, per output row (``channel``) or per block;
* NVIDIA ModelOpt's (``quant_method: "modelopt"``, or its ``hf_quant_config.json``; NVIDIA's ``-FP8``
  releases): ``weight_scale`` per tensor (``FP8``), per output row ``[out]`` (``FP8_PER_CHANNEL_PER_TOKEN``) or
  per 128 x 128 block ``[out / 128, 1, in / 128, 1]`` (``FP8_PB_WO``);
* per output row (``--quantization fp8``, computed here at load: absmax / 448 per row).

The matmul dequantizes the weight and keeps the activations in ``--dtype`` (W8A16, as vLLM's Marlin path runs
fp8 checkpoints on GPUs without fp8 tensor cores): the torch path dequantizes into ``--dtype`` as
transformers does when it loads such a checkpoint without a GPU (same numbers, token for token), the Triton
kernel (``engine/kernels/fp8_gemm.py``) reads the codes and scales the partial sums, so a decode step reads
one byte a weight. A checkpoint's static ``input_scale`` (and any activation scheme) is therefore not used, nor
are static K/V scales for an fp8 cache (``config.static_kv_scales``): the cache is ``--kv-cache-dtype``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import WeightQuant
from engine.kv_quant import FP8_MAX


def row_scales(scale: torch.Tensor, quant: WeightQuant, rows: int) -> torch.Tensor:
    """A checkpoint's scale for a ``[rows, cols]`` weight (size-1 dims aside: ModelOpt drops or adds some) ->
    the model's ``[rows, ceil(cols / k_block)]``."""
    scale = scale.to(torch.float32)
    if not quant.n_block:
        return scale.reshape(1, 1).expand(rows, 1)
    return scale.reshape(-(-rows // quant.n_block), -1).repeat_interleave(quant.n_block, dim=0)[:rows]


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` -> (e4m3 codes, float32 scales ``[out, 1]``): each row's absmax maps to 448."""
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    return (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, k_block: int, dtype: torch.dtype) -> torch.Tensor:
    """codes x scales in float32, then cast to ``dtype`` (the order transformers dequantizes in)."""
    per_column = scales if scales.shape[1] == 1 else scales.repeat_interleave(k_block, dim=1)[:, :codes.shape[1]]
    return (codes.to(torch.float32) * per_column).to(dtype)


def quantized_linear(x: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                     kernel: Callable[[torch.Tensor], torch.Tensor],
                     dequantized: Callable[[torch.dtype], torch.Tensor]) -> torch.Tensor:
    """``x @ W.T + bias`` for a quantized W (fp8 here, integers in ``engine/int_weights.py``): on GPUs ``kernel``
    (a Triton matmul reading the codes) on x's rows, elsewhere ``F.linear`` on the matrix ``dequantized`` into
    x's dtype."""
    if x.is_cuda and kernels.triton_available():
        out = kernel(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], out_features)
        return out if bias is None else out + bias
    return F.linear(x, dequantized(x.dtype), bias)


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, k_block: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantize(codes).T + bias`` (``quantized_linear``)."""
    return quantized_linear(x, bias, codes.shape[0], lambda rows: kernels.fp8_matmul(rows, codes, scales, k_block),
                            lambda dtype: dequantize(codes, scales, k_block, dtype))
