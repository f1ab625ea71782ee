"""Mixture of experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

A linear router scores every expert for each token; the token goes to its top-k experts and sums their
SwiGLU outputs scaled by the softmaxed scores (renormalized over the k for Mixtral and for Qwen with
``norm_topk_prob``). Qwen2-MoE adds a shared expert every token takes, scaled by a sigmoid gate.

Each expert's gate and up matrices are packed into one ``[E, 2I, H]`` tensor and the down matrices into
``[E, H, I]`` (transformers 5's and vLLM's layout; the loader packs the checkpoint's per-expert tensors);
the module holding them is ``engine.model.SparseMoE``. With fp8 weights (``engine/weight_quant.py``) they are
e4m3 codes with ``ExpertQuant``; with integer ones (``engine/int_weights.py``: AWQ, GPTQ, compressed-tensors)
4-bit codes two a byte, ``[E, 2I, H / 2]`` and ``[E, H, I / 2]``, or 8-bit ones a byte each, with scales and
zeros per group; W8A8 (``engine/w8a8.py``) int8 values with a scale a row, multiplied by each row of their
input quantized to int8.
The rows of the flattened batch are sorted by expert, so each expert with tokens runs two matmuls over
exactly its rows, and adds them up in ascending expert order as transformers does.
That is the torch path (CPU, and the reference): it reads the expert counts back to the host once a layer.
The Triton backend runs ``engine/kernels/moe_experts.py`` instead: two launches a layer whatever the
expert count, and no host sync, so decode steps of MoE models are captured in CUDA graphs as others are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import int_weights, weight_quant
from engine.kernels.common import ExpertQuant
from engine.w8a8 import w8a8_linear


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores ``[T, k]`` in float32, expert ids ``[T, k]``): the top-k of the softmax over experts."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    scores, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores, ids


def routed_experts(x: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, quant: ExpertQuant | None = None) -> torch.Tensor:
    """Sum over each row's experts of ``score * down(silu(gate(x)) * up(x))``: ``x`` ``[T, H]``, ``scores``
    and ``ids`` ``[T, k]``, ``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]`` (fp8 or integer codes with
    ``quant``: each expert's matrices dequantized as it runs, its inputs gathered into their act-order).
    Scores in float32 scale the outputs in float32 (then cast); scores in ``x.dtype`` scale them in that
    dtype."""
    k = ids.shape[1]
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # (row, slot) pairs grouped by expert, rows ascending
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    flat_scores = scores.flatten()
    gate_up_perm, down_perm = (None, None) if quant is None else (quant.gate_up_perm, quant.down_perm)
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        rows = pairs // k
        if quant is not None and quant.int8_activations:  # W8A8: each row quantized as it goes in
            gate, up = w8a8_linear(x[rows], gate_up[expert], quant.gate_up[expert], None).chunk(2, dim=-1)
            y = w8a8_linear(F.silu(gate) * up, down[expert], quant.down[expert], None) * flat_scores[pairs, None]
        else:
            w_gate_up, w_down = _expert_weights(gate_up, down, quant, expert, x.dtype)
            gate, up = F.linear(_in_order(x[rows], gate_up_perm, expert), w_gate_up).chunk(2, dim=-1)
            y = F.linear(_in_order(F.silu(gate) * up, down_perm, expert), w_down) * flat_scores[pairs, None]
        out.index_add_(0, rows, y.to(x.dtype))
    return out


def _expert_weights(gate_up: torch.Tensor, down: torch.Tensor, quant: ExpertQuant | None, expert: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's gate/up and down matrices in ``dtype``: as held, or dequantized from fp8 or integer codes."""
    if quant is None:
        return gate_up[expert], down[expert]
    if quant.gate_up_zero is None:
        return (weight_quant.dequantize(gate_up[expert], quant.gate_up[expert], quant.gate_up_k_block, dtype),
                weight_quant.dequantize(down[expert], quant.down[expert], quant.down_k_block, dtype))
    return (int_weights.dequantize(gate_up[expert], quant.gate_up[expert], quant.gate_up_zero[expert], quant.bits,
                                   dtype),
            int_weights.dequantize(down[expert], quant.down[expert], quant.down_zero[expert], quant.bits, dtype))


def _in_order(rows: torch.Tensor, orders: torch.Tensor | None, expert: int) -> torch.Tensor:
    """``rows``' columns in the expert's act-order input order (of ``orders`` ``[E, in]``; None: as they
    are), the order its matrix holds its columns in."""
    return rows if orders is None else rows.index_select(-1, orders[expert])
