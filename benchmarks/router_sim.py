"""Router benchmark (issues 6 and 15): every policy on a Mooncake-format trace with 16 prefill + 16 decode
instances of the `llama3-70b-a800` profile, TTFT SLO 30 s and TBT SLO 100 ms (the paper's setting), an
ablation of tidepool's mechanisms, plus the router's decision latency with 1,000 prefill workers and a
1M-block prefix index.

Run from the repository root, on the Mooncake conversation trace or on a generated prefill-bound one
(benchmarks/make_traces.py; --generate makes it in memory from --seed):
    python -m benchmarks.router_sim --trace ../shared/traces/conversation_trace.jsonl --json router_sim.json
    python -m benchmarks.router_sim --generate docqa --seed 0 --skip-latency

1. The trace at its own pace: mean/p50/p99 TTFT and TBT, SLO attainment, cache hits, next to the mean
   TTFTs the Mooncake paper reports for its cluster (random 19.65 s, load balancing 5.27 s, global
   cache-aware 3.07 s; conversation trace only).
2. `--sweep` for each policy and each ablation row: the highest request rate (trace time compressed)
   with >= 90% of requests meeting both SLOs; the goal is tidepool >= 1.15 x mooncake. The ablation
   rows switch one mechanism at a time: Algorithm 1 with decode picked by free KV blocks, tidepool
   without counting the prefixes in flight, tidepool with hot-prefix replication.
3. Decision latency: `Conductor.route` p50/p99 over 1,000 prefill + 1,000 decode worker reports (1% of
   them refreshed between decisions, as live reports arrive) and an index of 1M blocks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np

from benchmarks import make_traces
from router.conductor import SLO, Conductor, RouteRequest, WorkerLoad
from router.policies import POLICIES
from router.prefix_cache import PrefixIndex
from router.profile import PRESETS
from router.sim_cli import format_table, run_configs
from router.simulator import SimConfig
from router.trace import load_trace

PAPER_MEAN_TTFT_S = {"random": 19.65, "least_loaded": 5.27, "mooncake": 3.07}  # Mooncake (FAST'25)
# One mechanism switched at a time (policy, options): see the module docstring.
ABLATION = [("mooncake", {"decode_by": "free_blocks"}), ("tidepool", {"inflight": False}),
            ("tidepool", {"replicate": True})]


def decision_latency(workers: int = 1000, decode_workers: int = 1000, blocks: int = 1_000_000,
                     chain: int = 500, samples: int = 3000, seed: int = 0) -> dict:
    """route() latency over `workers` prefill reports and an index of `blocks` 16-token blocks, laid out
    as prefix chains of `chain` blocks (8k-token prompts) each held by 1-3 workers."""
    rng = random.Random(seed)
    index = PrefixIndex()
    ids = [f"p{i}" for i in range(workers)]
    chains = []
    for c in range(blocks // chain):
        hashes = [(c << 20) | i for i in range(chain)]
        owner, *others = rng.sample(ids, rng.randint(1, 3))
        index.add(owner, hashes)
        for w in others:  # replicas hold part of the prefix
            index.add(w, hashes[: rng.randint(chain // 2, chain)])
        chains.append(hashes)
    indexed = len(index)

    def prefill_load(w: str, now: float) -> WorkerLoad:
        queue = [(rng.randint(500, 8000), rng.randint(0, 8000)) for _ in range(rng.randint(0, 4))]
        return WorkerLoad(w, "prefill", True, queue, int(bool(queue)), 0, 5000, 10_000, 16, now)

    def decode_load(i: int, now: float) -> WorkerLoad:
        running = rng.randint(0, 128)
        return WorkerLoad(f"d{i}", "decode", True, (), running, running * 9000, rng.randint(0, 80_000), 83_000,
                          16, now)

    now = time.time()
    loads = [prefill_load(w, now) for w in ids] + [decode_load(i, now) for i in range(decode_workers)]
    conductor = Conductor("tidepool", PRESETS["llama3-70b-a800"]().estimator(), SLO(30.0, 0.1), block_size=16)
    gc.collect()
    gc.freeze()  # the index is long-lived: keep it out of the collector's way, as a gateway would
    times, cpu = [], []
    for k in range(samples + 200):
        now = time.time()
        for _ in range(len(loads) // 100):  # reports keep arriving between decisions
            i = rng.randrange(len(loads))
            loads[i] = prefill_load(ids[i], now) if i < workers else decode_load(i - workers, now)
        base = rng.choice(chains)
        prompt = base[: rng.randint(chain // 4, chain)] + [rng.getrandbits(62) for _ in range(rng.randint(0, 100))]
        req = RouteRequest(f"r{k}", len(prompt) * 16 + 7, prompt, 256)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        conductor.route(req, loads, index)
        if k >= 200:  # warm-up excluded
            times.append(time.perf_counter_ns() - t0)
            cpu.append(time.thread_time_ns() - c0)
    gc.unfreeze()
    us, cpu_us = np.array(times) / 1e3, np.array(cpu) / 1e3
    return {"prefill_workers": workers, "decode_workers": decode_workers, "indexed_blocks": indexed,
            "samples": samples, "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "max_us": float(us.max()), "cpu_p50_us": float(np.percentile(cpu_us, 50)),
            "cpu_p99_us": float(np.percentile(cpu_us, 99)), "load_average_1m": os.getloadavg()[0],
            "cpus": os.cpu_count()}


def _load(args: argparse.Namespace) -> tuple[list, str]:
    if args.generate is None:
        return load_trace(args.trace, args.max_requests), args.trace
    rows = make_traces.generate(args.generate, args.seed)
    print(f"generated {make_traces.describe(rows, args.generate)}")
    with tempfile.TemporaryDirectory() as tmp:  # through the one trace reader, as a file would go
        path = os.path.join(tmp, "trace.jsonl")
        make_traces.write(rows, path)
        return load_trace(path, args.max_requests), f"generated {args.generate}, seed {args.seed}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--trace", default="../shared/traces/conversation_trace.jsonl")
    src.add_argument("--generate", choices=list(make_traces.KINDS), help="a prefill-bound trace made from --seed")
    ap.add_argument("--preset", default="llama3-70b-a800", choices=list(PRESETS))
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=2, help="policies simulated in parallel processes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-latency", action="store_true", help="leave out the decision-latency measurement")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)

    trace, source = _load(args)
    profile = PRESETS[args.preset]()
    base = SimConfig(prefill=args.prefill, decode=args.decode, slo=SLO(30.0, 0.1), seed=args.seed)
    cfgs = [replace(base, policy=name) for name in POLICIES]
    cfgs += [replace(base, policy=name, policy_options=opts) for name, opts in ABLATION]
    head = (f"{source}: {len(trace)} requests, {args.prefill}P+{args.decode}D, {profile.name}, "
            "SLO TTFT 30 s / TBT 100 ms")

    t0 = time.time()
    at_trace_rate = run_configs(trace, profile, cfgs, False, args.jobs)
    print(f"== {head}, the trace at its own pace ({time.time() - t0:.0f} s)")
    print(format_table(at_trace_rate))
    if args.generate is None:
        print("\nmean TTFT vs the Mooncake paper's cluster:")
        for r in at_trace_rate:
            if r["policy"] in PAPER_MEAN_TTFT_S:
                print(f"  {r['policy']:<13} ours {r['ttft_s']['mean']:6.2f} s   "
                      f"paper {PAPER_MEAN_TTFT_S[r['policy']]:6.2f} s")

    t0 = time.time()
    swept = run_configs(trace, profile, cfgs, True, args.jobs)
    print(f"\n== {head}, each policy at its highest rate with >= 90% meeting both SLOs ({time.time() - t0:.0f} s)")
    print(format_table(swept))
    rate = {r["policy"]: r["max_rate_at_90pct_slo"] for r in swept}
    ratio = rate["tidepool"] / rate["mooncake"] if rate["tidepool"] and rate["mooncake"] else None
    print(f"\ntidepool / mooncake max rate at 90% SLO: {ratio:.2f}x (goal >= 1.15x)" if ratio else
          "\ntidepool / mooncake: a policy never reached 90% SLO attainment")
    if rate["mooncake"]:
        print("ablation, max rate over mooncake's: " + ", ".join(
            f"{r['policy']} {r['max_rate_at_90pct_slo'] / rate['mooncake']:.2f}x" for r in swept
            if r["policy"].startswith(("mooncake", "tidepool")) and r["max_rate_at_90pct_slo"]))

    latency = None
    if not args.skip_latency:
        t0 = time.time()
        latency = decision_latency(seed=args.seed)
        print(f"\n== decision latency, tidepool policy ({time.time() - t0:.0f} s incl. building the index): "
              f"{latency['prefill_workers']} prefill + {latency['decode_workers']} decode workers, "
              f"{latency['indexed_blocks']:,} indexed blocks: p50 {latency['p50_us']:.0f} us, "
              f"p99 {latency['p99_us']:.0f} us (goal p99 < 1000 us); CPU time p50 {latency['cpu_p50_us']:.0f} us, "
              f"p99 {latency['cpu_p99_us']:.0f} us; load average {latency['load_average_1m']:.1f} on "
              f"{latency['cpus']} CPUs")

    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"setting": head, "profile": profile.to_dict(), "at_trace_rate": at_trace_rate,
                       "sweep": swept, "max_rate_at_90pct_slo": rate, "tidepool_over_mooncake": ratio,
                       "paper_mean_ttft_s": PAPER_MEAN_TTFT_S, "decision_latency": latency}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
