"""What a simulated run (router/simulator.py) reports: TTFT, TBT (Mooncake's: the mean of each request's slowest 10% of token
gaps), SLO attainment over every arrived request (a rejection misses), goodput, cache hits, rejections."""

from __future__ import annotations

import math

import numpy as np

from router.simulator import SimConfig, SimRequest


def policy_label(cfg: SimConfig) -> str:
    options = dict(cfg.policy_options, **({} if cfg.learn_worker_speeds else {"worker_speeds": "off"}))
    opts = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{cfg.policy}[{opts}]" if opts else cfg.policy


def summarize(reqs: list[SimRequest], cfg: SimConfig, fetched_tokens: int = 0, replicated_tokens: int = 0) -> dict:
    """Per-run metrics; latencies in seconds, rates in requests/s of simulated time."""
    served = [r for r in reqs if r.done]
    rejected = [r for r in reqs if r.reject is not None]
    ttft = np.array([r.ttft for r in served])
    tbt = np.array([r.tbt for r in served])
    good = int(np.sum((ttft <= cfg.slo.ttft_s) & (tbt <= cfg.slo.tbt_s))) if served else 0
    first = min(r.arrival for r in reqs)
    span = max(r.arrival for r in reqs) - first
    end = max([r.end for r in served] + [r.arrival for r in reqs])
    prompt_tokens = sum(r.prompt for r in served)
    reasons: dict[str, int] = {}
    for r in rejected:
        reasons[r.reject] = reasons.get(r.reject, 0) + 1

    def stats(a: np.ndarray) -> dict:
        if not len(a):
            return {"mean": None, "p50": None, "p99": None}
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}

    return {
        "policy": policy_label(cfg),
        "speed": cfg.speed,
        "request_rate": len(reqs) / span if span > 0 else math.inf,
        "arrived": len(reqs),
        "served": len(served),
        "rejected": len(rejected),
        "rejected_by_reason": reasons,
        "ttft_s": stats(ttft),
        "tbt_s": stats(tbt),
        "slo_attainment": good / len(reqs),
        "goodput_rps": good / max(end - first, 1e-9),
        "cache_hit_rate": sum(r.cached for r in served) / max(prompt_tokens, 1),
        "fetched_token_share": fetched_tokens / max(prompt_tokens, 1),
        "replicated_token_share": replicated_tokens / max(prompt_tokens, 1),
        "duration_s": end - first,  # from the first arrival to the last request's end
    }
