"""Batch of sequence chunks -> flattened tokens, positions, slot mapping, attention metadata -> logits.

A chunk is a run of new tokens of one sequence: a whole prompt, a piece of a long prompt (chunked
prefill, after a cached prefix) or the single token of a decode step. All chunks of a step go through
one forward pass; nothing is padded except the decode rows' gathered context inside attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.model import AttentionMetadata, CausalLM, PrefillMeta


@dataclass
class SeqChunk:
    """Compute ``token_ids`` at positions ``start_pos``..; K/V of positions < start_pos are already in
    the cache at the slots ``block_table`` gives, and the table covers every position up to
    ``start_pos + len(token_ids)``."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]


class ModelRunner:
    def __init__(self, model: CausalLM, model_config: ModelConfig, kv_cache: KVCache):
        self.model, self.config, self.kv_cache = model, model_config, kv_cache
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        # K and V gather buffers (see AttentionMetadata.k_buf), grown to the most blocks a step gathers.
        self._gather_bufs = kv_cache.data.new_empty(2, 0, *kv_cache.data.shape[3:])

    def _check(self, c: SeqChunk) -> int:
        n = len(c.token_ids)
        if n == 0:
            raise ValueError("a chunk needs at least one token")
        if (c.start_pos + n + self.block_size - 1) // self.block_size > len(c.block_table):
            raise ValueError(f"block table of {len(c.block_table)} blocks does not cover position "
                             f"{c.start_pos + n - 1}")
        return n

    def prepare(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                          torch.Tensor]:
        """(input_ids, positions, attention metadata, row of each chunk's last token) for one pass.

        Decode chunks (one token after some context) take the first rows so attention can treat them
        as one contiguous batch; logits still come back in the order of ``chunks``."""
        B = self.block_size
        lens = [self._check(c) for c in chunks]
        decode = [i for i, c in enumerate(chunks) if lens[i] == 1 and c.start_pos > 0]
        prefill = [i for i, c in enumerate(chunks) if not (lens[i] == 1 and c.start_pos > 0)]
        # Decode rows: plain Python ints, one per chunk (this is the per-step hot path).
        token_ids = [chunks[i].token_ids[0] for i in decode]
        positions = [chunks[i].start_pos for i in decode]
        slots = [chunks[i].block_table[p // B] * B + p % B for i, p in zip(decode, positions, strict=True)]
        last_rows = [0] * len(chunks)
        for row, i in enumerate(decode):
            last_rows[i] = row
        prefills: list[PrefillMeta] = []
        for i in prefill:
            c, n, begin = chunks[i], lens[i], len(token_ids)
            end_pos = c.start_pos + n
            pos = torch.arange(c.start_pos, end_pos)
            table = torch.tensor(c.block_table[:(end_pos + B - 1) // B], dtype=torch.long)
            token_ids.extend(c.token_ids)
            positions.extend(pos.tolist())
            slots.extend((table[pos // B] * B + pos % B).tolist())
            last_rows[i] = begin + n - 1
            if c.start_pos == 0:
                prefills.append(PrefillMeta(begin, begin + n, None, None))
            else:  # after cached context: query at position p sees key columns 0..p
                mask = torch.arange(len(table) * B)[None, :] <= pos[:, None]
                prefills.append(PrefillMeta(begin, begin + n, table.to(self.device), mask.to(self.device)))
        meta = AttentionMetadata(torch.tensor(slots, device=self.device), prefills, len(decode))
        gathered = max([len(p.ctx_blocks) for p in prefills if p.ctx_blocks is not None], default=0)
        if decode:
            width = max((chunks[i].start_pos + B) // B for i in decode)  # blocks covering pos 0..start
            tables = [chunks[i].block_table[:width] + [0] * (width - len(chunks[i].block_table[:width]))
                      for i in decode]
            ctx = torch.tensor([chunks[i].start_pos + 1 for i in decode])
            mask = torch.arange(width * B)[None, :] < ctx[:, None]
            meta.decode_blocks = torch.tensor(tables, device=self.device).flatten()
            meta.decode_mask = mask[:, None, None, :].to(self.device)
            gathered = max(gathered, len(decode) * width)
        if gathered > self._gather_bufs.shape[1]:
            self._gather_bufs = self.kv_cache.data.new_empty(2, gathered, *self.kv_cache.data.shape[3:])
        meta.k_buf, meta.v_buf = self._gather_bufs[0], self._gather_bufs[1]
        return (torch.tensor(token_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, device=self.device), meta,
                torch.tensor(last_rows, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk],
            on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Float32 logits ``[len(chunks), vocab]`` of each chunk's last token; writes the chunks' K/V."""
        input_ids, positions, meta, last_rows = self.prepare(chunks)
        return self.model(input_ids, positions, meta, self.kv_cache.data, last_rows, on_layer_done)
