"""KV cache hand-off from a prefill worker to a decode worker: wire format, gRPC stream, torch collectives,
shared memory (CUDA IPC) within a node.

Import the backends from their modules (``kvstore.transfer.grpc``, ``kvstore.transfer.collective``,
``kvstore.transfer.ipc``); this package itself holds only the error family, so catching a transfer failure
does not pull in torch.
"""

from __future__ import annotations


class TransferError(Exception):
    """A KV transfer failed; the receiving side has discarded (or never committed) the bytes."""


class TransferRejected(TransferError):
    """The receiver refused the transfer: no reservation for the request, or a shape/dtype/size mismatch."""


class IpcUnavailable(TransferRejected):
    """This pair cannot share memory (different nodes, a GPU the receiver cannot see, no room in /dev/shm):
    nothing was written; the sender hands the same KV over another transport."""


class ChecksumMismatch(TransferError):
    """The bytes received are not the bytes sent (or the sender's header promised other bytes)."""


class TransferTimeout(TransferError):
    """The transfer's deadline passed before every byte was received and committed."""


class TransferCancelled(TransferError):
    """The sender cancelled the transfer (or its payload iterator failed) before the end."""


class PeerLost(TransferError):
    """The other side is unreachable or died; a collective channel is unusable from then on."""


__all__ = ["ChecksumMismatch", "IpcUnavailable", "PeerLost", "TransferCancelled", "TransferError", "TransferRejected",
           "TransferTimeout"]
