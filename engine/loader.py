"""Safetensors checkpoint (single file or sharded) -> CausalLM; the built-in ``tiny`` model.

Every tensor is checked against the shape the config implies before it is copied in, and every
expected tensor must be present, so a bad checkpoint fails with the file or tensor named instead of
producing garbage. q/k/v and gate/up are packed into the model's fused matrices here (Phi-3's checkpoints
hold them packed already), and so are the experts of a mixture of experts (one checkpoint tensor per expert
and matrix, as published).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import MULTIMODAL_TEXT_PREFIXES, PACKED_ARCHITECTURES, TINY, IntQuant, ModelConfig, Quant
from engine.errors import CheckpointError
from engine.int_weights import (
    act_order_perm,
    check_g_idx,
    check_weight_shape,
    codes_from_checkpoint,
    scales_from_checkpoint,
    sort_columns,
    zeros_from_checkpoint,
)
from engine.model import CausalLM, Linear, SparseMoE
from engine.tiny import write_tiny_checkpoint
from engine.w8a8 import quantize_int8_rows
from engine.weight_quant import quantize_rows, row_scales

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    return Path(os.environ.get("TIDEPOOL_CACHE_DIR") or Path.home() / ".cache" / "tidepool")


def resolve_model_dir(model: str) -> Path:
    """``tiny`` -> the built-in checkpoint (written on first use); anything else must be a directory."""
    if model == TINY:
        path = cache_dir() / TINY
        if not (path / "config.json").exists():
            write_tiny_checkpoint(path)
        return path
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path / 'config.json'}: not found (model must be 'tiny' or a checkpoint dir)")
    return path


def model_id_for(model: str) -> str:
    """The id used as block-hash salt: ``tiny`` for the built-in model, else the directory name."""
    return TINY if model == TINY else Path(model).expanduser().resolve().name


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{single}: not found (and no model.safetensors.index.json)")
    return [single]


# Mixtral names a layer's experts block_sparse_moe and their gate, up and down matrices w1, w3 and w2
MIXTRAL_EXPERT_NAMES = {"mlp.": "block_sparse_moe.", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _expert_targets(name: str, param: torch.Tensor, cfg: ModelConfig, columns: bool = False
                    ) -> dict[str, torch.Tensor]:
    """Checkpoint names of each expert's matrices packed in ``name`` (``...mlp.experts.gate_up_proj``
    ``[E, 2I, H]`` or ``...mlp.experts.down_proj`` ``[E, H, I]``) -> ``param``'s view for them: the
    matrix's, or a companion's row for row; with ``columns`` an act-order input order ``[E, in]``, which an
    expert's gate and up share whole."""
    prefix, packed = name.rsplit(".", 1)
    inter = param.shape[1] // 2
    views = {}
    for e in range(param.shape[0]):
        if packed == "gate_up_proj":
            views[f"{prefix}.{e}.gate_proj.weight"] = param.data[e] if columns else param.data[e, :inter]
            views[f"{prefix}.{e}.up_proj.weight"] = param.data[e] if columns else param.data[e, inter:]
        else:
            views[f"{prefix}.{e}.down_proj.weight"] = param.data[e]
    if cfg.architecture != "MixtralForCausalLM":
        return views
    renamed = {}
    for key, view in views.items():
        for ours, theirs in MIXTRAL_EXPERT_NAMES.items():
            key = key.replace(ours, theirs)
        renamed[key] = view
    return renamed


# what a quantized weight comes with, named after it: ``...weight_scale``, ``...experts.down_proj_zero``
COMPANIONS = ("_scale", "_zero", "_input_perm")

# what a checkpoint tensor holds, by dtype (anything else counts as a float)
_HOLDS = {torch.float8_e4m3fn: "fp8", torch.int32: "int32", torch.int64: "int64", torch.int8: "int8"}
_HOLDS_TEXT = {"float": "a 16- or 32-bit float (only the decoder's projections may be quantized)",
               "fp8": "float8_e4m3fn (a projection kept in 16 bits beside fp8 ones is not supported)",
               "int32": "int32 (integer codes packed eight or four a word, or GPTQ's g_idx)",
               "int64": "int64 (compressed-tensors' weight_shape)",
               "int8": "int8 (compressed-tensors' int-quantized weights and zero points)"}


