"""FP8 weights (engine/weight_quant.py): block-wise fp8 checkpoints generate as transformers generates when it
loads them, per-tensor, compressed-tensors' and ModelOpt's ones and ``--quantization fp8`` as their dequantized
weights do, and every checkpoint that does not say what it holds is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_engine_model import BLOCK, build_hf_checkpoint, prompts

from benchmarks.kv_quality import greedy_tokens
from engine.capacity import plan, shape_from_dir
from engine.config import EngineConfig, ModelConfig, read_quantization
from engine.engine import Engine
from engine.errors import CheckpointError, UnsupportedModelError
from engine.loader import load_model
from engine.weight_quant import dequantize, row_scales
from kvstore.hashing import salt_for

pytestmark = pytest.mark.timeout(120)

FP8_MAX = 448.0
NEW_TOKENS = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj",
               "w1", "w2", "w3")  # Mixtral's experts' gate, down and up


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def quantize_blocks(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each ``rows x cols`` block's absmax to 448, as the fp8 releases are made: (codes, scale_inv)."""
    r, c = w.shape
    tiles = w.float().reshape(r // rows, rows, c // cols, cols)
    scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(r, c), scale


def compressed_tensors_config(strategy: str) -> dict:
    """llm-compressor's quantization_config for fp8 weights (dynamic per-token activations, as its FP8-dynamic
    scheme writes it; the block scheme with [32, 32] blocks)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "block_structure": [32, 32] if strategy == "block" else None, "group_size": None}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


# layout -> (block rows and columns, None: the whole matrix; scale tensor; quantization_config)
LAYOUTS = {
    "block": ((32, 32), "weight_scale_inv", {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                             "weight_block_size": [32, 32]}),
    "tensor": (None, "weight_scale", {"quant_method": "fp8", "activation_scheme": "static",
                                      "ignored_layers": ["lm_head"]}),
    "compressed_channel": ((1, None), "weight_scale", compressed_tensors_config("channel")),
    "compressed_block": ((32, 32), "weight_scale", compressed_tensors_config("block")),
    # with static K/V scales for an fp8 cache (read past)
    "compressed_kv": ((1, None), "weight_scale", {**compressed_tensors_config("channel"), "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}}),
    # NVIDIA ModelOpt: config.json's flat config; per tensor, per row, per 128 x 128 block
    "modelopt": (None, "weight_scale", {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
                                        "kv_cache_scheme": None}),
    "modelopt_channel": ((1, None), "weight_scale", {"quant_method": "modelopt",
                                                     "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "ignore": ["lm_head"]}),
    "modelopt_block": ((128, 128), "weight_scale", {"quant_method": "modelopt", "quant_algo": "fp8_pb_wo",
                                                    "ignore": ["lm_head"]}),
    # its older hf_quant_config.json beside a config.json without quantization_config, an fp8 cache's K/V scales
    "modelopt_legacy": (None, "weight_scale", {"producer": {"name": "modelopt", "version": "0.19.0"}, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}),
}
# how ModelOpt shapes its per-row ([out]) and block ([out / 128, 1, in / 128, 1]) scales
SCALE_SHAPES = {"modelopt_channel": lambda s: s.flatten(), "modelopt_block": lambda s: s[:, None, :, None]}
# the static K/V scales each layer of these holds
KV_SCALES = {"compressed_kv": ("self_attn.k_scale", "self_attn.v_scale"),
             "modelopt_legacy": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")}


def quantize_checkpoint(path, layout: str, keep: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Rewrites the checkpoint at ``path`` with fp8 projections in one of ``LAYOUTS`` (per tensor: with a
    static input scale beside each, as vLLM's static fp8 checkpoints hold; blocks wider than a matrix cover
    it whole; the projections ``keep`` names left in 16 bits, as an ignore list leaves them); returns each
    quantized projection's dequantized weight."""
    block, scale_name, quantization_config = LAYOUTS[layout]
    tensors = load_file(path / "model.safetensors")
    dequantized = {}
    for name in [n for n in tensors if is_projection(n) and n.removesuffix(".weight") not in keep]:
        w = tensors[name]
        rows, cols = block or w.shape
        rows, cols = min(rows, w.shape[0]), min(cols or w.shape[1], w.shape[1])
        codes, scale = quantize_blocks(w, rows, cols)
        stem = name.removesuffix("weight")
        shaped = SCALE_SHAPES.get(layout, torch.clone)
        tensors[stem + scale_name] = scale.reshape(()) if block is None else shaped(scale)
        if block is None:
            tensors[stem + "input_scale"] = torch.tensor(0.02)
        per_weight = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        tensors[name] = codes
        dequantized[name] = codes.float() * per_weight
    layers = {n.split(".self_attn.")[0] for n in tensors if ".self_attn." in n}
    tensors |= {f"{layer}.{kv}": torch.tensor(0.05) for layer in layers for kv in KV_SCALES.get(layout, ())}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if layout == "modelopt_legacy":
        (path / "hf_quant_config.json").write_text(json.dumps(quantization_config))
        return dequantized
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return dequantized


def rowwise(hf: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """Each projection (transformers' packed experts' too) as --quantization fp8 holds it, dequantized: every
    row's absmax mapped to 448."""
    out = {}
    for name, w in hf.state_dict().items():
        if is_projection(name) or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            scale = w.abs().amax(dim=-1, keepdim=True) / FP8_MAX
            out[name] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return out


def with_weights(hf: transformers.PreTrainedModel, weights: dict[str, torch.Tensor]) -> transformers.PreTrainedModel:
    hf.load_state_dict(weights, strict=False)
    return hf


def reference_tokens(hf: transformers.PreTrainedModel, batch: list[list[int]]) -> list[list[int]]:
    with torch.no_grad():
        return [hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
                for ids in batch]


def projections(engine: Engine) -> list[torch.nn.Module]:
    return [m for name, m in engine.model.named_modules() if name.split(".")[-1] in PROJECTIONS]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_an_fp8_block_checkpoint_generates_as_transformers_loads_it(tmp_path, arch):
    """Qwen3's and DeepSeek's layout: q/k/v (with Qwen2's biases) and gate/up packed into one matrix each,
    their block scales packed row by row (Phi-3's checkpoint packs them itself); transformers dequantizes
    the same files. Only the projections hold codes: one byte a weight."""
    build_hf_checkpoint(tmp_path, arch)
    quantize_checkpoint(tmp_path, "block")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64))
    batch = prompts((5, 17, 40))
    assert greedy_tokens(engine, batch, NEW_TOKENS) == reference_tokens(hf, batch)
    assert {p.weight.dtype for p in projections(engine)} == {torch.float8_e4m3fn}
    assert engine.model.lm_head.weight.dtype == engine.model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("layout", ["tensor", "compressed_channel", "compressed_block", "compressed_kv", "modelopt",
                                    "modelopt_channel", "modelopt_block", "modelopt_legacy"])
