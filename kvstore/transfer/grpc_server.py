"""The receiving side of the gRPC KV transfer: a decode worker's server, closed to strangers and unstarvable.

Every stream must carry the cluster's secret as ``authorization: Bearer <secret>`` metadata, checked
before anything is read; a stream that sends no header within ``header_timeout_s`` ends with
DEADLINE_EXCEEDED; a malformed message ends it with INVALID_ARGUMENT; at most ``max_streams`` transfers
write at once and ``max_queued`` more wait, any further one is refused at once with RESOURCE_EXHAUSTED.
The server runs on its own asyncio loop, so a stream waiting for its sender holds no thread.

A stream's chunks go straight into its sink's writer (see sink.py), which is committed only after every
byte arrived and the checksum matched; any other end (bad data, cancel, deadline, dead client, stop)
aborts it, so the reserved blocks are freed. The protocol itself is described in grpc.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from kvstore.transfer import TransferRejected
from kvstore.transfer.sink import KVSink, KVWriter
from kvstore.transfer.wire import MAX_CHUNK_BYTES, TransferHeader, checksum
from tidepool.v1 import kv_transfer_pb2

# A data chunk plus room for the header chunk's block hashes (~100k of them).
_MAX_MESSAGE = MAX_CHUNK_BYTES + (1 << 20)
OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE),
           # A stream window far above the 64 KiB default: loopback and LAN links idle without it.
           ("grpc.http2.lookahead_bytes", 64 << 20), ("grpc.http2.max_frame_size", (16 << 20) - 1)]
SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
_AUTH_KEY = "authorization"
_CANCEL_GRACE_S = 0.2


def auth_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a push carries so the receiver accepts it (none without a secret)."""
    return ((_AUTH_KEY, f"Bearer {secret}"),) if secret else ()


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


@dataclass(frozen=True)
class ServerLimits:
    """What one KV transfer server accepts at once, and how long it waits for a sender."""

    max_streams: int = 8  # transfers writing into the sink at once (each holds a staging buffer)
    max_queued: int = 16  # transfers waiting for a slot (their bytes wait in HTTP/2 flow control)
    max_open: int = 64  # streams open at once, those still waiting for their header included
    header_timeout_s: float = 5.0  # a stream without its header by then is closed
    max_transfer_s: float = 600.0  # the longest a transfer may take whatever deadline its sender set


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _parse(raw: bytes) -> kv_transfer_pb2.KVChunk:
    try:
        return kv_transfer_pb2.KVChunk.FromString(raw)
    except DecodeError as exc:  # garbage on the port: never reaches the sink
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed chunk: {exc}") from exc


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while pos < len(raw) and shift < 64:
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos
    return -1, pos  # cut short or too long: not a fast-path chunk


def _data_chunk(raw: bytes) -> tuple[int, memoryview] | None:
    """Offset and data of a chunk in exactly the form ``grpc.encode_data_chunk`` writes (fields 2 and 3,
    nothing else), the data a view of ``raw``; None for any other message. The generated parser would copy
    every payload byte twice more."""
    if len(raw) < 4 or raw[0] != 0x10:
        return None
    offset, pos = _read_varint(raw, 1)
    if offset < 0 or pos >= len(raw) or raw[pos] != 0x1A:
        return None
    size, pos = _read_varint(raw, pos + 1)
    return (offset, memoryview(raw)[pos:]) if size == len(raw) - pos else None


class _Receipt:
    """One stream's chunks, checked against its header as they are written into the writer."""

    def __init__(self, header: TransferHeader, writer: KVWriter) -> None:
        self.header, self.writer = header, writer
        self.received, self.crc, self.sent_crc = 0, 0, None

    def add_raw(self, raw: bytes) -> None:
        fast = _data_chunk(raw)
        if fast is not None:
            self.add(*fast)
        else:
            chunk = _parse(raw)
            self.add(chunk.offset, memoryview(chunk.data), chunk.checksum if chunk.HasField("checksum") else None)

    def add(self, offset: int, data: memoryview, sent_crc: int | None = None) -> None:
        received, header = self.received, self.header
        end = received + len(data)
        if offset != received or len(data) > MAX_CHUNK_BYTES or end > header.total_bytes:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"chunk of {len(data)} B at offset "
                           f"{offset}, expected <= {MAX_CHUNK_BYTES} B at {received}")
        layer = header.layer_bytes
        if data and received // layer != (end - 1) // layer and (received % layer or end % layer):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"chunk at {received} cuts a layer boundary")
        if data:
            self.writer.write(received, data)
            self.crc = checksum(data, self.crc)
            self.received = end
        if sent_crc is not None:
            self.sent_crc = sent_crc

    @property
    def complete(self) -> bool:
        return self.received == self.header.total_bytes and self.sent_crc is not None

    def verify(self) -> int:
        received, total, crc, sent_crc = self.received, self.header.total_bytes, self.crc, self.sent_crc
        if received != total or sent_crc is None:
            raise _Refused(grpc.StatusCode.DATA_LOSS, f"stream ended after {received} of {total} B"
                           + ("" if sent_crc is not None else " without a checksum"))
        if crc != sent_crc or self.header.checksum not in (0, crc):
            raise _Refused(grpc.StatusCode.DATA_LOSS, f"checksum mismatch: received {crc:#x}, sender said "
                           f"{sent_crc:#x} (header {self.header.checksum:#x})")
        return received


