"""gRPC KV transfer on loopback into a real TensorSink: exact copies, checksum, deadline and cancel aborts.

The port's guards (secret, header deadline, garbage, limits, bind address) are in test_internal_ports.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from kvstore.transfer import TransferCancelled, TransferRejected, TransferTimeout
from kvstore.transfer.grpc import KVTransferClient, KVTransferServer, chunk_stream, encode_data_chunk
from kvstore.transfer.sink import TensorSink
from kvstore.transfer.wire import MAX_CHUNK_BYTES, LayerFeed, TransferHeader
from tidepool.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

# [layers, 2, blocks, block_size, kv_heads, head_dim]: 5 MiB per float32 layer, so layers span chunks.
SHAPE = (3, 2, 80, 16, 8, 64)
assert SHAPE[1] * SHAPE[2] * SHAPE[3] * SHAPE[4] * SHAPE[5] * 4 > MAX_CHUNK_BYTES


class MidStreamSink(TensorSink):
    """A TensorSink that signals when a transfer has begun, so a test can act mid-stream."""

    def __init__(self) -> None:
        super().__init__()
        self.began = threading.Event()

    def begin(self, header):
        writer = super().begin(header)
        self.began.set()
        return writer


@pytest.fixture
def sink():
    return MidStreamSink()


SECRET = "transfer-test-secret"
AUTH = (("authorization", f"Bearer {SECRET}"),)


@pytest.fixture
def target(sink):
    server = KVTransferServer(sink, secret=SECRET).start()
    yield server.target
    server.stop()


@pytest.fixture
def client(target):
    client = KVTransferClient(target, SECRET)
    yield client
    client.close()


def kv(dtype=torch.float32, seed=0):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("offset,size", [(0, 0), (5, 3), (2**40 + 7, 300)])
def test_hand_encoded_data_chunk_is_a_valid_kvchunk(offset, size):
    data = bytes(range(256)) * 2
    chunk = kv_transfer_pb2.KVChunk.FromString(encode_data_chunk(offset, memoryview(data[:size])))
    assert (chunk.offset, chunk.data, chunk.HasField("header"), chunk.HasField("checksum")) == \
        (offset, data[:size], False, False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", [SHAPE, (8, 2, 4, 16, 2, 8)])  # big layers split; small ones share chunks
def test_push_of_a_whole_tensor_lands_exactly_in_the_sink(sink, client, shape):
    source = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    sink.expect("r1", torch.empty_like(source))
    header = TransferHeader.describe("r1", "tiny", source.shape, source.dtype, block_hashes=[11, 12])
    ack = client.push(header, source, timeout_s=30)
    assert ack.ok and ack.received_bytes == header.total_bytes
    outcome = sink.wait("r1", 10)
    assert outcome.committed and torch.equal(outcome.tensor, source)


@pytest.mark.timeout(60)
def test_layerwise_push_streams_layers_as_they_are_produced(sink, client):
    source = kv(torch.bfloat16, seed=1)
    sink.expect("r2", torch.empty_like(source))
    header = TransferHeader.describe("r2", "tiny", source.shape, source.dtype, layerwise=True)
    feed = LayerFeed()
    call = client.start_push(header, feed, timeout_s=30)
    for layer in source:  # the producer (a prefill's on_layer_done) runs while the stream is open
        feed.put(layer.clone())
    feed.close()
    assert call.result().received_bytes == header.total_bytes
    outcome = sink.wait("r2", 10)
    assert outcome.committed and torch.equal(outcome.tensor, source)


@pytest.mark.timeout(60)
def test_push_without_a_reservation_is_rejected(client):
    source = kv()
    with pytest.raises(TransferRejected, match="no reservation"):
        client.push(TransferHeader.describe("nobody", "tiny", source.shape, source.dtype), source, 30)


@pytest.mark.timeout(60)
def test_corrupted_chunk_fails_the_checksum_and_nothing_is_committed(sink, target):
    source = kv(seed=2)
    sink.expect("r3", torch.empty_like(source))
    header = TransferHeader.describe("r3", "tiny", source.shape, source.dtype)

    def corrupted():
        for i, raw in enumerate(chunk_stream(header, source)):
            chunk = kv_transfer_pb2.KVChunk.FromString(raw)
            if i == 2:  # flip one bit of a data chunk after the sender checksummed it
                data = bytearray(chunk.data)
                data[12345] ^= 0x10
                chunk.data = bytes(data)
            yield chunk

    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as err:
        kv_transfer_pb2_grpc.KVTransferStub(channel).Push(corrupted(), timeout=30, metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    outcome = sink.wait("r3", 10)
    assert not outcome.committed and "checksum" in outcome.reason


@pytest.mark.timeout(60)
def test_deadline_passing_mid_stream_aborts_the_writer(sink, client):
    source = kv(seed=3)
    sink.expect("r4", torch.empty_like(source))
    header = TransferHeader.describe("r4", "tiny", source.shape, source.dtype, layerwise=True)
    feed = LayerFeed()
    feed.put(source[0])  # the producer stalls after one layer
    with pytest.raises(TransferTimeout):
        client.push(header, feed, timeout_s=3.0)
    outcome = sink.wait("r4", 10)
    assert not outcome.committed and "deadline" in outcome.reason
    feed.close()


@pytest.mark.timeout(60)
def test_cancel_mid_stream_aborts_the_writer(sink, client):
    source = kv(seed=4)
    sink.expect("r5", torch.empty_like(source))
    header = TransferHeader.describe("r5", "tiny", source.shape, source.dtype, layerwise=True)
    feed = LayerFeed()
    feed.put(source[0])
    call = client.start_push(header, feed, timeout_s=30)
    assert sink.began.wait(10)
    call.cancel()
    with pytest.raises(TransferCancelled):
        call.result()
    outcome = sink.wait("r5", 10)
    assert not outcome.committed and "cancel" in outcome.reason
    feed.close()


@pytest.mark.timeout(60)
def test_a_sender_leaving_while_the_commit_waits_its_turn_still_gets_it_committed(sink):
    """Every byte arrived and matched its checksum, and the sender cancels before its ack while the commit
    still waits for a worker thread: the commit runs all the same, so the writer ends and its reservation
    is not left claimed for good (a cancelled commit would never end it at all)."""
    server = KVTransferServer(sink).start()
    pool, held = ThreadPoolExecutor(1), threading.Event()
    # The server loop's one worker thread, held: its commit has to wait in the queue.
    server._loop.call_soon_threadsafe(server._loop.set_default_executor, pool)
    pool.submit(held.wait)
    client = KVTransferClient(server.target)
    try:
        source = kv(seed=8)[:, :, :4]
        sink.expect("late", torch.empty_like(source))
        call = client.start_push(TransferHeader.describe("late", "tiny", source.shape, source.dtype), source, 30)
        assert sink.began.wait(10)
        time.sleep(1.0)  # every chunk is in: the server awaits the commit
        call.cancel()
        with pytest.raises(TransferCancelled):
            call.result()
        time.sleep(0.5)  # the cancel reaches the server
        held.set()
        outcome = sink.wait("late", 10)
        assert outcome.committed and torch.equal(outcome.tensor, source)
    finally:
        held.set()
        client.close()
        server.stop()
        pool.shutdown()


@pytest.mark.timeout(60)
def test_failing_layer_producer_cancels_the_push_and_aborts_the_writer(sink, client):
    source = kv(seed=5)
    sink.expect("r6", torch.empty_like(source))
    header = TransferHeader.describe("r6", "tiny", source.shape, source.dtype, layerwise=True)
    feed = LayerFeed()
    feed.put(source[0])
    call = client.start_push(header, feed, timeout_s=30)
    assert sink.began.wait(10)
    feed.fail(RuntimeError("prefill aborted"))
    with pytest.raises(TransferCancelled, match="prefill aborted"):
        call.result()
    assert not sink.wait("r6", 10).committed


@pytest.mark.timeout(60)
def test_chunk_cutting_a_layer_boundary_is_refused_and_the_writer_aborted(sink, target):
    source = torch.randn(3, 1024)  # 4 KiB per layer
    sink.expect("r7", torch.empty_like(source))
    header = TransferHeader.describe("r7", "tiny", source.shape, source.dtype)
    raw = source.numpy().tobytes()
    chunks = [kv_transfer_pb2.KVChunk(header=header.to_proto()),
              kv_transfer_pb2.KVChunk(offset=0, data=raw[:6144])]  # a layer and a half
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as err:
        kv_transfer_pb2_grpc.KVTransferStub(channel).Push(iter(chunks), timeout=30, metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    outcome = sink.wait("r7", 10)
    assert not outcome.committed and "layer boundary" in outcome.reason
