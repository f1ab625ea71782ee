"""``tidepool bench``: drive any OpenAI-compatible server, or Tidepool's gRPC API, and report like
``vllm bench serve``."""

from __future__ import annotations

import argparse
import math
import os
import sys

from loadtest.metrics import parse_goodput
from loadtest.runner import BenchConfig, run_benchmark


def _slo(pair: str) -> dict[str, float]:
    try:
        return parse_goodput([pair])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="load-test a serving endpoint (vllm bench serve metrics)",
        description="Replay a Mooncake trace, multi-turn chats or random prompts against an OpenAI-compatible "
                    "HTTP server or Tidepool's gRPC API, and report TTFT/TPOT/ITL/E2EL like vllm bench serve.")
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=("openai", "grpc"), default="openai")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible server (openai backend)")
    g.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the gRPC API (grpc backend)")
    g.add_argument("--model", required=True, help="model name sent with every request")
    g.add_argument("--endpoint", choices=("chat", "completions"), default=None,
                   help="API to call (default: chat for the chat workload, completions otherwise)")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--timeout-s", type=float, default=6 * 3600, help="per-request timeout")

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("mooncake", "chat", "random"), default="random")
    g.add_argument("--trace", help="Mooncake-format JSONL trace (mooncake workload)")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply trace gaps (0.5 = twice as fast)")
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply trace lengths; blocks become round(512 * scale) tokens")
    g.add_argument("--max-requests", type=int, default=None, help="replay only the first N trace rows")
    g.add_argument("--num-users", type=int, default=8, help="chat: concurrent conversations")
    g.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    g.add_argument("--think-time-s", type=float, default=1.0, help="chat: pause after each answer")
    g.add_argument("--no-session", dest="use_session", action="store_false",
                   help="chat: resend the full history each turn instead of a session id")
    g.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens; chat: tokens per turn")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens per request (random, chat)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths in [L(1-r), L(1+r)]")
    g.add_argument("--prefix-len", type=int, default=0,
                   help="random: shared prefix tokens; chat: shared system prompt tokens")
    g.add_argument("--num-prompts", type=int, default=1000, help="random: number of requests")
    g.add_argument("--chars-per-token", type=float, default=1.0,
                   help="characters of synthetic text per intended token (1 for byte-level tokenizers)")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("arrivals and requests")
    g.add_argument("--request-rate", type=float, default=None,
                   help="requests (chat: conversations) per second; default inf, or the trace's timestamps")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate exactly max_tokens (vLLM/Tidepool extension)")
    g.add_argument("--temperature", type=float, default=0.0)

    g = p.add_argument_group("output")
    g.add_argument("--goodput", nargs="+", type=_slo, default=[], metavar="NAME:MS",
                   help="SLOs for goodput: ttft, tpot, e2el, tbt (Mooncake: mean of the slowest 10%% gaps)")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="table sections: ttft,tpot,itl,e2el,tbt")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    g.add_argument("--result-json", help="write the results here")
    g.add_argument("--save-detailed", action="store_true", help="add per-request arrays to the result JSON")
    g.add_argument("--plot", dest="plot_dir", help="write TTFT/TPOT CDFs, throughput and in-flight PNGs here")
    g.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run_bench_command)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    goodput = {k: v for slo in args.goodput for k, v in slo.items()}
    sections = tuple(s.strip() for s in args.percentile_metrics.split(",") if s.strip())
    unknown = set(sections) - {"ttft", "tpot", "itl", "e2el", "tbt"}
    if unknown:
        raise ValueError(f"unknown --percentile-metrics {', '.join(sorted(unknown))}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if not all(0 <= p <= 100 for p in percentiles) or any(math.isnan(p) for p in percentiles):
        raise ValueError("--metric-percentiles must lie in [0, 100]")
    return BenchConfig(
        model=args.model, backend=args.backend, base_url=args.base_url, target=args.target,
        workload=args.workload, endpoint=args.endpoint, trace=args.trace, time_scale=args.time_scale,
        length_scale=args.length_scale, max_requests=args.max_requests, num_users=args.num_users,
        turns=args.turns, think_time_s=args.think_time_s, use_session=args.use_session,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        prefix_len=args.prefix_len, num_prompts=args.num_prompts, chars_per_token=args.chars_per_token,
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos, temperature=args.temperature,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), timeout_s=args.timeout_s, seed=args.seed,
        goodput=goodput, percentiles=percentiles, percentile_metrics=sections, result_json=args.result_json,
        plot_dir=args.plot_dir, save_detailed=args.save_detailed, progress=not args.disable_tqdm,
    )


def run_bench_command(args: argparse.Namespace) -> int:
    """0 when the run finished, 130 when it was interrupted (results are written either way), 2 on bad
    input (nothing was sent)."""
    try:
        config = config_from_args(args)
        result = run_benchmark(config)
    except ValueError as e:  # TraceError included: reported before any request is sent
        print(f"tidepool bench: error: {e}", file=sys.stderr)
        return 2
    return 130 if result["interrupted"] else 0
