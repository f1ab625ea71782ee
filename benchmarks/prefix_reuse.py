"""Prefix reuse: multi-turn chat with prefix caching and the KV pool on, against caching off.

    python benchmarks/prefix_reuse.py --users 6 --turns 4 --json prefix_reuse.json

The load-test harness's ``chat`` workload: each user's conversation carries a session id, so the server keeps
the history and every turn's prompt is the whole conversation so far (shared system prompt + earlier
turns + answers) plus the new message. Run over Tidepool's gRPC API against

  (on)  tidepool serve                        (prefix caching on, blocks published to the Redis pool)
  (off) tidepool serve --no-prefix-caching

With caching on, a turn recomputes only its new message: the previous turn's prompt is in the prefill
worker's cache (or the pool), its answer's blocks were shared by the decode worker, and the session keeps
the turn's token ids, so the next prompt starts with exactly them. Off, it recomputes the whole history,
which grows every turn. No cache can serve the new messages (and each user's first system prompt until
one is computed): the table's "ceiling" is the share of prompt tokens left, the most any cache could hit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from benchmarks._serve import add_chat_arguments, chat_workload, served  # noqa: E402
from loadtest.runner import BenchConfig, run_benchmark  # noqa: E402

SIDES = {"caching on (+ pool)": [], "caching off": ["--no-prefix-caching"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_chat_arguments(p, users=6, turns=4)
    p.add_argument("--serve-args", default="", help="extra `tidepool serve` arguments for both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    results = {}
    for name, side_args in SIDES.items():
        load = load_average()
        with served([*args.serve_args.split(), *side_args]) as srv:
            results[name] = run_benchmark(BenchConfig(
                model=srv.model, backend="grpc", target=srv.grpc_target, **chat_workload(args),
                seed=args.seed, percentiles=[50, 99], progress=False, print_table=False))
        results[name]["load_average_before"] = load
        print(f"{name}: done, load average before the run {load}", flush=True)

    headers = ["server", "done/sent", "prompt tok", "cache-hit tok", "hit %", "TTFT mean", "TTFT p50",
               "TTFT p99", "TPOT p99"]
    print(format_table(headers, [
        [name, f"{r['completed']}/{r['sent']}", r["total_input_tokens"], r["total_cached_tokens"],
         100 * r["cache_hit_rate"], r["mean_ttft_ms"], r["median_ttft_ms"], r["p99_ttft_ms"], r["p99_tpot_ms"]]
        for name, r in results.items()]))
    on, off = results.values()
    reduction = 1 - on["mean_ttft_ms"] / off["mean_ttft_ms"] if off["mean_ttft_ms"] else float("nan")
    # Never cacheable: every turn's new message, and the shared system prompt once.
    fresh = args.users * args.turns * args.message_len + args.system_len
    ceiling = 1 - fresh / on["total_input_tokens"] if on["total_input_tokens"] else float("nan")
    print(f"(ms) mean TTFT {100 * reduction:.0f}% lower with caching; {100 * on['cache_hit_rate']:.1f}% of prompt "
          f"tokens from cache against a ceiling of {100 * ceiling:.1f}% (new messages are never cached); "
          f"load average now {load_average()}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"mean_ttft_reduction": reduction, "cache_ceiling": ceiling, "args": vars(args), "results": results},
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
