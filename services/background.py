"""Work started off a request's path (pool writes, releases, hot-prefix copies): each task is kept
referenced until it ends (asyncio holds only weak references), its failure logged, and its owner can
wait for or cancel what is still running."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable

log = logging.getLogger(__name__)


def cancel_requested() -> bool:
    """Whether the running task was asked to stop, even if a library swallowed the ``CancelledError``: redis-py
    can, when the cancel lands while it hands a connection back to its pool. A loop that must end when cancelled
    checks this each turn."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None]) -> None:
    """Cancel ``tasks`` (None: never started) and wait until each has ended, whatever it ended with: a loop
    that owns them is stopping."""
    started = [task for task in tasks if task is not None]
    for task in started:
        task.cancel()
    for task in started:
        try:
            await task
        except asyncio.CancelledError:
            if cancel_requested():  # the caller was cancelled too, not only the task it waited for
                raise
        except Exception:  # whatever it ended with: the loop that owns it is stopping
            pass


class BackgroundTasks:
    def __init__(self, what: str) -> None:
        self.what = what  # names the work in the log line of a failure
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, work: Coroutine) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self) -> None:
        """Until every task started so far, and any they started, has ended."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed: %r", self.what, task.exception())
