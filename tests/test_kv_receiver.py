"""A decode worker's receiver refusing a collective transfer (no lease for it) takes the bytes its sender
is already sending and drops them: the sender finishes at once instead of holding its thread and the
pair until its deadline, nothing reaches any block, and the same pair carries the next transfer."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from kvstore.transfer import TransferError, TransferRejected
from kvstore.transfer.collective import CollectiveChannel
from kvstore.transfer.wire import TransferHeader
from services.engine_loop import EngineLoop
from services.kv_receiver import HandoffReceiver


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
        engine = Engine(EngineConfig(model="tiny", num_blocks=16))
        loop = EngineLoop(engine, asyncio.get_running_loop())
        receiver = HandoffReceiver("decode-0", engine, loop, secret="receiver-test")
        try:
            blocks = await loop.acall(engine.reserve_blocks, "leased", 20)
            receiver.add_lease("leased", blocks, time.monotonic() + 60)
            shape = engine.kv_cache.payload_shape(len(blocks))
            payload = torch.randn(shape)
            before = engine.kv_cache.data.clone()
            address = receiver.collective_address("prefill-0", 30, fresh=True)
            stray = TransferHeader.describe("no-lease", engine.model_id, shape, payload.dtype)
            sender = CollectiveChannel("prefill", address, timeout_s=60)  # the prefill worker's end
            thread, outcome = send_in_thread(sender, stray, payload)
            with pytest.raises(TransferRejected, match="no open KV lease"):
                await asyncio.to_thread(receiver.receive_collective, "prefill-0", stray, 30)
            await asyncio.to_thread(thread.join, 25)  # far below the sender's 60 s deadline
            assert not thread.is_alive() and outcome == ["sent"]
            assert torch.equal(engine.kv_cache.data, before)  # the refused bytes went nowhere

            assert not receiver.channels.get("prefill-0").broken and receiver.collective_address("prefill-0", 30, fresh=False) == address
            header = TransferHeader.describe("leased", engine.model_id, shape, payload.dtype)
            thread, outcome = send_in_thread(sender, header, payload)  # the same pair, still in step
            assert await asyncio.to_thread(receiver.receive_collective, "prefill-0", header, 30) == header.total_bytes
            await asyncio.to_thread(thread.join, 25)
            assert outcome == ["sent"] and receiver.take_filled_lease("leased").block_ids == blocks
            assert torch.equal(engine.kv_cache.export_blocks(blocks), payload)
        finally:
            receiver.stop()
            loop.stop()

    asyncio.run(main())
