"""Compile every Triton kernel launch the GPU engine makes, for real GPU targets, on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute, but not whether they compile
for a GPU: it accepts what the compiler refuses (a type a target lacks, such as fp8 e4m3 before sm_89)
and has no shared memory to outgrow. Triton compiles to a cubin without a device (its own ptxas), so
this records the launches one decoder layer's step makes on the Triton backend, with the model shapes
users serve, every cache format and both decode paths (one split, split-K), then compiles each distinct
one as the JIT would on the target (the same argument specialization, options and constexprs) and
reports its shared memory (against what the target gives one block), and its registers a thread and
the bytes it spills to local memory (``cuobjdump``, shipped with Triton, on the cubin).

Run it in a process that imported triton without ``TRITON_INTERPRET`` (``@triton.jit`` must build
compilable kernels): ``python tests/kernel_compile.py --arch 90``; prints one JSON object a line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[1] / "proto")]

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from engine import kernels  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.kernels import common  # noqa: E402
from engine.kernels.paged_decode import paged_decode_attention  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.moe import route  # noqa: E402
from engine.triton_attention import paged_attention, paged_metadata, quantized_layer  # noqa: E402

# sharedMemPerBlockOptin (bytes) of each compute capability: what Triton's loader compares a kernel with.
MAX_SHARED = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}
# (query heads, kv heads, head_dim) of checkpoints users point --model at: head dims 64 and 128, GQA groups of 8
# and 7 (not a power of two: padded query rows), and Gemma's 256-wide heads (on the smaller tiles they default
# to; with Gemma 2's soft-capped scores too). Llama-3-8B, Mistral and Qwen3 compile like qwen2.5-7b.
SHAPES = {"tinyllama-1.1b": (32, 4, 64), "qwen2.5-7b": (28, 4, 128), "gemma-3-1b": (4, 1, 256)}
FORMATS = ("auto", "int8", "fp8", "kivi2")
FP8_SHAPE = "qwen2.5-7b"  # the fp8 and integer weight kernels depend on no head shape: compiled for one
BLOCK_SIZE = 16


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[tuple[JITFunction, tuple, dict]]]:
    """Every ``kernel[grid](...)`` inside the block is recorded instead of run."""
    launches: list[tuple[JITFunction, tuple, dict]] = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def layer_step(shape: str, dtype: torch.dtype, kv_format: str, context: int) -> None:
    """One layer of one engine step on the Triton backend: two decode rows at ``context`` tokens and a
    prefill chunk of 24 after a cached prefix of 40, through the backend's own entry points (RoPE, the
    K/V write, decode and prefill attention, with and without a sliding window, the fused residual add +
    RMSNorm, a mixture of experts, the grouped LoRA matmuls)."""
    heads, kv_heads, head_dim = SHAPES[shape]
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=heads * head_dim,
                      intermediate_size=4 * heads * head_dim, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=head_dim)
    blocks = 2 * -(-context // BLOCK_SIZE) + 8
    cache = KVCache(cfg, blocks, BLOCK_SIZE, dtype, "cpu", kv_format)
    per_seq = -(-context // BLOCK_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(2)] + [[2 * per_seq + i for i in range(4)]]
    meta = paged_metadata([(tables[0], context), (tables[1], context)], [(tables[2], 24, 64)], BLOCK_SIZE, cache.device)
    slots = torch.tensor([tables[0][-1] * BLOCK_SIZE, tables[1][-1] * BLOCK_SIZE]
                         + [tables[2][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(40, 64)])
    tokens = len(slots)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    cos = torch.randn(tokens, 1, head_dim).to(dtype)
    kernels.apply_rope(q, k, cos, cos.clone())
    last = (per_seq - 1) * BLOCK_SIZE  # the decode rows' position: the first of their last block
    kv = cache.for_step(slots, [(tables[0], last, last + 1), (tables[1], last, last + 1), (tables[2], 40, 64)])[0]
    paged_attention(q, k, v, kv, meta, 2, head_dim ** -0.5)
    if shape == "gemma-3-1b":  # Gemma 2's soft-capped scores, at its (and Gemma 3's) head_dim
        paged_attention(q, k, v, kv, meta, 2, head_dim ** -0.5, softcap=50.0)
    # a step verifying drafts: chunks of 4 tokens after a long context (the short query tile)
    verify = paged_metadata([], [(tables[0], 4, context), (tables[1], 4, context)], BLOCK_SIZE, cache.device)
    drafted = torch.tensor([t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t in tables[:2]
                            for p in range(context - 4, context)])
    kv_verify = cache.for_step(drafted, [(t, context - 4, context) for t in tables[:2]])[0]
    paged_attention(q[:8], k[:8], v[:8], kv_verify, verify, 0, head_dim ** -0.5)
    if kv_format == "auto":  # a sliding-window model's decode and prefill (Mistral v0.1)
        paged_attention(q, k, v, kv, dataclasses.replace(meta, window=64), 2, head_dim ** -0.5)
    hidden = torch.randn(tokens, cfg.hidden_size).to(dtype)
    kernels.fused_add_rms_norm(hidden, hidden.clone(), torch.ones(cfg.hidden_size).to(dtype), 1e-6)
    if shape == "gemma-3-1b":  # Gemma's norm: a float32 weight scaling the row before the cast
        kernels.fused_add_rms_norm(hidden, hidden.clone(), torch.ones(cfg.hidden_size), 1e-6, scale_first=True)
    if kv_format == "auto":  # a mixture of experts' two launches at a decode batch (16-row blocks) and a prefill (64)
        hidden, experts, inter = cfg.hidden_size, 8, 768  # the values are never read: nothing is run
        for tokens in (4, 512):
            scores, ids = route(torch.randn(tokens, experts), 2, renormalize=True)
            kernels.fused_moe(torch.empty(tokens, hidden, dtype=dtype), scores, ids,
                              torch.empty(experts, 2 * inter, hidden, dtype=dtype),
                              torch.empty(experts, hidden, inter, dtype=dtype))
            if shape == FP8_SHAPE and dtype != torch.float16:  # fp8 experts in 128 x 128 blocks (Qwen3-30B-A3B-FP8)
                fp8 = torch.float8_e4m3fn
                kernels.fused_moe(torch.empty(tokens, hidden, dtype=dtype), scores, ids,
                                  torch.empty(experts, 2 * inter, hidden, dtype=fp8),
                                  torch.empty(experts, hidden, inter, dtype=fp8),
                                  common.ExpertQuant(torch.empty(experts, 2 * inter, hidden // 128),
                                                      torch.empty(experts, hidden, inter // 128), 128, 128))
                # 4-bit experts in groups of 128 (Qwen3-30B-A3B-GPTQ-Int4), with act-order or not, and 8-bit ones:
                # scales and zeros of one shape each
                groups = ((experts, 2 * inter, hidden // 128), (experts, hidden, inter // 128))
                scales, zeros = ([torch.empty(g, dtype=t) for g in groups] for t in (torch.float32, torch.uint8))
                act_order = [torch.zeros(experts, cols, dtype=torch.long) for cols in (hidden, inter)]
                for bits, perms in ((4, [None, None]), (4, act_order), (8, [None, None])):
                    kernels.fused_moe(torch.empty(tokens, hidden, dtype=dtype), scores, ids,
                                      torch.empty(experts, 2 * inter, hidden * bits // 8, dtype=torch.uint8),
                                      torch.empty(experts, hidden, inter * bits // 8, dtype=torch.uint8),
                                      common.ExpertQuant(*scales, 128, 128, *zeros, *perms, bits=bits))
                # W8A8 experts (RedHat's w8a8 releases): int8 values a scale a row, times each row of their input
                # quantized in a launch of its own (int8_rows), the sums in int32
                kernels.fused_moe(torch.empty(tokens, hidden, dtype=dtype), scores, ids,
                                  torch.empty(experts, 2 * inter, hidden, dtype=torch.int8),
                                  torch.empty(experts, hidden, inter, dtype=torch.int8),
                                  common.ExpertQuant(torch.empty(experts, 2 * inter, 1), torch.empty(experts, hidden, 1),
                                                     hidden, inter, int8_activations=True))
    if kv_format == "auto" and dtype == torch.bfloat16:  # LoRA adapters of a decode batch: ranks 16 and 64, packed q/k/v
        fan_in, fan_out = cfg.hidden_size, qkv.shape[1]
        for cap in (48, 192):
            kernels.lora_grouped(torch.empty(4, fan_out, dtype=dtype), torch.empty(4, fan_in, dtype=dtype),
                                 torch.empty(4, cap, fan_in, dtype=dtype), torch.empty(4, fan_out, cap, dtype=dtype),
                                 torch.full((4,), -1))
    if kv_format == "auto" and shape == FP8_SHAPE and dtype != torch.float16:  # fp8 weights (W8A16): q/k/v at a
        for tokens in (8, 512):  # decode batch and a prefill, 128 x 128 blocks and a scale per row (--quantization
            # fp8); codes natively from sm_89, as bytes before. One shape, bf16 and fp32: fp16 compiles as bf16
            for k_block in (128, cfg.hidden_size):
                kernels.fp8_matmul(torch.empty(tokens, cfg.hidden_size, dtype=dtype),
                                   torch.empty(qkv.shape[1], cfg.hidden_size, dtype=torch.float8_e4m3fn),
                                   torch.empty(qkv.shape[1], cfg.hidden_size // k_block), k_block)
            groups = cfg.hidden_size // 128  # integer weights (W4A16 and W8A16, AWQ and GPTQ in groups of 128)
            for bits in (4, 8):
                kernels.int_matmul(torch.empty(tokens, cfg.hidden_size, dtype=dtype),
                                   torch.empty(qkv.shape[1], cfg.hidden_size * bits // 8, dtype=torch.uint8),
                                   torch.empty(qkv.shape[1], groups),
                                   torch.empty(qkv.shape[1], groups, dtype=torch.uint8), bits)
    if kv_format == "auto" or kv_format == "int8":  # split-K decode, as a long context on few sequences gets
        k_cache, v_cache, quant = ((kv.kv[0], kv.kv[1], None) if kv_format == "auto" else quantized_layer(kv))
        paged_decode_attention(q[:2], k_cache, v_cache, meta.decode_tables, meta.context_lens, head_dim ** -0.5,
                               num_splits=4, quant=quant)


def step_launches(arch: int) -> list[tuple[str, tuple[JITFunction, tuple, dict]]]:
    """(what, launch) for every layer step of ``SHAPES`` x attention dtypes x ``FORMATS``, as the launchers
    make them on ``cuda:arch`` (the only device-dependent choice: fp8 codes as bytes before sm_89)."""
    out = []
    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for kv_format in FORMATS if dtype == torch.bfloat16 else ("auto",):
                with recorded_launches() as launches, mock.patch.object(
                        common, "fp8_codes_as_bytes", lambda device: arch < 89):
                    layer_step(shape, dtype, kv_format, context=300)
                name = f"{shape} {str(dtype).removeprefix('torch.')} {kv_format}"
                out += [(name, launch) for launch in launches]
    return out


def bind(fn: JITFunction, args: tuple, kwargs: dict, arch: int):
    """What ``JITFunction.run`` derives from a launch on ``cuda:arch`` before compiling: the target, its
    backend, and the bound arguments' specialization and options (Triton's own binder, an internal API)."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    return (target, backend, *binder(*args, **kwargs))


