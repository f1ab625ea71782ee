"""W8A8 (engine/w8a8.py): compressed-tensors' int-quantized checkpoints with int8 activations scaled a token
(RedHat's w8a8 releases) run their projections and experts in integers. The reference is transformers on the
weights the codes stand for, each matmul's input quantized a row at a time as the checkpoint says."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from unittest import mock

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_engine_model import (
    BLOCK,
    NEW_TOKENS,
    build_hf_checkpoint,
    engine_greedy,
    make_runner,
    prompts,
    rel_err,
)
from test_int_weights import quantize_checkpoint, transformers_with

from engine.capacity import plan, shape_from_dir
from engine.config import IntQuant, ModelConfig
from engine.errors import UnsupportedModelError
from engine.int_weights import checkpoint_config
from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.model import Linear
from engine.runner import ModelRunner
from engine.w8a8 import W8A8_RELEASES, int8_matmul, quantize_int8_rows, w8a8_linear

pytestmark = pytest.mark.timeout(120)


def test_each_rows_absmax_maps_to_127_and_a_row_of_zeros_to_zeros():
    x = torch.tensor([[0.5, -2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 0.01]])
    codes, scales = quantize_int8_rows(x)
    assert codes.dtype == torch.int8 and scales.shape == (3, 1)
    assert codes[0].tolist() == [32, -127, 64, 0]  # 0.5 * 127 / 2 = 31.75
    assert codes[1].tolist() == [0, 0, 0, 0] and torch.isfinite(scales).all()
    assert codes[2].tolist() == [127, 64, -32, 0]  # 63.5 rounds half to even: 64; -31.75 to -32
    assert torch.allclose(scales[:, 0], torch.tensor([2.0, 0.0, 3.0]) / 127)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_matmul_is_the_product_of_the_quantized_rows_and_weights(rows, dtype):
    """The int32 sums are exact: the result is the dequantized codes' product in float64 up to the float32
    scaling and the cast to ``dtype``; a bias is added before the cast. Leading dims are kept."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 3, 96, generator=gen).to(dtype)
    weight = torch.randint(-128, 128, (48, 96), generator=gen, dtype=torch.int8)
    weight_scale = torch.rand(48, 1, generator=gen) / 100
    bias = torch.randn(48, generator=gen).to(dtype)
    codes, scales = quantize_int8_rows(x.reshape(-1, 96))
    exact = (codes.double() * scales.double()) @ (weight.double() * weight_scale.double()).T + bias.double()
    out = w8a8_linear(x, weight, weight_scale, bias)
    assert out.dtype == dtype and out.shape == (rows, 3, 48)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out.reshape(-1, 48).double(), exact) < tolerance
    assert torch.equal(int8_matmul(codes, weight), codes.int() @ weight.int().T)


