"""Keeps every worker slot filled: a worker that died, or reports itself unhealthy, is replaced.

The dispatcher's load refresh finds dead workers (their actor is gone) and unhealthy ones (an engine step
failed: the report says ``alive=False``). For each, the supervisor kills the old actor (an unhealthy one
still holds its CPU or GPU), starts a new one with the same role and settings under a new id
(``decode-0`` → ``decode-0.1`` → ``decode-0.2``), and swaps it into the dispatcher's worker set once it
serves. Until then the dead worker stays listed as dead, and ``/health`` reports degraded while its role
has no live worker. Requests that were on the dead worker resume elsewhere on their own (the dispatcher),
or wait for the replacement; its leases died with it.

The new actor re-runs everything a worker does at start: engine, profile, pool link, KV endpoint (a new
port, which prefill workers learn from the new ``WorkerInfo``). A failed start is retried with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable

import ray

from services.background import cancel_and_wait
from services.dispatcher import Dispatcher
from services.messages import Role
from services.worker_client import WorkerClient

log = logging.getLogger(__name__)

_POLL_S = 0.1
_RETRY_S = (1.0, 2.0, 5.0, 10.0)  # backoff between failed starts of a replacement


def next_incarnation(worker_id: str) -> str:
    """``decode-0`` → ``decode-0.1``; ``decode-0.1`` → ``decode-0.2``."""
    slot, _, count = worker_id.partition(".")
    return f"{slot}.{int(count or 0) + 1}"


class Supervisor:
    def __init__(self, dispatcher: Dispatcher, launch: Callable[[str, Role], Awaitable[WorkerClient]]) -> None:
        self.dispatcher = dispatcher
        self.launch = launch  # WorkerLauncher.launch
        self._replacing: dict[str, asyncio.Task] = {}  # dead worker id -> the task replacing it
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        """Stop watching and abandon replacements under way (their actors are the launcher's to kill)."""
        await cancel_and_wait([self._task, *self._replacing.values()])
        self._replacing.clear()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_POLL_S)
            for worker in self.dispatcher.dead_workers():
                # A draining worker that dies is not replaced: it was on its way out.
                if worker.worker_id not in self._replacing and worker.worker_id not in self.dispatcher.draining:
                    self._replacing[worker.worker_id] = asyncio.create_task(self._replace(worker))

    async def _replace(self, dead: WorkerClient) -> None:
        try:
            log.warning("replacing worker %s", dead.worker_id)
            if ray.is_initialized():  # (after ray.shutdown, a Ray call would start a new local Ray)
                with contextlib.suppress(Exception):  # a dead actor is gone already; an unhealthy one ends here
                    ray.kill(dead.actor, no_restart=True)
            worker_id = next_incarnation(dead.worker_id)
            for attempt in itertools.count():
                try:
                    new = await self.launch(worker_id, dead.role)
                    break
                except Exception:
                    log.exception("replacement %s of %s failed to start", worker_id, dead.worker_id)
                    await asyncio.sleep(_RETRY_S[min(attempt, len(_RETRY_S) - 1)])
                    worker_id = next_incarnation(worker_id)
            self.dispatcher.add_worker(new)
            self.dispatcher.remove_worker(dead.worker_id)
            await self.dispatcher.refresh_loads()  # routed to at once, not at the next refresh
            self.dispatcher.metrics.count_worker_change(str(dead.role), "replaced")
            log.warning("worker %s replaced by %s", dead.worker_id, new.worker_id)
        finally:
            self._replacing.pop(dead.worker_id, None)
