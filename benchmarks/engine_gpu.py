"""The engine on one GPU: decode and prefill throughput against the device's own limits and transformers.

One run, random-weight bf16 checkpoints of two shapes, written with transformers into a temporary
directory: TinyLlama-1.1B (hidden 2048, 22 layers, 32 heads / 4 KV heads, intermediate 5632, vocab 32000)
and Llama-3-8B (hidden 4096, 32 layers, 32 / 8, intermediate 14336, vocab 128256). For each, at batch 1,
16, 64 and 256 (random prompts of 512 tokens, 128 new, greedy, every request added at once):

- tokens/s: new tokens over the wall time from the first step to the last (prefill included), and the
  median decode step (the steps computing no prompt token);
- the decode roofline: a decode step reads every weight it uses (all but the embedding table) and each
  sequence's K/V at least once, so it takes at least (weight bytes + KV bytes) / the HBM copy bandwidth,
  measured in the same run (a 1 GiB device-to-device copy timed with CUDA events: read + write bytes
  over the time); the fraction reached is that bound over the median decode step;
- prefill tokens/s and MFU: prompt tokens over the time of the steps that computed prompt tokens (decode
  rows riding along in them count in the FLOPs); FLOPs = 2 x the matmul parameters per token (embedding
  and lm_head left out) + causal attention (4 x heads x head_dim per key per layer); MFU = those FLOPs
  per second over the rate of a large bf16 matmul measured in the same run;
- transformers ``generate`` on the same GPU, checkpoint and prompts (its defaults: SDPA attention, the
  dynamic cache), one batch at a time, and how many of its greedy sequences equal the engine's (bf16
  rounding may part them on random weights; in float32 they agree).

The engine sizes its KV cache from the device (``gpu_memory_utilization``) with the transformers model
resident, and is freed before ``generate`` runs; with a quantized ``--kv-cache-dtype`` the roofline counts
that format's bytes per token, scales included, and with ``--quantization fp8`` or ``--int-weights LAYOUT``
(the checkpoint rewritten with integer projections of ``--int-bits`` 4 or 8, AWQ's (4-bit only), GPTQ's or
compressed-tensors' layout, in groups of 128 before the engine loads it, or ``w8a8``: int8 with a scale a row
beside int8 activations a token, whose JSON adds the rate of a large int8 matmul, W8A8's prefill peak;
transformers still runs the 16-bit weights) the weights' own bytes. With ``--async-scheduling`` each step is
launched before the last one's
tokens reach the host (``EngineConfig.async_scheduling``), and a step's time is the wall time between two
``step`` calls, with no synchronization between them (what a served step takes once the host's work hides
behind the device's); otherwise each step is timed to the device's end of it. Writes one JSON object
(``--json``). ``--device cpu --shapes tiny-test`` runs the same code on a tiny float32 shape on CPU (a smoke test). Imports only torch,
transformers, safetensors (through the engine's loader) and the engine.

    python benchmarks/engine_gpu.py [--shapes tinyllama-1.1b,llama-3-8b] [--batches 1,16,64,256]
        [--prompt-len 512] [--new-tokens 128] [--json engine_gpu.json] [--skip-hf] [--device cuda]
        [--kv-cache-dtype auto|int8|fp8|kivi2] [--async-scheduling]
        [--quantization fp8 | --int-weights awq|gptq|compressed-tensors [--int-bits 4|8] | --int-weights w8a8]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import (  # noqa: E402
    INT_BITS,
    INT_LAYOUTS,
    QUANTIZATION_METHODS,
    EngineConfig,
    IntQuant,
    ModelConfig,
)
from engine.engine import Engine  # noqa: E402
from engine.int_weights import widest_group, write_int_checkpoint  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.w8a8 import INT8_ROW_FORMATS  # noqa: E402

SHAPES: dict[str, dict] = {
    "tinyllama-1.1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                           max_position_embeddings=2048),
    "llama-3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0),
    "tiny-test": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256, max_position_embeddings=512),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Fastest of ``repeats`` calls after one warm-up; CUDA events on a GPU."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return best


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large copy on ``device`` (read + write bytes)."""
    nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), device)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in ``dtype``; int8: integer ops/s with int32 sums (``torch._int_mm``,
    W8A8's prefill peak)."""
    n = 8192 if device.type == "cuda" else 512
    if dtype == torch.int8:
        a, b = (torch.randint(-128, 128, (n, n), dtype=dtype, device=device) for _ in range(2))
        return 2 * n**3 / best_seconds(lambda: torch._int_mm(a, b.t()), device)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / best_seconds(lambda: a @ b, device)


def write_checkpoint(path: Path, shape: str, dtype: torch.dtype, device: torch.device,
                     int_weights: tuple[str, int] | None = None):
    """A random-weight Llama of ``shape`` saved to ``path``; returns the transformers model (on ``device``).
    Built on the device, so initializing 8B parameters takes seconds (it is the disk write that costs).
    ``int_weights``: (layout, bits), the checkpoint written with its projections as integers of ``bits`` in
    that layout (``write_int_weights``) instead, its 16-bit weights never written."""
    config = transformers.LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, bos_token_id=1,
                                      eos_token_id=2)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if int_weights is None:
        model.save_pretrained(path)
        return model
    model.config.architectures = [type(model).__name__]  # what save_pretrained would record
    model.generation_config.save_pretrained(path)
    write_int_weights(path, model, *int_weights)
    return model


