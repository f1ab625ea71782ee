"""Routing policies. Each is a small class called with a `ClusterView` that returns a `Decision` or a
`Reject`; `POLICIES` maps the `--policy` names to them.

Baselines never reject. `mooncake` follows Algorithm 1 of the Mooncake paper; `tidepool` is ours: the
same TTFT estimate with the fetch overlapped with queueing, an explicit choice among pool fetch, peer
fetch and recompute, decode chosen by free KV blocks and TBT projected to when this prefill ends, and
early rejection on that projection.
"""

from __future__ import annotations

import numpy as np

from router.replication import HotPrefixReplicator
from router.view import ClusterView, Decision, Reject

Outcome = Decision | Reject


def _local(view: ClusterView, p: int, d: int) -> Decision:
    """Prefill on p with whatever prefix p already holds."""
    ttft = view.p_queue_s[p] + view.prefill_s(view.p_local)[p]
    return view.decision(p, d, None, 0, view.p_local[p], ttft)


def _least_loaded_decode(view: ClusterView) -> int:
    """The fewest running sequences, then the most free blocks; never one whose adapter slots are all busy
    while another has room for the request's adapter (``ClusterView.d_lora_blocked``)."""
    blocked = view.d_lora_blocked if view.d_lora_blocked is not None else np.zeros(len(view.d_ids), dtype=bool)
    return int(np.lexsort((-view.d_free, view.d_running, blocked))[0])


class RoundRobin:
    def __init__(self, seed: int = 0):
        self.p = self.d = 0

    def __call__(self, view: ClusterView) -> Outcome:
        p, d = self.p % len(view.p_ids), self.d % len(view.d_ids)
        self.p, self.d = self.p + 1, self.d + 1
        return _local(view, p, d)


class RandomChoice:
    """The paper's "random" scheduling baseline."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def __call__(self, view: ClusterView) -> Outcome:
        return _local(view, int(self.rng.integers(len(view.p_ids))), int(self.rng.integers(len(view.d_ids))))


class LeastLoaded:
    """The paper's "load balancing": the prefill worker with the least queued work, cache ignored."""

    def __init__(self, seed: int = 0):
        pass

    def __call__(self, view: ClusterView) -> Outcome:
        return _local(view, int(np.argmin(view.p_queue_s)), _least_loaded_decode(view))


class CacheAware:
    """SGLang router semantics: longest local prefix match (when it covers more than cache_threshold of
    the prompt; else the worker with the most free cache) unless the load is imbalanced by more than
    balance_abs_threshold requests AND balance_rel_threshold times, then the shortest queue."""

    def __init__(self, seed: int = 0, cache_threshold: float = 0.5, balance_abs_threshold: float = 32,
                 balance_rel_threshold: float = 1.0001):
        self.cache_threshold = cache_threshold
        self.abs_threshold, self.rel_threshold = balance_abs_threshold, balance_rel_threshold

    def __call__(self, view: ClusterView) -> Outcome:
        load = view.p_nqueued
        hi, lo = load.max(), load.min()
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            p = int(np.argmin(load))
        else:
            best = int(np.argmax(view.p_local))
            rate = view.cached_tokens(view.p_local[best]) / max(view.req.prompt_len, 1)
            p = best if rate > self.cache_threshold else int(np.lexsort((load, -view.p_cache_free))[0])
        return _local(view, p, _least_loaded_decode(view))


