"""The decode worker: holds leases of reserved blocks, receives KV into them (``services/kv_receiver.py``)
and decodes in a continuous batch; a finished sequence's answer blocks go to the pool. A reservation
without room waits in line for it in the background; the prefill worker computes its prompt once it is
first in line, and pushes the KV once it has its blocks (``wait_for_lease``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from engine.errors import InvalidRequestError, OutOfBlocksError
from engine.sampling_params import SamplingParams
from kvstore.transfer import TransferRejected
from kvstore.transfer.channel_pool import ChannelUse
from kvstore.transfer.ipc import SharedPayload
from kvstore.transfer.wire import TransferHeader
from router.loads import WorkerLoad
from services.errors import ReservationReleased
from services.kv_receiver import HandoffReceiver
from services.messages import TokenEvent, WorkerInfo
from services.token_feed import Emit
from services.worker import Worker

log = logging.getLogger(__name__)


# How often the reservation first in line looks for room again: blocks free at engine step boundaries.
_RESERVE_POLL_S = 0.01


@dataclasses.dataclass
class _Waiting:
    blocks: int
    released: bool = False
    # Set when the reservation has something to do: it became first in line, or was released. The ones
    # behind the first sleep on it instead of polling, so a long line costs nothing while it waits.
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # Set once its first try found no room: from then on it waits in the background (``reserve`` returns).
    queued: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # Set when it is first in line: next to get blocks as they free, so its prompt may be computed now.
    at_head: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class DecodeWorker(Worker):
    """Holds leases of reserved blocks, receives KV into them, and decodes in a continuous batch."""

    async def start(self) -> WorkerInfo:
        info = await super().start()
        self._waiting: dict[str, _Waiting] = {}  # reservations waiting for blocks, by request id
        # Each reservation's wait for room, until it has its lease, or after a failure until ``release`` (one
        # nobody releases is dropped after the lease's time): ``wait_for_lease`` reports it.
        self._granting: dict[str, asyncio.Task] = {}
        self.receiver = HandoffReceiver(self.spec.worker_id, self.engine, self.loop, self.spec.transfer_secret,
                                        self.spec.max_kv_channels)
        self._reaper = asyncio.create_task(self._reap_expired())
        return dataclasses.replace(info, kv_target=self.receiver.target())

    async def reserve(self, request_id: str, num_tokens: int, lease_s: float, wait_s: float = 0.0,
                      max_new_tokens: int = 0) -> bool:
        """Reserve blocks for ``num_tokens`` of prompt KV, held for ``lease_s``, for a request that will decode
        up to ``max_new_tokens`` (``Engine.reserve_blocks``). True: the lease holds its blocks now. False: there
        is no room now, and the reservation waits in line (behind those waiting before it) up to ``wait_s`` for
        running sequences to free it; the prefill worker computes the prompt once it is first in line and
        pushes its KV once it has the blocks (``wait_for_lease``), so the last of the wait overlaps the
        prefill. A request larger than the whole cache, or one without room and no time to wait, is
        OutOfBlocksError at once. ``release`` ends a wait early (ReservationReleased)."""
        if request_id in self._waiting:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        needed = len(self.engine.handoff_blocks(num_tokens))
        if needed > self.engine.block_manager.num_blocks:  # no wait can make room for it
            raise OutOfBlocksError(needed, self.loop.stats.free_blocks)
        waiting = self._waiting[request_id] = _Waiting(needed)
        self.notify_report_changed()  # the router counts a waiting reservation's blocks as used
        # The dict's order is the line's; registered before the first try, so a release always finds it.
        granting = asyncio.create_task(self._wait_in_line(request_id, waiting, num_tokens, lease_s,
                                                          time.monotonic() + wait_s, max_new_tokens))
        self._granting[request_id] = granting
        granting.add_done_callback(lambda task: self._granted(request_id, task, lease_s))
        queued = asyncio.create_task(waiting.queued.wait())
        try:
            await asyncio.wait((granting, queued), return_when=asyncio.FIRST_COMPLETED)
        finally:
            queued.cancel()
        if granting.done():
            self._granting.pop(request_id, None)
            granting.result()  # raises the refusal
            return True
        return False

    def _granted(self, request_id: str, task: asyncio.Task, lease_s: float) -> None:
        """A reservation's wait ended: with a lease, which is its record from now on; or with a failure,
        kept for ``wait_for_lease`` to report (and read here, so an unread one is not logged as lost)."""
        if task.cancelled() or task.exception() is None:
            self._granting.pop(request_id, None)
        else:
            asyncio.get_running_loop().call_later(
                lease_s, lambda: self._granting.get(request_id) is task and self._granting.pop(request_id))

    async def wait_for_lease(self, request_id: str, timeout_s: float, at_head: bool = False) -> None:
        """Until the reservation of ``request_id`` has its blocks (``reserve`` returned False), or with
        ``at_head`` until it is first in line for them; its failure (OutOfBlocksError: no room in time;
        ReservationReleased) is raised here, to the prefill worker."""
        granting = self._granting.get(request_id)
        if granting is None:
            if not self.receiver.has_lease(request_id):
                raise TransferRejected(f"no KV lease for request {request_id!r}")
            return
        waiting = self._waiting.get(request_id)
        async with asyncio.timeout(timeout_s):
            if at_head and waiting is not None:
                head = asyncio.ensure_future(waiting.at_head.wait())
                try:
                    await asyncio.wait((granting, head), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    head.cancel()
                if not granting.done():
                    return
            await asyncio.shield(granting)  # a caller that leaves does not end the wait itself

    async def _wait_in_line(self, request_id: str, waiting: _Waiting, num_tokens: int, lease_s: float,
                            deadline: float, max_new_tokens: int) -> None:
        try:
            while not waiting.released:
                left = deadline - time.monotonic()
                if next(iter(self._waiting.values())) is waiting:  # first in line: a large request is not starved
                    waiting.at_head.set()
                    try:
                        block_ids = await self.loop.acall(self.engine.reserve_blocks, request_id, num_tokens,
                                                          max_new_tokens)
                        break
                    except OutOfBlocksError:
                        if left < _RESERVE_POLL_S:
                            raise
                    waiting.queued.set()
                    await asyncio.sleep(_RESERVE_POLL_S)
                    continue
                if left <= 0:
                    raise OutOfBlocksError(waiting.blocks, self.loop.stats.free_blocks)
                waiting.queued.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiting.wake.wait(), left)
                waiting.wake.clear()
            else:
                raise ReservationReleased(request_id)
        finally:
            first = next(iter(self._waiting.values())) is waiting
            del self._waiting[request_id]
            self.notify_report_changed()
            if first and self._waiting:  # the line moved: the next one tries at once
                next(iter(self._waiting.values())).wake.set()
        if waiting.released:  # released while the engine reserved: nobody will fill these blocks
            await self.loop.acall(self.engine.release, request_id)
            raise ReservationReleased(request_id)
        self.receiver.add_lease(request_id, block_ids, time.monotonic() + lease_s)

    async def load(self) -> WorkerLoad:
        """With the reservations waiting for room: the router counts their blocks as used."""
        load = await super().load()
        return dataclasses.replace(load, waiting_leases=len(self._waiting),
                                   waiting_lease_blocks=sum(w.blocks for w in self._waiting.values()))

    async def generate(
        self, emit: Emit, request_id: str, prompt_ids: list[int], first_token_id: int, params: SamplingParams,
        index: int = 0, num_cached_tokens: int = 0, output_ids: tuple[int, ...] = (), lora: str | None = None,
    ) -> None:
        """Decode from the filled lease, handing the token events to ``emit``; returns once it finished.
        ``output_ids``: tokens a failed attempt already streamed (their K/V is in the lease); ``lora``: the
        LoRA adapter the prompt was computed with, and the decode runs with (None: the base model)."""
        lease = self.receiver.take_filled_lease(request_id)

        def join() -> None:
            self.engine.add_imported_request(request_id, prompt_ids, first_token_id, params, lease.block_ids,
                                             output_ids, lora)

        sequence = [*prompt_ids, *output_ids, first_token_id]
        # The prefill worker shared the prompt's blocks: the answer's are this worker's to share.
        # (The answer's first token came from the prefill worker: the stream interval applies from the second.)
        def emit_with_prefill_hit(event: TokenEvent) -> None:
            event.num_cached_tokens = num_cached_tokens  # the prefix-cache hit happened on the prefill side
            emit(event)

        await self._stream(emit_with_prefill_hit, request_id, index, join, sequence,
                           (len(prompt_ids) + len(output_ids)) // self.engine.block_size, lora, params.cache_salt,
                           first_at_once=False)

    async def collective_address(self, prefill_id: str, hold_s: float, fresh: bool) -> str:
        """The address of the collective channel ``prefill_id``'s next transfer uses (opened on demand),
        held for that transfer (``HandoffReceiver.collective_address``)."""
        return await self.receiver.collective_address(prefill_id, hold_s, fresh)

    async def close_collective(self, prefill_id: str) -> None:
        """``prefill_id`` closed its end of our collective channel: close ours."""
        await self.receiver.close_collective(prefill_id)

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
        """Free a lease that never joined the batch (the handoff failed or was cancelled), or end its
        reservation's wait for blocks."""
        if (waiting := self._waiting.get(request_id)) is not None:
            # its wait frees whatever it got and ends in ReservationReleased, which stays on record for a
            # wait_for_lease that comes after this release (``_granted``), as for any failed wait
            waiting.released = True
            waiting.wake.set()
            return
        self._granting.pop(request_id, None)  # a wait for its lease that failed is not asked about any more
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
