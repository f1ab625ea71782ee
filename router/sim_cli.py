"""Simulation runs: one policy or all of them on a trace, the sweep for the highest request rate that
keeps 90% of requests within both SLOs, and the ``tidepool simulate`` command. The discrete-event model
itself is router/simulator.py, a run's metrics router/sim_report.py."""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from router.autoscale_rules import add_autoscale_arguments, autoscale_from_args
from router.conductor import SLO
from router.policies import POLICIES
from router.profile import PRESETS, Profile, resolve_profile
from router.sim_report import policy_label, summarize
from router.simulator import SimConfig, Simulation
from router.trace import TraceError, TraceRequest, load_trace

SLO_TARGET = 0.9  # --sweep: the share of requests that must meet both SLOs


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="trace-driven simulation of the routing policies",
                              description="Replay a Mooncake-format trace through the routing policies on a "
                                          "simulated cluster, or sweep for the highest request rate that keeps "
                                          "90% of requests within both SLOs.")
    d = SimConfig()
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--prefill", type=int, default=d.prefill, help="prefill workers")
    p.add_argument("--decode", type=int, default=d.decode, help="decode workers")
    p.add_argument("--policy", default=d.policy, choices=[*POLICIES, "all"],
                   help="the routing policy, or all of them side by side")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=list(PRESETS), help="analytic cost profile")
    src.add_argument("--profile", help="profile JSON written by live profiling")
    p.add_argument("--speed", type=float, default=d.speed, help="compress trace time by this factor")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the trace's first N requests")
    p.add_argument("--ttft-slo-s", type=float, default=d.slo.ttft_s, help="time-to-first-token SLO")
    p.add_argument("--tbt-slo-ms", type=float, default=d.slo.tbt_s * 1000, help="time-between-tokens SLO")
    p.add_argument("--sweep", action="store_true", help="find the max request rate with >= 90%% meeting both SLOs")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the jitter and of random policies")
    p.add_argument("--noise", type=float, default=d.noise, help="sigma of log-normal jitter on true prefill times")
    p.add_argument("--jobs", type=int, default=1, help="policies simulated in parallel processes")
    add_autoscale_arguments(p, ("prefill", "decode"))
    p.add_argument("--worker-start-s", type=float, default=d.worker_start_s,
                   help="with --autoscale-ROLE: seconds an added worker takes to serve (loading, profiling)")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-slowdown", type=_factors, default=getattr(d, f"{role}_slowdown"), metavar="F[,F...]",
                       help=f"a mixed fleet: {role} worker n runs in the n-th factor (cycling) times the "
                            "profile's time, e.g. 1,2: every other worker half as fast")
    p.add_argument("--no-worker-speeds", dest="learn_worker_speeds", action="store_false",
                   help="the router prices every worker by the shared model, not by its measured speed")
    p.add_argument("--json", dest="json_path", help="write the results here")
    p.set_defaults(func=run_simulate)
    return p


def _factors(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(f) for f in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def simulate(trace: list[TraceRequest], profile: Profile, cfg: SimConfig) -> dict:
    """One run's metrics (`sim_report.summarize`), and the worker-seconds it took from the first arrival to the
    last request's end: each role's count times that, or what the autoscaler counted (its report with them)."""
    sim = Simulation(trace, profile, cfg)
    res = summarize(sim.run(), cfg, sim.fetched_tokens, sim.replicated_tokens)
    if sim.autoscaler is None:
        res["worker_seconds"] = {"prefill": cfg.prefill * res["duration_s"], "decode": cfg.decode * res["duration_s"]}
    else:
        res["autoscale"] = sim.autoscaler.report()
        res["worker_seconds"] = res["autoscale"]["worker_seconds"]
    return res


def sweep(trace: list[TraceRequest], profile: Profile, cfg: SimConfig, iterations: int = 5) -> dict:
    """The highest request rate (trace time compressed by ``speed``) at which at least 90% of the
    requests meet both SLOs: double or halve from cfg.speed to bracket it, then bisect geometrically."""
    runs: list[dict] = []

    def passes(speed: float) -> bool:
        res = simulate(trace, profile, replace(cfg, speed=speed))
        runs.append(res)
        return res["slo_attainment"] >= SLO_TARGET

    lo = hi = None
    s = cfg.speed
    for _ in range(12):
        if passes(s):
            lo = s
        else:
            hi = s
        if lo is not None and hi is not None:
            break
        s = s * 2 if hi is None else s / 2
    for _ in range(iterations if lo is not None and hi is not None else 0):
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    best = max((r for r in runs if r["slo_attainment"] >= SLO_TARGET), key=lambda r: r["request_rate"],
               default=None)
    return {
        "policy": policy_label(cfg),
        "max_rate_at_90pct_slo": None if best is None else best["request_rate"],
        "speed": None if best is None else best["speed"],
        "at_max_rate": best,
        "runs": [{"speed": r["speed"], "request_rate": r["request_rate"], "slo_attainment": r["slo_attainment"]}
                 for r in runs],
    }


def run_one(trace: list[TraceRequest], profile: Profile, cfg: SimConfig, do_sweep: bool) -> dict:
    """One policy's metrics at cfg.speed, or (do_sweep) at the highest rate meeting 90% of SLOs."""
    if not do_sweep:
        return simulate(trace, profile, cfg)
    res = sweep(trace, profile, cfg)
    return {**(res["at_max_rate"] or {"policy": res["policy"]}),
            "max_rate_at_90pct_slo": res["max_rate_at_90pct_slo"], "sweep_runs": res["runs"]}


def run_configs(trace: list[TraceRequest], profile: Profile, cfgs: list[SimConfig], do_sweep: bool,
                jobs: int = 1) -> list[dict]:
    """run_one for each config, in ``jobs`` processes (each simulation is single-threaded)."""
    if jobs <= 1 or len(cfgs) == 1:
        return [run_one(trace, profile, c, do_sweep) for c in cfgs]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run_one, [trace] * len(cfgs), [profile] * len(cfgs), cfgs, [do_sweep] * len(cfgs)))