def _best_source(view: ClusterView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per prefill worker: the longest prefix held elsewhere, whether it is the pool's, and the fetch
    seconds (peer wins ties: its link is the faster one)."""
    use_pool = view.pool_blocks > view.p_peer
    blocks = np.where(use_pool, view.pool_blocks, view.p_peer)
    fetch = np.where(use_pool, view.fetch_s(blocks, "pool"), view.fetch_s(blocks, "peer"))
    return blocks, use_pool, fetch


def _source_name(view: ClusterView, p: int, use_pool: bool) -> str:
    return "pool" if use_pool else str(view.peer_source(p))


class Mooncake:
    """Mooncake (FAST'25) Algorithm 1. For each prefill instance: TTFT = T_queue + T_transfer + T_prefill,
    fetching the best holder's prefix when best_len > balance_threshold x local_len; take the smallest
    TTFT; pick the decode instance by load (smallest TBT now); reject when TTFT or TBT misses its SLO.

    decode_by="free_blocks" swaps the decode pick for the one with the most free KV blocks (which count
    the requests already routed there): an ablation that isolates how much of tidepool's gain is that.
    """

    rejects_early = True

    def __init__(self, seed: int = 0, balance_threshold: float = 1.2, decode_by: str = "tbt"):
        if decode_by not in ("tbt", "free_blocks"):
            raise ValueError(f"decode_by must be 'tbt' or 'free_blocks', got {decode_by!r}")
        self.threshold, self.by_free = balance_threshold, decode_by == "free_blocks"

    def __call__(self, view: ClusterView) -> Outcome:
        best, use_pool, fetch = _best_source(view)
        use_fetch = best > self.threshold * view.p_local
        ttft = view.p_queue_s + np.where(use_fetch, fetch, 0.0) + view.prefill_s(np.where(use_fetch, best, view.p_local))
        p = int(np.argmin(ttft))
        tbt = view.tbt_now()
        d = view.decode_for(p, int(np.argmax(view.d_free / view.d_total) if self.by_free else np.argmin(tbt)))
        if ttft[p] > view.slo.ttft_s:
            return Reject("ttft", float(ttft[p] - view.slo.ttft_s))
        if tbt[d] > view.slo.tbt_s:
            return Reject("tbt", float(view.mean_output_tokens * tbt[d] / 2))
        if use_fetch[p]:
            return view.decision(p, d, _source_name(view, p, use_pool[p]), best[p] - view.p_local[p], best[p],
                                 ttft[p], float(tbt[d]))
        return view.decision(p, d, None, 0, view.p_local[p], ttft[p], float(tbt[d]))


class Tidepool:
    """Ours. Prefill: per worker the fastest of recompute-from-local, peer fetch and pool fetch, where a
    fetch runs while the request waits in the queue (TTFT = max(queue, fetch) + prefill). With
    ``inflight`` (on by default) it also counts the cache hits the queues will create: a prompt routed
    to a worker and not yet computed is cached there by the time a request queued behind it runs, and
    can be copied to another worker once it is computed. Decode: load projected to the moment this
    prefill ends — running sequences finish uniformly over their expected life (mean output x TBT),
    releasing blocks — must fit the request's KV and keep the TBT SLO; among those the one with the
    largest share of free KV blocks (free blocks count the requests already routed there and not yet
    decoding, which the running batch does not show). Reject early when no pair meets both SLOs (TTFT
    including the exposed part of the KV hand-off), with the time until the projection says one will.
    ``replicate`` (off by default) adds hot-prefix replication (`router.replication`)."""

    rejects_early = True

    def __init__(self, seed: int = 0, inflight: bool = True, replicate: bool = False, **replication):
        self.inflight = inflight
        self.replicator = HotPrefixReplicator(**replication) if replicate else None
        self.reads_heat = replicate  # the conductor tracks prefix heat for it (router.heat)

    def __call__(self, view: ClusterView) -> Outcome:
        q, local = view.p_queue_s, view.p_local
        own = np.maximum(local, view.p_inflight) if self.inflight else local  # held when the request runs
        # Per worker the fastest option: 0 its own prefix, 1 peer fetch, 2 pool fetch, 3 copy of a prefix
        # another worker is computing now.
        ttft = q + view.prefill_s(own)
        choice = np.zeros(len(local), dtype=np.int8)
        options = [(1, view.p_peer, lambda: view.fetch_s(view.p_peer, "peer"), view.peer_prefill_s),
                   (2, view.pool_blocks, lambda: view.fetch_s(view.pool_blocks, "pool"),
                    lambda: view.prefill_s(view.pool_blocks))]
        if self.inflight:
            options.append((3, view.p_future, view.future_fetch_s, view.future_prefill_s))
        for code, blocks, fetch_s, prefill_s in options:
            longer = blocks > own
            if not np.any(longer):
                continue
            t = np.maximum(q, fetch_s()) + prefill_s()
            better = (t < ttft) & longer
            choice[better] = code
            ttft = np.where(better, t, ttft)

        colocated = view.p_to_d >= 0
        if colocated.all():  # every prefill worker decodes its own requests: judge each pair
            ok, tbt_p, free = self._project(view, ttft, view.p_to_d)
            score = np.where(ok, ttft, np.inf)
            p = int(np.argmin(score))
            if not np.isfinite(score[p]):
                return self._reject(view, ttft, free, view.p_to_d)
            d, tbt = int(view.p_to_d[p]), float(tbt_p[p])
        else:
            p = int(np.argmin(ttft))
            every = slice(None)
            ok, tbt_d, free = self._project(view, ttft[p], every)
            if colocated[p]:
                ok = ok & (np.arange(len(ok)) == view.p_to_d[p])
            if not ok.any():
                return self._reject(view, ttft[p:p + 1], free, every)
            d = int(np.argmax(np.where(ok, free / view.d_total, -np.inf)))
            tbt = float(tbt_d[d])
        code = int(choice[p])
        if code == 0:
            src, blocks = None, own[p]
        else:
            src, blocks = {1: (view.peer_source(p), view.p_peer[p]), 2: ("pool", view.pool_blocks),
                           3: (view.future_source(p), view.p_future[p])}[code]
        copies = ()
        if self.replicator is not None:
            held, queue = own.copy(), q.copy()
            held[p], queue[p] = len(view.req.block_hashes), ttft[p]  # p computes this prompt: busy, then a holder
            copies = self.replicator(view, held, queue)
        dec = view.decision(p, d, src, 0 if code == 0 else blocks - local[p], blocks, ttft[p], tbt, copies)
        if dec.est_ttft_s > view.slo.ttft_s:
            return Reject("ttft", float(dec.est_ttft_s - view.slo.ttft_s))
        return dec

    @staticmethod
    def _project(view: ClusterView, horizon, d):
        """Decode workers d (indices or a slice) when this prefill ends ``horizon`` seconds from now:
        (fits the KV and meets the TBT SLO, projected TBT, projected free blocks)."""
        running, ctx, tbt_now = view.d_running[d], view.d_ctx[d], view.tbt_now()[d]
        life = np.maximum(view.mean_output_tokens * tbt_now, 1e-6)
        done = np.minimum(horizon / life, 1.0)  # share of today's sequences finished by then
        free = view.d_free[d] + done * ctx / view.d_bs[d]
        left = 1.0 - done
        tbt = view.est.decode.predict(running * left + 1,
                                      (ctx + running * horizon / tbt_now) * left + view.req.prompt_len) * view.d_speed[d]
        return (free >= view.decode_need()[d]) & (tbt <= view.slo.tbt_s), tbt, free

    @staticmethod
    def _reject(view: ClusterView, ttft: np.ndarray, free: np.ndarray, d) -> Reject:
        if np.min(ttft) > view.slo.ttft_s:
            return Reject("ttft", float(np.min(ttft) - view.slo.ttft_s))
        need, total = view.decode_need()[d], view.d_total[d]
        if np.all(need > total):
            return Reject("request larger than any decode worker's KV memory", 3600.0)
        # Blocks keep freeing as sequences finish (their held blocks over their expected life):
        # retry when the first worker short of blocks would have them.
        life = np.maximum(view.mean_output_tokens * view.tbt_now()[d], 1e-6)
        held = np.maximum(view.d_ctx[d] / view.d_bs[d], 1e-9)
        wait = np.where(need > total, np.inf, life * np.clip((need - free) / held, 0.0, 1.0))
        w = float(np.min(wait))
        return Reject("decode", w if w > 0.1 else float(np.min(life)) / 2)


POLICIES = {
    "round_robin": RoundRobin,
    "random": RandomChoice,
    "least_loaded": LeastLoaded,
    "cache_aware": CacheAware,
    "mooncake": Mooncake,
    "tidepool": Tidepool,
}


def make_policy(name: str, seed: int = 0, **options):
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](seed=seed, **options)
