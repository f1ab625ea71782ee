"""The LoRA adapter slots of one engine, allocated once (vLLM's ``--max-loras`` and ``--max-lora-rank``), and
which adapter each holds.

Every ``Linear`` an adapter may target (each layer's packed q/k/v, o, packed gate/up and down projections;
a mixture of experts' experts take none) holds two stacks: A ``[max_loras, cap, in]`` and B
``[max_loras, out, cap]``, ``cap`` being ``max_lora_rank`` times the parts packed in it (3 for q/k/v, 2 for
gate/up). Slot s (1..max_loras) is row s - 1 of both. Allocating them at start, before the KV cache takes
the device's free memory, means an adapter loaded while serving needs no memory the cache may hold, and the
stacks never move, so CUDA graphs captured over them read whichever adapters are loaded when they replay.

An engine may keep more adapters (in host memory, ``--max-cpu-loras``) than it has slots, as vLLM does:
``acquire`` gives an adapter a slot when a sequence of it is scheduled, copying it into a free slot or into
the slot of the least recently used adapter that no running sequence has; when every slot holds a running
sequence's adapter the sequence waits (``engine/scheduler.py``). Placing an adapter copies its packed pairs
into its slot's rows, zero past its rank, and points the layer's ``lora[slot]`` (the torch path's pairs) at
views of them; evicting one zeroes its rows, so the grouped kernels, which read every slot at its full
``cap``, add nothing for a free slot or past an adapter's rank.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from engine.config import ModelConfig
from engine.errors import LoRAAdapterError
from engine.lora import PackedAdapter

# the projections an adapter may target, as the model packs them, and how many adapter parts each packs
TARGETS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
DEFAULT_MAX_LORA_RANK = 16  # vLLM's


class LoRASlots:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {max_loras} and {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.resident: dict[str, int] = {}  # adapter name -> its slot, the least recently used first
        self.swaps = 0  # adapters copied into a slot that held another one
        self.linears: dict[str, torch.nn.Module] = {}
        for layer in range(cfg.num_layers):
            for module, parts in TARGETS.items():
                name = f"model.layers.{layer}.{module}"
                try:
                    linear = model.get_submodule(name)
                except AttributeError:  # a mixture of experts' MLP
                    continue
                out_features, in_features = linear.out_features, linear.in_features
                cap = max_rank * parts
                linear.lora_stacks = (torch.zeros(max_loras, cap, in_features, dtype=dtype, device=device),
                                      torch.zeros(max_loras, out_features, cap, dtype=dtype, device=device))
                self.linears[name] = linear

    @property
    def nbytes(self) -> int:
        """Device memory the stacks hold."""
        return sum(t.numel() * t.element_size() for linear in self.linears.values() for t in linear.lora_stacks)

    def check(self, adapter: PackedAdapter) -> None:
        """LoRAAdapterError when ``adapter``'s rank is above ``max_lora_rank``: no slot could hold it."""
        if adapter.rank > self.max_rank:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} is above --max-lora-rank "
                                   f"{self.max_rank} (start the server with a larger --max-lora-rank)")

    def slot_of(self, name: str) -> int:
        return self.resident[name]

    def acquire(self, adapter: PackedAdapter, busy: Collection[str]) -> int | None:
        """``adapter``'s slot: the one it is in (it becomes the most recently used), else a free one, else the
        slot of the least recently used adapter not in ``busy`` (those of running sequences), which it is
        copied into; None when every slot holds a busy adapter."""
        name = adapter.name
        if name in self.resident:
            self.resident[name] = self.resident.pop(name)
            return self.resident[name]
        if len(self.resident) == self.max_loras:
            idle = next((held for held in self.resident if held not in busy), None)
            if idle is None:
                return None
            self.evict(idle)
            self.swaps += 1
        slot = min(set(range(1, self.max_loras + 1)) - set(self.resident.values()))
        self._place(adapter, slot)
        self.resident[name] = slot
        return slot

    def _place(self, adapter: PackedAdapter, slot: int) -> None:
        for name, (a, b) in adapter.pairs.items():
            linear = self.linears[name]
            stack_a, stack_b = linear.lora_stacks
            r = a.shape[0]  # a free slot is all zeros (allocated so, zeroed when evicted): past r it stays so
            stack_a[slot - 1, :r].copy_(a, non_blocking=True)  # (pinned host copies on GPUs)
            stack_b[slot - 1, :, :r].copy_(b, non_blocking=True)
            linear.lora[slot] = (stack_a[slot - 1, :r], stack_b[slot - 1, :, :r])

    def evict(self, name: str) -> None:
        """Take adapter ``name`` off every layer (if it is in a slot) and zero its rows: the slot is free."""
        slot = self.resident.pop(name, None)
        if slot is None:
            return
        for linear in self.linears.values():
            linear.lora.pop(slot, None)
            for stack in linear.lora_stacks:
                stack[slot - 1].zero_()