def test_per_tensor_compressed_tensors_and_modelopt_checkpoints_run_as_their_dequantized_weights(tmp_path, layout):
    """vLLM's and AutoFP8's layout (one scale a matrix, the static input scales read past: activations stay
    in the model's dtype), llm-compressor's (compressed-tensors: a scale per output row, or per block; static
    K/V scales for an fp8 cache read past too) and NVIDIA ModelOpt's (a scale per tensor, per row as [out], per
    128 x 128 block as [out / 128, 1, in / 128, 1]; its hf_quant_config.json with K/V scales), which transformers
    cannot load without their own packages: the reference is the model with the weights those codes and scales
    stand for. Blocks of 128 split the MLP's 256 rows and columns in two."""
    hf = build_hf_checkpoint(tmp_path, "qwen3", **({"intermediate_size": 256} if layout == "modelopt_block" else {}))
    dequantized = quantize_checkpoint(tmp_path, layout)
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64))
    batch = prompts((9, 33))
    assert greedy_tokens(engine, batch, NEW_TOKENS) == reference_tokens(with_weights(hf, dequantized), batch)


def test_an_fp8_checkpoint_may_leave_projections_in_16_bits(tmp_path):
    """An ignore list beyond the lm_head (here an MLP's gate/up and another layer's o_proj, left 16-bit in
    the files): those run in the model's dtype, the rest as fp8 codes."""
    keep = frozenset({"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.1.self_attn.o_proj"})
    hf = build_hf_checkpoint(tmp_path, "qwen3")
    dequantized = quantize_checkpoint(tmp_path, "compressed_channel", keep)
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64))
    batch = prompts((9, 33))
    assert greedy_tokens(engine, batch, NEW_TOKENS) == reference_tokens(with_weights(hf, dequantized), batch)
    layers = engine.model.model.layers
    assert layers[0].mlp.gate_up_proj.weight.dtype == layers[1].self_attn.o_proj.weight.dtype == torch.float32
    assert layers[0].mlp.down_proj.weight.dtype == layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn


