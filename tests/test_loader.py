"""Config parsing (both RoPE config forms, mixtures of experts, refusals) and checkpoint loading (sharded,
bad checkpoints)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, MoEConfig, UnsupportedModelError
from engine.errors import CheckpointError
from engine.loader import load_model, model_id_for, resolve_model_dir

pytestmark = pytest.mark.timeout(60)

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256}
QWEN_MOE = {**BASE, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def save_hf(path, **overrides) -> None:
    config = transformers.LlamaConfig(**{**{k: v for k, v in BASE.items() if k != "architectures"},
                                         **overrides})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="100KB")


def test_llama3_rope_scaling_reads_the_same_from_transformers_4_and_5_keys():
    v4 = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    v4_old = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}})
    v5 = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}})
    assert v4 == v4_old == v5
    assert v5.rope_theta == 500000.0 and v5.rope_scaling["factor"] == 8.0
    assert v5.head_dim == 16 and v5.num_kv_heads == 2


# google/gemma-3-1b-it's config.json (transformers 4.50 keys), but for the vocabulary's size
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
             "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
             "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
             "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
             "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 1024}


def test_gemma3_reads_the_same_from_transformers_4_and_5_keys():
    """Every sixth layer attends to everything, the others to their last 512 positions on RoPE of base 10,000;
    the full layers on base 1,000,000 (and a linear scaling, as the larger Gemma 3 models have it); the
    embeddings are tied (transformers' default for Gemma 3)."""
    v4 = ModelConfig.from_dict({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    capped = ModelConfig.from_dict({**GEMMA3_1B, "attn_logit_softcapping": 50, "final_logit_softcapping": 30.0})
    assert (capped.attn_logit_softcapping, capped.final_logit_softcapping) == (50.0, 30.0)
    assert (v4.attn_logit_softcapping, v4.final_logit_softcapping) == (None, None)
    v5 = ModelConfig.from_dict({
        **{k: v for k, v in GEMMA3_1B.items() if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq",
                                                          "sliding_window_pattern")},
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}})
    assert v4 == v5
    assert v5.layer_windows == ((512,) * 5 + (0,)) * 4 + (512, 512) and v5.sliding_window is None
    assert (v5.rope_theta, v5.rope_scaling, v5.local_rope_theta) == (1e6, {"rope_type": "linear", "factor": 8.0}, 1e4)
    assert v5.gemma and v5.qk_norm and v5.tie_word_embeddings and v5.attention_scale == 1 / 16 and v5.head_dim == 256


def test_a_multimodal_gemma3_config_is_read_as_its_language_model_with_transformers_defaults():
    """google/gemma-3-4b-it's config.json names few text fields; transformers' Gemma3TextConfig defaults fill
    the rest (ours are held to its), and the checkpoint's own special tokens win over the text config's."""
    from engine.config import GEMMA3_TEXT_DEFAULTS

    defaults = transformers.Gemma3TextConfig()
    pattern = defaults.layer_types.index("full_attention") + 1
    rope = defaults.rope_parameters
    theirs = {**{k: getattr(defaults, k) for k in GEMMA3_TEXT_DEFAULTS if hasattr(defaults, k)},
              "sliding_window_pattern": pattern, "rope_theta": rope["full_attention"]["rope_theta"],
              "rope_local_base_freq": rope["sliding_attention"]["rope_theta"]}
    assert theirs == GEMMA3_TEXT_DEFAULTS
    cfg = ModelConfig.from_dict({
        "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024,
                        # (transformers' Gemma3ForConditionalGeneration never soft-caps its logits)
                        "final_logit_softcapping": 30.0},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}})
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2560, 34, 8, 4, 256)
    assert cfg.layer_windows == ((1024,) * 5 + (0,)) * 5 + (1024,) * 4 and cfg.eos_token_ids == [1, 106]
    assert (cfg.rope_scaling, cfg.local_rope_theta, cfg.vocab_size) == ({"rope_type": "linear", "factor": 8.0}, 1e4, 262208)
    assert cfg.gemma and cfg.tie_word_embeddings and cfg.attention_scale == 1 / 16


@pytest.mark.parametrize("overrides, field", [
    ({"final_logit_softcapping": 0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping"),
    ({**BASE, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),  # Gemma's only
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention.rope_type"),
])
def test_what_gemma_support_leaves_out_is_refused_naming_the_field(overrides, field):
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_dict({**GEMMA3_1B, **overrides})
    assert err.value.field == field and field in str(err.value)


def test_gemma2_reads_every_other_layer_sliding_on_one_rope_with_its_soft_caps():
    """google/gemma-2-2b-it's config.json (transformers 4.42 keys: no layer_types, the even layers slide)."""
    cfg = ModelConfig.from_dict({
        "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8,
        "num_hidden_layers": 26, "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 256000})
    assert cfg.layer_windows == (4096, 0) * 13 and cfg.local_rope_theta is None and not cfg.qk_norm
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.attention_scale) == (50.0, 30.0, 1 / 16)
    assert cfg.gemma and cfg.tie_word_embeddings and cfg.rope_theta == 10000.0


def test_yarn_reads_the_same_from_transformers_4_and_5_keys_with_its_defaults():
    """Qwen's documented long-context setting (transformers 4 keys) and the same in transformers 5's."""
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768}
    v4 = ModelConfig.from_dict({**BASE, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", **yarn}})
    v5 = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **yarn}})
    assert v4 == v5 and v5.rope_theta == 1e6
    assert v5.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                               "attention_factor": pytest.approx(0.1 * math.log(4.0) + 1), "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": True}


def test_eos_ids_prefer_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2, "bos_token_id": 1}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.eos_token_ids == [2, 7] and cfg.bos_token_id == 1