@dataclass
class _Target:
    """Where one checkpoint tensor goes: ``dest``, a view of a parameter (None: checked, not kept), the shape
    the config implies and what the tensor must hold (``_HOLDS``)."""

    dest: torch.Tensor | None
    shape: tuple[int, ...]
    holds: str = "float"
    # the checkpoint's layout -> dest's (on dest's device: the GPU where there is one); with no dest, a check
    convert: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    online_scales: torch.Tensor | None = None  # --quantization: a 16-bit weight, quantized into dest
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = quantize_rows  # (codes, scales)
    optional: bool = False  # a checkpoint may leave it out
    # a scale: its shape is checked without size-1 dims (a per-tensor one as [] or [1]; ModelOpt's per-row
    # scales [out] against [out, 1], its block ones [out / 128, 1, in / 128, 1])
    unit_dims_free: bool = False

    def fill(self, tensor: torch.Tensor) -> None:
        if self.online_scales is not None:
            codes, scales = self.quantize(tensor.to(self.dest.device))  # on the GPU where there is one
            self.dest.copy_(codes)
            self.online_scales.copy_(scales)
            return
        if self.dest is None:  # checked only
            self.convert(tensor)
            return
        self.dest.copy_(tensor if self.convert is None else self.convert(tensor.to(self.dest.device)))


def _add(targets: dict[str, _Target], name: str, view: torch.Tensor, companions: dict[str, torch.Tensor],
         quant: Quant) -> None:
    """The targets of checkpoint weight ``name`` (rows ``view`` of a parameter), and of what a quantized one
    comes with (``companions``: the same rows of its ``weight_scale`` and ``weight_zero``)."""
    shape = tuple(view.shape)
    if not companions or quant is None:
        targets[name] = _Target(view, shape)
    elif quant.online:  # fp8 codes, or int8 values run W8A8, each with a scale a row
        targets[name] = _Target(view, shape, online_scales=companions["weight_scale"],
                                quantize=quantize_int8_rows if isinstance(quant, IntQuant) else quantize_rows)
    elif isinstance(quant, IntQuant):
        _add_int(targets, name.removesuffix("weight"), view, companions, quant)
    else:
        targets[name] = _Target(view, shape, holds="fp8")
        targets[name.removesuffix("weight") + quant.scale_suffix] = _Target(
            companions["weight_scale"], quant.scale_shape(*shape),
            convert=partial(row_scales, quant=quant, rows=shape[0]), unit_dims_free=True)


