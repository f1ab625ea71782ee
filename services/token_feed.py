"""A worker's token feeds: one stream per gateway carrying every token event of that gateway's requests, a
step's together, instead of one Ray streaming generator (one Ray object per token) per request.

A Ray object costs the gateway's process about 0.3 ms of CPU (``benchmarks/stream_cost.py``): one per token
per request capped a gateway at about 1900 streamed tokens a second, less than one GPU decode worker makes.
Here each request's own stream (``Worker.generate``, unchanged) runs in a forwarding task that puts its events
in its gateway's outbox; the gateway's one ``serve`` generator yields whatever the outbox holds each time it
runs, so one engine step's events for every request of that gateway leave as one object. The gateway reads its
feed with Ray's generator backpressure (``services/worker_client.py``): while it is behind, ``serve`` waits at
its yield and the steps' events pile up in the outbox, to leave as one object with each request's joined into
one event, so a gateway slower than the engine gets fewer, larger batches and stays current. A request's end is
``(request_id, None)``, its failure ``(request_id, exception)``.

Stopping a request's forwarder (``stop``), or the gateway's feed ending (its reader closed it, and Ray
cancelled the generator), cancels the request's stream, whose own cleanup aborts it on the engine and frees
its blocks, as Ray's cancelling of a per-request generator did. (Ray does not end a generator whose caller's
process died; a gateway's process owns its workers, which die with it.)
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import AsyncIterator

from engine.errors import InvalidRequestError
from services.messages import TokenEvent, join_events

log = logging.getLogger(__name__)

FeedItem = tuple[str, TokenEvent | BaseException | None]


class StreamFailedError(RuntimeError):
    """A request's stream failed with an exception that could not travel to the gateway as it was."""


class _Feed:
    def __init__(self) -> None:
        self.outbox: asyncio.Queue[FeedItem] = asyncio.Queue()
        self.forwarders: dict[str, asyncio.Task] = {}


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

    def start(self, feed_id: str, request_id: str, stream: AsyncIterator[TokenEvent]) -> None:
        """Forward ``stream``'s events to ``feed_id``'s feed (created if the gateway has not opened it yet)."""
        feed = self._feeds.setdefault(feed_id, _Feed())
        if request_id in feed.forwarders:
            raise InvalidRequestError("request_id", f"{request_id!r} is already streaming")
        feed.forwarders[request_id] = asyncio.create_task(self._forward(feed, request_id, stream))

    async def stop(self, feed_id: str, request_id: str) -> None:
        """The gateway stopped reading the request: cancel its stream (which aborts it) and wait for that."""
        feed = self._feeds.get(feed_id)
        task = None if feed is None else feed.forwarders.get(request_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def serve(self, feed_id: str) -> AsyncIterator[list[FeedItem]]:
        """The gateway's feed: every batch of events waiting in its outbox, until the gateway goes away."""
        feed = self._feeds.setdefault(feed_id, _Feed())
        try:
            while True:
                items = [await feed.outbox.get()]
                while not feed.outbox.empty():
                    items.append(feed.outbox.get_nowait())
                yield _coalesced(items)
        finally:  # nobody reads this gateway's requests any more: stop them all
            self._feeds.pop(feed_id, None)
            tasks = list(feed.forwarders.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _forward(self, feed: _Feed, request_id: str, stream: AsyncIterator[TokenEvent]) -> None:
        try:
            async for event in stream:
                feed.outbox.put_nowait((request_id, event))
            feed.outbox.put_nowait((request_id, None))
        except Exception as exc:  # (a cancel lands inside the stream, the only await here: its cleanup runs there)
            feed.outbox.put_nowait((request_id, _portable(exc)))
        finally:
            feed.forwarders.pop(request_id, None)


class FeedServer:
    """The actor methods a gateway streams requests with (``WorkerClient``): the worker's, and any class with a
    ``generate(*args)`` stream of token events and ``feeds`` inherits them."""

    feeds: TokenFeeds

    async def start_stream(self, feed_id: str, request_id: str, args: tuple) -> None:
        """Run ``generate(*args)`` for request ``request_id``; its events go out on the gateway's feed
        ``feed_id``."""
        self.feeds.start(feed_id, request_id, self.generate(*args))  # type: ignore[attr-defined]

    async def stop_stream(self, feed_id: str, request_id: str) -> None:
        """The gateway stopped reading the request: cancel its stream (which aborts it) before returning."""
        await self.feeds.stop(feed_id, request_id)

    async def feed(self, feed_id: str) -> AsyncIterator[list[FeedItem]]:
        """The gateway's token feed: its requests' events, a step's together."""
        async for batch in self.feeds.serve(feed_id):
            yield batch
