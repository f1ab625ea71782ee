"""A decode worker's receiver refusing a collective transfer (no lease for it) takes the bytes its sender
is already sending and drops them: the sender finishes at once instead of holding its thread and the
pair until its deadline, nothing reaches any block, and the same pair carries the next transfer."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from receiver_helpers import leased_receiver

from kvstore.transfer import TransferError, TransferRejected
from kvstore.transfer.collective import CollectiveChannel
from kvstore.transfer.wire import TransferHeader


def send_in_thread(channel: CollectiveChannel, header: TransferHeader, payload: torch.Tensor
                   ) -> tuple[threading.Thread, list]:
    outcome: list = []

    def send() -> None:
        try:
            channel.send(header, payload)
            outcome.append("sent")
        except TransferError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.timeout(40)
def test_a_refused_collective_transfer_is_drained_and_the_pair_carries_the_next(tiny):
    async def main() -> None:
        async with leased_receiver("leased", 20) as leased:
            engine, receiver, blocks = leased.engine, leased.receiver, leased.blocks
            shape = engine.kv_cache.payload_shape(len(blocks))
            payload = torch.randn(shape)
            before = engine.kv_cache.data.clone()
            address = await receiver.collective_address("prefill-0", 30, fresh=True)
            stray = TransferHeader.describe("no-lease", engine.model_id, shape, payload.dtype)
            sender = CollectiveChannel("prefill", address, timeout_s=60)  # the prefill worker's end
            thread, outcome = send_in_thread(sender, stray, payload)
            with pytest.raises(TransferRejected, match="no open KV lease"):
                await asyncio.to_thread(receiver.receive_collective, "prefill-0", stray, 30)
            await asyncio.to_thread(thread.join, 25)  # far below the sender's 60 s deadline
            assert not thread.is_alive() and outcome == ["sent"]
            assert torch.equal(engine.kv_cache.data, before)  # the refused bytes went nowhere

            assert not receiver.channels.get("prefill-0").broken
            assert await receiver.collective_address("prefill-0", 30, fresh=False) == address
            header = TransferHeader.describe("leased", engine.model_id, shape, payload.dtype)
            thread, outcome = send_in_thread(sender, header, payload)  # the same pair, still in step
            assert await asyncio.to_thread(receiver.receive_collective, "prefill-0", header, 30) == header.total_bytes
            await asyncio.to_thread(thread.join, 25)
            assert outcome == ["sent"] and receiver.take_filled_lease("leased").block_ids == blocks
            assert torch.equal(engine.kv_cache.export_blocks(blocks), payload)

    asyncio.run(main())


@pytest.mark.timeout(40)
@pytest.mark.parametrize("ending", ["abort", "commit"])
def test_a_lease_released_mid_transfer_keeps_its_blocks_until_the_transfer_ends(tiny, ending):
    """A cancelled request's lease is released while its KV is still arriving: its blocks stay out of the
    free list (a late write must not land in blocks another request was given) until the transfer ends,
    however it ends, and then they are freed, without the lease ever counting as filled. The request id is
    free at once: a retry reserves and leases again, and the old transfer's end leaves that lease alone."""
    async def main() -> None:
        async with leased_receiver("leased", 20) as leased:
            engine, receiver, blocks, loop = leased.engine, leased.receiver, leased.blocks, leased.loop
            shape = engine.kv_cache.payload_shape(len(blocks))
            header = TransferHeader.describe("leased", engine.model_id, shape, engine.kv_cache.payload_dtype)

            def free() -> int:
                return engine.block_manager.num_free_blocks

            free_before = await loop.acall(free)
            writer = receiver.begin(header)  # a transfer claims the lease
            assert receiver.drop_lease("leased") is False  # the caller must not free the blocks now
            assert await loop.acall(free) == free_before
            retry = await loop.acall(engine.reserve_blocks, "leased", 20)  # the retry, while it drains
            receiver.add_lease("leased", retry, time.monotonic() + 60)
            writer.write(0, memoryview(bytes(header.total_bytes)))  # a late write, still into the old blocks
            if ending == "abort":
                writer.abort("sender cancelled")
            else:
                await asyncio.to_thread(writer.commit)
            assert await loop.acall(free) == free_before + len(blocks) - len(retry)  # the old ones, freed
            with pytest.raises(TransferRejected):
                receiver.take_filled_lease("leased")  # the retry's lease: open, untouched by the old transfer
            assert receiver.drop_lease("leased") is True
            await loop.acall(engine.release, "leased")
            assert await loop.acall(free) == free_before + len(blocks)

    asyncio.run(main())


@pytest.mark.timeout(40)
def test_a_channel_slow_to_open_leaves_the_event_loop_serving(tiny, monkeypatch):
    """Opening a channel creates a listening store, whose connect torch formats with a reverse DNS lookup
    (seconds where DNS is slow): the decode worker's event loop, which streams every sequence it serves,
    keeps running meanwhile. Here the store's creation waits for the event loop to run a callback."""
    from services import kv_receiver

    loop_ran = threading.Event()
    waited: list[bool] = []

    class SlowToOpen(CollectiveChannel):
        def __init__(self, *args, **kwargs) -> None:
            waited.append(loop_ran.wait(10))  # set only by the event loop: never, if this blocked it
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(kv_receiver, "CollectiveChannel", SlowToOpen)

    async def main() -> None:
        async with leased_receiver("leased", 20) as leased:
            asyncio.get_running_loop().call_later(0.05, loop_ran.set)
            address = await leased.receiver.collective_address("prefill-0", 30, fresh=True)
            assert waited == [True] and address.startswith("tcp://")
            await leased.receiver.close_collective("prefill-0")
            assert leased.receiver.channels.get("prefill-0") is None

    asyncio.run(main())
