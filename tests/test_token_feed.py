"""A worker's token feeds (services/token_feed.py), without Ray: one feed per gateway carries its requests'
events a step's together, a request's end or failure, and stopping a request or losing the gateway runs each
request's own cleanup (what aborts it on the engine) before it returns."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import InvalidRequestError
from engine.output import FinishReason
from services.messages import TokenEvent
from services.token_feed import StreamFailedError, TokenFeeds

pytestmark = pytest.mark.timeout(30)


class Stream:
    """A request's event stream as a worker's ``generate`` makes it: events put in by the test (an engine
    step), ended by ``None`` or an exception; ``cleaned`` once its ``finally`` ran (the worker's abort)."""

    def __init__(self) -> None:
        self.events: asyncio.Queue = asyncio.Queue()
        self.cleaned = False

    async def run(self):
        try:
            while (item := await self.events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            await asyncio.sleep(0)  # the worker's abort is a call to the engine thread
            self.cleaned = True


def event(token: int, last: bool = False) -> TokenEvent:
    return TokenEvent(0, [token], FinishReason.LENGTH if last else None, 4, 0, "x")


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickling calls Unpicklable(message): it fails
        super().__init__(f"{a} and {b}")


async def next_batch(feed) -> list:
    async with asyncio.timeout(10):
        return await anext(feed)


def test_a_steps_events_for_every_request_of_a_gateway_leave_in_one_batch_and_each_end_is_marked():
    async def scenario() -> None:
        feeds = TokenFeeds()
        one, two = Stream(), Stream()
        feeds.start("gw", "r1", one.run())
        feeds.start("gw", "r2", two.run())
        feed = feeds.serve("gw")
        one.events.put_nowait(event(5))
        two.events.put_nowait(event(7))  # the same engine step
        assert await next_batch(feed) == [("r1", event(5)), ("r2", event(7))]
        one.events.put_nowait(event(6, last=True))
        one.events.put_nowait(None)
        rest: list = []
        while ("r1", None) not in rest:  # the end follows the last event, in its batch or the next
            rest += await next_batch(feed)
        assert rest == [("r1", event(6, last=True)), ("r1", None)] and one.cleaned
        with pytest.raises(InvalidRequestError, match="already streaming"):
            feeds.start("gw", "r2", Stream().run())
        await feed.aclose()

    asyncio.run(scenario())


def test_a_failed_stream_sends_its_exception_or_its_words_when_the_exception_cannot_travel():
    async def scenario() -> None:
        feeds = TokenFeeds()
        plain, odd = Stream(), Stream()
        feeds.start("gw", "plain", plain.run())
        feeds.start("gw", "odd", odd.run())
        feed = feeds.serve("gw")
        plain.events.put_nowait(InvalidRequestError("prompt", "the prompt is empty"))
        (request_id, error), = await next_batch(feed)
        assert request_id == "plain" and isinstance(error, InvalidRequestError) and plain.cleaned
        odd.events.put_nowait(Unpicklable(1, 2))
        (request_id, error), = await next_batch(feed)
        assert request_id == "odd" and isinstance(error, StreamFailedError) and str(error) == "Unpicklable: 1 and 2"
        await feed.aclose()

    asyncio.run(scenario())


def test_stopping_a_request_returns_after_its_cleanup_and_other_requests_stream_on():
    async def scenario() -> None:
        feeds = TokenFeeds()
        stopped, other = Stream(), Stream()
        feeds.start("gw", "stopped", stopped.run())
        feeds.start("gw", "other", other.run())
        feed = feeds.serve("gw")
        stopped.events.put_nowait(event(3))
        assert await next_batch(feed) == [("stopped", event(3))]  # streaming, waiting for its next step
        await feeds.stop("gw", "stopped")
        assert stopped.cleaned and not other.cleaned
        await feeds.stop("gw", "stopped")  # again, or for a request that ended: nothing to do
        other.events.put_nowait(event(9))
        assert await next_batch(feed) == [("other", event(9))]
        await feed.aclose()

    asyncio.run(scenario())


def test_a_gateway_that_goes_away_stops_all_its_requests_and_only_its_own():
    async def scenario() -> None:
        feeds = TokenFeeds()
        mine, theirs = [Stream(), Stream()], Stream()
        for i, stream in enumerate(mine):
            feeds.start("gone", f"r{i}", stream.run())
        feeds.start("staying", "t", theirs.run())
        gone, staying = feeds.serve("gone"), feeds.serve("staying")
        mine[0].events.put_nowait(event(1))
        assert await next_batch(gone) == [("r0", event(1))]
        await gone.aclose()  # Ray cancels the feed's generator when the gateway's process is lost
        assert all(stream.cleaned for stream in mine) and not theirs.cleaned
        theirs.events.put_nowait(event(2))
        assert await next_batch(staying) == [("t", event(2))]
        await staying.aclose()
        assert theirs.cleaned

    asyncio.run(scenario())
