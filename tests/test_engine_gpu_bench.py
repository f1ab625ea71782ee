"""benchmarks/engine_gpu.py end to end on its tiny CPU shape: the JSON it writes has every figure, each a
sane positive number, and in float32 the engine's greedy tokens equal transformers ``generate``'s; with
``--kv-cache-dtype int8`` the roofline counts the int8 cache's own bytes, with ``--quantization fp8`` and
``--int-weights`` the quantized weights'; and benchmarks/speculative_gpu.py the same way (plain and drafted
engines, the same tokens in float32); benchmarks/moe_gpu.py too, its fused kernels interpreted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import engine_gpu

ROW_KEYS = {"seconds", "tokens_per_s", "decode_steps", "median_decode_step_ms", "roofline_decode_step_ms",
            "roofline_tokens_per_s", "roofline_fraction", "prefill_tokens", "prefill_seconds",
            "prefill_tokens_per_s", "prefill_mfu", "hf_tokens_per_s", "speedup_vs_hf", "hf_same_tokens"}


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.timeout(120)
def test_tiny_cpu_run_writes_every_figure(tmp_path):
    out = tmp_path / "engine_gpu.json"
    returned = engine_gpu.main(["--device", "cpu", "--shapes", "tiny-test", "--batches", "1,4",
                           "--prompt-len", "32", "--new-tokens", "8", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert positive(result["copy_bandwidth_bytes_per_s"]) and positive(result["matmul_flops_per_s"])
    shape = result["shapes"]["tiny-test"]
    assert shape["attention_backend"] == "torch" and shape["num_blocks"] > 0
    assert shape["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head_dim x fp32
    assert 0 < shape["weight_bytes_read_per_step"] < shape["weight_bytes"]
    assert set(shape["batches"]) == {"1", "4"}
    for batch, row in shape["batches"].items():
        assert set(row) == ROW_KEYS
        assert all(positive(row[k]) for k in ROW_KEYS), row
        assert row["decode_steps"] == 7  # 8 new tokens: the first comes with the prefill
        assert row["prefill_tokens"] == 32 * int(batch)
        assert row["hf_same_tokens"] == 1.0


@pytest.mark.timeout(120)
def test_a_quantized_cache_counts_its_own_bytes_in_the_roofline(tmp_path):
    out = tmp_path / "engine_gpu.json"
    result = engine_gpu.main(["--device", "cpu", "--shapes", "tiny-test", "--batches", "2", "--prompt-len", "32",
                              "--new-tokens", "4", "--skip-hf", "--kv-cache-dtype", "int8", "--json", str(out)])
    shape = result["shapes"]["tiny-test"]
    assert result["kv_cache_dtype"] == "int8"
    # per layer and block of 16 tokens: K and V codes (16 x 2 heads x 16 bytes) + fp16 scales per token and
    # head, each field 16-byte aligned; 2 layers
    assert shape["kv_bytes_per_token"] == 2 * 2 * (16 * 2 * 16 + 16 * 2 * 2) / 16
    assert positive(shape["batches"]["2"]["roofline_decode_step_ms"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, bytes_a_parameter, int_bits", [(["--quantization", "fp8"], 4, None),
                                                                (["--int-weights", "awq"], 2, 4),
                                                                (["--int-weights", "gptq", "--int-bits", "8"], 4, 8),
                                                                (["--int-weights", "w8a8"], 4, 8)])
def test_quantized_weights_count_their_own_bytes_in_the_roofline(tmp_path, flags, bytes_a_parameter, int_bits):
    """--quantization fp8 and --int-weights awq, gptq or w8a8 (the checkpoint rewritten in 4 or 8 bits): the weights
    read per step are the codes (a byte or half a byte each) and their scales, fewer than float32's four bytes
    a parameter (the float32 embedding and lm_head count in full)."""
    result = engine_gpu.main(["--device", "cpu", "--shapes", "tiny-test", "--batches", "2", "--prompt-len", "32",
                              "--new-tokens", "4", "--skip-hf", *flags, "--json", str(tmp_path / "engine_gpu.json")])
    shape = result["shapes"]["tiny-test"]
    assert result[flags[0].removeprefix("--").replace("-", "_")] == flags[1]
    assert result["int_bits"] == int_bits
    assert shape["weight_bytes"] < bytes_a_parameter * shape["parameters"]
    assert positive(shape["batches"]["2"]["roofline_decode_step_ms"])
    int8_rate = result["int8_matmul_ops_per_s"]  # W8A8's prefill peak, measured beside its checkpoint only
    assert positive(int8_rate) if flags[-1] == "w8a8" else int8_rate is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("draft_layers", [0, 1])
def test_speculative_gpu_benchmark_on_the_tiny_cpu_shape_writes_every_figure(tmp_path, draft_layers):
    """benchmarks/speculative_gpu.py: plain and drafted engines on the same prompts (n-gram drafts, or a draft
    model of the checkpoint's first layer); in float32 the tokens agree, the drafts happened, and every figure
    is there."""
    import torch

    from benchmarks import speculative_gpu

    torch.manual_seed(0)  # the random checkpoint: its greedy outputs repeat within the run
    out = tmp_path / "speculative_gpu.json"
    result = speculative_gpu.main(["--device", "cpu", "--shapes", "tiny-test", "--batches", "1,4", "--prompt-len",
                                   "32", "--new-tokens", "24", "--draft-layers", str(draft_layers), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = result["shapes"]["tiny-test"]["batches"]
    assert set(rows) == {"1", "4"}
    for row in rows.values():
        assert row["same_tokens"] == 1.0
        assert positive(row["plain_tokens_per_s"]) and positive(row["spec_tokens_per_s"]) and positive(row["speedup"])
        assert positive(row["plain_decode_step_ms"])
        assert 0 <= row["accepted_tokens"] <= row["draft_tokens"]
    drafted = [row for row in rows.values() if row["draft_tokens"]]
    assert drafted and all(positive(r["drafted_step_ms"]) and r["tokens_per_drafted_step"] >= 1 for r in drafted)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weights, fraction", [("dtype", (1, 1)), ("int4", (1 / 8, 1 / 4)), ("int8", (1 / 4, 1 / 2)),
                                              ("w8a8", (1 / 4, 1 / 2))])
def test_moe_gpu_benchmark_on_the_tiny_cpu_shape_writes_every_figure(tmp_path, weights, fraction):
    """benchmarks/moe_gpu.py in a process of its own (its fused kernels under TRITON_INTERPRET=1): both paths
    agree in float32, every figure is there, and the experts touched are those the routing can reach; 4-bit
    experts weigh about a quarter of their float32 bytes, 8-bit ones about a third (codes, and a scale and
    zero per group), W8A8 ones a little over a quarter (a scale a row)."""
    out = tmp_path / "moe_gpu.json"
    run = subprocess.run([sys.executable, "benchmarks/moe_gpu.py", "--device", "cpu", "--shapes", "tiny-test",
                          "--tokens", "1,40", "--weights", weights, "--json", str(out)],
                         cwd=Path(__file__).parents[1],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stderr[-3000:]
    shape = json.loads(out.read_text())["shapes"]["tiny-test"]
    float32_bytes = 3 * shape["experts"] * shape["hidden"] * shape["intermediate"] * 4
    low, high = fraction
    assert shape["weight_bytes"] == float32_bytes if weights == "dtype" else \
        float32_bytes * low < shape["weight_bytes"] < float32_bytes * high
    assert set(shape["tokens"]) == {"1", "40"}
    for t, row in shape["tokens"].items():
        assert row["max_rel_diff"] < 1e-5 and row["graph_replay_ms"] is None  # no CUDA graph on CPU
        assert all(positive(row[k]) for k in ("fused_ms", "torch_loop_ms", "speedup_vs_torch_loop",
                                              "roofline_ms", "roofline_fraction", "tflops", "mfu"))
        assert row["experts_touched"] == (2 if t == "1" else 8)  # one token's top 2; 40 tokens reach all 8
