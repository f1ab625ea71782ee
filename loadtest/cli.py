"""``tidepool bench``: drive any OpenAI-compatible server, or Tidepool's gRPC API, and report like
``vllm bench serve``, with its flags and defaults (plus Mooncake trace replay and multi-turn chat)."""

from __future__ import annotations

import argparse
import math
import os
import sys

from loadtest.config import BACKENDS, WORKLOADS, BenchConfig
from loadtest.metrics import parse_goodput
from loadtest.runner import run_benchmark

DESCRIPTION = (
    "Load-test an OpenAI-compatible HTTP server or Tidepool's gRPC API and report TTFT, TPOT, ITL and E2EL "
    "the way vllm bench serve does, with its flag names and defaults. Workloads (--dataset-name): random "
    "prompts, a ShareGPT JSON file, a Mooncake-format trace replayed on its timestamps, or multi-turn chats "
    "that reuse a session. Without --tokenizer, prompt lengths are estimated from --chars-per-token; give a "
    "local tokenizer.json for exact token counts."
)


def _slo(pair: str) -> dict[str, float]:
    try:
        return parse_goodput([pair])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _target_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai and vllm: an OpenAI-compatible server's completions API; openai-chat: its chat "
                        "API; openai-embeddings: its embeddings API (each prompt an input; latency is TTFT and "
                        "E2EL); grpc: Tidepool's gRPC Serving API at --target")
    g.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT from --host, --port)")
    g.add_argument("--host", default="127.0.0.1", help="server host when no --base-url is given")
    g.add_argument("--port", type=int, default=8000, help="server port when no --base-url is given")
    g.add_argument("--endpoint", default=None,
                   help="API path to call: /v1/completions, /v1/chat/completions or /v1/embeddings (or any "
                        "path ending so; 'completions', 'chat' and 'embeddings' also work). Default: "
                        "/v1/chat/completions for the chat workload and the openai-chat backend, /v1/embeddings "
                        "for the openai-embeddings backend, else /v1/completions")
    g.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the gRPC API (grpc backend)")
    g.add_argument("--model", default=None,
                   help="model name sent with every request (default: the first model of the server's "
                        "/v1/models; required with --backend grpc)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME",
                   help="LoRA adapters the server serves (tidepool serve --lora-modules): each request names one "
                        "of them as its model, chosen at random (seeded by --seed), as in vllm bench serve")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--timeout-s", type=float, default=6 * 3600, help="per-request timeout in seconds")
    g.add_argument("--tokenizer", default=None,
                   help="local Hugging Face tokenizer (a directory with tokenizer.json, or the file): random "
                        "prompts of exactly --random-input-len tokens, real token counts where the server "
                        "reports no usage (default: none; lengths estimated from --chars-per-token)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vllm bench serve compatibility; a tokenizer.json runs no code")


