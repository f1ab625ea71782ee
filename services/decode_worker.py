"""The decode worker: holds leases of reserved blocks, receives KV into them (``services/kv_receiver.py``)
and decodes in a continuous batch; a finished sequence's answer blocks go to the pool."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from engine.sampling_params import SamplingParams
from kvstore.transfer.channel_pool import ChannelUse
from kvstore.transfer.ipc import SharedPayload
from kvstore.transfer.wire import TransferHeader
from services.kv_receiver import HandoffReceiver
from services.messages import TokenEvent, WorkerInfo
from services.worker import Worker

log = logging.getLogger(__name__)


class DecodeWorker(Worker):
    """Holds leases of reserved blocks, receives KV into them, and decodes in a continuous batch."""

    async def start(self) -> WorkerInfo:
        info = await super().start()
        self.receiver = HandoffReceiver(self.spec.worker_id, self.engine, self.loop, self.spec.transfer_secret,
                                        self.spec.max_kv_channels)
        self._reaper = asyncio.create_task(self._reap_expired())
        return dataclasses.replace(info, kv_target=self.receiver.target())

    async def reserve(self, request_id: str, num_tokens: int, lease_s: float) -> None:
        """Reserve blocks for ``num_tokens`` of prompt KV; raises OutOfBlocksError when they don't fit."""
        block_ids = await self.loop.acall(self.engine.reserve_blocks, request_id, num_tokens)
        self.receiver.add_lease(request_id, block_ids, time.monotonic() + lease_s)

    async def generate(
        self, request_id: str, prompt_ids: list[int], first_token_id: int, params: SamplingParams,
        index: int = 0, num_cached_tokens: int = 0, output_ids: tuple[int, ...] = (),
    ) -> AsyncIterator[TokenEvent]:
        """``output_ids``: tokens a failed attempt already streamed (their K/V is in the lease)."""
        lease = self.receiver.take_filled_lease(request_id)

        def join() -> None:
            self.engine.add_imported_request(request_id, prompt_ids, first_token_id, params, lease.block_ids,
                                             output_ids)

        sequence = [*prompt_ids, *output_ids, first_token_id]
        # The prefill worker shared the prompt's blocks: the answer's are this worker's to share.
        async for event in self._stream(request_id, index, join, sequence,
                                        (len(prompt_ids) + len(output_ids)) // self.engine.block_size):
            # The prefix-cache hit happened on the prefill side; report it with the decode stream.
            event.num_cached_tokens = num_cached_tokens
            yield event

    async def collective_address(self, prefill_id: str, hold_s: float, fresh: bool) -> str:
        """The address of the collective channel ``prefill_id``'s next transfer uses (opened on demand),
        held for that transfer (``HandoffReceiver.collective_address``)."""
        return self.receiver.collective_address(prefill_id, hold_s, fresh)

    async def close_collective(self, prefill_id: str) -> None:
        """``prefill_id`` closed its end of our collective channel: close ours."""
        self.receiver.close_collective(prefill_id)

    async def kv_channels(self) -> ChannelUse:
        """Collective channels open to prefill workers, and the threads receiving over them."""
        return self.receiver.channels.use("kv-recv")

    async def receive_collective(self, prefill_id: str, header: TransferHeader, timeout_s: float) -> int:
        """Receive one collective transfer into its lease (the header travels in this call)."""
        header.validate()
        return await asyncio.get_running_loop().run_in_executor(
            self.receiver.receive_threads, self.receiver.receive_collective, prefill_id, header, timeout_s)

    async def receive_shared(self, header: TransferHeader, shared: SharedPayload) -> int:
        """Copy a payload a prefill worker on this node shares into its lease (``HandoffReceiver.receive_shared``);
        the return is the sender's ack."""
        header.validate()
        return await asyncio.get_running_loop().run_in_executor(
            self.receiver.receive_threads, self.receiver.receive_shared, header, shared)

    async def release(self, request_id: str) -> None:
        """Free a lease that never joined the batch (the handoff failed or was cancelled)."""
        if self.receiver.drop_lease(request_id):
            await self.loop.acall(self.engine.release, request_id)

    async def _reap_expired(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.receiver.channels.close_idle()
            for request_id in self.receiver.expired_leases(time.monotonic()):
                log.warning("lease of %s expired before its KV arrived; freeing it", request_id)
                with contextlib.suppress(Exception):
                    await self.release(request_id)
