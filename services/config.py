"""The settings of ``tidepool serve``: one dataclass per part, one default per setting.

``ClusterConfig`` holds the engine's ``EngineConfig`` (not a copy of its fields); ``GatewayConfig`` the
public APIs'. The command line takes every default from these dataclasses, so the CLI, the launcher,
the tests and the benchmarks cannot disagree.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import TemplateSyntaxError

from engine.config import ATTENTION_BACKENDS, QUANTIZATION_METHODS, TINY, EngineConfig
from engine.kv_format import FORMATS as KV_CACHE_DTYPES
from engine.kv_format import RESIDUAL_HELP
from engine.tokenizer import compile_chat_template
from kvstore.transfer.transports import TRANSPORTS as KV_TRANSPORTS
from router.autoscale_rules import AutoscaleConfig, add_autoscale_arguments, autoscale_from_args
from services.gateway.reasoning import PARSERS as REASONING_PARSERS
from services.gateway.tool_calls import PARSERS as TOOL_CALL_PARSERS
from services.messages import Role

POLICIES = ("round_robin", "least_loaded", "cache_aware", "mooncake", "tidepool")
DTYPES = ("float32", "bfloat16", "float16")
AUTOSCALED_ROLES = ("prefill", "decode", "colocated")


@dataclass
class ClusterConfig:
    """Every setting of a running cluster, each with its one default (``tidepool serve`` reads them here)."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model="tiny"))  # device set per worker
    prefill: int = 1
    decode: int = 1
    colocated: int = 0  # > 0 serves colocated workers instead of prefill/decode pairs
    policy: str = "tidepool"
    # sampling defaults for what a request leaves unset: "auto" (the model's generation_config.json, as
    # vLLM), "vllm" (none: the API's own) or a directory holding a generation_config.json
    generation_config: str = "auto"
    override_generation_config: dict = field(default_factory=dict)  # fields set over it (vLLM's flag)
    # the names the APIs serve the model under (vLLM's --served-model-name): a request may name any, the model
    # cards and metrics carry the first; empty: the checkpoint directory's name
    served_model_names: tuple[str, ...] = ()
    chat_template: str | None = None  # Jinja source rendering chats instead of the checkpoint's template
    replicate_hot_prefixes: bool = False  # the tidepool policy copies hot prefixes to idle prefill workers
    kv_transport: str = "auto"  # grpc | collective | ipc | auto (kvstore/transfer/transports.py)
    layerwise: bool = True  # send each layer's KV as soon as it is computed
    # Tokens a stream's events hold before they leave the worker (an answer's first and last at once); 1: each
    # step's. Larger: fewer events and chunks for every hop to the client (SGLang's --stream-interval).
    stream_interval: int = 1
    max_kv_channels: int = 16  # collective KV channels (process groups) a worker keeps open, LRU-evicted
    address: str | None = None  # "auto" joins a running Ray cluster
    redis_url: str | None = None  # None: start a private redis-server
    threads_per_worker: int | None = None  # CPU threads per worker; default: the cores split evenly
    pool_max_bytes: int = 256 << 20  # cap of the Redis KV payload tier
    kv_disk_dir: str | None = None  # each worker's disk tier lives under DIR/<worker id>; None: no disk tier
    kv_disk_bytes: int = 16 << 30  # cap of each worker's disk tier
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 1.0  # CPU decode steps are slow: a GPU deployment sets ~0.1
    ray_num_cpus: int | None = None  # for a local Ray: logical CPUs (default: enough for the workers' threads)
    gpus_per_worker: float | None = None  # None: 1 when the Ray cluster has GPUs, else 0 (CPU threads)
    placement_timeout_s: float = 60.0  # workers not placed (and constructed) by then fail the start
    replace_workers: bool = True  # a worker that dies or reports unhealthy is replaced by a new one
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    # environment variables for the workers' processes: a Ray runtime env, which costs each worker's start a
    # setup process (benchmarks/worker_start.py), so none is asked for when this is empty
    extra_env: dict[str, str] = field(default_factory=dict)

    def policy_options(self) -> dict:
        """Options of the routing policy (``router.policies``) this config turns on."""
        if self.replicate_hot_prefixes and self.policy != "tidepool":
            raise ValueError(f"hot-prefix replication is the tidepool policy's, not {self.policy}'s")
        return {"replicate": True} if self.replicate_hot_prefixes else {}

    def role_counts(self) -> dict[str, int]:
        """The workers started, per role."""
        if self.colocated:
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}

    def roles(self) -> list[Role]:
        return [Role(role) for role, count in self.role_counts().items() for _ in range(count)]


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    api_key: str | None = None  # required as a bearer key on every API call when set
    max_body_bytes: int = 8 << 20  # HTTP request bodies above this are refused (413) before parsing
    max_prompt_tokens: int | None = None  # None: the model's context is the only limit
    max_n: int = 16  # most choices (n) one request may ask for, per prompt
    session_ttl_s: float = 3600.0  # idle chat sessions expire after this
    response_ttl_s: float = 3600.0  # stored Responses API responses expire this long after they finish; 0: none kept
    metrics_require_key: bool = False  # /metrics and the API docs need the API key too (/health never does)
    shutdown_timeout_s: float = 10.0  # on SIGTERM, in-flight requests get this long before they are cancelled
    # Chat tool calling: the format the model writes calls in ("hermes", "llama3_json", "mistral"); None refuses tools
    tool_call_parser: str | None = None
    # Chat: split the thinking a reasoning model writes into reasoning_content ("qwen3", "deepseek_r1"); None: off
    reasoning_parser: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False
    # Browser pages on these origins may call the HTTP API (CORS; "*": any); empty: no CORS headers at all
    allowed_origins: tuple[str, ...] = ()


