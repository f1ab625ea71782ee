"""Collective (gloo) KV transfer between two real Ray actors: exact copies, checksum, aborts, dead peer."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from kvstore.transfer import ChecksumMismatch, PeerLost, TransferCancelled, TransferError, TransferTimeout
from kvstore.transfer.collective import CollectiveChannel, backend_for
from kvstore.transfer.transports import pick_transport
from kvstore.transfer.wire import LayerFeed, TransferHeader, as_bytes

pytestmark = pytest.mark.ray
SHAPE = (4, 2, 6, 16, 2, 32)  # [layers, 2, blocks, block_size, kv_heads, head_dim]


def kv(seed: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class PieceLog:
    """A ``recv_into`` writer that places each piece into ``out`` and records where it went."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out, self.offsets = out, []

    def write(self, offset: int, data: torch.Tensor) -> None:
        self.offsets.append(offset)
        as_bytes(self.out)[offset:offset + data.numel()] = as_bytes(data)


class Peer:
    """One worker's end of a pair, as a Ray actor (the prefill/decode workers hold theirs the same way)."""

    def __init__(self, role: str, init_method: str = "tcp://127.0.0.1:0", check_on_device: bool = False) -> None:
        torch.set_num_threads(1)
        self.channel = CollectiveChannel(role, init_method, backend="gloo", timeout_s=30,
                                         check_on_device=check_on_device)

    def init_method(self) -> str:
        return self.channel.init_method

    def send(self, header: TransferHeader, seed: int, fail_after: int | None = None) -> str:
        source = kv(seed, header.torch_dtype, header.shape)
        payload = source
        if header.layerwise:  # the layers come from a producer, as from a prefill's on_layer_done
            payload = LayerFeed()
            for i, layer in enumerate(source):
                if i == fail_after:
                    payload.fail(RuntimeError("prefill aborted"))
                    break
                payload.put(layer)
            payload.close()
        try:
            self.channel.send(header, payload)
        except TransferError as exc:
            return type(exc).__name__
        return "sent"

    def send_one_layer_then_stall(self, header: TransferHeader) -> None:
        def layers():
            yield kv(0, header.torch_dtype)[0]
            self.stalled.set()  # layer 0 is on its way; the producer hangs until the actor is killed
            threading.Event().wait()

        self.stalled = threading.Event()
        self.channel.send(header, layers())

    def is_stalled(self) -> bool:
        return hasattr(self, "stalled") and self.stalled.wait(1.0)

    def recv(self, header: TransferHeader, timeout_s: float | None = None) -> torch.Tensor:
        return self.channel.recv(header, timeout_s=timeout_s)

    def recv_into(self, header: TransferHeader) -> tuple[torch.Tensor, list[int]]:
        log = PieceLog(torch.zeros(header.shape, dtype=header.torch_dtype))
        self.channel.recv_into(header, log)
        return log.out, log.offsets


def peer_actor(ray, max_concurrency: int = 1):
    # The test module is not importable in Ray's workers: ship Peer by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray.remote(num_cpus=0, max_concurrency=max_concurrency)(Peer)


@pytest.fixture(scope="module")
def pair(ray_session):
    ray = ray_session
    actor = peer_actor(ray)
    decode = actor.remote("decode")
    prefill = actor.remote("prefill", ray.get(decode.init_method.remote()))
    yield ray, prefill, decode
    ray.kill(prefill)
    ray.kill(decode)


@pytest.mark.timeout(120)
def test_the_device_side_check_nccl_uses_carries_exact_copies_and_catches_a_mismatch(ray_session):
    """The check computed where the bytes are (NCCL's), here on gloo: exact copies pass; a trailer that
    does not match what arrived (a sender checking the other way) is refused."""
    ray = ray_session
    actor = peer_actor(ray)
    decode = actor.remote("decode", check_on_device=True)
    prefill = actor.remote("prefill", ray.get(decode.init_method.remote()), check_on_device=True)
    try:
        for request_id, layerwise in (("dev-whole", False), ("dev-layers", True)):
            h = header(request_id, layerwise=layerwise)
            received = decode.recv.remote(h)
            assert ray.get(prefill.send.remote(h, seed=8)) == "sent"
            assert torch.equal(ray.get(received), kv(8))
    finally:
        ray.kill(prefill)
        ray.kill(decode)
    decode = actor.remote("decode", check_on_device=True)
    host_checked = actor.remote("prefill", ray.get(decode.init_method.remote()))  # CRC-32C in its trailer
    try:
        received = decode.recv.remote(header("dev-mixed"))
        ray.get(host_checked.send.remote(header("dev-mixed"), seed=9))
        with pytest.raises(ChecksumMismatch):
            ray.get(received)
    finally:
        ray.kill(host_checked)
        ray.kill(decode)


def header(request_id: str, dtype=torch.float32, layerwise=False, checksum=0, shape=SHAPE) -> TransferHeader:
    return TransferHeader.describe(request_id, "tiny", shape, dtype, layerwise=layerwise, checksum=checksum)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_send_recv_between_two_actors_equals_the_source(pair, layerwise, dtype):
    ray, prefill, decode = pair
    h = header(f"r-{layerwise}-{dtype}", dtype, layerwise)
    received = decode.recv.remote(h)
    assert ray.get(prefill.send.remote(h, seed=7)) == "sent"
    assert torch.equal(ray.get(received).view(torch.uint8), kv(7, dtype).view(torch.uint8))


