"""Embeddings: the engine against sentence-transformers' way with transformers, on the same checkpoint, one run.

A random-weight checkpoint of Qwen3-Embedding-0.6B's shape (hidden 1024, 16 heads / 8 KV heads of 128, MLP
3072, its 151,669-token vocabulary), cut to ``--layers`` layers, saved as that model ships (the ``Qwen3Model``
alone), in float32. Two workloads of ``--inputs`` inputs each:

- ``documents``: distinct texts of 64 to 448 tokens (uniform, seeded);
- ``queries``: Qwen3-Embedding's retrieval queries, one ``--instruction-tokens`` instruction shared by all
  ("Instruct: ...\\nQuery: "), then 8 to 40 tokens of query each.

The peer is what ``SentenceTransformer.encode`` runs: inputs sorted by length, batches of ``--batch``, left
padding (Qwen3-Embedding's tokenizer pads left), one ``Qwen3Model`` forward per batch under
``torch.inference_mode``, the last position's hidden state, L2-normalized. Tidepool is one engine in this
process (``Engine.add_embedding_request`` for every input at once, stepped to the end): chunked prefill packs
the inputs without padding, and the prefix cache computes the queries' shared instruction once.

Reported per workload and side: inputs/s and tokens/s (best of ``--repeats``, after a warm-up; each run's inputs
begin with a token of their own, so each run computes the instruction once), the prompt tokens the engine
computed (the rest found cached: a prompt whose next block another computes in the same step waits a step for
it, ``engine/scheduler.py``), the speedup, and the largest
difference between the two sides' vectors (and the lowest cosine). Torch gets ``--threads`` threads.

    python benchmarks/embeddings.py [--layers 4] [--inputs 64] [--threads 2] [--json embeddings.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402

SHAPES: dict[str, dict] = {
    "qwen3-embedding-0.6b": dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
    "tiny-test": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=1024),
}


def workloads(inputs: int, instruction_tokens: int, vocab: int, seed: int) -> dict[str, list[list[int]]]:
    """The two workloads' token ids (documents; queries behind one shared instruction)."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731 - local shorthand
    instruction = tokens(instruction_tokens)
    return {"documents": [tokens(rng.randint(64, 448)) for _ in range(inputs)],
            "queries": [instruction + tokens(rng.randint(8, 40)) for _ in range(inputs)]}


def sentence_transformers_way(model: transformers.Qwen3Model, prompts: list[list[int]], batch: int
                              ) -> list[torch.Tensor]:
    """``SentenceTransformer.encode``'s loop: longest first, left-padded batches, last position, normalized;
    the vectors in the inputs' order."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    vectors: list[torch.Tensor | None] = [None] * len(prompts)
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            rows = order[start:start + batch]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in rows])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
            for i, vector in zip(rows, F.normalize(hidden.float(), dim=-1), strict=True):
                vectors[i] = vector
    return vectors


def engine_way(engine: Engine, prompts: list[list[int]], computed: list[int]) -> list[torch.Tensor]:
    """Every input at once through the engine; the vectors in order. Appends to ``computed`` the prompt
    tokens the engine computed (the rest it found in its prefix cache)."""
    before = engine.prompt_tokens_computed
    for i, prompt in enumerate(prompts):
        engine.add_embedding_request(f"e{i}", prompt)
    vectors: dict[str, list[float]] = {}
    while engine.has_unfinished():
        vectors |= {out.request_id: out.embedding for out in engine.step()}
    computed.append(engine.prompt_tokens_computed - before)
    return [torch.tensor(vectors[f"e{i}"]) for i in range(len(prompts))]


def best_of(run: Callable[[list[list[int]]], list[torch.Tensor]], prompts: list[list[int]], repeats: int
            ) -> tuple[float, list[torch.Tensor]]:
    """Fastest wall seconds of ``repeats`` runs after a warm-up, and the vectors of the last. Each run's inputs
    start with a token of their own (``3 + run``), so nothing an engine cached in one run is found by the next."""
    best, vectors = float("inf"), []
    for k in range(repeats + 1):
        start = time.perf_counter()
        vectors = run([[3 + k, *p[1:]] for p in prompts])
        if k:
            best = min(best, time.perf_counter() - start)
    return best, vectors


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-embedding-0.6b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--instruction-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="the peer's batch (SentenceTransformer.encode's default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the engine's step budget")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = transformers.Qwen3Config(num_hidden_layers=args.layers, **SHAPES[args.shape])
    peer = transformers.Qwen3Model(config).eval()
    result: dict = {"shape": args.shape, "layers": args.layers, "inputs": args.inputs, "batch": args.batch,
                    "threads": args.threads, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        peer.save_pretrained(tmp)
        tokens = sum(len(p) for p in workloads(args.inputs, args.instruction_tokens, config.vocab_size,
                                                args.seed)["documents"])
        engine = Engine(EngineConfig(model=tmp, max_num_batched_tokens=args.max_num_batched_tokens,
                                     max_num_seqs=args.inputs,
                                     kv_cache_bytes=max(256 << 20, 2 * tokens * engine_kv_bytes(config))))
        for name, prompts in workloads(args.inputs, args.instruction_tokens, config.vocab_size, args.seed).items():
            peer_s, peer_vectors = best_of(lambda runs: sentence_transformers_way(peer, runs, args.batch), prompts,
                                           args.repeats)
            computed: list[int] = []
            ours_s, our_vectors = best_of(partial(engine_way, engine, computed=computed), prompts, args.repeats)
            ours, theirs = torch.stack(our_vectors), torch.stack(peer_vectors)
            n_tokens = sum(len(p) for p in prompts)
            row = {"tokens": n_tokens,
                   "tidepool": {"seconds": ours_s, "inputs_per_s": len(prompts) / ours_s,
                                "tokens_per_s": n_tokens / ours_s, "tokens_computed": computed[-1]},
                   "sentence_transformers_way": {"seconds": peer_s, "inputs_per_s": len(prompts) / peer_s,
                                                 "tokens_per_s": n_tokens / peer_s},
                   "speedup": peer_s / ours_s,
                   "max_abs_diff": float((ours - theirs).abs().max()),
                   "min_cosine": float((ours * theirs).sum(-1).min())}
            result["workloads"][name] = row
            print(f"{name:9s} {n_tokens:6d} tokens ({computed[-1]} computed)  tidepool "
                  f"{row['tidepool']['inputs_per_s']:7.1f} inputs/s "
                  f"{row['tidepool']['tokens_per_s']:8.0f} tok/s   sentence-transformers' way "
                  f"{row['sentence_transformers_way']['inputs_per_s']:7.1f} inputs/s "
                  f"{row['sentence_transformers_way']['tokens_per_s']:8.0f} tok/s   x{row['speedup']:.2f}   "
                  f"max |diff| {row['max_abs_diff']:.1e}  min cos {row['min_cosine']:.6f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def engine_kv_bytes(config: transformers.Qwen3Config) -> int:
    """KV bytes a token of ``config`` takes in a float32 cache."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4


if __name__ == "__main__":
    main()
