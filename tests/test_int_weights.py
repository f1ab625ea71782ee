"""Integer weights (engine/int_weights.py): AWQ, GPTQ and compressed-tensors checkpoints, 4-bit and 8-bit,
generate as the weights their codes, zeros and scales stand for (transformers cannot load them without AutoAWQ,
GPTQModel or compressed-tensors: the reference is the model with those weights), hold half a byte (or one) a
weight, and every checkpoint the layout cannot hold is refused by name."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_engine_model import BLOCK, build_hf_checkpoint, prompts
from test_weight_quant import NEW_TOKENS, is_projection, reference_tokens, with_weights

from benchmarks.kv_quality import greedy_tokens
from engine.capacity import plan, shape_from_dir
from engine.config import EngineConfig, IntQuant, ModelConfig
from engine.engine import Engine
from engine.errors import CheckpointError, UnsupportedModelError
from engine.int_weights import (
    awq_pack,
    awq_unpack,
    checkpoint_config,
    checkpoint_tensors,
    pack_words,
    quantize_groups,
    unpack_words,
)
from engine.loader import load_model
from engine.w8a8 import W8A8_RELEASES

pytestmark = pytest.mark.timeout(120)

GROUP = 32


def test_an_awq_word_holds_its_eight_columns_in_awq_order():
    """AutoAWQ packs columns 0 2 4 6 1 3 5 7 into nibbles 0..7: columns holding 1..8 make 0x86427531."""
    word = torch.tensor([[0x86427531 - 2**32]], dtype=torch.int32)
    assert awq_unpack(word).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert torch.equal(awq_pack(torch.arange(1, 9).view(1, 8)), word)


def test_a_gptq_word_holds_eight_input_rows_in_order_and_a_compressed_tensors_one_eight_columns():
    word = torch.tensor([[0x87654321 - 2**32]], dtype=torch.int32)
    assert unpack_words(word, 0, 4).flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert torch.equal(pack_words(torch.arange(1, 9).view(8, 1), 0, 4), word)
    assert unpack_words(word, 1, 4).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]


def test_an_8_bit_word_holds_four_codes_lowest_byte_first():
    """GPTQ's and compressed-tensors' 8-bit packing: four codes a word, code i in bits 8i..8i+7."""
    word = torch.tensor([[0x81FF0201 - 2**32]], dtype=torch.int32)
    assert unpack_words(word, 0, 8).flatten().tolist() == [1, 2, 255, 129]
    assert unpack_words(word, 1, 8).tolist() == [[1, 2, 255, 129]]
    assert torch.equal(pack_words(torch.tensor([[1], [2], [255], [129]]), 0, 8), word)


quantize_symmetric = partial(quantize_groups, symmetric=True)  # GPTQ's sym=True grid: zero 2^(bits - 1)


# format -> (layout, the quantizer); the original GPTQ format as AutoGPTQ writes it with sym=True
FORMATS = {
    "awq": (IntQuant("awq", GROUP), quantize_groups),
    "gptq": (IntQuant("gptq", GROUP, zero_offset=1), quantize_symmetric),
    "gptq_v2": (IntQuant("gptq", 0), quantize_groups),  # one group a row
    "compressed": (IntQuant("compressed-tensors", GROUP, zero_points=False), quantize_symmetric),
    "compressed_asym": (IntQuant("compressed-tensors", 0), quantize_groups),  # a zero point a row
    # act-order: each group's columns scattered over the input, in GPTQ's order
    "gptq_act_order": (IntQuant("gptq", GROUP, act_order=True), quantize_groups),
    # groups of 16: the tiny mixtures' experts (intermediate size 32) get two groups in their down matrices
    "gptq_act_order_16": (IntQuant("gptq", 16, act_order=True), quantize_groups),
    "compressed_act_order": (IntQuant("compressed-tensors", GROUP, zero_points=False, act_order=True),
                             quantize_symmetric),
    # 8-bit: Qwen's GPTQ-Int8 releases (the original format, sym=True), RedHat's w8a16 ones (a scale a row,
    # symmetric), and asymmetric act-order groups of 16 (zeros packed four a word)
    "gptq_int8": (IntQuant("gptq", GROUP, zero_offset=1, bits=8), quantize_symmetric),
    "compressed_w8a16": (IntQuant("compressed-tensors", 0, zero_points=False, bits=8), quantize_symmetric),
    "compressed_int8_act_order_16": (IntQuant("compressed-tensors", 16, act_order=True, bits=8), quantize_groups),
    # int-quantized: an int8 a weight, RedHat's w8a8 releases (a scale a row, symmetric, int8 activations a
    # token: tests/test_w8a8.py), and asymmetric groups
    "compressed_w8a8": (W8A8_RELEASES, quantize_symmetric),
    "compressed_int8_asym_16": (IntQuant("compressed-tensors", 16, bits=8, packed=False), quantize_groups),
}


def input_order(name: str, cols: int, orders: dict[str, torch.Tensor]) -> torch.Tensor:
    """The order act-order GPTQ quantizes ``name``'s input columns in: one per input (q/k/v share the
    attention's, gate/up the MLP's), as GPTQ derives it from the input's statistics."""
    key = name.rsplit(".", 2)[0] + (".attn" if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj") else
                                    ".mlp" if name.split(".")[-2] in ("gate_proj", "up_proj") else name)
    if key not in orders:
        orders[key] = torch.randperm(cols, generator=torch.Generator().manual_seed(len(orders)))
    return orders[key]


