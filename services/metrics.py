"""Serving metrics in Prometheus format: the dispatcher and the gateway update them, `/metrics` renders them.

Each `Metrics` owns its registry (not prometheus_client's global one), so two servers in one process —
as in the tests — don't collide on metric names.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from router.conductor import WorkerLoad

# Latency buckets from 1 ms to 60 s: TTFT spans queueing + prefill, TPOT one decode step.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class Metrics:
    """The cluster's serving metrics (names prefixed ``tidepool_``)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("tidepool_ttft_seconds", "Time to first token", buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("tidepool_tpot_seconds", "Time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.cached_tokens = Counter("tidepool_cached_prompt_tokens",
                                     "Prompt tokens served from cached KV (local, pool or peer)", registry=r)
        self.waiting = Gauge("tidepool_worker_waiting_requests", "Requests queued on a worker",
                             ["worker", "role"], registry=r)
        self.running = Gauge("tidepool_worker_running_requests", "Requests in a worker's running batch",
                             ["worker", "role"], registry=r)
        self.blocks_used = Gauge("tidepool_worker_kv_blocks_used", "KV blocks in use on a worker",
                                 ["worker", "role"], registry=r)
        self.blocks_total = Gauge("tidepool_worker_kv_blocks_total", "KV blocks a worker has",
                                  ["worker", "role"], registry=r)
        self.transfer_bytes = Counter("tidepool_kv_transfer_bytes", "KV bytes moved between workers",
                                      ["transport"], registry=r)
        self.transfer_seconds = Histogram("tidepool_kv_transfer_seconds", "Duration of one KV handoff",
                                          ["transport"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.rejections = Counter("tidepool_rejections", "Requests rejected early", ["reason"], registry=r)
        self.requests = Counter("tidepool_requests", "Requests answered, by API and status",
                                ["api", "status"], registry=r)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def add_cached_tokens(self, n: int) -> None:
        self.cached_tokens.inc(n)

    def set_worker_load(self, load: WorkerLoad) -> None:
        """Record a worker's latest load report; a dead worker's series are dropped."""
        labels = (load.worker_id, load.role)
        gauges = (self.waiting, self.running, self.blocks_used, self.blocks_total)
        if not load.alive:
            for gauge in gauges:
                with contextlib.suppress(KeyError):  # never reported while alive
                    gauge.remove(*labels)
            return
        self.waiting.labels(*labels).set(len(load.queued_prefills))
        self.running.labels(*labels).set(load.num_running)
        self.blocks_used.labels(*labels).set(load.total_blocks - load.free_blocks)
        self.blocks_total.labels(*labels).set(load.total_blocks)

    def observe_transfer(self, transport: str, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(transport).inc(nbytes)
        self.transfer_seconds.labels(transport).observe(seconds)

    def inc_rejection(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def inc_request(self, api: str, status: str) -> None:
        self.requests.labels(api, status).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
