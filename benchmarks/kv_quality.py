"""What the KV-memory options (issue 16) cost in quality and save in memory, on a model that predicts
something (a random-weight model has no quality to lose): the trained model of ``benchmarks/train_tiny.py``
by default, or any checkpoint with a byte-level BPE tokenizer (``--model``; ``benchmarks/pretrained.py``
makes SmolLM2-135M-Instruct one), against the full-precision cache in the same run:

- (a) held-out bits per byte for each ``kv_cache_dtype`` (``FORMAT:N`` sets ``kv_residual_blocks`` N, the
  full blocks fp8/kivi2 keep in full precision behind the one being filled): documents teacher-forced through the engine's
  paged cache, every text token scored, bytes counted by the model's tokenizer. Two ways: one token a
  step, which reads the cache as generation does (the headline figure), and in chunks of ``--chunk``
  tokens, which reads it as a prompt does (blocks the chunk fills are read back quantized, its own
  tokens' included);
- (b) greedy agreement with the full-precision cache: N held-out prompts x M new tokens through the
  engine's own request path; identical tokens (position by position) and the first divergence;
- (c) a stream 10x longer than the attention window: full attention, window only (``kv_sinks=0``) and
  sinks + window (``kv_sinks=4``), bits per byte overall and past the trained context;
- (d) KV bytes per token for each dtype (the engine's own block accounting) and how many sequences of
  ``--seq-len`` tokens fit in ``--cache-bytes``, each with its windows (fp8, kivi2), and the bytes the
  weights take (an entry ``FORMAT/fp8`` runs with ``--quantization fp8``, ``FORMAT/awq``, ``FORMAT/gptq`` or
  ``FORMAT/compressed-tensors`` on a copy of the checkpoint with its projections written in 4 bits in that
  layout, or ``FORMAT/gptq:8`` (``compressed-tensors:8``) in 8 bits, round to nearest in groups of 128 or the
  widest dividing them; ``FORMAT/w8a8`` symmetric int8 a scale a row with int8 activations a token, as RedHat's
  w8a8 releases, and ``FORMAT/w8a16`` the same weights with activations in the model's dtype: (a) and (b) then
  show what those weights cost against the full-precision model).

Options the engine does not have yet (EngineConfig fields, or values it refuses) print "not available"
with the reason, so the script can be rerun as they land.

    python benchmarks/kv_quality.py [--model DIR] [--dtypes auto,int8,fp8,kivi2,kivi2:0] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from benchmarks.held_out import held_out_documents, token_bytes  # noqa: E402
from benchmarks.train_tiny import REPORT_FILE, bits_per_byte, default_out  # noqa: E402
from engine.config import INT_LAYOUTS, EngineConfig, IntQuant, ModelConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.int_weights import widest_group, write_int_checkpoint  # noqa: E402
from engine.kv_format import window_layer_bytes  # noqa: E402
from engine.loader import resolve_model_dir  # noqa: E402
from engine.runner import SeqChunk  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.w8a8 import INT8_ROW_FORMATS  # noqa: E402

FULL = "auto"  # the cache in the model's dtype: the reference every other option is compared with
MODEL_DTYPE = EngineConfig.dtype  # the engines here run in the default (float32) weights and cache
DTYPES = ["auto", "int8", "fp8", "kivi2"]
BLOCK_SIZE = 16


class Unavailable(Exception):
    """An engine option this build does not implement; the message says which and why."""


def make_engine(model: str, num_tokens: int, **options) -> Engine:
    """An engine with room for ``num_tokens`` and ``options`` (EngineConfig fields); Unavailable when
    EngineConfig lacks a field or refuses a value."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    missing = sorted(k for k in options if k not in fields)
    if missing:
        raise Unavailable(f"EngineConfig has no {', '.join(missing)}")
    try:
        return Engine(EngineConfig(model=model, block_size=BLOCK_SIZE, num_blocks=blocks_for(num_tokens) + 1,
                                   **options))
    except (ValueError, NotImplementedError, KeyError) as e:
        raise Unavailable(f"{type(e).__name__}: {e}") from e


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def room_for(docs: list[list[int]]) -> int:
    """Cache tokens ``batch_token_nll`` needs for ``docs`` at once (each in whole blocks)."""
    return BLOCK_SIZE * sum(blocks_for(len(d)) for d in docs)