def _failure(exc: BaseException, context: grpc.aio.ServicerContext,
             limits: ServerLimits) -> tuple[grpc.StatusCode | None, str]:
    """The status and reason a failed receive ends with (no status: an unexpected error, which goes on)."""
    remaining = context.time_remaining()
    # When the client cancels or its deadline passes, the stream may look merely cut short (EOF).
    if remaining is not None and remaining < 0.1:
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed"
    if isinstance(exc, asyncio.CancelledError) or context.cancelled():  # the client left, or we stop
        return grpc.StatusCode.CANCELLED, "sender cancelled"
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed (the receiver's {limits.max_transfer_s} s)"
    if isinstance(exc, _Refused):
        return exc.code, str(exc)
    if isinstance(exc, TransferRejected):  # the sink gave up mid-stream, e.g. its lease ran out
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    return None, f"receive failed: {exc!r}"


class KVTransferServer:
    """The decode worker's KV transfer endpoint, bound to ``host`` only (the address its peers use).

    ``secret``: pushes must carry it (see ``auth_metadata``); required unless ``host`` is a loopback
    address (tests and benchmarks on one machine).
    """

    def __init__(self, sink: KVSink, host: str = "127.0.0.1", port: int = 0, secret: str | None = None,
                 limits: ServerLimits | None = None) -> None:
        if not secret and not is_loopback(host):
            raise ValueError(f"a KV transfer server on {host} (not loopback) needs a secret")
        self._sink, self.host, self.limits = sink, host, limits or ServerLimits()
        self._expected = f"Bearer {secret}".encode() if secret else None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-transfer", daemon=True)
        self._thread.start()
        self._waiting = 0
        self._server, self.port = self._call(self._create(port))

    def _call(self, coro, timeout_s: float | None = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _create(self, port: int) -> tuple[grpc.aio.Server, int]:
        self._slots = asyncio.Semaphore(self.limits.max_streams)
        server = grpc.aio.server(options=OPTIONS, maximum_concurrent_rpcs=self.limits.max_open)
        # Raw bytes in: a malformed message is ours to refuse (INVALID_ARGUMENT), not gRPC's INTERNAL.
        push = grpc.stream_unary_rpc_method_handler(self._push, request_deserializer=None,
                                                    response_serializer=kv_transfer_pb2.KVAck.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Push": push}),))
        return server, server.add_insecure_port(f"{self.host}:{port}")

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def queued(self) -> int:
        """Transfers waiting for a slot right now."""
        return self._waiting

    def start(self) -> KVTransferServer:
        self._call(self._server.start())
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (streams still open are cancelled after ``grace_s``, their writers aborted)."""
        if self._thread.is_alive():
            self._call(self._server.stop(grace_s), None)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    # ---- one stream ------------------------------------------------------------------------------------
    async def _push(self, request_iterator, context: grpc.aio.ServicerContext) -> kv_transfer_pb2.KVAck:
        if self._expected is not None and not self._authorized(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong transfer secret")
        try:
            raw = await asyncio.wait_for(context.read(), self.limits.header_timeout_s)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no header within {self.limits.header_timeout_s} s")
        try:
            if raw is grpc.aio.EOF:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "the stream ended before its header")
            first = _parse(raw)
            if not first.HasField("header"):
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "the first chunk must carry the header")
            header = TransferHeader.from_proto(first.header)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad header: {exc}")
        except _Refused as exc:
            await context.abort(exc.code, str(exc))
        async with self._slot(context):
            try:
                writer = self._sink.begin(header)
            except TransferRejected as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            received = await self._fill(header, writer, first, context)
        return kv_transfer_pb2.KVAck(request_id=header.request_id, received_bytes=received, ok=True)

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        given = next((v for k, v in context.invocation_metadata() or () if k == _AUTH_KEY), "")
        return hmac.compare_digest(str(given).encode(), self._expected)

    @contextlib.asynccontextmanager
    async def _slot(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """One of ``max_streams`` places to write; up to ``max_queued`` streams wait, more are refused."""
        if self._slots.locked() and self._waiting >= self.limits.max_queued:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"receiver busy: {self.limits.max_streams} transfers running, "
                                f"{self._waiting} waiting")
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            yield
        finally:
            self._slots.release()

    async def _fill(self, header: TransferHeader, writer: KVWriter, first: kv_transfer_pb2.KVChunk,
                    context: grpc.aio.ServicerContext) -> int:
        """Receive the payload into ``writer`` and commit it; every other way out aborts the writer."""
        receipt = _Receipt(header, writer)
        try:
            async with asyncio.timeout(self.limits.max_transfer_s):
                receipt.add(first.offset, memoryview(first.data),
                            first.checksum if first.HasField("checksum") else None)
                while (raw := await context.read()) is not grpc.aio.EOF:
                    receipt.add_raw(raw)
                if not receipt.complete:
                    # A sender that cancels ends its stream as if it had finished early, and the cancellation
                    # follows a moment later: give it that moment, to report the right reason.
                    await asyncio.sleep(_CANCEL_GRACE_S)
            received = receipt.verify()
        except BaseException as exc:
            code, reason = _failure(exc, context, self.limits)
            writer.abort(reason)
            if code is None or isinstance(exc, asyncio.CancelledError):  # a cancelled call has no status to send
                raise
            await context.abort(code, f"{header.request_id}: {reason}")
        try:
            # Queued before the await and shielded: a sender that leaves now (its ack no longer awaited)
            # must not cancel the commit before it runs, or the writer would never end and its lease stay
            # claimed. The commit may wait for the engine to import the blocks.
            await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, writer.commit))
        except TransferRejected as exc:  # e.g. the reservation's lease ran out meanwhile
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return received
