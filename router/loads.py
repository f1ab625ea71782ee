"""Worker load reports and the table the conductor keeps of them.

`LoadTable` holds the latest reports as one numpy matrix and refreshes only the rows whose `WorkerLoad`
object changed since the last decision (workers report every ~100 ms; requests arrive far more often),
so a decision over 1,000 workers is a handful of vector operations. On top of the reports it keeps what
the conductor routed since each worker's last report, so a burst between two reports does not pile onto
one worker; a report stamped after a decision is assumed to include it.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from router.estimator import prefill_features

PREFILL_ROLES = ("prefill", "colocated")
DECODE_ROLES = ("decode", "colocated")


@dataclass
class WorkerLoad:
    """One worker's load report.

    queued_prefills: (new_tokens, cached_tokens) of each prefill not yet finished on the worker (a
    partly done one may count its remaining new tokens). num_running: prefills in progress on a prefill
    worker, decoding sequences on a decode worker. free/total_blocks: KV blocks (prefix cache on a
    prefill worker), with blocks reserved for requests already routed there counted as used.
    waiting_leases / waiting_lease_blocks: decode reservations waiting for room on the worker, and the
    blocks they will take as soon as they are free: the router counts those as used too (``row``).
    updated_at: when the report was taken, on the router's clock; reported queues drain from then on.
    report_seq: the worker numbers its reports as it takes them, so that of two reports (one asked for, one
    read on the load board, or two asks crossing) the router keeps the later; 0: not numbered (the simulator's).
    queued_features: optional sums of `estimator.prefill_features` over queued_prefills, for callers that
    keep them incrementally (the simulator); None means "sum queued_prefills".
    steps / last_step_s: the worker's step count and its latest step's duration.
    prefill_steps / decode_steps: the latest engine steps, measured (`step_samples`): each step that
    computed prompt tokens as (step number, its chunks' summed `prefill_features`, seconds), each
    decode-only step as (step number, batch, context tokens, seconds). The dispatcher feeds the ones
    numbered above the previous report's ``steps`` to the conductor's online refits.
    A report is a snapshot: make a new object for each new report and never mutate one already passed
    to `Conductor.route` (the conductor spots new reports by object identity).
    """

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    alive: bool = True
    queued_prefills: Sequence[tuple[int, int]] = ()
    num_running: int = 0
    running_context_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 16
    updated_at: float = 0.0
    queued_features: tuple[float, float, float] | None = None
    report_seq: int = 0
    steps: int = 0  # engine steps run so far, and the time of the latest (for the online TBT refit)
    last_step_s: float = 0.0
    prefill_steps: tuple[tuple[int, float, float, float, float], ...] = ()  # step, pairs, new, chunks, s
    decode_steps: tuple[tuple[int, int, int, float], ...] = ()  # step, batch, context tokens, s
    # steps that only decoded, some sequences verifying drafts: step, sequences, context tokens, s, the tokens
    # they produced (their time per token, against a plain step's, is the worker's decode speed)
    drafted_steps: tuple[tuple[int, int, int, float, int], ...] = ()
    waiting_leases: int = 0
    waiting_lease_blocks: int = 0
    # For the metrics only (the router ignores them): the engine's waiting queue, and cumulative counts
    # since the worker started: prompt tokens looked up in / found in the prefix cache (the hits include
    # blocks placed from the pool), computed, placed from each pool tier ("host", "disk", "redis"); preemptions;
    # speculative decoding's counts.
    num_waiting: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_computed: int = 0
    pool_hit_tokens: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    # speculative decoding: verification chunks, draft tokens proposed, accepted, and accepted per position
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # LoRA adapters: the worker's adapter slots (--max-loras), and the adapters of the running and the waiting
    # requests (vLLM's lora_requests_info)
    max_loras: int = 0
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()

    def row(self) -> tuple:
        """The report as one LoadTable row (see the column constants below)."""
        if self.queued_features is not None:
            pairs, new, count = self.queued_features
        else:  # summed in plain Python: queues are short
            pairs = new = count = 0.0
            for n, c in self.queued_prefills:
                p, t, one = prefill_features(n, c)
                pairs, new, count = pairs + p, new + t, count + one
        return (self.alive, self.alive and self.role in PREFILL_ROLES, self.alive and self.role in DECODE_ROLES,
                pairs, new, count, len(self.queued_prefills), self.num_running, self.running_context_tokens,
                self.free_blocks - self.waiting_lease_blocks, self.total_blocks, max(self.block_size, 1),
                self.updated_at)


@dataclass(frozen=True)
class LoRAUsage:
    """The cluster's LoRA adapters from its workers' reports: the most adapter slots a worker has, and the
    adapters of the requests running and waiting anywhere (sorted)."""

    slots: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]

    @classmethod
    def of(cls, loads: Iterable[WorkerLoad]) -> LoRAUsage:
        loads = [load for load in loads if load.alive]
        return cls(max((load.max_loras for load in loads), default=0),
                   tuple(sorted({name for load in loads for name in load.running_loras})),
                   tuple(sorted({name for load in loads for name in load.waiting_loras})))


def step_samples(steps) -> tuple[tuple, tuple, tuple]:
    """A worker's latest engine steps as a load report's (prefill_steps, decode_steps, drafted_steps).

    ``steps``: (step number, composition, seconds), the composition being the engine's StepComposition. A
    step with prompt chunks is a prefill row, its decode rows counted as one-token chunks on their context;
    a decode-only step is a decode row. A step whose only chunks are drafts being verified is a prefill
    row too (its chunks cost what such chunks cost) and a drafted row: its decoding sequences, their
    context, and the tokens they produced.
    """
    prefill, decode, drafted = [], [], []
    for number, comp, seconds in steps:
        if not comp.prefill_chunks:
            decode.append((number, comp.decode_seqs, comp.decode_context_tokens, seconds))
            continue
        if comp.drafted_seqs == len(comp.prefill_chunks):
            drafted.append((number, comp.decode_seqs + comp.drafted_seqs,
                            comp.decode_context_tokens + comp.drafted_context_tokens, seconds, comp.decoded_tokens))
        # a decode row is prefill_features(1, context - 1) = (context, 1, 1)
        pairs, new, count = comp.decode_context_tokens, comp.decode_seqs, comp.decode_seqs
        for _, n, before in comp.prefill_chunks:
            p, t, one = prefill_features(n, before)
            pairs, new, count = pairs + p, new + t, count + one
        prefill.append((number, float(pairs), float(new), float(count), seconds))
    return tuple(prefill), tuple(decode), tuple(drafted)


# LoadTable.data columns
ALIVE, IS_P, IS_D, QF, NQUEUED, RUNNING, CTX, FREE, TOTAL, BS, UPDATED = 0, 1, 2, slice(3, 6), 6, 7, 8, 9, 10, 11, 12
# LoadTable.pending columns: routed prefills' summed features and count; routed decode blocks, seqs, ctx
P_QF, P_PREFILLS, P_BLOCKS, P_SEQS, P_CTX = slice(0, 3), 3, 4, 5, 6


class LoadTable:
    """The latest report of every worker (``data``) and the work routed since (``pending``), one row a
    worker in the order of the ``loads`` list last passed."""

    def __init__(self) -> None:
        self.loads: list[WorkerLoad] = []
        self.ids: list[str] = []
        self.row: dict[str, int] = {}
        self.data = np.zeros((0, 13))
        self.pending = np.zeros((0, 7))
        # worker -> (decided_at, vector, the request's LoRA adapter or None)
        self._entries: dict[str, deque[tuple[float, np.ndarray, str | None]]] = {}
        self._order: deque[tuple[float, str]] = deque()  # every entry in decision order, for the TTL
        self._derive()

    def update(self, loads: Sequence[WorkerLoad]) -> None:
        n = len(loads)
        changed = [] if n != len(self.loads) else list(
            itertools.compress(range(n), map(operator.is_not, loads, self.loads)))
        if n != len(self.loads) or any(loads[i].worker_id != self.ids[i] for i in changed):
            self._rebuild(loads)
        elif changed:
            roles = self.data[changed, IS_P:IS_D + 1].copy()
            self.data[changed] = [loads[i].row() for i in changed]
            self.loads = list(loads)
            for i in changed:
                self._settle(self.ids[i])
            if not np.array_equal(roles, self.data[changed, IS_P:IS_D + 1]):
                self._derive()

    def add_pending(self, worker_id: str, decided_at: float, vector: np.ndarray, lora: str | None = None) -> None:
        r = self.row.get(worker_id)
        if r is None:
            return
        self._entries.setdefault(worker_id, deque()).append((decided_at, vector, lora))
        self._order.append((decided_at, worker_id))
        self.pending[r] += vector

    def routed_loras(self, worker_id: str) -> set[str]:
        """The LoRA adapters of the requests routed to the worker since its last report."""
        return {lora for _, _, lora in self._entries.get(worker_id, ()) if lora is not None}

    def expire(self, before: float) -> None:
        """Forget routed work older than ``before`` whatever the reports say (a worker that stopped
        reporting must not look busy forever)."""
        while self._order and self._order[0][0] < before:
            t, wid = self._order.popleft()
            self._settle(wid, t)

    def _settle(self, worker_id: str, older_than: float = -np.inf) -> None:
        """Drop routed entries the worker's report already covers (or older than the TTL cut)."""
        q = self._entries.get(worker_id)
        if not q:
            return
        r = self.row[worker_id]
        cut = max(self.data[r, UPDATED], older_than)
        while q and q[0][0] <= cut:
            self.pending[r] -= q.popleft()[1]
        if not q:
            self.pending[r] = 0.0  # no float residue
            del self._entries[worker_id]

    def _rebuild(self, loads: Sequence[WorkerLoad]) -> None:
        self.loads, self.ids = list(loads), [w.worker_id for w in loads]
        self.row = {w: i for i, w in enumerate(self.ids)}
        self.data = np.array([w.row() for w in loads], dtype=float).reshape(len(loads), 13)
        self.pending = np.zeros((len(loads), 7))
        for wid in list(self._entries):
            if wid not in self.row:
                del self._entries[wid]
                continue
            self._settle(wid)
            for _, v, _ in self._entries.get(wid, ()):
                self.pending[self.row[wid]] += v
        self._derive()

    def _derive(self) -> None:
        self.alive = self.data[:, ALIVE] > 0
        self.p_rows, self.d_rows = np.flatnonzero(self.data[:, IS_P]), np.flatnonzero(self.data[:, IS_D])
        self.p_ids = [self.ids[i] for i in self.p_rows]
        self.d_ids = [self.ids[i] for i in self.d_rows]
        self.p_pos = np.full(len(self.ids), -1)
        self.p_pos[self.p_rows] = np.arange(len(self.p_rows))
        self.d_pos = np.full(len(self.ids), -1)
        self.d_pos[self.d_rows] = np.arange(len(self.d_rows))
        self.p_sel, self.d_sel = _selector(self.p_rows), _selector(self.d_rows)


def _selector(rows: np.ndarray) -> slice | np.ndarray:
    """A slice when the rows are contiguous (callers usually list prefill then decode workers): indexing
    with it is a view, not a copy of the matrix."""
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows
