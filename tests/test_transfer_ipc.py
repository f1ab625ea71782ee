"""KV handed over in shared memory within a node (``kvstore/transfer/ipc.py``), host segments on the CPU:
another process copies a shared payload into its cache blocks exactly; a payload changed under the copy is
refused; the sender's close removes the segment, or keeps it for reuse after an ack; dead senders'
segments are removed; and a decode worker's receiver fills a lease from a share,
refuses one without a lease, and keeps the lease open for another transport when it cannot map the share.
(The CUDA IPC side of the same API is in test_gpu.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pickle
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import pytest
import torch
from receiver_helpers import SECRET, leased_receiver

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.kv_import import BlockImport
from kvstore.transfer import ChecksumMismatch, IpcUnavailable, TransferRejected
from kvstore.transfer.grpc import KVTransferClient
from kvstore.transfer.ipc import PayloadShare, SegmentPool, copy_shared
from kvstore.transfer.wire import TransferHeader, as_bytes, checksum

NUM_BLOCKS = 5
MODEL = ModelConfig("LlamaForCausalLM", 8, 16, 16, num_layers=3, num_heads=2, num_kv_heads=4, head_dim=8)


def _cache() -> KVCache:
    return KVCache(MODEL, 4 * NUM_BLOCKS, 16, torch.float32, "cpu")


# Another process (started on its own, as a Ray worker is, so it has its own multiprocessing resource
# tracker): a cache of its own, the shared payload (pickled on stdin) copied into the given blocks; prints
# the CRC-32C of those blocks in payload order.
_RECEIVER = """
import pickle, sys
from engine.kv_import import BlockImport
from kvstore.transfer.ipc import copy_shared
from kvstore.transfer.wire import as_bytes, checksum
from test_transfer_ipc import _cache
shared, block_ids = pickle.load(sys.stdin.buffer)
cache = _cache()
arrival = BlockImport(cache, block_ids)
copy_shared(shared, arrival)
arrival.finish()
print(checksum(as_bytes(cache.export_blocks(block_ids))))
"""


def _segment_exists(name: str) -> bool:
    try:
        segment = SharedMemory(name=name)
    except FileNotFoundError:
        return False
    segment.close()
    return True


@pytest.mark.timeout(60)
def test_another_process_copies_a_shared_payload_into_scattered_blocks_exactly():
    cache = _cache()
    payload = torch.randn(cache.payload_shape(NUM_BLOCKS))
    block_ids = random.Random(3).sample(range(4 * NUM_BLOCKS), NUM_BLOCKS)
    with PayloadShare(payload) as share:
        assert share.shared.nbytes == payload.numel() * 4 and share.shared.check == (checksum(as_bytes(payload)),)
        child = subprocess.run([sys.executable, "-c", _RECEIVER], input=pickle.dumps((share.shared, block_ids)),
                               capture_output=True, timeout=45, cwd=Path(__file__).parent, check=False)
        assert child.returncode == 0, child.stderr.decode()
        assert int(child.stdout) == checksum(as_bytes(payload))
        assert _segment_exists(share.shared.segment)  # the receiver's exit did not remove the sender's segment
    assert not _segment_exists(share.shared.segment)  # closing the share did


@pytest.mark.timeout(30)
def test_a_payload_changed_under_the_copy_is_refused_and_a_closed_or_foreign_share_is_not_mapped():
    cache = _cache()
    payload = torch.randn(cache.payload_shape(2))
    share = PayloadShare(payload)
    other = SharedMemory(name=share.shared.segment)  # a sender breaking the lifetime rule
    other.buf[100] ^= 0x01
    other.close()
    with pytest.raises(ChecksumMismatch, match="changed under the copy"):
        copy_shared(share.shared, BlockImport(cache, [0, 1]))
    share.close()
    share.close()  # idempotent
    with pytest.raises(IpcUnavailable, match="cannot map"):
        copy_shared(share.shared, BlockImport(cache, [0, 1]))
    with pytest.raises(TransferRejected, match="not a KV payload segment"):  # never any other file
        copy_shared(dataclasses.replace(share.shared, segment="../../etc/passwd"), BlockImport(cache, [0, 1]))


def _header(request_id: str, engine, num_blocks: int) -> TransferHeader:
    return TransferHeader.describe(request_id, engine.model_id, engine.kv_cache.payload_shape(num_blocks),
                                   engine.kv_cache.payload_dtype, kv_format=engine.kv_cache.kv_format)


@contextlib.asynccontextmanager
async def _lease_and_payload() -> AsyncIterator[tuple]:
    """(the receiver holding a lease, the header of a payload for it, a random payload)."""
    async with leased_receiver("leased", 40) as leased:
        header = _header("leased", leased.engine, len(leased.blocks))
        yield leased, header, torch.randn(header.shape).to(leased.engine.kv_cache.payload_dtype)


def _assert_filled_with(leased, payload: torch.Tensor) -> None:
    assert leased.receiver.take_filled_lease("leased").block_ids == leased.blocks
    assert torch.equal(leased.engine.kv_cache.export_blocks(leased.blocks), payload)


@pytest.mark.timeout(60)
def test_a_receiver_fills_its_lease_from_a_share_and_refuses_one_without_a_lease(tiny):
    async def main() -> None:
        async with _lease_and_payload() as (leased, header, payload):
            before = leased.engine.kv_cache.data.clone()
            stranger = _header("stranger", leased.engine, len(leased.blocks))
            with PayloadShare(payload) as share:
                with pytest.raises(TransferRejected, match="no open KV lease"):
                    await asyncio.to_thread(leased.receiver.receive_shared, stranger, share.shared)
                assert torch.equal(leased.engine.kv_cache.data, before)
                received = await asyncio.to_thread(leased.receiver.receive_shared, header, share.shared)
            assert received == header.total_bytes
            _assert_filled_with(leased, payload)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_share_the_receiver_cannot_map_leaves_the_lease_open_for_grpc(tiny):
    async def main() -> None:
        async with _lease_and_payload() as (leased, header, payload):
            share = PayloadShare(payload)
            share.close()  # what the receiver sees of a sender on another node, or one already gone
            with pytest.raises(IpcUnavailable):
                await asyncio.to_thread(leased.receiver.receive_shared, header, share.shared)
            client = KVTransferClient(leased.receiver.grpc_address, SECRET)  # the sender's fallback
            try:
                await asyncio.to_thread(client.push, header, payload, 30)
            finally:
                client.close()
            _assert_filled_with(leased, payload)

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_sender_reuses_acked_segments_within_its_idle_bound_and_removes_dead_senders_segments():
    pool = SegmentPool(max_idle_bytes=2 << 20)
    payload = torch.randn(1000)
    with PayloadShare(payload, pool) as share:
        first = share.shared.segment
    assert pool.idle_bytes == 1 << 20  # acked: back in the pool (1 MiB, the smallest size)
    with PayloadShare(torch.randn(3000), pool) as share:
        assert share.shared.segment == first  # reused: its pages are already faulted in
    with pytest.raises(RuntimeError), PayloadShare(payload, pool) as share:
        failed = share.shared.segment
        raise RuntimeError("the receiver failed")
    assert not _segment_exists(failed)  # a failed handoff's segment is unlinked, never reused
    shares = [PayloadShare(torch.randn(300_000), pool) for _ in range(3)]  # 2 MiB segments
    for share in shares:
        share.close(acked=True)
    assert pool.idle_bytes <= 2 << 20 and not _segment_exists(shares[0].shared.segment)
    pool.close()
    assert pool.idle_bytes == 0 and not any(_segment_exists(s.shared.segment) for s in shares)

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    orphan = f"tidepool-kv-{int(dead.stdout)}-0"  # left by a sender that died with its resource tracker
    with open(f"/dev/shm/{orphan}", "wb") as f:
        f.write(b"kv")
    with PayloadShare(payload) as live:
        assert orphan in SegmentPool.remove_orphans()
        assert not _segment_exists(orphan) and _segment_exists(live.shared.segment)  # ours is left alone
