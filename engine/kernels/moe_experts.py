"""A mixture of experts' matmuls in two Triton launches (vLLM's ``fused_moe``), for the GPU engine.

The torch path (``engine.moe.routed_experts``) runs two matmuls per expert that has rows and reads the
expert counts back to the host to slice them: 2 x 128 launches a layer for Qwen3-30B-A3B, and no CUDA
graph. Here the (token, expert) pairs are sorted by expert on the device and each expert's run is padded
to a whole number of ``BLOCK_M`` rows (``align_by_expert``, torch ops that never sync), so one launch
covers every expert: a program takes ``BLOCK_M`` pairs of one expert and a ``BLOCK_N`` slice of its
output, and multiplies the rows it gathers by that expert's matrix. The first launch gives each pair its
``[2I]`` gate and up rows, the activation runs in torch, the second launch multiplies by the down matrix
and the pair's router score, and the k pairs of a token are summed. Every shape depends only on the
token count, so a decode step holding it can be captured in a CUDA graph.

Quantized experts (W8A16 fp8, W4A16 and W8A16 integers) stay packed: each ``BLOCK_K`` slice of codes is read as
the dense matmuls read it (``_tile``'s helpers) and its partial sum scaled by its rows' scale, so a decode step
reads one byte, or half a byte, a weight of every expert it touches. W8A8 experts (int8 values) multiply int8
tiles of their input, each row quantized in a launch of its own before (``int8_rows``), into int32 sums
scaled once by both scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels import common
from engine.kernels._tile import _codes_minus_zero, _e4m3_bytes_as_half
from engine.kernels.common import ExpertQuant, dtype_flags, next_power_of_2
from engine.kernels.int8_rows import int8_rows


@triton.jit
def _expert_matmul_kernel(
    A, B, C, SortedPairs, BlockExperts, Scores, BScales, BZeros, APerm, AScales, num_pairs, N, K,
    stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_sn, stride_pe,
    PAIRS_PER_ROW: tl.constexpr, SCALE: tl.constexpr, QUANT: tl.constexpr, CODES_AS_BYTES: tl.constexpr,
    K_BLOCK: tl.constexpr, PERMUTED: tl.constexpr, BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """C[pair] = A[pair // PAIRS_PER_ROW] @ B[expert].T (times the pair's score with SCALE) for the
    BLOCK_M pairs of this program's block, all routed to the one expert BlockExperts names (-1: a block
    past the last expert's, nothing to do). Pairs >= num_pairs are a run's padding. With ``QUANT`` 1, B holds
    e4m3 codes (bytes with CODES_AS_BYTES, 2^-8 of their value); with 2, ``BITS``-bit integer codes, two 4-bit
    ones a byte ``[E, N, K / 2]`` or 8-bit ones ``[E, N, K]``, and BZeros their uint8 zeros, shaped and strided
    as the scales. Each ``BLOCK_K`` slice's partial sum is
    then scaled by its rows' scale in BScales ``[E, N, ceil(K / K_BLOCK)]`` (``BLOCK_K`` divides ``K_BLOCK``).
    With PERMUTED (integer act-order), column k of B multiplies column ``APerm[expert, k]`` of A. With
    ``QUANT`` 3 (W8A8) A and B hold int8 values, summed exactly in int32 and scaled once at the end by A's row
    scale in AScales ``[rows]`` and B's in BScales ``[E, N, 1]``."""
    expert = tl.load(BlockExperts + tl.program_id(0)).to(tl.int64)
    if expert >= 0:
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(SortedPairs + offs_m)
        valid = pairs < num_pairs
        rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = B + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
        per_byte: tl.constexpr = 8 // BITS  # rows of the slice a byte (an element) of B holds: 2 at 4 bits, else 1
        if QUANT == 2:  # a byte per 8 / BITS rows of the slice (4-bit: even rows in the low nibble)
            b_ptrs += (offs_k // per_byte)[:, None]
            shift = ((offs_k % per_byte) * BITS)[:, None]
        else:
            b_ptrs += offs_k[:, None]
        s_ptrs = BScales + expert * stride_se + offs_n.to(tl.int64) * stride_sn
        z_ptrs = BZeros + expert * stride_se + offs_n.to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sums = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)  # W8A8's
        for k0 in range(0, K, BLOCK_K):
            in_k = offs_k + k0 < K
            if PERMUTED:  # the expert's input order: a gather of each row's columns
                cols = tl.load(APerm + expert * stride_pe + k0 + offs_k, mask=in_k, other=0)
                a = tl.load(A + rows[:, None] * stride_am + cols[None, :], mask=valid[:, None] & in_k[None, :],
                            other=0.0)
            else:
                a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None] & (offs_n[None, :] < N), other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
            if QUANT == 0:
                acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PREC)
            elif QUANT == 3:
                sums = tl.dot(a, b, sums)
            else:
                scale = tl.load(s_ptrs + k0 // K_BLOCK, mask=offs_n < N, other=0.0)
                if QUANT == 2:
                    b = _codes_minus_zero(b, shift, tl.load(z_ptrs + k0 // K_BLOCK, mask=offs_n < N, other=0), BITS)
                elif CODES_AS_BYTES:
                    b = _e4m3_bytes_as_half(b)
                    scale = scale * 256.0
                acc += tl.dot(a, b.to(a.dtype), input_precision=PREC) * scale[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K // per_byte
        if QUANT == 3:
            a_scale = tl.load(AScales + rows, mask=valid, other=0.0)
            acc = sums.to(tl.float32) * a_scale[:, None] * tl.load(s_ptrs, mask=offs_n < N, other=0.0)[None, :]
        if SCALE:
            acc = acc * tl.load(Scores + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
        c_ptrs = C + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (``token * k + slot`` of ``ids`` ``[T, k]``) grouped by expert, each expert's run padded to a
    multiple of ``block_m`` with the sentinel ``T * k``; and each block's expert, -1 past the last run.
    Sized for the most blocks any routing of ``T * k`` pairs can take, so shapes depend on T alone."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would read its size back to the host
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    max_blocks = -(-num_pairs // block_m) + min(num_experts, num_pairs)
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[(run_ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    blocks = torch.arange(max_blocks, device=ids.device)
    block_experts = torch.searchsorted(run_ends // block_m, blocks, right=True)
    return sorted_pairs, torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows of one program: about the pairs an expert gets (16 at decode batch sizes, 64 at most)."""
    return min(64, max(16, next_power_of_2(-(-num_pairs // num_experts))))


def _expert_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
                   block_experts: torch.Tensor, scores: torch.Tensor | None, pairs_per_row: int,
                   block_m: int, b_scales: torch.Tensor | None = None, k_block: int = 0,
                   b_zeros: torch.Tensor | None = None, a_perm: torch.Tensor | None = None, bits: int = 8,
                   a_scales: torch.Tensor | None = None) -> None:
    """``b``: the experts' matrices in a's dtype, or fp8 codes with ``b_scales`` per row and ``k_block``, or
    ``bits``-bit integer codes (4-bit two a byte) with ``b_zeros`` too, and with act-order each expert's input
    order ``a_perm``; or int8 values times ``a``'s int8 codes with their row scales ``a_scales`` (W8A8)."""
    quant = 0 if b_scales is None else 3 if a_scales is not None else 1 if b_zeros is None else 2
    n, k = b.shape[1], b.shape[2] * (8 // bits if quant == 2 else 1)
    block_n = 64
    block_k = 32 if a.dtype == torch.float32 else 64  # fp32 tiles: half the K slice, the same shared memory
    if quant and k_block < k:
        block_k = min(block_k, k_block & -k_block)  # a slice within one scale's columns
    if a_perm is not None and a.dtype == torch.float32:
        block_k = min(block_k, 16)  # a gathered fp32 tile of 32 columns spills at prefill blocks (sm_90, sm_100)
    as_bytes = quant == 1 and common.fp8_codes_as_bytes(b.device)
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _expert_matmul_kernel[grid](
        a, b.view(torch.uint8) if as_bytes else b, out, sorted_pairs, block_experts,
        a if scores is None else scores, a if b_scales is None else b_scales, a if b_zeros is None else b_zeros,
        a if a_perm is None else a_perm, a if a_scales is None else a_scales, out.shape[0], n, k, a.stride(0),
        b.stride(0), b.stride(1), out.stride(0),
        0 if b_scales is None else b_scales.stride(0), 0 if b_scales is None else b_scales.stride(1),
        0 if a_perm is None else a_perm.stride(0),
        PAIRS_PER_ROW=pairs_per_row, SCALE=scores is not None, QUANT=quant, CODES_AS_BYTES=as_bytes,
        K_BLOCK=max(k_block, 1), PERMUTED=a_perm is not None, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k,
        **dtype_flags(a.dtype),
        # at 4 warps a second fp32 tile per slice spills, and so do integer down matrices at decode batches
        num_warps=8 if quant == 2 or (quant and a.dtype == torch.float32) else 4,
    )


def fused_moe(x: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, quant: ExpertQuant | None = None) -> torch.Tensor:
    """What ``engine.moe.routed_experts`` computes, in two launches: ``x`` ``[T, H]``, ``scores`` and ``ids``
    ``[T, k]`` (scores in float32 or x's dtype; each output row is scaled in float32), ``gate_up``
    ``[E, 2I, H]`` and ``down`` ``[E, H, I]`` in x's dtype, or fp8 codes with ``quant``'s scales (W8A16), or
    integer codes of ``quant.bits``, 4-bit ones two a byte (``[E, 2I, H / 2]``, ``[E, H, I / 2]``), with scales,
    zeros and, with act-order, input orders (W4A16, W8A16), or int8 values with a scale a row, times each row of
    their input quantized to int8 (``quant.int8_activations``, W8A8), all contiguous on one device. Returns
    ``[T, H]``."""
    t, h = x.shape
    e, two_i, _ = gate_up.shape
    w8a8 = quant is not None and quant.int8_activations
    integer = quant is not None and quant.gate_up_zero is not None
    if integer and quant.bits not in (4, 8):
        raise ValueError(f"integer expert codes must be 4- or 8-bit, got {quant.bits}")
    per_byte = 8 // quant.bits if integer else 1
    if ids.shape != scores.shape or ids.dim() != 2 or ids.shape[0] != t:
        raise ValueError(f"scores {tuple(scores.shape)} and ids {tuple(ids.shape)} must both be [{t}, top_k]")
    if gate_up.shape[2] * per_byte != h or down.shape != (e, h, two_i // 2 // per_byte):
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} must be [E, 2I, {h}] "
                         f"and [E, {h}, I]" + (" (4-bit codes: half the columns, two a byte)" if per_byte == 2 else ""))
    weight_dtype = (x.dtype if quant is None else torch.int8 if w8a8 else torch.uint8 if integer
                    else torch.float8_e4m3fn)
    if gate_up.dtype != weight_dtype or down.dtype != weight_dtype:
        raise ValueError(f"expert weights {gate_up.dtype} / {down.dtype} must be {weight_dtype} (x's dtype, or fp8 "
                         "codes with their scales, or uint8 integer codes with their scales and zeros, or int8 "
                         "values with their scales and int8 activations)")
    if quant is not None:
        _check_quant(quant, gate_up, down)
    if not (x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("x and the expert weights must be contiguous")
    k = ids.shape[1]
    if t == 0:
        return torch.empty_like(x)
    block_m = _block_m(t * k, e)
    sorted_pairs, block_experts = align_by_expert(ids, e, block_m)
    gate_and_up = torch.empty(t * k, two_i, dtype=x.dtype, device=x.device)
    a, a_scales = _operand(x, w8a8)
    _expert_matmul(a, gate_up, gate_and_up, sorted_pairs, block_experts, None, k, block_m,
                   *(() if quant is None else (quant.gate_up, quant.gate_up_k_block, quant.gate_up_zero,
                                               quant.gate_up_perm, quant.bits)), a_scales=a_scales)
    gate, up = gate_and_up.chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    per_pair = torch.empty(t * k, h, dtype=x.dtype, device=x.device)
    a, a_scales = _operand(hidden, w8a8)
    _expert_matmul(a, down, per_pair, sorted_pairs, block_experts, scores.contiguous(), 1, block_m,
                   *(() if quant is None else (quant.down, quant.down_k_block, quant.down_zero, quant.down_perm,
                                               quant.bits)), a_scales=a_scales)
    return per_pair.view(t, k, h).sum(dim=1)


def _operand(a: torch.Tensor, w8a8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A launch's ``a`` and its row scales: as it is (None), or for W8A8 its rows' int8 codes and scales."""
    if not w8a8:
        return a, None
    codes, scales = int8_rows(a)
    return codes, scales.view(-1)


def _check_quant(quant: ExpertQuant, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Scales ``[E, N, K / k_block]`` for each matrix, k_block at least 16; integer zeros shaped and strided as
    their scales (the kernel reads both with one set of strides), each group a whole slice of K; input orders,
    both or neither, int64 ``[E, K]`` with contiguous rows."""
    if (quant.gate_up.shape[:2] != gate_up.shape[:2] or quant.down.shape[:2] != down.shape[:2]
            or min(quant.gate_up_k_block, quant.down_k_block) < 16):
        raise ValueError("scales must be [E, N, K / k_block] for each matrix, k_block at least 16")
    if quant.gate_up_zero is None:
        if quant.gate_up_perm is not None or quant.down_perm is not None:
            raise ValueError("input orders (act-order) come with integer codes only")
        return
    if (quant.gate_up_perm is None) != (quant.down_perm is None):
        raise ValueError("act-order needs both matrices' input orders")
    for codes, scale, zeros, k_block, perm in (
            (gate_up, quant.gate_up, quant.gate_up_zero, quant.gate_up_k_block, quant.gate_up_perm),
            (down, quant.down, quant.down_zero, quant.down_k_block, quant.down_perm)):
        cols = 8 // quant.bits * codes.shape[2]
        if zeros is None or zeros.dtype != torch.uint8 or zeros.shape != scale.shape or zeros.stride() != scale.stride():
            raise ValueError("integer zeros must be uint8, shaped and strided as their scales")
        if scale.shape[2] * k_block != cols:
            raise ValueError(f"{scale.shape[2]} groups of {k_block} columns must split each row's {cols}")
        if perm is not None and (perm.dtype != torch.int64 or perm.shape != (codes.shape[0], cols)
                                 or perm.stride(1) != 1):
            raise ValueError(f"input orders must be int64 [E, {cols}] with contiguous rows, got {perm.dtype} "
                             f"{tuple(perm.shape)}")
