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
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import PACKED_ARCHITECTURES, ModelConfig
from engine.errors import CheckpointError
from engine.model import CausalLM
from engine.tiny import write_tiny_checkpoint

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


def _targets(model: CausalLM, cfg: ModelConfig) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """Checkpoint tensor name -> (destination view in the model, expected shape)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    packed = cfg.architecture in PACKED_ARCHITECTURES  # the checkpoint's q/k/v and gate/up are ours already
    targets: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {}
    for name, param in model.named_parameters():
        if ".experts." in name:
            for key, view in _expert_targets(name, param, cfg).items():
                targets[key] = (view, tuple(view.shape))
        elif ".mlp.gate." in name and cfg.architecture == "MixtralForCausalLM":  # the router
            targets[name.replace(".mlp.", ".block_sparse_moe.")] = (param.data, tuple(param.shape))
        elif ".qkv_proj." in name and not packed:  # split the fused matrix back into the checkpoint's three
            for part, (lo, hi) in zip(("q_proj", "k_proj", "v_proj"),
                                      ((0, q), (q, q + kv), (q + kv, q + 2 * kv)), strict=True):
                view = param.data[lo:hi]
                targets[name.replace("qkv_proj", part)] = (view, tuple(view.shape))
        elif ".gate_up_proj." in name and not packed:  # the dense MLP's, or a shared expert's
            inter = param.shape[0] // 2
            for part, (lo, hi) in zip(("gate_proj", "up_proj"), ((0, inter), (inter, 2 * inter)), strict=True):
                view = param.data[lo:hi]
                targets[name.replace("gate_up_proj", part)] = (view, tuple(view.shape))
        else:
            targets[name] = (param.data, tuple(param.shape))
    return targets


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> tuple[CausalLM, ModelConfig]:
    """Build the model for ``model_dir``'s config and fill it from its safetensors files."""
    model_dir = Path(model_dir)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; supported: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device(device):
        model = CausalLM(cfg, dtype)
    targets = _targets(model, cfg)
    seen: set[str] = set()
    for path in _weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue  # derived from the config, or the tied embedding already loaded
                if name not in targets:
                    raise CheckpointError(f"{path.name}: unexpected tensor {name!r} for {cfg.architecture}")
                dest, shape = targets[name]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != shape:
                    raise CheckpointError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                          f"config.json implies {shape}")
                dest.copy_(tensor)
                seen.add(name)
    missing = sorted(set(targets) - seen - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.init_rope(device)
    return model.eval(), cfg
