"""One request's timeline, recorded into the serving metrics as its token events arrive.

The dispatcher makes one ``RequestTracker`` per (sub-)request, tells it each routing decision and hands
it every token event *before* yielding the event: a consumer that stops right after the last event (the
gateway does) never resumes the dispatcher, so nothing may wait for the stream to end.

Phases as vLLM names them, on the dispatcher's clock: queue = arrival to the (last) routing decision;
prefill = routing to first token, which holds the prefill worker's own queue, the prompt's compute and the
KV handoff (workers do not report per-request admission times); decode = first to last token;
inference = routing to last token; e2e = arrival to last token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.metrics import Metrics

if TYPE_CHECKING:
    from router.view import Decision
    from services.messages import TokenEvent


class RequestTracker:
    def __init__(self, metrics: Metrics, arrived: float | None = None,
                 on_ttft: Callable[[Decision, float], None] | None = None) -> None:
        """``on_ttft(decision, seconds from routing to first token)``: the router learns from it."""
        arrived = time.monotonic() if arrived is None else arrived
        self.metrics, self.on_ttft = metrics, on_ttft
        self.arrived = self.routed = arrived
        self.decision: Decision | None = None
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.num_prompt_tokens = 0
        self.num_tokens = 0
        self.finished = False

    @property
    def streaming(self) -> bool:
        """The first token is out: the request can no longer be routed again."""
        return self.first_token_at is not None

    def route(self, decision: Decision) -> None:
        self.routed, self.decision = time.monotonic(), decision

    def on_event(self, event: TokenEvent) -> None:
        now, n, m = time.monotonic(), len(event.token_ids), self.metrics
        if self.first_token_at is None:
            self.first_token_at, self.num_prompt_tokens = now, event.num_prompt_tokens
            m.ttft.observe(now - self.arrived)
            m.prompt_tokens.inc(event.num_prompt_tokens)
            if self.decision is not None:
                self._estimate_error("ttft", now - self.routed, self.decision.est_ttft_s)
                if self.on_ttft is not None:
                    self.on_ttft(self.decision, now - self.routed)
        elif n:
            # Tokens that arrive together (joined while the gateway was behind the worker) share the gap.
            for _ in range(n):
                m.itl.observe((now - self.last_token_at) / n)
        self.last_token_at = now
        self.num_tokens += n
        m.generation_tokens.inc(n)
        if event.finish_reason is not None:
            self._finish(str(event.finish_reason))

    def stop(self, exc: BaseException | None) -> None:
        """The stream ended (``exc``: what ended it). One that streamed but never finished is counted as
        aborted (the consumer left) or as an error."""
        if self.streaming and not self.finished:
            left = exc is None or isinstance(exc, GeneratorExit | asyncio.CancelledError)
            self._finish("abort" if left else "error")

    def _finish(self, reason: str) -> None:
        self.finished = True
        m = self.metrics
        m.request_success.labels(m.model_name, reason).inc()
        if reason not in ("stop", "length"):
            return  # an aborted or failed request has no latency to report
        first, last = self.first_token_at, self.last_token_at
        m.e2e.observe(last - self.arrived)
        m.queue_time.observe(self.routed - self.arrived)
        m.prefill_time.observe(first - self.routed)
        m.decode_time.observe(last - first)
        m.inference_time.observe(last - self.routed)
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens)
        if self.num_tokens > 1:
            tpot = (last - first) / (self.num_tokens - 1)
            m.tpot.observe(tpot)
            if self.decision is not None:
                self._estimate_error("tbt", tpot, self.decision.est_tbt_s)

    def _estimate_error(self, estimate: str, measured: float, estimated: float) -> None:
        if estimated > 0:
            m = self.metrics
            m.estimate_error.labels(m.model_name, estimate).observe((measured - estimated) / estimated)
