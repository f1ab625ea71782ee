"""CUDA graphs for decode steps (Triton backend): one captured forward pass per batch size of a ladder.

A decode step of a small model is bound by the CPU launching a few hundred kernels, not by the GPU. So,
as vLLM and nano-vllm do, the whole forward pass of a decode-only step is captured once per batch size
(1, 2, 4, 8, 16, 32, ... up to ``max_num_seqs``) over static buffers (token ids, positions, slots, block
tables, context lengths) and replayed: a step copies its inputs into the buffers, pads the batch up to
the next captured size and launches one graph. Padded rows write nothing (slot -1, which the K/V write
kernel skips) and attend over one position of a valid block; their logits are dropped. Every shape is
fixed at capture: the decode kernel's split-K factor follows from the batch size and the largest context
(``max_blocks`` x block size), never from a step's own lengths, and each table row is read only up to its
row's context length, so stale entries past it are harmless. Steps with prompt tokens, or larger than
the largest size, run eagerly; ``EngineConfig.enforce_eager`` turns graphs off. With LoRA adapter slots,
each row's slot is one more buffer (-1: the base model, and the padding) that the grouped LoRA kernels read
(``engine/kernels/lora_matmul.py``), so steps of any mix of adapters replay the same graphs. Plain and int8 caches
(``GRAPH_KV_FORMATS``: the write kernel quantizes int8 rows on the device) are captured; fp8's window
pool (and kivi2's) decides on the host where each row goes, so those caches run eagerly.

The same buffers and forward pass run without capture off CUDA (``capture=False``): that is how the
padding and buffer logic is tested on CPU under the Triton interpreter; the capture itself needs CUDA.
A decode-only step completes no prompt, so the runner's per-layer hook has nothing to do in it and is
not called (a captured graph could not call Python anyway).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from engine.lora import LoRABatch
from engine.model import AttentionMetadata
from engine.triton_attention import PagedAttentionMeta

if TYPE_CHECKING:
    from engine.runner import ModelRunner, SeqChunk


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (which is always included), as vLLM's ladder."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int, max_blocks: int, capture: bool) -> None:
        """``max_blocks``: the longest block table a sequence can have (max_model_len / block_size)."""
        self.runner, self.sizes = runner, graph_batch_sizes(max_batch)
        device, top = runner.device, self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.rows = torch.arange(top, dtype=torch.long, device=device)
        self.lora_index = torch.full((top,), -1, dtype=torch.int32, device=device) if runner.with_lora else None
        self.max_context_len = max_blocks * runner.block_size
        self._no_prefill = (torch.zeros(0, max_blocks, dtype=torch.int32, device=device),
                            torch.zeros(1, dtype=torch.int32, device=device),
                            torch.zeros(0, dtype=torch.int32, device=device))
        self._logits: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays: Counter[int] = Counter()  # decode steps served, by padded batch size
        if capture:
            self._capture_all()

    def fits(self, chunks: list[SeqChunk]) -> bool:
        """Whether this step is decode-only (one token after some context each) and small enough."""
        return 0 < len(chunks) <= self.sizes[-1] and all(len(c.token_ids) == 1 and c.start_pos > 0 for c in chunks)

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Float32 logits ``[len(chunks), vocab]`` of a decode-only step (valid until the next step)."""
        n, B = len(chunks), self.runner.block_size
        size = next(s for s in self.sizes if s >= n)
        positions = [c.start_pos for c in chunks]
        width = max(p // B + 1 for p in positions)
        rows = torch.tensor([[c.token_ids[0], p, c.block_table[p // B] * B + p % B, p + 1, c.lora - 1]
                             for c, p in zip(chunks, positions, strict=True)], dtype=torch.long)
        tables = torch.tensor([c.block_table[:width] + [0] * (width - len(c.block_table[:width]))
                               for c in chunks], dtype=torch.int32)
        rows, tables = rows.to(self.runner.device), tables.to(self.runner.device)
        self.input_ids[:n], self.positions[:n], self.slots[:n] = rows[:, 0], rows[:, 1], rows[:, 2]
        self.context_lens[:n] = rows[:, 3].to(torch.int32)
        self.tables[:n, :width] = tables
        self.slots[n:size], self.context_lens[n:size] = -1, 1  # padding: writes nothing, reads one position
        if self.lora_index is not None:
            self.lora_index[:n], self.lora_index[n:size] = rows[:, 4].to(torch.int32), -1
        self.replays[size] += 1
        if size in self._graphs:
            self._graphs[size].replay()
        else:
            self._logits[size] = self._forward(size)
        return self._logits[size][:n]

    def _forward(self, size: int) -> torch.Tensor:
        """The forward pass of ``size`` decode rows over the static buffers (what a graph captures)."""
        meta = AttentionMetadata(self.slots[:size], [], size, paged=PagedAttentionMeta(
            self.tables[:size], self.context_lens[:size], self.max_context_len, *self._no_prefill, 0,
            self.runner.paged_window))
        if self.lora_index is not None:
            meta.lora = LoRABatch(index=self.lora_index[:size])
        kv_layers = self.runner.kv_cache.for_step(self.slots[:size])
        return self.runner.model(self.input_ids[:size], self.positions[:size], meta, kv_layers, self.rows[:size])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every size, the largest first, all in one memory pool (each graph's temporaries are
        free again once it has run, so the smaller ones fit in what the largest took)."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles this size's kernel variants and settles allocations
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self._graphs[size] = graph
        torch.cuda.synchronize(self.runner.device)