def compile_launch(fn: JITFunction, kwargs: dict, bound: tuple):
    """Compile one recorded launch, ``bound`` by ``bind`` for its target, as ``JITFunction.run`` would."""
    target, backend, bound_args, specialization, options = bound
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def registers_and_spills(cubin: bytes) -> tuple[int, int]:
    """Registers a thread and stack bytes a thread (spilled registers) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], check=True,
                               capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage[:500]}")
    return int(found.group(1)), int(found.group(2))


def root_cause(exc: BaseException) -> str:
    """The innermost cause of a compile error (Triton wraps it once per inlined function)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}"


def run_at_lowest_priority() -> None:
    """Let everything else on the machine have the CPU first: this is a batch check, and the test suite
    runs it beside its other tests. Under Linux's autogroup scheduling a nice value only ranks processes
    within one session, so a process that leads a session of its own (the suite starts it so) lowers its
    session's weight too; run from a shell, it leaves the shell's session alone."""
    os.nice(19 - os.nice(0))
    if os.getsid(0) == os.getpid():
        with contextlib.suppress(OSError):  # no autogroups on this kernel
            Path("/proc/self/autogroup").write_text("19")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", choices=sorted(MAX_SHARED),
                        help="compute capability x10 (repeatable; default 90, the H100/H200)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("run without TRITON_INTERPRET: interpreted kernels cannot be compiled")
    run_at_lowest_priority()
    for arch in args.arch or [90]:
        launches = step_launches(arch)
        seen: set[str] = set()
        for name, (fn, a, kw) in launches:
            bound = bind(fn, a, kw, arch)
            key = f"{fn.__name__} {bound[3]} {bound[4]}"  # specialization and options: the same kernel
            if key in seen:
                continue
            seen.add(key)
            row = {"arch": arch, "kernel": fn.__name__, "launch": name, "max_shared": MAX_SHARED[arch]}
            try:
                compiled = compile_launch(fn, kw, bound)
                registers, spilled = registers_and_spills(compiled.asm["cubin"])
                row.update(ok=True, shared=compiled.metadata.shared, registers=registers, spill_bytes=spilled,
                           num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages)
            except Exception as exc:  # a compile failure is the finding: report it, go on with the rest
                row.update(ok=False, error=root_cause(exc))
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
