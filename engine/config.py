"""ModelConfig read from a Hugging Face ``config.json``; EngineConfig for the limits an engine runs under.

Only what the Llama-family decoder in ``model.py`` implements is accepted; everything else is refused
with an ``UnsupportedModelError`` that names the field, so a checkpoint never runs with silently
different math.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError, UnsupportedModelError
from engine.kv_format import residual_blocks
from engine.speculative import SpeculativeConfig

# architecture -> (q/k/v projections carry a bias, q/k RMSNorm per head)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "MixtralForCausalLM": (False, False),
    "Phi3ForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Qwen3MoeForCausalLM": (False, True),
    "Gemma3ForCausalLM": (False, True),
    "Gemma3ForConditionalGeneration": (False, True),  # its text part (Gemma 3 4B-27B); images are refused
    "Gemma2ForCausalLM": (False, False),
}
# the base model alone, as some embedding checkpoints name their architecture (e5-mistral's MistralModel): read as
# the causal LM it is the body of (its tensors without the ``model.`` prefix: ModelConfig.base_checkpoint)
BASE_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                      "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# checkpoints whose q/k/v and gate/up matrices are already packed as the model packs them (Phi-3, Phi-4)
PACKED_ARCHITECTURES = ("Phi3ForCausalLM",)
# architectures whose sliding window, when set, covers every layer
SLIDING_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
# Gemma 3: Gemma's norms and GeGLU MLP (ModelConfig.gemma), sliding and full layers by layer_types, each kind
# with its own RoPE; of the multimodal checkpoints, the language model (MULTIMODAL_TEXT_PREFIXES). Gemma 2: the
# same layers, every other one sliding, one RoPE, its logits soft-capped.
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA_ARCHITECTURES = (*GEMMA3_ARCHITECTURES, "Gemma2ForCausalLM")
# transformers' Gemma3TextConfig defaults, which a multimodal Gemma 3 checkpoint's text_config leaves out
# (tests/test_loader.py holds them to transformers')
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "tie_word_embeddings": True}
# A multimodal checkpoint's tensors: its language model's under one of these prefixes (transformers 4.50's
# layout, which save_pretrained writes, and 4.52's model classes'), read as the text model's; the rest (the
# vision tower, the projector) are not loaded
MULTIMODAL_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                            "language_model.lm_head.": "lm_head."}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # EngineConfig.attention_backend
# KV cache formats whose writes never sync with the host, so decode steps can be captured in CUDA graphs
# (fp8's and kivi2's window pools plan on the host)
GRAPH_KV_FORMATS = ("auto", "int8")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# Bytes per element by dtype name; torch dtypes are accepted through their str() ("torch.float16").
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype given by name ("bfloat16", "fp16") or as a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def long_rope_applies(long_rope_from: int | None, num_tokens: int) -> bool:
    """Whether a LongRoPE model (original context ``long_rope_from``; None: not one) rotates a sequence of
    ``num_tokens`` with its long factors, every position: its blocks are then not a shorter sequence's, so
    they are hashed under a salt of their own (``kvstore.hashing.salt_for``), here and in the pool and peers."""
    return long_rope_from is not None and num_tokens > long_rope_from


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def special_token_ids(raw: dict, generation: dict | None) -> tuple[int | None, list[int]]:
    """(bos id, eos ids): generation_config.json wins over config.json (it lists chat EOS ids too)."""
    generation = generation or {}
    eos = _eos_list(generation.get("eos_token_id")) or _eos_list(raw.get("eos_token_id"))
    bos = generation.get("bos_token_id", raw.get("bos_token_id"))
    return (None if bos is None else int(bos)), eos


def _yarn(params: dict, key: str, max_pos: int) -> dict:
    """YaRN's settings as transformers reads them (Qwen2.5/Qwen3 long context, DeepSeek): the factor (default:
    the context over the original one), the original context, the ramp's bounds, and the attention factor
    cos and sin are scaled by (default: 0.1 ln(factor) + 1, or DeepSeek's mscale ratio)."""
    if "original_max_position_embeddings" not in params:
        raise UnsupportedModelError(key, "yarn rope scaling needs original_max_position_embeddings")
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or max_pos / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "attention_factor": float(attention), "beta_fast": float(params.get("beta_fast") or 32),
            "beta_slow": float(params.get("beta_slow") or 1), "truncate": bool(params.get("truncate", True))}


def _rotary_dim(raw: dict, params: dict, key: str, arch: str) -> int:
    """The leading dimensions of each head RoPE rotates: all of them, or the ``partial_rotary_factor`` share
    of them (Phi-4-mini's 0.75), which transformers applies for Phi-3's architecture only."""
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if factor == 1.0:
        return head_dim
    dim = int(head_dim * factor)
    if arch not in PACKED_ARCHITECTURES or dim <= 0 or dim % 2:
        raise UnsupportedModelError(f"{key}.partial_rotary_factor", f"{factor} is supported for Phi-3's "
                                    "architecture only, rotating an even number of dimensions")
    return dim


def _longrope(params: dict, key: str, raw: dict, rotary_dim: int) -> dict:
    """LongRoPE's settings as transformers reads them (Phi-3 128k, Phi-3.5): per-dimension short and long
    frequency divisors, the original context (the model's top-level one in transformers-4 configs) past which
    a sequence takes the long ones, and the attention factor cos and sin are scaled by (default:
    sqrt(1 + ln(factor) / ln(original)), factor being the context over the original one)."""
    max_pos = int(raw.get("max_position_embeddings", 4096))
    original = int(params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
                   or max_pos)
    half = rotary_dim // 2
    factors = {name: [float(f) for f in params.get(name) or ()] for name in ("short_factor", "long_factor")}
    for name, values in factors.items():
        if len(values) != half:
            raise UnsupportedModelError(f"{key}.{name}", f"needs {half} values (rotated dims / 2), got {len(values)}")
    factor = float(params.get("factor") or max_pos / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", **factors, "original_max_position_embeddings": original,
            "attention_factor": float(attention)}