def _add_int(targets: dict[str, _Target], prefix: str, view: torch.Tensor, companions: dict[str, torch.Tensor],
             quant: IntQuant) -> None:
    """An integer projection's tensors for the rows ``view`` (``[out, in / per_byte]``) of the model's packed
    weight, in the checkpoint's layout (``engine/int_weights.py``)."""
    out, cols, per_word = view.shape[0], quant.per_byte * view.shape[1], quant.per_word
    groups = quant.groups(cols)
    codes, zeros = partial(codes_from_checkpoint, quant=quant), partial(zeros_from_checkpoint, quant=quant)
    scales = partial(scales_from_checkpoint, quant=quant)
    if quant.layout == "compressed-tensors":
        g_idx, holds = prefix + "weight_g_idx", "int32" if quant.packed else "int8"
        if quant.packed:
            targets[prefix + "weight_packed"] = _Target(view, (out, cols // per_word), holds, codes)
            targets[prefix + "weight_shape"] = _Target(None, (2,), "int64", partial(check_weight_shape, rows=out,
                                                                                     cols=cols))
        else:  # int-quantized: an int8 a weight, under the weight's own name; kept as it is for W8A8
            targets[prefix + "weight"] = _Target(view, (out, cols), holds,
                                                 None if view.dtype == torch.int8 else codes)
        targets[prefix + "weight_scale"] = _Target(companions["weight_scale"], (out, groups), convert=scales)
        if quant.zero_points:
            targets[prefix + "weight_zero_point"] = _Target(companions["weight_zero"], (out // per_word, groups),
                                                            holds, zeros)
        elif "weight_zero" in companions:  # symmetric: codes are the signed values plus it (W8A8 holds no zeros)
            companions["weight_zero"].fill_(quant.mid_code)
    else:
        g_idx = prefix + "g_idx"
        words = (cols, out // 8) if quant.layout == "awq" else (cols // per_word, out)
        targets[prefix + "qweight"] = _Target(view, words, "int32", codes)
        targets[prefix + "qzeros"] = _Target(companions["weight_zero"], (groups, out // per_word), "int32", zeros)
        targets[prefix + "scales"] = _Target(companions["weight_scale"], (groups, out), convert=scales)
    if quant.act_order:  # the input order, which load_model then sorts the columns into
        perm = companions["weight_input_perm"]
        targets[g_idx] = _Target(perm, (cols,), "int32", partial(act_order_perm, quant=quant, current=perm))
    elif quant.layout == "gptq":
        targets[g_idx] = _Target(None, (cols,), "int32", partial(check_g_idx, quant=quant), optional=True)


def _targets(model: CausalLM, cfg: ModelConfig) -> dict[str, _Target]:
    """Checkpoint tensor name -> where it goes."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    packed = cfg.architecture in PACKED_ARCHITECTURES  # the checkpoint's q/k/v and gate/up are ours already
    quant = cfg.weight_quant
    params = dict(model.named_parameters())
    targets: dict[str, _Target] = {}
    for name, param in params.items():
        if name.endswith(COMPANIONS):
            continue  # filled with its weight
        # a quantized projection's scales (and integer zeros), row for row, and an act-order one's input order
        # (engine/weight_quant.py, int_weights.py): named after its weight, as an expert stack's are
        companions = {"weight" + part: params[name + part] for part in COMPANIONS if name + part in params}
        if ".experts." in name:
            views = {part: _expert_targets(name, companion, cfg, columns=part == "weight_input_perm")
                     for part, companion in companions.items()}
            for key, view in _expert_targets(name, param, cfg).items():
                _add(targets, key, view, {part: by_key[key] for part, by_key in views.items()}, quant)
        elif ".mlp.gate." in name and cfg.architecture == "MixtralForCausalLM":  # the router
            targets[name.replace(".mlp.", ".block_sparse_moe.")] = _Target(param.data, tuple(param.shape))
        elif ".qkv_proj." in name and not packed:  # split the fused matrix back into the checkpoint's three
            for part, (lo, hi) in zip(("q_proj", "k_proj", "v_proj"),
                                      ((0, q), (q, q + kv), (q + kv, q + 2 * kv)), strict=True):
                _add(targets, name.replace("qkv_proj", part), param.data[lo:hi], _rows(companions, lo, hi), quant)
        elif ".gate_up_proj." in name and not packed:  # the dense MLP's, or a shared expert's
            inter = param.shape[0] // 2
            for part, (lo, hi) in zip(("gate_proj", "up_proj"), ((0, inter), (inter, 2 * inter)), strict=True):
                _add(targets, name.replace("gate_up_proj", part), param.data[lo:hi], _rows(companions, lo, hi), quant)
        elif cfg.gemma and name.endswith("norm.weight"):  # Gemma's norms scale by 1 + weight: the 1 is added here
            targets[name] = _Target(param.data, tuple(param.shape), convert=lambda t: t.float() + 1.0)
        else:
            _add(targets, name, param.data, {part: c.data for part, c in companions.items()}, quant)
    return targets


def _rows(companions: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Rows ``lo:hi`` of each companion; the input order, which spans columns, whole."""
    return {part: companion.data if part == "weight_input_perm" else companion.data[lo:hi]
            for part, companion in companions.items()}


def _sort_act_order_columns(model: CausalLM) -> None:
    """Act-order: each integer matrix's columns sorted into group order (its input gathered to match), the
    projections' and each expert's (``int_weights.sort_columns``)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight_input_perm is not None:
            module.weight.copy_(sort_columns(module.weight, module.weight_input_perm, module.weight_bits))
        elif isinstance(module, SparseMoE) and getattr(module.experts, "gate_up_proj_input_perm", None) is not None:
            quant = module.expert_quant()
            for matrix, perms in ((module.experts.gate_up_proj, quant.gate_up_perm),
                                  (module.experts.down_proj, quant.down_perm)):
                for expert, perm in enumerate(perms):
                    matrix[expert].copy_(sort_columns(matrix[expert], perm, quant.bits))


def _check_tensor(path: Path, name: str, tensor: torch.Tensor, target: _Target) -> None:
    """A checkpoint tensor must have the shape the config implies, and be fp8 exactly where the model is."""
    shape = tuple(tensor.shape)
    if shape != target.shape and not (target.unit_dims_free and _without_ones(shape) == _without_ones(target.shape)):
        raise CheckpointError(f"{path.name}: tensor {name!r} has shape {shape}, config.json implies {target.shape}")
    if _HOLDS.get(tensor.dtype, "float") != target.holds:
        raise CheckpointError(f"{path.name}: tensor {name!r} is {tensor.dtype}, config.json's quantization_config "
                              f"implies {_HOLDS_TEXT[target.holds]}")


_FLOAT_DTYPES = ("F16", "BF16", "F32")  # safetensors' names of the 16- and 32-bit float dtypes


def _checkpoint_parts(cfg: ModelConfig, layer: int) -> dict[str, list[str]]:
    """Each quantizable projection of ``layer`` (the model's name) -> the checkpoint weights it is packed from."""
    p = f"model.layers.{layer}"
    packed = cfg.architecture in PACKED_ARCHITECTURES
    attention = [f"{p}.self_attn.qkv_proj"] if packed else [f"{p}.self_attn.{x}_proj" for x in "qkv"]
    parts = {f"{p}.self_attn.qkv_proj": attention, f"{p}.self_attn.o_proj": [f"{p}.self_attn.o_proj"]}
    mlps = [f"{p}.mlp"]
    if cfg.moe is not None and layer in cfg.moe.layers:
        meta = {"gate_up_proj": torch.empty(cfg.moe.num_experts, 2, 1, device="meta"),
                "down_proj": torch.empty(cfg.moe.num_experts, 1, 1, device="meta")}
        parts[f"{p}.mlp.experts"] = [key.removesuffix(".weight") for part, param in meta.items()
                                     for key in _expert_targets(f"{p}.mlp.experts.{part}", param, cfg)]
        mlps = [f"{p}.mlp.shared_expert"] if cfg.moe.shared_expert_intermediate_size else []
    for mlp in mlps:
        parts[f"{mlp}.gate_up_proj"] = [f"{mlp}.gate_up_proj"] if packed else [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
        parts[f"{mlp}.down_proj"] = [f"{mlp}.down_proj"]
    return parts


def _model_name(name: str, cfg: ModelConfig) -> str | None:
    """The model's name for checkpoint tensor ``name``: itself, a base model's under ``model.``
    (``ModelConfig.base_checkpoint``), or in a multimodal checkpoint its language model's tensor renamed as the
    text model's (``MULTIMODAL_TEXT_PREFIXES``), None for the rest (not loaded)."""
    if cfg.base_checkpoint:
        return "model." + name
    if cfg.architecture != "Gemma3ForConditionalGeneration":
        return name
    prefix = next((p for p in MULTIMODAL_TEXT_PREFIXES if name.startswith(p)), None)
    return None if prefix is None else MULTIMODAL_TEXT_PREFIXES[prefix] + name.removeprefix(prefix)


def _left_unquantized(model_dir: Path, cfg: ModelConfig) -> frozenset[str]:
    """The projections a quantized checkpoint holds in 16 or 32 bits (its ignore / modules_to_not_convert
    lists, in whatever pattern language it wrote them): those whose weights are floats in its tensors.
    CheckpointError when one matrix the model packs (q/k/v, gate/up, a layer's experts) is part of each."""
    dtypes: dict[str, str] = {}
    for path in _weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            dtypes |= {ours: f.get_slice(name).get_dtype() for name in f.keys()  # noqa: SIM118 - not a mapping
                       if (ours := _model_name(name, cfg)) is not None}
    kept = set()
    for layer in range(cfg.num_layers):
        for module, parts in _checkpoint_parts(cfg, layer).items():
            floats = [part for part in parts if dtypes.get(f"{part}.weight") in _FLOAT_DTYPES]
            if floats and len(floats) < len(parts):
                raise CheckpointError(f"{model_dir}: {floats[0]} is a float weight beside quantized ones of the "
                                      f"matrix the model packs it into ({module}): quantize all or none")
            if floats:
                kept.add(module)
    return frozenset(kept)


def _as_stored(cfg: ModelConfig, model_dir: Path) -> ModelConfig:
    """``cfg`` for a checkpoint of the base model alone (``ModelConfig.base_checkpoint``: its embedding matrix
    is ``embed_tokens.weight``), which has no LM head to load: tied to the embedding matrix, generating only if
    the config ties them."""
    for path in _weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            if "embed_tokens.weight" in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                return replace(cfg, base_checkpoint=True, generates=cfg.tie_word_embeddings, tie_word_embeddings=True)
    return cfg


def _without_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               quantization: str | None = None) -> tuple[CausalLM, ModelConfig]:
    """Build the model for ``model_dir``'s config and fill it from its safetensors files; ``quantization``
    "fp8" quantizes a 16-bit checkpoint's decoder projections as they load (``engine/weight_quant.py``); AWQ,
    GPTQ and compressed-tensors integer projections are unpacked into the model's layout
    (``engine/int_weights.py``); the projections a quantized checkpoint leaves in 16 bits (found in its
    tensors: ``_left_unquantized``) are held in ``dtype``."""
    model_dir = Path(model_dir)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; supported: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    cfg = _as_stored(ModelConfig.from_dir(model_dir).with_quantization(quantization), model_dir)
    if cfg.weight_quant is not None and not cfg.weight_quant.online:
        cfg = replace(cfg, unquantized=_left_unquantized(model_dir, cfg))
    with torch.device(device):
        model = CausalLM(cfg, dtype)
    targets = _targets(model, cfg)
    seen: set[str] = set()
    for path in _weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = _model_name(stored, cfg)
                if name is None:
                    continue  # a multimodal checkpoint's vision tower or projector
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue  # derived from the config, or the tied embedding already loaded
                if name.endswith(".input_scale") and name.removesuffix("input_scale") + "weight" in targets:
                    continue  # a static activation scale: activations stay in the model's dtype (W8A16)
                if cfg.static_kv_scales and ".self_attn." in name and name.endswith((".k_scale", ".v_scale")):
                    continue  # for an fp8 cache of one scale a layer: ours keeps scales of its own
                if name.endswith(".bias") and name not in targets and name.removesuffix("bias") + "qweight" in targets \
                        and not f.get_tensor(stored).any():
                    continue  # older AutoGPTQ writes a zero bias for every projection: nothing to add
                if name not in targets:
                    raise CheckpointError(f"{path.name}: unexpected tensor {name!r} for {cfg.architecture}")
                tensor = f.get_tensor(stored)
                _check_tensor(path, name, tensor, targets[name])
                try:
                    targets[name].fill(tensor)
                except CheckpointError as exc:  # a value the layout cannot hold (GPTQ's act-order g_idx)
                    raise CheckpointError(f"{path.name}: tensor {name!r}: {exc}") from None
                seen.add(name)
    optional = {name for name, target in targets.items() if target.optional}
    missing = sorted(set(targets) - seen - optional - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    _sort_act_order_columns(model)
    model.init_rope(device)
    return model.eval(), cfg
