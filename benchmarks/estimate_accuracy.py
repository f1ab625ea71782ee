"""How close the conductor's TTFT estimate comes to the measured TTFT, on the ``chat`` and ``mooncake`` workloads
(or, with ``--estimate tbt``, its TBT estimate to each request's measured time per output token).

    python benchmarks/estimate_accuracy.py --json estimate_accuracy.json
    python benchmarks/estimate_accuracy.py --estimate tbt --workloads chat --serve-args "--num-speculative-tokens 4"

Each workload runs against a fresh ``tidepool serve`` (the built-in tiny model, one prefill and one decode
worker unless ``--serve-args`` says otherwise), so both include the router's cold start: the estimator
begins at the workers' start-up profile and is refitted online from the engine steps they measure.

Every routed request's relative error (measured - estimated) / estimated, measured from the routing
decision to the first token on the dispatcher's clock, goes into the server's histogram
``tidepool_router_estimate_relative_error{estimate="ttft"}``; this script reads ``/metrics`` before and
after the run. The histogram has bucket bounds at -0.25 and 0.25, so the share within +-25% is exact;
median and p90 of |error| are interpolated linearly inside the buckets. A positive error means the request
was slower than estimated.

  chat      the load-test harness's multi-turn chat (session ids: the server keeps the history, so each
            turn's prompt is the whole conversation, mostly a prefix-cache hit)
  mooncake  a scaled Mooncake trace (``--trace``, by default ../shared/traces/conversation_trace.jsonl
            beside the repository; when the file is missing, an agent trace is generated with
            benchmarks/make_traces.py), prompts and times scaled as benchmarks/mooncake_replay.py does

Goal (issue 15): within +-25% for at least 80% of the requests on both workloads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from benchmarks._serve import REPO, add_chat_arguments, chat_workload, served  # noqa: E402
from benchmarks.make_traces import main as make_trace  # noqa: E402
from loadtest.runner import BenchConfig, run_benchmark  # noqa: E402

HISTOGRAM = "tidepool_router_estimate_relative_error"
GOAL = 0.8  # share of requests within +-25%
TRACE = REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"  # beside the repository, not the cwd


def error_buckets(base_url: str, estimate: str = "ttft") -> dict[float, float]:
    """{upper bound: cumulative count} of the server's relative-error histogram for ``estimate``."""
    text = httpx.get(base_url + "/metrics", timeout=10.0).text
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != HISTOGRAM:
            continue
        for s in family.samples:
            if s.name == HISTOGRAM + "_bucket" and s.labels.get("estimate") == estimate:
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value  # summed over models (one here)
    return out


def summarize(before: dict[float, float], after: dict[float, float]) -> dict:
    """Counts of the run (after - before) and what they say: share within +-10/25/50%, share slower than
    estimated, and the |error| quantiles interpolated within the buckets."""
    cum = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    n = cum.get(float("inf"), 0.0)
    if n == 0:
        return {"requests": 0}

    def within(x: float) -> float:  # share with -x < error <= x
        return (cum[x] - cum[-x]) / n

    # |error| <= x is known where both signs have a bound (0.1, 0.25, 0.5) and, since a measured time is
    # never negative (error >= -1), at every positive bound from 1 up.
    points = [(0.0, 0.0)] + [(x, within(x)) for x in (0.1, 0.25, 0.5) if -x in cum]
    points += [(x, cum[x] / n) for x in sorted(cum) if 1.0 <= x < float("inf")]
    xs, cdf = zip(*points, strict=True)

    def quantile(q: float) -> float | None:  # None: beyond the last finite bound
        return float(np.interp(q, cdf, xs)) if q <= cdf[-1] else None

    return {"requests": int(n), "within_10": within(0.1), "within_25": within(0.25), "within_50": within(0.5),
            "slower_than_estimated": 1.0 - cum[0.0] / n, "median_abs_error": quantile(0.5),
            "p90_abs_error": quantile(0.9), "buckets": {str(k): v for k, v in cum.items()}}


