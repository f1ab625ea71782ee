"""Single-sequence prefill and decode speed of the engine's model runner against transformers
``generate`` on the same checkpoint, in the same process and run.

Both sides are timed per token: ours around each runner call, transformers through a stopping
criterion that timestamps every generate step. Prefill tok/s = prompt tokens / time to the first token
(best of ``--repeats``); decode tok/s = 1 / median gap between later tokens (over all repeats). Runs
alternate between the two; the best TTFT and the median gap are what survive other processes on a
shared machine, where a total-time ratio would mostly measure the neighbours.

    python benchmarks/engine_core_bench.py --model tiny --prompt-len 256 --new-tokens 64 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kv_cache import KVCache  # noqa: E402
from engine.loader import load_model, resolve_model_dir  # noqa: E402
from engine.runner import ModelRunner, SeqChunk  # noqa: E402


def ours(runner: ModelRunner, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """(time to first token, gaps between the following tokens) of greedy generation via the runner."""
    table = list(range(math.ceil((len(prompt) + new_tokens) / runner.block_size)))
    stamps = [time.perf_counter()]
    token = int(runner.run([SeqChunk(prompt, 0, table)])[0].argmax())
    stamps.append(time.perf_counter())
    for i in range(new_tokens - 1):
        token = int(runner.run([SeqChunk([token], len(prompt) + i, table)])[0].argmax())
        stamps.append(time.perf_counter())
    return stamps[1] - stamps[0], [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]


def theirs(model, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Stamp(StoppingCriteria):  # called once per generated token, right after it is chosen
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.tensor([prompt])
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, stopping_criteria=StoppingCriteriaList([Stamp()]))
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    model_dir = resolve_model_dir(args.model)
    model, cfg = load_model(model_dir, "float32", "cpu")
    blocks = math.ceil((args.prompt_len + args.new_tokens) / 16)
    runner = ModelRunner(model, cfg, KVCache(cfg, blocks, 16, torch.float32, "cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()

    ours(runner, prompt, 4)  # warm-up both paths
    theirs(hf, prompt, 4)
    runs: dict[str, tuple[list[float], list[float]]] = {"tidepool": ([], []), "transformers": ([], [])}
    for _ in range(args.repeats):
        for name, fn, target in (("tidepool", ours, runner), ("transformers", theirs, hf)):
            ttft, gaps = fn(target, prompt, args.new_tokens)
            runs[name][0].append(ttft)
            runs[name][1].extend(gaps)
    result = {"model": args.model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "threads": torch.get_num_threads(), "torch_version": torch.__version__,
              "transformers_version": transformers.__version__}
    for name, (ttfts, gaps) in runs.items():
        result[name] = {"prefill_tok_s": args.prompt_len / min(ttfts), "decode_tok_s": 1 / statistics.median(gaps),
                        "ttft_s_best": min(ttfts), "ttft_s_median": statistics.median(ttfts),
                        "decode_gap_s_median": statistics.median(gaps)}
    for metric in ("prefill_tok_s", "decode_tok_s"):
        result[f"{metric}_ratio"] = result["tidepool"][metric] / result["transformers"][metric]

    print(f"model={args.model} prompt_len={args.prompt_len} new_tokens={args.new_tokens} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} torch={torch.__version__} "
          f"transformers={transformers.__version__}")
    print(f"{'metric':<16}{'tidepool':>12}{'transformers':>14}{'ratio':>8}")
    for metric in ("prefill_tok_s", "decode_tok_s"):
        a, b = result["tidepool"][metric], result["transformers"][metric]
        print(f"{metric:<16}{a:>12.1f}{b:>14.1f}{a / b:>8.2f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