def _fmt(v, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def format_table(results: list[dict]) -> str:
    w = max([13] + [len(r["policy"]) + 1 for r in results])
    head = (f"{'policy':<{w}}{'rate/s':>8}{'TTFT mean':>10}{'p50':>7}{'p99':>8}{'TBT ms mean':>12}{'p99':>7}"
            f"{'SLO ok':>8}{'goodput':>9}{'cache hit':>10}{'rejected':>9}{'max@90%':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        t, b = r.get("ttft_s", {}), r.get("tbt_s", {})
        lines.append(
            f"{r['policy']:<{w}}{_fmt(r.get('request_rate')):>8}{_fmt(t.get('mean')):>10}{_fmt(t.get('p50')):>7}"
            f"{_fmt(t.get('p99')):>8}{_fmt(b.get('mean'), 1e3, 1):>12}{_fmt(b.get('p99'), 1e3, 1):>7}"
            f"{_fmt(r.get('slo_attainment'), 100, 1) + '%':>8}{_fmt(r.get('goodput_rps')):>9}"
            f"{_fmt(r.get('cache_hit_rate'), 100, 1) + '%':>10}{r.get('rejected', 0):>9}"
            f"{_fmt(r.get('max_rate_at_90pct_slo')):>9}")
    return "\n".join(lines)


def run_simulate(args: argparse.Namespace) -> int:
    try:
        cfg = SimConfig(prefill=args.prefill, decode=args.decode, speed=args.speed,
                        slo=SLO(args.ttft_slo_s, args.tbt_slo_ms / 1000), seed=args.seed, noise=args.noise,
                        autoscale=autoscale_from_args(args, ("prefill", "decode")), worker_start_s=args.worker_start_s,
                        prefill_slowdown=args.prefill_slowdown, decode_slowdown=args.decode_slowdown,
                        learn_worker_speeds=args.learn_worker_speeds)
        profile = resolve_profile(args.preset, args.profile)
        trace = load_trace(args.trace, args.max_requests)
    except (TraceError, ValueError, OSError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    results = run_configs(trace, profile, [replace(cfg, policy=name) for name in policies], args.sweep, args.jobs)
    print(f"{len(trace)} requests, {args.prefill}P+{args.decode}D, profile {profile.name}, "
          f"SLO TTFT {args.ttft_slo_s:g} s / TBT {args.tbt_slo_ms:g} ms"
          + ("" if args.sweep else f", speed {args.speed:g}x"))
    print(format_table(results))
    for r in results:
        print(f"{r['policy']}: worker-seconds " + ", ".join(f"{role} {s:.0f}" for role, s in r["worker_seconds"].items())
              + "".join(f"; {role} {b[0]}..{b[1]} workers, most {r['autoscale']['most_workers'][role]}, added "
                        f"{r['autoscale']['added'][role]}, drained {r['autoscale']['drained'][role]}"
                        for role, b in r.get("autoscale", {}).get("bounds", {}).items()))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"profile": profile.to_dict(), "config": {
                "prefill": args.prefill, "decode": args.decode, "speed": args.speed, "requests": len(trace),
                "ttft_slo_s": args.ttft_slo_s, "tbt_slo_ms": args.tbt_slo_ms, "seed": args.seed,
                "noise": args.noise, "sweep": args.sweep, "prefill_slowdown": list(args.prefill_slowdown),
                "decode_slowdown": list(args.decode_slowdown),
                "learn_worker_speeds": args.learn_worker_speeds, "autoscale": {
                    role: list(b) for role, b in cfg.autoscale.bounds.items()}}, "results": results}, f, indent=2)
    return 0
