"""Speculative decoding on a pretrained model, by n-gram prompt lookup or with a draft model: decode speed
with drafts against the same engine without them, in the same run.

SmolLM2-135M-Instruct (``benchmarks/pretrained.py``) answers six kinds of request, alone and in batches
of 4: repeating a passage it was given, greedily (the case prompt lookup is made for); rewriting a piece of
code with a function renamed, greedily, its answer started with a code fence (much of it quotes the
prompt), and the same with the renamed code as its predicted output (OpenAI's ``prediction``, which drafts
before prompt lookup does: the plain engine ignores it); a rock-pool creature as JSON kept to a schema (``benchmarks/structured_output.py``'s), greedily:
drafts are the grammar's forced tokens or n-gram ones it allows, with JSON's free whitespace and without it
(``disable_any_whitespace``: keys and separators forced); and writing a poem, sampled (temperature
0.8, top-p 0.95, seeded: little to look up, so mostly the cost of drafts that fail). For each it reports decode tokens per second with ``--num-speculative-tokens``
against without, the draft tokens accepted, the steps taken, the mean step time (a draft's chunk costs more
than a decode row), and whether both runs gave the same tokens (they must: seeded sampling included).

``--draft-layers N`` drafts with a draft model instead (``--speculative-model``): the checkpoint's own first N
layers, its final norm and its head (an early exit, ``benchmarks/early_exit.py``), the one smaller model with
its tokenizer at hand. It was not trained to stop there, so its drafts are worse than a trained draft's.

    python benchmarks/speculative.py [--tokens 128] [--k 4] [--draft-layers N] [--workload NAME ...]
                                     [--json speculative.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from benchmarks.early_exit import early_exit_checkpoint  # noqa: E402
from benchmarks.pretrained import ensure_pretrained  # noqa: E402
from benchmarks.structured_output import CREATURES, SCHEMA  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured_output import StructuredOutput  # noqa: E402
from services.gateway.structured_outputs import json_spec  # noqa: E402

PASSAGES = [
    "The tide pool is a small world left behind when the sea goes out. Crabs hide under the rocks, anemones "
    "close up to keep their water in, and limpets hold fast until the waves come back. Twice a day the pool "
    "is cut off and joined again, and everything in it has learned to wait.",
    "Rock pools warm quickly in the sun, and their salt grows stronger as the water evaporates. The animals "
    "that live there must bear heat, cold, fresh rain and the pounding of the surf, which is why so few kinds "
    "can make a home between the high and the low water marks.",
    "At night the pool changes: periwinkles climb out of the water, prawns leave their cracks to feed, and the "
    "starfish move slowly across the rocks looking for mussels. By morning most of them are back where they "
    "were, as if nothing had happened in the dark.",
    "Children love to look into tide pools, but every stone they turn over is somebody's roof. The rule on the "
    "shore is simple: look closely, touch gently, and put each rock back the way you found it, the right way up.",
]
CODE = '''def {name}(values):
    """Add up the numbers in a list, skipping anything that is not a number."""
    total = 0
    for value in values:
        if isinstance(value, (int, float)):
            total += value
    return total


def average(values):
    numbers = [v for v in values if isinstance(v, (int, float))]
    if not numbers:
        return 0.0
    return {name}(numbers) / len(numbers)
'''
NAMES = ["add_all", "total_of", "sum_numbers", "running_sum"]
TOPICS = ["the sea", "a lighthouse", "the wind", "a small boat"]


def workloads(engine: Engine) -> dict[str, tuple[list[list[int]], list[SamplingParams]]]:
    """Four chat prompts of each kind, rendered with the model's chat template, and how each is sampled."""
    def chat(system: str, user: str, answer_start: str = "") -> list[int]:
        return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": user}]) + answer_start)

    greedy = SamplingParams(max_tokens=0, temperature=0.0)
    json_prompts = [chat("You answer with one JSON object and nothing else. Its JSON Schema: " + json.dumps(SCHEMA),
                         f"Describe the {creature} as that JSON object.") for creature in CREATURES[:4]]
    sampled = SamplingParams(max_tokens=0, temperature=0.8, top_p=0.95, seed=1)
    code = [chat("You are a careful programmer.", f"Here is some Python code:\n\n{CODE.format(name=name)}\nRewrite "
                 f"this code with the function `{name}` renamed to `{name}_v2`.", "```python\n") for name in NAMES]
    # OpenAI's predicted output: the code as it would be with the function renamed, and the closing fence
    predictions = [engine.tokenizer.encode(CODE.format(name=f"{name}_v2") + "```\n", False) for name in NAMES]
    return {
        "repeat a passage": ([chat("Repeat the user's text exactly, word for word.", text) for text in PASSAGES],
                             [greedy] * 4),
        "rewrite code": (code, [greedy] * 4),
        "rewrite code, predicted": (code, [dataclasses.replace(greedy, prediction_ids=ids) for ids in predictions]),
        "JSON to a schema": (json_prompts, [dataclasses.replace(greedy, structured_output=StructuredOutput(
            "json", json_spec(SCHEMA)))] * 4),
        # vLLM's disable_any_whitespace: the keys and separators are forced, drafts that cannot miss
        "JSON, no whitespace": (json_prompts, [dataclasses.replace(greedy, structured_output=StructuredOutput(
            "json", json_spec(SCHEMA, compact=True)))] * 4),
        "write a poem (sampled)": ([chat("You are a poet.", f"Write a short poem about {topic}.")
                                    for topic in TOPICS], [sampled] * 4),
    }


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Every prompt at once (``params[i]``: how prompt i is sampled), to the end: the tokens, and how long the
    decode took (from the first token on, so the prompts' compute, the same with or without drafts, is left
    out)."""
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), ids, p)
    tokens: dict[str, list[int]] = {}
    steps, started, step_times = 0, None, []
    while engine.has_unfinished():
        before = time.perf_counter()
        outputs = engine.step()
        if started is not None:
            steps += 1
            step_times.append(time.perf_counter() - before)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if started is None and len(tokens) == len(prompts):
            started = time.perf_counter()  # every prompt has its first token
    seconds = time.perf_counter() - started
    decoded = sum(len(t) - 1 for t in tokens.values())
    return {"tokens": [tokens[str(i)] for i in range(len(prompts))], "decoded_tokens": decoded,
            "decode_s": seconds, "steps": steps, "tokens_per_s": decoded / seconds,
            "mean_step_ms": 1000 * sum(step_times) / max(len(step_times), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128, help="max_tokens of each answer")
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--batches", default="1,4", help="batch sizes, comma-separated")
    p.add_argument("--draft-layers", type=int, default=0, metavar="N",
                   help="draft with the model's first N layers (a draft model) instead of prompt lookup")
    p.add_argument("--workload", action="append", metavar="NAME",
                   help="run only this workload (repeatable; default: all)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    model_dir = ensure_pretrained()
    scratch = tempfile.TemporaryDirectory(prefix="early-exit-")
    draft = (None if not args.draft_layers
             else str(early_exit_checkpoint(model_dir, args.draft_layers, Path(scratch.name) / "draft")))
    engines = {k: Engine(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=1024,
                                      num_speculative_tokens=k, speculative_model=draft if k else None))
               for k in (0, args.k)}
    prompts = workloads(engines[0])
    if unknown := set(args.workload or ()) - set(prompts):
        p.error(f"no workload {sorted(unknown)}; the workloads: {list(prompts)}")
    for engine in engines.values():  # warm up
        run(engine, prompts["repeat a passage"][0][:1], [SamplingParams(max_tokens=8, temperature=0.0)])
    results = []
    for name, (batch_prompts, params) in prompts.items():
        if args.workload and name not in args.workload:
            continue
        params = [dataclasses.replace(p, max_tokens=args.tokens) for p in params]
        for batch in (int(b) for b in args.batches.split(",")):
            plain = run(engines[0], batch_prompts[:batch], params[:batch])
            engine = engines[args.k]
            before = engine.stats().speculation
            drafted = run(engine, batch_prompts[:batch], params[:batch])
            after = engine.stats().speculation
            draft_tokens = after.draft_tokens - before.draft_tokens
            accepted = after.accepted_tokens - before.accepted_tokens
            row = {
                "workload": name, "batch": batch, "k": args.k,
                "plain_tokens_per_s": round(plain["tokens_per_s"], 1),
                "spec_tokens_per_s": round(drafted["tokens_per_s"], 1),
                "speedup": round(drafted["tokens_per_s"] / plain["tokens_per_s"], 2),
                "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                "acceptance": round(accepted / draft_tokens, 3) if draft_tokens else None,
                "steps_plain": plain["steps"], "steps_spec": drafted["steps"],
                "step_ms_plain": round(plain["mean_step_ms"], 1), "step_ms_spec": round(drafted["mean_step_ms"], 1),
                "same_tokens": plain["tokens"] == drafted["tokens"],
                "decoded_tokens": plain["decoded_tokens"],
            }
            results.append(row)
    print(f"load average {load_average()}; {model_dir.name}, float32, max_tokens {args.tokens}, "
          f"--num-speculative-tokens {args.k} ("
          f"{f'a draft of its first {args.draft_layers} layers' if draft else 'prompt lookup 4..2 tokens'}); "
          f"tokens/s of the decode (from the batch's "
          f"last first token on), plain and drafted engines in one run")
    print(format_table(
        ["workload", "batch", "plain tok/s", "drafted tok/s", "speedup", "accepted/drafted", "steps plain/drafted",
         "ms/step plain/drafted", "same tokens"],
        [[r["workload"], r["batch"], r["plain_tokens_per_s"], r["spec_tokens_per_s"], r["speedup"],
          f"{r['accepted_tokens']}/{r['draft_tokens']} ({r['acceptance'] or 0:.2f})",
          f"{r['steps_plain']} / {r['steps_spec']}", f"{r['step_ms_plain']} / {r['step_ms_spec']}",
          "yes" if r["same_tokens"] else "NO"] for r in results]))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(model_dir.name), "draft_layers": args.draft_layers,
                                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
