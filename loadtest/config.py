"""What one load-test run does: ``BenchConfig``, and the choices derived from it (API, result file).

Names and defaults follow ``vllm bench serve`` where the concept is the same. Two library defaults differ
from the CLI's: ``ignore_eos=True`` and ``temperature=0.0`` give the benchmarks/ scripts exact output
lengths and greedy decoding; ``tidepool bench`` passes vLLM's (ignore_eos only for random prompts, no
temperature sent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

# vLLM's names for its OpenAI-compatible clients (openai-embeddings: /v1/embeddings, each prompt an input)
OPENAI_BACKENDS = ("openai", "openai-chat", "openai-embeddings", "vllm")
BACKENDS = (*OPENAI_BACKENDS, "grpc")
WORKLOADS = ("random", "sharegpt", "mooncake", "chat")


@dataclass
class BenchConfig:
    model: str | None = None  # None: the first model of the server's /v1/models
    # LoRA adapters: each request names one as its model, chosen at random (seeded), as vllm bench serve does
    lora_modules: list[str] = field(default_factory=list)
    backend: str = "openai"  # one of BACKENDS; "grpc" is Tidepool's Serving API
    base_url: str = "http://127.0.0.1:8000"
    target: str = "127.0.0.1:50051"  # gRPC HOST:PORT
    workload: str = "random"  # one of WORKLOADS (vLLM's --dataset-name)
    # "chat" | "completions" | "embeddings" | an API path such as /v1/completions; None: chat for the chat
    # workload and the openai-chat backend, embeddings for the openai-embeddings backend, else completions
    endpoint: str | None = None
    dataset_path: str | None = None  # sharegpt JSON, or the mooncake trace (also accepted as ``trace``)
    # mooncake
    trace: str | None = None
    time_scale: float = 1.0
    length_scale: float = 1.0
    max_requests: int | None = None
    # chat
    num_users: int = 8
    turns: int = 4
    think_time_s: float = 1.0
    use_session: bool = True
    # random (input/output/prefix lengths are also chat's per-turn message, answer and system prompt)
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prompts: int = 1000  # random and sharegpt
    sharegpt_output_len: int | None = None  # None: each conversation's own answer length
    tokenizer: str | None = None  # local tokenizer.json (or its directory): real token counts
    chars_per_token: float | None = None  # None: measured from the tokenizer, else 1.0 (byte-level)
    # arrivals: request_rate None = the trace's timestamps (mooncake) or everything at once
    request_rate: float | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    # requests
    ignore_eos: bool = True
    temperature: float | None = 0.0  # None: not sent, the server decides
    api_key: str | None = None
    timeout_s: float = 6 * 3600
    seed: int = 0
    # output
    goodput: dict[str, float] = field(default_factory=dict)
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    result_json: str | None = None  # write the result exactly here (same as save_result + result_filename)
    save_result: bool = False  # write {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json
    result_dir: str | None = None
    result_filename: str | None = None
    label: str | None = None  # the file name's prefix; default the backend
    plot_dir: str | None = None
    save_detailed: bool = False
    progress: bool = True
    print_table: bool = True

    @property
    def file_path(self) -> str | None:
        """The dataset file of the workload: ``dataset_path``, or the older ``trace`` name."""
        return self.dataset_path or self.trace


def endpoint_kind(config: BenchConfig) -> tuple[str, str | None]:
    """("chat" | "completions" | "embeddings", the API path to POST to, or None for the standard one)."""
    endpoint = config.endpoint
    if endpoint is None:
        if config.backend == "openai-embeddings":
            return "embeddings", None
        chat = config.workload == "chat" or config.backend == "openai-chat"
        return ("chat" if chat else "completions"), None
    if endpoint in ("chat", "completions", "embeddings"):
        return endpoint, None
    path = "/" + endpoint.strip("/")
    for suffix, kind in (("/chat/completions", "chat"), ("/completions", "completions"), ("/embeddings", "embeddings")):
        if path.endswith(suffix):
            return kind, path
    raise ValueError(f"unknown endpoint {endpoint!r}: expected a .../completions, .../chat/completions or "
                     f".../embeddings path")


def rate_word(config: BenchConfig) -> str:
    """The request rate as vLLM writes it in file names and results: "inf", "4.0"; "trace" for a trace
    replayed on its own timestamps."""
    if config.request_rate is None:
        return "trace" if config.workload == "mooncake" else "inf"
    return "inf" if math.isinf(config.request_rate) else str(config.request_rate)


def result_path(config: BenchConfig, model: str, date: str) -> Path | None:
    """Where the result JSON goes: vLLM's ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`` (the
    model's last path part) unless a file name is given, under ``result_dir``; None when not saving."""
    if not (config.save_result or config.result_json):
        return None
    name = config.result_filename or config.result_json
    if name is None:
        concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
        label = config.label or config.backend
        name = f"{label}-{rate_word(config)}qps{concurrency}-{model.split('/')[-1]}-{date}.json"
    return Path(config.result_dir) / name if config.result_dir else Path(name)
