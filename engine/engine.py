"""The engine: the one object a worker drives.

``add_request`` queues a prompt, ``step`` runs one forward pass over whatever the scheduler picked and
returns each sampled token, ``abort`` drops a request at any point. Disaggregated serving adds: a
prefill-only request stops after its first token (``FinishReason.PREFILLED``) and keeps its blocks for
the hand-off (``request_block_ids``); the decode side ``reserve_blocks``, writes the K/V into them
(``engine/kv_import.py``, as it arrives) and continues with ``add_imported_request``; ``release`` frees what either side still holds. ``export_cached_prefix``
copies cached blocks out for the pool and peers, ``insert_cached_blocks`` makes blocks fetched from them
prefix-cache hits, and ``take_block_events`` hands out what the prefix cache stored and evicted.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.block_events import BlockEvent
from engine.block_manager import NO_BLOCK, BlockManager
from engine.config import EngineConfig, long_rope_applies
from engine.device_memory import engine_num_blocks
from engine.draft_model import DraftModelProposer, draft_block_bytes, load_draft_model
from engine.engine_stats import EngineStats, StepComposition, engine_stats
from engine.errors import InvalidRequestError, LoRAAdapterError
from engine.kv_cache import KVCache
from engine.kv_format import WINDOWED
from engine.loader import load_model, model_id_for, resolve_model_dir
from engine.lora import PackedAdapter, adapter_id, read_adapter
from engine.lora_slots import DEFAULT_MAX_LORA_RANK, LoRASlots
from engine.output import FinishReason, OutputText, RequestOutput, TokenLogprobs, check_finish
from engine.pooling import read_pooling
from engine.request_limits import RequestLimits
from engine.runner import ModelRunner, SeqChunk, TokenFeed
from engine.sampler import (
    Draws,
    LogprobFigures,
    bad_word_bans,
    draw_ahead,
    make_generator,
    sample,
    sample_tokens,
    skip_draws,
    top_logprobs,
)
from engine.sampling_params import Priority, SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, SeqStatus, Sequence
from engine.speculative import DraftRequest, DraftRules, NgramProposer, PredictedOutput, SpeculationStats
from engine.streaming_window import StreamingWindow
from engine.structured_output import GrammarMasks
from engine.to_device import device_values, host_copy
from engine.token_counts import TokenCounts
from engine.tokenizer import load_tokenizer
from engine.triton_attention import attention_backend
from kvstore.hashing import salt_for

# on_layer_done(layer, completing): layer ``layer``'s K/V of this step is written; ``completing`` maps each
# prefill-only request whose prompt completes in this step to its block table (to ship that layer early).
LayerHook = Callable[[int, dict[str, list[int]]], None]

# What a sequence's token_ids hold, under async scheduling, for a token still on the device (never a token id:
# a step that read it as one fails at the embedding instead of computing on a wrong token).
TOKEN_ON_DEVICE = -1


@dataclass
class _StepInFlight:
    """A step launched with async scheduling whose sampled tokens have not been seen by the host yet. Each
    sequence's token_ids end with TOKEN_ON_DEVICE until then: the next step takes these tokens to the host
    before anything else is appended."""

    seqs: list[Sequence]  # the sequences it sampled, by row
    tokens: torch.Tensor  # the tokens on the device: the next step's inputs read them there
    host: torch.Tensor  # ... and copied to the host, there once ``copied`` has passed (off CUDA: ``tokens``)
    logprobs: LogprobFigures | None  # on the host too, for the rows that asked for them
    copied: torch.cuda.Event | None

    @classmethod
    def launch(cls, seqs: list[Sequence], tokens: torch.Tensor,
               logprobs: LogprobFigures | None) -> _StepInFlight:
        """Start copying ``tokens`` (and ``logprobs``) to the host behind the step's queued work, and hold a
        place for each token."""
        for s in seqs:
            s.token_ids.append(TOKEN_ON_DEVICE)
        host, logprobs = host_copy(tokens), None if logprobs is None else logprobs.to_host()
        copied = torch.cuda.Event() if tokens.device.type == "cuda" else None
        if copied is not None:
            copied.record()
        return cls(seqs, tokens, host, logprobs, copied)

    def wait(self) -> None:
        """Until the step's work on the device, its writes to the K/V blocks included, is done."""
        if self.copied is not None:
            self.copied.synchronize()


