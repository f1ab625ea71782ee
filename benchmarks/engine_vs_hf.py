"""Engine throughput against transformers on the same checkpoint, and against the memory roofline.

One run, float32, CPU, the built-in ``tiny`` checkpoint (or ``--model DIR``, or ``--random-shape NAME``: a
random-weight mixture of experts written by transformers, ``RANDOM_SHAPES``):

- (a) 8 prompts x 256 tokens, 64 new tokens, greedy;
- (b) 32 prompts with lengths spread evenly over 32..512 tokens, 128 new tokens, greedy.

Each workload is timed end to end (prefill included) for this engine, transformers ``generate`` on one
left-padded static batch, and transformers ``generate_batch`` (its continuous batching). The roofline:
a decode step reads every weight once, so steps/s <= copy bandwidth / weight bytes, where the copy
bandwidth is measured in the same run (a large ``Tensor.copy_``, read + write bytes); tokens/s <=
that x the number of sequences decoding together. A profile of the engine on (a) (prefill vs decode
steps, the forward pass's share under cProfile, the heaviest torch ops) shows where the gap to the
roofline goes. Torch runs one thread by default: on a shared machine that keeps the figures stable,
and every system gets the same threads; each figure is the best of ``--repeats`` runs.

    python benchmarks/engine_vs_hf.py [--model tiny | --random-shape qwen3-moe|mixtral] [--threads N]
        [--repeats N] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.loader import resolve_model_dir  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

WORKLOADS = {  # name -> (prompt lengths, new tokens)
    "a": ([256] * 8, 64),
    "b": ([32 + round(i * (512 - 32) / 31) for i in range(32)], 128),
}


# Mixture-of-experts shapes at the tiny model's scale (hidden 512, 4 layers, 8 query / 4 KV heads, vocab
# 1024): Qwen3-MoE's many small experts (16 of 384, 4 a token) and Mixtral's few large ones (8 of 1024, 2).
RANDOM_SHAPES = {
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384,
                                         norm_topk_prob=True, head_dim=64)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),  # of intermediate_size
}


def write_random_checkpoint(shape: str, path: Path) -> Path:
    """A seeded random-weight checkpoint of ``RANDOM_SHAPES[shape]`` saved to ``path`` by transformers."""
    import transformers

    config_name, extra = RANDOM_SHAPES[shape]
    config = getattr(transformers, config_name)(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def make_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s moved by the best of ``repeats`` large copies (each reads and writes ``nbytes``)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int,
               step_log: list[tuple[bool, float]] | None = None) -> tuple[float, list[list[int]]]:
    """Wall seconds to finish every prompt, the tokens; ``step_log`` gets (prefilled?, seconds) per step."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    while engine.has_unfinished():
        before, t = engine.prompt_tokens_computed, time.perf_counter()
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        if step_log is not None:
            step_log.append((engine.prompt_tokens_computed > before, time.perf_counter() - t))
    return time.perf_counter() - start, [out[str(i)] for i in range(len(prompts))]


@torch.inference_mode()
def run_hf_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only batched generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    elapsed = time.perf_counter() - start
    return elapsed, out[:, width:].tolist()


def run_hf_generate_batch(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config, max_new_tokens=new_tokens)
    elapsed = time.perf_counter() - start
    ordered = list(results.values())  # generate_batch returns results in input order
    return elapsed, [list(r.generated_tokens) for r in ordered]


def profile_engine(engine: Engine, prompts: list[list[int]], new_tokens: int, step_s: float, top: int) -> str:
    """Where the engine's time goes on one workload: prefill vs decode steps (against the roofline
    step), the forward pass's share under cProfile, and the heaviest torch ops."""
    from torch.profiler import ProfilerActivity, profile

    buf = io.StringIO()
    log: list[tuple[bool, float]] = []
    elapsed, _ = run_engine(engine, prompts, new_tokens, log)
    prefill = sum(t for p, t in log if p)
    decode = [t for p, t in log if not p]
    buf.write(f"steps: {len(log) - len(decode)} with prefill {prefill:.2f}s ({100 * prefill / elapsed:.0f}%), "
              f"{len(decode)} decode-only {sum(decode):.2f}s, median decode step "
              f"{1e3 * sorted(decode)[len(decode) // 2]:.1f} ms vs roofline step {1e3 * step_s:.1f} ms\n")
    prof = cProfile.Profile()
    prof.enable()
    elapsed, _ = run_engine(engine, prompts, new_tokens)
    prof.disable()
    stats = pstats.Stats(prof)
    forward = next((v[3] for k, v in stats.stats.items() if k[2] == "run" and k[0].endswith("runner.py")), 0.0)
    buf.write(f"cProfile: ModelRunner.run (the forward pass) {forward:.2f}s of {elapsed:.2f}s = "
              f"{100 * forward / elapsed:.1f}%; scheduling, sampling and bookkeeping are the rest\n")
    with profile(activities=[ProfilerActivity.CPU]) as torch_prof:
        run_engine(engine, prompts, new_tokens)
    buf.write(torch_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--random-shape", choices=list(RANDOM_SHAPES), default=None,
                        help="benchmark a random-weight checkpoint of this shape instead of --model")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine one core gives stable figures)")
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per system and workload")
    parser.add_argument("--json", type=Path, default=None, help="write the figures per workload here")
    parser.add_argument("--workloads", default="a,b", help="comma-separated subset of a,b")
    parser.add_argument("--quick", action="store_true", help="a quarter of the new tokens (smoke test)")
    parser.add_argument("--skip-hf", action="store_true", help="engine and roofline only")
    parser.add_argument("--profile-top", type=int, default=12, help="torch ops listed in the profile")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.random_shape is not None:
        with tempfile.TemporaryDirectory() as tmp:
            args.model = str(write_random_checkpoint(args.random_shape, Path(tmp)))
            return run(args)
    return run(args)


