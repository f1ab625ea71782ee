"""The result table (``vllm bench serve``'s layout), the result JSON and the plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from loadtest.clients import RequestRecord
from loadtest.metrics import BenchmarkMetrics, tpot_s

SECTIONS = {  # metric -> (label, header), in vLLM's order; tbt is Mooncake's SLO variant
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "tbt": ("TBT", "Mooncake TBT (slowest 10% of gaps)"),
}


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def result_dict(m: BenchmarkMetrics) -> dict:
    """vLLM's result keys (``mean_ttft_ms``, ``p99_itl_ms``, ``completed``, ...) plus ours."""
    result = {
        "duration": m.duration_s, "sent": m.sent, "completed": m.completed, "failed": m.failed,
        "rejected": m.rejected, "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "total_cached_tokens": m.total_cached, "cache_hit_rate": m.cache_hit_rate,
        "request_throughput": m.request_throughput, "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name in SECTIONS:
        dist = getattr(m, name)
        result[f"mean_{name}_ms"], result[f"median_{name}_ms"] = dist.mean, dist.median
        result[f"std_{name}_ms"] = dist.std
        for p, value in dist.percentiles.items():
            result[f"p{_p_word(p)}_{name}_ms"] = value
    return result


def format_table(m: BenchmarkMetrics, *, request_rate: float | None = None,
                 max_concurrency: int | None = None, sections: tuple[str, ...] = ("ttft", "tpot", "itl")) -> str:
    def row(label: str, value, fmt: str = "") -> str:
        return f"{label:<40} {value:<10{fmt}}"

    lines = [f"{' Serving Benchmark Result ':=^50}",
             row("Successful requests:", m.completed), row("Failed requests:", m.failed),
             row("Rejected requests:", m.rejected)]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if request_rate is not None and not math.isinf(request_rate):
        lines.append(row("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [row("Benchmark duration (s):", m.duration_s, ".2f"),
              row("Total input tokens:", m.total_input), row("Total generated tokens:", m.total_output),
              row("Cached prompt tokens:", m.total_cached),
              row("Prefix cache hit rate (%):", 100 * m.cache_hit_rate, ".2f"),
              row("Request throughput (req/s):", m.request_throughput, ".2f")]
    if m.request_goodput is not None:
        lines.append(row("Request goodput (req/s):", m.request_goodput, ".2f"))
    lines += [row("Output token throughput (tok/s):", m.output_throughput, ".2f"),
              row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f"),
              row("Peak concurrent requests:", m.max_concurrent_requests, ".2f"),
              row("Total Token throughput (tok/s):", m.total_token_throughput, ".2f")]
    for name in sections:
        label, header = SECTIONS[name]
        dist = getattr(m, name)
        lines += [f"{header:-^50}", row(f"Mean {label} (ms):", dist.mean, ".2f"),
                  row(f"Median {label} (ms):", dist.median, ".2f")]
        lines += [row(f"P{_p_word(p)} {label} (ms):", v, ".2f") for p, v in dist.percentiles.items()]
    lines.append("=" * 50)
    return "\n".join(lines)


def detailed(records: list[RequestRecord]) -> dict:
    """Per-request arrays, as ``vllm bench serve --save-detailed`` keeps them."""
    return {
        "request_ids": [r.request_id for r in records], "statuses": [r.status for r in records],
        "input_lens": [r.prompt_tokens for r in records], "output_lens": [r.output_tokens for r in records],
        "cached_tokens": [r.cached_tokens for r in records], "ttfts": [r.ttft_s for r in records],
        "itls": [r.itl_s for r in records], "errors": [r.error for r in records],
        "generated_texts": [r.generated_text for r in records],
    }


def write_json(path: str | Path, result: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def _cdf(fig, values_ms: list[float], title: str, xlabel: str):
    ax = fig.subplots()
    xs = np.sort(values_ms)
    ax.step(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), where="post")
    ax.set(title=title, xlabel=xlabel, ylabel="fraction of requests", ylim=(0, 1.02))
    ax.grid(alpha=0.3)


def write_plots(directory: str | Path, records: list[RequestRecord], run_start_s: float) -> list[Path]:
    """ttft_cdf.png, tpot_cdf.png, throughput.png (output tokens/s) and inflight.png, under ``directory``."""
    from matplotlib.figure import Figure  # no pyplot: nothing global, renders with Agg

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.status == "ok"]
    end = max((r.end_s - run_start_s for r in records), default=0.0)
    width = 1.0 if end >= 20 else max(end / 20, 0.01)  # about 20+ bars on short runs
    edges = np.arange(math.ceil(end / width) + 1) * width
    times, weights = [], []
    for r in records:
        per_chunk = r.output_tokens / len(r.chunk_s) if r.output_tokens and r.chunk_s else 1.0
        times += [r.start_s - run_start_s + t for t in r.chunk_s]
        weights += [per_chunk] * len(r.chunk_s)
    counts, _ = np.histogram(times, bins=edges, weights=weights) if len(edges) > 1 else (np.zeros(0), None)
    events = sorted([(r.start_s - run_start_s, 1) for r in records] + [(r.end_s - run_start_s, -1) for r in records])
    inflight = np.cumsum([d for _, d in events]) if events else np.zeros(0)

    figures = {}
    figures["ttft_cdf.png"] = fig = Figure(figsize=(6, 4))
    _cdf(fig, [r.ttft_s * 1000 for r in done], "TTFT CDF", "TTFT (ms)")
    figures["tpot_cdf.png"] = fig = Figure(figsize=(6, 4))
    _cdf(fig, [tpot_s(r) * 1000 for r in done if r.output_tokens > 1], "TPOT CDF", "TPOT (ms)")
    figures["throughput.png"] = fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    ax.bar(edges[:-1], counts / width, width=width, align="edge")
    ax.set(title="Output token throughput", xlabel="time (s)", ylabel="tokens/s")
    figures["inflight.png"] = fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    ax.step([t for t, _ in events], inflight, where="post")
    ax.set(title="Requests in flight", xlabel="time (s)", ylabel="requests")
    paths = []
    for name, fig in figures.items():
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        paths.append(out / name)
    return paths
