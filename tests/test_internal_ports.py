"""The cluster's internal ports are closed to strangers and cannot be starved.

A real KV transfer server (and, at the end, a live cluster's decode worker): pushes without the cluster
secret are refused before anything is read, idle streams are closed at the header deadline, garbage is
refused, excess transfers are refused at once, and the listeners bind only the address they are given.
"""

from __future__ import annotations

import socket
import threading

import grpc
import httpx
import pytest
import torch
from live_helpers import idle as server_idle
from live_helpers import wait_until

from kvstore.transfer import PeerLost, TransferRejected, TransferTimeout
from kvstore.transfer.grpc import KVTransferClient, KVTransferServer, ServerLimits
from kvstore.transfer.sink import TensorSink
from kvstore.transfer.wire import LayerFeed, TransferHeader
from tidepool.v1 import kv_transfer_pb2

SECRET = "ports-test-secret"
HEADER_TIMEOUT_S = 5.0


class RecordingSink(TensorSink):
    """A TensorSink that records every transfer it was asked to begin (accepted or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.begun: list[str] = []

    def begin(self, header):
        self.begun.append(header.request_id)
        return super().begin(header)


@pytest.fixture
def sink():
    return RecordingSink()


@pytest.fixture
def server(sink):
    server = KVTransferServer(sink, secret=SECRET, limits=ServerLimits(header_timeout_s=HEADER_TIMEOUT_S)).start()
    yield server
    server.stop()


def payload(seed: int = 0, layers: int = 4) -> torch.Tensor:
    return torch.randn(layers, 2, 4, 16, 2, 8, generator=torch.Generator().manual_seed(seed))


def header_for(request_id: str, source: torch.Tensor, layerwise: bool = False) -> TransferHeader:
    return TransferHeader.describe(request_id, "tiny", source.shape, source.dtype, layerwise=layerwise)


class RawStreams:
    """Pushes written by hand (any bytes, any metadata) on one channel; ``release()`` ends the idle ones."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.push = self.channel.stream_unary("/tidepool.v1.KVTransfer/Push", request_serializer=None,
                                              response_deserializer=kv_transfer_pb2.KVAck.FromString)
        self._release = threading.Event()

    def idle(self, secret: str | None = SECRET, timeout_s: float = 60) -> grpc.Future:
        """A stream that opens and then sends nothing until released."""
        def nothing():
            self._release.wait()
            yield from ()
        return self.push.future(nothing(), timeout=timeout_s, metadata=_auth(secret))

    def send(self, messages: list[bytes], secret: str | None = SECRET, timeout_s: float = 60) -> grpc.Future:
        return self.push.future(iter(messages), timeout=timeout_s, metadata=_auth(secret))

    def close(self) -> None:
        self._release.set()
        self.channel.close()


def _auth(secret: str | None) -> tuple:
    return (("authorization", f"Bearer {secret}"),) if secret else ()


@pytest.fixture
def raw(server):
    streams = RawStreams(server.target)
    yield streams
    streams.close()


def code_of(future: grpc.Future, timeout_s: float = 30) -> grpc.StatusCode:
    try:
        future.result(timeout=timeout_s)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# ---- the secret --------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", [None, "wrong-secret"])
def test_push_without_the_secret_is_refused_and_nothing_is_written(sink, server, secret):
    source = payload()
    out = torch.zeros_like(source)
    sink.expect("r1", out)
    client = KVTransferClient(server.target, secret)
    try:
        with pytest.raises(TransferRejected, match="UNAUTHENTICATED"):
            client.push(header_for("r1", source), source, timeout_s=30)
    finally:
        client.close()
    assert sink.begun == [] and torch.count_nonzero(out) == 0
    # The reservation is still open: the cluster's own sender fills it.
    good = KVTransferClient(server.target, SECRET)
    try:
        assert good.push(header_for("r1", source), source, timeout_s=30).ok
    finally:
        good.close()
    assert torch.equal(sink.wait("r1", 10).tensor, source)


@pytest.mark.timeout(60)
def test_a_stream_without_the_secret_is_refused_without_waiting_for_it(server, raw):
    # It never sends a byte: refused at once, not at the header deadline.
    assert code_of(raw.idle(secret=None), timeout_s=HEADER_TIMEOUT_S / 2) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.timeout(30)
def test_a_server_off_loopback_needs_a_secret():
    with pytest.raises(ValueError, match="needs a secret"):
        KVTransferServer(TensorSink(), host="0.0.0.0")


# ---- idle streams and garbage --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_idle_and_garbage_streams_do_not_delay_a_real_transfer(sink, server, raw):
    idle = [raw.idle() for _ in range(10)]  # more than the transfer slots (8)
    garbage = [raw.send([b"\xff\xfenot a protobuf" * 8]) for _ in range(4)]
    no_header = raw.send([kv_transfer_pb2.KVChunk(offset=0, data=b"x").SerializeToString()])
    strangers = [raw.send([b"\x00" * 64], secret=None) for _ in range(4)]
    junk = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]  # not even HTTP/2
    for conn in junk:
        conn.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 4)

    source = payload(seed=1)
    sink.expect("real", torch.empty_like(source))
    client = KVTransferClient(server.target, SECRET)
    try:
        assert client.push(header_for("real", source, layerwise=True), source, timeout_s=30).ok
    finally:
        client.close()
    assert torch.equal(sink.wait("real", 10).tensor, source)
    assert not any(f.done() for f in idle), "the real transfer finished while the idle streams were still open"

    assert [code_of(f) for f in garbage] == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert code_of(no_header) == grpc.StatusCode.INVALID_ARGUMENT
    assert [code_of(f) for f in strangers] == [grpc.StatusCode.UNAUTHENTICATED] * 4
    assert [code_of(f) for f in idle] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 10
    assert sink.begun == ["real"]
    for conn in junk:
        conn.close()


