"""The workers each running attempt still uses, so that a draining worker is stopped once nothing runs on it.

An attempt uses its prefill worker until the KV handoff (the prefill's result is in) and its decode worker
until its stream ends; a colocated attempt uses its one worker throughout.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


class InFlight:
    """Attempts per worker, counted while they run (`WorkerUse.during`)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def count(self, worker_id: str) -> int:
        return self._counts[worker_id]

    def use(self, *worker_ids: str) -> WorkerUse:
        return WorkerUse(self._counts, set(worker_ids))


class WorkerUse:
    """One attempt's use of its workers: counted from its first step to its end, or to ``release``."""

    def __init__(self, counts: Counter[str], worker_ids: set[str]) -> None:
        self._counts = counts
        self._worker_ids = worker_ids
        self._held: set[str] = set()

    def release(self, worker_id: str) -> None:
        """The attempt is done with ``worker_id`` (a prefill worker at the handoff)."""
        if worker_id in self._held:
            self._held.discard(worker_id)
            self._counts[worker_id] -= 1
            if not self._counts[worker_id]:
                del self._counts[worker_id]

    async def during(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """``stream``'s items, the workers counted while it runs. Counted from the first step, not from
        creation: a stream closed before it started never ran on them."""
        self._held = set(self._worker_ids)
        for worker_id in self._held:
            self._counts[worker_id] += 1
        try:
            async for item in stream:
                yield item
        finally:
            for worker_id in list(self._held):
                self.release(worker_id)
            await stream.aclose()
