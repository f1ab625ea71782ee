"""How hot each prefix is: requests a second that carried it, decayed over a window.

Keyed like `router.inflight`: every ``stride``-th chained block hash of each routed prompt, so a prompt's
heat profile is one number per stride of its prefix, never rising with depth (every request that carried
block i carried the blocks before it). The hot-prefix replication of the `tidepool` policy reads it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


class PrefixHeat:
    def __init__(self, stride: int = 1, window_s: float = 30.0, max_keys: int = 200_000):
        self.stride, self.window_s, self.max_keys = max(stride, 1), window_s, max_keys
        self._heat: dict[int, tuple[float, float]] = {}  # key hash -> (decayed count, at)
        self._swept_at = -math.inf

    def _decayed(self, key: int, now: float) -> float:
        count, at = self._heat.get(key, (0.0, now))
        return count * math.exp(-(now - at) / self.window_s)

    def profile(self, hashes: Sequence[int], now: float) -> np.ndarray:
        """Requests a second (over the window) that carried each stride of ``hashes`` as a prefix."""
        keys = hashes[self.stride - 1::self.stride]
        out = np.zeros(len(keys))
        for i, h in enumerate(keys):
            if h not in self._heat:
                break  # chained: no later key was carried either
            out[i] = self._decayed(h, now) / self.window_s
        return out

    def add(self, hashes: Sequence[int], now: float) -> None:
        if len(self._heat) > self.max_keys and now - self._swept_at > self.window_s:
            # keep the map bounded: drop what has cooled down (at most once a window)
            self._heat = {h: v for h, v in self._heat.items() if self._decayed(h, now) >= 0.5}
            self._swept_at = now
        for h in hashes[self.stride - 1::self.stride]:
            self._heat[h] = (self._decayed(h, now) + 1.0, now)