def test_quantization_fp8_quantizes_a_16_bit_checkpoint_row_by_row(tmp_path):
    """--quantization fp8: each projection row's absmax maps to 448 as the checkpoint loads; the tokens are
    those of the model whose weights are quantized and dequantized so, and differ from the unquantized
    model's (the flag does something)."""
    hf = build_hf_checkpoint(tmp_path, "llama")
    batch = prompts((5, 40))
    unquantized = reference_tokens(hf, batch)
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64, quantization="fp8"))
    got = greedy_tokens(engine, batch, NEW_TOKENS)
    assert got == reference_tokens(with_weights(hf, rowwise(hf)), batch)
    assert got != unquantized
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and tuple(qkv.weight_scale.shape) == (qkv.weight.shape[0], 1)


def test_a_block_scale_covers_its_rows_and_columns_when_the_matrix_is_ragged():
    """A [40, 80] weight in [32, 32] blocks has 2 x 3 scales, the last ones covering 8 rows and 16 columns."""
    quant = read_quantization({"quant_method": "fp8", "weight_block_size": [32, 32]})
    assert quant.scale_shape(40, 80) == (2, 3)
    codes = torch.randn(40, 80).mul(50).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    got = dequantize(codes, row_scales(scale, quant, 40), quant.k_block, torch.float32)
    want = torch.stack([torch.stack([codes[r, c].float() * scale[r // 32, c // 32] for c in range(80)])
                        for r in range(40)])
    assert torch.equal(got, want)


def edit_checkpoint(path, drop: str | None = None, to_bf16: str | None = None) -> None:
    tensors = load_file(path / "model.safetensors")
    if drop:
        del tensors[drop]
    if to_bf16:
        tensors[to_bf16] = tensors[to_bf16].float().to(torch.bfloat16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_a_checkpoint_whose_tensors_contradict_its_quantization_config_is_refused_by_name(tmp_path):
    build_hf_checkpoint(tmp_path, "llama")
    quantize_checkpoint(tmp_path, "block")
    config = EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64)
    edit_checkpoint(tmp_path, drop="model.layers.1.mlp.up_proj.weight_scale_inv")
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model.layers.1.mlp.up_proj.weight_scale_inv"):
        Engine(config)
    # a 16-bit weight is a projection left unquantized, which has no scale: the one beside it is refused
    edit_checkpoint(tmp_path, to_bf16="model.layers.0.self_attn.o_proj.weight")
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.weight_scale_inv'"):
        Engine(config)


def test_a_modelopt_file_whose_algorithm_is_refused_is_named(tmp_path):
    build_hf_checkpoint(tmp_path, "llama")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                               "quantization": {"quant_algo": "NVFP4"}}))
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_dir(tmp_path)
    assert err.value.field == "hf_quant_config.json: quantization.quant_algo" and "'NVFP4'" in err.value.message


