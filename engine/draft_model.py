"""Speculative decoding with a draft model (vLLM's ``draft_model`` method): a smaller checkpoint with the
target's vocabulary proposes each decoding sequence's next tokens, and the engine verifies them as it verifies
n-gram drafts (``engine/speculative.py``), so the output is still the target model's, token for token.

The draft samples as its sequence does (penalties, bias, temperature, min-p, top-k, top-p: ``sample``) and,
for a sampled sequence, with the very random draws the engine will verify each position with (``Draws``,
taken ahead). Sampling is ``argmax(p / q)`` over one draw ``q``, so where the draft's distribution is close to
the model's, the two pick the same token even when neither is the most likely: a draft identical to the model
is accepted whole whatever the temperature, where a greedy draft is kept only with probability p(draft). The
verification does not change, so neither does the output: this is the Gumbel-max coupling of "Coupling without
Communication and Drafter-Invariant Speculative Decoding" (Daliri, Musco and Suresh, 2024). A greedy sequence
drafts the argmax. The draft also refuses what the verification refuses (``DraftRules``: the stop tokens
``min_tokens`` holds back, bad words, a structured output's grammar, which each draft token advances and which
is given the tokens back after the proposal): a JSON answer's draft is JSON, so it is not cut at its first
token the schema rules out.

The draft model keeps its own paged KV cache: as many blocks as the target's (a draft's blocks are smaller, it
has fewer layers and heads), handed out by its own block manager without a prefix cache, since the small model
recomputes a prompt cheaply. Per sequence it knows how many leading positions hold K/V computed from the
sequence's real tokens. A proposal first computes the rest up to the sequence's last token (a sequence new to
it, such as one whose prompt a prefill worker computed, in chunks within ``max_num_batched_tokens``; it drafts
once caught up), then k - 1 one-token passes over every drafting sequence write the draft tokens' K/V (on CUDA
replayed from the draft's own decode graphs, as the engine's decode steps are). What verification accepts
stays valid; the K/V of rejected draft tokens is overwritten at the next proposal. Under the engine's
attention window (``--kv-window``/``--kv-sinks``, or the model's sliding window) the draft attends as the
engine does, seeing what the model sees, and drops the blocks the window has passed, so its cache per
sequence is bounded as the engine's is.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.errors import CheckpointError, UnsupportedModelError
from engine.kv_cache import KVCache, block_bytes
from engine.loader import load_model, resolve_model_dir
from engine.model import CausalLM
from engine.runner import ModelRunner, SeqChunk
from engine.sampler import sample
from engine.speculative import DraftRequest, SpeculativeConfig
from engine.streaming_window import StreamingWindow
from engine.structured_output import GrammarMasks
from engine.to_device import device_values
from engine.token_counts import TokenCounts


def check_draft_model(speculative_model: str, target: ModelConfig) -> Path:
    """The draft checkpoint's directory; ValueError when its vocabulary is not the target's (its token ids
    would mean other tokens). Reads only its config (the server checks before any worker starts)."""
    try:
        model_dir = resolve_model_dir(speculative_model)
        draft = ModelConfig.from_dir(model_dir)
    except (CheckpointError, UnsupportedModelError) as exc:  # a plain ValueError: not the model's checkpoint
        raise ValueError(f"the speculative model {speculative_model!r}: {exc}") from None
    draft.check_drafts_for(target, speculative_model)
    return model_dir


def load_draft_model(config: EngineConfig, target: ModelConfig) -> tuple[CausalLM, ModelConfig]:
    """The draft checkpoint ``config.speculative_model`` (``check_draft_model``), in the target's dtype and on
    its device."""
    return load_model(check_draft_model(config.speculative_model, target), config.dtype, config.device)


def draft_block_bytes(model_config: ModelConfig, config: EngineConfig) -> int:
    """Bytes of one block of the draft's KV cache (in the model's dtype), which the target's budget pays for."""
    return block_bytes(model_config, config.block_size, config.dtype, "auto")


@dataclass
class _DraftState:
    computed: int = 0  # leading positions whose K/V the draft computed from the sequence's tokens
    written: list[int] = field(default_factory=list)  # the latest draft's tokens with K/V at ``computed``..

    def catch_up(self, token_ids: list[int]) -> None:
        """Count the latest draft's tokens that the sequence kept (their K/V is the real tokens')."""
        for token, real in zip(self.written, token_ids[self.computed:], strict=False):
            if token != real:
                break
            self.computed += 1
        self.written = []


