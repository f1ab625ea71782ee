"""The prefill worker: computes prompts, samples each one's first token and pushes its KV into a decode
worker's lease (``services/kv_sender.py``), then shares the prompt's new blocks with the pool."""

from __future__ import annotations

import asyncio
import time

from engine.output import FinishReason, RequestOutput
from engine.sampling_params import Priority, SamplingParams
from kvstore.transfer.channel_pool import ChannelUse
from services.errors import PrefillTimeoutError
from services.kv_sender import HandoffSender, PendingLease
from services.messages import EngineStepError, KVTarget, PrefillResult, PrefixFetch, WorkerInfo
from services.worker import Worker


class PrefillWorker(Worker):
    """Computes prompts, samples the first token and pushes the KV into a decode worker's lease."""

    async def start(self) -> WorkerInfo:
        info = await super().start()
        self.sender = HandoffSender(self.spec.worker_id, self.spec.kv_transport, self.spec.layerwise, self.engine,
                                    self.loop, self.spec.transfer_secret, self.spec.max_kv_channels)
        return info

    async def prefill(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, kv_target: KVTarget,
        fetch: PrefixFetch | None, deadline_s: float, output_ids: tuple[int, ...] = (),
        priority: Priority | None = None, lease_pending: bool = False, lora: str | None = None,
    ) -> PrefillResult:
        """``output_ids``: tokens a failed attempt already streamed; their K/V is computed and sent too,
        and the result's token is the one after them. ``lease_pending``: the decode worker's lease still
        waits for room. The prompt is computed once the lease is first in line (next to get blocks as they
        free), so the end of the wait overlaps the prefill: further back, it would take this worker's time
        from prompts that can be sent now, and be computed in vain if its wait runs out. The KV leaves once
        the lease has its blocks; a lease that never comes ends the prompt at once, computed or not.
        ``lora``: the LoRA adapter it runs with (None: the base model)."""
        deadline = time.monotonic() + deadline_s
        tokens = [*prompt_ids, *output_ids]
        released = False  # the blocks' release was handed to a background task
        salt = self.engine.prefix_salt(lora, len(tokens), params.cache_salt)
        fetched = await self._fetch_prefix(tokens, params.prompt_logprobs is not None, fetch, deadline_s, salt)
        copies = tuple((f.source, f.nbytes, f.seconds) for f in fetched if f.nbytes)
        queue = self.loop.open_queue(request_id)
        lease = PendingLease(kv_target, request_id, deadline) if lease_pending else None
        handoff = self.sender.open(request_id, tokens, kv_target, deadline, salt, lease)

        def admit() -> None:  # one engine call: the request waits for one step boundary, not one per part
            self._place(tokens, fetched, salt)
            self.engine.add_request(request_id, prompt_ids, params, True, output_ids, priority, lora)

        try:
            try:
                async with asyncio.timeout(deadline - time.monotonic()):  # (wait_for may swallow a cancel)
                    if lease is not None:  # (its remote wait ends at the deadline too, raising TimeoutError)
                        await asyncio.shield(lease.at_head)
                    await self.loop.acall(admit)
                    output = await self._prompt_output(queue, lease)
            except TimeoutError as exc:
                raise PrefillTimeoutError(deadline_s) from exc
            if isinstance(output, EngineStepError):
                raise output
            computed = time.perf_counter()
            first = output.new_token_ids[0]
            logprobs = output.logprobs[0] if output.logprobs else None
            if output.finish_reason != FinishReason.PREFILLED:  # the first token already ends it: nothing to send
                handoff.cancel()
                return PrefillResult(first, output.text, output.finish_reason, output.num_cached_tokens, 0, 0.0,
                                     logprobs=logprobs, prompt_logprobs=output.prompt_logprobs,
                                     prefix_copies=copies)
            nbytes, seconds, link_s = await handoff.finish()
            # The first token goes back now; sharing the prompt's blocks and releasing them wait for engine
            # step boundaries, so they run after it.
            self.background.spawn(self._share_and_release(request_id, tokens, output.num_cached_tokens, salt))
            released = True
            return PrefillResult(first, output.text, None, output.num_cached_tokens, nbytes, seconds,
                                 handoff.transport, link_s=link_s, exposed_s=time.perf_counter() - computed,
                                 logprobs=logprobs, prompt_logprobs=output.prompt_logprobs, prefix_copies=copies)
        except BaseException:
            handoff.cancel()
            await self.loop.acall(self.engine.abort, request_id)
            raise
        finally:
            self.loop.close_stream(request_id)
            handoff.close()
            if lease is not None:
                lease.close()
            if not released:
                await self.loop.acall(self.engine.release, request_id)

    @staticmethod
    async def _prompt_output(queue: asyncio.Queue, lease: PendingLease | None) -> RequestOutput | EngineStepError:
        """The prompt's output from the engine; a lease refused meanwhile raises at once (the prompt is
        aborted, computed or not)."""
        if lease is None:
            return await queue.get()
        output = asyncio.ensure_future(queue.get())
        try:
            await asyncio.wait((output, lease.granted), return_when=asyncio.FIRST_COMPLETED)
            if not output.done():
                lease.granted.result()  # the decode worker's refusal (granted: the output follows)
            return await output
        finally:
            output.cancel()

    async def kv_channels(self) -> ChannelUse:
        """Collective channels open to decode workers, and the threads sending over them."""
        return self.sender.channels.use("kv-send")

    async def _share_and_release(self, request_id: str, tokens: list[int], num_cached_tokens: int,
                                 salt: bytes) -> None:
        # Released first: blocks go back to the free list with their contents and hashes (a later prompt
        # still hits them), and a cache with a full-precision residual registers its blocks only then.
        await self.loop.acall(self.engine.release, request_id)
        if self.pool is not None:  # the prompt's new blocks; those it found cached were shared before
            await self.pool.store_prefix(self.loop, tokens, num_cached_tokens // self.engine.block_size, salt)
