"""A routing decision's inputs and outputs, and `ClusterView`: one request against the load table,
as arrays over the prefill (p_*) and decode (d_*) workers that every policy reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass
class Decision:
    prefill: str
    decode: str
    fetch_from: str | None  # "pool", a worker id, or None (use the local prefix / recompute)
    fetch_blocks: int  # blocks to copy from fetch_from before prefill
    cached_blocks: int  # prefix blocks the prefill worker will have (local + fetched)
    est_ttft_s: float
    est_tbt_s: float


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


class ClusterView:
    """Everything a policy needs for one request, as arrays over prefill (p_*) and decode (d_*) workers."""

    def __init__(self, req: RouteRequest, est: Estimator, slo: SLO, block_size: int, now: float,
                 mean_output_tokens: float, table: LoadTable, matches: dict[str, int], pool_blocks: int):
        self.req, self.est, self.slo, self.block_size = req, est, slo, block_size
        self.mean_output_tokens = mean_output_tokens
        self._cap = max(req.prompt_len - 1, 0)
        p, d = table.p_sel, table.d_sel
        self.p_ids, self.d_ids = table.p_ids, table.d_ids
        rp, rd, pp, pd = table.data[p], table.data[d], table.pending[p], table.pending[d]
        # Reported queues drain in real time until the next report; what was routed since is added.
        drained = np.maximum(est.queue_time(rp[:, QF]) - (now - rp[:, UPDATED]), 0.0)
        self.p_queue_s = drained + est.queue_time(pp[:, P_QF])
        self.p_nqueued = rp[:, NQUEUED] + pp[:, P_PREFILLS]
        self.p_cache_free = rp[:, FREE]
        self.p_to_d = table.d_pos[p]  # colocated prefill workers decode the request themselves
        self.d_free, self.d_total, self.d_bs = rd[:, FREE] - pd[:, P_BLOCKS], rd[:, TOTAL], rd[:, BS]
        self.d_running, self.d_ctx = rd[:, RUNNING] + pd[:, P_SEQS], rd[:, CTX] + pd[:, P_CTX]

        # Prefix matches: local ones per prefill worker, and the two longest alive holders as fetch
        # sources (the runner-up serves the best holder itself).
        self.p_local = np.zeros(len(self.p_ids))
        holders = []
        for wid, n in matches.items():
            r = table.row.get(wid)
            if r is None or not table.alive[r]:
                continue
            holders.append((n, wid))
            if table.p_pos[r] >= 0:
                self.p_local[table.p_pos[r]] = n
        holders.sort(reverse=True)
        (n0, self._src0), (n1, self._src1) = (holders + [(0, None), (0, None)])[:2]
        self.p_peer = np.full(len(self.p_ids), float(n0))
        self._best_pos = -1 if self._src0 is None else int(table.p_pos[table.row[self._src0]])
        if self._best_pos >= 0:
            self.p_peer[self._best_pos] = n1
        self.pool_blocks = pool_blocks
        self._table = table
        self._local_tokens = self.cached_tokens(self.p_local)
        self._tbt_now = self._need = None

    # ----- per-request quantities, vectorized over workers -----
    def cached_tokens(self, blocks):
        """Tokens a prefix of ``blocks`` saves: at least one prompt token is always computed."""
        return np.minimum(blocks * self.block_size, self._cap)

    def prefill_s(self, blocks):
        cached = self.cached_tokens(blocks)
        return self.est.prefill.predict(self.req.prompt_len - cached, cached)

    def peer_source(self, p: int) -> str | None:
        """The worker p would fetch a longer prefix from."""
        return self._src1 if p == self._best_pos else self._src0

    def fetch_s(self, src_blocks, kind: str):
        """Seconds to copy the blocks a source has beyond each worker's local prefix (0 if none)."""
        extra = self.cached_tokens(src_blocks) - self._local_tokens
        kv = self.est.kv_bytes_per_token
        t = self.est.transfer.defaults[kind].time(extra * kv)
        pairs = self.est.transfer.pairs
        if kind == "peer" and pairs:  # measured links, only from the (at most two) sources in play
            for src in {self._src0, self._src1} & pairs.keys():
                for dst, link in pairs[src].items():
                    r = self._table.row.get(dst)
                    i = -1 if r is None else self._table.p_pos[r]
                    if i >= 0 and self.peer_source(i) == src:
                        t[i] = link.time(extra[i] * kv)
        return np.where(extra > 0, t, 0.0)

    def decode_need(self):
        """KV blocks the request needs on each decode worker (prompt + max output)."""
        if self._need is None:
            self._need = np.ceil((self.req.prompt_len + self.req.max_tokens) / self.d_bs)
        return self._need

    def tbt_now(self):
        """Step time on each decode worker with this request added to today's batch."""
        if self._tbt_now is None:
            self._tbt_now = self.est.decode.predict(self.d_running + 1, self.d_ctx + self.req.prompt_len)
        return self._tbt_now

    def decode_for(self, p: int, d: int) -> int:
        """The decode worker that pairs with prefill worker p: itself when colocated."""
        return int(self.p_to_d[p]) if self.p_to_d[p] >= 0 else d

    def decision(self, p: int, d: int, fetch_from: str | None, fetch_blocks: float, cached_blocks: float,
                 ttft_s: float, tbt_s: float | None = None) -> Decision:
        d = self.decode_for(p, d)
        tbt = float(self.tbt_now()[d]) if tbt_s is None else tbt_s
        return Decision(self.p_ids[p], self.d_ids[d], fetch_from, int(fetch_blocks), int(cached_blocks),
                        float(ttft_s), tbt)
