"""Received KV written straight into reserved blocks (``engine/kv_import.py``): in any chunking, for every
KV format, the blocks end up exactly as ``import_blocks`` of the whole payload leaves them, and nothing
outside them changes; through a decode worker's receiver, a corrupted push never fills its lease."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from receiver_helpers import SECRET, leased_receiver

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_cache import KVCache
from engine.kv_import import BlockImport
from engine.runner import ModelRunner, SeqChunk
from engine.sampling_params import SamplingParams
from kvstore.transfer import TransferRejected
from kvstore.transfer.grpc import KVTransferClient, chunk_stream
from kvstore.transfer.grpc_server import auth_metadata
from kvstore.transfer.wire import TransferHeader, flat_bytes
from tidepool.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

pytestmark = pytest.mark.timeout(120)

FORMATS = ("auto", "int8", "fp8", "kivi2", "kivi2+1")  # +1: kivi2 keeping one residual block's window


def cache(cfg, fmt: str, dtype: torch.dtype) -> KVCache:
    """A cache of 8 blocks of 16 tokens in ``fmt`` (``FORMAT+N``: N residual blocks)."""
    fmt, _, residual = fmt.partition("+")
    return KVCache(cfg, 8, 16, dtype, "cpu", fmt, residual_blocks=int(residual or 0))


def computed_payload(tiny, fmt: str) -> tuple[torch.Tensor, ModelRunner]:
    """The payload of a 40-token prompt's 3 blocks (2 full, one open: fp8/kivi2 carry its window, and with a
    residual block block 1's)."""
    model, cfg = tiny
    runner = ModelRunner(model, cfg, cache(cfg, fmt, torch.float32))
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    runner.run([SeqChunk(prompt, 0, [2, 0, 5, 6])])
    return runner.kv_cache.export_blocks([2, 0, 5]), runner