class Engine:
    def __init__(self, config: EngineConfig):
        self.config, self.block_size = config, config.block_size
        model_dir, self.model_id = resolve_model_dir(config.model), model_id_for(config.model)
        self.model, self.model_config = load_model(model_dir, config.dtype, config.device, config.quantization)
        quant = self.model_config.weight_quant
        self.quantized_at_load = config.quantization if quant is not None and quant.online else None  # hash salt
        # before the KV cache is sized: the adapter slots take device memory too
        adapters = [read_adapter(name, path, self.model_id, self.model, self.model_config)
                    for name, path in config.lora_modules.items()]
        self.lora_slots = self._lora_slots(config, max((a.rank for a in adapters), default=0))
        # every adapter loaded, in host memory (in the model's dtype); those in use also in a slot
        self.loras: dict[str, PackedAdapter] = {}
        self.max_cpu_loras = config.max_cpu_loras or max(len(adapters), 0 if self.lora_slots is None
                                                         else self.lora_slots.max_loras)
        for packed in adapters:
            self._register(packed)
        model_window = self.model_config.sliding_window  # Mistral's: attention within the last W tokens
        self.attention_backend = backend = attention_backend(config)  # "torch" | "triton" (triton_attention)
        self.tokenizer = load_tokenizer(config, model_dir, self.model_config.vocab_size)
        self.pooling = read_pooling(model_dir)  # how an embedding request's vector is made (engine/pooling.py)
        speculative = config.speculative
        # a draft model's weights are loaded before the cache is sized, and its cache (as many blocks) paid from it
        draft = None if config.speculative_model is None else load_draft_model(config, self.model_config)
        num_blocks = engine_num_blocks(self.model, self.model_config, config, backend,
                                       0 if draft is None else draft_block_bytes(draft[1], config))
        # A full window pool reclaims the windows of blocks the block manager has freed; a block the prefix
        # cache registers drops its window (another sequence reads it as its record).
        residual = config.residual_blocks
        self.kv_cache = KVCache(self.model_config, num_blocks, config.block_size, config.dtype, config.device,
                                config.kv_cache_dtype, config.max_num_seqs * (residual + 1),
                                block_in_use=lambda block: self.block_manager.ref[block] > 0,
                                residual_blocks=residual)
        self.device = self.kv_cache.device
        # attention sinks + sliding window: None is full attention; with one, sequences may outgrow the context
        if self.model_config.attn_logit_softcapping and config.kv_sinks:
            raise ValueError("--kv-sinks: this model soft-caps its attention scores (Gemma's "
                             "attn_logit_softcapping), which the sink attention does not: serve it without --kv-sinks")
        if self.model_config.layer_windows and config.kv_window is not None:
            raise ValueError("--kv-window drops blocks every layer reads, and this model's full-attention layers "
                             "read them all (only some of its layers slide): serve it without --kv-window")
        self.window = StreamingWindow.from_config(config, self.model_config.max_position_embeddings, model_window)
        self.runner = ModelRunner(self.model, self.model_config, self.kv_cache, self.window, backend,
                                  with_lora=self.lora_slots is not None)
        self.block_manager = BlockManager(num_blocks, config.block_size, salt_for(self.model_id, quantized_at_load=self.quantized_at_load),
                                          config.enable_prefix_caching, config.enable_block_events, residual,
                                          self.kv_cache.release_windows)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   None if self.window is None else self.window.window)
        if self.lora_slots is not None:
            self.scheduler.adapter_ready = self._adapter_ready
        self.max_model_len = config.max_model_len_for(self.model_config)
        eos = set(self.model_config.eos_token_ids)
        self.eos_token_ids = eos | set(self.tokenizer.eos_token_ids) if self.tokenizer else eos
        self.limits = RequestLimits(self.model_config.vocab_size, self.max_model_len, self.block_size,
                                    num_blocks, self.window, frozenset(self.eos_token_ids))
        graphed = self.device.type == "cuda" and not config.enforce_eager  # decode steps replay CUDA graphs
        max_blocks = -(-self.max_model_len // self.block_size)
        if self.runner.supports_decode_graphs and graphed:
            self.runner.enable_decode_graphs(config.max_num_seqs, max_blocks,
                                             query_len=config.num_speculative_tokens + 1)
        self.grammars = GrammarMasks(self.tokenizer.file if self.tokenizer else None,
                                     self.model_config.vocab_size, sorted(self.eos_token_ids))
        self.proposer = (None if speculative is None else NgramProposer(speculative) if draft is None
                         else DraftModelProposer(speculative, *draft, num_blocks, config, backend, self.window,
                                                 self.grammars))
        if draft is not None and graphed and self.proposer.runner.supports_decode_graphs:
            self.proposer.runner.enable_decode_graphs(config.max_num_seqs, max_blocks)  # its one-token passes
        self.speculation = SpeculationStats()
        self.token_counts = TokenCounts(self.model_config.vocab_size, self.device, config.max_num_seqs)
        # Async scheduling: a speculating engine verifies drafts on the host, and a LongRoPE one may recompute a
        # sequence at any step, so those run every step synchronously
        self._async = (config.async_scheduling and self.proposer is None
                       and self.model_config.long_rope_from is None)
        self.requests: dict[str, list[Sequence]] = {}  # live (waiting or running) samples per request
        self.held: dict[str, int] = {}  # request -> block-manager id of blocks kept (prefilled / reserved)
        self._leases: dict[int, tuple[int, int]] = {}  # reserved id -> (tokens imported, tokens it may decode)
        self.prompt_tokens_computed, self._seq_ids = 0, itertools.count(1)
        # Outputs held for the caller until a step returns them (abort notices, tokens taken from a step in
        # flight): a step that fails loses none
        self._pending: list[RequestOutput] = []
        self._in_flight: _StepInFlight | None = None  # async scheduling: the step whose tokens are on device
        self._step_times: deque[float] = deque(maxlen=64)
        self.last_step: StepComposition | None = None  # what the latest step() computed; None: nothing

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, output_ids: tuple[int, ...] | list[int] = (),
                    priority: Priority | None = None, lora: str | None = None) -> None:
        """Queue a request; raises InvalidRequestError (before taking any block) when it can't run.
        ``output_ids``: tokens it already produced elsewhere (resumed: they are recomputed, not output).
        ``priority``: its place among waiting requests, lower first (``scheduler.Priority``); None: last.
        ``lora``: the name of the LoRA adapter it runs with (``EngineConfig.lora_modules``); None: the base model."""
        self._check(request_id, prompt_ids, params, prefill_only, lora=lora)
        seq = self._new_seq(request_id, list(prompt_ids), params, 0, output_ids=output_ids, lora=lora)
        seq.fanout, seq.prefill_only, seq.priority = params.n, prefill_only, priority
        # an estimate for load reports until admission sets the real figure (stops at the first miss)
        seq.num_cached_tokens = self.block_size * len(self.block_manager.cached_prefix(
            seq.token_ids, self.scheduler.cacheable_blocks(seq), seq.hash_salt)[0])
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)

    def add_embedding_request(self, request_id: str, prompt_ids: list[int], dimensions: int | None = None,
                              priority: Priority | None = None) -> None:
        """Queue an embedding request (``engine/pooling.py``): its prompt is computed as a generation's is (a
        cached prefix reused, chunked, batched with the others) and its one output carries the vector, cut to
        ``dimensions`` values (None: the hidden size); its blocks are freed then, the full ones left cached.
        InvalidRequestError (before taking any block) when it can't run."""
        hidden_size = self.model_config.hidden_size
        self.pooling.check(dimensions, hidden_size)
        params = SamplingParams(max_tokens=1)  # (a prompt's limits: it needs the room of one token more)
        self._check(request_id, prompt_ids, params, prefill_only=True)
        seq = self._new_seq(request_id, list(prompt_ids), params, 0)
        seq.embedding_dims, seq.priority = dimensions or hidden_size, priority
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Drop the request wherever it is; the next step() reports each live sample as aborted."""
        seqs = self.requests.pop(request_id, [])
        self.scheduler.remove(seqs)
        for s in seqs:
            self.block_manager.free(s.seq_id)
            self._forget(s.seq_id)
            self._pending.append(RequestOutput(request_id, s.index, [], True, FinishReason.ABORT,
                                               s.num_prompt_tokens, s.num_cached_tokens))
        self.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._in_flight is not None

    def step(self, on_layer_done: LayerHook | None = None) -> list[RequestOutput]:
        """Run one batch (decode rows, then prefill chunks) and sample where a sequence is complete;
        ``on_layer_done(layer, completing)`` runs after each layer (see ``LayerHook``). With async scheduling
        (``EngineConfig.async_scheduling``) a step whose every sequence samples on the device returns the
        outputs of the step before (``_step_ahead``)."""
        if self._async and on_layer_done is None and self._all_sample_on_device():
            return self._step_ahead()
        before, self._in_flight = self._in_flight, None  # (a sequence that needs its tokens on the host came)
        self._pending += self._resolve(before)
        self.last_step = None
        self._recompute_with_long_rope()
        start = time.perf_counter()  # (a draft model's passes are part of the step)
        draws: dict[int, Draws] = {}  # seq_id -> the draws a sampling proposer drafted with
        if self.proposer is not None:
            draws = self._propose_drafts(self.proposer.config.drafts_at(len(self.scheduler.running)))
        batch = self._schedule()
        if not batch.seqs:
            return self._take_outputs()
        chunks, completing, step = self._chunks(batch)
        layer_done = None if on_layer_done is None else lambda layer: on_layer_done(layer, completing)
        # Structured outputs: the tokens each completing sequence may sample, found while the forward pass runs
        bitmask = self.grammars.fill([seq.grammar if seq.num_computed_tokens + n == seq.num_tokens else None
                                      for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)])
        # ... and a drafting one's, at each position of its draft
        draft_masks = {seq.seq_id: self.grammars.draft_masks(seq.grammar, seq.draft_ids) for seq in batch.seqs
                       if seq.draft_ids and seq.grammar is not None}
        hidden = None  # the final-norm hidden rows, when an embedding request is in the step
        if any(seq.embedding_dims is not None for seq in batch.seqs):
            hidden = self.runner.final_hidden(chunks, layer_done)
            logits = self.runner.model.logits(hidden)
        else:
            logits = self.runner.run(chunks, layer_done)
        rows: list[int] = []  # the logits row each sampled sequence draws from
        mask_rows: list[int] = []  # ... and its bitmask row (its batch position)
        sampled: list[Sequence] = []
        drafted: list[tuple[Sequence, int]] = []  # sequences whose draft is verified, and their first row
        embedded: list[tuple[Sequence, int]] = []  # embedding requests whose prompt is done, and their row
        outputs: list[RequestOutput] = []
        last = -1  # the logits row of the chunk's last token (a chunk with all_logits has a row per token)
        for i, (seq, n, chunk) in enumerate(zip(batch.seqs, batch.num_new_tokens, chunks, strict=True)):
            pos, first = seq.num_computed_tokens, last + 1
            last += n if chunk.all_logits else 1
            if seq.draft_ids:
                drafted.append((seq, first))
                continue
            if chunk.all_logits:
                self._collect_prompt_logprobs(seq, pos, logits[first:last + 1])
            self._count_prompt_tokens(seq, n)
            self._computed(seq, pos + n)
            if pos + n == seq.num_tokens and seq.embedding_dims is not None:
                embedded.append((seq, last))
            elif pos + n == seq.num_tokens:  # the last token's logits are the next token's distribution
                for s in self._fork(seq) if seq.fanout > 1 else (seq,):  # forks start where their prompt's grammar is
                    rows.append(last)
                    mask_rows.append(i)
                    sampled.append(s)
        if sampled:  # (rows may repeat one, a prompt forking into its n samples, and skip a partial prompt's)
            outputs += self._sample(self._rows(logits, rows), sampled,
                                    None if bitmask is None else bitmask[mask_rows])
        if embedded:
            outputs += self._embed(hidden, embedded)
        verified = self._verify(logits, drafted, draft_masks, draws) if drafted else []
        outputs += verified
        step.decoded_tokens = step.decode_seqs + len(verified)  # a verified output is one token kept
        self._step_times.append(time.perf_counter() - start)
        self.last_step = step
        return self._take_outputs(outputs)

    def _take_outputs(self, outputs: list[RequestOutput] | None = None) -> list[RequestOutput]:
        """What a step returns: the outputs held for the caller, then its own ``outputs``."""
        taken, self._pending = self._pending + (outputs or []), []
        return taken

    def _schedule(self) -> ScheduledBatch:
        """The step's batch; what a preempted sequence holds for sampling and drafting goes with its blocks."""
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self._forget(seq.seq_id)
        return batch

    def _forget(self, seq_id: int) -> None:
        """Drop a finished, aborted or preempted sequence's token counts and draft state (a preempted one builds
        them again when it runs again)."""
        self.token_counts.forget(seq_id)
        if self.proposer is not None:
            self.proposer.forget(seq_id)

    def _chunks(self, batch: ScheduledBatch) -> tuple[list[SeqChunk], dict[str, list[int]], StepComposition]:
        """The step's chunks; the block tables of the prefill-only requests whose prompt it completes; what it
        computes. Copies the blocks copy-on-write asks for first."""
        bm = self.block_manager
        for src, dst in bm.take_copies():
            self.kv_cache.copy_block(src, dst)
        chunks = []
        completing: dict[str, list[int]] = {}
        step = StepComposition([], 0, 0)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            pos = seq.num_computed_tokens
            table = bm.block_table(seq.seq_id)
            # A sequence collecting prompt logprobs needs every row whose next token is in the prompt; a
            # draft needs every row (each position is sampled).
            tokens = [seq.token_ids[pos], *seq.draft_ids] if seq.draft_ids else seq.token_ids[pos:pos + n]
            chunks.append(SeqChunk(tokens, pos, table, bool(seq.draft_ids) or (
                seq.prompt_logprobs is not None and pos + 1 < seq.num_prompt_tokens),
                long_rope=seq.long_rope, lora=self.lora_slots.slot_of(seq.lora) if seq.lora else 0,
                drafted=bool(seq.draft_ids)))
            if seq.prefill_only and pos + n == seq.num_tokens:
                completing[seq.request_id] = table
            if pos >= seq.num_prompt_tokens and n == 1:  # a decode row
                step.decode_seqs += 1
                step.decode_context_tokens += pos + 1
            else:
                step.prefill_chunks.append((seq.request_id, n, pos))
                if seq.draft_ids:
                    step.drafted_seqs += 1
                    step.drafted_context_tokens += pos + 1
        return chunks, completing, step

    @staticmethod
    def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``logits``' rows ``rows`` (the tensor itself when they are all of its rows, in order)."""
        if rows == list(range(logits.shape[0])):
            return logits
        return logits.index_select(0, device_values(rows, torch.long, logits.device))

    def _count_prompt_tokens(self, seq: Sequence, n: int) -> None:
        """Count the prompt tokens among the ``n`` that ``seq`` computes in this step."""
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            self.prompt_tokens_computed += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)

    # -- async scheduling --------------------------------------------------------------------------
    def _all_sample_on_device(self) -> bool:
        """Whether every live sequence may have its tokens sampled and fed to the next step on the device."""
        s = self.scheduler
        return (all(seq.samples_on_device for seq in s.running)
                and all(seq.samples_on_device for seq in s.waiting)
                and all(seq.samples_on_device for seq in s.held))

    def _step_ahead(self) -> list[RequestOutput]:
        """A step launched while the last one's tokens are still on the device (vLLM's async scheduling,
        SGLang's overlap scheduler): its forward pass is launched with those tokens fed to it on the device;
        then, while the device computes it, they are taken to the host, appended, detokenized and checked for a
        stop (a grammar takes them too), and the step samples from what the host knows now, as a synchronous
        step would; its own tokens stay on the device until the next step. A sequence that ended at a token of
        the last step has computed one more position here, which is not sampled. Returns the last step's
        outputs. If this step fails before its forward pass is launched, the last one stays in flight for the
        next step to take."""
        self.last_step = None
        start = time.perf_counter()
        before, self._in_flight = self._in_flight, None
        try:
            launched = self._launch_ahead(before)
        except BaseException:  # (else a preempted sequence would keep its place for a token never taken)
            self._in_flight = before
            raise
        self._pending += self._resolve(before)
        if launched is not None:
            batch, logits, computed, step = launched
            rows = [i for i, (seq, num_computed) in enumerate(zip(batch.seqs, computed, strict=True))
                    if num_computed == seq.num_tokens and seq.status is SeqStatus.RUNNING]
            if rows:
                sampled = [batch.seqs[i] for i in rows]
                logits = self._rows(logits, rows)
                tokens = self._draw(logits, sampled, self.grammars.fill([s.grammar for s in sampled]))
                self._in_flight = _StepInFlight.launch(
                    sampled, tokens, LogprobFigures.of(logits, tokens, [s.params.logprobs for s in sampled]))
            for seq, num_computed in zip(batch.seqs, computed, strict=True):
                if seq.status is SeqStatus.RUNNING:  # not ended by its token of the last step
                    self._computed(seq, num_computed)  # (which registers blocks holding that token, known now)
            step.decoded_tokens = step.decode_seqs
            self._step_times.append(time.perf_counter() - start)
            self.last_step = step
        return self._take_outputs()

    def _launch_ahead(self, before: _StepInFlight | None
                      ) -> tuple[ScheduledBatch, torch.Tensor, list[int], StepComposition] | None:
        """Schedule a step and launch its forward pass, fed ``before``'s tokens on the device; returns (its
        batch, its logits, each sequence's computed tokens once it is done, what it computes), None when nothing
        is scheduled."""
        batch = self._schedule()
        if not batch.seqs:
            return None
        chunks, _, step = self._chunks(batch)
        feed = None
        fed = [i for i, chunk in enumerate(chunks) if chunk.token_ids[-1] == TOKEN_ON_DEVICE]
        if fed:  # (a token on the device is a sequence's last: its chunk is a decode chunk)
            row_of = {id(seq): row for row, seq in enumerate(before.seqs)}
            feed = TokenFeed(fed, [row_of[id(batch.seqs[i])] for i in fed], before.tokens)
        logits = self.runner.run(chunks, None, feed)
        computed = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            self._count_prompt_tokens(seq, n)
            computed.append(seq.num_computed_tokens + n)
        return batch, logits, computed, step

    def _resolve(self, flight: _StepInFlight | None) -> list[RequestOutput]:
        """Take an async-scheduled step's tokens to the host: append, detokenize, check each for a stop."""
        if flight is None:
            return []
        flight.wait()
        outputs, finished = [], []
        tokens = flight.host.tolist()
        logprobs = [None] * len(tokens) if flight.logprobs is None else flight.logprobs.token_logprobs(tokens)
        for seq, tok, lp in zip(flight.seqs, tokens, logprobs, strict=True):
            if seq.status is SeqStatus.FINISHED:  # aborted, or ended at its token of the step before
                continue
            seq.token_ids[-1] = tok
            out = self._emit(seq, tok, lp)
            if out.finished:
                finished.append(seq)
            outputs.append(out)
        self._retire(finished)
        return outputs

    @staticmethod
    def _collect_prompt_logprobs(seq: Sequence, pos: int, logits: torch.Tensor) -> None:
        """The logprobs of the prompt tokens after positions ``pos``.. (``logits``' rows), of which the prompt
        holds the next token; a prompt computed again (preempted before its first token) overwrites them."""
        m = min(logits.shape[0], seq.num_prompt_tokens - 1 - pos)
        del seq.prompt_logprobs[pos:]
        seq.prompt_logprobs += top_logprobs(logits[:m], seq.token_ids[pos + 1:pos + 1 + m],
                                            [seq.params.prompt_logprobs] * m)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], bitmask: torch.Tensor | None) -> list[RequestOutput]:
        """Sample, append and check each of ``seqs``' next token (``_draw``)."""
        token_ids = self._draw(logits, seqs, bitmask).tolist()
        logprobs = top_logprobs(logits, token_ids, [s.params.logprobs for s in seqs])
        outputs = [self._append(seq, tok, lp) for seq, tok, lp in zip(seqs, token_ids, logprobs, strict=True)]
        self._retire([seq for seq, out in zip(seqs, outputs, strict=True) if out.finished])
        return outputs

    def _embed(self, hidden: torch.Tensor, embedded: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """End each embedding request whose prompt is done with its vector, pooled from its row of ``hidden``."""
        rows = hidden.index_select(0, device_values([row for _, row in embedded], torch.long, hidden.device)).cpu()
        outputs = []
        for (seq, _), row in zip(embedded, rows, strict=True):
            seq.finish_reason = FinishReason.STOP
            vector = row.float()[:seq.embedding_dims]  # (Matryoshka: cut, then normalized)
            if self.pooling.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            outputs.append(RequestOutput(seq.request_id, 0, [], True, FinishReason.STOP, seq.num_prompt_tokens,
                                         seq.num_cached_tokens, embedding=vector.tolist()))
        self._retire([seq for seq, _ in embedded])
        return outputs

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], bitmask: torch.Tensor | None) -> torch.Tensor:
        """Each of ``seqs``' next token (a row of ``logits`` each), left on the device; ``bitmask``: the tokens
        each row may take (structured outputs), None when no row is constrained."""
        # Structured outputs mask a copy: logprobs stay the model's raw distribution, as vLLM reports them.
        # A complete grammar allows only stop tokens, which min_tokens then no longer holds back.
        allowed = logits if bitmask is None else self.grammars.apply(logits, bitmask)
        banned = [self._banned(s, [], s.grammar is not None and s.grammar.complete) for s in seqs]
        return sample_tokens(allowed, [s.params for s in seqs], [s.generator for s in seqs],
                             self.token_counts.penalties(seqs), banned)

    def _computed(self, seq: Sequence, num_computed: int) -> None:
        """``seq``'s K/V now holds its first ``num_computed`` tokens: full blocks go to the prefix cache."""
        seq.num_computed_tokens = num_computed
        self.block_manager.commit(seq.seq_id, seq.token_ids, num_computed)
        if self.window is not None:  # free the blocks the window has passed (registered ones stay cached)
            self.block_manager.drop(seq.seq_id, self.window.droppable(num_computed))

    def _retire(self, finished: list[Sequence]) -> None:
        """Take finished samples out; a prefilled one keeps its blocks for the hand-off."""
        if not finished:
            return
        self.scheduler.remove(finished)
        for seq in finished:
            live = self.requests[seq.request_id]
            live.remove(seq)
            if not live:
                del self.requests[seq.request_id]
            self._forget(seq.seq_id)
            if seq.finish_reason is FinishReason.PREFILLED:
                self.held[seq.request_id] = seq.seq_id
            else:
                self.block_manager.free(seq.seq_id)

    # -- speculative decoding (engine/speculative.py) ----------------------------------------------
    def _propose_drafts(self, drafting: bool) -> dict[int, Draws]:
        """Give every decoding sequence this step's draft (none unless ``drafting``): what a structured
        output's grammar forces, if anything; else its predicted output's next tokens, if any; else the
        proposer's; under a structured output cut where the grammar would refuse a token. A proposer that
        samples is given each sampled sequence's draws for its positions, taken ahead (``draw_ahead``):
        returned by seq_id, for the verification to sample with."""
        asked: list[tuple[Sequence, int]] = []  # the sequences the proposer drafts for, and their room
        for seq in self.scheduler.running:
            room = self._draft_room(seq) if drafting else 0
            seq.draft_ids = seq.grammar.forced_tokens()[:room] if room > 0 and seq.grammar is not None else []
            seq.draft_predicted = False
            if room > 0 and not seq.draft_ids and seq.prediction is not None:
                k = self.proposer.config.num_speculative_tokens
                seq.draft_ids = seq.prediction.draft(seq.token_ids, min(room, k))
                seq.draft_predicted = bool(seq.draft_ids)
            if room > 0 and not seq.draft_ids:
                asked.append((seq, room))
        draws = {seq.seq_id: draw_ahead(seq.generator, room + 1, self.model_config.vocab_size, self.device)
                 for seq, room in asked if self.proposer.samples_drafts and not seq.params.greedy}
        drafts = self.proposer.propose_all([
            DraftRequest(seq.seq_id, seq.token_ids, room, seq.params, seq.num_prompt_tokens, draws.get(seq.seq_id),
                         self._draft_rules(seq) if self.proposer.samples_drafts else None)
            for seq, room in asked]) if asked else []
        for (seq, _), draft in zip(asked, drafts, strict=True):
            seq.draft_ids = draft
        for seq in self.scheduler.running:
            if seq.draft_ids and seq.grammar is not None:
                seq.draft_ids = seq.draft_ids[:seq.grammar.draft_prefix(seq.draft_ids)]
        return draws

    def _draft_rules(self, seq: Sequence) -> DraftRules | None:
        """What ``seq``'s verification refuses besides its sampling parameters (``DraftRules``); None when
        nothing (no min_tokens still to reach, no bad words, no started grammar)."""
        grammar = seq.grammar if seq.grammar is not None and seq.grammar.started else None
        if (grammar is None and not seq.params.bad_words_token_ids
                and seq.num_output_tokens >= seq.params.min_tokens):
            return None
        return DraftRules(lambda drafted, complete: self._banned(seq, drafted, complete), grammar)

    def _draft_room(self, seq: Sequence) -> int:
        """The most draft tokens ``seq`` may verify now: none unless it is decoding (past its prompt, only its
        last token's K/V missing); one token of its max_tokens is always the sampled one; and in a windowed
        quantized cache never a block's last slot, since such a block is quantized once, when that slot is
        written, and a rejected token's K/V would stay in it."""
        if seq.num_output_tokens == 0 or seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        room = seq.params.max_tokens - seq.num_output_tokens - 1
        if self.kv_cache.kv_format in WINDOWED:
            room = min(room, self.block_size - 1 - seq.num_tokens % self.block_size)
        long_from = self.model_config.long_rope_from
        if long_from is not None and not seq.long_rope:  # a draft never crosses into the long factors
            room = min(room, long_from - seq.num_tokens)
        return room

    def _verify(self, logits: torch.Tensor, drafted: list[tuple[Sequence, int]],
                masks: dict[int, tuple[torch.Tensor | None, list[bool]]], draws: dict[int, Draws]
                ) -> list[RequestOutput]:
        """Sample every position of each drafted chunk (``logits`` rows from its first row on) as if its draft
        were the output so far, and keep the draft up to the first token sampled otherwise, plus that
        token; each kept token passes the stop checks plain decoding applies. ``masks``: a structured
        output's bitmask and completeness at each position (``GrammarMasks.draft_masks``), by seq_id; ``draws``:
        the draws a sampled sequence drafted with, by seq_id (the others' are taken ahead here)."""
        rows, params, histories, banned = [], [], [], []
        drafted_rows, drafted_tokens = [], []  # the draft tokens before each penalized row's position
        bitmasks: list[torch.Tensor] = []  # each row's allowed tokens, when some row is constrained
        row_draws: list[torch.Tensor | None] = []  # each row's random draw (None: a greedy row)
        for seq, first in drafted:
            draft, p = seq.draft_ids, seq.params
            bitmask, complete = masks.get(seq.seq_id, (None, [False] * (len(draft) + 1)))
            if masks:
                bitmasks.append(self.grammars.allowed_rows(bitmask, len(draft) + 1))
            if p.greedy:
                row_draws += [None] * (len(draft) + 1)
            else:  # the sequence's next draws, of which it takes those of the tokens it keeps
                if seq.seq_id not in draws:
                    draws[seq.seq_id] = draw_ahead(seq.generator, len(draft) + 1, self.model_config.vocab_size,
                                                   self.device)
                row_draws += list(draws[seq.seq_id].values[:len(draft) + 1])
            for j in range(len(draft) + 1):
                if p.has_penalties:
                    drafted_rows += [len(rows)] * j
                    drafted_tokens += draft[:j]
                rows.append(first + j)
                params.append(p)
                histories.append(seq)
                banned.append(self._banned(seq, draft[:j], complete[j]))
        chosen = logits[rows]
        allowed = self.grammars.apply(chosen, torch.cat(bitmasks)) if masks else chosen
        # (no row draws from a generator: a sampled row's draw was taken ahead, a greedy row needs none)
        extra = (drafted_rows, device_values(drafted_tokens, torch.long, self.device)) if drafted_rows else None
        penalties = self.token_counts.penalties(histories, extra=extra)
        token_ids = sample(allowed, params, [None] * len(rows), penalties, banned, row_draws)
        logprobs = top_logprobs(chosen, token_ids, [p.logprobs for p in params])
        outputs: list[RequestOutput] = []
        finished: list[Sequence] = []
        row = 0
        for seq, _ in drafted:
            draft, seq.draft_ids = seq.draft_ids, []
            kept = 0
            for j in range(len(draft) + 1):
                outputs.append(self._append(seq, token_ids[row + j], logprobs[row + j]))
                kept += 1
                if outputs[-1].finished or j == len(draft) or token_ids[row + j] != draft[j]:
                    break
            new = token_ids[row:row + kept]
            row += len(draft) + 1
            accepted = sum(1 for t, d in zip(new, draft, strict=False) if t == d)
            self.speculation.record(len(draft), accepted)
            if seq.draft_predicted:  # counted once, on the step's first output of the sequence
                outputs[-kept].accepted_prediction_tokens = accepted
                outputs[-kept].rejected_prediction_tokens = len(draft) - accepted
            if seq.seq_id in draws:
                draws[seq.seq_id].take(seq.generator, kept)
            self._computed(seq, seq.num_tokens - 1)  # the last token and the kept draft tokens
            if outputs[-1].finished:
                finished.append(seq)
        self._retire(finished)
        return outputs

    def _banned(self, seq: Sequence, drafted: list[int], complete: bool) -> list[int]:
        """The tokens ``seq`` may not sample after its output and ``drafted``: its stop tokens while min_tokens
        holds them back (not once its grammar is ``complete`` there: a complete grammar allows only stop
        tokens), and those that would complete one of its bad words."""
        holds = seq.num_output_tokens + len(drafted) < seq.params.min_tokens and not complete
        stops = self._stop_tokens(seq) if holds else []
        if not seq.params.bad_words_token_ids:
            return stops
        return stops + bad_word_bans(seq.params.bad_words_token_ids,
                                     [*seq.token_ids[seq.num_prompt_tokens:], *drafted])

    def _stop_tokens(self, seq: Sequence) -> list[int]:
        """The tokens that would end ``seq`` (kept out of its first min_tokens)."""
        eos = () if seq.params.ignore_eos else self.eos_token_ids
        return sorted({*seq.params.stop_token_ids, *eos})

    def _append(self, seq: Sequence, tok: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        """Add a sampled token and decide whether the sample is done (stop token, stop string, length)."""
        seq.token_ids.append(tok)
        return self._emit(seq, tok, logprobs)

    def _emit(self, seq: Sequence, tok: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        """The output of ``seq``'s last token ``tok``: done or not, its text."""
        if seq.grammar is not None:
            seq.grammar.advance(tok)
        reason, seq.stop_reason = check_finish(tok, seq.num_output_tokens, seq.params, self.eos_token_ids,
                                               seq.text, seq.prefill_only)
        seq.finish_reason = reason
        text = "" if seq.text is None else seq.text.emit(final=reason not in (None, FinishReason.PREFILLED))
        prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None  # handed out once, with the first token
        return RequestOutput(seq.request_id, seq.index, [tok], reason is not None, reason, seq.num_prompt_tokens,
                             seq.num_cached_tokens, None if logprobs is None else [logprobs], text,
                             seq.stop_reason, prompt_logprobs)

    # -- disaggregation: prefill side --------------------------------------------------------------
    def request_block_ids(self, request_id: str) -> list[int]:
        """Blocks held by a prefilled (or reserved) request, in position order: with an attention window,
        only those the window kept (``handoff_blocks``)."""
        return [b for b in self.block_manager.block_table(self.held[request_id]) if b != NO_BLOCK]

    def handoff_blocks(self, num_tokens: int) -> list[int]:
        """Table indices of the blocks a hand-off of ``num_tokens`` prompt tokens carries: all of them, or with
        an attention window the sink blocks and those the next query's window reads (the prefill side dropped
        the rest as its chunks passed them; the decode side never reads them)."""
        if self.window is None:
            return list(range(self.block_manager.blocks_for(num_tokens)))
        return self.window.kept_blocks(num_tokens)

    def release(self, request_id: str) -> None:
        """Free blocks a prefilled request or an unused reservation still holds (no-op otherwise)."""
        seq_id = self.held.pop(request_id, None)
        if seq_id is not None:
            self._leases.pop(seq_id, None)
            self.block_manager.free(seq_id)

    # -- disaggregation: decode side ---------------------------------------------------------------
    def rename_reservation(self, request_id: str, new_id: str) -> None:
        """Keep ``request_id``'s reserved blocks under ``new_id`` (freed later by ``release(new_id)``), so the
        request id can be reserved again at once: a retry while a cancelled transfer still drains."""
        if request_id in self.held:
            self.held[new_id] = self.held.pop(request_id)

    def reserve_blocks(self, request_id: str, num_tokens: int, max_new_tokens: int = 0) -> list[int]:
        """Blocks for ``num_tokens`` prompt positions whose K/V will be imported (with an attention window,
        those ``handoff_blocks`` carries; the table holds no block for the rest), for a request that will
        decode up to ``max_new_tokens`` more; OutOfBlocksError. The blocks the running sequences, and the
        leases still waiting for their K/V, grow into over their next ``num_reserved_decode_tokens`` stay
        free: taking them would preempt a sequence (a decode worker recomputes a preempted one's prompt)."""
        if request_id in self.requests or request_id in self.held:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        seq_id = next(self._seq_ids)
        block_ids = self.block_manager.reserve(
            seq_id, num_tokens, keep_free=self._growth_blocks(self.config.num_reserved_decode_tokens),
            dropped=range(0) if self.window is None else self.window.droppable(num_tokens))
        self.held[request_id] = seq_id
        self._leases[seq_id] = (num_tokens, max_new_tokens)
        return block_ids

    def _growth_blocks(self, tokens: int) -> int:
        """Blocks the running sequences (those held for an adapter slot too) and the leases take to grow
        ``tokens`` more tokens each (never past the tokens each may still decode)."""
        bm = self.block_manager
        running = [(s.num_tokens, s.params.max_tokens - s.num_output_tokens, len(bm.block_table(s.seq_id)))
                   for s in (*self.scheduler.running, *self.scheduler.held)]
        leases = [(n, new, bm.blocks_for(n)) for n, new in self._leases.values()]
        return sum(max(0, bm.blocks_for(n + min(tokens, new)) - have) for n, new, have in running + leases)

    def add_imported_request(self, request_id: str, prompt_ids: list[int], first_token_id: int,
                             params: SamplingParams, block_ids: list[int], output_ids: tuple[int, ...] | list[int] = (),
                             lora: str | None = None) -> None:
        """Continue decoding a request whose K/V (prompt, then ``output_ids`` when resumed) was imported
        into its reserved ``block_ids`` and whose next token the prefill side sampled (with adapter ``lora``)."""
        seq_id = self.held.get(request_id)
        if seq_id is None or self.request_block_ids(request_id)[:len(block_ids)] != list(block_ids):
            raise InvalidRequestError("block_ids", f"no reservation of these blocks for {request_id!r}")
        self._check(request_id, prompt_ids, params, False, reserved=True, lora=lora)
        done = check_finish(first_token_id, len(output_ids) + 1, params, self.eos_token_ids, None, False)[0]
        if done is not None:
            raise InvalidRequestError("first_token_id", "the request already finished at its first token")
        seq = self._new_seq(request_id, list(prompt_ids), params, 0, seq_id, [*output_ids, first_token_id], lora)
        del self.held[request_id]
        self._leases.pop(seq_id, None)  # a running sequence from now on
        seq.num_computed_tokens = seq.num_tokens - 1
        # as the prefill side computed its K/V
        self._salt(seq, long_rope_applies(self.model_config.long_rope_from, seq.num_computed_tokens))
        self.requests[request_id] = [seq]
        self.block_manager.salt_hashes(seq_id, seq.hash_salt)
        self.block_manager.commit(seq_id, seq.token_ids, seq.num_computed_tokens)
        self.scheduler.add_running(seq)

    # -- KV pool ---------------------------------------------------------------------------------
    def reusable_prefix_blocks(self, num_tokens: int) -> int:
        """The most leading blocks a prompt of ``num_tokens`` takes from a cache (this engine's, the pool's or
        a peer's): never the one holding its last token, nor those a full-precision residual keeps."""
        return self.block_manager.max_prefix_blocks(num_tokens)

    def prefix_salt(self, lora: str | None, num_tokens: int = 0, cache_salt: str | None = None) -> bytes:
        """What the blocks of a sequence of adapter ``lora`` (None: the base model) whose first ``num_tokens``
        tokens' K/V is computed are hashed under, here and by the router, the pool and the peers
        (``kvstore.hashing.salt_for``: a LongRoPE model's sequence past the original context has its own, and
        a request's ``cache_salt`` its own)."""
        return salt_for(self.model_id, None if lora is None else self._adapter(lora).adapter_id,
                        long_rope_applies(self.model_config.long_rope_from, num_tokens), self.quantized_at_load,
                        cache_salt)

    # -- LoRA adapters (engine/lora.py) -------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> PackedAdapter:
        """Load one more LoRA adapter (into a slot if one is free, else when a sequence of it is scheduled);
        the same adapter again is a no-op (a worker started while a runtime load ran has it from its config).
        LoRAAdapterError when it cannot be served, when another adapter has the name, or when
        ``max_cpu_loras`` adapters are loaded already."""
        if name in self.loras:
            if adapter_id(name, path) != self.loras[name].adapter_id:
                raise LoRAAdapterError(f"LoRA adapter {name!r}: another adapter of that name is loaded; unload it "
                                       "first")
            return self.loras[name]
        if self.lora_slots is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: this engine has no LoRA slots (start the server with "
                                   "--max-loras N to load adapters while serving)")
        if len(self.loras) >= self.max_cpu_loras:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {len(self.loras)} adapters are loaded, as many as "
                                   f"--max-cpu-loras {self.max_cpu_loras} allows; unload one first, or start the "
                                   "server with a larger --max-cpu-loras")
        return self._register(read_adapter(name, path, self.model_id, self.model, self.model_config))

    def _register(self, packed: PackedAdapter) -> PackedAdapter:
        self.lora_slots.check(packed)
        dtype, pinned = self.model.lm_head.weight.dtype, torch.device(self.config.device).type == "cuda"
        # pinned on a GPU machine: a swap into a slot is then a DMA the step's stream orders, not a host stall
        packed.pairs = {module: tuple(t.to(dtype).pin_memory() if pinned else t.to(dtype) for t in pair)
                        for module, pair in packed.pairs.items()}
        self.loras[packed.name] = packed
        self.lora_slots.acquire(packed, busy=self.loras)  # into a free slot, if any: no adapter is evicted
        return packed

    def _adapter_ready(self, name: str, busy: set[str]) -> bool:
        """The scheduler's gate for a sequence of adapter ``name``: whether the adapter is in a slot now,
        copied there if a slot is free or holds an adapter none of the ``busy`` ones (the running sequences')."""
        return self.lora_slots.acquire(self.loras[name], busy) is not None

    def _lora_slots(self, config: EngineConfig, start_rank: int) -> LoRASlots | None:
        """The slots of ``config.max_loras`` adapters at once (default: one per ``lora_modules`` entry) up to
        ``max_lora_rank`` (default: 16, or ``start_rank``, the largest of ``lora_modules``' adapters)."""
        max_loras = len(config.lora_modules) if config.max_loras is None else config.max_loras
        if not max_loras:
            return None
        rank = max(DEFAULT_MAX_LORA_RANK, start_rank) if config.max_lora_rank is None else config.max_lora_rank
        return LoRASlots(self.model, self.model_config, max_loras, rank, self.model.lm_head.weight.dtype,
                         config.device)

    def adapter_requests(self, name: str) -> list[str]:
        """The live requests (waiting or running) of adapter ``name``."""
        return [rid for rid, seqs in self.requests.items() if seqs and seqs[0].lora == name]

    def unload_adapter(self, name: str) -> list[str]:
        """Unload adapter ``name`` (out of its slot, if it has one, and out of host memory), aborting the
        requests still running with it (``adapter_requests``: wait for them first to let them finish); returns
        those. Its blocks stay in the prefix cache, under a salt no later request has, until evicted."""
        self._adapter(name)
        running = self.adapter_requests(name)
        for request_id in running:
            self.abort(request_id)
        del self.loras[name]
        self.lora_slots.evict(name)
        return running

    def _adapter(self, lora: str) -> PackedAdapter:
        if lora not in self.loras:
            raise InvalidRequestError("lora", f"no LoRA adapter {lora!r} is loaded (loaded: "
                                              f"{', '.join(self.loras) or 'none'})")
        return self.loras[lora]

    def cached_prefix_len(self, prompt_ids: list[int], salt: bytes | None = None) -> int:
        """Leading prompt tokens whose K/V is in this engine's prefix cache (whole blocks) under ``salt``
        (``prefix_salt``; None: the base model's). Callable from any thread as a hint (each lookup is atomic,
        but an eviction may race it): placing blocks checks again."""
        return len(self.block_manager.cached_prefix(prompt_ids, salt=salt)[0]) * self.block_size

    def export_cached_prefix(self, token_ids: list[int], skip_blocks: int = 0, max_blocks: int | None = None,
                             salt: bytes | None = None) -> tuple[torch.Tensor | None, list[int]]:
        """K/V (as ``export_blocks``) and chain hashes of the cached full blocks of ``token_ids`` (under
        ``salt``) after the first ``skip_blocks``, up to ``max_blocks`` in all; (None, []) when there are
        none. A copy made here, so the blocks may be evicted once this returns."""
        block_ids, hashes = self.block_manager.cached_prefix(token_ids, max_blocks, salt)
        if len(block_ids) <= skip_blocks:
            return None, []
        ids = block_ids[skip_blocks:]
        # Only the blocks' own columns: a windowed format's trailing window belongs to a live sequence.
        return self.kv_cache.export_blocks(ids)[:, :, :len(ids)].contiguous(), hashes[skip_blocks:]

    def insert_cached_blocks(self, token_ids: list[int], tensor: torch.Tensor, first_block: int = 0,
                             salt: bytes | None = None) -> int:
        """Put K/V of full blocks ``first_block .. first_block + tensor.shape[2]`` of ``token_ids`` (fetched
        from the pool or a peer, hashed under ``salt``) into the prefix cache, after the ``first_block`` cached
        ones; returns how many blocks were newly placed (0 when those leading blocks are no longer cached)."""
        if first_block and self.cached_prefix_len(token_ids, salt) // self.block_size < first_block:
            return 0  # evicted meanwhile: the fetched blocks no longer continue a cached chain
        placed = self.block_manager.insert(token_ids, first_block + tensor.shape[2], salt)
        if placed:
            index = torch.tensor([i - first_block for i, _ in placed], device=tensor.device)
            self.kv_cache.import_blocks([b for _, b in placed], tensor.index_select(2, index))
        return len(placed)

    def take_block_events(self) -> list[BlockEvent]:
        """Prefix-cache blocks stored and evicted since the last call, oldest first (for the KV pool)."""
        return self.block_manager.take_events()

    def stats(self) -> EngineStats:
        """Load figures for the router (cheap: called after every step)."""
        return engine_stats(self.scheduler, self.block_manager, self._step_times, self.prompt_tokens_computed,
                            self.speculation)

    def _check(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prefill_only: bool,
               reserved: bool = False, lora: str | None = None) -> None:
        params.validate()
        if lora is not None:
            self._adapter(lora)
        if not reserved and (request_id in self.requests or request_id in self.held):
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        self.limits.check(prompt_ids, params, prefill_only, reserved)

    def _new_seq(self, request_id: str, token_ids: list[int], params: SamplingParams, index: int,
                 seq_id: int | None = None, output_ids: tuple[int, ...] | list[int] = (),
                 lora: str | None = None) -> Sequence:
        """``output_ids``: tokens sampled elsewhere (the prefill side, a failed worker): their text was
        handed out (and matched no stop), and their random draws are skipped, one row each. Raises
        InvalidRequestError (taking nothing) when they break the request's structured output."""
        spec = params.structured_output
        grammar = None if spec is None else self.grammars.matcher(spec, output_ids)
        text = None if self.tokenizer is None else OutputText(self.tokenizer, token_ids, params)
        seq = Sequence(next(self._seq_ids) if seq_id is None else seq_id, request_id, [*token_ids, *output_ids],
                       len(token_ids), params, index,
                       generator=make_generator(params.seed, index, self.device), text=text,
                       prompt_logprobs=[] if params.prompt_logprobs is not None and not output_ids else None,
                       grammar=grammar, lora=lora)
        if params.prediction_ids and self.proposer is not None:  # (an engine that does not speculate has no use for it)
            seq.prediction = PredictedOutput(params.prediction_ids, self.proposer.config, len(token_ids))
        self._salt(seq, long_rope_applies(self.model_config.long_rope_from, seq.num_tokens))
        for token in output_ids:
            if text is not None:
                text.push(token)
        if seq.generator is not None and not params.greedy:
            skip_draws(seq.generator, len(output_ids), self.model_config.vocab_size)
        if text is not None:
            text.emit(final=False)
        return seq

    def _recompute_with_long_rope(self) -> None:
        """LongRoPE, as transformers generates with it: the step that would first compute a position past the
        original context computes the whole sequence again with the long factors (every key so far was
        rotated with the short ones), from then on under the long prefix-cache salt."""
        long_from = self.model_config.long_rope_from
        if long_from is None:
            return
        for seq in list(self.scheduler.running):
            if not seq.long_rope and seq.num_tokens > long_from:
                self._salt(seq, True)
                self.scheduler.recompute(seq)

    def _salt(self, seq: Sequence, long_rope: bool) -> None:
        """Set whether ``seq``'s keys rotate with LongRoPE's long factors, and so its prefix-cache salt
        (``Sequence.hash_salt``): None (the manager's) for the base model's short unsalted sequences, else
        ``prefix_salt``'s."""
        seq.long_rope = long_rope
        own = long_rope or seq.lora is not None or seq.params.cache_salt is not None
        seq.hash_salt = salt_for(self.model_id, None if seq.lora is None else self.loras[seq.lora].adapter_id,
                                 long_rope, self.quantized_at_load, seq.params.cache_salt) if own else None

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Split a finished prompt into its n samples; they share its blocks (copy-on-write)."""
        samples = [parent]
        for index in range(1, parent.fanout):
            child = self._new_seq(parent.request_id, list(parent.token_ids), parent.params, index, lora=parent.lora)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.prompt_logprobs = parent.prompt_logprobs  # the same prompt's (each sample hands them out)
            self.block_manager.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            self.requests[parent.request_id].append(child)
            samples.append(child)
        parent.fanout = 1  # each decodes on its own from here: async scheduling may take it
        return samples
