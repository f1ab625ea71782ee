"""A scaled Mooncake trace replay against ``tidepool serve`` and, side by side, the same load-test command
against ``transformers serve`` on the same tiny checkpoint.

    python benchmarks/mooncake_replay.py ../shared/traces/conversation_trace.jsonl \\
        --length-scale 0.03 --time-scale 3 --max-requests 100 --json mooncake.json

The harness turns each hash id into a fixed block of text, so requests that share hash ids share prompt
prefixes (``--length-scale`` shrinks the 512-token blocks and the output lengths to fit the tiny model's
4,096-token context; ``--time-scale`` stretches the trace's timestamps). Both servers get the identical
request stream through the OpenAI completions API over HTTP, with the same client. ``transformers serve``
rejects the ``ignore_eos`` extension, so neither side gets it: outputs end at EOS or max_tokens.

Placement: Tidepool runs its default deployment (one prefill and one decode worker, one core each);
``transformers serve`` runs one process with torch's default threads (both cores), no continuous
batching (its default; on CPU its paged continuous batching was slower here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from benchmarks._serve import free_port, served, served_command  # noqa: E402
from engine.loader import resolve_model_dir  # noqa: E402
from loadtest.runner import BenchConfig, run_benchmark  # noqa: E402


def bench(args: argparse.Namespace, base_url: str, model: str) -> dict:
    return run_benchmark(BenchConfig(
        model=model, base_url=base_url, workload="mooncake", trace=args.trace, length_scale=args.length_scale,
        time_scale=args.time_scale, max_requests=args.max_requests, ignore_eos=False, seed=args.seed,
        percentiles=[50, 99], progress=False, print_table=False))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", default="../shared/traces/conversation_trace.jsonl")
    p.add_argument("--length-scale", type=float, default=0.03, help="0.03: the longest of the first 100 "
                   "requests (120,633 tokens) becomes 3,540 and fits the 4,096-token context")
    p.add_argument("--time-scale", type=float, default=3.0)
    p.add_argument("--max-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-transformers", action="store_true", help="run the Tidepool half only")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    results: dict[str, dict] = {}
    load = load_average()
    with served([]) as srv:
        results["tidepool serve (1P+1D)"] = bench(args, srv.base_url, srv.model)
    results["tidepool serve (1P+1D)"]["load_average_before"] = load
    print(f"tidepool: done, load average before the run {load}", flush=True)
    if not args.skip_transformers:
        model_dir = str(resolve_model_dir("tiny"))
        port = free_port()
        command = [str(Path(sys.executable).parent / "transformers"), "serve", model_dir, "--host", "127.0.0.1",
                   "--port", str(port), "--device", "cpu"]
        load = load_average()
        with served_command(command, port, model_dir, "/health") as srv:
            results["transformers serve"] = bench(args, srv.base_url, srv.model)
        results["transformers serve"]["load_average_before"] = load
        print(f"transformers: done, load average before the run {load}", flush=True)

    headers = ["server", "done/sent", "in tok", "out tok", "cached tok", "TTFT mean", "TTFT p50", "TTFT p99",
               "TPOT p50", "ITL p99", "E2EL p50", "req/s", "tok/s out"]
    print(format_table(headers, [
        [name, f"{r['completed']}/{r['sent']}", r["total_input_tokens"], r["total_output_tokens"],
         r["total_cached_tokens"], r["mean_ttft_ms"], r["median_ttft_ms"], r["p99_ttft_ms"], r["median_tpot_ms"],
         r["p99_itl_ms"], r["median_e2el_ms"], r["request_throughput"], r["output_throughput"]]
        for name, r in results.items()]))
    print(f"(ms) load average now {load_average()}")
    for name, r in results.items():
        if r["error_samples"]:
            print(f"{name} errors: {r['error_samples']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
