"""Pool events and the router's mirror: an in-memory copy of the pool index, kept current from the Redis
Stream that every pool write appends to (``kvstore.publisher`` is the worker's side).

Each event is one stream entry ``{w: holder, s: seq, op: stored|removed|drop, t: tier, h: "hex,hex,..."}``
listing the blocks whose holder membership changed; ``s`` counts the holder's events, so a missing one
shows as a gap. The mirror answers ``longest_prefix`` without a network call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.pool import KVPool, execute

log = logging.getLogger(__name__)


@dataclass
class PoolEvent:
    worker: str
    seq: int
    op: str  # stored | removed | drop (the worker was dropped: it holds nothing)
    hashes: list[int]
    tier: str = "*"

    @classmethod
    def from_fields(cls, f: dict[bytes, bytes]) -> PoolEvent:
        h = f.get(b"h", b"")
        return cls(f[b"w"].decode(), int(f[b"s"]), f[b"op"].decode(),
                   [int(x, 16) for x in h.split(b",")] if h else [], f.get(b"t", b"*").decode())


@dataclass
class _Index:
    """Block hash -> bitmask of holder slots. A lookup walks the chain ANDing masks until none is left,
    so its cost is the matched length plus one step per holder that drops out."""

    blocks: dict[int, int] = field(default_factory=dict)
    held: list[set[int]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    bits: list[int] = field(default_factory=list)  # 1 << slot, shared by every block with one holder
    slots: dict[str, int] = field(default_factory=dict)
    alive: int = 0  # slots whose holdings count in lookups

    def slot(self, worker: str) -> int:
        s = self.slots.get(worker)
        if s is None:
            s = self.slots[worker] = len(self.names)
            self.names.append(worker)
            self.bits.append(1 << s)
            self.held.append(set())
        return s

    def add(self, slot: int, hashes: Iterable[int]) -> None:
        b, held, blocks = self.bits[slot], self.held[slot], self.blocks
        for h in hashes:
            if h not in held:
                held.add(h)
                m = blocks.get(h)
                blocks[h] = b if m is None else m | b

    def remove(self, slot: int, hashes: Iterable[int]) -> None:
        nb, held, blocks = ~self.bits[slot], self.held[slot], self.blocks
        for h in list(hashes):
            if h in held:
                held.discard(h)
                m = blocks[h] & nb
                if m:
                    blocks[h] = m
                else:
                    del blocks[h]

    def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        blocks, mask, out, n = self.blocks, self.alive, {}, 0
        for h in hashes:
            m = blocks.get(h, 0) & mask
            if m != mask:
                if n:
                    self._record(out, mask & ~m, n)
                if not m:
                    return out
                mask = m
            n += 1
        if n:
            self._record(out, mask, n)
        return out

    def _record(self, out: dict[str, int], bits: int, n: int) -> None:
        while bits:
            low = bits & -bits
            out[self.names[low.bit_length() - 1]] = n
            bits ^= low


class PoolMirror:
    """The router's in-memory copy of the pool index for one model and block size.

    ``poll()`` (or the ``start()`` thread) reads new stream events; a gap in a holder's sequence numbers,
    or a holder whose Redis sequence is ahead of what the stream delivered (trimmed or deleted events),
    resyncs that holder from the index; a new epoch (Redis restarted) or a lost connection rebuilds the
    whole mirror. Holders count in lookups while their heartbeat is younger than the TTL (by the Redis
    clock at the last census, then the local clock); ``@`` holders (the Redis tier) while Redis answers.
    """

    def __init__(self, redis_url: str, model_id: str, block_size: int, ttl_s: float = 10.0,
                 census_interval_s: float | None = None, max_events: int = 10_000) -> None:
        self.pool = KVPool(redis_url, model_id, block_size, ttl_s=ttl_s)
        self.census_interval_s = census_interval_s if census_interval_s is not None else ttl_s / 4
        self.max_events = max_events
        self.resyncs = 0  # holders resynced after a gap
        self.rebuilds = 0  # whole-mirror rebuilds
        self._index = _Index()
        self._seq: dict[str, int] = {}
        self._expires: dict[str, float] = {}  # worker -> monotonic time its last heartbeat runs out
        self._last_id = b"0-0"
        self._epoch: bytes | None = None
        self._stale = True
        self._next_census = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """``{holder: leading blocks of hashes it holds}`` for live holders; memory only."""
        return self._index.longest_prefix(hashes)

    @property
    def indexed_blocks(self) -> int:
        return len(self._index.blocks)

    def workers(self) -> list[str]:
        """Live workers (heartbeat within the TTL) that the mirror knows."""
        idx = self._index
        slots = dict(idx.slots)  # a copy taken at once: the poll thread may be adding workers
        return sorted(w for w, s in slots.items() if idx.alive >> s & 1 and not w.startswith("@"))

    def poll(self) -> int:
        """Catch up with the stream; returns the events applied (0 while Redis is unreachable)."""
        with self._lock:
            applied = self.pool.run(self._catch_up, None)
            if applied is None:
                self._stale = True  # whatever happened meanwhile, rebuild once Redis answers
            self._refresh_alive()
            return applied or 0

    def start(self, interval_s: float = 0.05) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="pool-mirror", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.pool.close()

    def _loop(self, interval_s: float) -> None:
        busy = False
        while not self._stop.wait(0 if busy else interval_s):
            try:
                busy = self.poll() >= self.max_events
            except Exception:  # a bug must not silently end catch-up: log it and rebuild next time
                log.exception("pool %s: mirror poll failed", self.pool.ns)
                self._stale, busy = True, False

    def _catch_up(self) -> int:
        if self._stale:
            self._rebuild()
        census_due = time.monotonic() >= self._next_census
        pipe = self.pool.client.pipeline(transaction=False)
        pipe.get(self.pool.ns + "epoch")
        if census_due:  # read before the stream, so the stream holds every event the census counts
            pipe.evalsha(self.pool.census_script.sha, 0, self.pool.ns)
        pipe.xread({self.pool.stream: self._last_id}, count=self.max_events)
        res = execute(pipe)
        if res[0] != self._epoch:
            log.warning("pool %s: Redis epoch changed (restart or flush); rebuilding the mirror", self.pool.ns)
            self._rebuild()
            return 0
        entries = res[-1][0][1] if res[-1] else []
        seen = self._apply(entries)
        if census_due and len(entries) < self.max_events:
            self._check_census(self._parse_census(res[1]), seen)
        elif any(w not in self._expires and not w.startswith("@") for w in seen):
            # a worker new to the mirror: learn its heartbeat now, not at the next census
            self._parse_census(self.pool.client.evalsha(self.pool.census_script.sha, 0, self.pool.ns))
        return len(entries)

    def _apply(self, entries: list) -> set[str]:
        idx, seen = self._index, set()
        for entry_id, fields in entries:
            ev = PoolEvent.from_fields(fields)
            self._last_id = entry_id
            seen.add(ev.worker)
            last = self._seq.get(ev.worker, 0)
            if ev.seq <= last:
                continue  # already part of a snapshot
            if ev.seq != last + 1:
                log.warning("pool %s: %s sent event %d after %d; resyncing it", self.pool.ns, ev.worker,
                            ev.seq, last)
                self._resync(ev.worker)
                continue
            self._seq[ev.worker] = ev.seq
            slot = idx.slot(ev.worker)
            if ev.op == "stored":
                idx.add(slot, ev.hashes)
            elif ev.op == "removed":
                idx.remove(slot, ev.hashes)
            else:
                idx.remove(slot, idx.held[slot])
        return seen

    def _parse_census(self, flat: list) -> dict[str, tuple[int, int]]:
        """``{holder: (seq, heartbeat_ms or -1)}``; also refreshes heartbeat expiry times."""
        now_ms, census, mono = int(flat[0]), {}, time.monotonic()
        for i in range(1, len(flat), 3):
            w, seq, hb = flat[i].decode(), int(flat[i + 1]), int(float(flat[i + 2]))
            census[w] = (seq, hb)
            if hb >= 0:
                self._expires[w] = mono + self.pool.ttl_s - (now_ms - hb) / 1000
        self._next_census = mono + self.census_interval_s
        return census

    def _check_census(self, census: dict[str, tuple[int, int]], seen: set[str]) -> None:
        for w, (seq, _) in census.items():
            if seq > self._seq.get(w, 0):
                log.warning("pool %s: missed events of %s; resyncing it", self.pool.ns, w)
                self._resync(w)
        idx = self._index
        for w, s in list(idx.slots.items()):
            if w not in census and w not in seen and idx.held[s]:
                idx.remove(s, idx.held[s])  # dropped from Redis and its drop event was lost

    def _snapshots(self, workers: Sequence[str]) -> dict[str, tuple[set[int], int]]:
        """Each holder's hashes and sequence number, read atomically per holder."""
        out, ns = {}, self.pool.ns
        for i in range(0, len(workers), 100):
            chunk = workers[i:i + 100]
            pipe = self.pool.client.pipeline(transaction=True)
            for w in chunk:
                pipe.smembers(f"{ns}w:{w}")
                pipe.get(f"{ns}seq:{w}")
            res = execute(pipe)
            for j, w in enumerate(chunk):
                out[w] = ({int(x, 16) for x in res[2 * j]}, int(res[2 * j + 1] or 0))
        return out

    def _resync(self, worker: str) -> None:
        (want, seq), idx = self._snapshots([worker])[worker], self._index
        s = idx.slot(worker)
        have = idx.held[s]
        idx.remove(s, have - want)
        idx.add(s, want - have)
        self._seq[worker] = seq
        self.resyncs += 1

    def _rebuild(self) -> None:
        pipe = self.pool.client.pipeline(transaction=True)
        pipe.get(self.pool.ns + "epoch")
        pipe.xrevrange(self.pool.stream, count=1)
        pipe.evalsha(self.pool.census_script.sha, 0, self.pool.ns)
        epoch, last, census = execute(pipe)
        census = self._parse_census(census)
        idx, seqs = _Index(), {}
        for w, (held, seq) in self._snapshots(sorted(census)).items():
            idx.add(idx.slot(w), held)
            seqs[w] = seq
        self._expires = {w: t for w, t in self._expires.items() if w in census}
        idx.alive = self._alive_mask(idx)
        self._index, self._seq = idx, seqs  # one swap: lookups see the old index or the new one
        self._last_id = last[0][0] if last else b"0-0"
        self._epoch, self._stale = epoch, False
        self.rebuilds += 1

    def _refresh_alive(self) -> None:
        self._index.alive = self._alive_mask(self._index)

    def _alive_mask(self, idx: _Index) -> int:
        now, up, mask = time.monotonic(), self.pool.up, 0
        for w, s in idx.slots.items():
            if (up if w.startswith("@") else self._expires.get(w, 0.0) > now):
                mask |= idx.bits[s]
        return mask
