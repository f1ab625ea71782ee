"""Received KV written straight into reserved blocks (``engine/kv_import.py``): in any chunking, for every
KV format, the blocks end up exactly as ``import_blocks`` of the whole payload leaves them, and nothing
outside them changes."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache
from engine.kv_import import BlockImport, as_uint8
from engine.loader import load_model, resolve_model_dir
from engine.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.timeout(120)

FORMATS = ("auto", "int8", "fp8", "kivi2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TIDEPOOL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield load_model(resolve_model_dir("tiny"), "float32", "cpu")
    mp.undo()


def computed_payload(tiny, fmt: str) -> tuple[torch.Tensor, ModelRunner]:
    """The payload of a 40-token prompt's 3 blocks (2 full, one open: fp8/kivi2 carry its window)."""
    model, cfg = tiny
    runner = ModelRunner(model, cfg, KVCache(cfg, 8, 16, torch.float32, "cpu", fmt))
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    runner.run([SeqChunk(prompt, 0, [2, 0, 5, 6])])
    return runner.kv_cache.export_blocks([2, 0, 5]), runner


def fresh(tiny, fmt: str, dtype: torch.dtype) -> KVCache:
    cache = KVCache(tiny[1], 8, 16, dtype, "cpu", fmt)
    if fmt == "auto":
        cache.data.normal_()  # blocks outside the lease hold someone's KV: they must stay as they are
    else:
        cache.data.random_(0, 256)
    return cache


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
    data = as_uint8(payload.contiguous())
    assert arrival.total_bytes == len(data)
    step = {"whole": len(data), "columns": arrival.column_bytes, "ragged": 3 * arrival.column_bytes // 2 + 7}
    for start in range(0, len(data), step[chunking]):
        # gRPC hands over host buffers (memoryviews); the collective, tensors
        piece = data[start:start + step[chunking]]
        arrival.write(start, memoryview(piece.numpy()) if start % 2 else piece)
    assert arrival.needs_engine_thread == (fmt in ("fp8", "kivi2"))  # only windows touch engine state
    arrival.finish()

    assert torch.equal(got.data, want.data)  # the lease's blocks, and every other block untouched
    if want.windows is not None:
        assert want.windows.slot(1) >= 0 and got.windows.slot(1) >= 0
        assert torch.equal(got.windows.data[:, :, got.windows.slot(1)], want.windows.data[:, :, want.windows.slot(1)])
        assert got.windows.slot(7) == got.windows.slot(3) == -1


def test_decoding_continues_from_blocks_written_as_they_arrived(tiny):
    model, cfg = tiny
    payload, prefill = computed_payload(tiny, "auto")
    decode = ModelRunner(model, cfg, KVCache(cfg, 8, 16, torch.float32, "cpu"))
    arrival = BlockImport(decode.kv_cache, [7, 3, 1])
    data = as_uint8(payload)
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