def _dataset_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=WORKLOADS, default="random",
                   help="random: synthetic prompts; sharegpt: conversations from --dataset-path; mooncake: "
                        "replay the trace at --dataset-path; chat: multi-turn conversations")
    g.add_argument("--workload", dest="dataset_name", choices=WORKLOADS, default=argparse.SUPPRESS,
                   help="the same as --dataset-name")
    g.add_argument("--dataset-path", "--trace", default=None,
                   help="ShareGPT JSON file (sharegpt) or Mooncake-format JSONL trace (mooncake)")
    # Absent unless given: 1000 for random and sharegpt; a trace replays every row; chat counts its turns.
    g.add_argument("--num-prompts", type=int, default=argparse.SUPPRESS,
                   help="number of requests: random, sharegpt (default: 1000); mooncake: the first N rows of "
                        "the trace (as --max-requests; default: all); not for chat, which sends --num-users x "
                        "--turns")
    g.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=1024,
                   help="random: prompt tokens after the prefix; chat: tokens per user message")
    g.add_argument("--random-output-len", type=int, default=128,
                   help="max_tokens per request (random, chat)")
    g.add_argument("--output-len", type=int, default=None,
                   help="max_tokens per request for every dataset: overrides --random-output-len and "
                        "--sharegpt-output-len")
    g.add_argument("--random-range-ratio", "--range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="random: lengths uniform in [L(1-r), L(1+r)], r in [0, 1)")
    g.add_argument("--random-prefix-len", "--prefix-len", dest="prefix_len", type=int, default=0,
                   help="random: shared prefix tokens before each prompt; chat: shared system prompt tokens")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: max_tokens per request (default: each conversation's answer length)")
    g.add_argument("--chars-per-token", type=float, default=None,
                   help="characters of synthetic text per token (default: measured on --tokenizer, else 1, "
                        "right for byte-level tokenizers)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrival times")

    g = p.add_argument_group("mooncake trace")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply trace gaps (0.5 = twice as fast)")
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply trace lengths; blocks become round(512 * scale) tokens")
    g.add_argument("--max-requests", type=int, default=None, help="replay only the first N rows (default: all)")

    g = p.add_argument_group("chat")
    g.add_argument("--num-users", type=int, default=8, help="concurrent conversations")
    g.add_argument("--turns", type=int, default=4, help="turns per conversation")
    g.add_argument("--think-time-s", type=float, default=1.0, help="pause after each answer, in seconds")
    g.add_argument("--session", dest="use_session", action=argparse.BooleanOptionalAction, default=True,
                   help="send a session id and only the new message each turn; --no-session resends the "
                        "whole history")


def _request_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("arrivals and requests")
    g.add_argument("--request-rate", type=float, default=None,
                   help="requests (chat: conversations) per second; inf sends everything at once (default: "
                        "inf, except that a mooncake trace keeps its own timestamps)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals: 1 is Poisson, below 1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight (default: no cap)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the server to generate exactly max_tokens (a vLLM and Tidepool extension; "
                        "default: on for random prompts, as vllm bench serve does, off otherwise)")
    g.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: none sent, so the server's default applies, as in "
                        "vllm bench serve; 0 is greedy)")


def _output_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--goodput", nargs="+", type=_slo, default=None, metavar="NAME:MS",
                   help="SLOs for goodput: ttft, tpot, e2el, tbt (Mooncake: mean of the slowest 10%% gaps); "
                        "default: none, no goodput is reported")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="table sections: ttft,tpot,itl,e2el,tbt")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--result-dir", default=None, help="directory of the result JSON (default: the current one)")
    g.add_argument("--result-filename", default=None,
                   help="file name of the result JSON (default: "
                        "LABEL-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json, as vllm bench serve names it)")
    g.add_argument("--label", default=None, help="the result file name's prefix (default: the backend)")
    g.add_argument("--result-json", default=None, metavar="PATH",
                   help="write the result JSON to PATH (the same as --save-result --result-filename PATH)")
    g.add_argument("--save-detailed", action="store_true", help="add per-request arrays to the result JSON")
    g.add_argument("--plot", dest="plot_dir", default=None,
                   help="write TTFT/TPOT CDFs, throughput and in-flight PNGs to this directory")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="load-test a serving endpoint (vllm bench serve metrics)",
                              description=DESCRIPTION)
    _target_options(p)
    _dataset_options(p)
    _request_options(p)
    _output_options(p)
    p.set_defaults(func=run_bench_command)
    return p


def _host_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _request_counts(args: argparse.Namespace) -> tuple[int, int | None]:
    """(num_prompts, max_requests): --num-prompts limits a trace replay as vLLM's does its datasets; the chat
    workload's count is its users and turns, so a --num-prompts there would be ignored: refused instead."""
    given = getattr(args, "num_prompts", None)
    if given is None:
        return 1000, args.max_requests
    if args.dataset_name == "chat":
        raise ValueError(f"the chat workload sends --num-users x --turns requests ({args.num_users} x "
                         f"{args.turns}); drop --num-prompts")
    if args.dataset_name != "mooncake":
        return given, args.max_requests
    if args.max_requests is not None and args.max_requests != given:
        raise ValueError(f"--num-prompts {given} and --max-requests {args.max_requests} both limit the trace "
                         "replay; give one")
    return given, given


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    goodput = {k: v for slo in args.goodput or () for k, v in slo.items()}
    sections = tuple(s.strip() for s in args.percentile_metrics.split(",") if s.strip())
    unknown = set(sections) - {"ttft", "tpot", "itl", "e2el", "tbt"}
    if unknown:
        raise ValueError(f"unknown --percentile-metrics {', '.join(sorted(unknown))}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if not all(0 <= p <= 100 for p in percentiles) or any(math.isnan(p) for p in percentiles):
        raise ValueError("--metric-percentiles must lie in [0, 100]")
    # vLLM: random prompts run to their length; other datasets stop at EOS unless asked
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name == "random"
    num_prompts, max_requests = _request_counts(args)
    return BenchConfig(
        model=args.model, lora_modules=args.lora_modules, backend=args.backend, base_url=args.base_url or _host_url(args.host, args.port),
        target=args.target, workload=args.dataset_name, endpoint=args.endpoint, dataset_path=args.dataset_path,
        time_scale=args.time_scale, length_scale=args.length_scale, max_requests=max_requests,
        num_users=args.num_users, turns=args.turns, think_time_s=args.think_time_s,
        use_session=args.use_session, input_len=args.input_len,
        output_len=args.output_len if args.output_len is not None else args.random_output_len,
        range_ratio=args.range_ratio, prefix_len=args.prefix_len, num_prompts=num_prompts,
        sharegpt_output_len=args.output_len if args.output_len is not None else args.sharegpt_output_len,
        tokenizer=args.tokenizer, chars_per_token=args.chars_per_token, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, ignore_eos=ignore_eos,
        temperature=args.temperature, api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        timeout_s=args.timeout_s, seed=args.seed, goodput=goodput, percentiles=percentiles,
        percentile_metrics=sections, result_json=args.result_json, save_result=args.save_result,
        result_dir=args.result_dir, result_filename=args.result_filename, label=args.label,
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
