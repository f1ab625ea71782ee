"""A mixture of experts' layer on one GPU: the fused Triton kernels against the torch loop over experts and
against the device's own limits, in the same run.

Random bf16 expert weights of two shapes, Qwen3-30B-A3B's (hidden 2048, 128 experts of 768, 8 per token)
and Mixtral-8x7B's (hidden 4096, 8 experts of 14336, 2 per token), and random router logits. For each
token count (a decode batch up to a prefill chunk):

- the fused kernels (``engine/kernels/moe_experts.py``: two launches) and the torch path
  (``engine.moe.routed_experts``: two matmuls per expert with tokens, the counts read back to the host),
  each the best of 5 timed with CUDA events, and their ratio;
- the memory roofline: a layer reads at least the weights of every expert some token chose, so it takes at
  least those bytes over the HBM copy bandwidth measured in the same run; the fraction reached is that
  bound over the fused time (what matters at decode batch sizes);
- the compute rate: 2 x 3 x hidden x intermediate FLOPs per (token, expert) pair over the fused time, as a
  fraction of a large bf16 matmul's rate measured in the same run (what matters for prefill chunks);
- the fused layer replayed from a CUDA graph (the shapes depend on the token count alone, and nothing
  reads back to the host, which is what lets the engine capture MoE decode steps), and its time;
- the largest difference between the two paths' outputs, relative to the largest output.

``--weights fp8`` holds the experts as e4m3 codes with a scale a row (what ``--quantization fp8`` loads),
``--weights int4`` as 4-bit codes with a scale and zero per group of 128 columns (what an AWQ, GPTQ or
compressed-tensors checkpoint loads into), ``--weights int8`` as 8-bit ones (GPTQ's and compressed-tensors'
W8A16), ``--weights w8a8`` as int8 values with a scale a row times int8 rows of their input (a w8a8
checkpoint's, or ``--quantization w8a8_int8``'s; the compute rate then still against bf16's): both paths then
read those, and the roofline counts their bytes.

Writes one JSON object (``--json``). ``--device cpu --shapes tiny-test`` runs the same code on a tiny float32
shape on CPU, under ``TRITON_INTERPRET=1`` (a smoke test). Imports only torch, triton and the engine.

    python benchmarks/moe_gpu.py [--shapes qwen3-30b-a3b,mixtral-8x7b] [--tokens 1,16,64,256,2048]
        [--weights dtype|fp8|int4|int8|w8a8] [--json moe_gpu.json] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_gpu import best_seconds, copy_bandwidth, matmul_rate, run_device, write_result  # noqa: E402
from engine.int_weights import pack_codes, quantize_groups  # noqa: E402
from engine.kernels import fused_moe  # noqa: E402
from engine.kernels.common import ExpertQuant  # noqa: E402
from engine.moe import route, routed_experts  # noqa: E402
from engine.w8a8 import quantize_int8_rows  # noqa: E402
from engine.weight_quant import quantize_rows  # noqa: E402

# hidden, experts, expert intermediate size, experts per token, top-k scores renormalized
SHAPES: dict[str, tuple[int, int, int, int, bool]] = {
    "qwen3-30b-a3b": (2048, 128, 768, 8, True),
    "mixtral-8x7b": (4096, 8, 14336, 2, True),
    "tiny-test": (64, 8, 32, 2, True),
}


def graph_seconds(fn, device: torch.device) -> float | None:
    """Best time of ``fn`` replayed from a CUDA graph captured around it (None off CUDA)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture: compiles the kernels
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return best_seconds(graph.replay, device)


