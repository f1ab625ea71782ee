"""What serving LoRA adapters costs a decode batch (``engine/lora.py``): the same batch of sequences decoded
with the base model only, all with one adapter, and each with one of K adapters (round robin), in the same
run, against the weight bytes each step must read (a decode step is bound by them: the base model's, plus
each adapter's in the batch once).

The adapters are random rank-R PEFT adapters of every projection (q, k, v, o, gate, up, down), written in
PEFT's format, so they load as a user's would. On a CPU each adapter's rows take their own matmuls; on a GPU
(``--device cuda``) every decode step replays a CUDA graph whose grouped LoRA kernels serve all adapters of
the batch at once (``engine/kernels/lora_matmul.py``).

    python benchmarks/lora_batch.py [--model tiny|DIR] [--batch 32] [--rank 16] [--adapters 8] [--json PATH]
                                    [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.loader import resolve_model_dir  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, cfg: ModelConfig, rank: int, seed: int, scale: float = 0.01) -> None:
    """A random PEFT LoRA adapter of every projection of every layer (A and B ``scale`` times N(0, 1))."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv), "v_proj": (cfg.hidden_size, kv),
              "o_proj": (q, cfg.hidden_size), "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size), "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if name in PROJECTIONS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = scale * torch.randn(rank, fan_in, generator=gen)
            tensors[f"{key}.lora_B.weight"] = scale * torch.randn(fan_out, rank, generator=gen)
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(PROJECTIONS)}))


def decode_run(engine: Engine, loras: list[str | None], prompt_len: int, new_tokens: int) -> tuple[float, int]:
    """(seconds of the decode steps, tokens they produced) of one batch: every prompt admitted first, then
    timed from the first step in which all of them decode."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, lora in enumerate(loras):
        prompt = [(7 * i + 13 * j) % 250 + 3 for j in range(prompt_len)]  # distinct: no prefix-cache hits
        engine.add_request(f"r{i}-{lora}", prompt, params, lora=lora)
    while engine.stats().num_waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return time.perf_counter() - start, tokens


def adapter_bytes(engine: Engine, name: str) -> int:
    """The bytes of one adapter's pairs as the layers hold them (packed: A stacked, B block-diagonal)."""
    return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
               for a, b in engine.loras[name].pairs.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8, help="K: the adapters of the mixed batch")
    p.add_argument("--repeats", type=int, default=3, help="runs of each batch; the fastest counts")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cfg = ModelConfig.from_dir(resolve_model_dir(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        modules = {f"lora{k}": str(Path(tmp) / f"lora{k}") for k in range(args.adapters)}
        for k, path in enumerate(modules.values()):
            write_adapter(Path(path), cfg, args.rank, seed=k)
        engine = Engine(EngineConfig(model=args.model, max_num_seqs=args.batch, lora_modules=modules,
                                     num_blocks=args.batch * -(-(args.prompt_len + args.new_tokens) // 16) + 16,
                                     device=args.device, dtype=args.dtype))
    base_bytes = sum(t.numel() * t.element_size() for name, t in engine.model.named_parameters()
                     if name != "model.embed_tokens.weight")  # a decode step reads every matrix but the table
    names = list(modules)
    one_adapter = adapter_bytes(engine, names[0])
    batches = {"base model only": [None] * args.batch, "one adapter": [names[0]] * args.batch,
               f"{args.adapters} adapters, round robin": [names[i % args.adapters] for i in range(args.batch)]}
    rows, results = [], {}
    base_s = None
    for label, loras in batches.items():
        seconds, tokens = min(decode_run(engine, loras, args.prompt_len, args.new_tokens) for _ in range(args.repeats))
        adapters_in_batch = len({lora for lora in loras if lora})
        bound = (base_bytes + adapters_in_batch * one_adapter) / base_bytes  # the weight bytes a step reads
        base_s = base_s or seconds
        results[label] = {"tok_s": tokens / seconds, "step_time_vs_base": seconds / base_s,
                          "weight_bytes_vs_base": bound}
        rows.append([label, tokens / seconds, seconds / base_s, bound])
    graphs = engine.runner.graphs
    print(f"device {engine.device}, decode steps replayed from CUDA graphs: "
          f"{sum(graphs.replays.values()) if graphs else 'none (eager)'}")
    print(f"model {args.model}: {base_bytes / 2**20:.0f} MiB of weights read per step; each rank-{args.rank} adapter "
          f"{one_adapter / 2**20:.1f} MiB; batch {args.batch}, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens; load {load_average()}")
    print(format_table(["batch", "decode tok/s", "step time / base", "weight bytes / base"], rows))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2))


if __name__ == "__main__":
    main()