def write_int_weights(path: Path, model: transformers.PreTrainedModel, layout: str, bits: int) -> None:
    """``model``'s config and weights to ``path``, its projections quantized to ``bits`` in ``layout`` (round to
    nearest in groups of 128, or the widest dividing the tiny shape's, on the model's device; ``w8a8``: as
    RedHat's w8a8 releases, symmetric int8 a scale a row, int8 activations)."""
    config = model.config.to_dict()
    quant = INT8_ROW_FORMATS.get(layout) or IntQuant(layout, widest_group(ModelConfig.from_dict(config)), bits=bits)
    write_int_checkpoint(path, model.state_dict(), config, quant)


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Every prompt at once to completion: wall seconds, the tokens, and each step's (seconds, prompt
    chunks as (tokens, tokens before them), decode rows, their context tokens). An async-scheduled engine's
    steps are not waited for: a step's seconds run to the next ``step`` call."""
    wait = not engine.config.async_scheduling
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    steps = []
    sync(engine.device)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    while engine.has_unfinished():
        t = time.perf_counter()
        outputs = engine.step()
        if wait:
            sync(engine.device)
        s = engine.last_step
        if s is not None:  # (None: a last call that only took the last step's tokens)
            steps.append((time.perf_counter() - t, [(n, pos) for _, n, pos in s.prefill_chunks], s.decode_seqs,
                          s.decode_context_tokens))
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
    return {"seconds": time.perf_counter() - start, "tokens": [tokens[str(i)] for i in range(len(prompts))],
            "steps": steps}


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], new_tokens: int,
           device: torch.device) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    sync(device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    sync(device)
    return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters in each token's matmuls, embedding and lm_head aside."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size)


def step_flops(cfg: ModelConfig, chunks: list[tuple[int, int]], decode_rows: int, decode_ctx: int) -> float:
    """Model FLOPs of one step: the matmuls per token, and attention over each query's keys (a chunk of n
    tokens after ``pos`` sees n x pos + n(n+1)/2 keys in all; a decode row its context)."""
    keys = sum(n * pos + n * (n + 1) // 2 for n, pos in chunks) + decode_ctx
    tokens = sum(n for n, _ in chunks) + decode_rows
    return 2 * matmul_params(cfg) * tokens + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys


def batch_figures(run: dict, cfg: ModelConfig, batch: int, new_tokens: int, weight_read: int,
                  kv_per_token: int, bandwidth: float, peak_flops: float) -> dict:
    steps = run["steps"]
    decode = [(t, ctx) for t, chunks, _, ctx in steps if not chunks]
    prefill = [(t, chunks, rows, ctx) for t, chunks, rows, ctx in steps if chunks]
    median = statistics.median(t for t, _ in decode) if decode else None
    ctx = statistics.mean(c for _, c in decode) if decode else 0.0
    roofline = (weight_read + ctx * kv_per_token) / bandwidth
    prefill_s = sum(t for t, *_ in prefill)
    prompt_tokens = sum(n for _, chunks, _, _ in prefill for n, _ in chunks)
    flops = sum(step_flops(cfg, chunks, rows, c) for _, chunks, rows, c in prefill)
    return {
        "seconds": run["seconds"], "tokens_per_s": batch * new_tokens / run["seconds"],
        "decode_steps": len(decode), "median_decode_step_ms": None if median is None else 1e3 * median,
        "roofline_decode_step_ms": 1e3 * roofline, "roofline_tokens_per_s": batch / roofline,
        "roofline_fraction": None if median is None else roofline / median,
        "prefill_tokens": prompt_tokens, "prefill_seconds": prefill_s,
        "prefill_tokens_per_s": prompt_tokens / prefill_s, "prefill_mfu": flops / prefill_s / peak_flops,
        "hf_tokens_per_s": None, "speedup_vs_hf": None, "hf_same_tokens": None,  # filled in unless --skip-hf
    }


def bench_shape(shape: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                bandwidth: float, peak_flops: float) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {"batches": {}}
    with tempfile.TemporaryDirectory(prefix=f"engine-gpu-{shape}-") as tmp:
        t = time.perf_counter()
        hf = write_checkpoint(Path(tmp), shape, dtype, device,
                              None if args.int_weights is None else (args.int_weights, args.int_bits))
        result["checkpoint_s"] = time.perf_counter() - t
        t = time.perf_counter()
        engine = Engine(EngineConfig(
            model=tmp, dtype=str(dtype).removeprefix("torch."), device=str(device), max_num_seqs=max(batches),
            max_num_batched_tokens=args.max_batched_tokens, enable_prefix_caching=False,
            gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization, async_scheduling=args.async_scheduling))
        result["engine_load_s"] = time.perf_counter() - t
    cfg = engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    embed = engine.model.model.embed_tokens.weight
    weight_read = weight_bytes - embed.numel() * embed.element_size()  # only the batch's rows of the table
    kv_per_token = engine.kv_cache.block_nbytes / engine.block_size  # the cache's format, scales included
    result.update(parameters=cfg.num_parameters(), weight_bytes=weight_bytes,
                  weight_bytes_read_per_step=weight_read, kv_bytes_per_token=kv_per_token,
                  num_blocks=engine.kv_cache.num_blocks, attention_backend=engine.attention_backend)
    print(f"{shape}: {cfg.num_parameters():,} parameters, {engine.kv_cache.num_blocks} KV blocks, "
          f"{engine.attention_backend} attention; checkpoint {result['checkpoint_s']:.1f}s, "
          f"engine load {result['engine_load_s']:.1f}s", flush=True)
    prompts = {b: make_prompts(b, args.prompt_len, cfg.vocab_size, seed=b) for b in batches}
    tokens = {}
    for b in batches:
        run_engine(engine, prompts[b], 2)  # warm-up: compiles the kernels this batch's shapes need
        run = run_engine(engine, prompts[b], args.new_tokens)
        tokens[b] = run["tokens"]
        row = batch_figures(run, cfg, b, args.new_tokens, weight_read, kv_per_token, bandwidth, peak_flops)
        result["batches"][str(b)] = row
        median = "-" if row["median_decode_step_ms"] is None else f"{row['median_decode_step_ms']:.2f}"
        print(f"  batch {b}: {row['tokens_per_s']:.0f} tok/s, median decode step {median} ms "
              f"(roofline {row['roofline_decode_step_ms']:.2f} ms, {row['roofline_fraction'] or 0:.0%}), "
              f"prefill {row['prefill_tokens_per_s']:.0f} tok/s, MFU {row['prefill_mfu']:.1%}", flush=True)
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        t = time.perf_counter()
        run_hf(hf, prompts[batches[0]][:1], 2, device)  # warm-up
        for b in batches:
            seconds, hf_tokens = run_hf(hf, prompts[b], args.new_tokens, device)
            row = result["batches"][str(b)]
            row["hf_tokens_per_s"] = b * args.new_tokens / seconds
            row["speedup_vs_hf"] = row["tokens_per_s"] / row["hf_tokens_per_s"]
            row["hf_same_tokens"] = sum(a == h for a, h in zip(tokens[b], hf_tokens, strict=True)) / b
            print(f"  batch {b}: transformers generate {row['hf_tokens_per_s']:.0f} tok/s "
                  f"(engine x{row['speedup_vs_hf']:.2f}; same greedy tokens for {row['hf_same_tokens']:.0%})",
                  flush=True)
        result["hf_s"] = time.perf_counter() - t
    del hf
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--shapes", default="tinyllama-1.1b,llama-3-8b",
                        help=f"comma-separated subset of {', '.join(SHAPES)}")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-batched-tokens", type=int, default=8192, help="the engine's step token budget")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--skip-hf", action="store_true", help="the engine and the device limits only")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8", "kivi2"))
    parser.add_argument("--async-scheduling", action="store_true",
                        help="launch each step before the last one's tokens reach the host")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                         help="fp8: the projections quantized as they load (the roofline counts their bytes)")
    weights.add_argument("--int-weights", default=None, choices=(*INT_LAYOUTS, "w8a8"),
                         help="the checkpoint's projections written as integers in this layout, groups of 128; "
                              "w8a8: int8 a scale a row, with int8 activations a token (RedHat's w8a8 releases)")
    parser.add_argument("--int-bits", type=int, default=4, choices=INT_BITS,
                        help="--int-weights' code width (AWQ's is 4)")
    parser.add_argument("--json", type=Path, default=Path("engine_gpu.json"), help="where the figures go")
    args = parser.parse_args(argv)
    if args.int_weights == "awq" and args.int_bits != 4:
        parser.error("--int-weights awq holds 4-bit codes only (--int-bits 4)")
    if args.int_weights == "w8a8":
        args.int_bits = 8
    start = time.perf_counter()
    device, dtype, name = run_device(args.device, args.dtype)
    bandwidth, peak = copy_bandwidth(device), matmul_rate(device, dtype)
    print(f"{name}: copy bandwidth {bandwidth / 1e9:.0f} GB/s, {str(dtype).removeprefix('torch.')} matmul "
          f"{peak / 1e12:.1f} TFLOP/s", flush=True)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = {
        "device": name, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
        "transformers": transformers.__version__, "triton": triton_version,
        "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": peak, "prompt_len": args.prompt_len,
        "int8_matmul_ops_per_s": matmul_rate(device, torch.int8) if args.int_weights == "w8a8" else None,
        "new_tokens": args.new_tokens, "max_batched_tokens": args.max_batched_tokens, "kv_cache_dtype": args.kv_cache_dtype,
        "async_scheduling": args.async_scheduling,
        "quantization": args.quantization, "int_weights": args.int_weights,
        "int_bits": None if args.int_weights is None else args.int_bits,
        "shapes": {shape: bench_shape(shape, args, device, dtype, bandwidth, peak)
                   for shape in args.shapes.split(",")},
    }
    return write_result(result, start, args.json)


def run_device(device_name: str, dtype_name: str | None) -> tuple[torch.device, torch.dtype, str]:
    """(device, dtype: bfloat16 on CUDA unless named, float32 on CPU, the device's name) of a GPU benchmark run;
    transformers' warnings silenced."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name or ("bfloat16" if device.type == "cuda" else "float32"))
    return device, dtype, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def write_result(result: dict, start: float, path: Path) -> dict:
    """``result`` with the run's wall time, written to ``path`` as JSON (the GPU benchmarks' last step)."""
    result["wall_s"] = time.perf_counter() - start
    path.write_text(json.dumps(result, indent=2))
    print(f"done in {result['wall_s']:.0f}s; figures in {path}", flush=True)
    return result


if __name__ == "__main__":
    main()
