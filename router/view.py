"""A routing decision's inputs and outputs, and `ClusterView`: one request against the load table,
as arrays over the prefill (p_*) and decode (d_*) workers that every policy reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from router.estimator import Estimator
from router.loads import (
    BS,
    CTX,
    FREE,
    NQUEUED,
    P_BLOCKS,
    P_CTX,
    P_PREFILLS,
    P_QF,
    P_SEQS,
    QF,
    RUNNING,
    TOTAL,
    UPDATED,
    LoadTable,
)


@dataclass
class RouteRequest:
    request_id: str
    prompt_len: int
    block_hashes: Sequence[int]  # chained hashes of the prompt's full blocks (kvstore.hashing)
    max_tokens: int
    max_kv_tokens: int | None = None  # an attention window (sinks + window) bounds the KV it holds at once
    lora: str | None = None  # its LoRA adapter (None: the base model)

    @property
    def kv_tokens(self) -> int:
        """Tokens of prompt KV the decode side holds at once, and so the hand-off moves (a window's worth)."""
        return min(self.prompt_len, self.max_kv_tokens or self.prompt_len)


@dataclass(frozen=True)
class Replication:
    """Copy the first ``blocks`` blocks of a hot prompt's prefix from ``src`` to the idle prefill worker
    ``dst`` ahead of the requests that will want them there."""

    src: str
    dst: str
    blocks: int


@dataclass
class Decision:
    """Where a request goes, and what the router expects of it (so measured times can be set against
    the estimates: est_ttft_s against the TTFT, est_transfer_s against the KV hand-off's duration)."""

    prefill: str
    decode: str
    fetch_from: str | None  # "pool", a worker id, or None (use the local prefix / recompute)
    fetch_blocks: int  # blocks to copy from fetch_from before prefill
    cached_blocks: int  # prefix blocks the prefill worker will have (local + fetched)
    est_ttft_s: float  # queue + fetch + prefill + the exposed part of the KV hand-off
    est_tbt_s: float
    est_transfer_s: float = 0.0  # the whole prompt KV over the prefill -> decode link (0: colocated)
    est_handoff_s: float = 0.0  # the part of that transfer the first token waits for (in est_ttft_s)
    est_overhead_s: float = 0.0  # the measured per-request overhead included in est_ttft_s
    replicate: tuple[Replication, ...] = ()  # copies of a hot prefix to start now (policy option)


@dataclass
class Reject:
    reason: str
    retry_after_s: float


@dataclass(frozen=True)
class SLO:
    """Service-level objectives; no defaults here: the live cluster (``ClusterConfig``) and the simulator
    (``SimConfig``, the paper's A800 setting) each keep their own."""

    ttft_s: float
    tbt_s: float


class _Sources(NamedTuple):
    """The best and runner-up holders of a prefix (the runner-up serves the best one itself): names,
    the best's prefill position (-1: not a prefill worker, or none), their blocks and delays."""

    src0: str | None
    src1: str | None
    best: int
    n0: float
    n1: float
    delay0: float
    delay1: float


_QUEUED_FOR_EVER_S = 1e9


def reusable_tokens(prompt_len: int, block_size: int) -> int:
    """The most prompt tokens a cached prefix saves: whole blocks, never the one holding the last token, which is
    always computed for its logits (``BlockManager.max_prefix_blocks``, less a quantized cache's residual)."""
    return max(prompt_len - 1, 0) // block_size * block_size


class ClusterView:
    """Everything a policy needs for one request, as arrays over prefill (p_*) and decode (d_*) workers.

    ``matches`` are the prefix index's holders ({holder: leading blocks}); ``inflight`` the prompts routed
    and not yet computed ({prefill worker: (leading blocks, when its prefill should end)}, see
    `router.inflight`); ``heat`` how hot each stride of the prompt's prefix is (`router.heat`)."""

    def __init__(self, req: RouteRequest, est: Estimator, slo: SLO, block_size: int, now: float,
                 mean_output_tokens: float, table: LoadTable, matches: dict[str, int], pool_blocks: int,
                 p_speed: np.ndarray, d_speed: np.ndarray, inflight: dict[str, tuple[int, float]] | None = None,
                 heat: np.ndarray | None = None, heat_stride: int = 1):
        self.req, self.est, self.slo, self.block_size, self.now = req, est, slo, block_size, now
        # each worker's step times against the shared models (router.worker_speed); 1: as modelled
        self.p_speed, self.d_speed = p_speed, d_speed
        # requests a second that carried each heat_stride blocks of this prompt's prefix (router.heat)
        self.heat, self.heat_stride = np.zeros(0) if heat is None else heat, heat_stride
        self.mean_output_tokens = mean_output_tokens
        self._cap = reusable_tokens(req.prompt_len, block_size)
        self._table = table
        p, d = table.p_sel, table.d_sel
        self.p_ids, self.d_ids = table.p_ids, table.d_ids
        rp, rd, pp, pd = table.data[p], table.data[d], table.pending[p], table.pending[d]
        # Reported queues drain in real time until the next report; what was routed since is added.
        drained = np.maximum(est.queue_time(rp[:, QF]) * self.p_speed - (now - rp[:, UPDATED]), 0.0)
        self.p_queue_s = drained + est.queue_time(pp[:, P_QF]) * self.p_speed
        self.p_nqueued = rp[:, NQUEUED] + pp[:, P_PREFILLS]
        self.p_cache_free = rp[:, FREE]
        self.p_to_d = table.d_pos[p]  # colocated prefill workers decode the request themselves
        self.d_free, self.d_total, self.d_bs = rd[:, FREE] - pd[:, P_BLOCKS], rd[:, TOTAL], rd[:, BS]
        self.d_running, self.d_ctx = rd[:, RUNNING] + pd[:, P_SEQS], rd[:, CTX] + pd[:, P_CTX]
        self.d_lora_blocked = None if req.lora is None else self._lora_blocked(req.lora, table)
        if self.d_lora_blocked is not None:
            self.d_free = np.where(self.d_lora_blocked, -np.inf, self.d_free)
            # a colocated worker decodes what it prefills: one whose slots are all busy looks queued for ever
            # (a finite "ever", so the projections over its queue stay numbers)
            held = (self.p_to_d >= 0) & self.d_lora_blocked[np.maximum(self.p_to_d, 0)]
            self.p_queue_s = np.where(held, _QUEUED_FOR_EVER_S, self.p_queue_s)

        # Prefix matches: local ones per prefill worker, and the two longest alive holders as fetch
        # sources (the runner-up serves the best holder itself).
        self.p_local, self._peers = self._sources({w: (n, 0.0) for w, n in matches.items()})
        self.p_peer = self._per_source(self._peers, float)
        self.pool_blocks = pool_blocks
        self._local_tokens = self.cached_tokens(self.p_local)
        # In flight: a request queued behind one on the same worker finds its blocks cached when it runs
        # (queues are FIFO); another worker can copy them once that prefill ends (p_future_delay from now).
        ready = {w: (n, max(t - now, 0.0)) for w, (n, t) in (inflight or {}).items()}
        self.p_inflight, self._future = self._sources(ready)
        self.p_future = self._per_source(self._future, float)
        self.p_future_delay = np.full(len(self.p_ids), self._future.delay0)
        if self._future.best >= 0:
            self.p_future_delay[self._future.best] = self._future.delay1
        self._tbt_now = self._need = None

    @staticmethod
    def _lora_blocked(lora: str, table: LoadTable) -> np.ndarray | None:
        """The decode workers whose adapter slots all hold other adapters of running requests (those routed there
        since its report included): one would hold this request, its KV received, until a slot frees
        (``engine/scheduler.py``). When some worker runs the
        adapter already or has a slot to give it, those look full and slow to every policy (free blocks -inf,
        TBT inf; the least-loaded pick sorts them last), as the Gateway API inference extension's LoRA
        affinity filters them; None when none or all are."""
        blocked = []
        for r in table.d_rows:
            load = table.loads[r]
            running = {*load.running_loras, *table.routed_loras(load.worker_id)}
            blocked.append(lora not in running and len(running) >= load.max_loras)
        blocked = np.array(blocked, dtype=bool)
        return blocked if blocked.any() and not blocked.all() else None

    def _sources(self, held: dict[str, tuple[int, float]]) -> tuple[np.ndarray, _Sources]:
        """(blocks each prefill worker holds itself, the best and runner-up holders) over alive holders
        of ``held`` ({holder: (blocks, seconds until it holds them)}): longest first, then soonest."""
        table = self._table
        own = np.zeros(len(self.p_ids))
        holders = []
        for wid, (n, delay) in held.items():
            r = table.row.get(wid)
            if r is None or not table.alive[r]:
                continue
            holders.append((n, -delay, wid))
            if table.p_pos[r] >= 0:
                own[table.p_pos[r]] = n
        holders.sort(reverse=True)
        (n0, t0, src0), (n1, t1, src1) = (holders + [(0, 0.0, None), (0, 0.0, None)])[:2]
        best = -1 if src0 is None else int(table.p_pos[table.row[src0]])
        return own, _Sources(src0, src1, best, n0, n1, -t0, -t1)

    def _per_source(self, s: _Sources, value) -> np.ndarray:
        """value(blocks of each worker's source): the best holder's everywhere but at the best holder
        itself, which gets the runner-up's; two evaluations, not one per worker."""
        out = np.full(len(self.p_ids), float(value(s.n0)))
        if s.best >= 0:
            out[s.best] = float(value(s.n1))
        return out

    # ----- per-request quantities, vectorized over workers -----
    def cached_tokens(self, blocks):
        """Tokens a prefix of ``blocks`` saves (``reusable_tokens``)."""
        return np.minimum(blocks * self.block_size, self._cap)

    def prefill_s(self, blocks):
        """Seconds each prefill worker computes the prompt in after a prefix of ``blocks`` (one count, or
        one per worker)."""
        cached = self.cached_tokens(blocks)
        return self.est.prefill.predict(self.req.prompt_len - cached, cached) * self.p_speed

    def _prefill_one_s(self, blocks: float) -> float:
        cached = min(blocks * self.block_size, self._cap)  # plain floats: one source
        return self.est.prefill.predict(self.req.prompt_len - cached, cached)

    def peer_prefill_s(self):
        """prefill_s(p_peer), the model evaluated once per source rather than once per worker."""
        return self._per_source(self._peers, self._prefill_one_s) * self.p_speed

    def future_prefill_s(self):
        """prefill_s(p_future), likewise."""
        return self._per_source(self._future, self._prefill_one_s) * self.p_speed

    def peer_source(self, p: int) -> str | None:
        """The worker p would fetch a longer prefix from."""
        return self._peers.src1 if p == self._peers.best else self._peers.src0

    def future_source(self, p: int) -> str | None:
        """The worker whose prefill in flight p would copy the prefix from."""
        return self._future.src1 if p == self._future.best else self._future.src0

    def fetch_s(self, src_blocks, kind: str):
        """Seconds to copy the blocks a source has beyond each worker's local prefix (0 if none)."""
        return self._copy_s(src_blocks, kind, self._peers)

    def future_fetch_s(self):
        """Seconds until the in-flight prefix held elsewhere could be on each worker: its prefill ends,
        then the copy."""
        return self.p_future_delay + self._copy_s(self.p_future, "peer", self._future)

    def _copy_s(self, src_blocks, kind: str, sources: _Sources):
        extra = self.cached_tokens(src_blocks) - self._local_tokens
        kv = self.est.kv_bytes_per_token
        t = self.est.transfer.defaults[kind].time(extra * kv)
        pairs = self.est.transfer.pairs
        src0, src1, best = sources.src0, sources.src1, sources.best
        if kind == "peer" and pairs:  # measured links, only from the (at most two) sources in play
            for src in {src0, src1} & pairs.keys():
                for dst, link in pairs[src].items():
                    r = self._table.row.get(dst)
                    i = -1 if r is None else self._table.p_pos[r]
                    if i >= 0 and (src1 if i == best else src0) == src:
                        t[i] = link.time(extra[i] * kv)
        return np.where(extra > 0, t, 0.0)

    def decode_need(self):
        """KV blocks the request needs on each decode worker (prompt + max output, or its window's worth)."""
        if self._need is None:
            tokens = self.req.prompt_len + self.req.max_tokens
            self._need = np.ceil(min(tokens, self.req.max_kv_tokens or tokens) / self.d_bs)
        return self._need

    def tbt_now(self):
        """Step time on each decode worker with this request added to today's batch."""
        if self._tbt_now is None:
            self._tbt_now = self.est.decode.predict(self.d_running + 1, self.d_ctx + self.req.prompt_len) * self.d_speed
            if self.d_lora_blocked is not None:
                self._tbt_now = np.where(self.d_lora_blocked, np.inf, self._tbt_now)
        return self._tbt_now

    def decode_for(self, p: int, d: int) -> int:
        """The decode worker that pairs with prefill worker p: itself when colocated."""
        return int(self.p_to_d[p]) if self.p_to_d[p] >= 0 else d

    def decision(self, p: int, d: int, fetch_from: str | None, fetch_blocks: float, cached_blocks: float,
                 ttft_s: float, tbt_s: float | None = None, replicate: Sequence[Replication] = ()) -> Decision:
        """The Decision for prefill worker p and decode worker d; ``ttft_s`` is the time until the prefill
        ends, to which the exposed part of the KV hand-off to d is added."""
        d = self.decode_for(p, d)
        tbt = float(self.tbt_now()[d]) if tbt_s is None else tbt_s
        transfer = exposed = 0.0
        if self.p_ids[p] != self.d_ids[d]:
            transfer, exposed = self.est.handoff_s(self.req.kv_tokens, self._prefill_one_s(float(cached_blocks)),
                                                   self.p_ids[p], self.d_ids[d])
        overhead = self.est.request_overhead_s
        return Decision(self.p_ids[p], self.d_ids[d], fetch_from, int(fetch_blocks), int(cached_blocks),
                        float(ttft_s) + exposed + overhead, tbt, transfer, exposed, overhead, tuple(replicate))
