"""Paged decode attention (Triton): one query token per sequence over its block table.

Each program owns one (sequence, kv head, split) and computes every query head of that kv head's group
at once, so a K/V tile is loaded once per group (GQA/MQA) and the scores are one ``tl.dot``. The key
loop (in-place reads through the block table, base-2 online softmax) is ``_tile.attend_keys``, shared
with prefill.

Long contexts with few sequences leave most of the GPU idle, so the context can be cut into splits
(flash-decoding, SGLang's two-stage decode): stage 1 writes each split's normalized partial output and
its log-sum-exp (base 2), stage 2 merges them. With one split, stage 1 writes the final output directly.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from engine.kernels._tile import attend_keys
from engine.kernels.common import QuantizedKV, attention_inputs, next_power_of_2, score_scales, tile_size

_MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the parallelism it adds
_MAX_SPLITS = 16


@triton.jit
def _decode_stage1(
    Q, K, V, KS, VS, KZ, VZ, KW, VW, SlotOf, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst,
    stride_vsh, stride_wb, stride_wt, stride_wh,
    BlockTables, ContextLens, Out, MidO, MidLse, scale_log2, softcap_log2, window,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr, QUANT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    WINDOWED: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP  # BLOCK_H >= 16 rows for tl.dot; rows past the group are padding
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM  # non-power-of-two head dims are zero-padded

    ctx = tl.load(ContextLens + b)
    first = 0  # the first key the query sees: its last ``window`` positions with SLIDING
    if SLIDING:
        first = tl.maximum(ctx - window, 0)
    # Splits are whole tiles long, so only a split's last tile is ragged.
    per_split = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, ctx)

    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # Every tile of a non-empty split holds >= 1 real key, so m_i is finite after the first one. Not
    # causal: the one query row sees the whole context, so ``pos`` (here ``start``) is unused.
    m_i, l_i, acc = attend_keys(
        q, K + kvh * stride_kh, V + kvh * stride_vh, KS + kvh * stride_ksh, VS + kvh * stride_vsh,
        KZ + kvh * stride_ksh, VZ + kvh * stride_vsh, KW + kvh * stride_wh, VW + kvh * stride_wh, SlotOf,
        BlockTables + b * stride_bt, start, end, start, window, scale_log2, softcap_log2, offs_d, mask_d,
        stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst, stride_wb,
        stride_wt, ROWS=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, PAGE=PAGE, CAUSAL=False, SLIDING=False,
        UPCAST=UPCAST, PREC=PREC, QUANT=QUANT, K_GROUP=K_GROUP, V_GROUP=V_GROUP, WINDOWED=WINDOWED,
        SOFTCAP=SOFTCAP)

    empty = l_i == 0.0  # only an empty split (context shorter than NUM_SPLITS tiles)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    mask_hd = mask_h[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_hd)
    else:
        mid = b * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(MidO + mid[:, None] + offs_d[None, :], out, mask=mask_hd)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # base 2
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    MidO, MidLse, Out, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    mid = b * stride_mb + h * stride_mh + offs_s * stride_ms
    o = tl.load(MidO + mid[:, None] + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_num_splits(batch: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Enough splits to give ~2 programs per SM, never splits shorter than ``_MIN_SPLIT_TOKENS``; a power
    of two so the number of compiled variants stays small. 1 off-GPU (the interpreter gains nothing)."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device)
    want = min(_MAX_SPLITS, -(-2 * sms // max(1, batch * num_kv_heads)),
               max(1, max_context_len // _MIN_SPLIT_TOKENS))
    return 1 << max(0, want.bit_length() - 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, num_splits: int | None = None,
                           max_context_len: int | None = None, block_n: int | None = None,
                           quant: QuantizedKV | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Attention of ``q`` ``[batch, num_q_heads, head_dim]`` (one token per sequence) over the first
    ``context_lens[b]`` (>= 1) positions of sequence b's blocks; with ``window`` (> 0, a sliding-window
    model's), over the last ``window`` of them only, so the blocks before those are never read; with
    ``softcap`` (> 0, Gemma 2's) each score is soft-capped (``common.score_scales``).

    ``k_cache``/``v_cache``: one layer, ``[num_blocks, block_size, kv_heads, head_dim]``.
    ``block_tables``: int ``[batch, max_blocks]``; only its first ``ceil(context_lens[b] / block_size)``
    entries per row are read, so padding may be anything. ``num_q_heads`` must be a multiple of
    ``kv_heads``. ``num_splits`` fixes the split-K factor (a CUDA-graph capture wants it fixed); by
    default it is chosen from the batch and ``max_context_len`` (default: the table's capacity, an
    upper bound that needs no device sync). ``block_n`` is the key tile (default: ``default_tile``).
    With ``quant``, ``k_cache``/``v_cache`` are a quantized layer's codes, dequantized as they are read.
    Returns ``out`` ``[batch, num_q_heads, head_dim]``."""
    block_size, kv_heads, head_dim, out, operands, constexprs, options = attention_inputs(
        q, k_cache, v_cache, block_tables, out, quant)
    batch, q_heads, _ = q.shape
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("block_tables must be [batch, max_blocks] and context_lens [batch]")
    if batch == 0:
        return out
    if num_splits is None:
        cap = block_tables.shape[1] * block_size if max_context_len is None else max_context_len
        num_splits = auto_num_splits(batch, kv_heads, cap, q.device)
    block_n = tile_size("block_n", block_n, q.dtype, head_dim)
    group = q_heads // kv_heads
    block_d = next_power_of_2(head_dim)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: the whole context), got {window}")
    if num_splits > 1:
        mid_o = torch.empty(batch, q_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
    else:  # unused by the kernel when NUM_SPLITS == 1
        mid_o, mid_lse = out, out[:, :, 0]
    _decode_stage1[(batch, kv_heads, num_splits)](
        q, *operands, block_tables, context_lens, out, mid_o, mid_lse, *score_scales(scale, softcap), window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, SLIDING=window > 0, SOFTCAP=softcap > 0,
        **constexprs, **options,
    )
    if num_splits > 1:
        _decode_stage2[(batch, q_heads)](
            mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
        )
    return out
