"""A worker's side of the pool: its block events, batched into the index, and its heartbeat."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from kvstore.pool import TIERS, KVPool

log = logging.getLogger(__name__)


class PoolPublisher:
    """A worker's side of the pool. Hand ``on_stored``/``on_removed`` to the engine (they only buffer, no
    network); ``flush`` publishes the buffer in one round trip and ``beat`` heartbeats (``start`` runs both
    on a thread). Whenever Redis may have missed something (first contact, a dropped publish, a Redis
    restart, having been dropped as dead) the next flush replaces the worker's whole entry with what it
    holds, so the pool converges without replaying history."""

    def __init__(self, pool: KVPool, worker_id: str, flush_interval_s: float = 0.05,
                 heartbeat_interval_s: float | None = None) -> None:
        if worker_id.startswith("@"):
            raise ValueError(f"worker id {worker_id!r}: ids starting with '@' are reserved for pool tiers")
        self.pool, self.worker_id = pool, worker_id
        self.flush_interval_s = flush_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s or pool.ttl_s / 3
        self._held: dict[int, int] = {}  # hash -> tier bits this worker holds
        self._pending: list[tuple[str, str, list[int]]] = []
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._desyncs, self._synced_at = 1, 0  # a full replace is due while they differ
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_stored(self, hashes: Sequence[int], tier: str = "device") -> None:
        self._record("stored", tier, hashes)

    def on_removed(self, hashes: Sequence[int], tier: str = "device") -> None:
        self._record("removed", tier, hashes)

    def callbacks(self, tier: str) -> tuple[Callable[[Sequence[int]], None], Callable[[Sequence[int]], None]]:
        """``(on_stored, on_removed)`` for another tier's owner, e.g. a ``HostTier``."""
        return partial(self.on_stored, tier=tier), partial(self.on_removed, tier=tier)

    def _record(self, op: str, tier: str, hashes: Sequence[int]) -> None:
        bit = TIERS[tier]
        with self._lock:
            for h in hashes:
                bits = self._held.get(h, 0)
                bits = bits | bit if op == "stored" else bits & ~bit
                if bits:
                    self._held[h] = bits
                else:
                    self._held.pop(h, None)
            if self._pending and self._pending[-1][:2] == (op, tier):
                self._pending[-1][2].extend(hashes)
            else:
                self._pending.append((op, tier, list(hashes)))

    def flush(self) -> bool:
        """Publish what was buffered (or the whole state when a replace is due); False if Redis dropped it."""
        with self._flush_lock:
            with self._lock:
                ops, self._pending = self._pending, []
                gen = self._desyncs
                snapshot = dict(self._held) if gen != self._synced_at else None
            if snapshot is not None:
                ok = self.pool.replace_holdings(self.worker_id, snapshot)
            else:
                ok = self.pool.publish_batch(self.worker_id, ops)
            with self._lock:
                if not ok:
                    self._desyncs += 1
                elif snapshot is not None and self._desyncs == gen:
                    self._synced_at = gen
            return ok

    def beat(self) -> None:
        """Heartbeat; a (re)registration or an unreachable Redis makes the next flush a full replace."""
        if self.pool.heartbeat(self.worker_id) is not False:
            with self._lock:
                self._desyncs += 1

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"pool-publisher-{self.worker_id}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_beat = 0.0
        while True:
            try:
                if time.monotonic() >= next_beat:
                    self.beat()
                    self.pool.cleanup()  # any live worker may drop the dead ones
                    next_beat = time.monotonic() + self.heartbeat_interval_s
                self.flush()
            except Exception:  # a bug must not silently stop heartbeats: log it, replace state next time
                log.exception("pool publisher %s: flush failed", self.worker_id)
                with self._lock:
                    self._desyncs += 1
            if self._stop.wait(self.flush_interval_s):
                return

    def stop(self, retire: bool = True) -> None:
        """Stop the thread; ``retire`` removes this worker and its holdings from the pool at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if retire:
            self.pool.retire(self.worker_id)