class _MarkSet(argparse.Action):
    """Store the value and remember the flag was given (to refuse mixing colocated and P/D flags)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_set", True)


def _json_object(text: str) -> dict:
    """An option's JSON object value (argparse names the option when this raises)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _origins(text: str) -> list[str]:
    """``--allowed-origins``' JSON list of origins (``scheme://host[:port]``, or "*")."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(o, str) and (o == "*" or "://" in o) for o in value):
        raise argparse.ArgumentTypeError(f'must be a JSON list of origins such as "https://host" or "*", got {text!r}')
    return value


def _lora_module(text: str) -> tuple[str, str]:
    """``--lora-modules``' NAME=DIR, the directory made absolute (workers run in other directories)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, _directory(path)


def _directory(text: str) -> str:
    """A directory option's value, made absolute (workers run in other directories)."""
    return os.path.abspath(os.path.expanduser(text))


def _checkpoint_dir(text: str) -> str:
    """A checkpoint option's value: ``tiny``, or a directory (``_directory``)."""
    return text if text == TINY else _directory(text)


BLOCK_SIZES = (8, 16, 32, 64, 128)  # --block-size's choices (vLLM's on CUDA, less 1)

# vLLM's --speculative-config keys this engine takes (its methods: "ngram" and "draft_model")
SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                           "disable_by_batch_size")


def speculative_fields(spec: dict) -> dict:
    """vLLM's ``--speculative-config`` object as ``EngineConfig``'s speculative fields; ValueError saying what to
    fix. ``method`` defaults to "draft_model" with a ``model``, else "ngram"."""
    unknown = sorted(set(spec) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported; it takes "
                         f"{', '.join(SPECULATIVE_CONFIG_KEYS)}")
    method = spec.get("method", "draft_model" if "model" in spec else "ngram")
    if method not in ("ngram", "draft_model"):
        raise ValueError(f"--speculative-config: method {method!r} is not supported; use \"ngram\" (prompt lookup) "
                         "or \"draft_model\" (with model)")
    if "model" in spec and (not isinstance(spec["model"], str) or not spec["model"]):
        raise ValueError(f"--speculative-config: model must be a checkpoint directory, got {spec['model']!r}")
    if (method == "draft_model") != ("model" in spec):
        raise ValueError('--speculative-config: method "draft_model" needs model (a checkpoint directory), '
                         '"ngram" takes none')
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
        if key in spec and (not isinstance(spec[key], int) or isinstance(spec[key], bool)):
            raise ValueError(f"--speculative-config: {key} must be an integer, got {spec[key]!r}")
    if "num_speculative_tokens" not in spec:
        raise ValueError("--speculative-config needs num_speculative_tokens (how many tokens a draft holds)")
    return dict(num_speculative_tokens=spec["num_speculative_tokens"],
                speculative_model=_checkpoint_dir(spec["model"]) if "model" in spec else None,
                prompt_lookup_max=spec.get("prompt_lookup_max", EngineConfig.prompt_lookup_max),
                prompt_lookup_min=spec.get("prompt_lookup_min", EngineConfig.prompt_lookup_min),
                speculative_disable_by_batch_size=spec.get("disable_by_batch_size"))


