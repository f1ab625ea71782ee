"""What the conductor measured while serving: the latest prefill steps, decode steps and KV transfers.

They refit the estimator as they arrive (`Conductor.observe_*`); this record keeps them so that
`tidepool profile` can read them back (``GET /v1/cluster/profile``) and fit a profile the simulator runs.
Bounded: the latest ``limit`` samples of each kind.
"""

from __future__ import annotations

from collections import deque


class Measurements:
    def __init__(self, limit: int = 4096):
        self.prefill_steps: deque[tuple[float, float, float, float]] = deque(maxlen=limit)  # pairs, new, chunks, s
        self.decode_steps: deque[tuple[int, int, float]] = deque(maxlen=limit)  # batch, context tokens, s
        self.transfers: deque[tuple[str, str, int, float]] = deque(maxlen=limit)  # src, dst, bytes, s

    def add_prefill_step(self, features, seconds: float) -> None:
        pairs, new, chunks = (float(x) for x in features)
        self.prefill_steps.append((pairs, new, chunks, float(seconds)))

    def add_decode_step(self, batch_size: int, context_tokens: int, seconds: float) -> None:
        self.decode_steps.append((int(batch_size), int(context_tokens), float(seconds)))

    def add_transfer(self, src: str, dst: str, nbytes: int, seconds: float) -> None:
        self.transfers.append((src, dst, int(nbytes), float(seconds)))

    def to_dict(self) -> dict:
        """JSON-ready lists: prefill_steps [attention pairs, new tokens, chunks, seconds], decode_steps
        [batch, context tokens, seconds], transfers [src, dst, bytes, seconds]."""
        return {"prefill_steps": [list(r) for r in self.prefill_steps],
                "decode_steps": [list(r) for r in self.decode_steps],
                "transfers": [list(r) for r in self.transfers]}