def mooncake_config(args: argparse.Namespace, trace: str) -> dict:
    return dict(workload="mooncake", trace=trace, length_scale=args.length_scale, time_scale=args.time_scale,
                max_requests=args.max_requests)


def trace_file(args: argparse.Namespace, tmp: Path) -> str:
    if Path(args.trace).exists():
        return args.trace
    path = tmp / "agent.jsonl"
    print(f"{args.trace} not found: generating an agent trace with benchmarks/make_traces.py", flush=True)
    make_trace(["--kind", "agent", "--seed", str(args.seed), "--requests", str(args.max_requests),
                "--out", str(path)])
    return str(path)


def run(name: str, serve_args: list[str], workload: dict, seed: int, estimate: str = "ttft") -> dict:
    load = load_average()
    with served(serve_args) as srv:
        before = error_buckets(srv.base_url, estimate)
        result = run_benchmark(BenchConfig(
            model=srv.model, backend="grpc", target=srv.grpc_target, seed=seed, percentiles=[50, 90],
            progress=False, print_table=False, **workload))
        after = error_buckets(srv.base_url, estimate)
    out = {**summarize(before, after), "sent": result["sent"], "completed": result["completed"],
           "mean_ttft_ms": result["mean_ttft_ms"], "median_ttft_ms": result["median_ttft_ms"],
           "p90_ttft_ms": result["p90_ttft_ms"], "error_samples": result["error_samples"],
           "load_average_before": load}
    print(f"{name}: done, load average before the run {load}", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="chat,mooncake", help="comma-separated: chat, mooncake")
    p.add_argument("--policy", default="tidepool", help="the router's policy (`tidepool serve --policy`)")
    p.add_argument("--serve-args", default="", help="extra `tidepool serve` arguments")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--estimate", choices=["ttft", "tbt"], default="ttft",
                   help="the estimate to judge: ttft (the goal's), or tbt against each request's time per output token")
    add_chat_arguments(p.add_argument_group("chat"), users=8, turns=5)
    moon = p.add_argument_group("mooncake")
    moon.add_argument("--trace", default=str(TRACE), help="a Mooncake-format trace (default: the shared "
                      "conversation trace beside the repository; generated when missing)")
    moon.add_argument("--length-scale", type=float, default=0.03)
    moon.add_argument("--time-scale", type=float, default=3.0)
    moon.add_argument("--max-requests", type=int, default=60)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    serve_args = ["--policy", args.policy, *args.serve_args.split()]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            if name == "chat":
                workload = chat_workload(args)
            elif name == "mooncake":
                workload = mooncake_config(args, trace_file(args, Path(tmp)))
            else:
                p.error(f"unknown workload {name!r}")
            results[name] = run(name, serve_args, workload, args.seed, args.estimate)

    headers = ["workload", "done/sent", "estimated", "within 10%", "within 25%", "within 50%", "slower",
               "|err| p50", "|err| p90", "TTFT p50 ms", "TTFT p90 ms"]
    pct = lambda v: f"{100 * v:.0f}%" if v is not None else "-"  # noqa: E731
    num = lambda v: f"{v:.2f}" if v is not None else "> 10"  # noqa: E731
    print(format_table(headers, [
        [name, f"{r['completed']}/{r['sent']}", r["requests"], pct(r.get("within_10")), pct(r.get("within_25")),
         pct(r.get("within_50")), pct(r.get("slower_than_estimated")), num(r.get("median_abs_error")),
         num(r.get("p90_abs_error")), r["median_ttft_ms"], r["p90_ttft_ms"]]
        for name, r in results.items()]))
    met = all(r.get("within_25", 0.0) >= GOAL for r in results.values())
    print(f"policy {args.policy}; {args.estimate} estimate; goal (ttft): >= {100 * GOAL:.0f}% within +-25% on "
          f"every workload: {'met' if met else 'not met'}; load average now {load_average()}")
    for name, r in results.items():
        if r["error_samples"]:
            print(f"{name} errors: {r['error_samples']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"goal_met": met, "args": vars(args), "results": results},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
