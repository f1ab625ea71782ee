"""W8A8 on the CPU: int8 matmuls against the 16-bit and W8A16 paths, measured in one run.

(a) The projections of one layer of ``--shape`` (TinyLlama-1.1B's: q/k/v ``[2560, 2048]``, o ``[2048, 2048]``,
gate/up ``[11264, 2048]``, down ``[2048, 5632]``) at 1, 16 and 256 rows, each the best of ``--repeats``:
``F.linear`` in float32 and in bfloat16, the W8A16 CPU path (int8 codes dequantized into float32 every call,
then ``F.linear``: how an int8 checkpoint ran before), W8A8 (``engine/w8a8.py``: the rows quantized a token,
``torch._int_mm``, the sums scaled back) and its int8 GEMM alone, so the quantization's share shows.

(b) The engine on a random-weight checkpoint of that shape cut to ``--layers`` layers (and its vocabulary),
written three ways: 16-bit (run in float32 and in bfloat16), int8 weights with a scale a row and no activation
scheme (W8A16, float32), and the same weights with RedHat's int8 activations a token (W8A8; in float32 and in
bfloat16, the ``--dtype`` of what is not a projection: embeddings, attention, norms, the lm_head); and the
16-bit one loaded with ``--quantization w8a8_int8`` (rounded to int8 as it loads; bfloat16). For each: prefill
tokens/s of ``--prefill`` prompts of ``--prompt-len`` tokens, and the median decode step at batch 1 and 16
(prompts of 64 tokens, ``--new-tokens`` new, greedy), each the best of ``--repeats`` runs. Torch gets
``--threads`` threads.

    python benchmarks/w8a8.py [--shape tinyllama-1.1b] [--layers 4] [--threads 2] [--json w8a8.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_gpu import SHAPES, best_seconds, make_prompts, run_engine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.int_weights import dequantize, quantize_groups, write_int_checkpoint  # noqa: E402
from engine.w8a8 import W8A8_RELEASES, W8A16_ROWS, int8_matmul, quantize_int8_rows, w8a8_linear  # noqa: E402


def layer_projections(shape: dict) -> list[tuple[int, int]]:
    """(out, in) of a layer's q/k/v, o, gate/up and down, as the engine packs them."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return [(h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter)]


def matmul_row(shape: dict, rows: int, repeats: int) -> dict:
    """Seconds for one layer's four projections at ``rows`` rows, per path."""
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(rows)
    paths: dict[str, list] = {name: [] for name in ("float32", "bfloat16", "w8a16", "w8a8", "int8_gemm")}
    for out, inp in layer_projections(shape):
        weight = torch.randn(out, inp, generator=gen) / inp**0.5
        x = torch.randn(rows, inp, generator=gen)
        codes, scales, zeros = quantize_groups(weight, 0, 8, symmetric=True)
        values, x_codes = (codes.to(torch.int16) - 128).to(torch.int8), quantize_int8_rows(x)[0]
        xb, wb = x.bfloat16(), weight.bfloat16()
        paths["float32"].append(lambda x=x, w=weight: F.linear(x, w))
        paths["bfloat16"].append(lambda x=xb, w=wb: F.linear(x, w))
        paths["w8a16"].append(lambda x=x, c=codes, s=scales, z=zeros: F.linear(x, dequantize(c, s, z, 8, x.dtype)))
        paths["w8a8"].append(lambda x=x, v=values, s=scales: w8a8_linear(x, v, s, None))
        paths["int8_gemm"].append(lambda c=x_codes, v=values: int8_matmul(c, v))
    return {name: best_seconds(lambda fns=fns: [fn() for fn in fns], cpu, repeats) for name, fns in paths.items()}


