"""Paged KV storage in one of the formats of ``engine/kv_format.py`` (``EngineConfig.kv_cache_dtype``).

A block holds ``block_size`` consecutive token positions of one sequence for every layer; a sequence's
block table lists its blocks in order, so position p lives at slot ``table[p // B] * B + p % B``.

Layout of ``data``:

* ``auto``: ``[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]`` in the attention dtype.
* ``int8``, ``fp8``, ``kivi2``: ``[layers, 1, num_blocks, record_bytes]`` uint8: one record per layer and
  block, K's codes and scales then V's (``kv_format.record_layout``). fp8 and kivi2 keep each block a
  sequence is still filling, and its last ``residual_blocks`` full ones, in the attention dtype too
  (``kv_window.WindowPool``); attention reads a block's window where it has one, else dequantizes its record.

``for_step`` hands the model one ``DenseLayerKV`` / ``QuantLayerKV`` per layer: ``write`` stores a step's
K/V rows, ``gather`` reads whole blocks back in the attention dtype. Export/import move whole blocks as
contiguous copies of ``data`` along the block axis (dim 2; all layers, or one for layer-wise transfer),
so quantized blocks travel as their exact bytes and scales; windowed formats append ``window_columns``
record-sized columns carrying the windows of the last ``residual_blocks + 1`` blocks, one section each
(a flag byte, then its K and V as float32, so the bytes do not depend on the attention dtype). An import
of exactly ``n`` columns (the pool's full blocks) takes records only. Memory: ``block_bytes`` per block
(scales included) plus the window slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.config import EngineConfig, ModelConfig, dtype_bytes
from engine.kv_format import WINDOWED, block_layer_bytes, check_format, record_layout, window_layer_bytes
from engine.kv_quant import decode_into, encode_blocks, write_tokens
from engine.kv_window import Span, WindowPool, WritePlan

_WINDOW_HEADER = 16  # flag byte, padded


def block_bytes(cfg: ModelConfig, block_size: int, dtype: str | torch.dtype, kv_format: str) -> int:
    """Bytes of one block across all layers, K and V, scales included."""
    return cfg.num_layers * block_layer_bytes(kv_format, block_size, cfg.num_kv_heads, cfg.head_dim,
                                              dtype_bytes(dtype))


def num_blocks_for(cfg: ModelConfig, config: EngineConfig, extra_block_bytes: int = 0) -> int:
    """Blocks that fit ``config.kv_cache_bytes`` after the windows (each sequence's of a full batch), each
    costing ``extra_block_bytes`` more (a draft model's block)."""
    window = cfg.num_layers * window_layer_bytes(config.kv_cache_dtype, config.block_size, cfg.num_kv_heads,
                                                 cfg.head_dim, dtype_bytes(config.dtype),
                                                 config.residual_blocks)
    budget = config.kv_cache_bytes - window * config.max_num_seqs
    return max(1, budget // (block_bytes(cfg, config.block_size, config.dtype, config.kv_cache_dtype)
                             + extra_block_bytes))


class DenseLayerKV:
    """One layer of an ``auto`` cache for one step: plain index_copy writes and index_select reads."""

    def __init__(self, kv: torch.Tensor, slot_mapping: torch.Tensor):
        self.kv, self.slot_mapping = kv, slot_mapping  # kv: [2, num_blocks, block_size, kv_heads, head_dim]

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[0].view(-1, *self.kv.shape[3:]).index_copy_(0, self.slot_mapping, k)
        self.kv[1].view(-1, *self.kv.shape[3:]).index_copy_(0, self.slot_mapping, v)

    def gather(self, kind: int, block_ids: torch.Tensor, batch: int, buf: torch.Tensor) -> torch.Tensor:
        """K (``kind`` 0) or V of ``block_ids`` -> [batch, kv_heads, S, head_dim], copied into the front of
        ``buf``. Whole blocks are copied with index_select (several times faster on CPU than indexing)."""
        blocks = self.kv[kind]
        out = torch.index_select(blocks, 0, block_ids, out=buf[:len(block_ids)])
        return out.view(batch, -1, *blocks.shape[2:]).transpose(1, 2)


class QuantLayerKV:
    """One layer of a quantized cache for one step: quantizing writes, dequantizing gathers."""

    def __init__(self, cache: KVCache, layer: int, slot_mapping: torch.Tensor, plan: WritePlan | None):
        """``plan``: the windows' ``WritePlan`` (fp8, kivi2; shared by the step's layers); None for int8,
        whose rows go straight to their slots."""
        self.cache, self.layer, self.slot_mapping, self.plan = cache, layer, slot_mapping, plan
        self.records = cache.data[layer, 0]  # [num_blocks, record_bytes]

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        c, p = self.cache, self.plan
        if p is None:  # int8: every token is quantized on its own
            B, slots = c.block_size, self.slot_mapping
            write_tokens(c.layout, self.records, slots // B, slots % B, k, v)
            return
        win = c.windows.data[self.layer]  # [2, slots, B, H, D]
        if p.open_rows.numel():
            win[0].index_put_((p.open_slots, p.open_offsets), k[p.open_rows])
            win[1].index_put_((p.open_slots, p.open_offsets), v[p.open_rows])
        if p.done_blocks.numel():  # earlier tokens from the window, this step's from the rows
            full = win.new_zeros(2, len(p.done_blocks), *win.shape[2:])
            full[:, p.carried] = win[:, p.carried_slots]
            full[0, p.done_index, p.done_offsets] = k[p.done_rows]
            full[1, p.done_index, p.done_offsets] = v[p.done_rows]
            self.records.index_copy_(0, p.done_blocks, encode_blocks(c.layout, full[0], full[1]))

    def gather(self, kind: int, block_ids: torch.Tensor, batch: int, buf: torch.Tensor) -> torch.Tensor:
        out = decode_into(self.cache.layout, self.records.index_select(0, block_ids), "kv"[kind],
                          buf[:len(block_ids)])
        if self.cache.windows is not None:
            self.cache.windows.overlay(self.layer, kind, block_ids, out)
        return out.view(batch, -1, *out.shape[2:]).transpose(1, 2)


class KVCache:
    def __init__(self, model_config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype | str, device: torch.device | str, kv_format: str = "auto",
                 window_slots: int = 8, block_in_use: Callable[[int], bool] | None = None,
                 residual_blocks: int = 0):
        """``window_slots``: initial windows (fp8, kivi2); ``block_in_use(block)`` lets full pools reclaim;
        ``residual_blocks``: full blocks each sequence keeps in windows (``kv_format.residual_blocks``)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.kv_format = check_format(kv_format)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype  # the attention dtype
        self.num_layers = model_config.num_layers
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = model_config.num_kv_heads, model_config.head_dim
        shape = (block_size, self.num_kv_heads, self.head_dim)
        self.layout = self.windows = None
        self.window_columns = 0
        if kv_format == "auto":
            self.data = torch.zeros(self.num_layers, 2, num_blocks, *shape, dtype=self.dtype, device=device)
            return
        self.layout = record_layout(kv_format, *shape)
        self.data = torch.zeros(self.num_layers, 1, num_blocks, self.layout.record_bytes, dtype=torch.uint8,
                                device=device)
        if kv_format in WINDOWED:
            self.windows = WindowPool(self.num_layers, num_blocks, *shape, self.dtype, self.data.device,
                                      window_slots, block_in_use, residual_blocks)
            self._window_bytes = 2 * math.prod(shape) * 4  # K and V as float32
            per_window = -(-(_WINDOW_HEADER + self._window_bytes) // self.layout.record_bytes)
            self._sections = residual_blocks + 1  # windows a payload carries: its last blocks'
            self._section_bytes = per_window * self.layout.record_bytes
            self.window_columns = self._sections * per_window

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def payload_dtype(self) -> torch.dtype:
        return self.data.dtype

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of ``export_blocks`` of ``num_blocks`` blocks (window columns included)."""
        return (self.num_layers, self.data.shape[1], num_blocks + self.window_columns, *self.data.shape[3:])

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block as the pool stores it: ``data[:, :, b]``."""
        return (self.num_layers, self.data.shape[1], *self.data.shape[3:])

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V (scales included)."""
        return self.data[:, :, 0].numel() * self.data.element_size()

    def gather_buffers(self, num_blocks: int) -> torch.Tensor:
        """K and V gather destinations ``[2, num_blocks, block_size, kv_heads, head_dim]``, attention dtype."""
        return torch.empty(2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                           device=self.device)

    def for_step(self, slot_mapping: torch.Tensor, spans: list[Span] | None = None
                 ) -> list[DenseLayerKV] | list[QuantLayerKV]:
        """Each layer's view for one forward pass that writes K/V rows at ``slot_mapping``; a windowed cache
        needs the step's ``spans`` (each sequence's table and positions) to know which blocks it keeps."""
        if self.layout is None:
            return [DenseLayerKV(self.data[i], slot_mapping) for i in range(self.num_layers)]
        if self.windows is not None and spans is None:
            raise ValueError(f"a {self.kv_format} cache needs the step's spans to place its windows")
        plan = None if self.windows is None else self.windows.plan(slot_mapping, spans)
        return [QuantLayerKV(self, i, slot_mapping, plan) for i in range(self.num_layers)]

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long, device=self.data.device)

    # -- export / import --------------------------------------------------------------------------------
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Contiguous copy ``payload_shape(n)`` of the given blocks (the last ones' windows appended)."""
        out = self.data.index_select(2, self._index(block_ids))
        if self.window_columns:
            out = torch.cat([out, self._export_windows(slice(None), block_ids)], dim=2)
        return out

    def import_blocks(self, block_ids: list[int], tensor: torch.Tensor) -> None:
        self._check("import_blocks", tensor, self.payload_shape(len(block_ids)), 2)
        self._import(slice(None), block_ids, tensor)

    def export_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """Contiguous copy ``payload_shape(n)[1:]`` of one layer's blocks."""
        out = self.data[layer].index_select(1, self._index(block_ids))
        if self.window_columns:
            out = torch.cat([out, self._export_windows(slice(layer, layer + 1), block_ids)[0]], dim=1)
        return out

    def import_layer(self, layer: int, block_ids: list[int], tensor: torch.Tensor) -> None:
        self._check("import_layer", tensor, self.payload_shape(len(block_ids))[1:], 1)
        self._import(slice(layer, layer + 1), block_ids, tensor[None])

    def _check(self, what: str, tensor: torch.Tensor, expected: tuple[int, ...], block_dim: int) -> None:
        """``expected``, or the same without the window columns (full blocks from the pool)."""
        records_only = list(expected)
        records_only[block_dim] -= self.window_columns
        if tuple(tensor.shape) not in (expected, tuple(records_only)):
            raise ValueError(f"{what}: tensor shape {tuple(tensor.shape)} != expected {expected}")

    def _import(self, layers: slice, block_ids: list[int], tensor: torch.Tensor) -> None:
        n = len(block_ids)
        tensor = tensor.to(self.data.device, self.data.dtype).contiguous()
        self.data[layers].index_copy_(2, self._index(block_ids), tensor[:, :, :n])
        if self.windows is not None:
            self.import_windows(layers, block_ids, tensor[:, 0, n:].flatten(1) if tensor.shape[2] > n else None)

    def import_windows(self, layers: slice, block_ids: list[int], window: torch.Tensor | None) -> None:
        """After the records of ``block_ids`` were imported: the windows of the last blocks from the
        payload's window columns (``[layers, window_columns * record_bytes]`` uint8), or none (every block a
        full record)."""
        tail = self._window_tail(block_ids)
        flags = [0] * len(tail) if window is None else window[0, [j * self._section_bytes for j, _ in tail]].tolist()
        flagged = [(j, b) for (j, b), flag in zip(tail, flags, strict=True) if flag]
        self.windows.release(sorted(set(block_ids) - {b for _, b in flagged}))
        for j, block in flagged:
            slot = self.windows.ensure(block)
            at = j * self._section_bytes + _WINDOW_HEADER
            values = window[:, at:at + self._window_bytes].view(torch.float32)
            self.windows.data[layers, :, slot] = values.view(-1, 2, *self.windows.data.shape[3:])

    def _window_tail(self, block_ids: list[int]) -> list[tuple[int, int]]:
        """(section, block) for the last blocks of a payload, the last block in the last section."""
        tail = block_ids[-self._sections:]
        return list(enumerate(tail, start=self._sections - len(tail)))

    def _export_windows(self, layers: slice, block_ids: list[int]) -> torch.Tensor:
        """``[layers, 1, window_columns, record_bytes]``: per section, flag 1 and its block's window, or zeros."""
        section = torch.zeros(self.data[layers].shape[0], self._sections, self._section_bytes, dtype=torch.uint8,
                              device=self.device)
        tail = self._window_tail(block_ids)
        slots = self.windows.slot_of[[b for _, b in tail]].tolist()  # one read, not one a section
        for (j, _), slot in zip(tail, slots, strict=True):
            if slot >= 0:
                section[:, j, 0] = 1
                values = self.windows.data[layers, :, slot].float().flatten(1)
                section[:, j, _WINDOW_HEADER:_WINDOW_HEADER + self._window_bytes] = values.view(torch.uint8)
        return section.view(-1, 1, self.window_columns, self.layout.record_bytes)

    def release_windows(self, block_ids: list[int]) -> None:
        """Blocks became shareable (registered in the prefix cache): every sequence reads their records now."""
        if self.windows is not None:
            self.windows.release(block_ids)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write support: block ``dst`` becomes a copy of ``src`` in every layer."""
        self.data[:, :, dst].copy_(self.data[:, :, src])
        if self.windows is not None:
            self.windows.copy(src, dst)
