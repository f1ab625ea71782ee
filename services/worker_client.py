"""Typed calls to one worker actor, so the dispatcher reads without Ray.

``WorkerClient`` wraps a Ray actor handle: each method is one actor call with a deadline, and Ray's
failures become ours: ``WorkerDiedError`` when the actor is gone, ``WorkerFailedError`` when it did not
answer in time, and the worker's own exception (e.g. ``OutOfBlocksError``) when the call raised there.
A stream that sends nothing for its inactivity deadline fails with ``WorkerStalledError``. Streams arrive on
the worker's token feed to this gateway (``TokenFeedReader``: every request's events of an engine step in one
Ray object, ``services/token_feed.py``); a stream whose consumer stops early stops the request on the worker,
which aborts it, and a prefill whose caller is cancelled is cancelled on the worker too. ``output_ids`` resume
a request after the tokens a failed attempt streamed. Tests drive the dispatcher with fakes that have the same
methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from engine.sampling_params import Priority, SamplingParams
from router.loads import WorkerLoad
from services.errors import WorkerDiedError, WorkerFailedError, WorkerLostError, WorkerStalledError
from services.event_queue import TokenEventQueue
from services.messages import (
    EmbeddingResult,
    KVTarget,
    PrefillResult,
    PrefixFetch,
    Role,
    TokenEvent,
    WorkerInfo,
)
from services.token_feed import decode_batch

log = logging.getLogger(__name__)


def raised_in_worker(exc: RayTaskError) -> BaseException:
    """The worker's own exception (e.g. ``OutOfBlocksError``), to raise chained to Ray's error, which keeps
    the worker's traceback for the logs. Ray's stand-in for it (``as_instanceof_cause``) has the right type,
    but its message is that traceback with the worker's pid and IP, which the gateway would put in what
    the client is told."""
    return exc.cause if isinstance(exc.cause, Exception) else exc.as_instanceof_cause()


class WorkerClient:
    def __init__(self, info: WorkerInfo, actor: ray.actor.ActorHandle) -> None:
        self.info = info
        self.actor = actor
        self._token_feed: TokenFeedReader | None = None

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> Role:
        return self.info.role

    # ---- calls --------------------------------------------------------------------------------------------
    async def load(self, timeout_s: float) -> WorkerLoad:
        return await self._call(self.actor.load.remote(), timeout_s)

    async def reserve(self, request_id: str, num_tokens: int, lease_s: float, wait_s: float, timeout_s: float,
                      max_new_tokens: int = 0) -> bool:
        """Reserve decode-side blocks for ``num_tokens`` of prompt KV, held for ``lease_s``, for a request that
        will decode up to ``max_new_tokens``. True: reserved. False: no room yet, and the reservation waits in
        line up to ``wait_s`` for it on the worker; the prefill starts once it is first in line and its KV
        push waits for it (``DecodeWorker.reserve``, ``prefill(lease_pending=True)``)."""
        return await self._call(self.actor.reserve.remote(request_id, num_tokens, lease_s, wait_s, max_new_tokens),
                                timeout_s)

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams, kv_target: KVTarget,
                      fetch: PrefixFetch | None, deadline_s: float, output_ids: tuple[int, ...] = (),
                      priority: Priority | None = None, lease_pending: bool = False,
                      lora: str | None = None) -> PrefillResult:
        """Compute the prompt (with LoRA adapter ``lora``), sample its first token and push its KV into
        ``kv_target``'s lease (``lease_pending``: a lease still waiting for room, which the push waits for)."""
        ref = self.actor.prefill.remote(request_id, prompt_ids, params, kv_target, fetch, deadline_s,
                                        output_ids, priority, lease_pending, lora)
        # The worker enforces the deadline; this is the backstop. A cancelled caller stops the prompt's compute.
        return await self._call(ref, deadline_s + 5.0, cancel_with_caller=True)

    async def embed(self, request_id: str, prompt_ids: list[int], dimensions: int | None, deadline_s: float,
                    priority: Priority | None = None) -> EmbeddingResult:
        """The prompt's embedding, computed on this (prefill or colocated) worker."""
        ref = self.actor.embed.remote(request_id, prompt_ids, dimensions, deadline_s, priority)
        return await self._call(ref, deadline_s + 5.0, cancel_with_caller=True)  # (as prefill's)

    async def copy_prefix(self, token_ids: list[int], fetch: PrefixFetch, timeout_s: float) -> int:
        """Replication: have this worker copy the prefix ``fetch`` names from its holder; the blocks placed."""
        return await self._call(self.actor.copy_prefix.remote(token_ids, fetch, timeout_s),
                                fetch.wait_s + timeout_s + 5.0)

    async def load_lora(self, name: str, path: str, timeout_s: float) -> str:
        """Load a LoRA adapter on the worker; its adapter id."""
        return await self._call(self.actor.load_lora.remote(name, path), timeout_s)

    async def unload_lora(self, name: str, wait_s: float) -> int:
        """Unload a LoRA adapter once its requests finished (up to ``wait_s``, then they are aborted); how many were."""
        return await self._call(self.actor.unload_lora.remote(name, wait_s), wait_s + 10.0)

    async def release(self, request_id: str) -> None:
        """Free a decode lease that never joined the batch; a dead worker has nothing left to free."""
        with contextlib.suppress(WorkerFailedError):
            await self._call(self.actor.release.remote(request_id), 10.0)

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(WorkerFailedError):
            await self._call(self.actor.abort.remote(request_id), 10.0)

    # ---- streams ------------------------------------------------------------------------------------------
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int,
                 fetch: PrefixFetch | None, output_ids: tuple[int, ...] = (), first_timeout_s: float = 120.0,
                 token_timeout_s: float = 60.0, priority: Priority | None = None,
                 lora: str | None = None) -> AsyncIterator[TokenEvent]:
        """A colocated worker computes the prompt and decodes it (with LoRA adapter ``lora``); the first event may
        take ``first_timeout_s`` (the prompt's queue and compute), every later one ``token_timeout_s``."""
        return self._stream(request_id, (request_id, prompt_ids, params, index, fetch, output_ids, priority, lora),
                            first_timeout_s, token_timeout_s)

    def decode(self, request_id: str, prompt_ids: list[int], first_token_id: int, params: SamplingParams,
               index: int, num_cached_tokens: int, output_ids: tuple[int, ...] = (),
               token_timeout_s: float = 60.0, lora: str | None = None) -> AsyncIterator[TokenEvent]:
        """A decode worker continues from its filled lease and the first token the prefill side sampled."""
        return self._stream(request_id, (request_id, prompt_ids, first_token_id, params, index, num_cached_tokens,
                                         output_ids, lora), token_timeout_s, token_timeout_s)

    async def _stream(self, request_id: str, args: tuple, first_timeout_s: float,
                      token_timeout_s: float) -> AsyncIterator[TokenEvent]:
        """The worker's ``generate(emit, *args)``, its events read off this gateway's token feed."""
        feed = self._feed()
        events = feed.open(request_id)
        finished = stalled = started = False
        watch: StallWatch | None = None  # from the first event on
        try:
            while not finished:
                if watch is not None:
                    item = await events.get()
                else:
                    try:
                        # asyncio.timeout, not wait_for: wait_for (before 3.12) may swallow a cancel that
                        # lands as an event arrives, and the request would run on after its consumer left.
                        async with asyncio.timeout(first_timeout_s):
                            await self.actor.start_stream.remote(feed.feed_id, request_id, args)
                            started = True
                            item = await events.get()
                    except RayTaskError:  # the start raised in the worker (Ray's stand-in may be a TimeoutError)
                        raise
                    except TimeoutError as exc:
                        stalled = True
                        raise WorkerStalledError(self.worker_id, f"worker {self.worker_id} sent nothing for "
                                                                 f"{first_timeout_s:.0f}s") from exc
                    watch = StallWatch(events, token_timeout_s, self.worker_id)
                if item is None:  # the stream ended (after its last event, which finished it)
                    return
                if isinstance(item, BaseException):
                    stalled = isinstance(item, WorkerStalledError)
                    raise item
                finished = item.finish_reason is not None
                yield item
        except RayActorError as exc:
            raise WorkerDiedError(self.worker_id, f"worker {self.worker_id} died mid-stream") from exc
        except RayTaskError as exc:
            raise raised_in_worker(exc) from exc
        finally:
            if watch is not None:
                watch.cancel()
            feed.forget(request_id)
            if started and not finished and ray.is_initialized():  # (after ray.shutdown a call starts a new Ray)
                # The consumer went away (or the stream broke): stop the request and free its blocks. A
                # stalled worker is not waited for: it stops the request when it wakes.
                stop = self.actor.stop_stream.remote(feed.feed_id, request_id)
                if not stalled:
                    with contextlib.suppress(WorkerFailedError, WorkerDiedError):
                        await self._call(stop, 10.0)

    async def close(self) -> None:
        """Stop reading the worker's token feed (the dispatcher is stopping); its requests are aborted there."""
        if self._token_feed is not None and self._token_feed.loop is asyncio.get_running_loop():
            await self._token_feed.close()

    def _feed(self) -> TokenFeedReader:
        """This gateway's feed from the worker, opened on first use, and again after it broke (or in another
        event loop: a test's)."""
        loop = asyncio.get_running_loop()
        if self._token_feed is None or self._token_feed.loop is not loop or self._token_feed.broken:
            self._token_feed = TokenFeedReader(self.actor, self.worker_id, loop)
        return self._token_feed

    async def _call(self, ref: ray.ObjectRef, timeout_s: float, cancel_with_caller: bool = False) -> Any:
        """``cancel_with_caller``: a cancelled caller cancels the actor's task too (never for cleanup calls,
        such as release and abort, which must run even when the request's task is cancelled again)."""
        try:
            async with asyncio.timeout(timeout_s):  # (not wait_for: see _stream)
                return await ref
        except RayActorError as exc:
            raise WorkerDiedError(self.worker_id, f"worker {self.worker_id} died") from exc
        except asyncio.CancelledError:
            if cancel_with_caller and ray.is_initialized():
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
            raise
        except RayTaskError as exc:  # before TimeoutError: Ray's stand-in for a worker's TimeoutError is one
            raise raised_in_worker(exc) from exc
        except (TimeoutError, GetTimeoutError) as exc:
            ray.cancel(ref)
            raise WorkerFailedError(
                f"worker {self.worker_id} did not answer within {timeout_s:.0f}s") from exc


