"""Torch references for the Triton kernels: gather each sequence's blocks, build the mask, softmax.

Slow and obviously correct (one sequence at a time, float32 math); the kernel tests compare against
these, and these are checked against dense causal SDPA. Importing this module never needs triton.
"""

from __future__ import annotations

import torch


def ref_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """``k[t]``/``v[t]`` -> slot ``slot_mapping[t]`` = (block, row) of the 4-D caches; slot < 0 skipped."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // block_size, slots % block_size] = k[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[keep].to(v_cache.dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence: ``[length, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    blocks = block_table[:(length + block_size - 1) // block_size].long()
    return cache[blocks].flatten(0, 1)[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q ``[m, Hq, D]`` at absolute positions ``q_pos`` over k/v ``[n, Hkv, D]`` (positions 0..n-1),
    causal: query at position p sees keys 0..p, or with ``window`` > 0 keys p - window + 1..p; ``softcap``
    > 0: each score becomes ``softcap * tanh(score / softcap)``. Returns ``[m, Hq, D]`` in q's dtype."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    keys = torch.arange(k.shape[0], device=q.device)[None, :]
    visible = keys <= q_pos[:, None]
    if window > 0:
        visible &= keys > q_pos[:, None] - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hmn,nhd->mhd", probs, v).to(q.dtype)


def ref_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Same contract as ``paged_decode_attention``: q ``[batch, Hq, D]`` is the token at position
    ``context_lens[b] - 1`` and sees the whole context (its last ``window`` positions with a window)."""
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        k = gather_context(k_cache, block_tables[b], n)
        v = gather_context(v_cache, block_tables[b], n)
        out[b] = _attend(q[b:b + 1], k, v, torch.tensor([n - 1], device=q.device), scale, window, softcap)[0]
    return out


def ref_paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Same contract as ``paged_prefill_attention``: rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q
    are the last positions of sequence b's ``seq_lens[b]`` (cached prefix first, then the chunk)."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        m = cu[b + 1] - cu[b]
        k = gather_context(k_cache, block_tables[b], n)
        v = gather_context(v_cache, block_tables[b], n)
        pos = torch.arange(n - m, n, device=q.device)
        out[cu[b]:cu[b + 1]] = _attend(q[cu[b]:cu[b + 1]], k, v, pos, scale, window, softcap)
    return out


def ref_lora_grouped(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     index: torch.Tensor) -> torch.Tensor:
    """Same contract as ``lora_grouped``, one row at a time in float32: ``out`` plus each row's adapter."""
    result = out.clone()
    for t, slot in enumerate(index.tolist()):
        if slot >= 0:
            delta = (x[t].float() @ a[slot].float().T) @ b[slot].float().T
            result[t] = (out[t].float() + delta).to(out.dtype)
    return result


def ref_fp8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, k_block: int) -> torch.Tensor:
    """Same contract as ``fp8_matmul``: each code times its row's scale for its ``k_block`` columns, in float32."""
    per_column = scales.repeat_interleave(k_block, dim=1)[:, :codes.shape[1]]
    return (x.float() @ (codes.float() * per_column).T).to(x.dtype)


def ref_int_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bits: int) -> torch.Tensor:
    """Same contract as ``int_matmul``: each code (a byte's two, low nibble first, at 4 bits) minus its group's
    zero, times its scale, in float32."""
    if bits == 4:
        packed = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    codes = packed.float()
    group = codes.shape[1] // scales.shape[1]
    weight = (codes - zeros.float().repeat_interleave(group, dim=1)) * scales.repeat_interleave(group, dim=1)
    return (x.float() @ weight.T).to(x.dtype)