@pytest.mark.parametrize("quantization_config, field", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization_config.quant_method"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt"),
    ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "quantization_config.weight_block_size"),
    ({**compressed_tensors_config("group")}, "quantization_config.config_groups.weights.strategy"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quantization_config.quant_algo"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "W4A8_AWQ"}},
     "quantization_config.quantization.quant_algo"),
    ({**compressed_tensors_config("channel"), "format": "marlin-24"}, "quantization_config.format"),
])
def test_a_quantization_config_other_than_fp8_e4m3_weights_is_refused_by_field(tmp_path, quantization_config, field):
    build_hf_checkpoint(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_dir(tmp_path)
    assert err.value.field == field


@pytest.mark.parametrize("arch, layout", [("qwen3_moe", "block"), ("mixtral", "block"), ("qwen2_moe", "online"),
                                          ("qwen3_moe", "modelopt")])
def test_a_mixture_of_experts_on_fp8_weights_generates_as_transformers_loads_it(tmp_path, arch, layout):
    """Each expert's matrices (Mixtral's w1/w3/w2 too) packed as fp8 codes with their scales, and Qwen2-MoE's
    shared expert; the routers stay in the model's dtype. A block-wise checkpoint against transformers loading
    the same files, --quantization fp8 and a ModelOpt checkpoint (a scale per expert matrix) against the
    weights they stand for."""
    from test_int_weights import transformers_with

    hf = build_hf_checkpoint(tmp_path, arch)
    if layout == "block":
        quantize_checkpoint(tmp_path, layout)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    elif layout == "modelopt":
        original = load_file(tmp_path / "model.safetensors")
        hf = transformers_with(tmp_path, {**original, **quantize_checkpoint(tmp_path, layout)})
    else:
        hf = with_weights(hf, rowwise(hf))
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64,
                                 quantization="fp8" if layout == "online" else None))
    batch = prompts((9, 33))
    assert greedy_tokens(engine, batch, NEW_TOKENS) == reference_tokens(hf, batch)
    moe = next(layer.mlp for layer in engine.model.model.layers if hasattr(layer.mlp, "experts"))
    assert moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == torch.float8_e4m3fn
    assert moe.gate.weight.dtype == torch.float32


@pytest.mark.parametrize("arch, layout", [("qwen2", "bfloat16"), ("qwen2", "online"), ("qwen2", "block"),
                                          ("qwen2_moe", "online"), ("qwen3_moe", "block")])
def test_kv_calc_weighs_the_weights_as_the_engine_holds_them(tmp_path, arch, layout):
    """tidepool kv-calc's weight bytes (what the KV cache is planned around): fp8 projections and experts one
    byte a weight plus their scales, routers in the model's dtype, tied embeddings once."""
    build_hf_checkpoint(tmp_path, arch)
    if layout == "block":
        quantize_checkpoint(tmp_path, "block")
    quantization = "fp8" if layout == "online" else None
    model, _ = load_model(tmp_path, "bfloat16", "cpu", quantization)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan(shape_from_dir(tmp_path, quantization), "bfloat16", 64, 1, None).weight_bytes == held


def test_blocks_of_weights_quantized_at_load_are_hashed_apart_from_the_checkpoints(tmp_path):
    """--quantization fp8 changes the K/V a prompt gets, so its blocks hash under a salt of their own: a pool
    or disk tier kept across a restart never hands one's blocks to the other. On an fp8 checkpoint the flag
    changes nothing, the salt neither."""
    build_hf_checkpoint(tmp_path / "bf16", "llama")
    plain, online = (Engine(EngineConfig(model=str(tmp_path / "bf16"), block_size=BLOCK, num_blocks=64,
                                         quantization=q)) for q in (None, "fp8"))
    assert online.quantized_at_load == "fp8" and plain.quantized_at_load is None
    assert online.prefix_salt(None) != plain.prefix_salt(None) == salt_for(plain.model_id)
    assert online.block_manager.salt == online.prefix_salt(None)
    build_hf_checkpoint(tmp_path / "fp8", "llama")
    quantize_checkpoint(tmp_path / "fp8", "block")
    checkpoint = Engine(EngineConfig(model=str(tmp_path / "fp8"), block_size=BLOCK, num_blocks=64, quantization="fp8"))
    assert checkpoint.quantized_at_load is None and checkpoint.prefix_salt(None) == salt_for(checkpoint.model_id)


def test_a_lora_adapter_on_fp8_weights_generates_as_peft_does_on_their_dequantized_copy(tmp_path):
    """The adapter's rows add to the fp8 projections' output as to a 16-bit one's, beside the base model."""
    from test_lora import ALL_PROJECTIONS, peft_adapter, reference, run

    build_hf_checkpoint(tmp_path / "base", "llama")
    quantize_checkpoint(tmp_path / "base", "block")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    adapted = peft_adapter(hf, tmp_path / "a", ALL_PROJECTIONS, rank=8, seed=1, lora_alpha=16)
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), block_size=BLOCK, num_blocks=64,
                                 lora_modules={"a": str(tmp_path / "a")}))
    p, q = prompts((21, 9))
    tokens, _ = run(engine, {"base": (p, None), "a": (p, "a"), "a-other": (q, "a")})
    assert tokens == {"base": reference(hf, p), "a": reference(adapted, p), "a-other": reference(adapted, q)}
    assert tokens["a"] != tokens["base"]
