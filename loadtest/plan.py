"""Turn a ``BenchConfig`` into the requests to send and when: every input error surfaces here, before the
first request goes out."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from loadtest.arrivals import synthetic_arrivals, trace_arrivals
from loadtest.config import BACKENDS, WORKLOADS, BenchConfig, endpoint_kind
from loadtest.tokens import PromptTokenizer, random_token_requests
from loadtest.workloads import (
    ChatSession,
    RequestSpec,
    chat_sessions,
    mooncake_requests,
    random_requests,
    sharegpt_requests,
)
from router.trace import load_trace


@dataclass
class Workload:
    """Either open-loop requests with their arrival offsets, or chat sessions with their start offsets."""

    total: int
    specs: list[RequestSpec]
    arrivals: list[float]
    sessions: list[ChatSession]
    starts: list[float]


def _check(config: BenchConfig) -> None:
    if config.backend not in BACKENDS:
        raise ValueError(f"unknown backend {config.backend!r}; expected one of {', '.join(BACKENDS)}")
    if config.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {config.workload!r}; expected one of {', '.join(WORKLOADS)}")
    for name in ("length_scale", "timeout_s"):
        if not getattr(config, name) > 0:
            raise ValueError(f"{name} must be positive, got {getattr(config, name)}")
    if config.chars_per_token is not None and not config.chars_per_token > 0:
        raise ValueError(f"chars_per_token must be positive, got {config.chars_per_token}")
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {config.max_concurrency}")
    # Counts and lengths the workload uses: 0 would send nothing, or prompts and answers of no tokens.
    counted = {"random": ("num_prompts", "input_len", "output_len"), "sharegpt": ("num_prompts",),
               "chat": ("num_users", "turns", "input_len", "output_len")}.get(config.workload, ())
    for name in counted:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(config, name)}")
    if config.workload in ("mooncake", "sharegpt") and not config.file_path:
        flag = "--trace" if config.workload == "mooncake" else "--dataset-path"
        raise ValueError(f"the {config.workload} workload needs {flag} FILE")
    if config.workload in ("random", "chat") and config.file_path:
        raise ValueError(f"the {config.workload} workload reads no file; drop --dataset-path or pick "
                         "--dataset-name sharegpt or mooncake")


def chars_per_token(config: BenchConfig, tok: PromptTokenizer | None) -> float:
    """The synthetic text's characters per token: given, measured on the tokenizer, or 1 (byte-level)."""
    if config.chars_per_token is not None:
        return config.chars_per_token
    return tok.chars_per_token(config.seed) if tok else 1.0


def build_workload(config: BenchConfig, tok: PromptTokenizer | None, id_prefix: str = "") -> Workload:
    """The requests of ``config`` (prompt lengths in ``tok``'s tokens when given); raises ValueError (or
    router.trace.TraceError) on bad input."""
    _check(config)
    kind, _ = endpoint_kind(config)
    cpt = chars_per_token(config, tok)
    rate = math.inf if config.request_rate is None else config.request_rate
    if config.workload == "chat":
        if kind != "chat":
            raise ValueError("the chat workload needs the chat endpoint")
        if config.lora_modules:  # a conversation would switch adapters from turn to turn
            raise ValueError("--lora-modules picks an adapter per request: use it with the random, sharegpt or "
                             "mooncake workload, not chat")
        sessions = chat_sessions(
            config.num_users, config.turns, input_len=config.input_len, output_len=config.output_len,
            prefix_len=config.prefix_len, seed=config.seed, chars_per_token=cpt,
            use_session=config.use_session, id_prefix=id_prefix, count=tok.prompt_count if tok else None)
        starts = synthetic_arrivals(config.num_users, rate, config.burstiness, config.seed)
        return Workload(config.num_users * config.turns, [], [], sessions, starts)
    if config.workload == "mooncake":
        rows = load_trace(config.file_path, config.max_requests)
        specs = mooncake_requests(rows, seed=config.seed, length_scale=config.length_scale,
                                  chars_per_token=cpt, id_prefix=id_prefix)
        if tok:
            for spec in specs:
                spec.prompt_len = tok.prompt_count(spec.prompt)
        arrivals = (trace_arrivals(rows, config.time_scale) if config.request_rate is None
                    else synthetic_arrivals(len(specs), rate, config.burstiness, config.seed))
    else:
        if config.workload == "sharegpt":
            count = tok.prompt_count if tok else lambda text: max(1, round(len(text) / cpt))
            specs = sharegpt_requests(config.file_path, config.num_prompts, count,
                                      output_len=config.sharegpt_output_len, seed=config.seed,
                                      id_prefix=id_prefix)
        elif tok:
            specs = random_token_requests(
                tok, config.num_prompts, input_len=config.input_len, output_len=config.output_len,
                range_ratio=config.range_ratio, prefix_len=config.prefix_len, seed=config.seed,
                id_prefix=id_prefix)
        else:
            specs = random_requests(
                config.num_prompts, input_len=config.input_len, output_len=config.output_len,
                range_ratio=config.range_ratio, prefix_len=config.prefix_len, seed=config.seed,
                chars_per_token=cpt, id_prefix=id_prefix)
        arrivals = synthetic_arrivals(len(specs), rate, config.burstiness, config.seed)
    if kind == "chat":
        for spec in specs:
            spec.messages = [{"role": "user", "content": spec.prompt}]
    if config.lora_modules:
        rng = random.Random(config.seed)
        for spec in specs:
            spec.model = rng.choice(config.lora_modules)
    return Workload(len(specs), specs, arrivals, [], [])
