"""The autoscaler in the simulator: ``tidepool simulate --autoscale-decode 1:8`` replays a trace on a cluster
that grows and shrinks as the live one would, to size MIN:MAX and the utilization target before deploying.

Every simulated second it samples the decode workers' sequences into the conductor's ``Demand`` (which also
records the prompts routed and the requests rejected, as live), asks the same ``Planner`` for each role's
count and applies the same ``ScaleRule``. An added worker serves ``worker_start_s`` after it was asked for
(loading the model, profiling); a drained one takes no new request and leaves once its queue or batch is
empty. The run reports each role's worker-seconds (a worker counts from its start to its departure) and its
count over time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.autoscale_rules import AutoscaleConfig, ScaleRule
from router.planner import Planner

if TYPE_CHECKING:
    from router.simulator import Simulation

TICK_S = 1.0  # as the live autoscaler's


class SimAutoscaler:
    def __init__(self, sim: Simulation, config: AutoscaleConfig, worker_start_s: float) -> None:
        self.sim, self.config, self.worker_start_s = sim, config, worker_start_s
        self.planner = Planner(config.bounds, config.utilization, sim.cfg.slo, sim.profile.max_batch)
        self.rule = ScaleRule(config.scale_down_delay_s)
        self.starting = {role: 0 for role in ("prefill", "decode")}  # workers asked for, not serving yet
        self.worker_s = {role: 0.0 for role in ("prefill", "decode")}
        self.timeline: list[tuple[float, str, int]] = []  # (time, role, workers serving) at each change
        self.added = {role: 0 for role in ("prefill", "decode")}
        self.drained = {role: 0 for role in ("prefill", "decode")}
        self._last_tick: float | None = None

    def tick(self, now: float) -> None:
        """Count the worker-seconds since the last tick, sample the decode load, plan and act."""
        sim = self.sim
        if self._last_tick is None:  # the counts the run starts with
            for role in self.config.bounds:
                self.record(role, now)
        else:
            for role in self.worker_s:
                self.worker_s[role] += (now - self._last_tick) * (len(sim.workers(role)) + self.starting[role])
        self._last_tick = now
        sim.retire_drained()
        serving = [d for d in sim.decode.values() if d.id not in sim.draining]
        running = sum(d.batch for d in serving)
        sim.demand.add_decode_sample(now, running + sum(len(d.waiting) for d in serving),
                                     sum(d.ctx for d in serving) / running if running else 0.0)
        current = {role: self._current(role) for role in self.config.bounds}
        conductor = sim.conductor
        plan = self.planner.plan(sim.demand.window(now), conductor.estimator, current, sim.profile.decode_kv_tokens,
                                 conductor.prefill_speeds.factors(self._serving("prefill")),
                                 conductor.decode_speeds.factors([d.id for d in serving]))
        for role, planned in plan.items():
            if self.starting[role] or any(w in sim.draining for w in sim.workers(role)):
                continue  # a change under way: plan again once it is done
            change = self.rule.change(role, planned.wanted, current[role], now)
            for _ in range(change):
                self.starting[role] += 1
                self.added[role] += 1
                sim.start_worker(role, now + self.worker_start_s)
            if change < 0:
                sim.drain(min(self._serving(role), key=sim.busyness))
                self.drained[role] += 1

    def worker_ready(self, role: str, now: float) -> None:
        self.starting[role] -= 1
        self.record(role, now)

    def record(self, role: str, now: float) -> None:
        self.timeline.append((now, role, len(self._serving(role))))

    def _serving(self, role: str) -> list[str]:
        return [w for w in self.sim.workers(role) if w not in self.sim.draining]

    def _current(self, role: str) -> int:
        return len(self._serving(role)) + self.starting[role]

    def report(self) -> dict:
        counts = {role: [n for _, r, n in self.timeline if r == role] for role in self.config.bounds}
        return {
            "bounds": {role: list(b) for role, b in self.config.bounds.items()},
            "worker_seconds": {role: round(s, 1) for role, s in self.worker_s.items()},
            "added": {role: self.added[role] for role in self.config.bounds},
            "drained": {role: self.drained[role] for role in self.config.bounds},
            "most_workers": {role: max(n, default=0) for role, n in counts.items()},
            "timeline": [[round(t, 1), role, n] for t, role, n in self.timeline],
        }
