"""How many workers of each role the measured load needs: the autoscaler's arithmetic, in the manner of
Dynamo's SLA planner, priced by the conductor's own estimator (profiled at start, refit from measured steps).

Prefill: the prompt work routed over the last window, each prompt priced by the prefill model on the tokens
it computed (its cached prefix excluded), is so many worker-seconds per second: that many workers fully
busy. Past the target utilization a worker's queue, and with it the TTFT, grows, so the count is that
load over the target. Decode: the sequences running or waiting on decode workers, averaged over the
window, over what one worker holds at once within the TBT SLO (the decode model's step at that batch and the
mean context) and within its KV cache, at the target utilization. Colocated workers do both: their shares
add up. Requests the router rejected in the window for a role's SLO (TTFT: prefill; TBT or decode room:
decode) ask for one worker more than runs, whatever the load says: the estimate missed something. In a mixed
fleet each worker's speed against the shared models (`router.worker_speed`) sets what it carries: the
prompt work is over the mean prefill capacity of the role's workers, the sequences over the mean each holds
at its own step time; a worker to add is taken to be like the average of those serving.

A count grows as soon as the load asks for it and shrinks only when the workers left would run below
``SHRINK_MARGIN`` of the target, so a load near a boundary does not add and drain a worker in turn (the
autoscaler also waits before it drains).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.estimator import DecodeModel, Estimator, prefill_features
from router.view import SLO

SHRINK_MARGIN = 0.8
# The router's reject reasons (``router.policies``) that more workers of a kind would have avoided; a request
# larger than any worker's KV cache, or a cluster without a live worker, is not one.
_REJECTED_KIND = {"ttft": "prefill", "tbt": "decode", "decode": "decode"}


@dataclass(frozen=True)
class LoadWindow:
    """What the cluster did over the last ``seconds``."""

    seconds: float
    prompt_features: tuple[float, float, float]  # summed `prefill_features` of the prompts routed
    decode_sequences: float  # sequences running or waiting on the decode workers, on average
    context_tokens: float  # tokens a running sequence holds, on average
    rejected: frozenset[str] = frozenset()  # "prefill" / "decode": requests rejected for that side's SLO


class Demand:
    """The load of the last ``window_s``: prompts routed and requests rejected (the conductor records them),
    and the decode workers' sequences (sampled from their load reports). Times are the conductor's clock."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._prompts: deque[tuple[float, tuple[float, float, float]]] = deque()
        self._prompt_sum = np.zeros(3)
        self._rejections: deque[tuple[float, str]] = deque()
        self._decode: deque[tuple[float, float, float]] = deque()  # (time, sequences, context tokens)

    def add_prompt(self, now: float, new_tokens: float, cached_tokens: float) -> None:
        features = prefill_features(new_tokens, cached_tokens)
        self._prompts.append((now, features))
        self._prompt_sum += features

    def add_rejection(self, now: float, reason: str) -> None:
        if reason in _REJECTED_KIND:
            self._rejections.append((now, _REJECTED_KIND[reason]))

    def add_decode_sample(self, now: float, sequences: float, context_tokens: float) -> None:
        self._decode.append((now, sequences, context_tokens))

    def window(self, now: float) -> LoadWindow:
        """The load over the last ``window_s``. Prompts are spread over the whole window even just after the
        start: a first burst is not read as a rate it has not kept up."""
        start = now - self.window_s
        while self._prompts and self._prompts[0][0] < start:
            self._prompt_sum -= self._prompts.popleft()[1]
        if not self._prompts:
            self._prompt_sum[:] = 0.0  # no float drift left over from the subtractions
        for records in (self._rejections, self._decode):
            while records and records[0][0] < start:
                records.popleft()
        sequences = sum(s for _, s, _ in self._decode)
        held = sum(s * c for _, s, c in self._decode)
        return LoadWindow(
            seconds=self.window_s,
            prompt_features=tuple(map(float, self._prompt_sum)),
            decode_sequences=sequences / len(self._decode) if self._decode else 0.0,
            context_tokens=held / sequences if sequences else 0.0,
            rejected=frozenset(kind for _, kind in self._rejections),
        )


def sequences_per_worker(decode: DecodeModel, tbt_slo_s: float, context_tokens: float, max_num_seqs: int,
                         kv_tokens: int, speed: float = 1.0) -> int:
    """Sequences one decode worker runs at once: within the TBT SLO (a step of batch B holds B times the mean
    context; ``speed``: the worker's steps over the model's), its KV cache and ``max_num_seqs``; at least 1
    (a step slower than the SLO alone is not helped by more workers)."""
    per_seq_s = (decode.per_seq_s + decode.per_context_token_s * context_tokens) * speed
    by_tbt = (tbt_slo_s - decode.fixed_s * speed) / per_seq_s if per_seq_s > 0 else math.inf
    by_kv = kv_tokens / context_tokens if context_tokens > 0 else math.inf
    return max(1, math.floor(min(max_num_seqs, by_tbt, by_kv)))


@dataclass(frozen=True)
class RoleLoad:
    """One role's measured load, in workers kept fully busy, and the count the planner wants for it."""

    load: float
    wanted: int


class Planner:
    """Worker counts per role from a `LoadWindow`, within each role's (min, max)."""

    def __init__(self, bounds: dict[str, tuple[int, int]], utilization: float, slo: SLO,
                 max_num_seqs: int) -> None:
        self.bounds = bounds
        self.utilization = utilization
        self.slo = slo
        self.max_num_seqs = max_num_seqs

    def plan(self, window: LoadWindow, estimator: Estimator, current: dict[str, int], kv_tokens: int,
             prefill_speeds: Sequence[float] = (), decode_speeds: Sequence[float] = ()) -> dict[str, RoleLoad]:
        """``current``: workers serving (or being replaced) per role; ``kv_tokens``: one decode worker's KV
        cache in tokens; ``prefill_speeds`` / ``decode_speeds``: the speed factors of the workers serving
        prompts / decoding (none: all as the models say)."""
        capacity = float(np.mean([1.0 / f for f in prefill_speeds])) if len(prefill_speeds) else 1.0
        prefill = float(np.dot(window.prompt_features, estimator.prefill.coef)) / window.seconds / capacity
        per_worker = float(np.mean([sequences_per_worker(estimator.decode, self.slo.tbt_s, window.context_tokens,
                                                         self.max_num_seqs, kv_tokens, f)
                                    for f in (decode_speeds if len(decode_speeds) else (1.0,))]))
        decode = window.decode_sequences / per_worker
        loads = {"prefill": prefill, "decode": decode, "colocated": prefill + decode}
        out = {}
        for role, (low, high) in self.bounds.items():
            now = current.get(role, 0)
            wanted = self.workers_for(loads[role], self.utilization)
            if wanted < now:  # shrink only well below the target (see the module doc)
                wanted = min(now, self.workers_for(loads[role], self.utilization * SHRINK_MARGIN))
            if window.rejected & ({"prefill", "decode"} if role == "colocated" else {role}):
                wanted = max(wanted, now + 1)
            out[role] = RoleLoad(loads[role], min(max(wanted, low), high))
        return out

    @staticmethod
    def workers_for(load: float, utilization: float) -> int:
        """Workers that carry ``load`` (workers fully busy) at ``utilization`` each."""
        return math.ceil(load / utilization - 1e-9)