def _chat_template(text: str) -> str:
    """``--chat-template``'s value: a file holding a Jinja chat template, or the template itself (vLLM's rule:
    a value with none of Jinja's {{, {% or {# that names no file is a path that does not exist)."""
    path = Path(os.path.expanduser(text))
    if path.is_file():
        text = path.read_text()
    elif not any(mark in text for mark in ("{{", "{%", "{#")):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a file nor a Jinja template")
    try:
        compile_chat_template(text)
    except TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(f"not a valid Jinja template: {exc.message} (line {exc.lineno})") from None
    return text


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``tidepool serve``'s options, with the dataclasses' defaults."""
    c, e, g = ClusterConfig(), ClusterConfig().engine, GatewayConfig()
    p.add_argument("--model", type=_checkpoint_dir, default=e.model, help="'tiny' (built-in) or a local HF checkpoint directory")
    p.add_argument("--tokenizer", type=_directory, default=e.tokenizer, metavar="DIR",
                   help="the model's tokenizer (tokenizer.json, tokenizer_config.json) from DIR, for a checkpoint "
                        "whose directory has none (default: the checkpoint's)")
    p.add_argument("--served-model-name", dest="served_model_names", nargs="+", default=list(c.served_model_names),
                   metavar="NAME", help="the model's names in the APIs: a request may name any, /v1/models lists "
                                        "each, the metrics carry the first (default: the checkpoint directory's name)")
    p.add_argument("--chat-template", type=_chat_template, default=c.chat_template, metavar="FILE|TEMPLATE",
                   help="render chats with this Jinja template (a file, or the template itself) instead of the "
                        "checkpoint's tokenizer_config.json one")
    p.add_argument("--max-model-len", type=int, default=e.max_model_len, metavar="TOKENS",
                   help="the longest sequence (prompt and output) a request may make, at most the model's "
                        "context (default: that context, max_position_embeddings)")
    p.add_argument("--prefill", type=int, default=c.prefill, action=_MarkSet, help="prefill workers")
    p.add_argument("--decode", type=int, default=c.decode, action=_MarkSet, help="decode workers")
    p.add_argument("--colocated", type=int, default=c.colocated,
                   help="serve N colocated workers (prefill and decode in one engine) instead")
    p.add_argument("--policy", default=c.policy, choices=POLICIES, help="how the router picks workers")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=DIR",
                   help="LoRA adapters (PEFT directories) served beside the model: a request names one as its "
                        "model; every worker loads them all")
    p.add_argument("--allow-runtime-lora-updating", action="store_true", default=g.allow_runtime_lora_updating,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), loading and "
                        "unloading LoRA adapters on every worker while serving")
    p.add_argument("--max-loras", type=int, default=e.max_loras,
                   help="LoRA adapter slots each worker allocates at start: the most adapters a batch runs at once "
                        "(default: one per --lora-modules adapter, at least 1 with --allow-runtime-lora-updating)")
    p.add_argument("--max-lora-rank", type=int, default=e.max_lora_rank,
                   help="the largest LoRA rank a slot holds (default: 16, or the largest --lora-modules rank)")
    p.add_argument("--max-cpu-loras", type=int, default=e.max_cpu_loras,
                   help="the most LoRA adapters loaded, kept in each worker's host memory and swapped into the "
                        "slots as their requests run (default: --max-loras, or the number of --lora-modules)")
    p.add_argument("--generation-config", default=c.generation_config, metavar="auto|vllm|DIR",
                   help="sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens "
                        "caps an unset max_tokens) for what a request leaves unset: auto reads the model's "
                        "generation_config.json, vllm uses none, DIR reads DIR/generation_config.json")
    p.add_argument("--override-generation-config", type=_json_object, default=c.override_generation_config,
                   metavar="JSON", help="sampling defaults set over --generation-config's, e.g. "
                                        "'{\"temperature\": 0.5, \"max_new_tokens\": 512}'")
    p.add_argument("--replicate-hot-prefixes", action="store_true", default=c.replicate_hot_prefixes,
                   help="copy prefixes many requests share to idle prefill workers ahead of demand "
                        "(tidepool policy)")
    p.add_argument("--kv-transport", default=c.kv_transport, choices=KV_TRANSPORTS,
                   help="how KV moves from prefill to decode workers: grpc; collective (NCCL on GPUs, gloo "
                        "on CPUs); ipc (shared memory within a node: CUDA IPC on GPUs, /dev/shm on CPUs; "
                        "other pairs fall back); auto: ipc for GPU pairs on one node, NCCL across nodes, "
                        "gRPC for CPU pairs")
    p.add_argument("--no-layerwise", dest="layerwise", action="store_false", default=c.layerwise,
                   help="send KV after the whole prefill instead of layer by layer")
    p.add_argument("--stream-interval", type=int, default=c.stream_interval, metavar="N",
                   help="send a stream's tokens N at a time (an answer's first token and its last at once): "
                        "fewer events and chunks to carry, coarser streaming; 1: each as it is made")
    p.add_argument("--max-kv-channels", type=int, default=c.max_kv_channels,
                   help="collective KV channels each worker keeps open (least recently used closed beyond)")
    p.add_argument("--address", default=c.address, help="join a Ray cluster ('auto': the one `ray start` ran "
                   "here; or set RAY_ADDRESS) instead of starting an instance of its own")
    p.add_argument("--redis-url", default=c.redis_url, help="use this Redis instead of a private redis-server")
    p.add_argument("--threads-per-worker", type=int, default=c.threads_per_worker,
                   help="CPU threads per worker (default: the cores split evenly)")
    p.add_argument("--ray-num-cpus", type=int, default=c.ray_num_cpus,
                   help="logical CPUs of the local Ray serve starts (default: the cores, or the workers' threads "
                        "if more); more leaves room for `tidepool scale` to add CPU workers")
    p.add_argument("--gpus-per-worker", type=float, default=c.gpus_per_worker,
                   help="GPUs each worker asks Ray for (default: 1 when the Ray cluster has GPUs, else 0)")
    p.add_argument("--placement-timeout", dest="placement_timeout_s", type=float, default=c.placement_timeout_s,
                   help="seconds the workers may take to be placed on the Ray cluster before serve fails, "
                        "naming what is missing (a local Ray that can never fit them fails at once)")
    p.add_argument("--no-replace-workers", dest="replace_workers", action="store_false", default=c.replace_workers,
                   help="leave a dead or unhealthy worker dead instead of starting a replacement")
    add_autoscale_arguments(p, AUTOSCALED_ROLES)
    p.add_argument("--autoscale-drain-timeout-s", type=float, default=c.autoscale.drain_timeout_s,
                   help="seconds a worker the autoscaler drains gives its requests (the rest resume elsewhere)")
    p.add_argument("--pool-max-bytes", type=int, default=c.pool_max_bytes, help="cap of the Redis KV payload tier")
    p.add_argument("--kv-disk-dir", type=_directory, default=c.kv_disk_dir,
                   help="keep shared KV blocks on local disk under DIR/<worker id> (reused after a restart)")
    p.add_argument("--kv-disk-bytes", type=int, default=c.kv_disk_bytes, help="cap of each worker's disk tier")
    p.add_argument("--ttft-slo-s", type=float, default=c.ttft_slo_s, help="time-to-first-token SLO")
    p.add_argument("--tbt-slo-ms", type=float, default=c.tbt_slo_s * 1000, help="time-between-tokens SLO")
    p.add_argument("--dtype", default=e.dtype, choices=DTYPES, help="weights and KV cache dtype")
    p.add_argument("--quantization", default=e.quantization, choices=QUANTIZATION_METHODS,
                   help="fp8: quantize a 16-bit checkpoint's projections and experts as it loads (one scale a row; half "
                        "the weight memory and bytes a decode step reads); w8a8_int8: to int8 a scale a row, run W8A8 "
                        "(inputs quantized to int8 a token, integer matmuls); an fp8 or integer (AWQ, GPTQ, "
                        "compressed-tensors) checkpoint runs as it is stored without it")
    p.add_argument("--num-blocks", type=int, default=e.num_blocks,
                   help="KV blocks per worker (default: from --gpu-memory-utilization on GPUs, else "
                        "from --kv-cache-bytes)")
    p.add_argument("--kv-cache-bytes", type=int, default=e.kv_cache_bytes,
                   help="KV cache memory per worker on CPUs")
    p.add_argument("--gpu-memory-utilization", type=float, default=e.gpu_memory_utilization,
                   help="share of each GPU for weights, activations and the KV cache, which gets what a "
                        "profiling pass leaves")
    p.add_argument("--enforce-eager", action="store_true", default=e.enforce_eager,
                   help="run every step eagerly: no CUDA graphs for decode steps")
    p.add_argument("--async-scheduling", action="store_true", default=e.async_scheduling,
                   help="launch each step before the last one's tokens reach the host, which handles "
                        "them while the GPU computes (a sequence computes one token past its stop)")
    p.add_argument("--attention-backend", default=e.attention_backend, choices=ATTENTION_BACKENDS,
                   help="paged attention: triton kernels reading blocks in place, quantized codes "
                        "dequantized as they are read (auto: on GPUs, unless --kv-sinks) or torch "
                        "(gather + SDPA)")
    p.add_argument("--kv-cache-dtype", default=e.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="KV cache format on every worker: auto (the --dtype), int8, fp8 or kivi2 (2-bit)")
    p.add_argument("--kv-residual-blocks", type=int, default=e.kv_residual_blocks, metavar="N", help=RESIDUAL_HELP)
    p.add_argument("--kv-window", type=int, default=e.kv_window, metavar="TOKENS",
                   help="attention window (StreamingLLM): each token attends to the last TOKENS tokens and the "
                        "--kv-sinks first ones, blocks in between are freed, and sessions may outgrow the "
                        "model's context (up to 1M tokens); colocated workers, since a disaggregated prompt must "
                        "fit the window (default: full attention)")
    p.add_argument("--kv-sinks", type=int, default=e.kv_sinks, metavar="N",
                   help="leading tokens every token attends to with --kv-window (attention sinks)")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=e.block_size, metavar="TOKENS",
                   help=f"tokens in one KV block, the unit of the prefix cache, the KV pool and the transfers "
                        f"(one of {', '.join(map(str, BLOCK_SIZES))}; a power of two, as the Triton kernels tile "
                        f"by it; default: {e.block_size})")
    p.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, help="sequences in one batch")
    p.add_argument("--num-reserved-decode-tokens", type=int, default=e.num_reserved_decode_tokens, metavar="N",
                   help="a decode worker admits a new request only while each running sequence keeps room to "
                        "grow N more tokens: more means fewer preemptions (each recomputes a prompt) and fewer "
                        "sequences decoding at once")
    p.add_argument("--num-speculative-tokens", type=int, default=e.num_speculative_tokens, metavar="K",
                   help="speculative decoding by n-gram prompt lookup (or --speculative-model): each decoding "
                        "sequence proposes up to K tokens that followed an earlier occurrence of its last tokens "
                        "and verifies them in one pass; the output is unchanged (default: 0, off)")
    p.add_argument("--prompt-lookup-max", type=int, default=e.prompt_lookup_max, metavar="N",
                   help="with --num-speculative-tokens: the longest suffix looked up (tried first)")
    p.add_argument("--prompt-lookup-min", type=int, default=e.prompt_lookup_min, metavar="N",
                   help="with --num-speculative-tokens: the shortest suffix looked up")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=e.speculative_disable_by_batch_size,
                   metavar="N", help="with --num-speculative-tokens: no drafts in a step while more than N "
                                     "sequences run (a large batch is compute-bound; default: always draft)")
    p.add_argument("--speculative-model", type=_checkpoint_dir, default=e.speculative_model, metavar="DIR",
                   help="with --num-speculative-tokens: draft with this checkpoint (a smaller model with the same "
                        "tokenizer, or tiny) instead of prompt lookup; the decode workers load it, its KV cache "
                        "takes a share of theirs (default: prompt lookup)")
    p.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help="the speculative settings as vLLM's JSON object instead of the flags above: "
                        '{"num_speculative_tokens": K, "method": "ngram", "prompt_lookup_max": 4, ...} or '
                        '{"model": DIR, "num_speculative_tokens": K}')
    p.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens,
                   help="tokens in one engine step (chunked prefill splits longer prompts)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=e.enable_prefix_caching, help="turn off prefix caching")
    p.add_argument("--host", default=g.host, help="address the HTTP and gRPC gateways listen on")
    p.add_argument("--http-port", type=int, default=g.http_port, help="OpenAI-compatible HTTP port")
    p.add_argument("--grpc-port", type=int, default=g.grpc_port, help="gRPC port")
    p.add_argument("--api-key", default=g.api_key, help="require this bearer key (or set TIDEPOOL_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=g.max_body_bytes, help="largest HTTP request body")
    p.add_argument("--allowed-origins", type=_origins, default=list(g.allowed_origins), metavar="JSON",
                   help="browser pages on these origins may call the HTTP API (CORS), a JSON list as vLLM's "
                        "flag takes, e.g. '[\"https://chat.example.com\"]' or '[\"*\"]' (default: none)")
    p.add_argument("--max-prompt-tokens", type=int, default=g.max_prompt_tokens,
                   help="longest prompt accepted (default: the model's context)")
    p.add_argument("--max-n", type=int, default=g.max_n,
                   help="most choices (n) a request may ask for, per prompt; above it the answer is a 400")
    p.add_argument("--session-ttl", dest="session_ttl_s", type=float, default=g.session_ttl_s,
                   help="seconds an idle chat session (session_id) is kept")
    p.add_argument("--response-ttl", dest="response_ttl_s", type=float, default=g.response_ttl_s,
                   help="seconds a Responses API response is kept for previous_response_id and GET after it "
                        "finishes; 0 keeps none (store: true is then a 400)")
    p.add_argument("--metrics-require-key", action="store_true", default=g.metrics_require_key,
                   help="require the API key for /metrics and the API docs as well (/health stays open)")
    p.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS), default=g.tool_call_parser,
                   help="serve chat tool calling, reading the calls the model writes in this format (hermes: "
                        "Qwen2.5, Qwen3, Hermes; llama3_json: Llama 3.1 and later; mistral: Mistral v0.3, Nemo, "
                        "Small); without it, requests with tools are a 400")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag, for command lines written for it: tool_choice \"auto\" is on whenever "
                        "--tool-call-parser is given, which this flag needs")
    p.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=g.reasoning_parser,
                   help="return a reasoning model's thinking (<think>...</think>) as reasoning_content, apart from "
                        "the answer (qwen3: the model opens the block; deepseek_r1: the template does)")
    p.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float, default=g.shutdown_timeout_s,
                   help="on SIGTERM/Ctrl-C, seconds in-flight requests get to finish before they are cancelled")
    p.set_defaults(prefill_set=False, decode_set=False)


def configs_from_args(args: argparse.Namespace) -> tuple[ClusterConfig, GatewayConfig]:
    """The parsed options as the two configs; ValueError when they contradict each other."""
    if args.colocated and (args.prefill_set or args.decode_set):
        raise ValueError("use either --colocated N or --prefill/--decode, not both")
    if args.max_kv_channels < 1:
        raise ValueError(f"--max-kv-channels must be at least 1, got {args.max_kv_channels}")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be at least 1, got {args.stream_interval}")
    names = [name for name, _ in args.lora_modules]
    if len(set(names)) < len(names):
        raise ValueError(f"--lora-modules names each adapter once, got {', '.join(names)}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes calls in)")
    served = args.served_model_names
    if len(set(served)) < len(served) or set(served) & set(names) or not all(n.strip() for n in served):
        raise ValueError(f"--served-model-name takes distinct, non-blank names that no --lora-modules adapter has, "
                         f"got {', '.join(map(repr, served))}")
    speculation = dict(num_speculative_tokens=args.num_speculative_tokens, prompt_lookup_min=args.prompt_lookup_min,
                       prompt_lookup_max=args.prompt_lookup_max,
                       speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
                       speculative_model=args.speculative_model)
    if args.speculative_config is not None:
        if args.num_speculative_tokens or args.speculative_model:
            raise ValueError("use either --speculative-config or --num-speculative-tokens / --speculative-model")
        speculation = speculative_fields(args.speculative_config)
    max_loras = args.max_loras
    if max_loras is None and args.allow_runtime_lora_updating:
        max_loras = max(len(names), 1)
    engine = EngineConfig(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, quantization=args.quantization,
        block_size=args.block_size,
        num_blocks=args.num_blocks, kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_residual_blocks=args.kv_residual_blocks, kv_window=args.kv_window, kv_sinks=args.kv_sinks, attention_backend=args.attention_backend,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        num_reserved_decode_tokens=args.num_reserved_decode_tokens,
        **speculation, lora_modules=dict(args.lora_modules), max_loras=max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )
    cluster = ClusterConfig(
        engine=engine, prefill=args.prefill, decode=args.decode, colocated=args.colocated, policy=args.policy,
        generation_config=args.generation_config, override_generation_config=args.override_generation_config,
        served_model_names=tuple(served), chat_template=args.chat_template,
        replicate_hot_prefixes=args.replicate_hot_prefixes, kv_transport=args.kv_transport, layerwise=args.layerwise,
        stream_interval=args.stream_interval, max_kv_channels=args.max_kv_channels, address=args.address,
        redis_url=args.redis_url,
        threads_per_worker=args.threads_per_worker, ray_num_cpus=args.ray_num_cpus,
        pool_max_bytes=args.pool_max_bytes,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_bytes=args.kv_disk_bytes,
        ttft_slo_s=args.ttft_slo_s, tbt_slo_s=args.tbt_slo_ms / 1000, gpus_per_worker=args.gpus_per_worker,
        placement_timeout_s=args.placement_timeout_s, replace_workers=args.replace_workers,
        autoscale=autoscale_from_args(args, AUTOSCALED_ROLES, drain_timeout_s=args.autoscale_drain_timeout_s),
    )
    gateway = GatewayConfig(
        host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        api_key=args.api_key or os.environ.get("TIDEPOOL_API_KEY"), max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens, max_n=args.max_n, metrics_require_key=args.metrics_require_key,
        shutdown_timeout_s=args.shutdown_timeout_s, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, session_ttl_s=args.session_ttl_s,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        response_ttl_s=args.response_ttl_s, allowed_origins=tuple(args.allowed_origins),
    )
    if gateway.session_ttl_s <= 0:
        raise ValueError(f"--session-ttl must be positive, got {gateway.session_ttl_s:g}")
    if gateway.response_ttl_s < 0:
        raise ValueError(f"--response-ttl must be at least 0 (0: keep no responses), got {gateway.response_ttl_s:g}")
    cluster.policy_options()  # refuses an option the chosen policy does not have
    cluster.autoscale.check(cluster.role_counts())
    return cluster, gateway
