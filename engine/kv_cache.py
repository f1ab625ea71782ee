"""Paged KV storage: one tensor ``[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]``.

A block holds ``block_size`` consecutive token positions of one sequence for every layer; a sequence's
block table lists its blocks in order, so position p lives at slot ``table[p // B] * B + p % B``.
Export/import move whole blocks (all layers, or one layer for layer-wise transfer) as contiguous copies.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig


class KVCache:
    def __init__(self, model_config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype | str, device: torch.device | str):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.num_layers = model_config.num_layers
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = model_config.num_kv_heads, model_config.head_dim
        self.data = torch.zeros(self.num_layers, 2, num_blocks, block_size, self.num_kv_heads,
                                self.head_dim, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.data[:, :, 0].numel() * self.data.element_size()

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long, device=self.data.device)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Contiguous copy ``[layers, 2, n, block_size, kv_heads, head_dim]`` of the given blocks."""
        return self.data.index_select(2, self._index(block_ids))

    def import_blocks(self, block_ids: list[int], tensor: torch.Tensor) -> None:
        expected = (self.num_layers, 2, len(block_ids), *self.data.shape[3:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"import_blocks: tensor shape {tuple(tensor.shape)} != expected {expected}")
        self.data.index_copy_(2, self._index(block_ids), tensor.to(self.data.device, self.data.dtype))

    def export_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """Contiguous copy ``[2, n, block_size, kv_heads, head_dim]`` of one layer's blocks."""
        return self.data[layer].index_select(1, self._index(block_ids))

    def import_layer(self, layer: int, block_ids: list[int], tensor: torch.Tensor) -> None:
        expected = (2, len(block_ids), *self.data.shape[3:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"import_layer: tensor shape {tuple(tensor.shape)} != expected {expected}")
        self.data[layer].index_copy_(1, self._index(block_ids), tensor.to(self.data.device, self.data.dtype))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write support: block ``dst`` becomes a copy of ``src`` in every layer."""
        self.data[:, :, dst].copy_(self.data[:, :, src])
