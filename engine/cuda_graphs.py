"""CUDA graphs for decode steps (Triton backend): one captured forward pass per batch size of a ladder.

A decode step of a small model is bound by the CPU launching a few hundred kernels, not by the GPU. So,
as vLLM and nano-vllm do, the whole forward pass of a decode-only step is captured once per batch size
(1, 2, 4, 8, 16, 32, ... up to ``max_num_seqs``) over static buffers (token ids, positions, slots, block
tables, context lengths) and replayed: a step writes its inputs into pinned host mirrors of the buffers
(a row's block table only where it changed since the last step, as vLLM's persistent batch does), pads
the batch up to the next captured size, copies the mirrors over in three copies that do not wait for the
device's queued work and launches one graph. With async scheduling (``Engine``) some token ids are still on
the device, sampled by the step before: they are gathered into the token buffer there, before the replay.
Padded rows write nothing (slot -1, which the K/V write kernel skips) and attend over one position of a
valid block; their logits are dropped. Every shape is fixed at capture: the decode kernel's split-K factor
follows from the batch size and the largest context (``max_blocks`` x block size), never from a step's own
lengths, and each table row is read only up to its row's context length, so stale entries past it are
harmless. With speculative decoding a second ladder
holds the steps that verify drafts: every sequence of the step gets ``query_len`` rows (its last token and
draft, or a decode row, then padding that writes nothing), attended by the prefill kernel over each
sequence's last ``query_len`` positions (the padding after a sequence's real rows, so those see only real
keys); the logits of the padding are dropped. Steps with prompt tokens, or larger than the largest size,
run eagerly; ``EngineConfig.enforce_eager`` turns graphs off. With LoRA adapter slots,
each row's slot is one more buffer (-1: the base model, and the padding) that the grouped LoRA kernels read
(``engine/kernels/lora_matmul.py``), so steps of any mix of adapters replay the same graphs. Plain and int8 caches
(``GRAPH_KV_FORMATS``: the write kernel quantizes int8 rows on the device) are captured; fp8's window
pool (and kivi2's) decides on the host where each row goes, so those caches run eagerly.

The same buffers and forward pass run without capture off CUDA (``capture=False``): that is how the
padding and buffer logic is tested on CPU under the Triton interpreter; the capture itself needs CUDA.
A decode or verification step completes no prompt, so the runner's per-layer hook has nothing to do in it
and is not called (a captured graph could not call Python anyway).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from engine.lora import LoRABatch
from engine.model import AttentionMetadata
from engine.triton_attention import PagedAttentionMeta

if TYPE_CHECKING:
    from engine.runner import ModelRunner, SeqChunk, TokenFeed


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (which is always included), as vLLM's ladder."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int, max_blocks: int, capture: bool,
                 query_len: int = 1) -> None:
        """``max_blocks``: the longest block table a sequence can have (max_model_len / block_size).
        ``query_len``: with speculative decoding, 1 + the most draft tokens a sequence verifies in a step."""
        self.runner, self.sizes, self.query_len = runner, graph_batch_sizes(max_batch), query_len
        device, top, B = runner.device, self.sizes[-1], runner.block_size
        rows = top * query_len
        # The static buffers, as views of three tensors that a step fills with one host-to-device copy each from
        # host mirrors (pinned on CUDA): token ids, positions and slots by row (a token fed from the device is
        # written over its row's after the copy: ``TokenFeed.write``); each row's LoRA slot - 1 (-1: the base
        # model, and the padding) then each sequence's context length; the block tables.
        pin = device.type == "cuda"
        self._host_rows = torch.zeros(3, rows, dtype=torch.long, pin_memory=pin)
        self._host_rows[2] = -1  # no slot: a row writes nothing until a step fills it
        self._host_ints = torch.tensor([-1] * rows + [1] * top, dtype=torch.int32)
        self._host_ints = self._host_ints.pin_memory() if pin else self._host_ints
        # a drafted step's padding rows sit up to query_len - 1 positions past the context: its table has room.
        # Every entry past a row's table holds block 0, so whatever a padded row reads is a valid block.
        self._host_tables = torch.zeros(top, max_blocks + -(-(query_len - 1) // B), dtype=torch.int32,
                                        pin_memory=pin)
        self._known_tables: list[list[int]] = [[] for _ in range(top)]  # what each row of _host_tables holds
        # (the mirrors as numpy arrays, which take a Python list's ints in one call)
        self._rows_np, self._ints_np = self._host_rows.numpy(), self._host_ints.numpy()
        self._lens_np, self._tables_np = self._ints_np[rows:], self._host_tables.numpy()  # lengths: after LoRA slots
        self._padding_table = [0] * -(-query_len // B)  # a padding sequence's: its q positions in block 0
        self._row_inputs = self._host_rows.to(device, copy=True)
        self._int_inputs = self._host_ints.to(device, copy=True)
        self.input_ids, self.positions, self.slots = self._row_inputs.unbind()
        # recorded after a step's copies: the mirrors are written again only once those have run
        self._copied = torch.cuda.Event() if pin else None
        self.lora_index = self._int_inputs[:rows] if runner.with_lora else None
        self.context_lens = self._int_inputs[rows:]  # decode: position + 1; drafted: the sequence's length
        self.tables = torch.zeros_like(self._host_tables, device=device)
        self.rows = torch.arange(rows, dtype=torch.long, device=device)
        self.cu_seqlens = torch.arange(top + 1, dtype=torch.int32, device=device) * query_len
        self.max_context_len = max_blocks * B
        self._no_prefill = (torch.zeros(0, self.tables.shape[1], dtype=torch.int32, device=device),
                            torch.zeros(1, dtype=torch.int32, device=device),
                            torch.zeros(0, dtype=torch.int32, device=device))
        self._no_decode = (torch.zeros(0, self.tables.shape[1], dtype=torch.int32, device=device),
                           torch.zeros(0, dtype=torch.int32, device=device))
        self._logits: dict[tuple[int, int], torch.Tensor] = {}  # by (batch size, rows a sequence)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replays: Counter[int] = Counter()  # decode steps served, by padded batch size
        self.draft_replays: Counter[int] = Counter()  # steps verifying drafts served, by padded batch size
        if capture:
            self._capture_all()

    def fits(self, chunks: list[SeqChunk]) -> bool:
        """Whether every chunk of this step is a decode row (one token after some context) or a draft to verify
        (its last token and up to ``query_len`` - 1 draft tokens), and the step is small enough."""
        return 0 < len(chunks) <= self.sizes[-1] and all(
            c.start_pos > 0 and (len(c.token_ids) == 1 or (c.drafted and len(c.token_ids) <= self.query_len))
            for c in chunks)

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk], feed: TokenFeed | None = None) -> torch.Tensor:
        """Float32 logits of the step: a row per decode chunk and per token of a drafted chunk, in the order of
        ``chunks`` (valid until the next step). ``feed``: token ids still on the device."""
        n, size, q = len(chunks), *self.load(chunks, feed)
        (self.replays if q == 1 else self.draft_replays)[size] += 1
        if (size, q) in self._graphs:
            self._graphs[size, q].replay()
        else:
            self._logits[size, q] = self._forward(size, q)
        logits = self._logits[size, q]
        if q == 1:
            return logits[:n]
        keep = [i * q + j for i, c in enumerate(chunks) for j in range(len(c.token_ids))]
        return logits[torch.tensor(keep, device=logits.device)]

    def load(self, chunks: list[SeqChunk], feed: TokenFeed | None = None) -> tuple[int, int]:
        """Copy the step's inputs into the static buffers, padded up to the next captured batch size: (that
        size, rows a sequence). The host work a replayed step waits on, so it costs a few list comprehensions
        and three copies; a block table is rewritten only where it changed since its row last held it."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the mirrors (long since, as a rule)
        n, B = len(chunks), self.runner.block_size
        q = self.query_len if any(len(c.token_ids) > 1 for c in chunks) else 1
        size = next(s for s in self.sizes if s >= n)
        m, padded = n * q, size * q
        rows, ints, lens = self._rows_np, self._ints_np, self._lens_np
        if q == 1:
            rows[0, :m], rows[1, :m] = [c.token_ids[0] for c in chunks], [c.start_pos for c in chunks]
            rows[2, :m] = [c.block_table[c.start_pos // B] * B + c.start_pos % B for c in chunks]
        else:  # each sequence's tokens, then padding up to q rows (no token, position 0, writes nothing)
            rows[0, :m] = [c.token_ids[j] if j < len(c.token_ids) else 0 for c in chunks for j in range(q)]
            rows[1, :m] = [c.start_pos + j if j < len(c.token_ids) else 0 for c in chunks for j in range(q)]
            rows[2, :m] = [c.block_table[(c.start_pos + j) // B] * B + (c.start_pos + j) % B
                           if j < len(c.token_ids) else -1 for c in chunks for j in range(q)]
        ints[:m] = [c.lora - 1 for c in chunks for _ in range(q)]
        # a decode row sees positions up to its own; a drafted chunk's rows are the last q of its sequence
        lens[:n] = [c.start_pos + q for c in chunks]
        rows[2, m:padded], ints[m:padded], lens[n:size] = -1, -1, q  # padding sequences: write nothing
        self._load_tables([c.block_table for c in chunks] + [self._padding_table] * (size - n))
        width = max((c.start_pos + q - 1) // B + 1 for c in chunks)
        # (the first two are a few KiB: copied whole, they need no slicing on either side)
        self._row_inputs.copy_(self._host_rows, non_blocking=True)
        self._int_inputs.copy_(self._host_ints, non_blocking=True)
        self.tables[:size, :width].copy_(self._host_tables[:size, :width], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if feed is not None:  # (a fed chunk is a decode chunk, its token at its first row)
            feed.write(self.input_ids, [k * q for k in feed.chunks])
        return size, q

    def _load_tables(self, tables: list[list[int]]) -> None:
        """Write each table into its row of the host mirror where the row held another: a decode step mostly
        finds its rows as the last step left them, or grown by a block. What a shorter table no longer covers
        goes back to block 0."""
        host, known, cols = self._tables_np, self._known_tables, self._tables_np.shape[1]
        for i, table in enumerate(tables):
            held = known[i]
            if table == held:
                continue
            start = len(held) if len(held) < len(table) and table[:len(held)] == held else 0
            end = min(len(table), cols)
            host[i, start:end] = table[start:end]
            host[i, end:min(len(held), cols)] = 0
            known[i] = list(table)

    def _forward(self, size: int, q: int) -> torch.Tensor:
        """The forward pass of ``size`` sequences of ``q`` rows each over the static buffers (what a graph
        captures): decode attention when q is 1, else the prefill kernel over each sequence's last q positions."""
        window, rows = self.runner.paged_window, size * q
        if q == 1:
            paged = PagedAttentionMeta(self.tables[:size], self.context_lens[:size], self.max_context_len,
                                       *self._no_prefill, 0, window)
        else:
            paged = PagedAttentionMeta(*self._no_decode, 0, self.tables[:size], self.cu_seqlens[:size + 1],
                                       self.context_lens[:size], q, window)
        meta = AttentionMetadata(self.slots[:rows], [], size if q == 1 else 0, paged=paged)
        if self.lora_index is not None:
            meta.lora = LoRABatch(index=self.lora_index[:rows])
        kv_layers = self.runner.kv_cache.for_step(self.slots[:rows])
        return self.runner.model(self.input_ids[:rows], self.positions[:rows], meta, kv_layers, self.rows[:rows])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every size (for drafted steps too, with speculative decoding), the largest first, all in one
        memory pool (each graph's temporaries are free again once it has run, so the smaller ones fit in
        what the largest took)."""
        pool = None
        for q in sorted({1, self.query_len}, reverse=True):
            for size in reversed(self.sizes):
                self._forward(size, q)  # warm-up: compiles this size's kernel variants and settles allocations
                torch.cuda.synchronize(self.runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._logits[size, q] = self._forward(size, q)
                pool = graph.pool() if pool is None else pool
                self._graphs[size, q] = graph
        torch.cuda.synchronize(self.runner.device)
