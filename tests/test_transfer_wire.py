"""Wire format: header <-> protobuf, tensor <-> raw bytes for every KV dtype, checksums, layer iteration."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore.transfer import TransferError
from kvstore.transfer.wire import (
    LayerFeed,
    TransferHeader,
    as_bytes,
    checksum,
    device_checksum,
    payload_pieces,
    piece_ranges,
    tensor_from_bytes,
)
from tidepool.v1 import kv_transfer_pb2


@pytest.mark.timeout(30)
def test_header_survives_protobuf_round_trip():
    header = TransferHeader.describe("req-1", "tiny", (4, 2, 3, 16, 2, 8), torch.bfloat16,
                                     block_hashes=[1, 2**64 - 1, 12345], layerwise=True, checksum=77)
    wire = kv_transfer_pb2.KVHeader.FromString(header.to_proto().SerializeToString())
    assert TransferHeader.from_proto(wire) == header
    assert header.total_bytes == 4 * 2 * 3 * 16 * 2 * 8 * 2
    assert header.layer_bytes * header.num_layers == header.total_bytes


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field,value", [("total_bytes", 3), ("dtype", "object"), ("num_layers", 9),
                                         ("request_id", "")])
def test_header_with_inconsistent_fields_is_refused(field, value):
    msg = TransferHeader.describe("req-1", "tiny", (2, 4), torch.float32).to_proto()
    setattr(msg, field, value)
    with pytest.raises(ValueError):
        TransferHeader.from_proto(msg)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_bytes_round_trip_is_bit_exact(dtype):
    source = torch.randn(3, 2, 5, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    data = bytes(as_bytes(source))
    assert len(data) == source.numel() * source.element_size()
    back = tensor_from_bytes(data, str(dtype).removeprefix("torch."), source.shape)
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), source.view(torch.uint8))


@pytest.mark.timeout(30)
def test_as_bytes_of_a_contiguous_cpu_tensor_writes_through():
    out = torch.zeros(2, 3, dtype=torch.bfloat16)
    source = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    as_bytes(out)[:] = as_bytes(source)
    assert torch.equal(out, source)


@pytest.mark.timeout(30)
def test_checksum_is_streamable_and_sees_a_flipped_byte():
    data = bytes(range(256)) * 1000
    assert checksum(data[1000:], checksum(data[:1000])) == checksum(data)
    flipped = bytearray(data)
    flipped[777] ^= 1
    assert checksum(flipped) != checksum(data)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nbytes", [4096, 4099])  # a last partial word too
def test_device_checksum_sees_every_flipped_bit_and_moved_words(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    reference = device_checksum(data)
    assert torch.equal(device_checksum(data.clone()), reference)
    assert torch.equal(device_checksum(data.view(1, -1)), reference)  # the bytes count, not the shape
    rng = torch.Generator().manual_seed(2)
    for position in [0, nbytes - 1, *torch.randint(0, nbytes, (30,), generator=rng).tolist()]:
        for bit in (0, 7):
            flipped = data.clone()
            flipped[position] ^= 1 << bit
            assert not torch.equal(device_checksum(flipped), reference)
    swapped = data.clone()
    swapped[0:4], swapped[8:12] = data[8:12], data[0:4]
    assert not torch.equal(swapped, data) and not torch.equal(device_checksum(swapped), reference)


def test_layerwise_pieces_are_layers_and_a_wrong_layer_count_is_refused():
    source = torch.arange(24, dtype=torch.float32).view(3, 8)
    header = TransferHeader.describe("r", "tiny", source.shape, source.dtype, layerwise=True)
    assert [p.tolist() for p in payload_pieces(header, iter(source.unbind(0)), 1 << 20)] == source.tolist()
    with pytest.raises(TransferError):
        list(payload_pieces(header, iter([source[0], source[1]]), 1 << 20))
    with pytest.raises(TransferError):
        list(payload_pieces(header, iter([source[0], source[1], source[2, :4]]), 1 << 20))


@pytest.mark.timeout(30)
def test_whole_payload_pieces_group_whole_layers_up_to_the_piece_size():
    source = torch.arange(5 * 8, dtype=torch.float32).view(5, 8)  # 32 bytes per layer
    header = TransferHeader.describe("r", "tiny", source.shape, source.dtype)
    assert piece_ranges(header, 64) == [(0, 2), (2, 4), (4, 5)]
    assert piece_ranges(header, 16) == [(i, i + 1) for i in range(5)]  # a layer is never split
    assert torch.equal(torch.cat(list(payload_pieces(header, source, 64))), source)
    with pytest.raises(TransferError):
        list(payload_pieces(header, iter(source.unbind(0)), 64))  # only a layer-wise payload may stream


@pytest.mark.timeout(30)
def test_layer_feed_yields_layers_from_another_thread_and_reports_failure():
    feed = LayerFeed()
    layers = [torch.full((4,), float(i)) for i in range(3)]

    def produce():
        for layer in layers:
            feed.put(layer)
        feed.close()

    threading.Thread(target=produce).start()
    assert [t.tolist() for t in feed] == [t.tolist() for t in layers]

    failed = LayerFeed()
    failed.put(layers[0])
    failed.fail(RuntimeError("prefill aborted"))
    with pytest.raises(TransferError, match="prefill aborted"):
        list(failed)