# Batches the worker may send ahead of this gateway's reading them: past it, the worker's feed waits, and what the
# engine steps meanwhile leaves as one batch, each request's events joined (Ray's generator backpressure).
_FEED_BATCHES_AHEAD = 2


class StallWatch:
    """Fails a stream's queue with ``WorkerStalledError`` once ``timeout_s`` pass without the worker sending it
    anything (``TokenEventQueue.last_put``): one timer a stream, which, firing while events still come, moves on
    to the last one's time plus the timeout; a timeout around each wait for an event cost the gateway's event
    loop 7 µs an event (a timer scheduled and cancelled each time). A consumer that is slow to take events
    does not make its worker look stalled."""

    def __init__(self, queue: TokenEventQueue, timeout_s: float, worker_id: str) -> None:
        self.queue, self.timeout_s, self.worker_id = queue, timeout_s, worker_id
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        quiet_s = time.monotonic() - self.queue.last_put
        if quiet_s < self.timeout_s:
            self._timer = self._loop.call_later(self.timeout_s - quiet_s, self._check)
        else:
            self.queue.put_nowait(WorkerStalledError(
                self.worker_id, f"worker {self.worker_id} sent nothing for {self.timeout_s:.0f}s"))

    def cancel(self) -> None:
        self._timer.cancel()


