"""Structured outputs on a real model: how often its answers keep to a JSON schema without the grammar and with
it, and what the grammar costs the decode loop.

Model: SmolLM2-135M-Instruct (benchmarks/pretrained.py, a 49,152-token vocabulary), in the engine on this
machine. Each of ``--requests`` chats asks for one creature of the rock pools as a JSON object with the
schema's fields (the schema is in the prompt), greedy, all in one batch. The peer is the same model on the
same prompts without a grammar, in the same run:

- valid: answers that parse as JSON and validate against the schema, free and kept to the schema
  (``response_format: json_schema``); answers cut by max_tokens count as invalid;
- decode: output tokens per second over the whole batch, free and kept (kept answers are shorter, so the
  batch thins sooner: read the grammar's own cost instead), and the grammar's time per engine step and its
  share of the run (the bitmask fill before each forward pass, plus applying it to the logits).

    python benchmarks/structured_output.py [--requests 16] [--max-tokens 96] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from benchmarks.pretrained import ensure_pretrained  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured_output import GrammarMasks, StructuredOutput  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "habitat": {"type": "string", "maxLength": 80},
                                           "legs": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["name", "habitat", "legs"], "additionalProperties": False}
CREATURES = ["shore crab", "beadlet anemone", "common limpet", "sea star", "periwinkle", "hermit crab",
             "blenny", "prawn", "dog whelk", "barnacle", "sea urchin", "brittle star", "mussel", "goby",
             "cushion star", "chiton"]


class GrammarClock:
    """Seconds the engine spends in GrammarMasks.fill and apply (wrapped for the run)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._fill, self._apply = GrammarMasks.fill, GrammarMasks.apply

    def __enter__(self) -> GrammarClock:
        def timed(fn):
            def run(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
            return run

        GrammarMasks.fill = timed(self._fill)
        GrammarMasks.apply = staticmethod(timed(self._apply))
        return self

    def __exit__(self, *exc) -> None:
        GrammarMasks.fill, GrammarMasks.apply = self._fill, staticmethod(self._apply)


def run_batch(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Every prompt at once, to the end: the answers, output tokens, seconds, and the grammar's seconds."""
    texts = [""] * len(prompts)
    reasons: list[str | None] = [None] * len(prompts)
    tokens = steps = 0
    with GrammarClock() as clock:
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, params)
        while engine.has_unfinished():
            steps += 1
            for out in engine.step():
                i = int(out.request_id)
                texts[i] += out.text
                tokens += len(out.new_token_ids)
                if out.finished:
                    reasons[i] = str(out.finish_reason)
        seconds = time.perf_counter() - start
    valid = sum(_valid(text) for text in texts)
    return {"answers": texts, "finish_reasons": reasons, "valid": valid, "output_tokens": tokens,
            "seconds": seconds, "steps": steps, "tokens_per_s": tokens / seconds, "grammar_s": clock.seconds}


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)

    model_dir = ensure_pretrained()
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=1024, max_num_seqs=64))
    system = ("You answer with one JSON object and nothing else. Its JSON Schema: " + json.dumps(SCHEMA))
    prompts = [engine.tokenizer.encode(engine.tokenizer.apply_chat_template([
        {"role": "system", "content": system},
        {"role": "user", "content": f"Describe the {CREATURES[i % len(CREATURES)]} as that JSON object."}]))
        for i in range(args.requests)]
    kept = StructuredOutput("json", json.dumps(SCHEMA))
    run_batch(engine, prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, structured_output=kept))  # warm up
    free = run_batch(engine, prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    constrained = run_batch(engine, prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                            structured_output=kept))
    rows = [[name, f"{r['valid']}/{args.requests}", r["output_tokens"], r["steps"], r["tokens_per_s"],
             1e3 * r["grammar_s"] / r["steps"], 100 * r["grammar_s"] / r["seconds"]]
            for name, r in (("free", free), ("json_schema", constrained))]
    print(f"load average {load_average()}; SmolLM2-135M-Instruct, {args.requests} chats in one batch, greedy, "
          f"max_tokens {args.max_tokens}")
    print(format_table(["answers", "valid", "output tokens", "steps", "decode tok/s", "grammar ms/step",
                        "grammar % of time"], rows))
    print(f"kept / free decode tok/s: {constrained['tokens_per_s'] / free['tokens_per_s']:.2f}")
    print("first free answer:", json.dumps(free["answers"][0][:160]))
    print("first kept answer:", json.dumps(constrained["answers"][0][:160]))
    if args.json:
        Path(args.json).write_text(json.dumps({"requests": args.requests, "max_tokens": args.max_tokens,
                                               "free": free, "json_schema": constrained}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
