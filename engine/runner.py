"""Batch of sequence chunks -> flattened tokens, positions, slot mapping, attention metadata -> logits.

A chunk is a run of new tokens of one sequence: a whole prompt, a piece of a long prompt (chunked
prefill, after a cached prefix) or the single token of a decode step. All chunks of a step go through
one forward pass; nothing is padded except the decode rows' gathered context inside attention (the torch
path; the Triton backend only pads the block tables its kernels read, ``engine/triton_attention.py``). With an
attention window (``engine/streaming_window.py``), a chunk whose queries have evicted tokens gathers only
its sink and window blocks, under the window's mask, and sinks see each query at its cache position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import GRAPH_KV_FORMATS, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.lora import LoRABatch, LoRARows
from engine.model import AttentionMetadata, CausalLM, PrefillMeta, rope_cos_sin
from engine.streaming_window import StreamingWindow
from engine.to_device import device_index, device_values
from engine.triton_attention import paged_metadata


@dataclass
class SeqChunk:
    """Compute ``token_ids`` at positions ``start_pos``..; K/V of positions < start_pos are already in
    the cache at the slots ``block_table`` gives, and the table covers every position up to
    ``start_pos + len(token_ids)``."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    all_logits: bool = False  # logits of every token of the chunk, not only the last (prompt logprobs)
    # LongRoPE: the sequence is longer than the original context, so every position rotates with the long
    # factors (``CausalLM.rope_tables``)
    long_rope: bool = False
    lora: int = 0  # the sequence's LoRA adapter slot (``engine/lora.py``); 0: the base model
    drafted: bool = False  # the sequence's last token and a draft to verify (speculative decoding)


@dataclass
class TokenFeed:
    """Input tokens a step takes from the device (async scheduling, ``Engine``): the one token of decode chunk
    ``chunks[k]`` is ``tokens[rows[k]]``, which the step before sampled and the host has not seen yet (the
    chunk holds a placeholder for it)."""

    chunks: list[int]
    rows: list[int]
    tokens: torch.Tensor

    def write(self, input_ids: torch.Tensor, positions: list[int]) -> None:
        """Put the fed tokens into the step's ``input_ids`` on the device: chunk ``chunks[k]``'s at
        ``positions[k]`` (one copy of the indices and two ops, however many are fed)."""
        at, rows = device_index([positions, self.rows], input_ids.device)
        input_ids.index_copy_(0, at, self.tokens.index_select(0, rows))


