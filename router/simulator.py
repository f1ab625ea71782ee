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
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvstore.names import POOL_HOLDER
from router.conductor import SLO, Conductor, Decision, RouteRequest, WorkerLoad
from router.estimator import prefill_features
from router.prefix_cache import BlockCache, PrefixIndex
from router.profile import Profile
from router.trace import TRACE_BLOCK_TOKENS, TraceRequest

_PREFILL_DONE, _DECODE_ARRIVE, _DECODE_EPOCH = 0, 1, 2


@dataclass
class SimConfig:
    prefill: int = 16
    decode: int = 16
    policy: str = "tidepool"
    speed: float = 1.0  # arrival times are divided by this
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=30.0, tbt_s=0.1))  # the Mooncake paper's setting
    seed: int = 0
    noise: float = 0.05  # sigma of the log-normal jitter on each true prefill time (unknown to the router)
    block_tokens: int = TRACE_BLOCK_TOKENS  # tokens per trace hash id
    policy_options: dict = field(default_factory=dict)  # passed to the policy (e.g. ablation switches)


class SimRequest:
    __slots__ = ("arrival", "prompt", "out", "hashes", "need", "cached", "ttft", "tbt", "prefill_end",
                 "join_step", "join_t", "reject", "done", "end", "decode")

    def __init__(self, t: TraceRequest, speed: float):
        self.arrival, self.prompt, self.out = t.arrival_s / speed, t.input_length, t.output_length
        self.hashes = t.hash_ids
        self.cached, self.ttft, self.tbt, self.reject, self.done = 0, math.nan, math.nan, None, False


class _Prefill:
    def __init__(self, wid: str, cache: BlockCache):
        self.id, self.cache = wid, cache
        self.queue: deque = deque()  # (req, new, cached, ready_at) waiting to start
        self.pairs: deque[tuple[int, int]] = deque()  # (new, cached) of every unfinished prefill
        self.waiting = [0.0, 0.0, 0.0]  # summed features of the queue
        self.running = None  # (req, new, cached, start, end)
        self.load: WorkerLoad | None = None  # last report, reused until the state changes


class _Decode:
    def __init__(self, wid: str, total_blocks: int, block_size: int, max_batch: int):
        self.id, self.total, self.bs, self.max_batch = wid, total_blocks, block_size, max_batch
        self.t, self.step, self.batch, self.ctx = 0.0, 0, 0, 0
        self.free, self.reserved, self.version = total_blocks, 0, 0
        self.finishing: list = []  # heap of (finish_step, seq, req)
        self.waiting: deque = deque()
        self.durs = np.empty(4096)  # duration of every step so far
        self.load: WorkerLoad | None = None

    def record(self, first: float, inc: float, k: int) -> None:
        need = self.step + k
        if need > len(self.durs):
            self.durs = np.concatenate([self.durs, np.empty(max(need, 2 * len(self.durs)) - len(self.durs))])
        self.durs[self.step:need] = first + inc * np.arange(k)


