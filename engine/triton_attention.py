"""The Triton attention backend: paged attention that reads K/V blocks where they are.

Per layer and step: ``write_kv`` stores the step's K/V rows at their slots, then the decode rows (first,
as in ``AttentionMetadata``) go through ``paged_decode_attention`` and every multi-token chunk through
``paged_prefill_attention``, both reading the layer's cache through block tables, so nothing is gathered
into contiguous buffers. Since the chunk's own K/V is already in the cache, a fresh prompt is just a
chunk with no prefix; one prefill launch serves fresh prompts and chunks after a cached prefix alike.

The backend reads every cache format: int8 rows are quantized by the write kernel, fp8 and kivi2 rows by
the cache's own writer (``QuantLayerKV.write``, whose window pool keeps the blocks still filling), and the
attention kernels read codes, scales and zero points in place (and the windows), dequantizing in the
tile, so a decode step reads half (int8, fp8) or about a seventh (kivi2) of a 16-bit cache's KV bytes.
Attention sinks keep the torch path (gather + SDPA in ``engine/model.py``), which is also the CPU path and
the reference. On CPU the kernels run only under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kernels
from engine.config import EngineConfig
from engine.kernels.common import QuantizedKV
from engine.kv_cache import DenseLayerKV, QuantLayerKV
from engine.kv_quant import field_view
from engine.to_device import device_values

_SHORT_QUERY_TILE = 16  # the smallest tl.dot side


def attention_backend(config: EngineConfig) -> str:
    """"torch" or "triton": ``config.attention_backend`` with "auto" resolved (triton on CUDA when triton
    imports and there are no attention sinks: a plain sliding window, the model's own or ``--kv-window``'s,
    runs on the kernels). EngineConfig has already refused triton with sinks; an explicit "triton" that
    cannot run here raises ValueError."""
    on_cuda = torch.device(config.device).type == "cuda"
    if config.attention_backend == "auto":
        return "triton" if on_cuda and not config.kv_sinks and kernels.triton_available() else "torch"
    if config.attention_backend == "triton":
        if not kernels.triton_available():
            raise ValueError("attention_backend 'triton' needs the triton package, which does not import")
        from engine.kernels.common import interpreting  # imports triton

        if not on_cuda and not interpreting():
            raise ValueError(f"attention_backend 'triton' on device {config.device!r} runs only under the "
                             "Triton interpreter (TRITON_INTERPRET=1); use a CUDA device or 'torch'")
    return config.attention_backend


@dataclass
class PagedAttentionMeta:
    """What the kernels read besides the caches; int32, on the cache's device. Decode rows come first in
    the step's rows, prefill chunks follow (``cu_seqlens_q`` counts from the first prefill row)."""

    decode_tables: torch.Tensor  # [num_decode, max_blocks], padded with block 0 (never read)
    context_lens: torch.Tensor  # [num_decode]: each decode row's position + 1
    max_context_len: int  # sizes the decode split-K without a device sync
    prefill_tables: torch.Tensor  # [num_prefills, max_blocks]
    cu_seqlens_q: torch.Tensor  # [num_prefills + 1]
    seq_lens: torch.Tensor  # [num_prefills]: cached prefix + chunk
    max_query_len: int  # sizes the prefill grid without a device sync
    window: int = 0  # a sliding-window model's: each query sees its last ``window`` positions; 0: all