def held_experts(gate_up: torch.Tensor, down: torch.Tensor, weights: str
                 ) -> tuple[torch.Tensor, torch.Tensor, ExpertQuant | None]:
    """The experts as the engine holds them for ``weights``: as they are ("dtype"), e4m3 codes with a scale a
    row ("fp8"), integer codes with a scale and zero per group of 128 columns ("int4": two a byte; "int8";
    narrower groups where 128 does not split a row), or int8 values with a scale a row run W8A8 ("w8a8")."""
    if weights == "dtype":
        return gate_up, down, None
    experts = gate_up.shape[0]
    if weights == "w8a8":
        (gate_up, gate_up_scales), (down, down_scales) = (
            [p.view(experts, w.shape[1], -1) for p in quantize_int8_rows(w.reshape(-1, w.shape[2]))]
            for w in (gate_up, down))
        return gate_up, down, ExpertQuant(gate_up_scales, down_scales, gate_up.shape[2], down.shape[2],
                                          int8_activations=True)
    group = next(g for g in (128, 64, 32, 16) if gate_up.shape[2] % g == 0 and down.shape[2] % g == 0)
    bits = 8 if weights == "fp8" else int(weights.removeprefix("int"))
    held = []
    for w in (gate_up, down):
        rows = w.reshape(-1, w.shape[2])
        parts = quantize_rows(rows) if weights == "fp8" else quantize_groups(rows, group, bits)
        if weights != "fp8":
            parts = (pack_codes(parts[0], bits), *parts[1:])
        held.append([p.reshape(experts, w.shape[1], -1) for p in parts])
    (gate_up, gate_up_scales, *gate_up_zeros), (down, down_scales, *down_zeros) = held
    k_blocks = (gate_up.shape[2], down.shape[2]) if weights == "fp8" else (group, group)
    return gate_up, down, ExpertQuant(gate_up_scales, down_scales, *k_blocks, *gate_up_zeros, *down_zeros,
                                      bits=bits)


def run_shape(shape: str, tokens: list[int], device: torch.device, dtype: torch.dtype, bandwidth: float,
              flops: float, weights: str = "dtype") -> dict:
    hidden, experts, inter, top_k, renormalize = SHAPES[shape]
    gen = torch.Generator(device).manual_seed(0)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=gen) / inter**0.5
    gate_up, down, quant = held_experts(gate_up, down, weights)
    held = [gate_up, down] + ([] if quant is None else [t for t in quant if isinstance(t, torch.Tensor)])
    expert_bytes = sum(t.numel() * t.element_size() for t in held) // experts  # what a chosen expert reads
    rows = {}
    for t in tokens:
        x = torch.randn(t, hidden, device=device, dtype=dtype, generator=gen)
        scores, ids = route(torch.randn(t, experts, device=device, generator=gen), top_k, renormalize)
        fused_call = partial(fused_moe, x, scores, ids, gate_up, down, quant)
        loop_call = partial(routed_experts, x, scores, ids, gate_up, down, quant)
        fused_s, loop_s = best_seconds(fused_call, device), best_seconds(loop_call, device)
        fused, loop = fused_call().float(), loop_call().float()
        touched = int(torch.unique(ids).numel())
        roofline_s = touched * expert_bytes / bandwidth
        pair_flops = 2 * 3 * hidden * inter * t * top_k
        replay_s = graph_seconds(fused_call, device)
        rows[str(t)] = {
            "fused_ms": fused_s * 1e3, "torch_loop_ms": loop_s * 1e3, "speedup_vs_torch_loop": loop_s / fused_s,
            "experts_touched": touched, "roofline_ms": roofline_s * 1e3, "roofline_fraction": roofline_s / fused_s,
            "tflops": pair_flops / fused_s / 1e12, "mfu": pair_flops / fused_s / flops,
            "graph_replay_ms": None if replay_s is None else replay_s * 1e3,
            "max_rel_diff": float((fused - loop).abs().max() / loop.abs().max()),
        }
        print(shape, t, {k: round(v, 4) if isinstance(v, float) else v for k, v in rows[str(t)].items()},
              flush=True)
    return {"hidden": hidden, "experts": experts, "intermediate": inter, "top_k": top_k,
            "weight_bytes": experts * expert_bytes, "tokens": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--tokens", default="1,16,64,256,2048")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--weights", default="dtype", choices=("dtype", "fp8", "int4", "int8", "w8a8"),
                        help="the experts in --dtype, fp8 codes (W8A16) or 4- or 8-bit integer codes (W4A16, W8A16)")
    parser.add_argument("--json", default="moe_gpu.json")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    device, dtype, name = run_device(args.device, args.dtype)
    bandwidth, flops = copy_bandwidth(device), matmul_rate(device, dtype)
    result = {"device": name, "dtype": str(dtype).removeprefix("torch."), "weights": args.weights,
              "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops, "shapes": {}}
    for shape in args.shapes.split(","):
        result["shapes"][shape] = run_shape(shape, [int(t) for t in args.tokens.split(",")], device, dtype,
                                            bandwidth, flops, args.weights)
    return write_result(result, start, Path(args.json))


if __name__ == "__main__":
    main()
