"""LoRA adapters served beside the base model (vLLM's ``--lora-modules``): many adapters, one batch.

An adapter is a PEFT checkpoint directory (``adapter_config.json`` and ``adapter_model.safetensors``) whose
low-rank pairs A ``[r, in]``, B ``[out, r]`` target the attention and MLP projections. Each is read and checked
whole (``read_adapter``: packed as the model packs q/k/v and gate/up, A stacked, B block-diagonal, PEFT's
scaling folded into B) and kept in host memory, at start or while serving (``services/lora_updates.py``); it
is copied into one of the slots allocated at start (1, 2, ...; 0 is the base model: ``engine/lora_slots.py``,
vLLM's ``--max-loras``) when its sequences run. A step names each row's slot (``LoRABatch``), and each layer
adds ``x A^T B^T`` to the rows of each adapter in the batch, so sequences of different adapters and of the
base model share one forward pass: per adapter on the torch path (``lora_delta``), or in two grouped kernel
launches for every adapter at once on the Triton backend's decode steps, which CUDA graphs capture
(``engine/kernels/lora_matmul.py``).

An adapter changes every key and value, so its sequences' blocks are hashed under a salt of their own
(``kvstore.hashing.salt_for(model, adapter_id)``): they are never another adapter's prefix-cache hits, while
sequences of one adapter share blocks like any others, across workers too. The adapter id is its name and a
digest of its weights, so an adapter retrained under the same name never reads its predecessor's blocks.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load

from engine.config import ModelConfig
from engine.errors import LoRAAdapterError

# The projections an adapter may target, and the model's packed matrix each lands in (Phi-3's checkpoints,
# and so its adapters, hold qkv_proj and gate_up_proj packed already).
PACKED_INTO = {"q_proj": "self_attn.qkv_proj", "k_proj": "self_attn.qkv_proj", "v_proj": "self_attn.qkv_proj",
               "qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_up_proj",
               "up_proj": "mlp.gate_up_proj", "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

# The rows of each adapter in one step: (slot, row indices; None: every row of the step)
LoRARows = list[tuple[int, torch.Tensor | None]]


@dataclass
class LoRABatch:
    """A step's adapters: ``rows`` for the per-adapter path (``lora_delta``), or ``index``, each row's slot - 1
    (-1: the base model), for the grouped kernels (``engine/kernels/lora_matmul.py``)."""

    rows: LoRARows = field(default_factory=list)
    index: torch.Tensor | None = None


@dataclass
class PackedAdapter:
    """An adapter read and checked whole, in host memory: each targeted layer's packed (A, B), by the layer's
    module name (``model.layers.3.self_attn.qkv_proj``), and its largest rank; ``LoRASlots`` copies it into a
    slot of the layers (``engine/lora_slots.py``)."""

    name: str
    adapter_id: str  # name@digest: what its blocks' hashes are salted with
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int


def lora_delta(out: torch.Tensor, x: torch.Tensor, pairs: dict[int, tuple[torch.Tensor, torch.Tensor]],
               rows: LoRARows) -> torch.Tensor:
    """``out`` (a layer's base output for ``x``) plus each adapter's ``x A^T B^T`` on its rows (in place)."""
    for slot, index in rows:
        pair = pairs.get(slot)
        if pair is None:  # this adapter leaves this layer alone
            continue
        a, b = pair
        if index is None:  # (addmm_ adds in the matmul: no temporary of the output's size)
            out.addmm_(x @ a.T, b.T)
        else:
            out.index_add_(0, index, (x[index] @ a.T) @ b.T)
    return out


def check_adapters(modules: dict[str, str], base_id: str) -> None:
    """Refuse adapters that could not be served beside the model ``base_id`` (requests name it, so no adapter
    may), before any weight is read."""
    for name, path in modules.items():
        _check_name(name, base_id)
        read_adapter_config(name, Path(path).expanduser())


def _check_name(name: str, base_id: str) -> None:
    if not name or name != name.strip() or name == base_id:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: a name must be non-empty, without surrounding spaces, "
                               f"and not the base model's ({base_id!r})")


def read_adapter_config(name: str, path: Path) -> dict:
    """The adapter directory's ``adapter_config.json``, once it is known to describe an adapter these layers
    run (callers check this before starting workers, so a bad adapter fails at once, named)."""
    for f in (path / "adapter_config.json", path / "adapter_model.safetensors"):
        if not f.is_file():
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {f} not found (a PEFT adapter directory is expected)")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except json.JSONDecodeError as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path / 'adapter_config.json'}: {exc}") from None
    _check_config(name, config)
    return config


def read_adapter(name: str, path: str, base_id: str, model: torch.nn.Module, cfg: ModelConfig) -> PackedAdapter:
    """Read the adapter at ``path`` of the model ``base_id`` and pack every pair, checked against ``model``'s
    layers; nothing goes onto a layer (``LoRASlots.acquire`` does that), so an adapter refused half-way leaves
    no trace."""
    _check_name(name, base_id)
    path = Path(path).expanduser()
    config = read_adapter_config(name, path)
    weights_file = path / "adapter_model.safetensors"
    raw = weights_file.read_bytes()
    tensors = load(raw)
    pairs: dict[tuple[int, str], dict[str, dict[str, torch.Tensor]]] = {}  # (layer, module) -> part -> A/B
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if ".experts." in key:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} adapts a mixture of experts' experts, which "
                                  "is not supported (target attention and dense MLPs only)")
        if m is None or m.group(3) not in PACKED_INTO:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A/lora_B of a supported "
                                  f"projection ({', '.join(sorted(PACKED_INTO))})")
        layer, part, ab = int(m.group(1)), m.group(3), m.group(4)
        if layer >= cfg.num_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key!r} names layer {layer}, the model has {cfg.num_layers}")
        pairs.setdefault((layer, PACKED_INTO[part]), {}).setdefault(part, {})[ab] = tensor
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), parts in pairs.items():
        path_in_model = f"model.layers.{layer}.{module}"
        try:
            model.get_submodule(path_in_model)
        except AttributeError:  # a mixture of experts' layer: its experts take no adapter
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer}'s {module} is a mixture of experts, "
                                  "which LoRA adapters are not supported on (target attention only)") from None
        packed[path_in_model] = _pack(name, layer, module, parts, config, cfg)
    rank = max(pair["A"].shape[0] for parts in pairs.values() for pair in parts.values())
    return PackedAdapter(name, _adapter_id(name, raw), packed, rank)


def adapter_id(name: str, path: str) -> str:
    """The id the adapter at ``path`` would be loaded under (``PackedAdapter.adapter_id``), its weights unread
    into any layer; LoRAAdapterError when the directory holds no adapter."""
    read_adapter_config(name, Path(path).expanduser())
    return _adapter_id(name, (Path(path).expanduser() / "adapter_model.safetensors").read_bytes())


def _adapter_id(name: str, weights: bytes) -> str:
    return f"{name}@{hashlib.sha256(weights).hexdigest()[:16]}"


def _check_config(name: str, config: dict) -> None:
    """Refuse what PEFT can save but these layers do not compute."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    if config.get("use_dora"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: bias {config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: modules_to_save ({config['modules_to_save']}) would replace "
                              "base weights, which adapters here do not")
    if config.get("fan_in_fan_out"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: fan_in_fan_out (GPT-2 style Conv1D) is not supported")


def _scaling(config: dict, module_name: str, rank: int) -> float:
    """PEFT's: lora_alpha (or its alpha_pattern entry for this module) over the rank, or over its square root
    with rsLoRA."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module_name):
            alpha = value
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pack(name: str, layer: int, module: str, parts: dict[str, dict[str, torch.Tensor]], config: dict,
          cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed layer's A ``[sum r, in]`` and scaled block-diagonal B ``[out, sum r]`` from its parts' pairs
    (a part the adapter leaves alone keeps zero rows of B)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    spans = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv), "qkv_proj": (0, q + 2 * kv),
             "o_proj": (0, cfg.hidden_size), "gate_proj": (0, inter), "up_proj": (inter, 2 * inter),
             "gate_up_proj": (0, 2 * inter), "down_proj": (0, cfg.hidden_size)}
    fan_in = {"self_attn.o_proj": q, "mlp.down_proj": inter}.get(module, cfg.hidden_size)
    out_size = {"self_attn.qkv_proj": q + 2 * kv, "mlp.gate_up_proj": 2 * inter}.get(module, cfg.hidden_size)
    a_parts, b_parts = [], []
    for part, pair in sorted(parts.items(), key=lambda item: spans[item[0]]):
        where = f"LoRA adapter {name!r}: layer {layer} {part}"
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: lora_A and lora_B must both be present")
        a, b = pair["A"], pair["B"]
        lo, hi = spans[part]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or tuple(b.shape) != (hi - lo, r):
            raise LoRAAdapterError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                                  f"model (expected [r, {fan_in}] and [{hi - lo}, r])")
        scaled = b.float() * _scaling(config, f"model.layers.{layer}.{module.split('.')[0]}.{part}", r)
        full = torch.zeros(out_size, r)
        full[lo:hi] = scaled
        a_parts.append(a.float())
        b_parts.append(full)
    return torch.cat(a_parts), torch.cat(b_parts, dim=1)
