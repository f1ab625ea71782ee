"""Prompts the conductor routed whose prefill has not ended yet, as prefixes their worker will hold.

The prefix index only learns a prompt's blocks once they are computed, so a burst of requests sharing a
new prefix would each compute it again. The conductor remembers where it sent each prompt and when that
prefill should end: a request queued behind it on the same worker will find the prefix cached when it
runs (a worker's prefill queue is FIFO), and another worker can copy it from there once it is computed.

Only every ``stride``-th block hash is kept (block hashes are chained, so block i matching means blocks
0..i match): matches are rounded down to a stride, which keeps a 32k-token prompt to a few dozen entries
whatever the block size. An entry is dropped ``grace_s`` after its expected end: by then the index shows
the blocks, or the estimate was wrong and the entry would only mislead.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class InflightPrefixes:
    def __init__(self, stride: int = 1, grace_s: float = 10.0):
        self.stride, self.grace_s = max(stride, 1), grace_s
        self._ready: dict[int, dict[str, float]] = {}  # block hash -> {worker: when its prefill ends}
        self._expiry: list[tuple[float, int, str, tuple[int, ...], float]] = []  # heap
        self._seq = 0

    def __len__(self) -> int:
        return len(self._ready)

    def add(self, worker: str, hashes: Sequence[int], ready_at: float) -> None:
        """``worker`` will hold ``hashes`` (a prompt's chained block hashes) from ``ready_at`` on."""
        keys = tuple(hashes[self.stride - 1::self.stride])
        for h in keys:
            at = self._ready.setdefault(h, {})
            at[worker] = min(at.get(worker, ready_at), ready_at)  # the earliest prefill computes it
        self._seq += 1
        heapq.heappush(self._expiry, (ready_at + self.grace_s, self._seq, worker, keys, ready_at))

    def expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, _, worker, keys, ready_at = heapq.heappop(self._expiry)
            for h in keys:
                at = self._ready.get(h)
                if at is not None and at.get(worker) == ready_at:  # not a later entry's (earlier) time
                    del at[worker]
                    if not at:
                        del self._ready[h]

    def longest_prefix(self, hashes: Sequence[int]) -> dict[str, tuple[int, float]]:
        """{worker: (leading blocks of ``hashes`` it will hold, when)} over the prompts in flight."""
        out: dict[str, tuple[int, float]] = {}
        for i in range(self.stride - 1, len(hashes), self.stride):
            at = self._ready.get(hashes[i])
            if not at:
                break  # chained: nobody holds a later block either
            for worker, t in at.items():
                out[worker] = (i + 1, t)
        return out
