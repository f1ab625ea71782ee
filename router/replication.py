"""Hot-prefix replication (the `tidepool` policy's ``replicate`` option), after Mooncake's hot-spot
migration: when a prefix is hot and every worker holding it (or computing it) has a queue, copy it to an
idle prefill worker ahead of the requests that will want it, so the copy's time is off their path; they
find it local there once it lands (the index then shows the new holder). Copies come out of a byte
budget, a token bucket refilled at a share of the peer link's bandwidth, since they take link time the
KV hand-offs also need. Requests themselves already go to an idle worker with an on-demand copy when
that is faster (the policy's fetch options): replication pays where the copy would not hide behind a
queue, i.e. on links slow next to the prefill.
"""

from __future__ import annotations

import numpy as np

from router.view import ClusterView, Replication


class HotPrefixReplicator:
    def __init__(self, hot_rps: float = 0.2, busy_s: float = 1.0, idle_s: float = 0.25,
                 budget_share: float = 0.1, budget_window_s: float = 60.0):
        self.hot_rps = hot_rps  # a prefix is hot from this many requests a second carrying it
        self.busy_s = busy_s  # ... and its holders are busy when even the least loaded has this much queue
        self.idle_s = idle_s  # a worker with less queue than this can take a copy
        self.budget_share = budget_share  # of the peer link's bandwidth, for copies
        self.budget_window_s = budget_window_s  # the bucket holds this many seconds of that rate
        self._budget_bytes = 0.0
        self._at: float | None = None
        self._landing: dict[tuple[str, int], float] = {}  # (destination, prefix key) -> when the copy lands

    def __call__(self, view: ClusterView, own: np.ndarray, queue_s: np.ndarray) -> list[Replication]:
        """Copies to start with this decision (at most one: of this prompt's longest hot prefix);
        ``own``/``queue_s``: blocks each worker will hold and its queue, this request included."""
        rate = self.budget_share * view.est.transfer.defaults["peer"].bandwidth_Bps
        full = rate * self.budget_window_s  # the bucket starts full
        self._budget_bytes = full if self._at is None else min(self._budget_bytes + rate * (view.now - self._at), full)
        self._at = view.now
        hot = np.flatnonzero(view.heat >= self.hot_rps)
        if not len(hot):
            return []
        blocks = (int(hot[-1]) + 1) * view.heat_stride  # the longest hot prefix
        holders = view.p_local >= blocks  # the source must hold the bytes now
        if not holders.any() or np.min(queue_s[own >= blocks]) < self.busy_s:
            return []
        key = view.req.block_hashes[blocks - 1]
        self._landing = {k: t for k, t in self._landing.items() if t > view.now}
        landing = np.array([(w, key) in self._landing for w in view.p_ids])
        idle = np.flatnonzero((own < blocks) & (queue_s < self.idle_s) & ~landing)
        nbytes = float(view.cached_tokens(blocks)) * view.est.kv_bytes_per_token
        if not len(idle) or nbytes > self._budget_bytes:
            return []
        self._budget_bytes -= nbytes
        src = int(np.flatnonzero(holders)[np.argmin(queue_s[holders])])
        dst = int(idle[np.argmin(queue_s[idle])])
        copy = Replication(view.p_ids[src], view.p_ids[dst], blocks)
        self._landing[(copy.dst, key)] = view.now + float(view.est.transfer_time(view.cached_tokens(blocks),
                                                                                 copy.src, copy.dst))
        return [copy]
