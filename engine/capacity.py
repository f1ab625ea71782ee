"""KV-cache capacity planner behind ``tidepool kv-calc``.

KV bytes per token = 2 (K, V) x layers x kv_heads x head_dim x bytes per element (DESIGN.md section 3);
with ``--kv-cache-dtype`` int8/fp8/kivi2, a block's quantized record (scales included) / block size, plus
full-precision windows per request for fp8 and kivi2: the block being filled and ``--kv-residual-blocks``
full ones (``engine/kv_format.py``). From that: bytes per
request at a context length, bytes for a batch, and how many such requests fit in a device after the
weights and a reserve for activations and the runtime. A draft model (``--speculative-model``) adds its
weights and its own KV cache, in the model's dtype: the engine pairs each of its blocks with one of the
draft's, which holds the positions the model's do (it attends through the model's window). Deliberately
free of torch so the command answers instantly.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.config import QUANTIZATION_METHODS, ModelConfig, UnsupportedModelError, dtype_bytes
from engine.kv_format import FORMATS, RESIDUAL_HELP, block_layer_bytes, residual_blocks, window_layer_bytes

GIB = 1024**3
RESERVE_FRACTION = 0.10  # of device memory kept for activations, CUDA context, fragmentation


@dataclass
class ModelShape:
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_parameters: int
    sliding_window: int | None = None  # the model's own (Mistral v0.1): a request holds only its blocks
    config: ModelConfig | None = None  # a checkpoint's (None: a preset), whose fp8 projections weigh less

    def weight_bytes(self, dtype: str) -> int:
        return self.config.weight_bytes(dtype) if self.config else self.num_parameters * dtype_bytes(dtype)


PRESETS: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llama-7b", 32, 32, 32, 128, 6_738_415_616),
    ModelShape("llama-13b", 40, 40, 40, 128, 13_015_864_320),
    ModelShape("opt-13b", 40, 40, 40, 128, 12_853_954_560),  # hidden 5120 = 40 heads x 128, MHA
    ModelShape("llama-2-7b", 32, 32, 32, 128, 6_738_415_616),
    ModelShape("llama-2-13b", 40, 40, 40, 128, 13_015_864_320),
    ModelShape("llama-2-70b", 80, 64, 8, 128, 68_976_648_192),
    ModelShape("llama-3-8b", 32, 32, 8, 128, 8_030_261_248),
    ModelShape("llama-3-70b", 80, 64, 8, 128, 70_553_706_496),
    ModelShape("mistral-7b", 32, 32, 8, 128, 7_241_732_096),
    ModelShape("qwen2-7b", 28, 28, 4, 128, 7_615_616_512),
    ModelShape("tiny", 8, 12, 4, 64, 50_762_496),
)}


@dataclass
class Capacity:
    model: str
    dtype: str
    context: int
    batch: int
    kv_bytes_per_token: int  # rounded up where a block's scales do not divide evenly among its tokens
    mha_kv_bytes_per_token: int  # the same model with one KV head per query head
    gqa_saving: float  # MHA bytes / actual bytes (num_heads / num_kv_heads)
    kv_bytes_per_request: int  # context x bytes per token, plus the window
    kv_bytes_for_batch: int
    weight_bytes: int
    gpu_mem_bytes: int | None = None
    reserve_bytes: int | None = None
    kv_budget_bytes: int | None = None  # device memory - weights - reserve
    max_concurrent_requests: int | None = None  # at ``context`` tokens each
    batch_fits: bool | None = None
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    window_bytes_per_request: int = 0  # fp8/kivi2: the block being filled and the residual, kept in ``dtype``
    residual_blocks: int = 0
    sliding_window: int | None = None  # the model's own, which bounds the KV a request holds
    draft_model: str | None = None  # --speculative-model's, whose KV and weights the totals above include
    draft_kv_bytes_per_token: int = 0
    draft_weight_bytes: int = 0


def shape_from_dir(path: str | Path, quantization: str | None = None) -> ModelShape:
    """The checkpoint's shape; ``quantization`` (fp8, w8a8_int8): its projections as ``--quantization`` loads them."""
    cfg = ModelConfig.from_dir(path).with_quantization(quantization)
    return ModelShape(Path(path).resolve().name, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim, cfg.num_parameters(), cfg.sliding_window, cfg)