@pytest.mark.timeout(120)
def test_recv_into_hands_every_piece_over_in_order_through_rotating_buffers(pair):
    ray, prefill, decode = pair
    shape = (12, *SHAPE[1:])  # 12 layer-wise pieces: the 4 receive buffers are each reused 3 times
    h = header("r-pieces", layerwise=True, shape=shape)
    received = decode.recv_into.remote(h)
    assert ray.get(prefill.send.remote(h, seed=5)) == "sent"
    out, offsets = ray.get(received)
    assert offsets == [layer * h.layer_bytes for layer in range(12)]
    assert torch.equal(out, kv(5, shape=shape))
    bad = header("r-pieces-bad", layerwise=True, shape=shape, checksum=1)  # the receiver expects other bytes
    received = decode.recv_into.remote(bad)
    ray.get(prefill.send.remote(header("r-pieces-bad", layerwise=True, shape=shape), seed=6))
    with pytest.raises(ChecksumMismatch):
        ray.get(received)


@pytest.mark.timeout(120)
def test_wrong_checksum_is_refused_and_the_channel_still_works(pair):
    ray, prefill, decode = pair
    bad = header("r-bad", checksum=12345)
    received = decode.recv.remote(bad)
    ray.get(prefill.send.remote(header("r-bad"), seed=1))  # the receiver was promised other bytes
    with pytest.raises(ChecksumMismatch):
        ray.get(received)
    good = header("r-after-bad", layerwise=True)
    received = decode.recv.remote(good)
    ray.get(prefill.send.remote(good, seed=2))
    assert torch.equal(ray.get(received), kv(2))


@pytest.mark.timeout(120)
def test_failing_layer_producer_cancels_on_both_sides_and_the_channel_still_works(pair):
    ray, prefill, decode = pair
    h = header("r-abort", layerwise=True)
    received = decode.recv.remote(h)
    assert ray.get(prefill.send.remote(h, seed=3, fail_after=2)) == "TransferCancelled"
    with pytest.raises(TransferCancelled):
        ray.get(received)
    good = header("r-after-abort")
    received = decode.recv.remote(good)
    ray.get(prefill.send.remote(good, seed=4))
    assert torch.equal(ray.get(received), kv(4))


def stalled_pair(ray, request_id: str):
    """A pair whose prefill sent layer 0 of ``request_id`` and then stalls; decode is receiving it."""
    actor = peer_actor(ray, max_concurrency=2)  # so is_stalled answers while send blocks
    decode = actor.remote("decode")
    prefill = actor.remote("prefill", ray.get(decode.init_method.remote()))
    h = header(request_id, layerwise=True)
    return prefill, decode, h


@pytest.mark.timeout(120)
def test_dead_peer_surfaces_peer_lost_and_the_channel_stays_down(ray_session):
    ray = ray_session
    prefill, decode, h = stalled_pair(ray, "r-dead")
    received = decode.recv.remote(h)
    prefill.send_one_layer_then_stall.remote(h)
    while not ray.get(prefill.is_stalled.remote(), timeout=60):
        pass
    ray.kill(prefill)  # mid-transfer: layer 0 sent, the rest never comes
    with pytest.raises(PeerLost):
        ray.get(received, timeout=90)
    with pytest.raises(PeerLost):
        ray.get(decode.recv.remote(header("r-next")), timeout=30)
    ray.kill(decode)


@pytest.mark.timeout(120)
def test_stalled_peer_times_out_and_the_channel_stays_down(ray_session):
    ray = ray_session
    prefill, decode, h = stalled_pair(ray, "r-stall")
    received = decode.recv.remote(h, timeout_s=5)
    prefill.send_one_layer_then_stall.remote(h)
    with pytest.raises(TransferTimeout):
        ray.get(received, timeout=90)
    with pytest.raises(PeerLost):
        ray.get(decode.recv.remote(header("r-next")), timeout=30)
    ray.kill(prefill)
    ray.kill(decode)


@pytest.mark.timeout(30)
def test_pick_transport_uses_collective_only_where_nccl_can_join_and_ipc_only_within_a_node():
    nccl = "collective" if torch.distributed.is_nccl_available() else "grpc"
    assert pick_transport("grpc", "cuda:0", "cuda:1", same_node=True) == "grpc"
    assert pick_transport("collective", "cpu", "cpu", same_node=True) == "collective"
    assert pick_transport("auto", "cpu", "cpu", same_node=True) == "grpc"  # CPU pairs keep gRPC by default
    assert pick_transport("auto", "cuda:0", "cpu", same_node=True) == "grpc"
    assert pick_transport("auto", "cuda:0", "cuda:1", same_node=True) == "ipc"
    assert pick_transport("auto", "cuda:0", "cuda:1", same_node=False) == nccl
    assert pick_transport("ipc", "cpu", "cpu", same_node=True) == "ipc"
    assert pick_transport("ipc", "cpu", "cpu", same_node=False) == "grpc"  # across nodes: the fallback
    assert pick_transport("ipc", "cuda:0", "cuda:0", same_node=False) == nccl
    with pytest.raises(ValueError, match="carrier-pigeon"):
        pick_transport("carrier-pigeon", "cpu", "cpu", same_node=True)
    assert (backend_for("cpu"), backend_for("cuda:1")) == ("gloo", "nccl")
