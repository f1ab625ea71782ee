"""Paged prefill / extend attention (Triton): chunks of several query tokens per sequence, packed
varlen, attending causally over everything already in the paged cache.

The chunk's own K/V is written into the cache (``write_kv``) before this runs, as in vLLM, so a cached
prefix and the chunk are one context read through the block table: sequence b's query rows
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` are its last positions of ``seq_lens[b]``, and the row at
position p sees keys 0..p. A fresh prompt is the case prefix = 0; a decode row is a chunk of one.

Each program owns ``BLOCK_M`` query rows of one (sequence, query head) and streams ``BLOCK_N``-token
key tiles with an online (base-2) softmax (``_tile.attend_keys``, shared with decode); tiles past the
tile's last query position are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._tile import attend_keys
from engine.kernels.common import QuantizedKV, attention_inputs, next_power_of_2, score_scales, tile_size


@triton.jit
def _prefill_kernel(
    Q, K, V, KS, VS, KZ, VZ, KW, VW, SlotOf, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst,
    stride_vsh, stride_wb, stride_wt, stride_wh,
    Out, BlockTables, CuSeqlensQ, SeqLens, scale_log2, softcap_log2, window,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    QUANT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    WINDOWED: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)  # the grid is sized for the longest chunk; shorter ones exit early
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_begin = tl.load(CuSeqlensQ + b)
    q_len = tl.load(CuSeqlensQ + b + 1) - q_begin
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(SeqLens + b)
    prefix = seq_len - q_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    pos = prefix + offs_m  # absolute position of each query row
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    rows = (q_begin + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Causal: the tile's last row sees up to its own position; key 0 is visible to every row (padding
    # rows included), so each row's running max is finite after the first key tile. With SLIDING each row
    # sees its last ``window`` positions: keys before the tile's first row's window are never read (a
    # sliding-window sequence gives their blocks back), and a row may see no key of an early tile.
    kv_end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
    _, l_i, acc = attend_keys(
        q, K + kvh * stride_kh, V + kvh * stride_vh, KS + kvh * stride_ksh, VS + kvh * stride_vsh,
        KZ + kvh * stride_ksh, VZ + kvh * stride_vsh, KW + kvh * stride_wh, VW + kvh * stride_wh, SlotOf,
        BlockTables + b * stride_bt, kv_start, kv_end, pos, window, scale_log2, softcap_log2, offs_d, mask_d,
        stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst, stride_wb,
        stride_wt, ROWS=BLOCK_M, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, PAGE=PAGE, CAUSAL=True, SLIDING=SLIDING,
        UPCAST=UPCAST, PREC=PREC, QUANT=QUANT, K_GROUP=K_GROUP, V_GROUP=V_GROUP, WINDOWED=WINDOWED,
        SOFTCAP=SOFTCAP)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # 0: a padding row a sliding window left keyless
    tl.store(Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                            max_query_len: int | None = None, block_m: int | None = None,
                            block_n: int | None = None, quant: QuantizedKV | None = None,
                            window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of packed query chunks over the paged cache; with ``window`` (> 0, a sliding-window
    model's) each query sees only its last ``window`` positions, itself included; with ``softcap`` (> 0,
    Gemma 2's) each score is soft-capped (``common.score_scales``).

    ``q``: ``[num_tokens, num_q_heads, head_dim]``, sequence b's chunk at rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (int ``[batch + 1]``, starting at 0, every chunk >= 1
    token). ``seq_lens``: int ``[batch]``, cached prefix + chunk length, so the chunk holds positions
    ``seq_lens[b] - chunk_len .. seq_lens[b] - 1`` and their K/V must already be in the cache.
    ``k_cache``/``v_cache``: one layer, ``[num_blocks, block_size, kv_heads, head_dim]``;
    ``block_tables``: int ``[batch, max_blocks]`` covering ``seq_lens[b]`` positions.
    ``max_query_len`` sizes the grid (computed from ``cu_seqlens_q`` with a device sync if omitted);
    ``block_m``/``block_n`` are the query/key tiles (default: ``default_tile``). With ``quant``,
    ``k_cache``/``v_cache`` are a quantized layer's codes, dequantized as they are read.
    Returns ``out`` ``[num_tokens, num_q_heads, head_dim]``."""
    block_size, kv_heads, head_dim, out, operands, constexprs, options = attention_inputs(
        q, k_cache, v_cache, block_tables, out, quant)
    num_tokens, q_heads, _ = q.shape
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape != (batch + 1,) or block_tables.shape[0] != batch:
        raise ValueError("cu_seqlens_q must be [batch + 1], seq_lens [batch] and block_tables "
                         "[batch, max_blocks]")
    if batch == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m = tile_size("block_m", block_m, q.dtype, head_dim)
    block_n = tile_size("block_n", block_n, q.dtype, head_dim)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: the whole context), got {window}")
    grid = (triton.cdiv(max_query_len, block_m), batch, q_heads)
    _prefill_kernel[grid](
        q, *operands, out, block_tables, cu_seqlens_q, seq_lens, *score_scales(scale, softcap), window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        PAGE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, SLIDING=window > 0, SOFTCAP=softcap > 0, **constexprs,
        **options,
    )
    return out