def write_checkpoints(root: Path, shape: dict, layers: int) -> dict[str, Path]:
    """The 16-bit checkpoint and its W8A16 and W8A8 copies under ``root``."""
    config = transformers.LlamaConfig(**{**shape, "num_hidden_layers": layers}, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.config.architectures = [type(model).__name__]
    model.generation_config.eos_token_id = None
    dirs = {name: root / name for name in ("16-bit", "w8a16", "w8a8")}
    model.save_pretrained(dirs["16-bit"])
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    for name, quant in (("w8a16", W8A16_ROWS), ("w8a8", W8A8_RELEASES)):
        dirs[name].mkdir()
        write_int_checkpoint(dirs[name], tensors, model.config.to_dict(), quant)
    return dirs


def engine_row(path: Path, dtype: str, quantization: str | None, args: argparse.Namespace) -> dict:
    """Prefill tokens/s and the median decode step at batch 1 and 16 of the engine on ``path``, each the best of
    ``--repeats`` runs (the median of a run's decode steps)."""
    engine = Engine(EngineConfig(model=str(path), dtype=dtype, quantization=quantization, max_num_seqs=16,
                                 enable_prefix_caching=False,
                                 max_num_batched_tokens=args.prefill * args.prompt_len, num_blocks=512))
    vocab = engine.model_config.vocab_size
    run_engine(engine, make_prompts(2, 16, vocab, seed=0), 2)  # warm-up
    prompts = make_prompts(args.prefill, args.prompt_len, vocab, seed=1)
    prefill_s = min(sum(seconds for seconds, chunks, _, _ in run_engine(engine, prompts, 1)["steps"] if chunks)
                    for _ in range(args.repeats))
    row = {"prefill_tokens_per_s": args.prefill * args.prompt_len / prefill_s}
    for batch in (1, 16):
        prompts = make_prompts(batch, 64, vocab, seed=batch)
        row[f"decode_step_ms_batch_{batch}"] = 1e3 * min(
            statistics.median(seconds for seconds, chunks, _, _ in run_engine(engine, prompts, args.new_tokens)["steps"]
                              if not chunks) for _ in range(args.repeats))
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tinyllama-1.1b", choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=4, help="prompts prefilled together")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="best of N: each matmul and each engine figure")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    shape = SHAPES[args.shape]
    result: dict = {"shape": args.shape, "threads": args.threads, "layers": args.layers, "matmul_s": {},
                    "engine": {}}
    print(f"(a) one {args.shape} layer's projections, ms (best of {args.repeats}, {args.threads} threads)")
    print(f"{'rows':>5} {'float32':>9} {'bfloat16':>9} {'w8a16':>9} {'w8a8':>9} {'int8 gemm':>10} "
          f"{'w8a8 vs fp32':>13} {'vs bf16':>8} {'vs w8a16':>9}")
    for rows in (1, 16, 256):
        t = result["matmul_s"][str(rows)] = matmul_row(shape, rows, args.repeats)
        print(f"{rows:>5} " + " ".join(f"{1e3 * t[k]:>9.2f}" for k in ("float32", "bfloat16", "w8a16", "w8a8"))
              + f" {1e3 * t['int8_gemm']:>10.2f} {t['float32'] / t['w8a8']:>12.2f}x "
                f"{t['bfloat16'] / t['w8a8']:>7.2f}x {t['w8a16'] / t['w8a8']:>8.2f}x", flush=True)
    print(f"(b) the engine, {args.layers} layers: prefill {args.prefill} x {args.prompt_len} tokens, "
          f"decode steps of {args.new_tokens} new tokens")
    print(f"{'weights':<18} {'prefill tok/s':>14} {'decode ms b=1':>14} {'decode ms b=16':>15}")
    with tempfile.TemporaryDirectory(prefix="w8a8-bench-") as tmp:
        dirs = write_checkpoints(Path(tmp), shape, args.layers)
        runs = (("16-bit, float32", dirs["16-bit"], "float32", None),
                ("16-bit, bfloat16", dirs["16-bit"], "bfloat16", None),
                ("w8a16, float32", dirs["w8a16"], "float32", None), ("w8a8, float32", dirs["w8a8"], "float32", None),
                ("w8a8, bfloat16", dirs["w8a8"], "bfloat16", None),
                ("16-bit, w8a8_int8", dirs["16-bit"], "bfloat16", "w8a8_int8"))
        for name, path, dtype, quantization in runs:
            row = result["engine"][name] = engine_row(path, dtype, quantization, args)
            print(f"{name:<18} {row['prefill_tokens_per_s']:>14.0f} {row['decode_step_ms_batch_1']:>14.1f} "
                  f"{row['decode_step_ms_batch_16']:>15.1f}", flush=True)
    result["seconds"] = time.perf_counter() - start
    print(f"done in {result['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