class DraftModelProposer:
    samples_drafts = True  # each draft token is sampled, with its verification's draw where it is random

    def __init__(self, config: SpeculativeConfig, model: CausalLM, model_config: ModelConfig, num_blocks: int,
                 engine_config: EngineConfig, attention_backend: str, window: StreamingWindow | None,
                 grammars: GrammarMasks):
        """``window``: the engine's attention window (None: full attention); ``grammars``: the engine's, which
        masks a draft's positions as the verification will."""
        self.config = config
        self.grammars = grammars
        self.kv_cache = KVCache(model_config, num_blocks, engine_config.block_size, engine_config.dtype,
                                engine_config.device)
        self.blocks = BlockManager(num_blocks, engine_config.block_size, b"draft", enable_prefix_caching=False)
        # The draft attends as the engine does (--kv-window/--kv-sinks or the model's sliding window), else through
        # its own sliding window, if it has one: its cache per sequence is then bounded as the engine's is.
        context = model_config.max_position_embeddings
        try:  # --kv-window's checks against the draft's context; without any window, the draft's own
            own = StreamingWindow.from_config(engine_config, context, None if window else model_config.sliding_window)
        except ValueError as exc:
            raise ValueError(f"the speculative model: {exc}") from None
        self.window = window or own
        self.runner = ModelRunner(model, model_config, self.kv_cache, self.window, attention_backend)
        # its penalized drafts' counts: the sequence's history, then its draft so far
        self.token_counts = TokenCounts(model_config.vocab_size, self.kv_cache.device,
                                        engine_config.max_num_seqs)
        self.token_budget = engine_config.max_num_batched_tokens  # catch-up tokens computed per proposal
        # ... in chunks of at most a window, as the engine's scheduler prefills under one
        self.chunk_limit = sys.maxsize if self.window is None else self.window.window
        # No draft token past the draft's context, which attention sinks never leave (positions within the cache)
        self.max_len = context if engine_config.kv_window is None else sys.maxsize
        self._states: dict[int, _DraftState] = {}

    def propose_all(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's draft: up to its ``max_tokens`` tokens, the draft model's continuation sampled as
        the request samples; [] for a sequence still catching up, or when the draft's blocks or context run
        out."""
        drafts: list[list[int]] = [[] for _ in requests]
        chunks: list[SeqChunk] = []
        drafting: list[tuple[int, int, int]] = []  # (request index, draft length, row of the catch-up pass)
        budget = self.token_budget
        for i, r in enumerate(requests):
            state = self._states.setdefault(r.seq_id, _DraftState())
            state.catch_up(r.token_ids)
            total = len(r.token_ids)
            room = min(r.max_tokens, self.config.num_speculative_tokens, self.max_len - total)
            n = min(total - state.computed, budget, self.chunk_limit)
            if room <= 0 or n <= 0:
                continue
            caught_up = state.computed + n == total
            if not self.blocks.allocate(r.seq_id, state.computed, n + (room - 1 if caught_up else 0)):
                continue
            budget -= n
            chunks.append(SeqChunk(r.token_ids[state.computed:total if caught_up else state.computed + n],
                                   state.computed, self.blocks.block_table(r.seq_id)))
            state.computed += n
            if caught_up:
                drafting.append((i, room, len(chunks) - 1))
        if not chunks:
            return drafts
        logits = self.runner.run(chunks)  # (also when no chunk drafts: it writes the catch-up's K/V)
        live = [(i, room) for i, room, _ in drafting]
        taken = [0] * len(requests)  # draft tokens each grammar took, given back below
        try:
            if live:
                live = self._sample_next(logits[[row for _, _, row in drafting]], requests, live, drafts, taken)
            # one token a pass: each draft token's K/V is written as the next one is predicted
            while live:
                logits = self.runner.run([SeqChunk([drafts[i][-1]], len(requests[i].token_ids) + len(drafts[i]) - 1,
                                                   self.blocks.block_table(requests[i].seq_id)) for i, _ in live])
                live = self._sample_next(logits, requests, live, drafts, taken)
        finally:
            for r, count in zip(requests, taken, strict=True):
                if count:
                    r.rules.grammar.give_back(count)
        for i, _, _ in drafting:
            self._states[requests[i].seq_id].written = drafts[i][:-1]
        if self.window is not None:  # free the blocks no later query of the sequence reads
            for r in requests:
                if r.seq_id in self.blocks.seqs:
                    self.blocks.drop(r.seq_id, self.window.droppable(self._states[r.seq_id].computed))
        return drafts

    def _sample_next(self, logits: torch.Tensor, requests: list[DraftRequest], live: list[tuple[int, int]],
                     drafts: list[list[int]], taken: list[int]) -> list[tuple[int, int]]:
        """Append to each live request's draft its next token, sampled from ``logits`` (a row per live request)
        as the request samples, with the draw its verification will use at that position, within its rules
        (their grammar takes the token: ``taken`` counts them); the requests whose drafts go on."""
        picked = [(requests[i], drafts[i]) for i, _ in live]
        grammars = [None if r.rules is None else r.rules.grammar for r, _ in picked]
        bitmask = self.grammars.fill(grammars)
        allowed = logits if bitmask is None else self.grammars.apply(logits, bitmask)
        banned = [[] if r.rules is None else r.rules.banned(draft, g is not None and g.complete)
                  for (r, draft), g in zip(picked, grammars, strict=True)]
        drafted = [(row, token) for row, (r, draft) in enumerate(picked) if r.params.has_penalties
                   for token in draft]
        extra = None if not drafted else ([row for row, _ in drafted],
                                          device_values([t for _, t in drafted], torch.long, logits.device))
        tokens = sample(allowed, [r.params for r, _ in picked], [None] * len(picked),
                        self.token_counts.penalties([r for r, _ in picked], extra=extra), banned,
                        draws=[None if r.draws is None else r.draws.values[len(draft)] for r, draft in picked])
        going = []
        for (i, room), token, grammar in zip(live, tokens, grammars, strict=True):
            if grammar is not None and not grammar.take_draft(token):
                continue  # nothing was left to draft (every token masked or banned): the draft ends here
            drafts[i].append(token)
            taken[i] += grammar is not None
            if len(drafts[i]) < room:
                going.append((i, room))
        return going

    def forget(self, seq_id: int) -> None:
        """Free a finished, aborted or preempted sequence's draft blocks (a preempted one catches up again)."""
        self._states.pop(seq_id, None)
        self.blocks.free(seq_id)
        self.token_counts.forget(seq_id)
