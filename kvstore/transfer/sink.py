"""Where received KV lands: the sink a decode worker hands the transfer server, and an in-memory one.

A sink owns the reservations. ``begin(header)`` finds the one for ``header.request_id`` (raising
``TransferRejected`` when there is none or it does not fit) and returns a writer; the transport then
calls ``write`` for every chunk in order and exactly one of ``commit`` (every byte arrived and the
checksum matched) or ``abort(reason)`` (anything else: the reservation should be freed).

The gRPC server calls ``begin``, ``write`` and ``abort`` on its event loop, so they must not block (a
copy into memory is fine); ``commit`` runs in a worker thread and may wait, e.g. for an engine's import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstore.transfer import TransferRejected
from kvstore.transfer.wire import TransferHeader, as_bytes


class KVWriter(Protocol):
    """Where one transfer's bytes land. Chunks arrive in order; each lies within a layer or holds whole layers."""

    def write(self, offset: int, data: memoryview) -> None: ...

    def commit(self) -> None: ...

    def abort(self, reason: str) -> None: ...


class KVSink(Protocol):
    """The decode worker's side: ``begin`` raises TransferRejected when nothing is reserved for the header."""

    def begin(self, header: TransferHeader) -> KVWriter: ...


@dataclass
class SinkOutcome:
    committed: bool
    reason: str = ""
    tensor: torch.Tensor | None = None


class TensorSink:
    """A KVSink that writes each expected request into its own CPU tensor (host staging, tests, benchmarks,
    prefix copies between workers)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._expected: dict[str, Callable[[TransferHeader], torch.Tensor]] = {}
        self._outcomes: dict[str, SinkOutcome] = {}

    def expect(self, request_id: str, out: torch.Tensor) -> None:
        """Reserve ``out`` (a contiguous CPU tensor) as the destination of one transfer of ``request_id``."""
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("a TensorSink writes into contiguous CPU tensors only")

        def exactly_out(header: TransferHeader) -> torch.Tensor:
            if tuple(out.shape) != header.shape or out.dtype != header.torch_dtype:
                raise TransferRejected(f"{header.request_id}: reserved {out.dtype} {list(out.shape)}, "
                                       f"header says {header.dtype} {list(header.shape)}")
            return out

        self.expect_sized(request_id, exactly_out)

    def expect_sized(self, request_id: str, destination: Callable[[TransferHeader], torch.Tensor]) -> None:
        """Expect one transfer of ``request_id`` whose size is known only from its header: ``destination``
        checks the header (raising TransferRejected) and returns a CPU tensor of its shape to write into."""
        with self._cond:
            self._expected[request_id] = destination

    def begin(self, header: TransferHeader) -> KVWriter:
        with self._cond:
            destination = self._expected.pop(header.request_id, None)
        if destination is None:
            raise TransferRejected(f"no reservation for request {header.request_id!r}")
        return _TensorWriter(self, header.request_id, destination(header))

    def wait(self, request_id: str, timeout_s: float) -> SinkOutcome:
        """Block until the transfer of ``request_id`` was committed or aborted, and forget it."""
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._outcomes, timeout_s):
                raise TimeoutError(f"no outcome for {request_id} after {timeout_s} s")
            return self._outcomes.pop(request_id)

    def forget(self, request_id: str) -> None:
        """Drop the expectation or outcome of ``request_id``, whichever is left (a transfer given up on)."""
        with self._cond:
            self._expected.pop(request_id, None)
            self._outcomes.pop(request_id, None)

    def _finish(self, request_id: str, outcome: SinkOutcome) -> None:
        with self._cond:
            self._outcomes[request_id] = outcome
            self._cond.notify_all()


class _TensorWriter:
    def __init__(self, sink: TensorSink, request_id: str, out: torch.Tensor) -> None:
        self._sink, self._request_id, self._out = sink, request_id, out
        self._bytes = as_bytes(out)  # zero-copy view: writes land in the tensor

    def write(self, offset: int, data: memoryview) -> None:
        self._bytes[offset:offset + len(data)] = data

    def commit(self) -> None:
        self._sink._finish(self._request_id, SinkOutcome(committed=True, tensor=self._out))

    def abort(self, reason: str) -> None:
        self._sink._finish(self._request_id, SinkOutcome(committed=False, reason=reason))
