"""Attention sinks + sliding window (StreamingLLM, Xiao et al. 2023): ``--kv-window W --kv-sinks N``; and a
model's own sliding-window attention (Mistral v0.1's, Mixtral's), which is this window without sinks.

Not to be confused with ``engine/kv_window.py``, the quantized cache's full-precision copy of the blocks
sequences are still filling: that is how a block is stored, this is which tokens attention keeps at all.

What attention sees. The query at position p attends to the first N tokens (the sinks) and to the W most
recent tokens, itself included: keys j < N or p - W < j <= p; the tokens in between are evicted. Positions
are StreamingLLM's positions within the cache: sinks at 0..N-1, the window consecutive after them, so the
query sits at cache position c(p) = min(p, N + W - 1), inside the trained context (N + W <=
max_position_embeddings) however long the sequence grows. Until p reaches N + W nothing is evicted and the
engine runs its ordinary path, so a window longer than every sequence changes nothing.

Memory, block by block. After each step a sequence drops (``BlockManager.drop``) the blocks past its sink
blocks that lie wholly before the next query's window; a partly needed block stays, its extra tokens masked.
Dropping releases through the block manager's reference counts: a block a sibling sample or another prompt
with the same prefix still holds stays where it is, and a block registered in the prefix cache stays
findable (free, cached, least recently used first) until something reuses it. Prompts are prefilled in
chunks of at most W tokens (the scheduler's cap), so one step holds at most ``max_blocks`` blocks.

RoPE. Keys stay in the cache rotated by their original position, in every format (auto, int8, fp8, kivi2),
exactly as without a window: nothing is re-rotated or re-quantized. That is StreamingLLM's re-assignment of
positions, exactly, because a RoPE score depends only on the difference between the two positions:

* window key j sits at cache position c(p) - (p - j): difference p - j, which the query rotated at p gives
  against the key as stored (rotated at j);
* sink key i sits at cache position i, its original position: difference c(p) - i, which the query rotated
  at c(p) gives against the key as stored.

So each query is rotated twice, at p for window columns and at c(p) for sink columns, and one softmax covers
both (``sink_window_attention``). The textbook alternative, keys stored before rotation and rotated by cache
position at attention time, would change what the quantizers see (kivi2 fits per-channel key scales to the
rotated keys this cache stores) and rotate every gathered key in every layer and step; re-rotating stored
keys as blocks are evicted would dequantize, rotate and quantize them again, compounding the quantization
error. A second query rotation costs one row per token.

Positions keep growing with the sequence, and cos/sin are float32 angles as in transformers, off by about
p * 2**-24 positions; sequences are therefore capped at ``engine.config.DEFAULT_MAX_LEN`` tokens (an error
under 0.07 of a position) unless ``max_model_len`` sets the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import EngineConfig


@dataclass(frozen=True)
class StreamingWindow:
    window: int  # W: the most recent tokens each query sees, itself included
    sinks: int  # N: the leading tokens every query sees
    block_size: int

    @classmethod
    def from_config(cls, config: EngineConfig, context: int, model_window: int | None = None
                    ) -> StreamingWindow | None:
        """The engine's window (None: full attention): ``--kv-window`` / ``--kv-sinks``, else the model's own
        sliding window (``model_window``, Mistral's: no sinks). ValueError unless sinks + window fit
        ``context``, or if the window asked for is longer than the model's (it attends to no more)."""
        if config.kv_window is None:
            return None if model_window is None else cls(model_window, 0, config.block_size)
        if model_window is not None and config.kv_window > model_window:
            raise ValueError(f"kv_window {config.kv_window} is longer than the model's sliding window of "
                             f"{model_window} tokens, beyond which it never attends")
        if config.kv_sinks + config.kv_window > context:
            raise ValueError(f"kv_sinks + kv_window ({config.kv_sinks} + {config.kv_window}) exceed the "
                             f"model's context of {context} positions")
        return cls(config.kv_window, config.kv_sinks, config.block_size)

    @property
    def sink_blocks(self) -> int:
        return -(-self.sinks // self.block_size)

    @property
    def max_blocks(self) -> int:
        """Most blocks one sequence holds during a step: its sink blocks, and the blocks touched by a chunk of
        at most W tokens with the W - 1 positions before it (2W - 1 consecutive positions)."""
        return self.sink_blocks + (2 * self.window + 2 * self.block_size - 3) // self.block_size

    def applies(self, end_pos: int) -> bool:
        """Whether some query before ``end_pos`` has evicted tokens (a gap between sinks and window)."""
        return end_pos > self.sinks + self.window

    def droppable(self, num_computed: int) -> range:
        """Block indices that no query at a position >= ``num_computed`` reads: past the sink blocks and
        wholly before the window of the query at ``num_computed``."""
        end = (num_computed + 1 - self.window) // self.block_size
        return range(self.sink_blocks, max(self.sink_blocks, end))

    def kept_blocks(self, num_computed: int) -> list[int]:
        """Block indices a sequence of ``num_computed`` computed tokens still holds: what a hand-off of that
        many prompt tokens carries (the rest were dropped on the prefill side and are never read again)."""
        dropped = self.droppable(num_computed)
        return [i for i in range(-(-num_computed // self.block_size)) if i not in dropped]

    def cache_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """c(p) of each query: where the sinks see it."""
        return positions.clamp(max=self.sinks + self.window - 1)

    # -- attention metadata (the runner's) --------------------------------------------------------------
    def prefill_context(self, table: list[int], pos: torch.Tensor
                        ) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """For the queries at ``pos`` (consecutive): (block ids to gather, visible columns [n, S], which
        columns are sinks [S, 1], None without sinks)."""
        index = self._columns(int(pos[0]), int(pos[-1]) + 1)
        key_pos = (torch.tensor(index)[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
        return [table[i] for i in index], self._visible(key_pos[None, :], pos[:, None]), self._sinks(key_pos)

    def decode_context(self, tables: list[list[int]], positions: list[int]
                       ) -> tuple[list[int], int, torch.Tensor, torch.Tensor | None]:
        """For one query per row: (block ids, each row padded with block 0 to ``width`` blocks, width,
        visible columns [rows, width * block_size], which columns are sinks [rows, 1, width * block_size, 1],
        None without sinks)."""
        B = self.block_size
        rows = [self._columns(p, p + 1) for p in positions]
        width = max(map(len, rows))
        index = torch.tensor([r + [-1] * (width - len(r)) for r in rows])  # -1: padding
        ids = [table[i] if i >= 0 else 0 for table, row in zip(tables, index.tolist(), strict=True) for i in row]
        key_pos = (index[:, :, None] * B + torch.arange(B)).flatten(1)
        mask = self._visible(key_pos, torch.tensor(positions)[:, None]) & (index >= 0).repeat_interleave(B, 1)
        sinks = self._sinks(key_pos)
        return ids, width, mask, None if sinks is None else sinks[:, None]

    def _columns(self, start: int, end: int) -> list[int]:
        """Block indices the queries at ``start``..``end - 1`` read: the sink blocks, then from the first
        query's window to the last query."""
        last = -(-end // self.block_size)
        first = max(self.sink_blocks, (start + 1 - self.window) // self.block_size)
        return [*range(min(self.sink_blocks, last)), *range(first, last)]

    def _visible(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        return (key_pos <= query_pos) & ((key_pos < self.sinks) | (key_pos > query_pos - self.window))

    def _sinks(self, key_pos: torch.Tensor) -> torch.Tensor | None:
        return (key_pos < self.sinks)[..., None] if self.sinks else None


def sink_window_attention(q: torch.Tensor, q_sink: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor, sink_cols: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA in which sink columns (``sink_cols``, broadcast over ``k``) score against ``q_sink`` (queries
    rotated at their cache position) and the other columns against ``q``, under one softmax. Keys widen to
    [k, 0] on sink columns and [0, k] elsewhere and queries to [q_sink, q], so one dot product of width
    2 * head_dim gives each column its own query's score; the softmax ``scale`` is the model's (1 / sqrt(head_dim)
    unless it sets its own), not the widened width's."""
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    keys = torch.cat([torch.where(sink_cols, k, zero), torch.where(sink_cols, zero, k)], dim=-1)
    return F.scaled_dot_product_attention(torch.cat([q_sink, q], dim=-1), keys, v, attn_mask=mask,
                                          scale=scale, enable_gqa=True)