def quantize_checkpoint(path, fmt: str, keep: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Rewrites the checkpoint at ``path`` with integer projections in ``fmt`` (the original GPTQ format with a
    zero bias beside each projection, as older AutoGPTQ writes; act-order formats with their columns
    grouped in a random order per input; the projections ``keep`` names, as the checkpoint does, left in their
    float weights, as a checkpoint's ignore list leaves them); returns each quantized projection's dequantized
    weight."""
    quant, quantize = FORMATS[fmt]
    tensors = load_file(path / "model.safetensors")
    dequantized, orders = {}, {}
    for name in [n for n in tensors if is_projection(n) and n.removesuffix(".weight") not in keep]:
        weight = tensors.pop(name)
        cols = weight.shape[1]
        order = input_order(name, cols, orders) if quant.act_order else torch.arange(cols)
        sorted_codes, scales, zeros = quantize(weight[:, order], quant.group_size, quant.bits)
        codes, g_idx = torch.empty_like(sorted_codes), torch.empty(cols, dtype=torch.int64)
        codes[:, order], g_idx[order] = sorted_codes, torch.arange(cols) // (quant.group_size or cols)
        stem = name.removesuffix("weight")
        tensors.update({stem + suffix: t for suffix, t in checkpoint_tensors(codes, scales, zeros, quant,
                                                                             g_idx).items()})
        if quant.zero_offset:
            tensors.setdefault(stem + "bias", torch.zeros(codes.shape[0], dtype=torch.float16))
        # the weights they stand for, written out: each column with its group's zero and scale
        dequantized[name] = (codes.float() - zeros.float()[:, g_idx]) * scales.half().float()[:, g_idx]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    config = {**checkpoint_config(quant), **({"sym": True} if quant.layout == "gptq" and quant.zero_offset else {})}
    (path / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    return dequantized


def transformers_with(path, tensors: dict[str, torch.Tensor]) -> transformers.PreTrainedModel:
    """transformers loading ``tensors`` (by checkpoint name: the weights the codes stand for) with ``path``'s
    config minus its quantization_config; its own conversion packs a mixture's experts as it loads."""
    out = path / "dequantized"
    out.mkdir()
    raw = json.loads((path / "config.json").read_text())
    raw.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(raw))
    if (path / "generation_config.json").exists():
        shutil.copy(path / "generation_config.json", out)
    save_file({name: t.contiguous() for name, t in tensors.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch, fmt", [("qwen2", "awq"), ("llama", "gptq"), ("mistral", "gptq_v2"),
                                       ("qwen3", "compressed"), ("phi3", "compressed_asym"),
                                       ("qwen2", "gptq_act_order"), ("llama", "compressed_act_order"),
                                       ("qwen3_moe", "gptq"), ("mixtral", "awq"), ("qwen2_moe", "compressed_asym"),
                                       ("qwen3_moe", "gptq_act_order_16"), ("qwen2", "gptq_int8"),
                                       ("llama", "compressed_w8a16"), ("qwen3_moe", "compressed_int8_act_order_16"),
                                       ("qwen2_moe", "compressed_int8_asym_16")])
def test_an_integer_checkpoint_generates_as_its_dequantized_weights(tmp_path, arch, fmt):
    """AWQ on Qwen2 (q/k/v biases, tied embeddings), the original GPTQ format on Llama (zeros stored minus
    one, a zero bias beside every projection, read past), GPTQ v2 on Mistral (one group a row),
    compressed-tensors on Qwen3 (symmetric: no zeros stored) and Phi-3 (a zero point a row, its checkpoint's
    q/k/v and gate/up packed already), and act-order GPTQ and compressed-tensors (groups scattered over the
    columns by g_idx: sorted into place at load, the input gathered to match), and mixtures of experts in
    GPTQ (Qwen3-MoE, act-order too: each expert's own input orders), AWQ (Mixtral's w1/w3/w2) and
    compressed-tensors with a zero point a row (Qwen2-MoE, its shared expert too); 8-bit GPTQ (Qwen's Int8
    releases) and compressed-tensors (a scale a row, symmetric; and act-order experts with zero points packed
    four a word), and int-quantized ones, an int8 a weight (asymmetric groups of a mixture's experts; RedHat's
    w8a8 releases run W8A8: tests/test_w8a8.py): q/k/v and gate/up packed row by row into the model's fused
    matrices, each expert's into the packed experts, half a byte (or one) a weight; the routers stay in the model's dtype. The reference is
    transformers on the weights the codes stand for."""
    build_hf_checkpoint(tmp_path, arch)
    original = load_file(tmp_path / "model.safetensors")
    reference = transformers_with(tmp_path, {**original, **quantize_checkpoint(tmp_path, fmt)})
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64))
    batch = prompts((9, 33))
    assert greedy_tokens(engine, batch, NEW_TOKENS) == reference_tokens(reference, batch)
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    per_byte = FORMATS[fmt][0].per_byte
    assert qkv.weight.dtype == torch.uint8 and qkv.weight.shape[1] == qkv.in_features // per_byte
    if "moe" in arch or arch == "mixtral":
        moe = next(layer.mlp for layer in engine.model.model.layers if hasattr(layer.mlp, "experts"))
        assert moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == torch.uint8
        assert moe.experts.gate_up_proj.shape[2] == engine.model_config.hidden_size // per_byte
        assert moe.gate.weight.dtype == torch.float32


