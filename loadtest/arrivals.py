"""When each request (or chat session) starts, in seconds from the start of the run.

Synthetic arrivals follow ``vllm bench serve``: gaps drawn from a gamma distribution with shape
``burstiness`` and mean ``1/rate`` (burstiness 1 is a Poisson process; below 1 burstier, above 1 more
even), then rescaled so the last arrival lands at ``n / rate`` and throughput does not drift with the seed.
"""

from __future__ import annotations

import math

import numpy as np

from router.trace import TraceRequest


def synthetic_arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival offsets for ``n`` requests at ``rate`` per second (``inf``: everything at time 0)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    times *= (n / rate) / times[-1]
    return times.tolist()


def trace_arrivals(rows: list[TraceRequest], time_scale: float = 1.0) -> list[float]:
    """The trace's own timestamps, relative to its first row and multiplied by ``time_scale``
    (0.5 replays twice as fast)."""
    if time_scale < 0:
        raise ValueError(f"time_scale must be non-negative, got {time_scale}")
    if not rows:
        return []
    t0 = min(r.arrival_s for r in rows)
    return [(r.arrival_s - t0) * time_scale for r in rows]