class Simulation:
    def __init__(self, trace: list[TraceRequest], profile: Profile, cfg: SimConfig):
        self.cfg, self.profile = cfg, profile
        self.reqs = [SimRequest(t, cfg.speed) for t in trace]
        self.conductor = Conductor(cfg.policy, profile.estimator(), cfg.slo, block_size=cfg.block_tokens,
                                   seed=cfg.seed, **cfg.policy_options)
        self.rng = np.random.default_rng(cfg.seed)
        self.index = PrefixIndex()
        cache_blocks = profile.prefill_cache_tokens // cfg.block_tokens
        self.prefill = {f"p{i}": _Prefill(f"p{i}", BlockCache(f"p{i}", cache_blocks, self.index))
                        for i in range(cfg.prefill)}
        self.decode = {f"d{i}": _Decode(f"d{i}", profile.decode_kv_tokens // profile.decode_block_size,
                                        profile.decode_block_size, profile.max_batch) for i in range(cfg.decode)}
        self.pool = BlockCache(POOL_HOLDER, profile.pool_tokens // cfg.block_tokens, self.index)
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.fetched_tokens = 0

    # ----- event plumbing -----
    def _push(self, t: float, kind: int, obj) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    def run(self) -> list[SimRequest]:
        handlers = (self._prefill_done, self._decode_arrive, self._decode_epoch)
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
        return [p.load for p in self.prefill.values()] + [d.load for d in self.decode.values()]

    def _arrive(self, r: SimRequest) -> None:
        dec = self.conductor.route(RouteRequest(str(id(r)), r.prompt, r.hashes, r.out), self._loads(),
                                   self.index, self.now)
        if not isinstance(dec, Decision):
            r.reject = dec.reason
            return
        p, d = self.prefill[dec.prefill], self.decode[dec.decode]
        r.decode = d
        r.need = math.ceil((r.prompt + r.out) / d.bs)
        d.reserved += r.need
        p.load = d.load = None
        cached = min(dec.cached_blocks * self.cfg.block_tokens, r.prompt - 1)
        ready = self.now
        if dec.fetch_from is not None and dec.fetch_blocks > 0:
            src = self.pool if dec.fetch_from == "pool" else self.prefill[dec.fetch_from].cache
            src.touch(r.hashes[:dec.cached_blocks])
            link = self.profile.pool_link if dec.fetch_from == "pool" else self.profile.peer_link
            tokens = min(dec.fetch_blocks * self.cfg.block_tokens, cached)
            ready += link.time(tokens * self.profile.kv_bytes_per_token)
            self.fetched_tokens += tokens
        p.cache.touch(r.hashes[:dec.cached_blocks])
        new = r.prompt - cached
        p.queue.append((r, new, cached, ready))
        p.pairs.append((new, cached))
        for i, v in enumerate(prefill_features(new, cached)):
            p.waiting[i] += v
        if p.running is None:
            self._start_prefill(p)

    # ----- prefill -----
    def _start_prefill(self, p: _Prefill) -> None:
        r, new, cached, ready = p.queue.popleft()
        p.load = None
        for i, v in enumerate(prefill_features(new, cached)):
            p.waiting[i] -= v
        # A sibling that finished meanwhile may have left a longer prefix here (vLLM matches at schedule time).
        local = min(p.cache.leading(r.hashes) * self.cfg.block_tokens, r.prompt - 1)
        if local > cached:
            cached, new = local, r.prompt - local
        start = max(self.now, ready)
        dur = float(self.profile.prefill.predict(new, cached))
        if self.cfg.noise > 0:
            dur *= float(self.rng.lognormal(0.0, self.cfg.noise))
        p.running = (r, new, cached, start, start + dur)
        r.cached = cached
        self._push(start + dur, _PREFILL_DONE, p)

    def _prefill_done(self, p: _Prefill) -> None:
        r, new, cached, start, end = p.running
        p.running = None
        p.load = None
        p.pairs.popleft()
        r.ttft, r.prefill_end = self.now - r.arrival, self.now
        self.conductor.observe_prefill(p.id, new, cached, end - start)
        p.cache.insert(r.hashes)
        self.pool.insert(r.hashes)
        d = r.decode
        if r.out <= 1:  # the prefill's token was the whole answer
            d.reserved -= r.need
            d.load = None
            r.tbt, r.done, r.end = 0.0, True, self.now
        else:  # KV streamed layer by layer while computing; the tail lands one link latency after the end
            link = self.profile.peer_link
            arrive = max(self.now + link.latency_s, start + link.time(r.prompt * self.profile.kv_bytes_per_token))
            self._push(arrive, _DECODE_ARRIVE, r)
        if p.queue:
            self._start_prefill(p)

    # ----- decode -----
    def _advance(self, d: _Decode, k: int) -> None:
        """Run k steps of the current batch."""
        if k <= 0:
            return
        m = self.profile.decode
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
            k = self.profile.decode.steps_to_reach(d.batch, d.ctx, self.now - d.t)
            self._advance(d, min(k, d.finishing[0][0] - d.step))
            if d.finishing[0][0] == d.step:
                self._finish_due(d)
        d.waiting.append(r)
        self._admit(d)
        self._schedule(d)

    def _admit(self, d: _Decode) -> None:
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

    def _schedule(self, d: _Decode) -> None:
        d.version += 1
        if d.batch:
            k = d.finishing[0][0] - d.step
            self._push(d.t + self.profile.decode.run_time(d.batch, d.ctx, k), _DECODE_EPOCH, (d, d.version))

    def _decode_epoch(self, obj) -> None:
        d, version = obj
        if version != d.version:
            return
        self._advance(d, d.finishing[0][0] - d.step)
        self._finish_due(d)
        self._admit(d)
        self._schedule(d)

    def _finish_due(self, d: _Decode) -> None:
        while d.finishing and d.finishing[0][0] == d.step:
            r = heapq.heappop(d.finishing)[2]
            d.load = None
            d.free += r.need
            d.batch -= 1
            d.ctx -= r.prompt + r.out
            n = r.out - 1
            gaps = d.durs[r.join_step:r.join_step + n].copy()
            gaps[0] += r.join_t - r.prefill_end  # first gap: from the first token to the first decode step
            k = math.ceil(0.1 * n)  # Mooncake's TBT: mean of the slowest 10% of token gaps
            r.tbt = float(np.partition(gaps, n - k)[n - k:].mean())
            r.done, r.end = True, d.t
