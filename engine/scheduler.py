"""Continuous batching: which sequences run this step and how many of their tokens.

Each step spends a token budget (``max_num_batched_tokens``): first one token for every running
sequence that is decoding (and its draft, when it speculates: ``engine/speculative.py``), then the rest of
any partly prefilled prompt, then new prompts from the waiting queue (after their prefix-cache hits), a
long prompt being cut into chunks (chunked prefill) of at most ``max_chunk`` tokens (an attention window's
length, which bounds the blocks a windowed step holds). When a running sequence needs a block and none is
free, the running sequence of the lowest priority (the request's own, vLLM's; then the most recently
admitted) is preempted by recompute: its blocks are freed and it goes back to the waiting queue, ahead of
every waiting sequence of its priority or a lower one, with every token it has, to be prefilled again
later (its prefix blocks are then usually still cached).

With LoRA adapters (``engine/lora_slots.py``) a sequence runs only once its adapter is in one of the engine's
slots (``adapter_ready``, which swaps it in if a slot is free or holds an adapter no running sequence has):
a waiting sequence whose adapter gets no slot is passed over for the ones behind it (vLLM's ``max_loras``
rule), and an imported sequence (its K/V received) is held until it gets one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from engine.block_manager import BlockManager
from engine.output import FinishReason, OutputText, TokenLogprobs
from engine.sampling_params import Priority, SamplingParams
from engine.speculative import PredictedOutput
from engine.structured_output import GrammarMatcher


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"

# Most prompt tokens a step computes of the sequences that collect prompt logprobs, all of them together:
# each returns a row of logits (vocabulary-wide, float32), and the device profile holds this many rows beside
# the sampler's (``device_memory.sample_largest_step``), so such a step stays within what it measured.
PROMPT_LOGPROBS_ROWS = 512


@dataclass(eq=False)
class Sequence:
    """One sample of one request: its tokens so far and how many of them have K/V in the cache."""

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    index: int = 0  # which of the request's n samples
    fanout: int = 1  # samples this sequence forks into when its prompt is done (n > 1)
    prefill_only: bool = False
    # An embedding request's (``engine/pooling.py``): the values its vector keeps (the hidden size, or the
    # Matryoshka ``dimensions`` asked for); it ends when its prompt is computed, with the vector, not a token
    embedding_dims: int | None = None
    priority: Priority | None = None  # lower is earlier in the waiting queue; None: last
    generator: torch.Generator | None = None
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    admitted: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    text: OutputText | None = None  # when the model has a tokenizer
    # The logprobs of prompt tokens 1.. (prompt_logprobs asked for), collected as the prompt is computed and
    # handed out with the first token; None otherwise and from then on.
    prompt_logprobs: list[TokenLogprobs] | None = None
    grammar: GrammarMatcher | None = None  # where the sample is in its structured output, if it has one
    # Tokens proposed to follow its last one (speculative decoding), computed with it in this step's chunk and
    # kept as far as the sampler agrees; [] outside a decoding step that speculates.
    draft_ids: list[int] = field(default_factory=list)
    prediction: PredictedOutput | None = None  # its request's predicted output, followed as it decodes
    draft_predicted: bool = False  # draft_ids came from the prediction
    lora: str | None = None  # the LoRA adapter it runs with (``engine/lora.py``); None: the base model
    # A LongRoPE model's sequence longer than the original context rotates every key with the long factors
    long_rope: bool = False
    # What its blocks' chain hashes are salted with in the prefix cache (None: the engine's): an adapter's and a
    # long LongRoPE sequence's blocks are not the base model's, nor a short sequence's (``Engine._salt``).
    hash_salt: bytes | None = None
    @property
    def samples_on_device(self) -> bool:
        """Async scheduling (``Engine``): whether its next step may be launched with its last token still on
        the device. Not while its prompt's logprobs are collected (read from the step's logits, until they go
        out with its first token), nor while its prompt is to fork into n samples or be handed off (a
        prefill-only request), nor an embedding request (its vector is read on the host). Its sampling waits
        for nothing: that token reaches the host while the step's forward pass runs, before the step samples."""
        return not (self.prefill_only or self.fanout > 1 or self.prompt_logprobs is not None
                    or self.embedding_dims is not None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def _own_priority(seq: Sequence) -> float:
    """The request's own priority (vLLM's), lower first; none: last."""
    return math.inf if seq.priority is None else seq.priority[0]


def _later(waiting: Sequence, priority: Priority) -> bool:
    """Whether a sequence of ``priority`` goes ahead of ``waiting``: one of a lower own priority, preempted or
    not, and one of the same own priority routed later that has not run yet."""
    if waiting.priority is None:
        return False
    return waiting.priority[0] > priority[0] or (waiting.priority > priority and not waiting.admitted)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]
    preempted: list[Sequence]


