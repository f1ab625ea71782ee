"""Host values onto the device, and device values back, without waiting for the device.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory, which CUDA does by waiting for
every kernel queued before it: under async scheduling (``Engine._step_ahead``) that would make the host wait
for the step in flight before it could launch the next one. Values staged in pinned memory are copied behind
the queued work instead (the pinned block is not reused before its copy has run: torch's caching host
allocator records the copy).
"""

from __future__ import annotations

import torch


def device_values(values: list | tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``; on CUDA copied from pinned memory without waiting for the device."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def device_index(rows_and_columns: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two lists of as many indices, rows then columns, as index tensors on ``device`` (one copy for both)."""
    rows, columns = device_values(rows_and_columns, torch.long, device)
    return rows, columns


def device_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA copied through pinned memory without waiting for the device."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor copied into pinned host memory behind the device's queued work: valid once an event
    recorded after this call has passed. Off CUDA, the tensor itself."""
    if tensor.device.type != "cuda":
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)
