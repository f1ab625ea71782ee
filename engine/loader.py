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
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import PACKED_ARCHITECTURES, ModelConfig, WeightQuant
from engine.errors import CheckpointError
from engine.model import CausalLM
from engine.tiny import write_tiny_checkpoint
from engine.weight_quant import quantize_rows, row_scales

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY = "tiny"


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


def _expert_targets(name: str, param: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint names of each expert's matrices packed in ``param`` (``...mlp.experts.gate_up_proj``
    ``[E, 2I, H]`` or ``...mlp.experts.down_proj`` ``[E, H, I]``) -> its view for them."""
    prefix, packed = name.rsplit(".", 1)
    inter = param.shape[1] // 2
    views = {}
    for e in range(param.shape[0]):
        if packed == "gate_up_proj":
            views[f"{prefix}.{e}.gate_proj.weight"] = param.data[e, :inter]
            views[f"{prefix}.{e}.up_proj.weight"] = param.data[e, inter:]
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


@dataclass
class _Target:
    """Where one checkpoint tensor goes: ``dest``, a view of a parameter, and the shape the config implies."""

    dest: torch.Tensor
    shape: tuple[int, ...]
    codes: bool = False  # fp8 codes of a quantized projection: the checkpoint must hold them as such
    scale_of: WeightQuant | None = None  # a checkpoint scale, expanded to ``dest``'s rows (``row_scales``)
    online_scales: torch.Tensor | None = None  # --quantization fp8: a 16-bit weight, quantized into dest

    def fill(self, tensor: torch.Tensor) -> None:
        if self.scale_of is not None:
            self.dest.copy_(row_scales(tensor, self.scale_of, self.dest.shape[0]))
        elif self.online_scales is not None:
            codes, scales = quantize_rows(tensor.to(self.dest.device))  # on the GPU where there is one
            self.dest.copy_(codes)
            self.online_scales.copy_(scales)
        else:
            self.dest.copy_(tensor)


def _add(targets: dict[str, _Target], name: str, view: torch.Tensor, scales: torch.Tensor | None,
         quant: WeightQuant | None) -> None:
    """The target of checkpoint weight ``name`` (rows ``view`` of a parameter), and of its scale when the
    parameter is fp8 (``scales``: the same rows of its ``weight_scale``)."""
    shape = tuple(view.shape)
    if scales is None or quant is None:
        targets[name] = _Target(view, shape)
    elif quant.online:
        targets[name] = _Target(view, shape, online_scales=scales)
    else:
        targets[name] = _Target(view, shape, codes=True)
        targets[name.removesuffix("weight") + quant.scale_suffix] = _Target(
            scales, quant.scale_shape(*shape), scale_of=quant)


def _targets(model: CausalLM, cfg: ModelConfig) -> dict[str, _Target]:
    """Checkpoint tensor name -> where it goes."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    packed = cfg.architecture in PACKED_ARCHITECTURES  # the checkpoint's q/k/v and gate/up are ours already
    quant = cfg.weight_quant
    params = dict(model.named_parameters())
    targets: dict[str, _Target] = {}
    for name, param in params.items():
        scales = params.get(name + "_scale")  # a quantized projection's rows' scales (engine/weight_quant.py)
        if name.endswith("_scale"):
            continue  # filled with its weight
        if ".experts." in name:
            scale_views = {} if scales is None else _expert_targets(name, scales, cfg)
            for key, view in _expert_targets(name, param, cfg).items():
                _add(targets, key, view, scale_views.get(key), quant)
        elif ".mlp.gate." in name and cfg.architecture == "MixtralForCausalLM":  # the router
            targets[name.replace(".mlp.", ".block_sparse_moe.")] = _Target(param.data, tuple(param.shape))
        elif ".qkv_proj." in name and not packed:  # split the fused matrix back into the checkpoint's three
            for part, (lo, hi) in zip(("q_proj", "k_proj", "v_proj"),
                                      ((0, q), (q, q + kv), (q + kv, q + 2 * kv)), strict=True):
                _add(targets, name.replace("qkv_proj", part), param.data[lo:hi],
                     None if scales is None else scales.data[lo:hi], quant)
        elif ".gate_up_proj." in name and not packed:  # the dense MLP's, or a shared expert's
            inter = param.shape[0] // 2
            for part, (lo, hi) in zip(("gate_proj", "up_proj"), ((0, inter), (inter, 2 * inter)), strict=True):
                _add(targets, name.replace("gate_up_proj", part), param.data[lo:hi],
                     None if scales is None else scales.data[lo:hi], quant)
        else:
            _add(targets, name, param.data, None if scales is None else scales.data, quant)
    return targets


def _check_tensor(path: Path, name: str, tensor: torch.Tensor, target: _Target) -> None:
    """A checkpoint tensor must have the shape the config implies, and be fp8 exactly where the model is."""
    shape = tuple(tensor.shape)
    if shape != target.shape and not (target.shape == () and shape == (1,)):  # a per-tensor scale as [1]
        raise CheckpointError(f"{path.name}: tensor {name!r} has shape {shape}, config.json implies {target.shape}")
    if (tensor.dtype == torch.float8_e4m3fn) != target.codes:
        implied = ("float8_e4m3fn (a projection kept in 16 bits beside fp8 ones is not supported)" if target.codes
                   else "a 16- or 32-bit float (only the decoder's projections may be fp8)")
        raise CheckpointError(f"{path.name}: tensor {name!r} is {tensor.dtype}, config.json's quantization_config "
                              f"implies {implied}")


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               quantization: str | None = None) -> tuple[CausalLM, ModelConfig]:
    """Build the model for ``model_dir``'s config and fill it from its safetensors files; ``quantization``
    "fp8" quantizes a 16-bit checkpoint's decoder projections as they load (``engine/weight_quant.py``)."""
    model_dir = Path(model_dir)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; supported: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    cfg = ModelConfig.from_dir(model_dir).with_quantization(quantization)
    with torch.device(device):
        model = CausalLM(cfg, dtype)
    targets = _targets(model, cfg)
    seen: set[str] = set()
    for path in _weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue  # derived from the config, or the tied embedding already loaded
                if name.endswith(".input_scale") and name.removesuffix("input_scale") + "weight" in targets:
                    continue  # a static activation scale: activations stay in the model's dtype (W8A16)
                if name not in targets:
                    raise CheckpointError(f"{path.name}: unexpected tensor {name!r} for {cfg.architecture}")
                tensor = f.get_tensor(name)
                _check_tensor(path, name, tensor, targets[name])
                targets[name].fill(tensor)
                seen.add(name)
    missing = sorted(set(targets) - seen - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.init_rope(device)
    return model.eval(), cfg