@pytest.mark.parametrize("arch, fmt", [("qwen2", "awq"), ("qwen2", "gptq_act_order"),
                                       ("qwen3_moe", "gptq_act_order_16"), ("llama", "gptq_int8")])
def test_kv_calc_weighs_integer_weights_as_the_engine_holds_them(tmp_path, arch, fmt):
    """Codes, scales and zeros (a mixture's experts' too, its routers in the model's dtype), and an act-order
    projection's, or expert's, input order."""
    build_hf_checkpoint(tmp_path, arch)
    quantize_checkpoint(tmp_path, fmt)
    model, _ = load_model(tmp_path, "bfloat16", "cpu")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan(shape_from_dir(tmp_path), "bfloat16", 64, 1, None).weight_bytes == held


@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order"])
def test_a_lora_adapter_on_integer_weights_generates_as_peft_does_on_their_dequantized_copy(tmp_path, fmt):
    """The adapter's stacks are sized from the projection's features, not its packed weight's columns, and
    read the input in its own order when the base projection gathers it in act-order."""
    from test_lora import ALL_PROJECTIONS, peft_adapter, reference, run

    hf = build_hf_checkpoint(tmp_path / "base", "llama")
    hf = with_weights(hf, quantize_checkpoint(tmp_path / "base", fmt))
    adapted = peft_adapter(hf, tmp_path / "a", ALL_PROJECTIONS, rank=8, seed=1, lora_alpha=16)
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), block_size=BLOCK, num_blocks=64,
                                 lora_modules={"a": str(tmp_path / "a")}))
    p = prompts((21,))[0]
    tokens, _ = run(engine, {"base": (p, None), "a": (p, "a")})
    assert tokens == {"base": reference(hf, p), "a": reference(adapted, p)}


