"""The simulated workers' state (router/simulator.py drives them): the run's settings, one request, a
prefill worker's queue and a decode worker's batch."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from router.autoscale_rules import AutoscaleConfig
from router.conductor import SLO, WorkerLoad
from router.estimator import DecodeModel
from router.prefix_cache import BlockCache
from router.trace import TRACE_BLOCK_TOKENS, TraceRequest


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
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)  # off while it has no bounds
    worker_start_s: float = 60.0  # an added worker serves this long after it was asked for
    # A mixed fleet: prefill worker n computes in prefill_slowdown[n % len] times the profile's time, decode
    # worker n steps in decode_slowdown[n % len] times it (their true speeds, which the router learns from
    # their steps unless learn_worker_speeds is off); (): all alike.
    prefill_slowdown: tuple[float, ...] = ()
    decode_slowdown: tuple[float, ...] = ()
    learn_worker_speeds: bool = True

    def __post_init__(self) -> None:
        """ValueError naming the first setting that cannot describe a cluster or a replay."""
        for name, value in (("prefill", self.prefill), ("decode", self.decode), ("speed", self.speed),
                            ("ttft_slo_s", self.slo.ttft_s), ("tbt_slo_s", self.slo.tbt_s),
                            ("block_tokens", self.block_tokens)):
            if not value > 0:  # NaN too
                raise ValueError(f"{name} must be positive, got {value}")
        if not self.noise >= 0:
            raise ValueError(f"noise must be at least 0, got {self.noise}")
        for name, factors in (("prefill", self.prefill_slowdown), ("decode", self.decode_slowdown)):
            if not all(f > 0 for f in factors):
                raise ValueError(f"--{name}-slowdown factors must be positive, got {list(factors)}")
        if self.autoscale.bounds:
            self.autoscale.check({"prefill": self.prefill, "decode": self.decode})
            if not self.worker_start_s >= 0:
                raise ValueError(f"--worker-start-s must be at least 0, got {self.worker_start_s}")


class SimRequest:
    __slots__ = ("arrival", "prompt", "out", "hashes", "need", "cached", "ttft", "tbt", "first_t",
                 "join_step", "join_t", "reject", "done", "end", "decode")

    def __init__(self, t: TraceRequest, speed: float):
        self.arrival, self.prompt, self.out = t.arrival_s / speed, t.input_length, t.output_length
        self.hashes = t.hash_ids
        self.cached, self.ttft, self.tbt, self.reject, self.done = 0, math.nan, math.nan, None, False


class SimJob:
    """A request in a prefill worker's queue: its routed estimate (new, cached tokens), when its fetch
    lands (None while the fetch waits for its source to compute the prefix) and the prefix tokens the
    fetch brings."""

    __slots__ = ("req", "new", "cached", "ready", "fetched")

    def __init__(self, req: SimRequest, new: int, cached: int, ready: float | None):
        self.req, self.new, self.cached, self.ready, self.fetched = req, new, cached, ready, 0


class SimPrefill:
    def __init__(self, wid: str, cache: BlockCache, slowdown: float = 1.0):
        self.id, self.cache, self.slowdown = wid, cache, slowdown  # its prefills take slowdown x the profile's
        self.queue: deque[SimJob] = deque()  # waiting to start, in order
        self.pairs: deque[tuple[int, int]] = deque()  # (new, cached) of every unfinished prefill
        self.waiting = [0.0, 0.0, 0.0]  # summed features of the queue
        self.running = None  # (req, new, cached, start, end)
        # Fetches from here waiting for a prefill here to compute their prefix, by that prefill's request:
        # (job, its worker, prefix blocks, blocks to copy).
        self.waiters: dict[int, list] = {}
        self.load: WorkerLoad | None = None  # last report, reused until the state changes

    def producer(self, hashes, blocks: int) -> SimRequest | None:
        """The first prefill running or queued here that computes the first ``blocks`` blocks of
        ``hashes`` (chained hashes: the last of them matching is enough)."""
        key = hashes[blocks - 1]
        jobs = ([self.running[0]] if self.running else []) + [j.req for j in self.queue]
        return next((r for r in jobs if len(r.hashes) >= blocks and r.hashes[blocks - 1] == key), None)


class SimDecode:
    def __init__(self, wid: str, total_blocks: int, block_size: int, max_batch: int, model: DecodeModel):
        self.id, self.total, self.bs, self.max_batch = wid, total_blocks, block_size, max_batch
        self.model = model  # its true step times (the profile's, or a slower worker's)
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
