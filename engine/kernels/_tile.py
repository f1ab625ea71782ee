"""The key loop shared by the paged attention kernels (decode and prefill).

``attend_keys`` is a ``@triton.jit`` function, inlined into each kernel that calls it. It streams
``BLOCK_N``-token key tiles through the block table, reading K/V in place: token n lives at row
``n % PAGE`` of block ``table[n // PAGE]``, looked up per token inside the tile, so the tile width is
independent of the block size. Each tile is scored against the program's query rows and folded into a
running online softmax in base 2 (``exp2`` is the native instruction, so the scale arrives pre-multiplied
by log2(e)). The kernels differ only in which keys a row may see, chosen by ``CAUSAL``.

A quantized cache (``SCALED``: int8 or fp8 codes) is dequantized in the tile, so the codes are the only
K/V bytes read: code x scale (one fp16 scale per token and head, or per block and head with a token stride
of 0), rounded to the attention dtype as the torch path's gather is. With ``WINDOWED`` (fp8), a block
that still has a window (``SlotOf[block] >= 0``: the block a sequence is filling) is read from the
window, in the attention dtype, instead of its record.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_keys(
    q, K, V, KS, VS, KW, VW, SlotOf, table, start, end, pos, scale_log2, offs_d, mask_d,
    stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, stride_wb, stride_wt,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, SCALED: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """Keys ``start .. end - 1`` for the query rows ``q`` ``[ROWS, BLOCK_D]``.

    ``K``/``V`` point at the kv head (cache base + ``kvh * stride_h``), as do ``KS``/``VS`` (scales)
    and ``KW``/``VW`` (windows; with neither flag they are unused placeholders of the attention dtype),
    ``table`` at the sequence's block-table row. Every row sees every key in range, or with ``CAUSAL``
    only keys ``<= pos`` (``[ROWS]``, the rows' absolute positions; ignored otherwise). Returns
    ``(m_i, l_i, acc)``, fp32: each row's running max and sum ``[ROWS]`` and unnormalized output
    ``[ROWS, BLOCK_D]`` (an empty range leaves ``l_i == 0``; the caller divides ``acc`` by ``l_i``)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blk = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        row = offs_n % PAGE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + blk[:, None] * stride_kb + row[:, None] * stride_kt + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(V + blk[:, None] * stride_vb + row[:, None] * stride_vt + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        if SCALED:
            scales = blk * stride_sb + row * stride_st
            ks = tl.load(KS + scales, mask=mask_n, other=0.0).to(tl.float32)
            vs = tl.load(VS + scales, mask=mask_n, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * ks[:, None]).to(KW.dtype.element_ty)
            v = (v.to(tl.float32) * vs[:, None]).to(VW.dtype.element_ty)
        if WINDOWED:
            slot = tl.load(SlotOf + blk, mask=mask_n, other=-1)
            in_window = (slot >= 0)[:, None]
            at = slot.to(tl.int64)[:, None] * stride_wb + row[:, None] * stride_wt + offs_d[None, :]
            k = tl.where(in_window, tl.load(KW + at, mask=kv_mask & in_window, other=0.0), k)
            v = tl.where(in_window, tl.load(VW + at, mask=kv_mask & in_window, other=0.0), v)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # [ROWS, BLOCK_N]
        if CAUSAL:
            s = tl.where((offs_n[None, :] <= pos[:, None]) & mask_n[None, :], s, float("-inf"))
        else:
            s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return m_i, l_i, acc
