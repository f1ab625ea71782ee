"""Serving metrics with ``vllm bench serve``'s definitions (its ``calculate_metrics``), so numbers compare.

Only completed requests contribute to latencies and token counts. Per request: TTFT = first token chunk;
E2EL = last event; TPOT = (E2EL - TTFT) / (output_tokens - 1), only for output_tokens > 1 (counted as 0
for goodput otherwise); ITL = every gap between token chunks, pooled over requests. Statistics are numpy's
mean, median, population std and linear-interpolated percentiles, 0 when there is no sample. Throughputs
divide by the whole run's duration. Added here: Mooncake's TBT (the mean of a request's slowest 10% of
gaps, at least one gap), cache-hit tokens (``usage.prompt_tokens_details.cached_tokens``), rejections.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.clients import RequestRecord

SLO_NAMES = ("ttft", "tpot", "e2el", "tbt")


@dataclass
class Distribution:
    """Milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, values_s: list[float], percentiles: list[float]) -> Distribution:
        v = values_s or 0  # vLLM's convention: an empty metric reads 0
        return cls(float(np.mean(v)) * 1000, float(np.median(v)) * 1000, float(np.std(v)) * 1000,
                   {p: float(np.percentile(v, p)) * 1000 for p in percentiles})


@dataclass
class BenchmarkMetrics:
    duration_s: float
    sent: int
    completed: int
    failed: int
    rejected: int
    total_input: int
    total_output: int
    total_cached: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    tbt: Distribution

    @property
    def cache_hit_rate(self) -> float:
        return self.total_cached / self.total_input if self.total_input else 0.0


def mooncake_tbt(itls_s: list[float]) -> float:
    """Mean of the slowest 10% (rounded up) of one request's token gaps; 0 with no gap."""
    if not itls_s:
        return 0.0
    k = max(1, math.ceil(0.1 * len(itls_s)))
    return float(np.mean(sorted(itls_s, reverse=True)[:k]))


def tpot_s(rec: RequestRecord) -> float:
    """(E2EL - TTFT) / (output_tokens - 1); 0 for a single-token answer."""
    if rec.output_tokens <= 1:
        return 0.0
    return (rec.latency_s - rec.ttft_s) / (rec.output_tokens - 1)


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or name not in SLO_NAMES or not ms >= 0:
            raise ValueError(f"bad SLO {pair!r}: expected NAME:MS with NAME one of {', '.join(SLO_NAMES)} "
                             "and MS a non-negative number of milliseconds")
        slos[name] = ms
    return slos


def _peaks(done: list[RequestRecord]) -> tuple[float, int]:
    """vLLM's peak output tokens/s and peak concurrency, over one-second buckets from the first start."""
    if not done:
        return 0.0, 0
    t0 = min(r.start_s for r in done)
    n = int(np.ceil(max(r.start_s + r.latency_s for r in done) - t0)) + 1
    tokens, concurrent = np.zeros(n), np.zeros(n)
    for r in done:
        for t in r.chunk_s:
            bucket = int(r.start_s + t - t0)
            if 0 <= bucket < n:
                tokens[bucket] += 1
        concurrent[int(r.start_s - t0): int(r.start_s + r.latency_s - t0) + 1] += 1
    return float(tokens.max()), int(concurrent.max())


def compute_metrics(records: list[RequestRecord], duration_s: float, percentiles: Sequence[float] = (99,),
                    goodput: dict[str, float] | None = None) -> BenchmarkMetrics:
    """Aggregate every sent request's record; ``goodput`` maps SLO names to milliseconds."""
    done = [r for r in records if r.status == "ok"]
    percentiles = list(percentiles)
    duration_s = max(duration_s, 1e-9)  # a run interrupted at once still reports
    ttfts = [r.ttft_s for r in done]
    e2els = [r.latency_s for r in done]
    all_tpots = [tpot_s(r) for r in done]
    all_tbts = [mooncake_tbt(r.itl_s) for r in done]
    tpots = [t for t, r in zip(all_tpots, done, strict=True) if r.output_tokens > 1]
    tbts = [t for t, r in zip(all_tbts, done, strict=True) if r.itl_s]
    itls = [gap for r in done for gap in r.itl_s]

    good = None
    if goodput:
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els, "tbt": all_tbts}
        checks = [(per_request[name], ms / 1000) for name, ms in goodput.items()]
        good = sum(all(values[i] <= slo for values, slo in checks) for i in range(len(done)))

    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    peak_tokens, peak_concurrency = _peaks(done)
    return BenchmarkMetrics(
        duration_s=duration_s, sent=len(records), completed=len(done),
        failed=sum(r.status == "failed" for r in records), rejected=sum(r.status == "rejected" for r in records),
        total_input=total_input, total_output=total_output, total_cached=sum(r.cached_tokens for r in done),
        request_throughput=len(done) / duration_s,
        request_goodput=None if good is None else good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_concurrency,
        ttft=Distribution.of(ttfts, percentiles), tpot=Distribution.of(tpots, percentiles),
        itl=Distribution.of(itls, percentiles), e2el=Distribution.of(e2els, percentiles),
        tbt=Distribution.of(tbts, percentiles),
    )