def _padded(tables: list[list[int]], lens: list[int], block_size: int) -> tuple[list[int], int]:
    """Each table cut to the blocks covering its length and padded to the longest: (flat rows, width)."""
    width = max((-(-n // block_size) for n in lens), default=0)
    flat: list[int] = []
    for table, n in zip(tables, lens, strict=True):
        row = table[:-(-n // block_size)]
        flat += row + [0] * (width - len(row))
    return flat, width


def paged_metadata(decode: list[tuple[list[int], int]], prefill: list[tuple[list[int], int, int]],
                   block_size: int, device: torch.device, window: int = 0) -> PagedAttentionMeta:
    """``decode``: (block table, context length) per decode row; ``prefill``: (block table, query length,
    sequence length) per chunk, in row order; ``window``: a sliding window's length (0: none). Everything
    travels to the device as one int32 copy, which does not wait for the device."""
    dec_flat, dec_width = _padded([t for t, _ in decode], [n for _, n in decode], block_size)
    pre_flat, pre_width = _padded([t for t, _, _ in prefill], [n for _, _, n in prefill], block_size)
    cu = [0]
    for _, q, _ in prefill:
        cu.append(cu[-1] + q)
    parts = [dec_flat, [n for _, n in decode], pre_flat, cu, [n for _, _, n in prefill]]
    data = device_values([x for part in parts for x in part], torch.int32, device)
    views, start = [], 0
    for part in parts:
        views.append(data[start:start + len(part)])
        start += len(part)
    return PagedAttentionMeta(
        decode_tables=views[0].view(len(decode), dec_width), context_lens=views[1],
        max_context_len=max((n for _, n in decode), default=0),
        prefill_tables=views[2].view(len(prefill), pre_width), cu_seqlens_q=views[3], seq_lens=views[4],
        max_query_len=max((q for _, q, _ in prefill), default=0), window=window)


def quantized_layer(kv: QuantLayerKV) -> tuple[torch.Tensor, torch.Tensor, QuantizedKV]:
    """K and V codes of one quantized layer (``[num_blocks, block_size, kv_heads, head_dim]``, kivi2's
    packed a quarter as wide) and their scales, zero points and windows, as views of the cache shaped the
    way the kernels read them (``kernels.common.QuantizedKV``)."""
    cache = kv.cache
    shape = (cache.num_blocks, cache.block_size, cache.num_kv_heads)

    def field(name: str) -> torch.Tensor:
        return field_view(kv.records, cache.layout.field(name))

    def groups(name: str) -> torch.Tensor:
        """A scale or zero point field as ``[num_blocks, block_size, kv_heads, groups]``."""
        t = field(name)
        if cache.kv_format == "int8":  # per token and head
            return t[..., None]
        if cache.kv_format == "fp8":  # per block and head
            return t[:, None, :, None].expand(*shape, 1)
        if name.startswith("k"):  # kivi2 keys: per block, head and channel
            return t[:, None].expand(*shape, t.shape[-1])
        return t  # kivi2 values: per token, head and channel group

    zeros = (groups("k_zero"), groups("v_zero")) if cache.kv_format == "kivi2" else (None, None)
    windows = (None, None, None)
    if cache.windows is not None:
        layer = cache.windows.data[kv.layer]
        windows = (layer[0], layer[1], cache.windows.slot_of)
    return field("k_codes"), field("v_codes"), QuantizedKV(groups("k_scale"), groups("v_scale"), *zeros, *windows)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: DenseLayerKV | QuantLayerKV,
                    meta: PagedAttentionMeta, num_decode: int, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """Write the step's K/V (``[T, kv_heads, head_dim]``) into the layer's cache, then attention of ``q``
    (``[T, heads, head_dim]``, decode rows first) over each row's context: ``[T, heads, head_dim]``;
    ``softcap`` (> 0): the scores soft-capped (Gemma 2's)."""
    if isinstance(kv, QuantLayerKV) and kv.cache.windows is None:  # int8: quantized by the write kernel
        k_cache, v_cache, quant = quantized_layer(kv)
        kernels.write_kv(k, v, k_cache, v_cache, kv.slot_mapping, quant=quant)
    elif isinstance(kv, QuantLayerKV):  # fp8, kivi2: the window pool plans where each row goes (host-side)
        kv.write(k, v)  # before the views: a window pool that grew has its new tensor in place
        k_cache, v_cache, quant = quantized_layer(kv)
    else:
        k_cache, v_cache, quant = kv.kv[0], kv.kv[1], None
        kernels.write_kv(k, v, k_cache, v_cache, kv.slot_mapping)
    out = torch.empty_like(q)
    n = num_decode
    if n:
        kernels.paged_decode_attention(q[:n], k_cache, v_cache, meta.decode_tables, meta.context_lens, scale,
                                       out=out[:n], max_context_len=meta.max_context_len, quant=quant,
                                       window=meta.window, softcap=softcap)
    if n < q.shape[0]:
        # short chunks (drafts to verify: a few tokens each) take the smallest query tile, not a 64-row one
        # mostly masked off
        block_m = _SHORT_QUERY_TILE if meta.max_query_len <= _SHORT_QUERY_TILE else None
        kernels.paged_prefill_attention(q[n:], k_cache, v_cache, meta.prefill_tables, meta.cu_seqlens_q,
                                        meta.seq_lens, scale, out=out[n:], max_query_len=meta.max_query_len,
                                        block_m=block_m, quant=quant, window=meta.window, softcap=softcap)
    return out