def held_tokens(shape: ModelShape, context: int, block_size: int) -> int:
    """KV positions one request of ``context`` tokens holds at most: all of them, or with a sliding window of
    W the blocks that W consecutive positions touch (the engine gives back those behind the window)."""
    if shape.sliding_window is None:
        return context
    return min(context, (shape.sliding_window + 2 * block_size - 2) // block_size * block_size)


def plan(shape: ModelShape, dtype: str, context: int, batch: int, gpu_mem_gib: float | None,
         kv_cache_dtype: str = "auto", block_size: int = 16, kv_residual_blocks: int | None = None,
         draft: ModelShape | None = None) -> Capacity:
    """``draft``: a draft model's shape (``--speculative-model``), whose cache is in ``dtype`` ("auto")."""
    width = dtype_bytes(dtype)
    residual = residual_blocks(kv_cache_dtype, kv_residual_blocks)

    def block_bytes(model: ModelShape, kv_heads: int, kv_format: str) -> int:
        return model.num_layers * block_layer_bytes(kv_format, block_size, kv_heads, model.head_dim, width)

    block = block_bytes(shape, shape.num_kv_heads, kv_cache_dtype)
    mha_block = block_bytes(shape, shape.num_heads, kv_cache_dtype)
    draft_block = block_bytes(draft, draft.num_kv_heads, "auto") if draft else 0
    window = shape.num_layers * window_layer_bytes(kv_cache_dtype, block_size, shape.num_kv_heads,
                                                   shape.head_dim, width, residual)
    held = held_tokens(shape, context, block_size)  # (a draft's blocks come paired with the model's)
    per_request = -(-(block + draft_block) * held // block_size) + window
    draft_weights = draft.weight_bytes(dtype) if draft else 0
    cap = Capacity(shape.name, dtype, context, batch, -(-block // block_size), -(-mha_block // block_size),
                   mha_block / block, per_request, per_request * batch, shape.weight_bytes(dtype) + draft_weights,
                   kv_cache_dtype=kv_cache_dtype, block_size=block_size, window_bytes_per_request=window,
                   residual_blocks=residual, sliding_window=shape.sliding_window,
                   draft_model=draft.name if draft else None, draft_kv_bytes_per_token=-(-draft_block // block_size),
                   draft_weight_bytes=draft_weights)
    if gpu_mem_gib is not None:
        cap.gpu_mem_bytes = int(gpu_mem_gib * GIB)
        cap.reserve_bytes = int(cap.gpu_mem_bytes * RESERVE_FRACTION)
        cap.kv_budget_bytes = max(0, cap.gpu_mem_bytes - cap.reserve_bytes - cap.weight_bytes)
        cap.max_concurrent_requests = cap.kv_budget_bytes // cap.kv_bytes_per_request
        cap.batch_fits = cap.kv_bytes_for_batch <= cap.kv_budget_bytes
    return cap


def _size(n: int) -> str:
    return f"{n:,} B ({n / 1e9:.2f} GB, {n / GIB:.2f} GiB)"


def format_report(c: Capacity) -> str:
    lines = [
        f"model {c.model}, {c.dtype}, KV cache {c.kv_cache_dtype}, context {c.context} tokens, "
        f"batch {c.batch}",
        f"KV bytes per token        {c.kv_bytes_per_token:,} B",
        f"  same model as MHA       {c.mha_kv_bytes_per_token:,} B (GQA saves {c.gqa_saving:g}x)",
        *([f"  draft model {c.draft_model}: {c.draft_kv_bytes_per_token:,} B more"] if c.draft_model else []),
        f"KV per request            {_size(c.kv_bytes_per_request)}"
        + (f" (the model's sliding window of {c.sliding_window} tokens bounds it)"
           if c.sliding_window else ""),
        *([f"  of which windows        {_size(c.window_bytes_per_request)} (the block being filled + "
           f"{c.residual_blocks} residual)"]
          if c.window_bytes_per_request else []),
        f"KV for the batch          {_size(c.kv_bytes_for_batch)}",
        f"weights                   {_size(c.weight_bytes)}",
        *([f"  of which the draft      {_size(c.draft_weight_bytes)}"] if c.draft_model else []),
    ]
    if c.gpu_mem_bytes is not None:
        lines += [
            f"device memory             {_size(c.gpu_mem_bytes)}",
            f"  reserve ({RESERVE_FRACTION:.0%})           {_size(c.reserve_bytes)}",
            f"  left for KV             {_size(c.kv_budget_bytes)}",
            f"max concurrent requests   {c.max_concurrent_requests} at {c.context} tokens each",
            f"{f'batch of {c.batch} fits':<26}{'yes' if c.batch_fits else 'no'}",
        ]
    return "\n".join(lines)


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value
    return parse


def run_kv_calc(args: argparse.Namespace) -> int:
    try:
        if args.preset and args.quantization:
            raise ValueError("--quantization needs --model (a preset has no projection shapes)")
        shape = PRESETS[args.preset] if args.preset else shape_from_dir(args.model, args.quantization)
        draft = shape_from_dir(args.speculative_model) if args.speculative_model else None
        if draft and shape.config:  # a preset has no vocabulary to compare
            draft.config.check_drafts_for(shape.config, args.speculative_model)
        cap = plan(shape, args.dtype, args.context, args.batch, args.gpu_mem_gib, args.kv_cache_dtype,
                   args.block_size, args.kv_residual_blocks, draft)
    except (OSError, KeyError, ValueError, UnsupportedModelError, json.JSONDecodeError) as e:
        print(f"tidepool kv-calc: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(cap)) if args.json else format_report(cap))
    return 0


def add_kv_calc_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``kv-calc``; argument errors print one line and exit 2 (no usage dump, no traceback)."""
    p = subparsers.add_parser("kv-calc", help="KV-cache memory per token/request/batch and how many fit",
                              description="KV-cache bytes per token, request and batch for a model, and how "
                                          "many requests fit in a device's memory.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory (reads its config.json)")
    source.add_argument("--preset", choices=sorted(PRESETS), help="a named model shape")
    p.add_argument("--context", type=_positive(int), default=2048, help="tokens per request")
    p.add_argument("--batch", type=_positive(int), default=1, help="concurrent requests")
    p.add_argument("--dtype", default="float16", help="KV and weight dtype (float16, bfloat16, float32, fp8)")
    p.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                   help="weights as tidepool serve --quantization loads them (an fp8 or integer checkpoint is "
                        "counted as it is stored without it)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=FORMATS,
                   help="KV cache format: auto (the --dtype), int8, fp8 or kivi2 (2-bit), scales included")
    p.add_argument("--kv-residual-blocks", type=int, default=None, metavar="N", help=RESIDUAL_HELP)
    p.add_argument("--block-size", type=_positive(int), default=16,
                   help="tokens per KV block (fp8 and kivi2 scale per block)")
    p.add_argument("--gpu-mem-gib", type=_positive(float), default=None, help="device memory in GiB")
    p.add_argument("--speculative-model", metavar="DIR", default=None,
                   help="a draft model's checkpoint (as tidepool serve takes it): its weights and KV cache count too")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_kv_calc)

    def one_line_error(message: str) -> None:
        p.exit(2, f"tidepool kv-calc: error: {message}\n")

    p.error = one_line_error  # argparse's default prints the whole usage block first
    return p
