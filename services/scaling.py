"""Resizing a running cluster: a worker added to a role, or drained and stopped, so that an operator can shift
capacity between prefill and decode as the workload's prompt and answer lengths change.

Adding starts a worker as ``tidepool serve`` starts one (``WorkerLauncher.launch``: placed by Ray, engine,
profile, pool link, KV endpoint) under its role's next free id (``prefill-2``); the router takes it from
its first load report. Draining takes a worker out of routing at once, waits until no attempt uses it (an
attempt holds its prefill worker until the KV handoff, its decode worker until its last token:
``services/in_flight.py``) or until the timeout, then forgets it, stops its actor (its CPU or GPU goes back
to Ray) and drops its blocks from the pool's index. A request still on it at the timeout resumes on another
pair with the tokens it has streamed, as after a crash, so its client sees no gap. The last live worker of a
role is never drained.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from router.loads import DECODE_ROLES, PREFILL_ROLES
from services.dispatcher import Dispatcher
from services.errors import ScalingConflictError, UnknownWorkerError
from services.messages import Role
from services.placement import WorkerLauncher
from services.worker_client import WorkerClient

log = logging.getLogger(__name__)

_POLL_S = 0.05


@dataclass(frozen=True)
class DrainResult:
    worker_id: str
    role: str
    waited_s: float  # from the drain's start until nothing ran on the worker, or until the timeout
    resumed: int  # attempts still on the worker at the timeout, resumed elsewhere


class Scaler:
    def __init__(self, dispatcher: Dispatcher, launcher: WorkerLauncher, colocated: bool) -> None:
        """``colocated``: the cluster serves colocated workers (else prefill/decode pairs)."""
        self.dispatcher = dispatcher
        self.launcher = launcher
        self.roles = (Role.COLOCATED,) if colocated else (Role.PREFILL, Role.DECODE)
        self._issued: set[str] = set(dispatcher.workers)  # every slot's first id: the start's, and added

    async def add(self, role: Role) -> WorkerClient:
        """Start a worker of ``role`` and route to it once it serves (PlacementError when Ray cannot place it
        within the placement timeout)."""
        if role not in self.roles:
            raise ScalingConflictError(f"this cluster serves {' and '.join(map(str, self.roles))} workers, not "
                                       f"{role} ones")
        worker_id = self._next_id(role)
        worker = await self.launcher.launch(worker_id, role)
        self.dispatcher.add_worker(worker)
        await self.dispatcher.refresh_loads()  # routed to at once, not at the next refresh
        self.dispatcher.metrics.count_worker_change(str(role), "added")
        log.warning("worker %s added", worker_id)
        return worker

    def _next_id(self, role: Role) -> str:
        """The role's next slot, never one used before in this cluster: a stopped actor's Ray name may still
        be taken for a moment, and metrics and logs keep one id for one worker. (A replacement, decode-0.1,
        keeps its slot.)"""
        slots = [int(worker_id.removeprefix(f"{role}-")) for worker_id in self._issued
                 if worker_id.startswith(f"{role}-")]
        worker_id = f"{role}-{max(slots, default=-1) + 1}"
        self._issued.add(worker_id)
        return worker_id

    async def drain(self, worker_id: str, timeout_s: float) -> DrainResult:
        """Stop routing to ``worker_id``, wait up to ``timeout_s`` for what runs on it, then stop it."""
        worker = self.dispatcher.workers.get(worker_id)
        if worker is None:
            raise UnknownWorkerError(worker_id)
        if worker_id in self.dispatcher.draining:
            raise ScalingConflictError(f"worker {worker_id!r} is already draining")
        serves = [kind for kind, roles in (("prefill", PREFILL_ROLES), ("decode", DECODE_ROLES))
                  if worker.role in roles]
        missing = [kind for kind in self.dispatcher.missing_roles(self.dispatcher.draining | {worker_id})
                   if kind in serves]
        if missing:
            raise ScalingConflictError(f"worker {worker_id!r} is the last live {' and '.join(missing)} worker: add "
                                       "another before draining it")
        self.dispatcher.draining.add(worker_id)
        start = time.monotonic()
        try:
            log.warning("draining worker %s", worker_id)
            while self.dispatcher.in_flight.count(worker_id) and time.monotonic() - start < timeout_s:
                await asyncio.sleep(_POLL_S)
            waited_s, resumed = time.monotonic() - start, self.dispatcher.in_flight.count(worker_id)
            self.dispatcher.remove_worker(worker_id)
            self.launcher.stop(worker)
            await asyncio.to_thread(self.dispatcher.index.pool.retire, worker_id)  # its blocks, out of the index
        finally:
            self.dispatcher.draining.discard(worker_id)
        self.dispatcher.metrics.count_worker_change(str(worker.role), "drained")
        log.warning("worker %s drained after %.1f s (%d attempts resumed elsewhere)", worker_id, waited_s, resumed)
        return DrainResult(worker_id, str(worker.role), waited_s, resumed)
