"""Discrete-event simulation of N prefill + M decode workers replaying a Mooncake-format trace (the runs,
sweeps and the `tidepool simulate` command are in router/sim_cli.py, their metrics in router/sim_report.py).

Requests are routed by the live `Conductor` and policies (no second implementation). Each prefill
worker runs its FIFO queue one prefill at a time and keeps an LRU prefix cache published to a prefix
index; fetched prefixes travel over the profile's links while the request waits; KV streams to the
decode worker layer by layer during prefill. Decode workers run continuous batches whose step time is
the profile's decode model. Steps are not simulated one by one: between two batch changes the step
times form an arithmetic series (context grows by the batch size per step), so a decode worker only
has an event when a sequence joins or finishes, and the step durations are written in bulk to a buffer
that each request's token gaps are read from.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from kvstore.names import POOL_HOLDER
from router.conductor import Conductor, Decision, RouteRequest, WorkerLoad
from router.estimator import DecodeModel, exposed_handoff_s, prefill_features
from router.planner import Demand
from router.prefix_cache import BlockCache, PrefixIndex
from router.profile import Profile
from router.sim_autoscaler import TICK_S, SimAutoscaler
from router.sim_workers import SimConfig, SimDecode, SimJob, SimPrefill, SimRequest
from router.trace import TraceRequest
from router.view import Replication, reusable_tokens

__all__ = ["SimConfig", "SimRequest", "Simulation"]

_PREFILL_DONE, _DECODE_ARRIVE, _DECODE_EPOCH, _REPLICA_DONE, _TICK, _WORKER_READY = 0, 1, 2, 3, 4, 5


class Simulation:
    def __init__(self, trace: list[TraceRequest], profile: Profile, cfg: SimConfig):
        self.cfg, self.profile = cfg, profile
        self.reqs = [SimRequest(t, cfg.speed) for t in trace]
        self.unfinished = len(self.reqs)  # neither served to the end nor rejected yet
        self.demand = Demand(cfg.autoscale.window_s) if cfg.autoscale.bounds else None
        self.conductor = Conductor(cfg.policy, profile.estimator(), cfg.slo, block_size=cfg.block_tokens,
                                   seed=cfg.seed, demand=self.demand, learn_worker_speeds=cfg.learn_worker_speeds,
                                   **cfg.policy_options)
        self.rng = np.random.default_rng(cfg.seed)
        self.index = PrefixIndex()
        self.prefill: dict[str, SimPrefill] = {}
        self.decode: dict[str, SimDecode] = {}
        self._numbers = {"prefill": 0, "decode": 0}  # the next worker id's number, per role
        for role, count in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            for _ in range(count):
                self._add_worker(role)
        self.draining: set[str] = set()  # workers taking no new request, leaving once idle
        self.autoscaler = SimAutoscaler(self, cfg.autoscale, cfg.worker_start_s) if self.demand else None
        self.pool = BlockCache(POOL_HOLDER, profile.pool_tokens // cfg.block_tokens, self.index)
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.fetched_tokens = self.replicated_tokens = 0

    # ----- event plumbing -----
    def _push(self, t: float, kind: int, obj) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    def run(self) -> list[SimRequest]:
        handlers = (self._prefill_done, self._decode_arrive, self._decode_epoch, self._replica_done, self._tick,
                    self._worker_ready)
        if self.autoscaler is not None and self.reqs:
            self._push(self.reqs[0].arrival, _TICK, None)
        for r in self.reqs:
            while self.events and self.events[0][0] <= r.arrival:
                self.now, _, kind, obj = heapq.heappop(self.events)
                handlers[kind](obj)
            self.now = r.arrival
            self._arrive(r)
        while self.events:
            self.now, _, kind, obj = heapq.heappop(self.events)
            handlers[kind](obj)
        return self.reqs

    # ----- workers coming and going (the autoscaler's) -----
    def workers(self, role: str) -> dict[str, SimPrefill] | dict[str, SimDecode]:
        return self.prefill if role == "prefill" else self.decode

    def _add_worker(self, role: str) -> str:
        number = self._numbers[role]
        wid = f"{role[0]}{number}"
        self._numbers[role] += 1
        factors = self.cfg.prefill_slowdown if role == "prefill" else self.cfg.decode_slowdown
        slowdown = factors[number % len(factors)] if factors else 1.0
        if role == "prefill":
            cache = BlockCache(wid, self.profile.prefill_cache_tokens // self.cfg.block_tokens, self.index)
            self.prefill[wid] = SimPrefill(wid, cache, slowdown)
        else:
            prof, m = self.profile, self.profile.decode
            model = DecodeModel(m.fixed_s * slowdown, m.per_seq_s * slowdown, m.per_context_token_s * slowdown)
            self.decode[wid] = SimDecode(wid, prof.decode_kv_tokens // prof.decode_block_size, prof.decode_block_size,
                                         prof.max_batch, model)
        return wid

    def start_worker(self, role: str, ready_at: float) -> None:
        self._push(ready_at, _WORKER_READY, role)

    def _worker_ready(self, role: str) -> None:
        self._add_worker(role)
        self.autoscaler.worker_ready(role, self.now)

    def busyness(self, wid: str) -> tuple[int, int]:
        """What a worker has to finish before it can leave: the least busy is drained first."""
        if wid in self.prefill:
            p = self.prefill[wid]
            return len(p.pairs), 0
        d = self.decode[wid]
        return d.batch + len(d.waiting), d.reserved

    def drain(self, wid: str) -> None:
        self.draining.add(wid)

    def retire_drained(self) -> None:
        """Workers drained whose work is done leave (a prefill worker's cache leaves the prefix index)."""
        for wid in [w for w in self.draining if self.busyness(w) == (0, 0)]:
            self.draining.discard(wid)
            role = "prefill" if wid in self.prefill else "decode"
            if role == "prefill":
                self.prefill.pop(wid).cache.clear()
            else:
                del self.decode[wid]
            self.autoscaler.record(role, self.now)

    def _tick(self, _) -> None:
        self.autoscaler.tick(self.now)
        if self.unfinished:
            self._push(self.now + TICK_S, _TICK, None)

    # ----- routing -----
    def _loads(self) -> list[WorkerLoad]:
        """Exact reports, one new object per worker whose state changed since its last one (the
        conductor drains a reported prefill queue by the time elapsed since, as it does live)."""
        now = self.now
        for p in self.prefill.values():
            if p.load is None:
                f = list(p.waiting)
                if p.running is not None:
                    _, new, cached, start, end = p.running
                    left = 1.0 if now <= start else (end - now) / (end - start)
                    rf = prefill_features(new * left, cached + new * (1 - left))
                    f = [a + b for a, b in zip(f, rf, strict=True)]
                p.load = WorkerLoad(p.id, "prefill", True, tuple(p.pairs), int(p.running is not None), 0,
                                    p.cache.capacity - len(p.cache), p.cache.capacity, self.cfg.block_tokens,
                                    now, tuple(f))
        for d in self.decode.values():
            if d.load is None:
                d.load = WorkerLoad(d.id, "decode", True, (), d.batch, d.ctx, d.free - d.reserved, d.total,
                                    d.bs, now)
        return [w.load for w in (*self.prefill.values(), *self.decode.values()) if w.id not in self.draining]

    def _arrive(self, r: SimRequest) -> None:
        dec = self.conductor.route(RouteRequest(str(id(r)), r.prompt, r.hashes, r.out), self._loads(),
                                   self.index, self.now)
        if not isinstance(dec, Decision):
            r.reject = dec.reason
            self.unfinished -= 1
            return
        p, d = self.prefill[dec.prefill], self.decode[dec.decode]
        r.decode = d
        r.need = math.ceil((r.prompt + r.out) / d.bs)
        d.reserved += r.need
        p.load = d.load = None
        cached = min(dec.cached_blocks * self.cfg.block_tokens, reusable_tokens(r.prompt, self.cfg.block_tokens))
        job = SimJob(r, r.prompt - cached, cached, self.now)
        if dec.fetch_from is not None and dec.fetch_blocks > 0:
            self._fetch(job, dec)
        for rep in dec.replicate:
            self._replicate(r, rep)
        p.cache.touch(r.hashes[:dec.cached_blocks])
        p.queue.append(job)
        p.pairs.append((job.new, job.cached))
        for i, v in enumerate(prefill_features(job.new, job.cached)):
            p.waiting[i] += v
        if p.running is None:
            self._start_prefill(p)

    def _fetch(self, job: SimJob, dec: Decision) -> None:
        """Copy the decision's prefix to the prefill worker while the request queues. A worker whose
        prefill of that prefix is still under way (the conductor routed on it) sends it once computed."""
        blocks = dec.cached_blocks
        if dec.fetch_from == "pool":
            src, link, have = self.pool, self.profile.pool_link, self.pool.leading(job.req.hashes[:blocks])
        else:
            holder = self.prefill[dec.fetch_from]
            src, link, have = holder.cache, self.profile.peer_link, holder.cache.leading(job.req.hashes[:blocks])
            producer = holder.producer(job.req.hashes, blocks) if have < blocks else None
            if producer is not None:
                job.ready = None
                holder.waiters.setdefault(id(producer), []).append((job, self.prefill[dec.prefill], blocks,
                                                                    dec.fetch_blocks))
                return
        self._copy(job, src, link, min(have, blocks), dec.fetch_blocks - (blocks - min(have, blocks)))

    def _copy(self, job: SimJob, src, link, blocks: int, extra_blocks: int) -> None:
        """The fetch of the first ``blocks`` prefix blocks (``extra_blocks`` of them missing here) starts now."""
        src.touch(job.req.hashes[:blocks])
        usable = reusable_tokens(job.req.prompt, self.cfg.block_tokens)
        tokens = min(max(extra_blocks, 0) * self.cfg.block_tokens, usable)
        job.ready = self.now + (link.time(tokens * self.profile.kv_bytes_per_token) if tokens > 0 else 0.0)
        job.fetched = min(blocks * self.cfg.block_tokens, usable) if tokens > 0 else 0
        self.fetched_tokens += tokens

    def _replicate(self, r: SimRequest, rep: Replication) -> None:
        """Copy r's first rep.blocks blocks from one prefill worker's cache to another's (the policy's
        hot-prefix replication); the destination holds them once the copy lands."""
        src = self.prefill[rep.src].cache
        blocks = src.leading(r.hashes[:rep.blocks])
        if blocks == 0:
            return
        src.touch(r.hashes[:blocks])
        tokens = min(blocks * self.cfg.block_tokens, r.prompt)
        self.replicated_tokens += tokens
        done = self.now + self.profile.peer_link.time(tokens * self.profile.kv_bytes_per_token)
        self._push(done, _REPLICA_DONE, (self.prefill[rep.dst], r.hashes[:blocks]))

    def _replica_done(self, obj) -> None:
        p, hashes = obj
        p.cache.insert(hashes)
        p.load = None

    # ----- prefill -----
    def _start_prefill(self, p: SimPrefill) -> None:
        job = p.queue[0]
        if job.ready is None:  # its prefix is still being computed elsewhere: the worker waits (FIFO)
            return
        p.queue.popleft()
        p.load = None
        for i, v in enumerate(prefill_features(job.new, job.cached)):
            p.waiting[i] -= v
        r = job.req
        # What is here when it starts: the local prefix (a request queued behind one with the same prefix
        # finds it computed; vLLM matches at schedule time) or what was fetched, whichever is longer.
        cached = max(min(p.cache.leading(r.hashes) * self.cfg.block_tokens,
                         reusable_tokens(r.prompt, self.cfg.block_tokens)), job.fetched)
        new = r.prompt - cached
        start = max(self.now, job.ready)
        dur = float(self.profile.prefill.predict(new, cached)) * p.slowdown
        if self.cfg.noise > 0:
            dur *= float(self.rng.lognormal(0.0, self.cfg.noise))
        p.running = (r, new, cached, start, start + dur)
        r.cached = cached
        self._push(start + dur, _PREFILL_DONE, p)

    def _prefill_done(self, p: SimPrefill) -> None:
        r, new, cached, start, end = p.running
        p.running = None
        p.load = None
        p.pairs.popleft()
        self.conductor.observe_prefill(p.id, new, cached, end - start)
        p.cache.insert(r.hashes)
        self.pool.insert(r.hashes)
        self._serve_waiters(p, r)
        d = r.decode
        if r.out <= 1:  # the prefill's token was the whole answer
            d.reserved -= r.need
            d.load = None
            r.first_t, r.tbt, r.done, r.end = self.now, 0.0, True, self.now
            self.unfinished -= 1
        else:  # KV streamed layer by layer while computing: the first token waits for the exposed rest
            link, prof = self.profile.peer_link, self.profile
            moving = r.prompt * prof.kv_bytes_per_token / link.bandwidth_Bps
            r.first_t = self.now + exposed_handoff_s(moving, end - start, prof.layers, link.latency_s)
            self._push(r.first_t, _DECODE_ARRIVE, r)
        r.ttft = r.first_t - r.arrival
        if p.queue:
            self._start_prefill(p)

    def _serve_waiters(self, p: SimPrefill, r: SimRequest) -> None:
        """Fetches that waited for r's prefill on p start now, with whatever of their prefix p holds."""
        for job, dst, blocks, extra in p.waiters.pop(id(r), ()):
            have = p.cache.leading(job.req.hashes[:blocks])
            self._copy(job, p.cache, self.profile.peer_link, have, extra - (blocks - have))
            if dst.running is None and dst.queue and dst.queue[0] is job:
                self._start_prefill(dst)

    # ----- decode -----
    def _advance(self, d: SimDecode, k: int) -> None:
        """Run k steps of the current batch."""
        if k <= 0:
            return
        m = d.model
        first, inc = m.predict(d.batch, d.ctx), m.per_context_token_s * d.batch
        d.record(first, inc, k)
        seconds = m.run_time(d.batch, d.ctx, k)
        self.conductor.observe_decode_step(d.id, d.batch, d.ctx + d.batch * (k - 1) // 2, seconds / k)
        d.t += seconds
        d.step += k
        d.ctx += d.batch * k
        d.load = None

    def _decode_arrive(self, r: SimRequest) -> None:
        d = r.decode
        if d.batch == 0:
            d.t = max(d.t, self.now)
        else:  # join at the first step boundary at or after now
            k = d.model.steps_to_reach(d.batch, d.ctx, self.now - d.t)
            self._advance(d, min(k, d.finishing[0][0] - d.step))
            if d.finishing[0][0] == d.step:
                self._finish_due(d)
        d.waiting.append(r)
        self._admit(d)
        self._schedule(d)

    def _admit(self, d: SimDecode) -> None:
        while d.waiting and d.batch < d.max_batch and (d.free >= d.waiting[0].need or d.batch == 0):
            r = d.waiting.popleft()
            d.load = None
            d.reserved -= r.need
            d.free -= r.need
            r.join_step, r.join_t = d.step, d.t
            d.batch += 1
            d.ctx += r.prompt + 1
            self.seq += 1
            heapq.heappush(d.finishing, (d.step + r.out - 1, self.seq, r))

    def _schedule(self, d: SimDecode) -> None:
        d.version += 1
        if d.batch:
            k = d.finishing[0][0] - d.step
            self._push(d.t + d.model.run_time(d.batch, d.ctx, k), _DECODE_EPOCH, (d, d.version))

    def _decode_epoch(self, obj) -> None:
        d, version = obj
        if version != d.version:
            return
        self._advance(d, d.finishing[0][0] - d.step)
        self._finish_due(d)
        self._admit(d)
        self._schedule(d)

    def _finish_due(self, d: SimDecode) -> None:
        while d.finishing and d.finishing[0][0] == d.step:
            r = heapq.heappop(d.finishing)[2]
            d.load = None
            d.free += r.need
            d.batch -= 1
            d.ctx -= r.prompt + r.out
            n = r.out - 1
            gaps = d.durs[r.join_step:r.join_step + n].copy()
            gaps[0] += r.join_t - r.first_t  # first gap: from the first token to the first decode step
            k = math.ceil(0.1 * n)  # Mooncake's TBT: mean of the slowest 10% of token gaps
            r.tbt = float(np.partition(gaps, n - k)[n - k:].mean())
            r.done, r.end = True, d.t
            self.unfinished -= 1