def fresh(tiny, fmt: str, dtype: torch.dtype) -> KVCache:
    kv = cache(tiny[1], fmt, dtype)
    if fmt == "auto":
        kv.data.normal_()  # blocks outside the lease hold someone's KV: they must stay as they are
    else:
        kv.data.random_(0, 256)
    return kv


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("chunking", ["whole", "columns", "ragged"])
def test_block_import_equals_import_blocks_in_any_chunking(tiny, fmt, chunking):
    if fmt == "auto":  # bf16 (random blocks): every dtype travels as bytes
        dtype, payload = torch.bfloat16, fresh(tiny, fmt, torch.bfloat16).export_blocks([2, 0, 5])
    else:
        dtype, payload = torch.float32, computed_payload(tiny, fmt)[0]
    want, got = fresh(tiny, fmt, dtype), fresh(tiny, fmt, dtype)
    got.data.copy_(want.data)
    table = [7, 3, 1]
    want.import_blocks(table, payload)

    arrival = BlockImport(got, table)
    data = flat_bytes(payload.contiguous())
    assert arrival.total_bytes == len(data)
    step = {"whole": len(data), "columns": arrival.column_bytes, "ragged": 3 * arrival.column_bytes // 2 + 7}
    for start in range(0, len(data), step[chunking]):
        # gRPC hands over host buffers (memoryviews); the collective, tensors
        piece = data[start:start + step[chunking]]
        arrival.write(start, memoryview(piece.numpy()) if start % 2 else piece)
    assert arrival.needs_engine_thread == (fmt != "auto" and fmt != "int8")  # only windows touch engine state
    arrival.finish()

    assert torch.equal(got.data, want.data)  # the lease's blocks, and every other block untouched
    if want.windows is not None:
        assert want.windows.slot(1) >= 0 and got.windows.slot(1) >= 0
        assert torch.equal(got.windows.data[:, :, got.windows.slot(1)], want.windows.data[:, :, want.windows.slot(1)])
        assert got.windows.slot(7) == -1
        if fmt.endswith("+1"):  # the residual block (0 on the prefill side) travelled with its window
            assert torch.equal(got.windows.data[:, :, got.windows.slot(3)], want.windows.data[:, :, want.windows.slot(3)])
        else:
            assert got.windows.slot(3) == -1


def test_decoding_continues_from_blocks_written_as_they_arrived(tiny):
    model, cfg = tiny
    payload, prefill = computed_payload(tiny, "auto")
    decode = ModelRunner(model, cfg, KVCache(cfg, 8, 16, torch.float32, "cpu"))
    arrival = BlockImport(decode.kv_cache, [7, 3, 1])
    data = flat_bytes(payload)
    for start in range(0, len(data), 1000):
        arrival.write(start, data[start:start + 1000])
    arrival.finish()
    ours, theirs = [17], [17]
    for step in range(6):
        ours.append(int(decode.run([SeqChunk(ours[-1:], 40 + step, [7, 3, 1, 4])])[0].argmax()))
        theirs.append(int(prefill.run([SeqChunk(theirs[-1:], 40 + step, [2, 0, 5, 6])])[0].argmax()))
    assert ours == theirs


def test_a_write_past_the_payload_is_refused(tiny):
    cache = KVCache(tiny[1], 8, 16, torch.float32, "cpu")
    arrival = BlockImport(cache, [1, 2])
    before = cache.data.clone()
    with pytest.raises(ValueError, match="overrun"):
        arrival.write(arrival.total_bytes - 4, torch.zeros(8, dtype=torch.uint8))
    assert torch.equal(cache.data, before)


@pytest.mark.timeout(120)
def test_a_corrupted_push_into_a_lease_is_refused_never_decoded_and_a_good_one_then_decodes_exactly(tiny):
    """Bytes land in the lease's blocks as they arrive, so a corrupt transfer did write into them: the
    lease must stay unfilled (no decode can take it), and a later good transfer into the same blocks
    decodes exactly as the prefill side would."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    prefill = Engine(EngineConfig(model="tiny", num_blocks=16))
    prefill.add_request("r", prompt, params, True)
    first = prefill.step()[0].new_token_ids[0]
    payload = prefill.kv_cache.export_blocks(prefill.request_block_ids("r"))
    cold = Engine(EngineConfig(model="tiny", num_blocks=16))
    cold.add_request("r", prompt, params)
    want = []
    while cold.has_unfinished():
        want += [t for o in cold.step() for t in o.new_token_ids]

    async def main() -> list[int]:
        async with leased_receiver("r", len(prompt)) as leased:
            engine, loop, receiver = leased.engine, leased.loop, leased.receiver
            header = TransferHeader.describe("r", engine.model_id, payload.shape, payload.dtype)
            target = receiver.grpc_address

            def corrupted():
                for i, raw in enumerate(chunk_stream(header, payload)):
                    chunk = kv_transfer_pb2.KVChunk.FromString(raw)
                    if i == 1:  # one flipped bit in the first data chunk, after the sender's checksum
                        data = bytearray(chunk.data)
                        data[4321] ^= 0x04
                        chunk.data = bytes(data)
                    yield chunk

            def push_corrupted() -> grpc.StatusCode:
                with grpc.insecure_channel(target) as channel:
                    try:
                        kv_transfer_pb2_grpc.KVTransferStub(channel).Push(
                            corrupted(), timeout=30, metadata=auth_metadata(SECRET))
                    except grpc.RpcError as exc:
                        return exc.code()
                return grpc.StatusCode.OK

            assert await asyncio.to_thread(push_corrupted) == grpc.StatusCode.DATA_LOSS
            with pytest.raises(TransferRejected, match="no filled KV lease"):
                receiver.take_filled_lease("r")
            client = KVTransferClient(target, SECRET)
            await asyncio.to_thread(client.push, header, payload, 30)
            client.close()
            lease = receiver.take_filled_lease("r")
            stream = loop.open_queue("r")
            await loop.acall(engine.add_imported_request, "r", prompt, first, params, lease.block_ids)
            out = [first]
            while True:
                o = await stream.get()
                out += o.new_token_ids
                if o.finished:
                    return out

    assert asyncio.run(main()) == want
