"""What streaming detokenization costs a token: tokenizers' ``DecodeStream`` against the same windowed decode
run from Python, in the same run.

Every generated token of every sequence is detokenized on the worker between two decode steps
(``engine/output.py``), so its cost is part of the host work a GPU step waits on (``benchmarks/engine_host.py``).
``engine.tokenizer.IncrementalDetokenizer`` hands the window to the library's stream, one call a token; its
``use_stream=False`` runs the window in Python (two decodes a token), which it also falls back to where the
stream refuses a token. Both stream the repository's docs (English prose, code, tables, some non-ASCII) token by
token, primed with four tokens of context as a served request is, and must give the text the whole-sequence
decode gives. Tokenizers: the built-in tiny model's (one token a byte) and, with ``--pretrained``,
SmolLM2-135M-Instruct's (a 49k-token byte-level BPE; fetched and converted once, see
``benchmarks/pretrained.py``).

    python benchmarks/detokenize.py [--pretrained] [--rounds 5] [--json detokenize.json]

Timings are wall clock in one thread; the load average is recorded: run it on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import format_table, load_average  # noqa: E402
from engine.loader import resolve_model_dir  # noqa: E402
from engine.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 4  # as engine/output.py primes a request's detokenizer


def docs_text(max_chars: int) -> str:
    """The README and docs, in a fixed order, cut to ``max_chars``."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n".join(p.read_text() for p in files)[:max_chars]


def stream_seconds(tokenizer: Tokenizer, ids: list[int], use_stream: bool) -> tuple[float, str]:
    """Seconds to stream ``ids`` after their first CONTEXT tokens, and the text handed out."""
    detok = IncrementalDetokenizer(tokenizer, context=ids[:CONTEXT], use_stream=use_stream)
    start = time.perf_counter()
    text = "".join(map(detok.push, ids[CONTEXT:])) + detok.flush()
    return time.perf_counter() - start, text


def measure(name: str, tokenizer: Tokenizer, text: str, rounds: int) -> dict:
    ids = tokenizer.encode(text)
    expected = tokenizer.decode(ids)[len(tokenizer.decode(ids[:CONTEXT])):]
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):  # alternated, so a slower stretch of the machine hits both
        for use_stream in (False, True):
            seconds, out = stream_seconds(tokenizer, ids, use_stream)
            if out != expected:
                raise SystemExit(f"{name}: the {'stream' if use_stream else 'window'} handed out other text")
            times[use_stream].append(seconds)
    per_token = {k: statistics.median(v) / (len(ids) - CONTEXT) * 1e6 for k, v in times.items()}
    return {"tokenizer": name, "vocab": tokenizer.vocab_size, "tokens": len(ids) - CONTEXT,
            "window_us_per_token": per_token[False], "stream_us_per_token": per_token[True],
            "speedup": per_token[False] / per_token[True]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrained", action="store_true", help="SmolLM2-135M-Instruct's tokenizer as well")
    parser.add_argument("--chars", type=int, default=200_000, help="characters of the docs streamed")
    parser.add_argument("--rounds", type=int, default=5, help="each figure is the median of the rounds")
    parser.add_argument("--json")
    args = parser.parse_args()
    tokenizers = [("tiny (byte-level)", Tokenizer.from_dir(resolve_model_dir("tiny")))]
    if args.pretrained:
        from benchmarks.pretrained import ensure_pretrained
        tokenizers.append(("smollm2 (BPE)", Tokenizer.from_dir(ensure_pretrained())))
    text = docs_text(args.chars)
    results = [measure(name, tok, text, args.rounds) for name, tok in tokenizers]
    print(format_table(["tokenizer", "vocab", "tokens", "window µs/token", "stream µs/token", "window / stream"],
                       [[r["tokenizer"], r["vocab"], r["tokens"], r["window_us_per_token"], r["stream_us_per_token"],
                         r["speedup"]] for r in results]))
    load = load_average()
    print(f"load average: {load}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "load_average": load}, indent=2))


if __name__ == "__main__":
    main()
