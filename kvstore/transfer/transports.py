"""Which transport carries a pair's KV (``--kv-transport``); torch-free to import, so configs can list them."""

from __future__ import annotations

TRANSPORTS = ("grpc", "collective", "ipc", "auto")


def _on_cuda(device: object) -> bool:
    return str(device).startswith("cuda")


def fallback_transport(prefill_device: object, decode_device: object) -> str:
    """What a pair uses when it cannot share memory: the collective where NCCL can join both ends, else gRPC."""
    import torch.distributed as dist  # only when a transfer is set up: this module stays torch-free

    both_cuda = _on_cuda(prefill_device) and _on_cuda(decode_device)
    return "collective" if both_cuda and dist.is_nccl_available() else "grpc"


def pick_transport(mode: str, prefill_device: object, decode_device: object, same_node: bool) -> str:
    """``grpc`` and ``collective`` as given. ``ipc`` (shared memory: CUDA IPC on GPUs, a host segment on
    CPUs, ``kvstore/transfer/ipc.py``) for a pair on one node, the fallback across nodes. ``auto``: ipc for
    a GPU pair on one node, else the fallback (NCCL for GPU pairs, gRPC for CPU and mixed pairs)."""
    if mode in ("grpc", "collective"):
        return mode
    if mode not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {mode!r} ({'|'.join(TRANSPORTS)})")
    if same_node and (mode == "ipc" or _on_cuda(prefill_device) and _on_cuda(decode_device)):
        return "ipc"
    return fallback_transport(prefill_device, decode_device)
