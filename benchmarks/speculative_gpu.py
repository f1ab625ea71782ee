"""Speculative decoding on one GPU: what a drafted step costs against a plain decode step, and the decode
speed with drafts against without, in the same run.

A random-weight bf16 checkpoint (``benchmarks/engine_gpu.py``'s shapes) decodes random prompts greedily,
without drafts and then with ``--num-speculative-tokens``, one engine after the other on the same prompts.
Random weights settle into repeating a few tokens within a few steps, which n-gram drafts predict: so the
acceptance here is near its best case and the speedup an upper bound for this shape and batch; what the run
really measures is the price of a drafted step. Plain decode steps replay CUDA graphs; a step holding a
draft replays a graph of its own (``engine/cuda_graphs.py``: every sequence padded to 1 + k rows), its
chunks (the last token and the draft) through the prefill kernel. Per batch size:

- decode tokens/s of both engines (the tokens after each sequence's first, over the time from the last
  prompt's first token to the end) and their ratio;
- the draft tokens accepted, and the tokens a drafted sequence gains per step;
- the median plain decode step and the median drafted step (both engines' decode-only steps), and their
  ratio: above 1 + accepted tokens per drafted step, drafts cost more than they save;
- whether both engines gave the same tokens (bf16 rounding may part them on random weights: a chunk's
  matmuls round otherwise than a decode row's).

``--draft-layers N`` drafts with a draft model instead (``--speculative-model``): the random checkpoint's
first N layers and its head (``benchmarks/early_exit.py``), whose one-token passes replay graphs of their
own. Its drafts agree with the model about as often as random weights repeat themselves, so the figure that
counts is the drafted step's cost: the draft's passes and the verification, against a plain step.

Writes one JSON object (``--json``). ``--device cpu --shapes tiny-test`` runs the same code on a tiny
float32 shape on CPU (a smoke test). Imports only torch, transformers, safetensors and the engine.

    python benchmarks/speculative_gpu.py [--shapes tinyllama-1.1b] [--batches 1,16,64] [--k 4] [--draft-layers N]
        [--prompt-len 512] [--new-tokens 128] [--json speculative_gpu.json] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.early_exit import early_exit_checkpoint  # noqa: E402
from benchmarks.engine_gpu import make_prompts, run_device, sync, write_checkpoint, write_result  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def decode(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Every prompt at once, greedily, to the end: the tokens, the decode phase's seconds (from the last
    prompt's first token on), each decode-phase step's seconds and whether it held a draft."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {}
    steps: list[tuple[float, bool]] = []
    started = None
    sync(engine.device)
    while engine.has_unfinished():
        drafts_before = engine.speculation.drafts
        t = time.perf_counter()
        outputs = engine.step()
        sync(engine.device)
        if started is not None:
            steps.append((time.perf_counter() - t, engine.speculation.drafts > drafts_before))
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if started is None and len(tokens) == len(prompts):
            started = time.perf_counter()
    return {"tokens": [tokens[str(i)] for i in range(len(prompts))], "seconds": time.perf_counter() - started,
            "steps": steps}


def median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def bench_shape(shape: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {"batches": {}}
    runs: dict[int, dict[int, dict]] = {b: {} for b in batches}
    with tempfile.TemporaryDirectory(prefix=f"speculative-gpu-{shape}-") as tmp:
        hf = write_checkpoint(Path(tmp) / "model", shape, dtype, device)
        vocab = hf.config.vocab_size
        del hf
        gc.collect()
        draft = (str(early_exit_checkpoint(Path(tmp) / "model", args.draft_layers, Path(tmp) / "draft"))
                 if args.draft_layers else None)
        for k in (0, args.k):  # one engine at a time: each sizes its KV cache from the free device memory
            engine = Engine(EngineConfig(
                model=str(Path(tmp) / "model"), dtype=str(dtype).removeprefix("torch."), device=str(device),
                max_num_seqs=max(batches), enable_prefix_caching=False,
                gpu_memory_utilization=args.gpu_memory_utilization, num_speculative_tokens=k,
                speculative_model=draft if k else None))
            for b in batches:
                prompts = make_prompts(b, args.prompt_len, vocab, seed=b)
                decode(engine, prompts, 4)  # warm-up: the kernels and graphs this batch needs
                before = engine.stats().speculation
                runs[b][k] = decode(engine, prompts, args.new_tokens)
                after = engine.stats().speculation
                runs[b][k]["drafted"] = (after.drafts - before.drafts, after.draft_tokens - before.draft_tokens,
                                         after.accepted_tokens - before.accepted_tokens)
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for b in batches:
        plain, spec = runs[b][0], runs[b][args.k]
        decoded = b * (args.new_tokens - 1)
        drafts, draft_tokens, accepted = spec["drafted"]
        plain_step = median_ms([t for t, _ in plain["steps"]])
        drafted_step = median_ms([t for t, drafted in spec["steps"] if drafted])
        row = {
            "plain_tokens_per_s": decoded / plain["seconds"], "spec_tokens_per_s": decoded / spec["seconds"],
            "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance": accepted / draft_tokens if draft_tokens else None,
            "tokens_per_drafted_step": 1 + accepted / drafts if drafts else None,
            "plain_decode_step_ms": plain_step, "drafted_step_ms": drafted_step,
            "same_tokens": sum(a == s for a, s in zip(plain["tokens"], spec["tokens"], strict=True)) / b,
        }
        row["speedup"] = row["spec_tokens_per_s"] / row["plain_tokens_per_s"]
        row["drafted_step_cost"] = drafted_step / plain_step if drafted_step and plain_step else None
        result["batches"][str(b)] = row
        print(f"  {shape} batch {b}: {row['plain_tokens_per_s']:.0f} -> {row['spec_tokens_per_s']:.0f} tok/s "
              f"(x{row['speedup']:.2f}); accepted {accepted}/{draft_tokens}; drafted step "
              f"{drafted_step or 0:.2f} ms vs plain {plain_step or 0:.2f} ms; same tokens {row['same_tokens']:.0%}",
              flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--shapes", default="tinyllama-1.1b", help="comma-separated shapes of engine_gpu.py")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    parser.add_argument("--draft-layers", type=int, default=0, metavar="N",
                        help="draft with the checkpoint's first N layers (a draft model) instead of prompt lookup")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--json", type=Path, default=Path("speculative_gpu.json"), help="where the figures go")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    device, dtype, name = run_device(args.device, args.dtype)
    result = {"device": name, "dtype": str(dtype).removeprefix("torch."), "k": args.k, "draft_layers": args.draft_layers,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "shapes": {shape: bench_shape(shape, args, device, dtype) for shape in args.shapes.split(",")}}
    return write_result(result, start, args.json)


if __name__ == "__main__":
    main()