def batch_token_nll(engine: Engine, docs: list[list[int]],
                    chunk: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per document: (NLL in nats of tokens[1:], the bytes of text each of them stands for: 0 for a
    special token, which is never scored). The documents are teacher-forced together, each step running
    the next ``chunk`` tokens of every one not yet done, through blocks the engine's block manager gives
    each its whole length (a window's blocks included: this pass drops none) and frees after. ``chunk`` 1 reads the cache as generation does: a token sees the K/V before it as the
    cache holds them (the block it fills still in its window); a longer chunk reads it as a prompt does:
    its blocks filled in the step are read back in the cache's format."""
    table = token_bytes(str(resolve_model_dir(engine.config.model)))
    request_ids = [f"kv-quality-{i}" for i in range(len(docs))]
    tables: list[list[int]] = []
    nll: list[list[torch.Tensor]] = [[] for _ in docs]
    try:
        for request_id, doc in zip(request_ids, docs, strict=True):
            tables.append(engine.block_manager.reserve(request_id, len(doc) - 1))
        for start in range(0, max(map(len, docs)) - 1, chunk):
            live = [i for i, doc in enumerate(docs) if len(doc) - 1 > start]
            # The engine's own pass (same model, cache, attention backend and window), every row's logits.
            chunks = [SeqChunk(docs[i][start:min(start + chunk, len(docs[i]) - 1)], start, tables[i], all_logits=True)
                      for i in live]
            rows = engine.runner.run(chunks).cpu().split([len(c.token_ids) for c in chunks])
            for i, logits in zip(live, rows, strict=True):
                targets = torch.tensor(docs[i][start + 1:start + 1 + len(logits)])
                nll[i].append(torch.nn.functional.cross_entropy(logits, targets, reduction="none"))
    finally:
        for request_id in request_ids:
            engine.block_manager.free(request_id)
    return [(torch.cat(n), table[torch.tensor(doc[1:])]) for n, doc in zip(nll, docs, strict=True)]


def token_nll(engine: Engine, tokens: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_token_nll`` of one document."""
    return batch_token_nll(engine, [tokens], chunk)[0]


def text_bits_per_byte(nll: torch.Tensor, nbytes: torch.Tensor) -> float:
    """Bits per byte of the text tokens among ``nll``'s (``nbytes`` > 0)."""
    return bits_per_byte(nll[nbytes > 0].sum().item(), int(nbytes.sum()))


def score_documents(engine: Engine, docs: list[list[int]], chunk: int) -> float:
    """Bits per byte of ``docs``, each teacher-forced from position 0 through the paged cache."""
    scored = batch_token_nll(engine, docs, chunk)
    return text_bits_per_byte(torch.cat([n for n, _ in scored]), torch.cat([b for _, b in scored]))


def greedy_tokens(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of every prompt (batched by the engine's scheduler), ``new_tokens`` each."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        out[str(i)] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Share of identical tokens position by position, identical sequences, and first divergences."""
    same = sum(a == b for r, o in zip(reference, other, strict=True) for a, b in zip(r, o, strict=True))
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
              for r, o in zip(reference, other, strict=True)]
    return {"token_agreement": same / sum(map(len, reference)),
            "identical_sequences": sum(f == len(r) for f, r in zip(firsts, reference, strict=True)),
            "mean_first_divergence": sum(firsts) / len(firsts), "min_first_divergence": min(firsts)}


def memory(block_nbytes: float, cache_bytes: int, seq_len: int, window_nbytes: int = 0) -> dict:
    """KV bytes per token and how many sequences of ``seq_len`` tokens (and ``window_nbytes`` of windows
    each) fit in ``cache_bytes``."""
    return {"kv_bytes_per_token": block_nbytes / BLOCK_SIZE,
            "sequences_fit": int(cache_bytes // (blocks_for(seq_len) * block_nbytes + window_nbytes))}


def engine_options(spec: str) -> dict:
    """EngineConfig fields of a ``--dtypes`` entry: ``FORMAT``, ``FORMAT:RESIDUAL_BLOCKS``, either followed
    by ``/QUANTIZATION`` for the weights (``auto/fp8``: the full cache, fp8 weights)."""
    spec, _, weights = spec.partition("/")
    fmt, _, residual = spec.partition(":")
    return ({} if fmt == FULL else {"kv_cache_dtype": fmt}) | (
        {"kv_residual_blocks": int(residual)} if residual else {}) | ({"quantization": weights} if weights else {})


@contextmanager
def weights_as(model: str, options: dict) -> Iterator[str]:
    """The checkpoint ``options`` load: ``model``, or for ``quantization`` LAYOUT or LAYOUT:BITS (awq, gptq,
    compressed-tensors; taken out of ``options``) a copy of it in a temporary directory with its projections
    written in that layout, in 4 bits or BITS."""
    layout, _, bits = str(options.get("quantization")).partition(":")
    if layout not in INT_LAYOUTS and layout not in INT8_ROW_FORMATS:  # w8a8, w8a16: int8 a scale a row
        yield model
        return
    del options["quantization"]
    source = Path(model)
    with tempfile.TemporaryDirectory(prefix="kv-quality-int-weights-") as tmp:
        for file in source.iterdir():  # the tokenizer, chat template and generation config
            if file.is_file() and file.name != "config.json" and not file.name.startswith("model.safetensors"):
                shutil.copy(file, tmp)
        config = json.loads((source / "config.json").read_text())
        tensors = {name: t for file in sorted(source.glob("*.safetensors")) for name, t in load_file(file).items()}
        quant = INT8_ROW_FORMATS.get(layout) or IntQuant(layout, widest_group(ModelConfig.from_dict(config)),
                                                  bits=int(bits or 4))
        write_int_checkpoint(Path(tmp), tensors, config, quant)
        yield tmp


def sequence_window_bytes(engine: Engine) -> int:
    """Bytes of one sequence's windows across all layers (0 unless fp8/kivi2)."""
    c, cfg = engine.config, engine.model_config
    return cfg.num_layers * window_layer_bytes(c.kv_cache_dtype, c.block_size, cfg.num_kv_heads, cfg.head_dim,
                                               engine.kv_cache.dtype.itemsize, c.residual_blocks)


def formula_memory(model: str, dtype: str, cache_bytes: int, seq_len: int) -> dict:
    """(d) from ``ModelConfig.kv_bytes_per_token`` (no scales or other overhead) where the dtype has
    a known element size; the figure to compare the engine's accounting with."""
    try:
        fmt = engine_options(dtype).get("kv_cache_dtype", MODEL_DTYPE)
        per_token = ModelConfig.from_dir(model).kv_bytes_per_token(fmt)
    except ValueError:
        return {}
    return {"formula_" + k: v for k, v in memory(per_token * BLOCK_SIZE, cache_bytes, seq_len).items()}


def evaluate_dtype(args: argparse.Namespace, dtype: str, docs: list[list[int]], prompts: list[list[int]],
                   reference: list[list[int]] | None) -> tuple[dict, list[list[int]]]:
    """((a), (b), (d) figures, greedy tokens) with the cache in ``dtype``."""
    start = time.perf_counter()
    room = max(room_for(docs), len(prompts) * BLOCK_SIZE * blocks_for(args.prompt_len + args.new_tokens))
    options = engine_options(dtype)
    with weights_as(args.model, options) as model:  # scoring reads the model directory's tokenizer
        engine = make_engine(model, room, **options)
        row = {"available": True, "residual_blocks": engine.config.residual_blocks,
               "bits_per_byte": score_documents(engine, docs, 1),
               "bits_per_byte_prefill": score_documents(engine, docs, args.chunk),
               "weight_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
               **memory(engine.kv_cache.block_nbytes, args.cache_bytes, args.seq_len, sequence_window_bytes(engine))}
    tokens = greedy_tokens(engine, prompts, args.new_tokens)  # after scoring: it allocates blocks itself
    row |= agreement(reference or tokens, tokens)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row, tokens


def run_dtypes(args: argparse.Namespace, docs: list[list[int]], prompts: list[list[int]]) -> dict:
    """(a), (b) and (d) for each requested dtype; "not available: why" for the ones the engine lacks
    or cannot run (the full-precision reference must run)."""
    results, reference = {}, None
    for dtype in args.dtypes:
        try:
            row, tokens = evaluate_dtype(args, dtype, docs, prompts, reference)
        except (Unavailable, NotImplementedError, RuntimeError) as e:
            if dtype == FULL:
                raise
            row = {"available": False, "note": str(e).splitlines()[0]}
        else:
            reference = reference or tokens
        results[dtype] = row | formula_memory(args.model, dtype, args.cache_bytes, args.seq_len)
    return results


def run_stream(args: argparse.Namespace, stream: list[int], trained_ctx: int) -> dict:
    """(c): bits per byte of one long document under full attention, window only, sinks + window."""
    variants = {"full": {}, "window": {"kv_window": args.window, "kv_sinks": 0},
                "sinks+window": {"kv_window": args.window, "kv_sinks": args.sinks}}
    results = {}
    for name, options in variants.items():
        try:
            engine = make_engine(args.model, len(stream), **options)
            if len(stream) > engine.max_model_len:
                raise Unavailable(f"{len(stream)} tokens exceed max_model_len {engine.max_model_len}")
        except Unavailable as e:
            results[name] = {"available": False, "note": str(e)}
            continue
        nll, nbytes = token_nll(engine, stream, min(args.chunk, args.window))
        results[name] = {"available": True, "bits_per_byte": text_bits_per_byte(nll, nbytes),
                         "bits_per_byte_past_trained_ctx": text_bits_per_byte(nll[trained_ctx:],
                                                                              nbytes[trained_ctx:])}
    full = results["full"]
    for name in ("window", "sinks+window"):  # the same figures as full attention: nothing was dropped
        if results[name].get("available") and full.get("available") and \
                results[name]["bits_per_byte"] == full["bits_per_byte"]:
            results[name]["note"] = "identical to full attention: the window is not applied on this path"
    return results


def select_inputs(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(documents for (a), prompts for (b), the long stream for (c)) from the held-out files."""
    held = held_out_documents(resolve_model_dir(args.model))
    docs, total = [], 0
    for d in held:
        if total >= args.eval_tokens:
            break
        docs.append(d[:args.doc_tokens])
        total += len(docs[-1])
    long_docs = [d for d in held if len(d) > args.prompt_len] or held
    prompts = [long_docs[i % len(long_docs)][(i // len(long_docs)) * args.prompt_len:][:args.prompt_len]
               for i in range(args.prompts)]
    stream_len = args.stream_windows * args.window + 1
    stream = max(held, key=len)[:stream_len]
    return docs, prompts, stream


def print_report(report: dict) -> None:
    """Each option with its ratio to the full-precision cache (``auto``; full attention for (c))."""
    rows, notes, full = [], [], report["dtypes"][FULL]
    for dtype, r in report["dtypes"].items():
        formula = [f"{r['formula_kv_bytes_per_token']:.0f}", str(r["formula_sequences_fit"])] \
            if "formula_kv_bytes_per_token" in r else ["n/a", "n/a"]
        if not r["available"]:
            rows.append([dtype, "not available", "", "", "", "", "", "", *formula, ""])
            notes.append(f"{dtype}: not available: {r['note']}")
            continue
        label = f"{dtype} (residual {r['residual_blocks']})" if r["residual_blocks"] else dtype
        rows.append([label, *(f"{r[k]:.4f} ({r[k] / full[k] - 1:+.3%})" for k in ("bits_per_byte",
                                                                                  "bits_per_byte_prefill")),
                     f"{r['token_agreement']:.3f}", f"{r['identical_sequences']}/{report['prompts']}",
                     f"{r['mean_first_divergence']:.1f}",
                     f"{r['kv_bytes_per_token']:.0f} ({r['kv_bytes_per_token'] / full['kv_bytes_per_token']:.3f}x)",
                     str(r["sequences_fit"]), *formula,
                     f"{r['weight_bytes'] / 1e6:.1f} ({r['weight_bytes'] / full['weight_bytes']:.3f}x)"])
    fit = f"seqs of {report['seq_len']} in {report['cache_bytes'] >> 20} MiB"
    print(format_table(["kv_cache_dtype", "bits/byte (vs auto)", f"chunks of {report['chunk']} (vs auto)",
                        "greedy agree", "identical", "1st diverge",
                        "KV B/token (vs auto)", fit, "formula B/token", "formula " + fit, "weights MB (vs auto)"],
                       rows))
    print("\n".join(notes) + "\n")
    if not report["stream"]:
        return
    ref = report["stream"]["full"].get("bits_per_byte")
    rows = [[name, f"{r['bits_per_byte']:.4f}" + (f" ({r['bits_per_byte'] / ref - 1:+.3%})" if ref else ""),
             f"{r['bits_per_byte_past_trained_ctx']:.4f}", r.get("note", "")]
            if r["available"] else [name, "not available", "", r["note"]] for name, r in report["stream"].items()]
    print(format_table(["attention", "bits/byte (vs full)", f"past pos {report['trained_context']}", "note"],
                       rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(default_out()), help="checkpoint (default: train_tiny.py's)")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="kv_cache_dtype values, each optionally FORMAT:RESIDUAL_BLOCKS, and /fp8 for fp8 weights "
                        "(--quantization fp8) or /awq, /gptq, /compressed-tensors for 4-bit ones (/gptq:8, "
                        "/compressed-tensors:8: 8-bit ones; /w8a8, /w8a16: int8 a scale a row, with and without "
                        "int8 activations); 'auto' = full precision")
    p.add_argument("--skip-stream", action="store_true", help="leave (c) out")
    p.add_argument("--chunk", type=int, default=256, help="(a) prefill-style and (c): tokens per forward")
    p.add_argument("--eval-tokens", type=int, default=16384, help="(a): held-out tokens scored")
    p.add_argument("--doc-tokens", type=int, default=1024, help="(a): leading tokens of each document")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--stream-windows", type=int, default=10, help="(c): stream length in windows")
    p.add_argument("--seq-len", type=int, default=2048, help="(d): sequence length for the fit count")
    p.add_argument("--cache-bytes", type=int, default=256 << 20, help="(d): KV cache size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if FULL not in args.dtypes:
        args.dtypes.insert(0, FULL)
    torch.set_num_threads(args.threads)
    trained = Path(args.model) / REPORT_FILE
    trained_ctx = json.loads(trained.read_text())["eval_context"] if trained.exists() else 1024
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"{args.model}: no checkpoint; run python benchmarks/train_tiny.py first")
    load_before = load_average()
    docs, prompts, stream = select_inputs(args)
    report = {"model": args.model, "chunk": args.chunk, "documents": len(docs),
              "scored_tokens": sum(len(d) - 1 for d in docs), "prompts": len(prompts),
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "seq_len": args.seq_len,
              "cache_bytes": args.cache_bytes, "trained_context": trained_ctx,
              "window": args.window, "sinks": args.sinks, "stream_tokens": len(stream),
              "dtypes": run_dtypes(args, docs, prompts),
              "stream": {} if args.skip_stream else run_stream(args, stream, trained_ctx),
              "load_average_before": load_before, "load_average_after": load_average(),
              "torch": torch.__version__, "threads": args.threads}
    print(f"model {args.model}; (a) {report['documents']} held-out documents, {report['scored_tokens']} "
          f"tokens teacher-forced one a step and in chunks of {args.chunk}; (b) {len(prompts)} prompts x {args.new_tokens} "
          f"greedy tokens; " + ("" if args.skip_stream else f"(c) a {len(stream)}-token document, window "
                                f"{args.window}, {args.sinks} sinks; ") +
          f"load average {load_before} -> {report['load_average_after']}\n")
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