@pytest.mark.parametrize("overrides, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling.short_factor"),  # no factors
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),  # no original context
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 128,
      "layer_types": ["sliding_attention"]}, "layer_types"),  # one entry for two layers
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"partial_rotary_factor": 0.5}, "rope_scaling.partial_rotary_factor"),  # Phi-3's architecture only
    ({**QWEN_MOE, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({**QWEN_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step"),
])
def test_unsupported_config_is_refused_naming_the_field(overrides, field):
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_dict({**BASE, **overrides})
    assert err.value.field == field and field in str(err.value)


def test_experts_are_read_with_transformers_keys_and_defaults():
    """Which layers are sparse (Qwen's decoder_sparse_step and mlp_only_layers; every layer of Mixtral's),
    how scores are normalized, and the shared expert (Qwen2-MoE's only); dense models have none."""
    qwen2 = ModelConfig.from_dict({**QWEN_MOE, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                   "mlp_only_layers": [3], "shared_expert_intermediate_size": 48})
    assert qwen2.moe == MoEConfig(4, 2, 32, (1, 5), renormalize=False, float32_scores=False,
                                  shared_expert_intermediate_size=48)
    qwen3 = ModelConfig.from_dict({**QWEN_MOE, "architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 8,
                                   "norm_topk_prob": True, "shared_expert_intermediate_size": 48})
    assert qwen3.moe == MoEConfig(8, 2, 32, (0, 1), renormalize=True, float32_scores=False) and qwen3.qk_norm
    mixtral = ModelConfig.from_dict({**BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                     "num_experts_per_tok": 2, "sliding_window": None})
    assert mixtral.moe == MoEConfig(8, 2, 128, (0, 1), renormalize=True, float32_scores=True)
    assert ModelConfig.from_dict(BASE).moe is None


def test_missing_expert_tensor_names_it_as_the_checkpoint_does(tmp_path):
    """Mixtral's per-expert tensors (block_sparse_moe.experts.E.w1/w2/w3) are packed into the model's
    expert matrices; one missing is named."""
    config = transformers.MixtralConfig(**{k: v for k, v in BASE.items() if k != "architectures"},
                                        num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path)
    load_model(tmp_path, "float32", "cpu")  # whole, it loads
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name):
        load_model(tmp_path, "float32", "cpu")


def test_sliding_window_covering_the_context_or_disabled_is_full_attention_and_a_shorter_one_is_read():
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 256})
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
                                   "use_sliding_window": False})
    assert mistral.architecture == "MistralForCausalLM" and qwen2.attention_bias
    assert mistral.sliding_window is None and qwen2.sliding_window is None
    v01 = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 128})
    assert v01.sliding_window == 128  # Mistral-7B-v0.1's kind: 4,096 of 32,768


def test_sharded_checkpoint_loads_and_matches_transformers(tmp_path):
    save_hf(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    model, cfg = load_model(tmp_path, "float32", "cpu")
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    q = ref.model.layers[1].self_attn.q_proj.weight
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight[:q.shape[0]], q)
    assert cfg.num_layers == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_weights(tmp_path, dtype):
    save_hf(tmp_path)
    model, _ = load_model(tmp_path, dtype, "cpu")
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}


def test_missing_shard_names_the_file(tmp_path):
    save_hf(tmp_path)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(tmp_path, "float32", "cpu")


def test_wrong_shape_names_the_tensor(tmp_path):
    save_hf(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    shard = tmp_path / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name][:, :32].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*{name}.*\(128, 32\)"):
        load_model(tmp_path, "float32", "cpu")


def test_missing_tensor_names_the_tensor(tmp_path):
    save_hf(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = tmp_path / index["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name):
        load_model(tmp_path, "float32", "cpu")


def test_unsupported_architecture_checkpoint_is_refused(tmp_path):
    save_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="architectures.*FalconForCausalLM"):
        load_model(tmp_path, "float32", "cpu")


def test_not_a_checkpoint_dir_and_model_ids(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        resolve_model_dir(str(tmp_path / "nope"))
    assert model_id_for("tiny") == "tiny"
    assert model_id_for(str(tmp_path / "my-model")) == "my-model"
