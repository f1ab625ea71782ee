"""The key loop shared by the paged attention kernels (decode and prefill).

``attend_keys`` is a ``@triton.jit`` function, inlined into each kernel that calls it. It streams
``BLOCK_N``-token key tiles through the block table, reading K/V in place: token n lives at row
``n % PAGE`` of block ``table[n // PAGE]``, looked up per token inside the tile, so the tile width is
independent of the block size. Each tile is scored against the program's query rows and folded into a
running online softmax in base 2 (``exp2`` is the native instruction, so the scale arrives pre-multiplied
by log2(e)). The kernels differ only in which keys a row may see, chosen by ``CAUSAL``.

A quantized cache is dequantized in the tile, so its codes are the only K/V bytes read, rounded to the
attention dtype as the torch path's gather rounds them (``engine/kv_quant.decode_into``):

* ``QUANT`` 1 (int8, fp8 e4m3) and 3 (fp8 e4m3 read as bytes, on GPUs without Triton's e4m3 type): code x
  scale, one fp16 scale per token and head (fp8: per block and head, a token stride of 0);
* ``QUANT`` 2 (kivi2): four 2-bit codes a byte along head_dim, code x scale + zero point, the scales and
  zero points ``[.., groups]`` per token and head with ``K_GROUP``/``V_GROUP`` channels each (keys: per
  channel over the block, a token stride of 0; values: per token, in groups).

With ``WINDOWED`` (fp8, kivi2), a block that still has a window (``SlotOf[block] >= 0``: the block a
sequence is filling) is read from the window, in the attention dtype, instead of its record.

The weight tile helpers the quantized matmuls share (dense and experts) are here too: ``_e4m3_bytes_as_half``
and ``_codes_minus_zero``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e4m3_bytes_as_half(bits):
    """fp8 e4m3 (``torch.float8_e4m3fn``) codes, read as bytes, as fp16 values 2^-8 times theirs: the sign
    moves to bit 15, exponent and mantissa to bits 7-13, where fp16's exponent (bias 15) reads e4m3's
    (bias 7) 8 lower, subnormals included. Exact for every finite code (NaN, which the quantizer never
    writes, reads as 1.875); four integer ops, for GPUs without Triton's e4m3 type (before sm_89)."""
    b = bits.to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _codes_minus_zero(packed, shift, zero, BITS: tl.constexpr):
    """A ``[BLOCK_K, BLOCK_N]`` slice of ``BITS``-bit integer weights (``engine/int_weights.py``), each row read
    from the byte that holds it (4-bit: two rows a byte, ``shift`` 0 or 4 a row for its nibble; 8-bit: one,
    ``shift`` 0), minus its column's ``zero``: -255..255 in int16, exact in every float type the product
    takes."""
    return ((packed >> shift) & ((1 << BITS) - 1)).to(tl.int16) - zero.to(tl.int16)[None, :]


@triton.jit
def _dequantize(codes_ptr, scale_ptr, zero_ptr, blk, row, offs_d, mask_n, mask, stride_b, stride_t, stride_sb,
                stride_st, out_dtype: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr):
    """One ``[BLOCK_N, BLOCK_D]`` tile of K or V in ``out_dtype``, from codes (``QUANT`` 1: int8 or fp8;
    3: fp8 as bytes; 2: four 2-bit codes a byte) and scales (and, for 2, zero points) addressed
    ``blk * stride_sb + row * stride_st + channel // GROUP``."""
    at = blk[:, None] * stride_b + row[:, None] * stride_t
    scales = blk * stride_sb + row * stride_st
    # if/else, never an early return: the compiler builds the statements after a constexpr branch's return
    # too, and those refuse the other format's pointer (the interpreter never sees this).
    if QUANT == 2:
        packed = tl.load(codes_ptr + at + (offs_d // 4)[None, :], mask=mask, other=0).to(tl.int32)
        codes = ((packed >> ((offs_d % 4) * 2)[None, :]) & 3).to(tl.float32)
        groups = scales[:, None] + (offs_d // GROUP)[None, :]
        s = tl.load(scale_ptr + groups, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + groups, mask=mask, other=0.0).to(tl.float32)
        out = ((codes * s).to(out_dtype).to(tl.float32) + z).to(out_dtype)  # torch's mul_, then add_
    else:
        codes = tl.load(codes_ptr + at + offs_d[None, :], mask=mask, other=0.0)
        s = tl.load(scale_ptr + scales, mask=mask_n, other=0.0).to(tl.float32)
        if QUANT == 3:  # fp8 bytes as fp16 at 2^-8 of their value: the scale takes the 2^8 (both exact)
            codes = _e4m3_bytes_as_half(codes)
            s = s * 256.0
        out = (codes.to(tl.float32) * s[:, None]).to(out_dtype)
    return out


@triton.jit
def attend_keys(
    q, K, V, KS, VS, KZ, VZ, KW, VW, SlotOf, table, start, end, pos, window, scale_log2, softcap_log2, offs_d,
    mask_d, stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
    stride_wb, stride_wt,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    CAUSAL: tl.constexpr, SLIDING: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    QUANT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr, WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Keys ``start .. end - 1`` for the query rows ``q`` ``[ROWS, BLOCK_D]``.

    ``K``/``V`` point at the kv head (cache base + ``kvh * stride_h``), as do ``KS``/``VS`` (scales),
    ``KZ``/``VZ`` (zero points) and ``KW``/``VW`` (windows); unused ones are placeholders of the attention
    dtype. ``table`` points at the sequence's block-table row. Every row sees every key in range, or with
    ``CAUSAL`` only keys ``<= pos`` (``[ROWS]``, the rows' absolute positions; ignored otherwise), and with
    ``SLIDING`` also only keys ``> pos - window`` (a sliding-window model: the last ``window`` positions).
    Returns ``(m_i, l_i, acc)``, fp32: each row's running max and sum ``[ROWS]`` and unnormalized output
    ``[ROWS, BLOCK_D]`` (an empty range leaves ``l_i == 0``; the caller divides ``acc`` by ``l_i``). A tile
    in which a row sees nothing leaves that row as it was. With ``SOFTCAP`` (Gemma 2's logit soft-capping)
    ``scale_log2`` is the softmax scale over the cap and each score becomes ``cap * tanh(score / cap)``, in
    base 2 by ``softcap_log2`` (the cap times log2(e))."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blk = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        row = offs_n % PAGE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        if QUANT == 0:
            k = tl.load(K + blk[:, None] * stride_kb + row[:, None] * stride_kt + offs_d[None, :], mask=kv_mask,
                        other=0.0)
            v = tl.load(V + blk[:, None] * stride_vb + row[:, None] * stride_vt + offs_d[None, :], mask=kv_mask,
                        other=0.0)
        else:
            k = _dequantize(K, KS, KZ, blk, row, offs_d, mask_n, kv_mask, stride_kb, stride_kt, stride_ksb,
                            stride_kst, KW.dtype.element_ty, K_GROUP, QUANT)
            v = _dequantize(V, VS, VZ, blk, row, offs_d, mask_n, kv_mask, stride_vb, stride_vt, stride_vsb,
                            stride_vst, VW.dtype.element_ty, V_GROUP, QUANT)
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
        if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1
            s = softcap_log2 * (2.0 * tl.sigmoid(2.0 * s) - 1.0)
        if CAUSAL:
            visible = (offs_n[None, :] <= pos[:, None]) & mask_n[None, :]
            if SLIDING:
                visible = visible & (offs_n[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        else:
            s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if SLIDING:  # a row that has seen no key yet stays at -inf: -inf - -inf must not make NaNs
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return m_i, l_i, acc