class TokenFeedReader:
    """This gateway's end of a worker's token feed (``services/token_feed.py``): one task reads the feed and
    hands each request's events to its queue, where those its consumer has not taken yet are joined
    (``TokenEventQueue``). The worker dying fails every open request's queue with ``WorkerDiedError``, the feed
    breaking otherwise with ``WorkerLostError`` (both resumable); however the reader stops, it cancels the feed,
    which the worker's side would otherwise keep waiting for it."""

    def __init__(self, actor: ray.actor.ActorHandle, worker_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.actor, self.worker_id, self.loop = actor, worker_id, loop
        self.feed_id = uuid.uuid4().hex
        self._queues: dict[str, TokenEventQueue] = {}
        self._feed = actor.feed.options(_generator_backpressure_num_objects=_FEED_BATCHES_AHEAD).remote(self.feed_id)
        self._reader = loop.create_task(self._read())

    def open(self, request_id: str) -> TokenEventQueue:
        """The queue of ``request_id``'s events (registered before the request starts: none is missed)."""
        queue = self._queues[request_id] = TokenEventQueue()
        return queue

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    @property
    def broken(self) -> bool:
        """The feed ended (the worker died, or the feed failed): requests need a new one."""
        return self._reader.done()

    async def close(self) -> None:
        self._reader.cancel()  # (which cancels the feed)
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self) -> None:
        try:
            async for ref in self._feed:
                for request_id, item in decode_batch(await ref):
                    if (queue := self._queues.get(request_id)) is not None:
                        queue.put_nowait(item)
        except RayActorError:
            for queue in self._queues.values():
                queue.put_nowait(WorkerDiedError(self.worker_id, f"worker {self.worker_id} died mid-stream"))
        except Exception as exc:
            log.exception("the token feed from %s broke", self.worker_id)
            for queue in self._queues.values():
                queue.put_nowait(WorkerLostError(self.worker_id, f"the token feed from {self.worker_id} broke: {exc}"))
        finally:
            if ray.is_initialized():  # (after ray.shutdown a call starts a new Ray)
                with contextlib.suppress(Exception):  # a dead worker's feed is over already
                    ray.cancel(self._feed)
