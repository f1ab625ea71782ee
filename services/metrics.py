"""Serving metrics in Prometheus format, named after vLLM's so its dashboards and autoscalers carry over.

Where the concept is vLLM's, the series is vLLM's name with ``tidepool_`` for ``vllm:``
(``vllm:prompt_tokens_total`` -> ``tidepool_prompt_tokens_total``): Prometheus reserves ``:`` for
recording rules and ``promtool check metrics`` rejects it in exported names. Every series has a
``model_name`` label; docs/metrics.md maps every vLLM metric to its Tidepool equivalent.

Three sources feed them: the dispatcher records each request as its token events arrive
(a ``RequestTracker``, services/request_metrics.py), the load refresher hands in every worker report
(``set_worker_load``: cluster and per-worker gauges, and the workers' cumulative engine counters), and
the gateways count API answers. Each ``Metrics`` owns its registry (not prometheus_client's global one),
so two servers in one process, as in the tests, don't collide on metric names.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from router.loads import LoRAUsage

if TYPE_CHECKING:
    from router.loads import WorkerLoad

# vLLM's buckets; below vLLM's first bucket a few finer ones, for short prompts and fast decode steps.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                      1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                  30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
# (measured - estimated) / estimated: -0.5 is twice as fast as predicted, 1.0 twice as slow
_RELATIVE_ERROR_BUCKETS = (-0.9, -0.75, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
# what the engine's prefix cache found vs computed; the pool tiers are the worker's own report keys
_LOCAL_SOURCES = ("local_compute", "local_cache_hit")


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to the context length: 1, 2, 5, 10, 20, 50, ..."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


# vLLM's finish reasons: "abort" when the client left (or the engine aborted), "error" when the request failed
FINISH_REASONS = ("stop", "length", "abort", "error")


class _LoRAInfo:
    """vLLM's ``lora_requests_info``, from the workers' latest reports: one series whose labels name the
    adapters of the running and of the waiting requests across the cluster (comma-separated) and the workers'
    adapter slots (``--max-loras``: all of them share batches); its value is the scrape time, as vLLM sets it
    (the Gateway API inference extension reads a server's adapters from the newest series). Exported while
    a worker has LoRA slots. A collector rather than a labelled gauge, so the label sets of earlier scrapes
    do not stay behind as series of their own."""

    def __init__(self, model_name: str, loads: dict[str, WorkerLoad]) -> None:
        self.model_name, self.loads = model_name, loads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        usage = LoRAUsage.of(list(self.loads.values()))
        if not usage.slots:
            return
        family = GaugeMetricFamily("tidepool_lora_requests_info", "Running stats on LoRA requests",
                                   labels=["model_name", "max_lora", "running_lora_adapters",
                                           "waiting_lora_adapters"])
        family.add_metric([self.model_name, str(usage.slots), ",".join(usage.running), ",".join(usage.waiting)],
                          time.time())
        yield family


class Metrics:
    """The cluster's serving metrics; ``render()`` is the ``/metrics`` body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "unknown", max_model_len: int = 2048) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        m = ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        def count(name: str, doc: str) -> Counter:
            return Counter(name, doc, m, registry=r).labels(model_name)

        # ---- the cluster, from the workers' latest reports (computed at scrape time)
        self._loads: dict[str, WorkerLoad] = {}  # alive workers' latest reports
        self._seen: dict[str, dict[str, int]] = {}  # worker -> counter -> cumulative value already counted
        gauges = (
            ("tidepool_num_requests_running", "Requests in the workers' running batches (prefill or decode)",
             lambda: sum(ld.num_running for ld in self._loads.values())),
            ("tidepool_num_requests_waiting", "Requests in the workers' waiting queues",
             lambda: sum(ld.num_waiting for ld in self._loads.values())),
            ("tidepool_kv_cache_usage_perc", "Fraction of the cluster's KV blocks in use (0-1)",
             self._kv_usage),
        )
        for name, doc, read in gauges:
            Gauge(name, doc, m, registry=r).labels(model_name).set_function(read)
        self.prefix_cache_queries = count("tidepool_prefix_cache_queries",
                                          "Prefix cache queries, in prompt tokens looked up")
        self.prefix_cache_hits = count("tidepool_prefix_cache_hits",
                                       "Prefix cache hits, in prompt tokens found (pool placements included)")
        self.preemptions = count("tidepool_num_preemptions", "Requests preempted by the workers' schedulers")
        # speculative decoding (--num-speculative-tokens): acceptance rate = accepted / draft tokens
        self.spec_drafts = count("tidepool_spec_decode_num_drafts", "Draft verifications (a sequence's step with "
                                                                    "a draft)")
        self.spec_draft_tokens = count("tidepool_spec_decode_num_draft_tokens", "Draft tokens proposed and verified")
        self.spec_accepted_tokens = count("tidepool_spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_accepted_per_pos = Counter("tidepool_spec_decode_num_accepted_tokens_per_pos",
                                             "Drafts whose token at this position was accepted",
                                             [*m, "position"], registry=r)
        self.tokens_by_source = Counter(
            "tidepool_prompt_tokens_by_source",
            "Prompt tokens by where their KV came from: computed, local prefix cache, or a pool tier",
            [*m, "source"], registry=r)
        for source in (*_LOCAL_SOURCES, "pool_host", "pool_disk", "pool_redis", "pool_peer"):
            self.tokens_by_source.labels(model_name, source)
        r.register(_LoRAInfo(model_name, self._loads))

        # ---- requests, recorded by the dispatcher (services/request_metrics.py)
        self.prompt_tokens = count("tidepool_prompt_tokens",
                                   "Prompt tokens of requests whose prefill finished")
        self.generation_tokens = count("tidepool_generation_tokens", "Generated tokens")
        self.request_success = Counter("tidepool_request_success", "Finished requests, by finish reason",
                                       [*m, "finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.ttft = hist("tidepool_time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = hist("tidepool_inter_token_latency_seconds", "Time between two output tokens",
                        _TOKEN_GAP_BUCKETS)
        self.tpot = hist("tidepool_request_time_per_output_token_seconds",
                         "A request's mean time per output token after the first", _TOKEN_GAP_BUCKETS)
        self.e2e = hist("tidepool_e2e_request_latency_seconds", "Arrival to last token", _PHASE_BUCKETS)
        self.queue_time = hist("tidepool_request_queue_time_seconds",
                               "Arrival to routed (routing, and routing again after a dead worker)",
                               _PHASE_BUCKETS)
        self.prefill_time = hist("tidepool_request_prefill_time_seconds",
                                 "Routed to first token (prefill worker queue, prompt compute, KV handoff)",
                                 _PHASE_BUCKETS)
        self.decode_time = hist("tidepool_request_decode_time_seconds", "First token to last token",
                                _PHASE_BUCKETS)
        self.inference_time = hist("tidepool_request_inference_time_seconds", "Routed to last token",
                                   _PHASE_BUCKETS)
        lengths = token_buckets(max_model_len)
        self.request_prompt_tokens = hist("tidepool_request_prompt_tokens",
                                          "Prompt tokens of a finished request", lengths)
        self.request_generation_tokens = hist("tidepool_request_generation_tokens",
                                              "Generated tokens of a finished request", lengths)
        self.estimate_error = Histogram(
            "tidepool_router_estimate_relative_error",
            "The router's estimates against the measurement: (measured - estimated) / estimated; "
            "ttft from routing to first token, tbt against the request's time per output token",
            [*m, "estimate"], buckets=_RELATIVE_ERROR_BUCKETS, registry=r)

        # ---- the KV handoff, rejections, API answers
        self.transfer_bytes = Counter("tidepool_kv_transfer_bytes", "KV bytes moved from prefill to decode",
                                      [*m, "transport"], registry=r)
        self.transfer_seconds = Histogram("tidepool_kv_transfer_seconds", "Duration of one KV handoff",
                                          [*m, "transport"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.transfer_exposed = Histogram(
            "tidepool_kv_transfer_exposed_seconds",
            "Time a first token waited for its KV handoff after the prompt was computed (its part in the TTFT)",
            [*m, "transport"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.rejections = Counter("tidepool_rejections", "Requests the router rejected early, by reason",
                                  [*m, "reason"], registry=r)
        self.requests = Counter("tidepool_requests", "API requests answered, by route and status",
                                [*m, "api", "status"], registry=r)
        self.resumed = count("tidepool_requests_resumed",
                             "Requests continued on another pair after streaming tokens (their worker died, "
                             "stalled or was drained)")

        # ---- the worker set: added and drained (tidepool scale), replaced after dying (the supervisor)
        self.worker_changes = Counter("tidepool_worker_changes", "Workers added, drained or replaced, by role",
                                      [*m, "role", "change"], registry=r)
        self.load_reports = Counter("tidepool_load_reports", "Workers' load reports the router took, by how they "
                                    "came (read on the load board, or asked for)", [*m, "via"], registry=r)
        self.autoscaler_load = Gauge("tidepool_autoscaler_load",
                                     "A role's measured load, in workers kept fully busy (the autoscaler's)",
                                     [*m, "role"], registry=r)
        self.autoscaler_wanted = Gauge("tidepool_autoscaler_wanted_workers",
                                       "Workers of a role the autoscaler wants for its measured load",
                                       [*m, "role"], registry=r)

        # ---- one series per worker
        w = [*m, "worker", "role"]
        self.worker_gauges = {
            "waiting": Gauge("tidepool_worker_waiting_requests", "Requests in a worker's waiting queue", w,
                             registry=r),
            "running": Gauge("tidepool_worker_running_requests", "Requests in a worker's running batch", w,
                             registry=r),
            "used": Gauge("tidepool_worker_kv_blocks_used", "KV blocks in use on a worker", w, registry=r),
            "capacity": Gauge("tidepool_worker_kv_blocks_capacity", "KV blocks a worker has", w, registry=r),
            "usage": Gauge("tidepool_worker_kv_cache_usage_perc",
                           "Fraction of a worker's KV blocks in use (0-1)", w, registry=r),
            "leases": Gauge("tidepool_worker_waiting_leases",
                            "Decode reservations waiting for KV blocks on a worker", w, registry=r),
            "prefill_ratio": Gauge("tidepool_worker_prefill_time_ratio",
                                   "A worker's measured prefill steps over the router's shared model's prediction "
                                   "(1: as modelled; its prompts are priced by it)", w, registry=r),
            "decode_ratio": Gauge("tidepool_worker_decode_time_ratio",
                                  "A worker's measured decode steps over the router's shared model's prediction",
                                  w, registry=r),
        }
        # which worker preempts matters: on a decode worker each preemption computes a prompt again
        self.worker_preemptions = Counter("tidepool_worker_preemptions",
                                          "Requests preempted by a worker's scheduler", w, registry=r)

    # ---- worker reports ---------------------------------------------------------------------------------
    def set_worker_load(self, load: WorkerLoad, prefill_ratio: float = 1.0, decode_ratio: float = 1.0) -> None:
        """Take a worker's latest report, and its step times over the router's models (``router.worker_speed``);
        a dead worker's series are dropped."""
        labels = (self.model_name, load.worker_id, load.role)
        if not load.alive:
            self._loads.pop(load.worker_id, None)
            for series in (*self.worker_gauges.values(), self.worker_preemptions):
                with contextlib.suppress(KeyError):  # never reported while alive
                    series.remove(*labels)
            return
        self._loads[load.worker_id] = load
        used = load.total_blocks - load.free_blocks
        usage = used / load.total_blocks if load.total_blocks else 0.0
        values = {"waiting": load.num_waiting, "running": load.num_running, "used": used,
                  "capacity": load.total_blocks, "usage": usage, "leases": load.waiting_leases,
                  "prefill_ratio": prefill_ratio, "decode_ratio": decode_ratio}
        for key, value in values.items():
            self.worker_gauges[key].labels(*labels).set(value)
        self._count(load)

    def _count(self, load: WorkerLoad) -> None:
        """Turn a worker's cumulative counts into counter increments."""
        pooled = sum(load.pool_hit_tokens.values())
        totals = {
            "queries": (self.prefix_cache_queries, load.prefix_cache_queries),
            "hits": (self.prefix_cache_hits, load.prefix_cache_hits),
            "preemptions": (self.preemptions, load.num_preemptions),
            "worker_preemptions": (self.worker_preemptions.labels(self.model_name, load.worker_id, load.role),
                                   load.num_preemptions),
            "local_compute": (self.tokens_by_source.labels(self.model_name, "local_compute"),
                              load.prompt_tokens_computed),
            # pool placements become prefix-cache entries, so the engine's hits include them
            "local_cache_hit": (self.tokens_by_source.labels(self.model_name, "local_cache_hit"),
                                max(load.prefix_cache_hits - pooled, 0)),
            "spec_drafts": (self.spec_drafts, load.spec_drafts),
            "spec_draft_tokens": (self.spec_draft_tokens, load.spec_draft_tokens),
            "spec_accepted_tokens": (self.spec_accepted_tokens, load.spec_accepted_tokens),
        }
        for position, accepted in enumerate(load.spec_accepted_per_position):
            totals[f"spec_accepted_{position}"] = (
                self.spec_accepted_per_pos.labels(self.model_name, str(position)), accepted)
        for tier, tokens in load.pool_hit_tokens.items():
            totals[f"pool_{tier}"] = (self.tokens_by_source.labels(self.model_name, f"pool_{tier}"), tokens)
        # A worker's first report is the baseline: what came before it is its start-up profiling.
        first = load.worker_id not in self._seen
        seen = self._seen.setdefault(load.worker_id, {})
        for name, (counter, total) in totals.items():
            if not first and total > seen.get(name, 0):
                counter.inc(total - seen.get(name, 0))
            seen[name] = max(seen.get(name, 0), total)

    def _kv_usage(self) -> float:
        total = sum(ld.total_blocks for ld in self._loads.values())
        free = sum(ld.free_blocks for ld in self._loads.values())
        return (total - free) / total if total else 0.0

    # ---- transfers, rejections, API answers -----------------------------------------------------------
    def observe_transfer(self, transport: str, nbytes: int, seconds: float, exposed_s: float) -> None:
        self.transfer_bytes.labels(self.model_name, transport).inc(nbytes)
        self.transfer_seconds.labels(self.model_name, transport).observe(seconds)
        self.transfer_exposed.labels(self.model_name, transport).observe(exposed_s)

    def observe_embedding(self, prompt_tokens: int, seconds: float) -> None:
        """An embedding request answered: its prompt, and its time from arrival to its vector."""
        self.prompt_tokens.inc(prompt_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.e2e.observe(seconds)
        self.request_success.labels(self.model_name, "stop").inc()

    def inc_rejection(self, reason: str) -> None:
        self.rejections.labels(self.model_name, reason).inc()

    def count_load_report(self, asked: bool) -> None:
        self.load_reports.labels(self.model_name, "asked" if asked else "board").inc()

    def count_worker_change(self, role: str, change: str) -> None:
        """``change``: "added", "drained" or "replaced"."""
        self.worker_changes.labels(self.model_name, role, change).inc()

    def set_autoscaler_plan(self, role: str, load: float, wanted: int) -> None:
        self.autoscaler_load.labels(self.model_name, role).set(load)
        self.autoscaler_wanted.labels(self.model_name, role).set(wanted)

    def inc_request(self, api: str, status: str) -> None:
        self.requests.labels(self.model_name, api, status).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