def on_int8_grid(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each row (its last dim) replaced by its int8 codes times their scale, computed in x's dtype:
    the row's absmax at 127, round half to even."""
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(x * scale.reciprocal()).clamp(-128, 127) * scale


@contextmanager
def inputs_quantized(hf: transformers.PreTrainedModel) -> Iterator[None]:
    """While it lasts, every matmul of ``hf`` but the lm_head's and the routers' takes its input as int8 codes
    times their scale, a row at a time: the projections' and the experts' (which call ``F.linear`` on their
    slices of the packed matrices)."""
    kept = {id(hf.lm_head.weight)} | {id(module.weight) for name, module in hf.named_modules()
                                       if name.endswith(("mlp.gate", "shared_expert_gate"))}
    linear = torch.nn.functional.linear

    def quantized(x, weight, bias=None):
        return linear(x if id(weight) in kept else on_int8_grid(x), weight, bias)

    with mock.patch("torch.nn.functional.linear", quantized):
        yield


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe", "qwen3_moe", "qwen3", "mixtral"])
def test_a_w8a8_checkpoint_generates_as_transformers_with_its_inputs_quantized_a_row(tmp_path, arch):
    """Llama, Qwen2 (q/k/v biases, added in float32), Qwen3, Qwen2-MoE (a shared expert beside the routed ones),
    Qwen3-MoE and Mixtral: greedy tokens equal the reference's and the first logits are within float rounding of
    it, ten times nearer than to the same weights with unquantized inputs (the activations really are
    quantized).

    The reference runs in float32 and in float64, and each prompt must match one of them: a value that lands on
    a code boundary takes a neighbouring code in one and not the other, and which of the two the engine's own
    float32 sums agree with depends on the CPU's kernels (Qwen3-MoE's 40-token prompt went each way on two
    machines)."""
    build_hf_checkpoint(tmp_path, arch)
    original = load_file(tmp_path / "model.safetensors")
    reference = transformers_with(tmp_path, {**original, **quantize_checkpoint(tmp_path, "compressed_w8a8")})
    references = [reference, copy.deepcopy(reference).double()]
    for ref in references:
        ref.set_experts_implementation("eager")  # each expert's matmuls by F.linear, which the reference patches
    runner, cfg = make_runner(tmp_path)
    assert cfg.weight_quant.int8_activations
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_zero is None and qkv.weight_scale.shape == (qkv.out_features, 1)
    batch = prompts()
    tokens, logits = engine_greedy(runner, batch, NEW_TOKENS)
    with torch.no_grad():
        for i, p in enumerate(batch):
            ids = torch.tensor([p])
            runs = []  # (error against the quantized reference, against the unquantized one, its greedy tokens)
            for ref in references:
                unquantized = ref(ids).logits[0, -1].float()
                with inputs_quantized(ref):
                    want = ref(ids).logits[0, -1].float()
                    greedy = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
                runs.append((rel_err(logits[i], want), rel_err(logits[i], unquantized), greedy))
            error, unquantized_error, greedy = min(runs, key=lambda run: run[0])
            assert error < 1e-4, f"{arch} prompt {i}: {[run[0] for run in runs]}"
            assert unquantized_error > 10 * error
            assert tokens[i] == greedy, f"{arch} prompt {i}"


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_kv_calc_weighs_w8a8_projections_as_the_engine_holds_them(tmp_path, arch):
    """A byte a weight and a float32 scale a row, no zeros, for the projections and a mixture's experts."""
    build_hf_checkpoint(tmp_path, arch)
    quantize_checkpoint(tmp_path, "compressed_w8a8")
    model, _ = load_model(tmp_path, "bfloat16", "cpu")
    dense = [m for name, m in model.named_modules() if isinstance(m, Linear) and name.endswith("_proj")]
    assert dense and all(m.weight.dtype == torch.int8 and m.weight_zero is None for m in dense)
    for moe in (layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")):
        assert moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == torch.int8
        assert not hasattr(moe.experts, "gate_up_proj_zero") and moe.experts.down_proj_scale.shape[2] == 1
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan(shape_from_dir(tmp_path), "bfloat16", 64, 1, None).weight_bytes == held


def w8a8_config(**change) -> dict:
    config = checkpoint_config(W8A8_RELEASES)
    group = config["config_groups"]["group_0"]
    for key in ("weights", "input_activations"):
        group[key] = {**group[key], **change.get(key, {})}
    return config


@pytest.mark.parametrize("change", [
    {"input_activations": {"dynamic": False, "strategy": "tensor"}},  # a static scale from calibration
    {"input_activations": {"symmetric": False}},  # a zero point a token
    {"input_activations": {"num_bits": 4}},
    {"weights": {"strategy": "group", "group_size": 32}},  # a scale a group cannot scale an int32 sum
    {"weights": {"symmetric": False}},
])
def test_other_activation_schemes_run_w8a16(tmp_path, change):
    """Only dynamic symmetric int8 tokens beside symmetric weights with a scale a row run W8A8; any other
    int-quantized checkpoint keeps its activations in the model's dtype, as before."""
    build_hf_checkpoint(tmp_path, "llama")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_dict({**raw, "quantization_config": w8a8_config()}).weight_quant.int8_activations
    quant = ModelConfig.from_dict({**raw, "quantization_config": w8a8_config(**change)}).weight_quant
    assert isinstance(quant, IntQuant) and not quant.int8_activations


@pytest.mark.parametrize("change", [dict(group_size=32), dict(zero_points=True), dict(packed=True),
                                    dict(group_size=32, act_order=True)])
def test_int8_activations_beside_other_weights_cannot_be_built(change):
    with pytest.raises(ValueError, match="int8 activations"):
        replace(W8A8_RELEASES, **change)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_quantization_w8a8_int8_generates_as_transformers_on_its_rounded_weights(tmp_path, arch):
    """A 16-bit checkpoint with ``--quantization w8a8_int8``: every projection and expert matrix rounded to int8
    a scale a row as it loads (routers, embeddings and the lm_head left), then run as a w8a8 checkpoint. The
    reference is transformers on those rounded weights, its inputs quantized a row, in float64."""
    hf = build_hf_checkpoint(tmp_path, arch)
    reference = hf.double()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                param.copy_(on_int8_grid(param.float()))  # in float32, as the engine rounds them
    reference.set_experts_implementation("eager")
    model, cfg = load_model(tmp_path, "float32", "cpu", quantization="w8a8_int8")
    assert cfg.weight_quant.online and cfg.weight_quant.int8_activations
    runner = ModelRunner(model, cfg, KVCache(cfg, 64, BLOCK, torch.float32, "cpu"))
    assert runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    batch = prompts()
    tokens, logits = engine_greedy(runner, batch, NEW_TOKENS)
    with torch.no_grad(), inputs_quantized(reference):
        for i, p in enumerate(batch):
            ids = torch.tensor([p])
            assert rel_err(logits[i], reference(ids).logits[0, -1].float()) < 1e-4
            assert tokens[i] == reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan(shape_from_dir(tmp_path, "w8a8_int8"), "float32", 64, 1, None).weight_bytes == held


def test_quantization_w8a8_int8_refuses_a_quantized_checkpoint(tmp_path):
    """Weights already quantized (fp8, or integers) are not rounded again: the error names the flag to drop."""
    from test_weight_quant import quantize_checkpoint as quantize_fp8

    build_hf_checkpoint(tmp_path / "fp8", "llama")
    quantize_fp8(tmp_path / "fp8", "block")
    build_hf_checkpoint(tmp_path / "int", "llama")
    quantize_checkpoint(tmp_path / "int", "compressed_w8a8")
    for path in (tmp_path / "fp8", tmp_path / "int"):
        with pytest.raises(UnsupportedModelError, match="without --quantization w8a8_int8"):
            ModelConfig.from_dir(path).with_quantization("w8a8_int8")
    assert ModelConfig.from_dir(tmp_path / "fp8").with_quantization("fp8").weight_quant is not None