@dataclass
class _StepRoom:
    """What a step being scheduled has left: tokens of ``max_num_batched_tokens`` and, for the sequences that
    collect prompt logprobs, rows of ``PROMPT_LOGPROBS_ROWS``; and the chunks put in it so far."""

    tokens: int
    max_chunk: int
    logprob_rows: int
    seqs: list[Sequence] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def most(self, seq: Sequence, wanted: int) -> int:
        """How many of ``wanted`` tokens ``seq`` computes this step: within the tokens left and ``max_chunk``,
        and while it collects prompt logprobs within the rows left (0: it waits for the next step)."""
        chunk = self.max_chunk if seq.prompt_logprobs is None else min(self.max_chunk, self.logprob_rows)
        return min(wanted, self.tokens, chunk)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.counts.append(n)
        self.tokens -= n
        if seq.prompt_logprobs is not None:
            self.logprob_rows -= n


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_chunk: int | None = None):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_chunk = max_chunk or max_num_batched_tokens
        # A new prompt starts in a step only while the step holds fewer prompt tokens than this (DistServe's
        # saturation length): past it, batching more prompts saves nothing and only makes the prompts
        # ahead wait for the ones behind. None: fill the budget (the worker sets it from its profile).
        self.prefill_batch_tokens: int | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # imported sequences waiting for their LoRA adapter's slot, and the gate that gives one: the adapter's
        # name and those of the running sequences -> whether it is in a slot now (None: no adapters)
        self.held: list[Sequence] = []
        self.adapter_ready: Callable[[str, set[str]], bool] | None = None
        self.prompt_tokens_cached = 0  # prompt tokens served from the prefix cache at first admission
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache at first admission
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` after every waiting sequence of lower or no priority: requests reach the engine
        in another order than the router sent them (each passes its own prefix read first), and the
        router's TTFT estimates assume its order."""
        seq.status = SeqStatus.WAITING
        i = len(self.waiting)
        if seq.priority is not None:  # never ahead of a preempted sequence (admitted before: it goes first)
            while i > 0 and _later(self.waiting[i - 1], seq.priority):
                i -= 1
        self.waiting.insert(i, seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks already hold its K/V (imported): it decodes from the next step, or, when
        its LoRA adapter gets no slot yet, from the first step in which it does."""
        seq.admitted = True
        if self._adapter_ready(seq):
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SeqStatus.WAITING
            self.held.append(seq)

    def _adapter_ready(self, seq: Sequence) -> bool:
        if seq.lora is None or self.adapter_ready is None:
            return True
        return self.adapter_ready(seq.lora, {s.lora for s in self.running if s.lora is not None})

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    def remove(self, seqs: list[Sequence]) -> None:
        """Take sequences out of both queues (finish or abort); their blocks are the caller's business."""
        gone = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in gone]
        self.held = [s for s in self.held if id(s) not in gone]
        if any(id(s) in gone for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        for s in seqs:
            s.status = SeqStatus.FINISHED

    def schedule(self) -> ScheduledBatch:
        if self.held:  # imported sequences whose adapter has a slot now
            held, self.held = self.held, []
            for seq in held:
                self.add_running(seq)
        step = _StepRoom(self.max_num_batched_tokens, self.max_chunk, PROMPT_LOGPROBS_ROWS)
        preempted: list[Sequence] = []
        # decode rows first, then the remainder of partly prefilled prompts, each by the request's own priority
        # (then admission order); preempt from the back: the lowest priority, the latest admitted. A sequence
        # whose last token, still on the device (async scheduling), is its max_tokens-th has ended.
        order = sorted((s for s in self.running if s.num_computed_tokens == s.num_tokens - 1
                        and s.num_output_tokens < s.params.max_tokens), key=_own_priority)
        order += sorted((s for s in self.running if s.num_computed_tokens < s.num_tokens - 1), key=_own_priority)
        i = 0
        while i < len(order) and step.tokens > 0:
            seq = order[i]
            n = step.most(seq, seq.num_tokens - seq.num_computed_tokens + len(seq.draft_ids))
            if n == 0:  # the step's prompt-logprob rows are taken: it goes on next step
                i += 1
                continue
            del seq.draft_ids[n - 1:]  # a draft is cut to the budget
            while not self.bm.allocate(seq.seq_id, seq.num_computed_tokens, n):
                if seq.draft_ids:  # speculation gives way before any sequence is preempted
                    seq.draft_ids.clear()
                    n = 1
                    continue
                victim = order.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                step.add(seq, n)
                i += 1
        if preempted:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        # admit waiting prompts (none while blocks are so short that we had to preempt)
        prompt_tokens = sum(n for s, n in zip(step.seqs, step.counts, strict=True)
                            if s.num_computed_tokens < s.num_tokens - 1)
        # The first block each prompt admitted below computes: a prompt whose next block after its cached
        # prefix is one of them waits a step and finds it cached (SGLang's in-batch prefix caching), rather than
        # computing it again beside (a burst of requests behind one system prompt; the router counts on it
        # when it routes prompts of one prefix to one worker, router/inflight.py). Not with a cache whose newest
        # blocks stay out of the prefix cache (a full-precision residual): waiting would not find them.
        computing: set[int] | None = set() if self.bm.residual_blocks == 0 else None
        i = 0  # the first waiting sequence not passed over (its adapter got no slot)
        while i < len(self.waiting) and step.tokens > 0 and not preempted:
            if self.prefill_batch_tokens is not None and prompt_tokens >= self.prefill_batch_tokens:
                break
            seq = self.waiting[i]
            if len(self.running) + seq.fanout > self.max_num_seqs and self.running:
                break
            chunk = step.most(seq, seq.num_tokens)
            if not self._adapter_ready(seq) or not chunk:
                i += 1  # every slot holds a running sequence's adapter, or the prompt-logprob rows are taken
                continue
            cacheable = self.cacheable_blocks(seq)
            prefix = self.bm.cached_prefix(seq.token_ids, cacheable, seq.hash_salt)
            num_cached = len(prefix[0]) * self.bm.block_size
            first_new = self.bm.first_new_block_hash(seq.token_ids, prefix[1], seq.hash_salt)
            if computing and len(prefix[0]) < cacheable and first_new in computing:
                i += 1  # its next block is computed in this step: it takes it from the cache next step
                continue
            n = min(seq.num_tokens - num_cached, chunk)
            if not self.bm.allocate(seq.seq_id, num_cached, n, prefix, seq.hash_salt):
                break
            del self.waiting[i]
            seq.num_computed_tokens = num_cached
            if not seq.admitted:
                seq.num_cached_tokens, seq.admitted = min(num_cached, seq.num_prompt_tokens), True
                self.prompt_tokens_cached += seq.num_cached_tokens
                self.prefix_cache_queries += seq.num_prompt_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            step.add(seq, n)
            prompt_tokens += n
            if computing is not None and first_new is not None and n >= self.bm.block_size:
                computing.add(first_new)
        return ScheduledBatch(step.seqs, step.counts, preempted)

    def cacheable_blocks(self, seq: Sequence) -> int:
        """The most leading blocks ``seq`` takes from the prefix cache: none while it collects prompt logprobs
        (a cached position yields no logits, as in vLLM), else ``BlockManager.max_prefix_blocks``."""
        return 0 if seq.prompt_logprobs is not None else self.bm.max_prefix_blocks(seq.num_tokens)

    def recompute(self, seq: Sequence) -> None:
        """Take ``seq`` out of the batch (if in it) to compute every token of it again, from the waiting queue
        (a LongRoPE sequence passing the original context: ``Engine._recompute_with_long_rope``)."""
        if seq in self.running:
            self.running.remove(seq)
        self._requeue(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it back in the waiting queue, nothing of it computed."""
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.draft_ids.clear()
        seq.status = SeqStatus.WAITING
        i = 0  # behind the waiting sequences of a higher own priority only
        while i < len(self.waiting) and _own_priority(self.waiting[i]) < _own_priority(seq):
            i += 1
        self.waiting.insert(i, seq)
