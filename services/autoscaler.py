"""The autoscaler: keeps each role's worker count where the measured load needs it, within the bounds the
operator set (``--autoscale-decode 1:4``), through the Scaler's own add and drain (``services/scaling.py``).

Every second it samples the decode workers' sequences into the conductor's `Demand` (which also records the
prompts routed and the requests rejected), asks the planner (``router/planner.py``) for each role's count over
the last window, and acts on it. A role below its count gets the missing workers at once and changes nothing
more until they serve (a start that fails is tried again a window later). A role above its count has one
worker drained once the count has stayed below for ``scale_down_delay_s``: the least busy, then the newest;
the delay then starts again. A role with a dead worker waits for the supervisor's replacement before it
changes, unless workers are not replaced, in which case the dead one no longer counts. A worker added asks
Ray for its resources as the first ones did, so on a Ray cluster with an autoscaler of its own (``ray up``)
a worker that fits no running node has a node launched for it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.autoscale_rules import AutoscaleConfig, ScaleRule
from router.loads import DECODE_ROLES, PREFILL_ROLES
from router.planner import Planner, RoleLoad
from services.background import cancel_and_wait
from services.cluster_status import drain_order, worker_rows
from services.dispatcher import Dispatcher
from services.errors import ScalingConflictError, UnknownWorkerError
from services.messages import Role
from services.scaling import Scaler

log = logging.getLogger(__name__)

TICK_S = 1.0


class Autoscaler:
    def __init__(self, dispatcher: Dispatcher, scaler: Scaler, config: AutoscaleConfig, max_num_seqs: int,
                 replacing: bool) -> None:
        """``replacing``: the supervisor replaces dead workers (the cluster's ``replace_workers``)."""
        if dispatcher.conductor.demand is None:
            raise ValueError("the conductor records no demand to plan from")
        self.dispatcher = dispatcher
        self.scaler = scaler
        self.config = config
        self.replacing = replacing
        self.planner = Planner(config.bounds, config.utilization, dispatcher.conductor.slo, max_num_seqs)
        self.plan: dict[str, RoleLoad] = {}  # the latest, for the status
        self.rule = ScaleRule(config.scale_down_delay_s)
        self._changes: dict[str, asyncio.Task] = {}  # role -> its add or drain under way
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop planning and abandon the changes under way (a worker being started is the launcher's to kill;
        a drain cut short leaves its worker serving)."""
        await cancel_and_wait([self._task, *self._changes.values()])
        self._changes.clear()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.step(time.time())  # the conductor's clock, which stamps the demand it records
            except Exception:  # the autoscaler must outlive any one bad report
                log.exception("autoscaler step failed")

    def step(self, now: float) -> None:
        """Sample the decode load, plan, and start the changes the plan asks for."""
        demand = self.dispatcher.conductor.demand
        decoding = [ld for ld in self.dispatcher.loads.values() if ld.alive and ld.role in DECODE_ROLES]
        if not decoding:
            return  # nothing measured to plan from: the dispatcher answers for a cluster without workers
        running = sum(ld.num_running for ld in decoding)
        held = sum(ld.running_context_tokens for ld in decoding)
        demand.add_decode_sample(now, sum(ld.num_running + ld.num_waiting + ld.waiting_leases for ld in decoding),
                                 held / running if running else 0.0)
        rows = [r for r in worker_rows(self.dispatcher)
                if not r["draining"] and (r["alive"] or self.replacing)]  # a dead one counts while it is replaced
        kept = {role: [r for r in rows if r["role"] == role] for role in self.config.bounds}
        current = {role: len(workers) for role, workers in kept.items()}
        kv_tokens = min(ld.total_blocks * ld.block_size for ld in decoding)
        conductor = self.dispatcher.conductor
        serving = [ld for ld in self.dispatcher.loads.values() if ld.alive]
        self.plan = self.planner.plan(
            demand.window(now), conductor.estimator, current, kv_tokens,
            conductor.prefill_speeds.factors([ld.worker_id for ld in serving if ld.role in PREFILL_ROLES]),
            conductor.decode_speeds.factors([ld.worker_id for ld in decoding]))
        for role, planned in self.plan.items():
            self.dispatcher.metrics.set_autoscaler_plan(role, planned.load, planned.wanted)
            change = self._changes.get(role)
            if change is not None and not change.done():
                continue
            if not all(r["alive"] for r in kept[role]):
                continue  # a replacement is on its way: plan again once it serves
            change = self.rule.change(role, planned.wanted, current[role], now)
            if change > 0:
                self._changes[role] = asyncio.create_task(self._add(Role(role), change))
            elif change < 0:
                self._changes[role] = asyncio.create_task(self._drain(min(kept[role], key=drain_order)["id"]))

    async def _add(self, role: Role, count: int) -> None:
        log.warning("autoscaler: adding %d %s worker(s)", count, role)
        results = await asyncio.gather(*(self.scaler.add(role) for _ in range(count)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.warning("autoscaler: %d of %d %s worker(s) did not start (%s); trying again in %g s",
                        len(failed), count, role, failed[0], self.config.window_s)
            await asyncio.sleep(self.config.window_s)  # the role changes nothing more meanwhile

    async def _drain(self, worker_id: str) -> None:
        log.warning("autoscaler: draining %s", worker_id)
        try:
            await self.scaler.drain(worker_id, self.config.drain_timeout_s)
        except (ScalingConflictError, UnknownWorkerError) as exc:  # an operator drained it, or another, first
            log.warning("autoscaler: %s", exc)
        except Exception:  # the role plans again next tick
            log.exception("autoscaler: draining %s failed", worker_id)

    def status(self) -> dict:
        """Each role's bounds, measured load and wanted count (``GET /v1/cluster/status``)."""
        return {role: {"min": low, "max": high,
                       "load": round(self.plan[role].load, 3) if role in self.plan else None,
                       "wanted": self.plan[role].wanted if role in self.plan else None}
                for role, (low, high) in self.config.bounds.items()}
