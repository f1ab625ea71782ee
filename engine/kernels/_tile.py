"""The key loop shared by the paged attention kernels (decode and prefill).

``attend_keys`` is a ``@triton.jit`` function, inlined into each kernel that calls it. It streams
``BLOCK_N``-token key tiles through the block table, reading K/V in place: token n lives at row
``n % PAGE`` of block ``table[n // PAGE]``, looked up per token inside the tile, so the tile width is
independent of the block size. Each tile is scored against the program's query rows and folded into a
running online softmax in base 2 (``exp2`` is the native instruction, so the scale arrives pre-multiplied
by log2(e)). The kernels differ only in which keys a row may see, chosen by ``CAUSAL``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_keys(
    q, K, V, table, start, end, pos, scale_log2, offs_d, mask_d,
    stride_kb, stride_kt, stride_vb, stride_vt,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """Keys ``start .. end - 1`` for the query rows ``q`` ``[ROWS, BLOCK_D]``.

    ``K``/``V`` point at the kv head (cache base + ``kvh * stride_h``), ``table`` at the sequence's
    block-table row. Every row sees every key in range, or with ``CAUSAL`` only keys ``<= pos``
    (``[ROWS]``, the rows' absolute positions; ignored otherwise). Returns ``(m_i, l_i, acc)``, fp32:
    each row's running max and sum ``[ROWS]`` and unnormalized output ``[ROWS, BLOCK_D]`` (an empty
    range leaves ``l_i == 0``; the caller divides ``acc`` by ``l_i``)."""
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
