"""Disaggregated vs colocated serving on this machine's cores: the same workload, long prompts arriving
while other requests decode, against

  (a) one colocated worker with both cores:  tidepool serve --colocated 1 --threads-per-worker 2
  (b) one prefill and one decode worker, one core each:
                                              tidepool serve --prefill 1 --decode 1 --threads-per-worker 1

    python benchmarks/disagg_vs_colocated.py --duration-s 90 --json disagg.json

The workload is written as a Mooncake-format trace (unique hash ids, so no prefix is shared) and replayed
by the load-test harness over Tidepool's gRPC API (every chunk carries token ids, so each token counts
even when the tiny model's bytes are not printable): Poisson arrivals of short-prompt/long-output
requests plus, at a lower Poisson rate, long-prompt/short-output ones. In (a) a long prefill runs in the
same steps as the decodes and stalls them; in (b) it runs on the other core while decoding goes on.

Goodput is recomputed for both sides after the runs with the same SLOs, taken from (a)'s medians times
``--slo-scale``: a request is good when its TTFT and its TPOT ((last chunk - first chunk) / (tokens - 1))
both meet them; goodput = good requests / run duration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from benchmarks._serve import served  # noqa: E402
from loadtest.runner import BenchConfig, run_benchmark  # noqa: E402
from router.trace import TRACE_BLOCK_TOKENS  # noqa: E402

SIDES = {
    "a colocated (1 worker x 2 threads)": ["--colocated", "1", "--threads-per-worker", "2"],
    "b disagg (1P + 1D, 1 thread each)": ["--prefill", "1", "--decode", "1", "--threads-per-worker", "1"],
}
# The router's admission control off on both sides (SLOs it can never miss): every request is served,
# and goodput is judged by the same SLOs afterwards instead of by each side's own predictions.
NO_ADMISSION = ["--ttft-slo-s", "86400", "--tbt-slo-ms", "86400000"]


def make_trace(args: argparse.Namespace) -> list[dict]:
    """Two Poisson streams merged: short prompts that decode long, and long prompts that decode little."""
    rng = np.random.default_rng(args.seed)
    rows, next_id = [], 0
    for rate, n_in, n_out in ((args.short_rate, args.short_input, args.short_output),
                              (args.long_rate, args.long_input, args.long_output)):
        t = rng.exponential(1 / rate)
        while t < args.duration_s:
            n_blocks = -(-n_in // TRACE_BLOCK_TOKENS)
            rows.append({"timestamp": round(t * 1000), "input_length": n_in, "output_length": n_out,
                         "hash_ids": list(range(next_id, next_id + n_blocks))})
            next_id += n_blocks
            t += rng.exponential(1 / rate)
    return sorted(rows, key=lambda r: r["timestamp"])


def per_request(result: dict) -> list[tuple[float, float | None]]:
    """(TTFT ms, TPOT ms or None) of each completed request, from the harness's detailed arrays."""
    out = []
    for status, ttft, itls, n in zip(result["statuses"], result["ttfts"], result["itls"], result["output_lens"],
                                     strict=True):
        if status == "ok":
            out.append((ttft * 1000, sum(itls) * 1000 / (n - 1) if n > 1 else None))
    return out


def goodput(result: dict, ttft_ms: float, tpot_ms: float) -> float:
    good = sum(1 for ttft, tpot in per_request(result) if ttft <= ttft_ms and (tpot is None or tpot <= tpot_ms))
    return good / result["duration"]


def run_side(serve_args: list[str], trace: Path) -> dict:
    with served([*serve_args, *NO_ADMISSION]) as srv:
        return run_benchmark(BenchConfig(
            model=srv.model, backend="grpc", target=srv.grpc_target, workload="mooncake", trace=str(trace),
            percentiles=[50, 99], save_detailed=True, progress=False, print_table=False))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=90.0, help="arrivals span this long")
    p.add_argument("--short-rate", type=float, default=1.0, help="short-prompt requests per second")
    p.add_argument("--short-input", type=int, default=32)
    p.add_argument("--short-output", type=int, default=128)
    p.add_argument("--long-rate", type=float, default=0.25, help="long-prompt requests per second")
    p.add_argument("--long-input", type=int, default=768)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--slo-scale", type=float, default=2.0, help="SLO = (a)'s median TTFT and TPOT times this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    rows = make_trace(args)
    n_long = sum(r["input_length"] == args.long_input for r in rows)
    print(f"workload: {len(rows) - n_long} x ({args.short_input} in, {args.short_output} out) at "
          f"{args.short_rate}/s + {n_long} x ({args.long_input} in, {args.long_output} out) at {args.long_rate}/s, "
          f"Poisson, over {args.duration_s:.0f} s")
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
        results = {}
        for name, serve_args in SIDES.items():
            load = load_average()
            results[name] = run_side(serve_args, trace)
            results[name]["load_average_before"] = load
            print(f"{name}: done, load average before the run {load}", flush=True)

    base = results[next(iter(SIDES))]
    base_rows = per_request(base)
    slo_ttft = args.slo_scale * statistics.median(t for t, _ in base_rows)
    slo_tpot = args.slo_scale * statistics.median(t for _, t in base_rows if t is not None)
    headers = ["server", "done/sent", "rejected", "TTFT p50", "TTFT p99", "ITL p99", "TPOT p99", "tok/s", "goodput"]
    table = []
    for name, r in results.items():
        r["goodput_at_equal_slo"] = goodput(r, slo_ttft, slo_tpot)
        table.append([name, f"{r['completed']}/{r['sent']}", r["rejected"], r["median_ttft_ms"], r["p99_ttft_ms"],
                      r["p99_itl_ms"], r["p99_tpot_ms"], r["output_throughput"], r["goodput_at_equal_slo"]])
    a, b = (results[n] for n in SIDES)
    print(format_table(headers, table))
    print(f"(ms; goodput in req/s at SLO TTFT <= {slo_ttft:.0f} ms and TPOT <= {slo_tpot:.1f} ms, "
          f"{args.slo_scale:g}x (a)'s medians)")
    itl_ratio = b["p99_itl_ms"] / a["p99_itl_ms"] if a["p99_itl_ms"] else float("nan")
    good_ratio = b["goodput_at_equal_slo"] / a["goodput_at_equal_slo"] if a["goodput_at_equal_slo"] else float("inf")
    print(f"(b)/(a): p99 ITL {itl_ratio:.2f} (goal <= 0.33), goodput {good_ratio:.2f}x (goal >= 1.5x); "
          f"load average now {load_average()}")
    if args.json:
        summary = {"slo_ttft_ms": slo_ttft, "slo_tpot_ms": slo_tpot, "itl_p99_ratio": itl_ratio,
                   "goodput_ratio": good_ratio, "args": vars(args)}
        for r in results.values():  # per-request arrays stay out of the file
            for key in ("request_ids", "statuses", "input_lens", "output_lens", "cached_tokens", "ttfts", "itls",
                        "errors", "generated_texts"):
                r.pop(key, None)
        Path(args.json).write_text(json.dumps({"summary": summary, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
