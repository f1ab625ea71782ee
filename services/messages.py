"""What the dispatcher and the workers say to each other: typed, torch-free dataclasses.

Everything here crosses a process boundary (Ray pickles it), so it holds plain data only: no tensors,
no engine objects. The gateway and the router's process import this module without importing torch.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.output import FinishReason, TokenLogprobs, pickled_by_fields
from engine.pooling import Pooling


class EngineStepError(Exception):
    """A worker's engine step raised: the requests in that step are failed with this error (their blocks
    freed), and the worker reports itself unhealthy until it is replaced. Not retried elsewhere: the
    request may be what broke the step."""


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # prefill and decode in one engine


@dataclass(frozen=True)
class KVTarget:
    """Where a prefill worker sends a request's KV: the decode worker's transfer endpoints."""

    worker_id: str
    grpc_address: str  # host:port of the decode worker's KV transfer server
    device: str  # the decode side's device ("cpu", "cuda", "cuda:1"): picks the collective backend
    node_id: str  # the Ray node it runs on: a prefill worker on the same node may hand KV over by ipc
    actor: Any  # the decode worker's Ray actor handle, which opens and receives collective and ipc transfers


@dataclass(frozen=True)
class SessionSequence:
    """A chat session's last turn as the model saw and wrote it: its prompt's token ids, then its reply's
    (the next turn's prompt starts with them, so it finds that turn's KV)."""

    prompt_len: int
    ids: list[int]


@dataclass(frozen=True)
class PrefixFetch:
    """The router's choice to copy a prompt's leading blocks from another worker before computing it."""

    source: str  # the holder's worker id
    blocks: int  # leading blocks of the prompt the holder has, or will have once its prefill of them ends
    wait_s: float  # how long the holder may wait for blocks it is still computing
    actor: Any  # the holder's Ray actor handle: asked to push the blocks
    salt: bytes  # what the blocks are hashed under (``kvstore.hashing.salt_for``: model, adapter, LongRoPE factors)


@dataclass(frozen=True)
class WorkerProfile:
    """Timings a worker measured on its own engine at start, for the router's estimator."""

    prefill: list[tuple[int, int, float]]  # (new tokens, cached tokens, seconds)
    decode: list[tuple[int, int, float]]  # (batch size, context tokens, seconds per step)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker reports once started: where it runs, its model and KV capacity, its profile."""

    worker_id: str
    role: Role
    node: str  # the node's IP address
    node_id: str  # Ray's node id
    device: str
    model_id: str
    block_size: int
    max_model_len: int
    kv_bytes_per_token: int
    total_blocks: int
    profile: WorkerProfile
    kv_target: KVTarget | None = None  # decode workers only
    prefix_address: str | None = None  # host:port peers push prefix copies to (prefill and colocated workers)
    max_kv_tokens: int | None = None  # an attention window bounds one sequence's KV at this many tokens
    num_layers: int = 1  # the model's layers: a layer-wise hand-off streams in this many pieces
    long_rope_from: int | None = None  # LongRoPE's original context (``engine.config.long_rope_applies``)
    quantized_at_load: str | None = None  # --quantization, when it changed the weights: part of the hash salt
    # The LoRA adapters it serves beside the base model: name -> adapter id (its blocks' hash salt, ``engine/lora.py``)
    loras: dict[str, str] = field(default_factory=dict)
    num_speculative_tokens: int = 0  # the most draft tokens its engine verifies a step; 0: it does not speculate
    hidden_size: int = 0  # the length of the model's embeddings
    pooling: Pooling = field(default_factory=Pooling)  # how they are made (``engine/pooling.py``)
    generates: bool = True  # False: a base checkpoint without its LM head serves embeddings only (ModelConfig's)


@pickled_by_fields
@dataclass
class TokenEvent:
    """New tokens of one choice of a request, as a worker streams them."""

    index: int  # which of the n choices
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    text: str = ""  # new text: the engine detokenizes, holds back a possible stop string and cuts a matched one
    logprobs: list[TokenLogprobs] | None = None  # one per token of ``token_ids``, when the request asked
    # With a choice's first token, when the request asked for prompt logprobs: one per prompt token after the first
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Draft tokens of the request's predicted output that these tokens' steps verified: kept, and not kept
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


def join_events(events: Sequence[TokenEvent]) -> TokenEvent:
    """One event for consecutive ``events`` of one choice, none but the last finishing it (what a consumer slower
    than its producer is handed): their tokens, text, logprobs and prediction counts in order, the first's prompt
    logprobs, the last's finish reason and prompt counts."""
    if len(events) == 1:
        return events[0]
    first, last = events[0], events[-1]
    return TokenEvent(
        index=first.index, token_ids=[t for e in events for t in e.token_ids], finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens, num_cached_tokens=last.num_cached_tokens,
        text="".join(e.text for e in events),
        logprobs=None if all(e.logprobs is None for e in events) else [lp for e in events for lp in e.logprobs or ()],
        prompt_logprobs=first.prompt_logprobs,  # only a choice's first event has them
        accepted_prediction_tokens=sum(e.accepted_prediction_tokens for e in events),
        rejected_prediction_tokens=sum(e.rejected_prediction_tokens for e in events),
    )


@dataclass(frozen=True)
class EmbeddingResult:
    """A worker's answer to an embedding request (``Worker.embed``)."""

    embedding: list[float]
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens its prefix cache (or the pool, a peer) held


@dataclass(frozen=True)
class PrefillResult:
    """A prefill worker's answer: the first token, and how the KV handoff went."""

    first_token_id: int
    text: str  # the first token's text as the engine released it
    finish_reason: FinishReason | None  # set when the first token already ends the request
    num_cached_tokens: int
    transfer_bytes: int
    transfer_s: float
    transport: str = ""  # the transport actually used ("grpc", "collective"); "" when nothing was sent
    # Seconds the bytes were moving: transfer_s less a layer-wise sender's waits for layers still being
    # computed; what the router learns the link from (0: nothing sent)
    link_s: float = 0.0
    # Seconds from the prompt's last step to the decode side's ack: what the first token waited for the KV,
    # the part of the handoff in its TTFT (all of it when sent after the prefill; 0: nothing sent)
    exposed_s: float = 0.0
    logprobs: TokenLogprobs | None = None  # the first token's, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprobs] | None = None  # when the request asked for them (RequestOutput's)
    # Prefix blocks copied in before the prefill: (source, bytes, seconds) per source ("pool", a worker id)
    prefix_copies: tuple[tuple[str, int, float], ...] = ()
