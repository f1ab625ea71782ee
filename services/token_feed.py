"""A worker's token feeds: one stream per gateway carrying every token event of that gateway's requests, a
step's together, instead of one Ray streaming generator (one Ray object per token) per request.

A Ray object costs the gateway's process about 0.3 ms of CPU (``benchmarks/stream_cost.py``): one per token
per request capped a gateway at about 1900 streamed tokens a second, less than one GPU decode worker makes.
Each request runs in a task of its own (``Worker.generate``), which hands its events to its gateway's outbox
(``emit``: the worker's ``OutputStream`` does it as the engine delivers each step, without waking the task); the
gateway's one ``serve`` generator yields whatever the outbox holds each time it runs, so one engine step's
events for every request of that gateway leave as one object: bytes the feed pickles itself (``encode_batch``),
which Ray passes as they are, instead of a list Ray would pickle with cloudpickle, object by object (1.0 ms for
a step's 256 events, against 0.37 ms). The gateway reads its feed with Ray's generator backpressure
(``services/worker_client.py``): while it is behind, ``serve`` waits at its yield and the steps' events pile up
in the outbox, to leave as one object with each request's joined into one event, so a gateway slower than the
engine gets fewer, larger batches and stays current. A request's end is ``(request_id, None)``, its failure
``(request_id, exception)``.

Stopping a request (``stop``), or the gateway's feed ending (its reader closed it, and Ray cancelled the
generator), cancels the request's task, whose own cleanup aborts it on the engine and frees its blocks, as Ray's
cancelling of a per-request generator did; nothing it emits after the stop is sent. (Ray does not end a
generator whose caller's process died; a gateway's process owns its workers, which die with it.)
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import AsyncIterator, Awaitable, Callable

from engine.errors import InvalidRequestError
from services.messages import TokenEvent, join_events

log = logging.getLogger(__name__)

FeedItem = tuple[str, TokenEvent | BaseException | None]
Emit = Callable[[TokenEvent], None]


def encode_batch(items: list[FeedItem]) -> bytes:
    """A batch for the gateway's reader, pickled here: Ray passes bytes through without pickling them again."""
    return pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)


def decode_batch(data: bytes) -> list[FeedItem]:
    """A batch the feed sent (the gateway's reader): its items, in order."""
    return pickle.loads(data)


class StreamFailedError(RuntimeError):
    """A request's stream failed with an exception that could not travel to the gateway as it was."""


