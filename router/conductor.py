"""The conductor: picks the prefill and decode worker for each request, or rejects it early.

`route` reads the latest worker load reports and the prefix index (the KV pool's in-memory mirror, or
the simulator's own index), adds what it routed since each report (so a burst between two reports does
not pile onto one worker) and the prompts whose prefill is still under way (`router.inflight`), and asks
the configured policy. Measured prefill steps, decode steps and KV transfers refit the estimator online
and are kept (`router.measurements`) for `tidepool profile`; each worker's steps against the refit model
give its speed factor (`router.worker_speed`), so a slower worker's queue and prompts are priced as slower.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from router.estimator import Estimator, prefill_features
from router.heat import PrefixHeat
from router.inflight import InflightPrefixes
from router.loads import LoadTable, WorkerLoad
from router.measurements import Measurements
from router.planner import Demand
from router.policies import make_policy
from router.view import SLO, ClusterView, Decision, Reject, RouteRequest, reusable_tokens
from router.worker_speed import WorkerSpeeds

__all__ = ["SLO", "Conductor", "Decision", "PrefixIndex", "Reject", "RouteRequest", "WorkerLoad"]

_INFLIGHT_STRIDE_TOKENS = 512  # granularity of in-flight prefix matches
_MIN_COPY_WAIT_S = 0.5


def is_pool_holder(holder: str) -> bool:
    """Index holders that are the shared pool tier, not a worker: "@..." (such as
    kvstore.names.POOL_HOLDER), or plain "redis" / "pool"."""
    return holder.startswith("@") or holder in ("redis", "pool")


class PrefixIndex(Protocol):
    def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]: ...


class Conductor:
    def __init__(self, policy_name: str, estimator: Estimator, slo: SLO,
                 *, block_size: int = 16, seed: int = 0, pending_ttl_s: float = 30.0, copy_inflight: bool = False,
                 demand: Demand | None = None, learn_worker_speeds: bool = True, **policy_options):
        self.policy_name, self.estimator, self.slo, self.block_size = policy_name, estimator, slo, block_size
        # The live cluster's choice (any policy copies a prefix another worker is computing); the simulator
        # leaves it off to compare the policies as published.
        self.copy_inflight = copy_inflight
        self.policy = make_policy(policy_name, seed=seed, **policy_options)
        self.demand = demand  # the load an autoscaler plans from (router.planner): recorded only when asked
        self.pending_ttl_s = pending_ttl_s
        self.mean_output_tokens = 256.0  # running mean of max_tokens: the expected decode length
        self.measurements = Measurements()
        # Each worker's step times against the shared models (router.worker_speed); off: every worker is
        # priced as the shared model says (the simulator's comparison).
        self.learn_worker_speeds = learn_worker_speeds
        self.prefill_speeds, self.decode_speeds = WorkerSpeeds(), WorkerSpeeds()
        self._table = LoadTable()
        self._stride = stride = max(1, _INFLIGHT_STRIDE_TOKENS // block_size)
        self._inflight = InflightPrefixes(stride=stride)
        # prefix heat only for a policy that reads it (tidepool's replication): it costs every decision
        self._heat = PrefixHeat(stride=stride) if getattr(self.policy, "reads_heat", False) else None

    def route(self, req: RouteRequest, loads: Sequence[WorkerLoad], index: PrefixIndex,
              now: float | None = None) -> Decision | Reject:
        now = time.time() if now is None else now
        table = self._take_loads(loads, now)
        if len(table.p_rows) == 0 or len(table.d_rows) == 0:
            return Reject("no live prefill or decode worker", 1.0)
        hashes = req.block_hashes
        matches = index.longest_prefix(hashes) if hashes else {}
        pool = max((n for k, n in matches.items() if is_pool_holder(k)), default=0)
        inflight = self._inflight.longest_prefix(hashes) if hashes else {}
        heat = None if self._heat is None else self._heat.profile(hashes, now)
        view = ClusterView(req, self.estimator, self.slo, self.block_size, now, self.mean_output_tokens, table,
                           matches, pool, self.prefill_speeds.factors(table.p_ids),
                           self.decode_speeds.factors(table.d_ids), inflight, heat, self._stride)
        out = self.policy(view)
        if self.copy_inflight and isinstance(out, Decision) and out.fetch_from is None:
            out = self._copy_inflight(out, view)
        self.mean_output_tokens += 0.01 * (req.max_tokens - self.mean_output_tokens)
        if self._heat is not None:
            self._heat.add(hashes, now)
        if isinstance(out, Reject) and self.demand is not None:
            self._record_rejection(out, view, matches)
        if isinstance(out, Decision):
            self._remember(out, req, view, now)
            if hashes:
                self._inflight.add(out.prefill, hashes, now + out.est_ttft_s - out.est_handoff_s)
        return out

    def route_prompt(self, req: RouteRequest, loads: Sequence[WorkerLoad], index: PrefixIndex,
                     now: float | None = None) -> Decision | Reject:
        """Route a prompt that is computed and nothing after it (an embedding request): to the prefill (or
        colocated) worker that would end it first, after the prefix it holds; its decode is itself. Rejected
        for TTFT when none would within the TTFT SLO, by a policy that rejects early (a baseline never does)."""
        now = time.time() if now is None else now
        table = self._take_loads(loads, now)
        if len(table.p_rows) == 0:
            return Reject("no live prefill worker", 1.0)
        matches = index.longest_prefix(req.block_hashes) if req.block_hashes else {}
        view = ClusterView(req, self.estimator, self.slo, self.block_size, now, self.mean_output_tokens, table,
                           matches, 0, self.prefill_speeds.factors(table.p_ids),
                           self.decode_speeds.factors(table.d_ids))
        done_s = view.p_queue_s + view.prefill_s(view.p_local)
        p = int(np.argmin(done_s))
        if getattr(self.policy, "rejects_early", False) and done_s[p] > self.slo.ttft_s:
            return Reject("ttft", float(done_s[p] - self.slo.ttft_s))
        worker, cached = str(view.p_ids[p]), float(view.p_local[p])
        overhead = self.estimator.request_overhead_s
        new = req.prompt_len - float(view.cached_tokens(cached))
        self._table.add_pending(worker, now, np.array([*prefill_features(new, req.prompt_len - new), 1.0, 0.0,
                                                       0.0, 0.0]))
        if self.demand is not None:
            self.demand.add_prompt(now, new, req.prompt_len - new)
        if req.block_hashes:
            self._inflight.add(worker, req.block_hashes, now + float(done_s[p]))
        return Decision(worker, worker, None, 0, int(cached), float(done_s[p]) + overhead, 0.0,
                        est_overhead_s=overhead)

    def _take_loads(self, loads: Sequence[WorkerLoad], now: float) -> LoadTable:
        """The load table with ``loads`` taken in, and what was routed too long ago forgotten."""
        self._table.update(loads)
        self._table.expire(now - self.pending_ttl_s)
        self._inflight.expire(now)
        return self._table

    def _record_rejection(self, out: Reject, view: ClusterView, matches: dict[str, int]) -> None:
        """Tell the demand a request was rejected, unless no number of workers would have taken it: it misses
        the SLO alone on the fastest idle worker (its prompt, after the longest prefix any holder has, computes
        longer than the TTFT SLO; one decode step of it alone is longer than the TBT SLO). A prompt rejected
        for TTFT also counts as prompt work: the load to plan for is what arrives, not only what the workers
        took."""
        req, now = view.req, view.now
        if out.reason == "ttft":
            cached = min(max(matches.values(), default=0) * self.block_size,
                         reusable_tokens(req.prompt_len, self.block_size))
            new = req.prompt_len - cached
            if float(self.estimator.prefill.predict(new, cached)) * view.p_speed.min() >= self.slo.ttft_s:
                return
            self.demand.add_prompt(now, new, cached)
        elif out.reason == "tbt" and (float(self.estimator.decode.predict(1, req.prompt_len)) * view.d_speed.min()
                                      >= self.slo.tbt_s):
            return
        self.demand.add_rejection(now, out.reason)

    def copy_wait_s(self, dec: Decision) -> float:
        """How long a prefix copy from ``dec.fetch_from`` may wait for blocks still being computed there:
        past the time to compute them on the chosen worker, waiting cannot win."""
        compute_s = float(self.estimator.prefill.predict(dec.cached_blocks * self.block_size, 0))
        return max(_MIN_COPY_WAIT_S, compute_s * self.prefill_speeds.factor(dec.prefill))

    def observe_prefill(self, worker: str, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A measured prefill of one prompt alone."""
        self.observe_prefill_step(worker, prefill_features(new_tokens, cached_tokens), seconds)

    def observe_prefill_step(self, worker: str, features, seconds: float) -> None:
        """A measured engine step of ``worker`` that computed prompt tokens: ``features`` sums its chunks'
        `prefill_features` (a step's time is the sum of its chunks' costs). It refits the shared model, and
        first sets the worker's speed against that model's prediction."""
        if self.learn_worker_speeds:
            self.prefill_speeds.observe(worker, float(self.estimator.queue_time(np.asarray(features, float))),
                                        seconds)
        self.estimator.observe_prefill_step(features, seconds)
        self.measurements.add_prefill_step(features, seconds)

    def observe_ttft(self, dec: Decision, measured_s: float) -> None:
        """A routed request's measured time to first token (from its routing), against ``dec``'s estimate."""
        self.estimator.observe_ttft(measured_s, dec.est_ttft_s - dec.est_overhead_s)

    def observe_decode_step(self, worker: str, batch_size: int, context_tokens: int, seconds: float) -> None:
        """A measured decode-only engine step of ``worker``, as observe_prefill_step's for the decode model."""
        if self.learn_worker_speeds:
            self.decode_speeds.observe(worker, float(self.estimator.decode.predict(batch_size, context_tokens)),
                                       seconds)
        self.estimator.observe_decode_step(batch_size, context_tokens, seconds)
        self.measurements.add_decode_step(batch_size, context_tokens, seconds)

    def observe_drafted_step(self, worker: str, batch_size: int, context_tokens: int, seconds: float,
                             tokens: int) -> None:
        """A measured step of ``worker`` whose sequences all decoded, some verifying drafts (speculative
        decoding), producing ``tokens`` in all: the worker's decode speed is its time per token against a
        plain step's, so accepted drafts price its TBT lower. Not a plain step: the model is not refit."""
        if self.learn_worker_speeds and tokens > 0:
            self.decode_speeds.observe(worker, float(self.estimator.decode.predict(batch_size, context_tokens)),
                                       seconds * batch_size / tokens)

    def forget_worker(self, worker: str) -> None:
        """A worker that left: its speeds go (a replacement may take its id on other hardware)."""
        self.prefill_speeds.forget(worker)
        self.decode_speeds.forget(worker)

    def observe_transfer(self, src: str, dst: str, nbytes: int, seconds: float) -> None:
        """A measured KV transfer from ``src`` to ``dst`` (the prefill -> decode hand-off, or a fetch)."""
        if nbytes <= 0 or seconds <= 0:
            return  # nothing moved: no bandwidth to learn
        self.estimator.transfer.observe(src, dst, nbytes, seconds, "pool" if src == "pool" else "peer")
        self.measurements.add_transfer(src, dst, nbytes, seconds)

    @staticmethod
    def _copy_inflight(dec: Decision, view: ClusterView) -> Decision:
        """Whatever the policy: when another worker is computing (or has just computed, before the pool
        lists it) more of this prompt's prefix than the chosen worker has or the pool can give it, copy it
        from there once computed instead of computing it again, if that gives the earlier first token."""
        p = list(view.p_ids).index(dec.prefill)
        blocks = float(view.p_future[p])
        if blocks <= max(dec.cached_blocks, view.pool_blocks):
            return dec
        ttft = max(float(view.p_queue_s[p]), float(view.future_fetch_s()[p])) + float(view.future_prefill_s()[p])
        if ttft >= dec.est_ttft_s - dec.est_handoff_s - dec.est_overhead_s:
            return dec
        return view.decision(p, list(view.d_ids).index(dec.decode), view.future_source(p),
                             blocks - view.p_local[p], blocks, ttft, dec.est_tbt_s, dec.replicate)

    def _remember(self, dec: Decision, req: RouteRequest, view: ClusterView, now: float) -> None:
        """Count this request on its workers until their reports include it."""
        cached = float(view.cached_tokens(dec.cached_blocks))
        new = req.prompt_len - cached
        if self.demand is not None:
            self.demand.add_prompt(now, new, cached)
        blocks = float(view.decode_need()[self._table.d_pos[self._table.row[dec.decode]]])
        prefill = np.array([*prefill_features(new, cached), 1.0, 0.0, 0.0, 0.0])  # features, 1 prefill
        decode = np.array([0.0, 0.0, 0.0, 0.0, blocks, 1.0, req.prompt_len])
        if dec.prefill == dec.decode:
            self._table.add_pending(dec.prefill, now, prefill + decode, req.lora)
        else:
            self._table.add_pending(dec.prefill, now, prefill)
            self._table.add_pending(dec.decode, now, decode, req.lora)