def _rope(raw: dict, arch: str) -> tuple[float, dict | None, int]:
    """(rope_theta, llama3, yarn or longrope scaling or None, the rotated dimensions of a head) from either
    transformers-4 or transformers-5 keys."""
    # transformers 5: rope_parameters = {"rope_type", "rope_theta", ...scaling keys}
    # transformers 4: rope_theta at top level, rope_scaling = {"type" | "rope_type", ...} or null
    params = raw.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = raw.get("rope_scaling"), "rope_scaling"
    params = dict(params or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # LongRoPE's first name, in early Phi-3 configs
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{key}.rope_type", f"{rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    rotary_dim = _rotary_dim(raw, params, key, arch)
    if rope_type == "default":
        return theta, None, rotary_dim
    if rope_type == "linear":  # positions divided by the factor (Gemma 3's full-attention layers past 1B)
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}, rotary_dim
    if rope_type == "yarn":
        return theta, _yarn(params, key, int(raw.get("max_position_embeddings", 4096))), rotary_dim
    if rope_type == "longrope":
        return theta, _longrope(params, key, raw, rotary_dim), rotary_dim
    missing = [k for k in LLAMA3_KEYS if k not in params]
    if missing:
        raise UnsupportedModelError(f"{key}", f"llama3 rope scaling needs {', '.join(missing)}")
    scaling = {"rope_type": "llama3", **{k: float(params[k]) for k in LLAMA3_KEYS}}
    scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return theta, scaling, rotary_dim


def _gemma_rope(raw: dict, arch: str) -> tuple[float, dict | None, int, float]:
    """``_rope``'s result for Gemma 3's full-attention layers, and its sliding layers' own RoPE base (plain RoPE):
    transformers 5 keeps one ``rope_parameters`` entry per layer type, transformers 4 the full layers' in
    ``rope_theta`` / ``rope_scaling`` and the sliding layers' base in ``rope_local_base_freq``."""
    params = raw.get("rope_parameters")
    if params is None or "full_attention" not in params:
        return (*_rope(raw, arch), float(raw.get("rope_local_base_freq", 10000.0)))
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError("rope_parameters.sliding_attention.rope_type",
                                    f"{local['rope_type']!r}: the sliding layers' RoPE must be plain (default)")
    return (*_rope({**raw, "rope_parameters": params["full_attention"]}, arch),
            float(local.get("rope_theta", 10000.0)))


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts in place of the MLP (``engine/moe.py``): each token goes to its ``top_k`` experts
    of ``num_experts``, chosen by a linear router, and sums their SwiGLU outputs scaled by its softmaxed
    router scores."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    layers: tuple[int, ...]  # the layers that have experts; the others have the dense MLP
    renormalize: bool  # top-k scores divided by their sum (Mixtral always; Qwen's norm_topk_prob)
    # Mixtral scales expert outputs by the float32 scores; Qwen casts the scores to the activations' dtype
    # first. The same in float32, a rounding apart in bf16: kept for token parity with transformers.
    float32_scores: bool
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an expert every token also takes, sigmoid-gated


def _moe(arch: str, raw: dict, num_layers: int) -> MoEConfig | None:
    """The experts of a mixture-of-experts checkpoint (transformers' keys and defaults), else None."""
    if arch not in MOE_ARCHITECTURES:
        return None
    experts = int(raw["num_local_experts"] if "num_local_experts" in raw else raw["num_experts"])
    top_k = int(raw["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise UnsupportedModelError("num_experts_per_tok", f"{top_k}: must be in [1, {experts}] (the experts)")
    if arch == "MixtralForCausalLM":
        return MoEConfig(experts, top_k, int(raw["intermediate_size"]), tuple(range(num_layers)),
                         renormalize=True, float32_scores=True)
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise UnsupportedModelError("decoder_sparse_step", f"{step}: must be at least 1")
    dense = set(raw.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(experts, top_k, int(raw["moe_intermediate_size"]), layers,
                     renormalize=bool(raw.get("norm_topk_prob", False)), float32_scores=False,
                     shared_expert_intermediate_size=shared)


QUANTIZATION_METHODS = ("fp8", "w8a8_int8")  # EngineConfig.quantization, --quantization


@dataclass(frozen=True)
class WeightQuant:
    """How a model's projections and experts are stored: fp8 codes and the layout of their scales."""

    k_block: int  # input columns one scale covers; 0: the whole row
    n_block: int  # output rows one checkpoint scale covers; 0: all of them (per tensor), or online
    scale_suffix: str  # the checkpoint tensor beside each ``.weight``; "": computed at load (online)

    @property
    def online(self) -> bool:
        return not self.scale_suffix

    def projection_bytes(self, rows: int, cols: int) -> int:
        """A ``[rows, cols]`` projection as the model holds it: a byte a weight and float32 scales."""
        return rows * cols + 4 * rows * -(-cols // (self.k_block or cols))

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The checkpoint's scale tensor for a ``[rows, cols]`` weight (per tensor: a scalar)."""
        if not self.n_block:
            return ()
        return -(-rows // self.n_block), -(-cols // self.k_block) if self.k_block else 1


ONLINE_FP8 = WeightQuant(k_block=0, n_block=0, scale_suffix="")

INT_LAYOUTS = ("awq", "gptq", "compressed-tensors")
INT_BITS = (4, 8)  # integer code widths: AWQ's 4, GPTQ's and compressed-tensors' 4 or 8


@dataclass(frozen=True)
class IntQuant:
    """How an AWQ, GPTQ or compressed-tensors checkpoint stores its projections: 4- or 8-bit integer codes with
    a scale and a zero point of as many bits per ``group_size`` input columns of each output row, packed eight
    (or four) to an int32, or an int8 each (``engine/int_weights.py``)."""

    layout: str  # one of INT_LAYOUTS: how codes and zeros are packed into the checkpoint's int32 tensors
    group_size: int  # input columns one scale and zero cover; 0: the whole row (GPTQ's group_size -1)
    zero_offset: int = 0  # added to the stored zeros: GPTQ's original format stores each zero minus 1
    zero_points: bool = True  # False: symmetric, no zeros stored (compressed-tensors'): every zero is mid_code
    # GPTQ's desc_act / compressed-tensors' group actorder: a projection's groups are columns scattered in
    # activation order (its g_idx); the model sorts them into place and gathers its input to match
    act_order: bool = False
    bits: int = 4  # one of INT_BITS
    # codes packed into int32 words; False: compressed-tensors' int-quantized format, an int8 a code (W8A8
    # releases: the signed value, mid_code below the code)
    packed: bool = True
    # W8A8 (engine/w8a8.py): each projection's (and expert's) input quantized to int8 a row as it runs, the
    # matmul in integers; the weights held as the checkpoint's int8 values and a scale a row, no zeros. Only
    # symmetric int-quantized weights with one scale a row, as RedHat's w8a8 releases hold them
    int8_activations: bool = False
    online: bool = False  # quantized at load from a 16-bit checkpoint (--quantization w8a8_int8), not read

    def __post_init__(self) -> None:
        """The combinations checkpoints hold: AWQ's codes are 4-bit, unpacked ones (an int8 each) 8-bit; int8
        activations beside symmetric unpacked int8 weights with a scale a row."""
        widths = (4,) if self.layout == "awq" else (8,) if not self.packed else INT_BITS
        unpacked_held = self.packed or self.layout == "compressed-tensors"  # int-quantized's int8 codes
        if self.layout not in INT_LAYOUTS or self.bits not in widths or not unpacked_held:
            raise ValueError(f"{self.layout} {'packed' if self.packed else 'unpacked'} {self.bits}-bit codes are "
                             "not a layout checkpoints hold")
        if self.int8_activations and not self.int8_rows:
            raise ValueError("int8 activations run beside unpacked symmetric int8 weights with a scale a row only")

    @property
    def int8_rows(self) -> bool:
        """Symmetric int8 codes an int8 each with a scale a row: weights an int8 matmul can take as they are."""
        return not (self.packed or self.group_size or self.zero_points or self.act_order)

    @property
    def per_byte(self) -> int:
        """Codes the model packs into a byte (two 4-bit ones, or one)."""
        return 8 // self.bits

    @property
    def per_word(self) -> int:
        """Codes a checkpoint packs into one of its integers: 32 / bits an int32, or one an int8 (unpacked)."""
        return 32 // self.bits if self.packed else 1

    @property
    def mid_code(self) -> int:
        """The zero of a symmetric checkpoint: the codes are the signed values plus this."""
        return 1 << (self.bits - 1)

    def groups(self, cols: int) -> int:
        return cols // self.group_size if self.group_size else 1

    def projection_bytes(self, rows: int, cols: int) -> int:
        """A ``[rows, cols]`` projection as the model holds it: ``bits`` / 8 bytes a weight, a float32 scale and
        a uint8 zero a group (W8A8: no zeros), and with act-order an int64 input order."""
        zero_bytes = 0 if self.int8_activations else 1
        return (rows * cols // self.per_byte + (4 + zero_bytes) * rows * self.groups(cols)
                + (8 * cols if self.act_order else 0))


# --quantization w8a8_int8: a 16-bit checkpoint's projections and experts rounded to int8 a scale a row as they
# load (engine/w8a8.py), held as a w8a8 release's are (compressed-tensors' in-memory form) and run W8A8
ONLINE_W8A8 = IntQuant("compressed-tensors", 0, zero_points=False, bits=8, packed=False, int8_activations=True,
                       online=True)

# how a projection is held: fp8 codes, integer codes, or None (the model's dtype)
Quant = WeightQuant | IntQuant | None


def read_quantization(raw: dict | None) -> Quant:
    """A checkpoint's ``quantization_config`` -> its weight layout (None: not quantized); anything but fp8
    e4m3 weights, 4-bit AWQ and 4- or 8-bit GPTQ or compressed-tensors integer ones is refused, naming what is
    there."""
    if raw is None:
        return None
    key = "quantization_config"
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, key)
    if method == "modelopt":
        return _modelopt(raw, key)
    if method in ("awq", "gptq"):
        return _int_codes(raw, key, method)
    if method != "fp8":
        raise UnsupportedModelError(f"{key}.quant_method", f"{method!r} is not supported; supported: fp8 (block-wise "
                                    "or per tensor), modelopt's fp8, awq 4-bit and gptq 4- or 8-bit weights, "
                                    "compressed-tensors' fp8 and 4- or 8-bit integer weights, or an unquantized "
                                    "checkpoint with --quantization fp8")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedModelError(f"{key}.fmt", f"{raw['fmt']!r} is not supported; fp8 weights must be e4m3")
    if raw.get("scale_fmt") not in (None, "float32"):
        raise UnsupportedModelError(f"{key}.scale_fmt", f"{raw['scale_fmt']!r} is not supported (float32 scales)")
    block = raw.get("weight_block_size")
    if block is None:
        return WeightQuant(k_block=0, n_block=0, scale_suffix="weight_scale")
    return _block_quant(block, f"{key}.weight_block_size", "weight_scale_inv")


# ModelOpt's quant_algo -> its weights' layout: a scale per tensor, per output row, or per 128 x 128 block
_MODELOPT_FP8 = {"FP8": WeightQuant(k_block=0, n_block=0, scale_suffix="weight_scale"),
                 "FP8_PER_CHANNEL_PER_TOKEN": WeightQuant(k_block=0, n_block=1, scale_suffix="weight_scale"),
                 "FP8_PB_WO": WeightQuant(k_block=128, n_block=128, scale_suffix="weight_scale")}


def _modelopt(raw: dict, key: str) -> WeightQuant:
    """NVIDIA ModelOpt's fp8 exports (``quant_method: "modelopt"``, as NVIDIA's ``-FP8`` releases): the config
    nested under ``quantization`` (``hf_quant_config.json``'s shape) or flat (config.json's). Static activation
    scales are read past (W8A16); ``exclude_modules``/``ignore`` may name only what stays 16-bit anyway (the
    lm_head, routers): a projection left unquantized is refused by tensor name as it loads."""
    nested = raw.get("quantization")
    field = f"{key}.quantization.quant_algo" if isinstance(nested, dict) else f"{key}.quant_algo"
    algo = str((nested if isinstance(nested, dict) else raw).get("quant_algo")).upper()
    if algo not in _MODELOPT_FP8:
        raise UnsupportedModelError(field, f"{algo!r} is not supported; supported: {', '.join(_MODELOPT_FP8)} "
                                    "(fp8 e4m3 weights)")
    return _MODELOPT_FP8[algo]


def static_kv_scales(raw: dict | None) -> bool:
    """Whether a ``quantization_config`` says its checkpoint carries static fp8 K/V scales (compressed-tensors'
    ``kv_cache_scheme``, ModelOpt's ``kv_cache_quant_algo``): calibrated for an fp8 cache of one scale a
    layer, they are read past, the cache being ``--kv-cache-dtype``'s with scales of its own."""
    if not raw:
        return False
    nested = raw.get("quantization")
    return bool(raw.get("kv_cache_scheme") or (isinstance(nested, dict) and nested.get("kv_cache_quant_algo")))


def _block_quant(block: Any, field: str, scale_suffix: str) -> WeightQuant:
    """Block-wise scales of ``[rows, columns]`` (the columns a multiple of 16: the kernel's K slices)."""
    if (not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) for b in block)
            or block[0] < 1 or block[1] < 16 or block[1] % 16):
        raise UnsupportedModelError(field, f"{block!r}: must be [rows, columns], the columns a multiple of 16")
    return WeightQuant(k_block=block[1], n_block=block[0], scale_suffix=scale_suffix)


def _int_codes(raw: dict, key: str, method: str) -> IntQuant:
    """AutoAWQ's GEMM format (``quant_method: "awq"``, 4-bit) and GPTQ's (AutoGPTQ, GPTQModel, optimum; both
    ``checkpoint_format``s; 4- or 8-bit): integer weights, zero points and scales per group of input columns."""
    bits = raw.get("bits", raw.get("w_bit"))
    widths = (4,) if method == "awq" else INT_BITS
    if bits not in widths:
        raise UnsupportedModelError(f"{key}.bits", f"{bits!r} is not supported; {method} weights must be "
                                    + " or ".join(f"{b}-bit" for b in widths))
    group = _group_size(raw.get("group_size", raw.get("q_group_size")), f"{key}.group_size")
    if method == "awq":
        if str(raw.get("version", "gemm")).lower() != "gemm":
            raise UnsupportedModelError(f"{key}.version", f"{raw['version']!r} is not supported; supported: gemm "
                                                          "(AutoAWQ's default)")
        if raw.get("zero_point", True) is not True:
            raise UnsupportedModelError(f"{key}.zero_point", "AWQ weights without zero points are not supported")
        return IntQuant("awq", group)
    if raw.get("lm_head"):
        raise UnsupportedModelError(f"{key}.lm_head", "a quantized lm_head is not supported")
    if raw.get("dynamic"):  # GPTQModel's per-module overrides: other bits or groups, or modules left unquantized
        raise UnsupportedModelError(f"{key}.dynamic", "per-module overrides are not supported: every projection "
                                    "must hold the config's bits and group_size")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"{key}.checkpoint_format", f"{fmt!r} is not supported; supported: gptq, "
                                                                "gptq_v2")
    return IntQuant("gptq", group, zero_offset=1 if fmt == "gptq" else 0,
                    act_order=bool(raw.get("desc_act")) and group > 0, bits=bits)


def _group_size(group: Any, field: str) -> int:
    """A group size of input columns: a multiple of 16, or -1 (one group a row, returned as 0)."""
    if not isinstance(group, int) or (group != -1 and (group < 16 or group % 16)):
        raise UnsupportedModelError(field, f"{group!r}: must be a multiple of 16, or -1 (one group a row)")
    return max(group, 0)


def _compressed_tensors(raw: dict, key: str) -> WeightQuant | IntQuant:
    """llm-compressor's format (``quant_method: "compressed-tensors"``, as RedHat's and Neural Magic's
    releases): one config group on the Linear layers, of 8-bit float weights scaled per tensor, per output
    row (``channel``) or per block in ``weight_scale`` (FP8 releases), of 4-bit integers packed eight a word
    (``pack-quantized``: the w4a16 releases, or 8-bit ones four a word: w8a16), or of int8 weights an int8
    each (``int-quantized``: the w8a8 releases). The w8a8 releases' activations, int8 scaled a token as they
    run (``_dynamic_int8_tokens``), run so beside symmetric int8 weights with a scale a row (W8A8,
    ``IntQuant.int8_activations``); every other activation scheme is read past: activations stay in
    ``--dtype`` (W8A16, W4A16)."""
    fmt = raw.get("format")
    if fmt not in ("float-quantized", "naive-quantized", "pack-quantized", "int-quantized"):
        raise UnsupportedModelError(f"{key}.format", f"{fmt!r} is not supported; supported: float-quantized or "
                                    "naive-quantized fp8 weights, pack-quantized 4- or 8-bit integer weights, "
                                    "int-quantized or naive-quantized int8 weights")
    groups = list((raw.get("config_groups") or {}).values())
    if len(groups) != 1 or groups[0].get("targets") != ["Linear"]:
        raise UnsupportedModelError(f"{key}.config_groups", "one group targeting [\"Linear\"] is supported")
    weights = groups[0].get("weights") or {}
    if fmt in ("pack-quantized", "int-quantized") or weights.get("type") == "int":
        quant = _compressed_int(weights, f"{key}.config_groups.weights", packed=fmt == "pack-quantized")
        if quant.int8_rows and _dynamic_int8_tokens(groups[0].get("input_activations")):
            return replace(quant, int8_activations=True)
        return quant
    if (weights.get("num_bits"), weights.get("type"), weights.get("symmetric", True)) != (8, "float", True):
        raise UnsupportedModelError(f"{key}.config_groups.weights", f"{weights!r}: only symmetric 8-bit float "
                                    "(fp8 e4m3) weights are supported")
    strategy = weights.get("strategy")
    if strategy == "tensor":
        return WeightQuant(k_block=0, n_block=0, scale_suffix="weight_scale")
    if strategy == "channel":
        return WeightQuant(k_block=0, n_block=1, scale_suffix="weight_scale")
    if strategy == "block":
        return _block_quant(weights.get("block_structure"), f"{key}.config_groups.weights.block_structure",
                            "weight_scale")
    raise UnsupportedModelError(f"{key}.config_groups.weights.strategy", f"{strategy!r} is not supported; "
                                "supported: tensor, channel, block")


def _compressed_int(weights: dict, field: str, packed: bool) -> IntQuant:
    """compressed-tensors' integer weights, packed (4- or 8-bit) or an int8 each, in groups or per output row
    (``channel``), symmetric (no zero points stored) or not."""
    widths = INT_BITS if packed else (8,)
    if weights.get("type") != "int" or weights.get("num_bits") not in widths:
        raise UnsupportedModelError(field, f"{weights!r}: " + ("pack-quantized weights must be 4- or 8-bit "
                                    "integers" if packed else "int-quantized weights must be 8-bit integers"))
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise UnsupportedModelError(f"{field}.strategy", f"{strategy!r} is not supported; supported: group, channel")
    group = _group_size(weights.get("group_size"), f"{field}.group_size") if strategy == "group" else 0
    # "weight": columns quantized in activation order into groups kept in place (nothing to undo)
    actorder = weights.get("actorder")
    if actorder not in (None, False, "weight", "group", True):
        raise UnsupportedModelError(f"{field}.actorder", f"{actorder!r} is not supported; supported: group, weight")
    return IntQuant("compressed-tensors", group, zero_points=not weights.get("symmetric", True),
                    act_order=actorder in ("group", True) and group > 0, bits=weights["num_bits"], packed=packed)


def _dynamic_int8_tokens(activations: dict | None) -> bool:
    """compressed-tensors' activation scheme of the w8a8 releases: symmetric 8-bit integers, a scale a token
    computed as they run."""
    return bool(activations) and (activations.get("num_bits"), activations.get("type"),
                                  activations.get("symmetric", True), activations.get("dynamic"),
                                  activations.get("strategy")) == (8, "int", True, True, "token")


def _sliding_windows(arch: str, raw: dict, num_layers: int, max_pos: int) -> tuple[int | None, tuple[int, ...] | None]:
    """(the window every layer attends within, each layer's window when they differ: 0 for a full-attention
    layer), or (None, None) for full attention (none set, or one at least as long as the context, which
    changes nothing). Mistral, Mixtral and Phi-3 slide in every layer; Qwen's optional window
    (``use_sliding_window``) and Gemma 3's cover the layers ``_sliding_layers`` names."""
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", arch in SLIDING_ARCHITECTURES + GEMMA_ARCHITECTURES)
    if not uses_window or window is None or int(window) >= max_pos:
        return None, None
    if not int(window) > 0:
        raise UnsupportedModelError("sliding_window", f"{window}: must be a positive number of tokens or null")
    if arch in SLIDING_ARCHITECTURES:
        return int(window), None
    windows = tuple(int(window) if slides else 0 for slides in _sliding_layers(arch, raw, num_layers))
    if all(windows):  # every layer slides: the engine's own window, as Mistral's
        return int(window), None
    return None, windows if any(windows) else None


def _sliding_layers(arch: str, raw: dict, num_layers: int) -> list[bool]:
    """Which layers of a Qwen model with ``use_sliding_window``, or of Gemma 3, slide, as transformers decides:
    every one for Qwen3-MoE; else the ``layer_types`` the config lists, or, without it, each variant's rule:
    for Gemma every layer but each ``sliding_window_pattern``-th (default 6 for Gemma 3, 2 for Gemma 2), for the others over
    ``max_window_layers`` (transformers' default 28): Qwen2 and Qwen3 from that layer on, Qwen2-MoE every
    other layer below it."""
    if arch == "Qwen3MoeForCausalLM":
        return [True] * num_layers
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise UnsupportedModelError("layer_types", f"{types!r}: one of 'sliding_attention' or 'full_attention' "
                                                       f"for each of the {num_layers} layers")
        return [kind == "sliding_attention" for kind in types]
    if arch in GEMMA_ARCHITECTURES:
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
                      or (6 if arch in GEMMA3_ARCHITECTURES else 2))
        return [(i + 1) % pattern != 0 for i in range(num_layers)]
    limit = int(raw.get("max_window_layers", 28))
    if arch == "Qwen2MoeForCausalLM":
        return [i % 2 == 0 and i < limit for i in range(num_layers)]
    return [i >= limit for i in range(num_layers)]


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "yarn" | "longrope", ...} (``_rope``); None: plain
    rotary_dim: int | None = None  # the leading dims of a head RoPE rotates (Phi-4-mini's 3/4); None: head_dim
    rms_norm_eps: float = 1e-6
    # Gemma 3's layers: RMSNorm scales by 1 + weight, in float32 before the cast back (the loader stores the
    # 1 + weight, in float32); embeddings times sqrt(hidden_size); each sublayer's output normed before its
    # residual add (post_attention_layernorm, post_feedforward_layernorm; pre_feedforward_layernorm before the
    # MLP); a GeGLU MLP (tanh-approximated GELU)
    gemma: bool = False
    attention_scale: float | None = None  # softmax scale (Gemma's query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    local_rope_theta: float | None = None  # Gemma 3's sliding layers' RoPE base (plain RoPE); None: every layer's rope_theta
    # Gemma's soft-capping (Gemma 2's, optional in Gemma 3): each attention score, and each logit, becomes
    # cap * tanh(x / cap); None: none
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2); o_proj never has one here
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    moe: MoEConfig | None = None  # Mixtral, Qwen2-MoE, Qwen3-MoE; None: every layer has the dense MLP
    # The checkpoint holds the base model alone (transformers' ``*Model``, its tensors without the ``model.``
    # prefix), as embedding models ship (Qwen3-Embedding): no LM head, so its logits come from the tied embedding
    # matrix; ``generates`` False when the config unties them (that head is not the model's): embeddings only
    base_checkpoint: bool = False
    generates: bool = True
    # Mistral's (v0.1), Mixtral's and Phi-3's sliding-window attention: every layer's query sees the last W
    # tokens, itself included; None: full attention. The engine runs it as its attention window without sinks.
    sliding_window: int | None = None
    # Qwen's use_sliding_window when only some layers slide: each layer's window (0: full attention). Every
    # block stays (the full layers read it); the sliding layers' attention is masked to their window.
    layer_windows: tuple[int, ...] | None = None
    # fp8 projections and experts (engine/weight_quant.py): the checkpoint's quantization_config, or set by
    # with_quantization for --quantization fp8; 4- or 8-bit integer projections of an AWQ, GPTQ or compressed-tensors
    # checkpoint (engine/int_weights.py); None: every weight in the engine's dtype
    weight_quant: Quant = None
    static_kv_scales: bool = False  # the checkpoint's K/V scales for an fp8 cache, read past (static_kv_scales())
    # the model's projections (``model.layers.3.mlp.down_proj``, ``model.layers.1.mlp.experts``) a quantized
    # checkpoint leaves in 16 bits (its ignore / modules_to_not_convert lists), found by the loader in its tensors
    unquantized: frozenset[str] = frozenset()

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE's original context: every position of a sequence longer than it rotates with the long
        factors (``long_rope_applies``; None: not a LongRoPE model)."""
        s = self.rope_scaling
        return s["original_max_position_embeddings"] if s and s["rope_type"] == "longrope" else None

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = BASE_ARCHITECTURES.get(archs[0], archs[0]) if len(archs) == 1 else None
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                "architectures", f"{archs!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
        if arch == "Gemma3ForConditionalGeneration":  # the language model's config, the checkpoint's special tokens
            top = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "quantization_config")
                   if k in raw}
            raw = {**GEMMA3_TEXT_DEFAULTS, **(raw.get("text_config") or {}), **top}
            raw.pop("final_logit_softcapping", None)  # some configs set it; this model class never applies it
        qkv_bias, qk_norm = ARCHITECTURES[arch]
        gemma = arch in GEMMA_ARCHITECTURES
        act_key = "hidden_activation" if gemma and "hidden_activation" in raw else "hidden_act"
        act, supported_act = raw.get(act_key), "gelu_pytorch_tanh" if gemma else "silu"
        if act not in (None, supported_act):
            raise UnsupportedModelError(act_key, f"{act!r}; only {supported_act!r} is supported for {arch}")
        softcaps = {key: raw.get(key) for key in ("attn_logit_softcapping", "final_logit_softcapping")}
        for key, cap in softcaps.items():
            if cap is not None and (not gemma or not isinstance(cap, int | float) or cap <= 0):
                raise UnsupportedModelError(key, f"{cap!r}: logit soft-capping is Gemma's, a cap > 0")
        if raw.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias", "MLP biases are not supported")
        if not arch.startswith("Qwen2") and raw.get("attention_bias"):
            raise UnsupportedModelError("attention_bias", f"attention biases are not supported for {arch}")
        max_pos = int(raw.get("max_position_embeddings", 4096))
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedModelError("num_key_value_heads", f"{kv_heads} does not divide {heads} heads")
        num_layers = int(raw["num_hidden_layers"])
        sliding_window, layer_windows = _sliding_windows(arch, raw, num_layers, max_pos)
        theta, scaling, rotary_dim, local_theta = (_gemma_rope(raw, arch) if arch in GEMMA3_ARCHITECTURES
                                                   else (*_rope(raw, arch), None))
        head_dim = int(raw.get("head_dim") or hidden // heads)
        scalar = raw.get("query_pre_attn_scalar") if gemma else None
        bos, eos = special_token_ids(raw, generation)
        config = cls(
            architecture=arch, vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]), num_layers=num_layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            gemma=gemma, attention_scale=None if scalar is None else float(scalar) ** -0.5, local_rope_theta=local_theta,
            **{key: None if cap is None else float(cap) for key, cap in softcaps.items()},
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)), attention_bias=qkv_bias,
            qk_norm=qk_norm, max_position_embeddings=max_pos,
            bos_token_id=bos, eos_token_ids=eos, moe=_moe(arch, raw, num_layers), sliding_window=sliding_window,
            layer_windows=layer_windows, weight_quant=read_quantization(raw.get("quantization_config")),
            static_kv_scales=static_kv_scales(raw.get("quantization_config")),
        )
        if isinstance(config.weight_quant, IntQuant):
            config.check_int_shapes()
        return config

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` for EOS ids when present, and ModelOpt's
        ``hf_quant_config.json`` as the quantization_config of a config.json that has none)."""
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{file}: not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{file}: not a JSON object")
        modelopt = read_json(file.with_name("hf_quant_config.json"))
        from_modelopt = "quantization_config" not in raw and isinstance(modelopt, dict)
        if from_modelopt:
            raw = {**raw, "quantization_config": {"quant_method": "modelopt", **modelopt}}
        try:
            return cls.from_dict(raw, read_json(file.with_name("generation_config.json")))
        except UnsupportedModelError as exc:  # name the file a refused quantization field is in
            if from_modelopt and exc.field.startswith("quantization_config."):
                raise UnsupportedModelError(exc.field.replace("quantization_config.", "hf_quant_config.json: ", 1),
                                            exc.message) from None
            raise
        except KeyError as exc:
            raise CheckpointError(f"{file}: required key {exc} is missing") from exc
        except TypeError as exc:  # e.g. null where a number belongs
            raise CheckpointError(f"{file}: a value has the wrong type: {exc}") from exc

    def kv_bytes_per_token(self, dtype: Any) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element (DESIGN.md section 3)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    def num_parameters(self) -> int:
        """Parameter count implied by the config (weights memory in the capacity planner)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        norms = (4 if self.gemma else 2) * h + (2 * self.head_dim if self.qk_norm else 0)  # Gemma's sandwich norms
        dense_mlp = 3 * h * self.intermediate_size
        mlps = self.num_layers * dense_mlp
        if (moe := self.moe) is not None:  # every expert's weights are held, whichever ones a token takes
            shared = 3 * h * moe.shared_expert_intermediate_size + h if moe.shared_expert_intermediate_size else 0
            sparse = moe.num_experts * (3 * h * moe.intermediate_size + h) + shared  # + h: the router's row
            mlps += len(moe.layers) * (sparse - dense_mlp)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + norms) + mlps + embed + h

    def quant_for(self, module: str) -> Quant:
        """How the projection ``module`` (the model's name for it) is held: the checkpoint's quantization, or
        None where the checkpoint left it in 16 bits."""
        return None if module in self.unquantized else self.weight_quant

    def with_quantization(self, quantization: str | None) -> ModelConfig:
        """This config as ``--quantization`` loads it: a 16-bit checkpoint's projections quantized to fp8
        (``ONLINE_FP8``) or to int8 run W8A8 (``ONLINE_W8A8``); an fp8 checkpoint with fp8, or no quantization,
        unchanged; any other quantized checkpoint is refused."""
        quant = self.weight_quant
        if quantization is None or (quantization == "fp8" and isinstance(quant, WeightQuant)):
            return self
        if isinstance(quant, IntQuant):
            raise UnsupportedModelError("quantization_config", f"this checkpoint holds {quant.layout} "
                                        f"{quant.bits}-bit weights already; load it without "
                                        f"--quantization {quantization}")
        if quant is not None:
            raise UnsupportedModelError("quantization_config", "this checkpoint holds fp8 weights already; load it "
                                        f"without --quantization {quantization}")
        return replace(self, weight_quant=ONLINE_FP8 if quantization == "fp8" else ONLINE_W8A8)

    def check_drafts_for(self, target: ModelConfig, name: str) -> None:
        """ValueError when this draft model (``name``: how the user named it) has another vocabulary than
        ``target``: its token ids would mean other tokens."""
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"the speculative model {name!r} has a vocabulary of {self.vocab_size} tokens and the "
                             f"model {target.vocab_size}: a draft model must share the model's tokenizer")

    def check_int_shapes(self) -> None:
        """Integer checkpoints pack 8 (or 4) codes to an int32 along one dimension and group the input columns:
        every projection's rows and columns must split so."""
        quant = self.weight_quant
        for out, inp, _ in self.projection_shapes():
            if out % quant.per_word or inp % quant.per_word or (quant.group_size and inp % quant.group_size):
                raise UnsupportedModelError("quantization_config.group_size", f"a [{out}, {inp}] projection does not "
                                            f"split into {quant.per_word}-code words and groups of "
                                            f"{quant.group_size or inp}")

    def projection_shapes(self) -> list[tuple[int, int, int]]:
        """(out, in, how many) of the model's packed projections, what fp8 quantizes: every layer's q/k/v and
        o, the dense MLPs' gate/up and down, each expert's, and a shared expert's (not the routers)."""
        h, q, kv, layers = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.num_layers
        sparse = 0 if self.moe is None else len(self.moe.layers)
        shapes = [(q + 2 * kv, h, layers), (h, q, layers), (2 * self.intermediate_size, h, layers - sparse),
                  (h, self.intermediate_size, layers - sparse)]
        if (moe := self.moe) is not None:
            shapes += [(2 * moe.intermediate_size, h, sparse * moe.num_experts),
                       (h, moe.intermediate_size, sparse * moe.num_experts)]
            if shared := moe.shared_expert_intermediate_size:
                shapes += [(2 * shared, h, sparse), (h, shared, sparse)]
        return shapes

    def weight_bytes(self, dtype: Any) -> int:
        """Bytes the weights take in ``dtype``, the projections as their quantization holds them when they are
        fp8 or integers (``projection_bytes``: codes and scales)."""
        total = self.num_parameters() * dtype_bytes(dtype)
        if self.weight_quant is None:
            return total
        for out, inp, count in self.projection_shapes():
            total -= count * (out * inp * dtype_bytes(dtype) - self.weight_quant.projection_bytes(out, inp))
        return total


TINY = "tiny"  # the built-in model's name (engine/tiny.py writes it on first use)
DEFAULT_MAX_LEN = 1 << 20  # longest sequence of a windowed engine without an explicit max_model_len


@dataclass
class EngineConfig:
    model: str  # "tiny" or a checkpoint directory
    # A directory holding the model's tokenizer (tokenizer.json, tokenizer_config.json) when the checkpoint's
    # own has none (vLLM's --tokenizer); None: the checkpoint's
    tokenizer: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    # "fp8": a 16-bit checkpoint's projections and experts quantized at load (engine/weight_quant.py), one
    # scale per output row; "w8a8_int8": to int8 the same way, run W8A8 (engine/w8a8.py); None: as the
    # checkpoint holds them (an fp8 checkpoint is read as fp8 either way)
    quantization: str | None = None
    block_size: int = 16
    num_blocks: int | None = None  # None: from gpu_memory_utilization on CUDA, else from kv_cache_bytes
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings (with kv_window: 1M tokens)
    enable_prefix_caching: bool = True
    enable_block_events: bool = False  # queue BlockStored/BlockRemoved for take_block_events (pool workers)
    kv_cache_dtype: str = "auto"  # auto (= dtype) | int8 | fp8 | kivi2: the KV cache format (engine/kv_format.py)
    # fp8, kivi2: full blocks each sequence keeps in the attention dtype behind the one it fills (KIVI's
    # residual); None: the format's default (kv_format.RESIDUAL_BLOCKS). ``residual_blocks`` resolves it.
    kv_residual_blocks: int | None = None
    # Attention sinks + sliding window (engine/streaming_window.py): each query sees the first kv_sinks tokens
    # and the kv_window most recent ones; None: full attention.
    kv_window: int | None = None
    kv_sinks: int = 0
    # auto | torch | triton (engine/triton_attention.py). auto: triton on CUDA when triton imports and there
    # are no kv_sinks; torch (gather + SDPA) otherwise, e.g. on CPU.
    attention_backend: str = "auto"
    # On CUDA with num_blocks None: the fraction of device memory for weights, activations and the KV cache,
    # which gets what is left after a profiling pass (engine/device_memory.py); kv_cache_bytes is for CPU.
    gpu_memory_utilization: float = 0.9
    # Decode-only steps (and steps verifying drafts) replay CUDA graphs (engine/cuda_graphs.py) on CUDA with
    # the triton backend and a GRAPH_KV_FORMATS cache; True: every step runs eagerly.
    enforce_eager: bool = False
    # Async scheduling (vLLM's --async-scheduling, SGLang's overlap scheduler): a step's forward pass is launched
    # before the last one's sampled tokens reach the host, which appends, detokenizes and checks them for a stop
    # while the device computes, then samples. A sequence then computes one position past its stop, not sampled.
    # Steps of sequences collecting prompt logprobs, of a request's prompt forking into n > 1 samples or of a
    # prefill-only hand-off, and engines that speculate or serve a LongRoPE model, run synchronously.
    async_scheduling: bool = False
    # A decode reservation (Engine.reserve_blocks) leaves each running sequence, and each lease still waiting
    # for its K/V, the blocks to grow this many more tokens (never past its max_tokens). More means fewer
    # preemptions, each of which recomputes a prompt on a decode worker, and fewer sequences admitted
    # (SGLang's num_reserved_decode_tokens).
    num_reserved_decode_tokens: int = 16
    # Speculative decoding by n-gram prompt lookup (engine/speculative.py): the most draft tokens a decoding
    # sequence proposes per step (0: off), from an earlier occurrence of its last prompt_lookup_max ..
    # prompt_lookup_min tokens (or from speculative_model).
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_disable_by_batch_size: int | None = None  # no drafts while more sequences run; None: always
    # A draft model instead (engine/draft_model.py): a checkpoint directory (or "tiny") with the model's
    # vocabulary, proposing num_speculative_tokens tokens sampled as the request samples
    speculative_model: str | None = None
    # LoRA adapters served beside the base model (engine/lora.py): name -> PEFT adapter directory
    lora_modules: dict[str, str] = field(default_factory=dict)
    # The adapter slots allocated at start (engine/lora_slots.py, vLLM's flags): how many adapters a step can
    # run at once (None: as many as lora_modules names; 0: none) and their largest rank (None: 16, or the
    # largest of lora_modules' adapters); and how many adapters may be loaded (kept in host memory, swapped
    # into the slots as their sequences run; None: max_loras, or more when lora_modules names more)
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {self.attention_backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.attention_backend == "triton" and self.kv_sinks:
            raise ValueError(f"attention_backend 'triton' has no attention sinks (got kv_sinks {self.kv_sinks}); "
                             "use attention_backend 'torch' (a sliding window without sinks runs on either)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_window is None and self.kv_sinks:
            raise ValueError("kv_sinks needs kv_window (sinks are kept next to a sliding window)")
        if self.kv_window is not None and (self.kv_window < 1 or self.kv_sinks < 0):
            raise ValueError(f"kv_window must be >= 1 and kv_sinks >= 0, got {self.kv_window} and {self.kv_sinks}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization {self.quantization!r} is not supported; supported: "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        residual_blocks(self.kv_cache_dtype, self.kv_residual_blocks)  # refuses an unknown dtype or a bad count
        if self.max_loras is not None and self.max_loras < (1 if self.lora_modules else 0):
            raise ValueError(f"max_loras must be at least 1 to serve lora_modules (0: no LoRA), got {self.max_loras}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < max(len(self.lora_modules), self.max_loras or 1):
            raise ValueError(f"max_cpu_loras must be at least max_loras and the number of lora_modules, got "
                             f"{self.max_cpu_loras}")
        if self.num_reserved_decode_tokens < 0:
            raise ValueError(f"num_reserved_decode_tokens must be >= 0, got {self.num_reserved_decode_tokens}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0 (0: off), got {self.num_speculative_tokens}")
        _ = self.speculative  # refuses prompt lookup lengths that contradict each other
        if self.speculative_model is not None and not self.num_speculative_tokens:
            raise ValueError("speculative_model needs num_speculative_tokens (how many tokens the draft proposes)")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative decoding settings; None when it is off."""
        if not self.num_speculative_tokens:
            return None
        return SpeculativeConfig(self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max,
                                 self.speculative_disable_by_batch_size)

    def max_model_len_for(self, model: ModelConfig) -> int:
        """The longest sequence (prompt and output) the engine takes: ``max_model_len``, or the model's context
        (a streaming window, kv_window, lets sequences outgrow it: up to DEFAULT_MAX_LEN); ValueError when
        max_model_len is outside 2 .. that (a model's own sliding window changes nothing)."""
        context = model.max_position_embeddings if self.kv_window is None else DEFAULT_MAX_LEN
        if self.max_model_len is not None and not 1 < self.max_model_len <= context:
            raise ValueError(f"max_model_len {self.max_model_len} must be between 2 and the model's context, "
                             f"{context} tokens" + (" (max_position_embeddings)" if self.kv_window is None else ""))
        return self.max_model_len or context

    @property
    def residual_blocks(self) -> int:
        """Full blocks each sequence keeps in windows (0 unless the KV cache dtype is windowed)."""
        return residual_blocks(self.kv_cache_dtype, self.kv_residual_blocks)
