"""KV between two processes on one node through CUDA IPC: the receiver maps the sender's device memory.

``share(tensor)`` describes a CUDA tensor so that another process on the same node can map it (a
``SharedTensor``: plain picklable fields, whatever carries it: a pipe, a Ray call, a gRPC header);
``open_shared`` maps it there, as a tensor over the sender's memory, which the receiver copies into its
own (e.g. its reserved KV blocks, on its own stream) and then drops. No byte crosses the host.

Lifetime rule: the sender keeps the tensor alive, and unchanged, until the receiver acks, and the receiver
acks only after its copy finished (its stream synchronised) and it dropped the mapped tensor. torch's
caching allocator would not hand the memory to another tensor while a mapping is open, but nothing stops
the sender from writing new bytes into a live tensor the receiver is still reading.

Ordering is taken care of: ``share`` records an event on the sender's current stream, and ``open_shared``
makes the receiver's current stream wait for it, so work queued before ``share`` (the export that filled
the tensor) is complete before any copy the receiver queues after ``open_shared``. Each share maps the
whole caching-allocator segment the tensor lives in (CUDA shares allocations, not tensors); the receiver
reads only the tensor's bytes. The mapping fails in the sender's own process and across nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import reduce_tensor


@dataclass(frozen=True)
class SharedTensor:
    """What another process needs to map a CUDA tensor: its description, and torch's IPC handles (the
    allocation's memory handle, the offset in it, a reference counter and the ready event)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: int
    nbytes: int
    rebuild: Callable[..., torch.Tensor]
    args: tuple


def share(tensor: torch.Tensor) -> SharedTensor:
    """Describe ``tensor`` (in CUDA memory) for ``open_shared`` in another process on this node. Keep the
    tensor alive and unchanged until that process acks (see the module's lifetime rule)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
        where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"CUDA IPC shares CUDA tensors only, not one on {where}")
    rebuild, args = reduce_tensor(tensor.detach())
    return SharedTensor(tuple(tensor.shape), tensor.dtype, tensor.device.index or 0,
                        tensor.numel() * tensor.element_size(), rebuild, args)


def open_shared(shared: SharedTensor) -> torch.Tensor:
    """Map a tensor another process shared: a tensor over the sender's device memory, its bytes ready for
    work queued on this process's current stream. Copy out of it, then drop it before acking."""
    if not torch.cuda.is_available():
        raise RuntimeError("a shared CUDA tensor can only be mapped by a process that sees a CUDA device")
    return shared.rebuild(*shared.args)
