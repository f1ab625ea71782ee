"""One attempt at a (sub-)request on the pair the router chose, and what a later attempt resumes from.

A disaggregated attempt reserves a lease on the decode worker, has the prefill worker compute the prompt
and push its KV into that lease (a lease still waiting for room is waited for by the push; the prompt is
computed once it is first in line), then streams the decode worker's tokens; every step has a deadline,
and the decode stream fails when it sends nothing for ``Deadlines.token_s``. An attempt that fails
because a worker died or stalled, because the handoff broke, or because the decode worker had no room
for the lease after all, is ``resumable``: the dispatcher runs another on a live pair with the tokens
streamed so far (``Progress``). That prefill computes the prompt plus those tokens and samples the next
one, so the client's stream goes on with no token missing or repeated (see docs/RELIABILITY.md for what
is guaranteed about the tokens that follow).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from engine.errors import OutOfBlocksError
from engine.sampling_params import Priority, SamplingParams
from kvstore.transfer import TransferError, TransferTimeout
from services.errors import WorkerDiedError, WorkerLostError, WorkerStalledError
from services.messages import PrefillResult, PrefixFetch, TokenEvent
from services.worker_client import WorkerClient

T = TypeVar("T")


@dataclass
class Deadlines:
    reserve_s: float = 10.0  # the decode reservation's call (its wait for room runs on beside the prefill)
    prefill_s: float = 120.0  # queueing + compute + transfer of the prompt
    lease_s: float = 150.0  # a decode reservation that is never filled is freed after this
    token_s: float = 60.0  # a stream that sends nothing for this long has stalled: resumed elsewhere
    resume_s: float = 90.0  # a request whose workers failed waits this long for a live pair (a replacement)


def resumable(exc: BaseException) -> bool:
    """A failure of the workers rather than of the request: a death, a stall, a broken handoff, or a decode
    worker without room for the lease after all (the router's view of it was older than the reservation:
    routed again on fresh loads, the request goes elsewhere or is rejected with the router's retry-after).
    A missed deadline and an engine step that raised (the request may be what broke it) are not."""
    if isinstance(exc, TransferError):
        return not isinstance(exc, TransferTimeout)
    return isinstance(exc, WorkerLostError | OutOfBlocksError)


@dataclass
class Progress:
    """What a (sub-)request has streamed so far, across its attempts."""

    output_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None  # the first attempt's prefix-cache hit

    def add(self, event: TokenEvent) -> None:
        if self.num_cached_tokens is None:
            self.num_cached_tokens = event.num_cached_tokens
        else:  # a resumed attempt's hit counts the request's own output: the client is told the first one
            event.num_cached_tokens = self.num_cached_tokens
        self.output_ids += event.token_ids


@dataclass(frozen=True)
class Attempt:
    """One try: the request under an id of its own (a failed try's id may still be in use on a worker)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    index: int  # which of the request's n choices
    output_ids: tuple[int, ...]  # streamed by earlier attempts: this one continues after them
    fetch: PrefixFetch | None  # the prefix copy the router chose, if any
    priority: Priority  # (the request's priority, the router's order): the engine queues its prompt by it
    # How long the decode reservation may wait for running sequences to free room (Dispatcher._reserve_wait_s).
    reserve_wait_s: float = 0.0
    lora: str | None = None  # the LoRA adapter it runs with on both sides; None: the base model


async def unless_set(died: asyncio.Event, worker_id: str, call: Awaitable[T]) -> T:
    """``call``'s result, or WorkerDiedError as soon as ``died`` is set (the call is then cancelled)."""
    task = asyncio.ensure_future(call)
    waiter = asyncio.ensure_future(died.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise WorkerDiedError(worker_id, f"worker {worker_id} died during the handoff")
    return task.result()


def run_colocated(attempt: Attempt, worker: WorkerClient, deadlines: Deadlines) -> AsyncIterator[TokenEvent]:
    """One worker computes the prompt and decodes; its first event may take the prefill deadline."""
    a = attempt
    return worker.generate(a.request_id, a.prompt_ids, a.params, a.index, a.fetch, a.output_ids,
                           deadlines.prefill_s, deadlines.token_s, a.priority, a.lora)


async def run_disaggregated(
    attempt: Attempt, prefill: WorkerClient, decode: WorkerClient, deadlines: Deadlines,
    decode_died: asyncio.Event, on_handoff: Callable[[PrefillResult], None],
) -> AsyncIterator[TokenEvent]:
    """Reserve, prefill + transfer, stream the decode; ``on_handoff`` gets each completed handoff.

    A decode worker that dies while the prompt is computed or sent (``decode_died``) ends the attempt at
    once, whatever the transport would take to notice.
    """
    a = attempt
    try:
        # Without room now the reservation waits in line on the decode worker (``reserved`` False): the
        # prefill starts once it is first in line and its KV push waits for it, so the end of the wait
        # overlaps the prefill instead of coming before it.
        reserved = await decode.reserve(a.request_id, len(a.prompt_ids) + len(a.output_ids), deadlines.lease_s,
                                        a.reserve_wait_s, deadlines.reserve_s, a.params.max_tokens - len(a.output_ids))
    except BaseException:
        # A reservation refused, past its deadline, or whose caller left may still be waiting for room on the
        # worker, or hold blocks it got at the last moment: release it rather than leave them to its lease's end.
        await decode.release(a.request_id)
        raise
    handed_off = completed = False
    try:
        result = await unless_set(decode_died, decode.worker_id, prefill.prefill(
            a.request_id, a.prompt_ids, a.params, decode.info.kv_target, a.fetch, deadlines.prefill_s,
            a.output_ids, a.priority, lease_pending=not reserved, lora=a.lora))
        on_handoff(result)
        first = TokenEvent(a.index, [result.first_token_id], result.finish_reason, len(a.prompt_ids),
                           result.num_cached_tokens, result.text, result.logprobs and [result.logprobs],
                           result.prompt_logprobs)
        if result.finish_reason is not None:
            yield first
            return
        stream = decode.decode(a.request_id, a.prompt_ids, result.first_token_id, a.params, a.index,
                               result.num_cached_tokens, a.output_ids, deadlines.token_s, a.lora)
        handed_off = True
        yield first
        async for event in stream:
            yield event
        completed = True
    finally:
        if not handed_off:
            # The lease is freed whether or not the KV arrived; the prefill side cleans itself up.
            await decode.release(a.request_id)
            await prefill.abort(a.request_id)
        elif not completed and not isinstance(sys.exc_info()[1], WorkerStalledError):
            # The consumer left, possibly before the decode stream was first read (then its own
            # cleanup never ran): stop the decode request. (A stalled stream has cancelled its own.)
            await stream.aclose()
            await decode.abort(a.request_id)