# ---- limits --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_transfers_beyond_the_slots_and_the_queue_are_refused_at_once():
    sink = RecordingSink()
    server = KVTransferServer(sink, secret=SECRET, limits=ServerLimits(max_streams=1, max_queued=1)).start()
    client = KVTransferClient(server.target, SECRET)
    sources = {rid: payload(seed=i) for i, rid in enumerate(("running", "queued", "refused"))}
    feeds = {rid: LayerFeed() for rid in sources}
    try:
        for rid, source in sources.items():
            sink.expect(rid, torch.empty_like(source))
        calls = {}
        for rid in ("running", "queued"):
            feeds[rid].put(sources[rid][0])  # one layer in, then the producer stalls
            calls[rid] = client.start_push(header_for(rid, sources[rid], layerwise=True), feeds[rid], 30)
            assert wait_until(lambda rid=rid: rid in sink.begun or server.queued == 1, 10)
        assert sink.begun == ["running"] and server.queued == 1

        with pytest.raises(TransferRejected, match="RESOURCE_EXHAUSTED.*busy"):
            client.push(header_for("refused", sources["refused"]), sources["refused"], timeout_s=30)

        for rid in ("running", "queued"):  # the slot passes on in turn
            for layer in sources[rid][1:]:
                feeds[rid].put(layer)
            feeds[rid].close()
            assert calls[rid].result().ok
            assert torch.equal(sink.wait(rid, 10).tensor, sources[rid])
        assert sink.begun == ["running", "queued"]
    finally:
        client.close()
        server.stop()


# ---- bind addresses ------------------------------------------------------------------------------------------
def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.mark.timeout(30)
def test_the_transfer_server_binds_only_the_given_host(server):
    assert _reachable("127.0.0.1", server.port)
    assert not _reachable("127.0.0.2", server.port)  # the same machine, another address


@pytest.mark.timeout(30)
def test_another_loopback_address_is_reachable_when_bound_to_all():
    # The check above could not fail if 127.0.0.2 were unreachable here: a wildcard listener answers on it.
    with socket.create_server(("0.0.0.0", 0)) as listener:
        assert _reachable("127.0.0.2", listener.getsockname()[1])


@pytest.mark.timeout(30)
def test_the_collective_rendezvous_binds_only_the_given_host():
    from kvstore.transfer.collective import CollectiveChannel

    channel = CollectiveChannel("decode", "tcp://127.0.0.1:0", backend="gloo", timeout_s=10)
    try:
        port = int(channel.init_method.rsplit(":", 1)[1])
        assert _reachable("127.0.0.1", port)
        assert not _reachable("127.0.0.2", port)
    finally:
        channel.close()


# ---- a live decode worker ------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(240)
def test_a_live_decode_worker_serves_chats_while_strangers_and_idle_streams_hit_its_kv_port(live_server):
    decode = next(w for w in live_server.dispatcher.workers.values() if w.role == "decode")
    address = decode.info.kv_target.grpc_address
    host, port = address.rsplit(":", 1)
    assert host != "0.0.0.0" and not _reachable("127.0.0.3" if host == "127.0.0.2" else "127.0.0.2", int(port))
    secret = live_server.server.cluster.transfer_secret
    assert wait_until(lambda: server_idle(live_server))
    raw = RawStreams(address)
    try:
        idle = [raw.idle(secret) for _ in range(10)]  # more than the receiver's transfer slots
        garbage = [raw.send([b"\xff\xfenot a protobuf" * 8], secret) for _ in range(3)]
        strangers = [raw.idle(None), raw.idle("guessed"), raw.send([b"\x00" * 64], None)]

        body = {"model": live_server.model_id, "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        chat = httpx.post(f"{live_server.http_url}/v1/chat/completions", json=body, timeout=120)
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4

        assert [code_of(f) for f in strangers] == [grpc.StatusCode.UNAUTHENTICATED] * 3
        assert [code_of(f) for f in garbage] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
        assert [code_of(f) for f in idle] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 10
    finally:
        raw.close()
    assert wait_until(lambda: server_idle(live_server)), "a lease or block was left behind"


# ---- what the client is told -----------------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("cause,status,code", [
    (TransferTimeout("r1: DEADLINE_EXCEEDED: no header within 5 s from 192.0.2.9:4242"), 504, "kv_transfer_timeout"),
    (TransferRejected("r1: RESOURCE_EXHAUSTED: receiver busy at 192.0.2.9:4242"), 503, "kv_transfer_failed"),
    (PeerLost("tcp://192.0.2.9:4242: connection reset"), 503, "kv_transfer_failed"),
])
def test_a_failed_kv_handoff_is_a_503_or_504_with_retry_after_and_no_internal_address(cause, status, code):
    from ray.exceptions import RayTaskError

    from services.gateway.errors import classify
    from services.worker_client import raised_in_worker

    raised = raised_in_worker(RayTaskError("prefill", "traceback", cause, ip="192.0.2.9"))  # as the client raises it
    err = classify(raised)
    assert (err.http_status, err.code) == (status, code)
    assert err.retry_after_header() == "1"
    assert "192.0.2.9" not in err.message