@pytest.mark.parametrize("change, field", [
    ({"bits": 8}, "quantization_config.bits"),  # AWQ's are 4-bit
    ({"quant_method": "gptq", "bits": 3}, "quantization_config.bits"),
    ({"quant_method": "gptq", "dynamic": {"-:.*mlp.*": {}}}, "quantization_config.dynamic"),  # GPTQModel's
    ({"group_size": 100}, "quantization_config.group_size"),
    ({"version": "gemv"}, "quantization_config.version"),
    ({"zero_point": False}, "quantization_config.zero_point"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "quantization_config.checkpoint_format"),
    ({"group_size": 48}, "quantization_config.group_size"),  # a multiple of 16 that splits no projection
    ({"weights": {"num_bits": 2, "type": "int"}}, "quantization_config.config_groups.weights"),
    ({"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "actorder": "dynamic"}},
     "quantization_config.config_groups.weights.actorder"),
    ({"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}},
     "quantization_config.config_groups.weights.strategy"),
    ({"format": "int-quantized", "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}},
     "quantization_config.config_groups.weights"),  # int-quantized holds int8 weights only
])
def test_an_integer_config_the_layout_cannot_hold_is_refused_by_field(tmp_path, change, field):
    build_hf_checkpoint(tmp_path, "llama")
    raw = json.loads((tmp_path / "config.json").read_text())
    if "weights" in change:  # a compressed-tensors config group's weights (and the format)
        config = {**checkpoint_config(FORMATS["compressed"][0]), **{k: v for k, v in change.items() if k != "weights"}}
        config["config_groups"]["group_0"]["weights"] = change["weights"]
    else:
        config = {**checkpoint_config(FORMATS["awq"][0]), **change}
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_dir(tmp_path)
    assert err.value.field == field


def test_integer_checkpoints_the_engine_cannot_run_as_such_are_refused(tmp_path):
    """An act-order g_idx under desc_act false, q and k act-order g_idx that differ (one input cannot be in
    two orders), a nonzero bias a projection does not have, a weight_shape other than the projection's,
    --quantization fp8 on top of integer weights, an act-order expert whose gate and up g_idx differ, and an
    8-bit zero the original GPTQ format wrapped (0 stored as -1: read back as 256)."""
    build_hf_checkpoint(tmp_path, "llama")
    quantize_checkpoint(tmp_path, "gptq")
    config = EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64)
    tensors = load_file(tmp_path / "model.safetensors")
    g_idx = "model.layers.1.mlp.down_proj.g_idx"
    tensors[g_idx] = tensors[g_idx].flip(0).contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{g_idx}'.*quantization_config does not say act-order"):
        Engine(config)
    build_hf_checkpoint(tmp_path / "act", "llama")
    quantize_checkpoint(tmp_path / "act", "gptq_act_order")
    act = load_file(tmp_path / "act" / "model.safetensors")
    k_g_idx = "model.layers.0.self_attn.k_proj.g_idx"
    act[k_g_idx] = (torch.arange(64) // GROUP).int()
    save_file(act, tmp_path / "act" / "model.safetensors")
    with pytest.raises(CheckpointError, match="g_idx differs from another projection's on the same input"):
        Engine(EngineConfig(model=str(tmp_path / "act"), block_size=BLOCK, num_blocks=64))
    tensors[g_idx] = tensors[g_idx].flip(0).contiguous()
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.ones(64, dtype=torch.float16)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"):
        Engine(config)
    build_hf_checkpoint(tmp_path / "ct", "llama")
    quantize_checkpoint(tmp_path / "ct", "compressed")
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight_shape"] = torch.tensor([128, 32])
    save_file(tensors, tmp_path / "ct" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"up_proj.weight_shape'.*is \[128, 32\], config.json implies \[128, 64\]"):
        Engine(EngineConfig(model=str(tmp_path / "ct"), block_size=BLOCK, num_blocks=64))
    with pytest.raises(UnsupportedModelError, match="4-bit weights already; load it without --quantization fp8"):
        ModelConfig.from_dir(tmp_path).with_quantization("fp8")
    build_hf_checkpoint(tmp_path / "moe", "qwen3_moe")
    quantize_checkpoint(tmp_path / "moe", "gptq_act_order_16")
    tensors = load_file(tmp_path / "moe" / "model.safetensors")
    up_g_idx = "model.layers.0.mlp.experts.2.up_proj.g_idx"
    tensors[up_g_idx] = tensors[up_g_idx].flip(0).contiguous()
    save_file(tensors, tmp_path / "moe" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{up_g_idx}'.*differs from another projection's on the same input"):
        Engine(EngineConfig(model=str(tmp_path / "moe"), block_size=BLOCK, num_blocks=64))
    build_hf_checkpoint(tmp_path / "int8", "llama")
    quantize_checkpoint(tmp_path / "int8", "gptq_int8")
    tensors = load_file(tmp_path / "int8" / "model.safetensors")
    qzeros = "model.layers.1.self_attn.o_proj.qzeros"
    tensors[qzeros][0, 0] = 0x7F7F7FFF  # the first column's zero stored as 255
    save_file(tensors, tmp_path / "int8" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{qzeros}'.*an 8-bit zero of 256"):
        Engine(EngineConfig(model=str(tmp_path / "int8"), block_size=BLOCK, num_blocks=64))


@pytest.mark.parametrize("arch, fmt, keep", [
    ("llama", "gptq", ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                       "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]),
    ("qwen3_moe", "compressed_asym", [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(8)
                                      for p in ("gate_proj", "up_proj", "down_proj")]),
])
def test_projections_a_checkpoint_leaves_in_16_bits_load_as_such_beside_the_quantized_ones(tmp_path, arch, fmt,
                                                                                            keep):
    """What an ignore list (modules_to_not_convert, exclude_modules) leaves unquantized is found in the
    checkpoint's tensors, whatever pattern language named it: a whole attention's q/k/v and an MLP's down
    matrix, or a layer's experts, held in the model's dtype while the rest stays packed."""
    build_hf_checkpoint(tmp_path, arch)
    original = load_file(tmp_path / "model.safetensors")
    reference = transformers_with(tmp_path, {**original, **quantize_checkpoint(tmp_path, fmt, frozenset(keep))})
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64))
    batch = prompts((9, 33))
    assert greedy_tokens(engine, batch, NEW_TOKENS) == reference_tokens(reference, batch)
    layers = engine.model.model.layers
    if arch == "llama":
        assert layers[0].self_attn.qkv_proj.weight.dtype == layers[1].mlp.down_proj.weight.dtype == torch.float32
        assert layers[1].self_attn.qkv_proj.weight.dtype == layers[0].mlp.down_proj.weight.dtype == torch.uint8
    else:
        assert layers[0].mlp.experts.gate_up_proj.dtype == torch.float32 and layers[0].mlp.expert_quant() is None
        assert layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8


def test_a_matrix_the_model_packs_from_float_and_quantized_weights_is_refused(tmp_path):
    """q left in 16 bits beside quantized k and v: one packed q/k/v matrix cannot hold both."""
    build_hf_checkpoint(tmp_path, "llama")
    quantize_checkpoint(tmp_path, "gptq", frozenset({"model.layers.1.self_attn.q_proj"}))
    with pytest.raises(CheckpointError, match=r"model.layers.1.self_attn.q_proj is a float weight beside quantized "
                                              r"ones of the matrix the model packs it into \(model.layers.1.self_attn"
                                              r".qkv_proj\)"):
        Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64))


@pytest.mark.parametrize("layout, bits, packed", [("awq", 8, True), ("gptq", 3, True), ("gptq", 8, False),
                                                  ("compressed-tensors", 4, False), ("marlin", 4, True)])
def test_an_integer_layout_no_checkpoint_holds_cannot_be_built(layout, bits, packed):
    """AWQ's codes are 4-bit; only compressed-tensors' int-quantized format holds unpacked codes, an int8 each."""
    with pytest.raises(ValueError, match="not a layout checkpoints hold"):
        IntQuant(layout, 32, bits=bits, packed=packed)
