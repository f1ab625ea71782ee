"""Paged prefill / extend attention (Triton): chunks of several query tokens per sequence, packed
varlen, attending causally over everything already in the paged cache.

The chunk's own K/V is written into the cache (``write_kv``) before this runs, as in vLLM, so a cached
prefix and the chunk are one context read through the block table: sequence b's query rows
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` are its last positions of ``seq_lens[b]``, and the row at
position p sees keys 0..p. A fresh prompt is the case prefix = 0; a decode row is a chunk of one.

Each program owns ``BLOCK_M`` query rows of one (sequence, query head) and streams ``BLOCK_N``-token
key tiles with an online (base-2) softmax; tiles past the tile's last query position are never read.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels.common import (
    check_paged_cache,
    check_tile,
    default_tile,
    dot_precision,
    next_power_of_2,
    upcast,
)


@triton.jit
def _prefill_kernel(
    Q, K, V, Out, BlockTables, CuSeqlensQ, SeqLens, scale_log2,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = BlockTables + b * stride_bt
    # Causal: the tile's last row sees up to its own position; key 0 is visible to every row (padding
    # rows included), so each row's running max is finite after the first tile.
    kv_end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        blk = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        row = offs_n % PAGE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_ptrs = K + blk[:, None] * stride_kb + row[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        v_ptrs = V + blk[:, None] * stride_vb + row[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = (offs_n[None, :] <= pos[:, None]) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                            max_query_len: int | None = None, block_m: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """Causal attention of packed query chunks over the paged cache.

    ``q``: ``[num_tokens, num_q_heads, head_dim]``, sequence b's chunk at rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (int ``[batch + 1]``, starting at 0, every chunk >= 1
    token). ``seq_lens``: int ``[batch]``, cached prefix + chunk length, so the chunk holds positions
    ``seq_lens[b] - chunk_len .. seq_lens[b] - 1`` and their K/V must already be in the cache.
    ``k_cache``/``v_cache``: one layer, ``[num_blocks, block_size, kv_heads, head_dim]``;
    ``block_tables``: int ``[batch, max_blocks]`` covering ``seq_lens[b]`` positions.
    ``max_query_len`` sizes the grid (computed from ``cu_seqlens_q`` with a device sync if omitted);
    ``block_m``/``block_n`` are the query/key tiles (default: ``default_tile``).
    Returns ``out`` ``[num_tokens, num_q_heads, head_dim]``."""
    _, block_size, kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
    num_tokens, q_heads, qd = q.shape
    if qd != head_dim or q_heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_heads={kv_heads}, head_dim={head_dim}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape != (batch + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError("cu_seqlens_q must be [batch + 1], seq_lens [batch] and block_tables "
                         "[batch, max_blocks]")
    if q.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q's head_dim and block_tables' last axis must be contiguous")
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be shaped like q with a contiguous head_dim")
    if batch == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m = check_tile("block_m", block_m or default_tile(q.dtype))
    block_n = check_tile("block_n", block_n or default_tile(q.dtype))
    grid = (triton.cdiv(max_query_len, block_m), batch, q_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        PAGE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=upcast(q.dtype),
        PREC=dot_precision(q.dtype),
    )
    return out