class ModelRunner:
    def __init__(self, model: CausalLM, model_config: ModelConfig, kv_cache: KVCache,
                 window: StreamingWindow | None = None, attention_backend: str = "torch", with_lora: bool = False):
        """``attention_backend``: "torch" (gather + SDPA) or "triton" (``engine/triton_attention.py``: a
        sliding window, no sinks); ``engine.triton_attention.attention_backend`` resolves "auto".
        ``with_lora``: the model has LoRA adapter slots (``engine/lora_slots.py``), which decode graphs read."""
        if attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend must be 'torch' or 'triton', got {attention_backend!r}")
        if attention_backend == "triton" and window is not None and window.sinks:
            raise ValueError("the triton attention backend has no attention sinks (a sliding window runs on it)")
        if window is not None and window.sinks and model_config.long_rope_from is not None:
            raise ValueError("attention sinks rotate queries at their cache position, which LongRoPE's two "
                             "frequency sets do not define: serve this model without --kv-sinks")
        self.model, self.config, self.kv_cache, self.window = model, model_config, kv_cache, window
        self.with_lora = with_lora
        self.paged_window = 0 if window is None else window.window  # the kernels' sliding window (0: none)
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        self.paged = attention_backend == "triton"
        # K and V gather buffers (see AttentionMetadata.k_buf), grown to the most blocks a step gathers;
        # the Triton kernels gather nothing.
        self._gather_bufs = None if self.paged else kv_cache.gather_buffers(0)
        self.graphs: DecodeGraphs | None = None  # decode-only steps replayed from CUDA graphs (cuda_graphs.py)

    def enable_decode_graphs(self, max_batch: int, max_blocks: int, capture: bool = True,
                             query_len: int = 1) -> None:
        """Run decode-only steps of up to ``max_batch`` sequences through ``DecodeGraphs`` (Triton backend), and
        steps verifying drafts of up to ``query_len`` - 1 tokens: captured on CUDA; ``capture=False`` runs the
        same static-buffer pass uncaptured (tests on CPU)."""
        if not self.supports_decode_graphs:
            raise ValueError(f"decode graphs need the triton attention backend and a "
                             f"{' or '.join(GRAPH_KV_FORMATS)} cache")
        self.graphs = DecodeGraphs(self, max_batch, max_blocks, capture, query_len)

    @property
    def supports_decode_graphs(self) -> bool:
        """Whether a decode step can be captured: Triton attention over a cache whose writes never wait for
        the host."""
        return self.paged and self.kv_cache.kv_format in GRAPH_KV_FORMATS

    def _check(self, c: SeqChunk) -> int:
        n = len(c.token_ids)
        if n == 0:
            raise ValueError("a chunk needs at least one token")
        if (c.start_pos + n + self.block_size - 1) // self.block_size > len(c.block_table):
            raise ValueError(f"block table of {len(c.block_table)} blocks does not cover position "
                             f"{c.start_pos + n - 1}")
        return n

    def prepare(self, chunks: list[SeqChunk], feed: TokenFeed | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, the rows whose logits the pass returns) for one pass:
        each chunk's last row, or all of its rows when it asks for ``all_logits``, in the order of ``chunks``;
        the tokens ``feed`` names are taken from the device.

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
        first_rows: dict[int, int] = {}  # of the chunks that want every row's logits
        prefills: list[PrefillMeta] = []
        for i in prefill:
            c, n, begin = chunks[i], lens[i], len(token_ids)
            end_pos = c.start_pos + n
            pos = torch.arange(c.start_pos, end_pos)
            first = c.start_pos // B  # the chunk's own blocks (a windowed table may be long and gapped)
            own = torch.tensor(c.block_table[first:(end_pos + B - 1) // B], dtype=torch.long)
            token_ids.extend(c.token_ids)
            positions.extend(pos.tolist())
            slots.extend((own[pos // B - first] * B + pos % B).tolist())
            last_rows[i] = begin + n - 1
            if c.all_logits:
                first_rows[i] = begin
            if not self.paged:
                prefills.append(self._prefill_meta(c, begin, n, pos))
        meta = AttentionMetadata(device_values(slots, torch.long, self.device), prefills, len(decode))
        if any(chunks[i].long_rope for i in prefill):
            meta.long_rope_rows = torch.tensor([False] * len(decode) + [
                chunks[i].long_rope for i in prefill for _ in range(lens[i])], device=self.device)
        if any(c.lora for c in chunks):
            slots = [chunks[i].lora for i in decode] + [chunks[i].lora for i in prefill for _ in range(lens[i])]
            # a decode step on the Triton backend takes every adapter in two grouped launches a layer;
            # prompt rows keep the per-adapter matmuls (each row of the grouped kernel reads its whole A)
            meta.lora = (LoRABatch(index=device_values([s - 1 for s in slots], torch.long, self.device))
                         if self.paged and not prefill else LoRABatch(self._lora_rows(slots)))
        pos = device_values(positions, torch.long, self.device)
        if self.paged:
            meta.paged = paged_metadata([(chunks[i].block_table, chunks[i].start_pos + 1) for i in decode],
                                        [(chunks[i].block_table, lens[i], chunks[i].start_pos + lens[i])
                                         for i in prefill], B, self.device, self.paged_window)
        else:
            self._decode_meta(meta, [chunks[i] for i in decode], pos)
        rows = last_rows if not first_rows else [
            row for i, last in enumerate(last_rows) for row in range(first_rows.get(i, last), last + 1)]
        input_ids = device_values(token_ids, torch.long, self.device)
        if feed is not None:  # a fed chunk is a decode chunk: its one row is its last
            feed.write(input_ids, [last_rows[i] for i in feed.chunks])
        return input_ids, pos, meta, device_values(rows, torch.long, self.device)

    def _lora_rows(self, slots: list[int]) -> LoRARows:
        """Each adapter's rows of the step (row i is ``slots[i]``'s); None for an adapter with every row."""
        if len(set(slots)) == 1:
            return [(slots[0], None)]
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot:
                by_slot.setdefault(slot, []).append(row)
        return [(slot, device_values(rows, torch.long, self.device)) for slot, rows in by_slot.items()]

    def _prefill_meta(self, c: SeqChunk, begin: int, n: int, pos: torch.Tensor) -> PrefillMeta:
        """The torch path's view of one chunk: its context blocks and mask, unless nothing precedes it in a
        plain cache (then its own K/V is its whole context)."""
        B, end_pos = self.block_size, c.start_pos + n
        if self.window is not None and self.window.applies(end_pos):
            ctx, mask, sink_cols = self.window.prefill_context(c.block_table, pos)
            return PrefillMeta(begin, begin + n, torch.tensor(ctx, device=self.device), mask.to(self.device),
                               _to(sink_cols, self.device))
        if c.start_pos == 0 and self.kv_cache.kv_format == "auto":
            return PrefillMeta(begin, begin + n, None, None)
        # Query at position p sees key columns 0..p. A quantized cache's fresh prompt reads its own K/V back
        # too, as a prefix hit would (and as the Triton kernels and vLLM v1 do): a cached prefix never
        # changes a prompt's output.
        table = torch.tensor(c.block_table[:(end_pos + B - 1) // B], dtype=torch.long)
        mask = torch.arange(len(table) * B)[None, :] <= pos[:, None]
        return PrefillMeta(begin, begin + n, table.to(self.device), mask.to(self.device))

    def _decode_meta(self, meta: AttentionMetadata, decode: list[SeqChunk], pos: torch.Tensor) -> None:
        """The torch path's decode tables and masks, gather buffers and attention-sink rotations."""
        B, prefills = self.block_size, meta.prefills
        gathered = max([len(p.ctx_blocks) for p in prefills if p.ctx_blocks is not None], default=0)
        if decode:
            if self.window is not None and any(self.window.applies(c.start_pos + 1) for c in decode):
                ids, width, mask, sink_cols = self.window.decode_context(
                    [c.block_table for c in decode], [c.start_pos for c in decode])
                blocks, meta.decode_sink_cols = torch.tensor(ids), _to(sink_cols, self.device)
            else:
                width = max((c.start_pos + B) // B for c in decode)  # blocks covering pos 0..start
                tables = [c.block_table[:width] + [0] * (width - len(c.block_table[:width])) for c in decode]
                ctx = torch.tensor([c.start_pos + 1 for c in decode])
                mask = torch.arange(width * B)[None, :] < ctx[:, None]
                blocks = torch.tensor(tables).flatten()
            meta.decode_blocks = blocks.to(self.device)
            meta.decode_mask = mask[:, None, None, :].to(self.device)
            gathered = max(gathered, len(decode) * width)
        if gathered > self._gather_bufs.shape[1]:
            self._gather_bufs = self.kv_cache.gather_buffers(gathered)
        meta.k_buf, meta.v_buf = self._gather_bufs[0], self._gather_bufs[1]
        if meta.decode_sink_cols is not None or any(p.sink_cols is not None for p in prefills):
            meta.sink_cos, meta.sink_sin = rope_cos_sin(self.window.cache_positions(pos), self.model.inv_freq,
                                                        self.kv_cache.dtype, self.model.rope_scale)

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk], on_layer_done: Callable[[int], None] | None = None,
            feed: TokenFeed | None = None) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of each chunk's last token (of each of its tokens when it asks for
        ``all_logits``), in the order of ``chunks``; writes the chunks' K/V. ``feed``: input tokens still on
        the device."""
        if self.graphs is not None and self.graphs.fits(chunks):  # completes no prompt: no layer hook
            return self.graphs.run(chunks, feed)
        return self.model(*self._pass(chunks, feed), on_layer_done)

    @torch.inference_mode()
    def final_hidden(self, chunks: list[SeqChunk], on_layer_done: Callable[[int], None] | None = None
                     ) -> torch.Tensor:
        """The final-norm hidden states of the rows ``run`` returns logits of (``model.logits`` makes them
        those logits), in the model's dtype; never replayed from a decode graph."""
        return self.model.final_hidden(*self._pass(chunks, None), on_layer_done)

    def _pass(self, chunks: list[SeqChunk], feed: TokenFeed | None) -> tuple:
        """The model's inputs for one pass over ``chunks``: input ids, positions, attention metadata, each
        layer's K/V for the step, and the rows it returns."""
        input_ids, positions, meta, rows = self.prepare(chunks, feed)
        kv_layers = self.kv_cache.for_step(meta.slot_mapping, [(c.block_table, c.start_pos,
                                                                 c.start_pos + len(c.token_ids)) for c in chunks])
        return input_ids, positions, meta, kv_layers, rows


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)