class _Outbox:
    """What a feed has yet to send, in order. A list and a wake-up, not an ``asyncio.Queue``: every event of every
    step goes in and out, and a queue's bookkeeping cost nearly a microsecond an item (200 µs a step for 256)."""

    def __init__(self) -> None:
        self._items: list[FeedItem] = []
        self._waiter: asyncio.Future | None = None  # the feed, waiting for the next item

    def put(self, item: FeedItem) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[FeedItem]:
        """Everything waiting, once there is something."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class _Feed:
    def __init__(self) -> None:
        self.outbox = _Outbox()
        self.requests: dict[str, _Request] = {}


class _Request:
    """A request streaming on a feed: its task running ``run(emit)``, and its events' way into the feed until it
    is stopped; once it ends it leaves the feed's requests."""

    def __init__(self, request_id: str, feed: _Feed, run: Callable[[Emit], Awaitable[None]]) -> None:
        self.request_id, self.feed = request_id, feed
        self.stopped = False
        self.task = asyncio.create_task(self._run(run))

    def send(self, item: TokenEvent | BaseException | None) -> None:
        """One of its events (its ``emit``), then its end or failure."""
        if not self.stopped:  # (a step delivered between the stop and the task's cleanup: nobody reads it)
            self.feed.outbox.put((self.request_id, item))

    def stop(self) -> asyncio.Task:
        self.stopped = True
        self.task.cancel()
        return self.task

    async def _run(self, run: Callable[[Emit], Awaitable[None]]) -> None:
        try:
            await run(self.send)
            self.send(None)
        except Exception as exc:  # (a cancel lands inside ``run``, the only await here: its cleanup runs there)
            self.send(_portable(exc))
        finally:
            self.feed.requests.pop(self.request_id, None)


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling (it travels in a batch with other requests' events), else its words."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return StreamFailedError(f"{type(exc).__name__}: {exc}")


def _coalesced(items: list[FeedItem]) -> list[FeedItem]:
    """``items`` with each request's consecutive token events joined into one (they piled up while the gateway
    was behind); a request's end or failure stays after its events."""
    if len({request_id for request_id, _ in items}) == len(items):  # one item a request: nothing to join
        return items
    runs: list[tuple[str, list]] = []  # (request, its token events to join) or (request, [its end or failure])
    open_runs: dict[str, list[TokenEvent]] = {}  # request -> its run that later events may join
    for request_id, item in items:
        run = open_runs.get(request_id) if isinstance(item, TokenEvent) else None
        if run is None:
            run = [item]
            runs.append((request_id, run))
        else:
            run.append(item)
        if isinstance(item, TokenEvent) and item.finish_reason is None:
            open_runs[request_id] = run
        else:
            open_runs.pop(request_id, None)
    return [(request_id, join_events(run) if isinstance(run[0], TokenEvent) else run[0]) for request_id, run in runs]


class TokenFeeds:
    """The feeds of one worker, by gateway (``feed_id``)."""

    def __init__(self) -> None:
        self._feeds: dict[str, _Feed] = {}

    def start(self, feed_id: str, request_id: str, run: Callable[[Emit], Awaitable[None]]) -> None:
        """Run ``run(emit)`` for ``request_id``, its events (``emit``'s) sent on ``feed_id``'s feed (created if
        the gateway has not opened it yet), then its end, or the exception it raised."""
        feed = self._feeds.setdefault(feed_id, _Feed())
        if request_id in feed.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already streaming")
        feed.requests[request_id] = _Request(request_id, feed, run)

    async def stop(self, feed_id: str, request_id: str) -> None:
        """The gateway stopped reading the request: cancel its task (which aborts it) and wait for that."""
        feed = self._feeds.get(feed_id)
        request = None if feed is None else feed.requests.get(request_id)
        if request is not None:
            await asyncio.gather(request.stop(), return_exceptions=True)

    async def serve(self, feed_id: str) -> AsyncIterator[bytes]:
        """The gateway's feed: every batch of events waiting in its outbox (``encode_batch``'s), until the
        gateway goes away."""
        feed = self._feeds.setdefault(feed_id, _Feed())
        try:
            while True:
                yield encode_batch(_coalesced(await feed.outbox.take()))
        finally:  # nobody reads this gateway's requests any more: stop them all
            self._feeds.pop(feed_id, None)
            await asyncio.gather(*[request.stop() for request in list(feed.requests.values())],
                                 return_exceptions=True)


class FeedServer:
    """The actor methods a gateway streams requests with (``WorkerClient``): the worker's, and any class with a
    ``generate(emit, *args)`` coroutine (it hands a request's token events to ``emit`` and returns when the request
    has finished) and ``feeds`` inherits them."""

    feeds: TokenFeeds

    async def start_stream(self, feed_id: str, request_id: str, args: tuple) -> None:
        """Run ``generate(emit, *args)`` for request ``request_id``; its events go out on the gateway's feed
        ``feed_id``."""
        self.feeds.start(feed_id, request_id, lambda emit: self.generate(emit, *args))  # type: ignore[attr-defined]

    async def stop_stream(self, feed_id: str, request_id: str) -> None:
        """The gateway stopped reading the request: cancel its stream (which aborts it) before returning."""
        await self.feeds.stop(feed_id, request_id)

    async def feed(self, feed_id: str) -> AsyncIterator[bytes]:
        """The gateway's token feed: its requests' events, a step's together (``decode_batch`` reads them)."""
        async for batch in self.feeds.serve(feed_id):
            yield batch
