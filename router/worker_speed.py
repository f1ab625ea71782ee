"""How fast each worker runs against the shared cost model: a factor per worker its estimates are scaled by.

The estimator keeps one prefill model and one decode model, refit from every worker's measured steps, as
if all workers were alike. A cluster is often not: prefill workers on two GPU generations, a worker whose
GPU is shared with another process, a CPU worker beside GPU ones. For each worker this keeps its
measured step seconds against what the shared model predicted for the same steps, both summed with
exponential decay, and their ratio is its factor (2: its steps take twice what the model predicts). In
a fleet of equal workers the factors stay near 1 (the shared model fits them all); in a mixed one they
settle at each worker's ratio to the fleet's mix, so a queue or a prompt on a slow worker is priced as
slow. A decoding step where drafts were accepted (speculative decoding) counts per token: its time over the
tokens each sequence gained, so the TBT expected on a drafting worker is its time per token. Until a worker
has ``warmup`` steps, and for a worker never measured, the factor is 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FACTOR_BOUNDS = (0.05, 20.0)  # a worker 20x off the model is more likely measured wrong than that slow


class WorkerSpeeds:
    def __init__(self, decay: float = 0.95, warmup: int = 4):
        self.decay, self.warmup = decay, warmup
        self._sums: dict[str, list[float]] = {}  # worker -> [decayed measured s, decayed predicted s, steps]
        # factors() of the last worker list asked for, until a step is observed: the router asks on every
        # decision, with the same list (``LoadTable.p_ids``) until the workers change
        self._version = 0
        self._cached: tuple[Sequence[str], int, np.ndarray] | None = None

    def observe(self, worker: str, predicted_s: float, measured_s: float) -> None:
        """One measured step of ``worker`` and what the shared model predicted for it (before refitting
        on it); steps the model prices at nothing tell nothing."""
        if not predicted_s > 0 or not measured_s >= 0:
            return
        sums = self._sums.setdefault(worker, [0.0, 0.0, 0])
        sums[0] = self.decay * sums[0] + measured_s
        sums[1] = self.decay * sums[1] + predicted_s
        sums[2] += 1
        self._version += 1

    def factor(self, worker: str) -> float:
        sums = self._sums.get(worker)
        if sums is None or sums[2] < self.warmup:
            return 1.0
        return min(max(sums[0] / sums[1], FACTOR_BOUNDS[0]), FACTOR_BOUNDS[1])

    def factors(self, workers: Sequence[str]) -> np.ndarray:
        """``factor`` of each of ``workers``; the array is shared with the next call for the same list object
        until a step is observed: read it, never write it."""
        cached = self._cached
        if cached is not None and cached[0] is workers and cached[1] == self._version:
            return cached[2]
        out = np.array([self.factor(w) for w in workers], dtype=float)
        self._cached = (workers, self._version, out)
        return out

    def forget(self, worker: str) -> None:
        """A worker that left (its id may come back on other hardware)."""
        self._sums.pop(worker, None)
        self._version += 1

    def to_dict(self) -> dict[str, float]:
        """Every measured worker's factor (``GET /v1/cluster/profile``, the metrics)."""
        return {w: self.factor(w) for w in self._sums}