def run(args: argparse.Namespace) -> int:

    engine = Engine(EngineConfig(model=args.model, dtype="float32", device="cpu", max_num_seqs=64,
                                 max_num_batched_tokens=2048, enable_prefix_caching=False))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    bandwidth = copy_bandwidth()
    step_s = weight_bytes / bandwidth
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=torch.float32).eval()
    vocab = min(256, engine.model_config.vocab_size)
    run_engine(engine, make_prompts([64, 16], vocab, 99), 4)  # warm-up (allocator, first-call costs)
    label = f"random {args.random_shape}" if args.random_shape else args.model
    print(f"model {label}: {weight_bytes / 1e6:.1f} MB float32 weights; torch threads {args.threads}; "
          f"copy bandwidth {bandwidth / 1e9:.2f} GB/s -> roofline decode step {1e3 * step_s:.1f} ms; "
          f"best of {args.repeats} runs each", flush=True)

    def best(fn, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        runs = [fn(prompts, new_tokens) for _ in range(args.repeats)]
        return min(runs, key=lambda r: r[0])

    results: dict[str, dict[str, float]] = {}
    for name in args.workloads.split(","):
        lengths, new_tokens = WORKLOADS[name]
        new_tokens = max(4, new_tokens // 4) if args.quick else new_tokens
        prompts = make_prompts(lengths, vocab, seed=ord(name))
        total = len(prompts) * new_tokens
        ours_s, ours = best(lambda p, n: run_engine(engine, p, n), prompts, new_tokens)
        assert all(len(t) == new_tokens for t in ours)
        row = {"ours_tok_s": total / ours_s, "hf_generate_tok_s": None, "hf_generate_batch_tok_s": None,
               "roofline_tok_s": len(prompts) / step_s}
        line = (f"({name}) {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {new_tokens} new: "
                f"ours {row['ours_tok_s']:.1f} tok/s ({ours_s:.1f}s)")
        if hf is not None:
            gen_s, gen = best(lambda p, n: run_hf_generate(hf, p, n), prompts, new_tokens)
            row["hf_generate_tok_s"] = total / gen_s
            batch_s, batched = best(lambda p, n: run_hf_generate_batch(hf, p, n), prompts, new_tokens)
            row["hf_generate_batch_tok_s"] = sum(len(t) for t in batched) / batch_s
            same = sum(a == b for a, b in zip(ours, gen, strict=True))
            line += (f"; generate {row['hf_generate_tok_s']:.1f} tok/s ({gen_s:.1f}s)"
                     f"; generate_batch {row['hf_generate_batch_tok_s']:.1f} tok/s ({batch_s:.1f}s)"
                     f"; ours x{row['ours_tok_s'] / row['hf_generate_tok_s']:.2f} generate, "
                     f"x{row['ours_tok_s'] / row['hf_generate_batch_tok_s']:.2f} generate_batch; "
                     f"greedy tokens equal to generate's for {same}/{len(prompts)} prompts")
        line += f"; roofline {row['roofline_tok_s']:.1f} tok/s (ours at {row['ours_tok_s'] / row['roofline_tok_s']:.0%})"
        print(line, flush=True)
        results[name] = row
    first = args.workloads.split(",")[0]
    lengths, new_tokens = WORKLOADS[first]
    new_tokens = max(4, new_tokens // 4) if args.quick else new_tokens
    print(f"\nprofile of the engine on ({first}):")
    print(profile_engine(engine, make_prompts(lengths, vocab, seed=ord(first)), new_tokens, step_s,
                         args.profile_top))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
