"""A worker's token feeds (services/token_feed.py): one feed per gateway carries its requests' events a step's
together, each request's joined when they piled up while the gateway was behind, a request's end or failure,
and stopping a request or losing the gateway runs each request's own cleanup (what aborts it on the engine)
before it returns. Without Ray, but for the last two tests: a gateway's reader that stalls (Ray's backpressure
holds the worker's feed) and one that breaks (it cancels the worker's feed)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from engine.errors import InvalidRequestError
from engine.output import FinishReason, TokenLogprobs
from engine.sampling_params import SamplingParams
from services.errors import WorkerLostError, WorkerStalledError
from services.event_queue import TokenEventQueue
from services.messages import Role, TokenEvent, WorkerInfo, WorkerProfile, join_events
from services.token_feed import FeedServer, StreamFailedError, TokenFeeds, decode_batch, encode_batch
from services.worker_client import TokenFeedReader, WorkerClient

pytestmark = pytest.mark.timeout(30)


class Stream:
    """A request as a worker's ``generate`` runs it: events put in by the test (an engine step) are emitted,
    ``None`` ends it and an exception fails it; ``cleaned`` once its ``finally`` ran (the worker's abort)."""

    def __init__(self) -> None:
        self.events: asyncio.Queue = asyncio.Queue()
        self.cleaned = False

    async def run(self, emit) -> None:
        try:
            while (item := await self.events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                emit(item)
        finally:
            await asyncio.sleep(0)  # the worker's abort is a call to the engine thread
            self.cleaned = True


def event(token: int, last: bool = False) -> TokenEvent:
    return TokenEvent(0, [token], FinishReason.LENGTH if last else None, 4, 0, "x")


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickling calls Unpicklable(message): it fails
        super().__init__(f"{a} and {b}")


def streaming(feeds: TokenFeeds, feed_id: str, *request_ids: str) -> list[Stream]:
    """A started stream for each of ``request_ids``, on ``feed_id``'s feed."""
    streams = [Stream() for _ in request_ids]
    for request_id, stream in zip(request_ids, streams, strict=True):
        feeds.start(feed_id, request_id, stream.run)
    return streams


async def next_batch(feed) -> list:
    """The feed's next batch, as the gateway's reader decodes it."""
    async with asyncio.timeout(10):
        return decode_batch(await anext(feed))


def test_a_steps_events_for_every_request_of_a_gateway_leave_in_one_batch_and_each_end_is_marked():
    async def scenario() -> None:
        feeds = TokenFeeds()
        one, two = streaming(feeds, "gw", "r1", "r2")
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
            feeds.start("gw", "r2", Stream().run)
        await feed.aclose()

    asyncio.run(scenario())


def test_a_batch_decodes_to_what_was_encoded_every_field_of_every_event_its_ends_and_failures():
    logprobs = [TokenLogprobs(5, -0.25, ((5, -0.25), (9, -2.0)), 1), TokenLogprobs(6, -1.5, (), 3)]
    prompt_logprobs = [TokenLogprobs(1, None), TokenLogprobs(2, -0.75, ((4, -0.5),), 2)]
    full = TokenEvent(3, [5, 6], FinishReason.STOP, 40, 16, "héllo", logprobs, prompt_logprobs, 2, 1)
    items = [("r1", full), ("r1", None), ("r2", event(7)), ("r3", InvalidRequestError("prompt", "the prompt is empty"))]
    decoded = decode_batch(encode_batch(items))
    assert decoded[:3] == items[:3] and decoded[3][0] == "r3"
    assert isinstance(decoded[3][1], InvalidRequestError) and str(decoded[3][1]) == str(items[3][1])


def test_a_failed_stream_sends_its_exception_or_its_words_when_the_exception_cannot_travel():
    async def scenario() -> None:
        feeds = TokenFeeds()
        plain, odd = streaming(feeds, "gw", "plain", "odd")
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
        stopped, other = streaming(feeds, "gw", "stopped", "other")
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


def test_what_a_stopped_request_emits_before_its_cleanup_is_not_sent():
    async def scenario() -> None:
        feeds = TokenFeeds()

        async def late_step(emit) -> None:  # the engine delivers a step between the stop and the cleanup
            try:
                await asyncio.Event().wait()
            finally:
                emit(event(99))

        feeds.start("gw", "stopped", late_step)
        (other,) = streaming(feeds, "gw", "other")
        feed = feeds.serve("gw")
        await asyncio.sleep(0)
        await feeds.stop("gw", "stopped")
        other.events.put_nowait(event(9))
        assert await next_batch(feed) == [("other", event(9))]
        await feed.aclose()

    asyncio.run(scenario())


def test_a_gateway_that_goes_away_stops_all_its_requests_and_only_its_own():
    async def scenario() -> None:
        feeds = TokenFeeds()
        mine, (theirs,) = streaming(feeds, "gone", "r0", "r1"), streaming(feeds, "staying", "t")
        gone, staying = feeds.serve("gone"), feeds.serve("staying")
        mine[0].events.put_nowait(event(1))
        assert await next_batch(gone) == [("r0", event(1))]
        await gone.aclose()  # the gateway's reader closed it (its dispatcher stopped): Ray cancels the generator
        assert all(stream.cleaned for stream in mine) and not theirs.cleaned
        theirs.events.put_nowait(event(2))
        assert await next_batch(staying) == [("t", event(2))]
        await staying.aclose()
        assert theirs.cleaned

    asyncio.run(scenario())


def test_a_gateway_behind_the_steps_gets_each_requests_piled_up_events_joined_and_its_end_after():
    async def scenario() -> None:
        feeds = TokenFeeds()
        one, two = streaming(feeds, "gw", "r1", "r2")
        feed = feeds.serve("gw")
        for step in range(3):  # three engine steps while the gateway reads nothing
            one.events.put_nowait(event(10 + step, last=step == 2))
            two.events.put_nowait(event(20 + step))
        one.events.put_nowait(None)
        await asyncio.sleep(0.05)  # the requests' tasks hand every step's events to the outbox
        batch = await next_batch(feed)
        assert [item for r, item in batch if r == "r1"] == [join_events([event(10), event(11), event(12, True)]), None]
        assert [item for r, item in batch if r == "r2"] == [join_events([event(20), event(21), event(22)])]
        await feed.aclose()

    asyncio.run(scenario())


class PacedStreams(FeedServer):
    """The worker's stream methods (``FeedServer``) on the real token feeds, its requests' tokens given by
    ``step``; counts the batches its feeds sent."""

    def __init__(self) -> None:
        self.feeds = TokenFeeds()
        self.streams: dict[str, Stream] = {}
        self.batches = 0

    async def generate(self, emit, request_id: str, *_) -> None:
        self.streams[request_id] = Stream()
        await self.streams[request_id].run(emit)

    async def feed(self, feed_id: str):
        async for batch in super().feed(feed_id):
            self.batches += 1
            yield batch

    def open_streams(self) -> int:
        return len(self.streams)

    def open_feeds(self) -> int:
        return len(self.feeds._feeds)

    async def step(self, steps: int, finish: bool = True) -> int:
        """``steps`` engine steps, each a token for every request (the last step's finishing it, if ``finish``);
        the batches its feeds sent so far."""
        for i in range(steps):
            for stream in self.streams.values():
                stream.events.put_nowait(event(i, last=finish and i == steps - 1))
            await asyncio.sleep(0.02)  # a step's time: the feed sends what it may
        return self.batches


def paced_worker(ray) -> tuple:
    """A ``PacedStreams`` actor and the worker client the gateway reads it with."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (not importable in Ray's workers)
    actor = ray.remote(num_cpus=0)(PacedStreams).remote()
    info = WorkerInfo("paced", Role.DECODE, "127.0.0.1", "", "cpu", "m", 16, 4096, 1, 1, WorkerProfile([], []))
    return actor, WorkerClient(info, actor)


@pytest.mark.timeout(60)  # (the session's Ray may start here)
def test_a_gateway_whose_reading_stalls_gets_the_steps_made_meanwhile_in_few_batches_every_token_in_order(
        ray_session):
    import ray

    async def scenario() -> None:
        actor, client = paced_worker(ray)
        streams = [client.decode(f"r{i}", [1, 2, 3], 0, SamplingParams(max_tokens=20), 0, 0) for i in range(2)]
        firsts = [asyncio.create_task(anext(s)) for s in streams]  # each started and waiting for its first token
        while await actor.open_streams.remote() < 2:
            await asyncio.sleep(0.01)
        batches = ray.get(actor.step.remote(20))  # blocks this loop: the gateway reads nothing meanwhile
        assert batches < 20  # the feed waited for the gateway, not sending a batch a step
        for first, stream in zip(firsts, streams, strict=True):
            events = [await first] + [e async for e in stream]
            assert [t for e in events for t in e.token_ids] == list(range(20)) and events[-1].finish_reason
            assert len(events) < 20  # what piled up came joined
        await client.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)  # (the session's Ray may start here)
def test_a_stream_fails_as_stalled_once_its_worker_sends_nothing_for_the_token_timeout_not_while_it_sends(
        ray_session):
    """Its worker sends 3 tokens, then 40 more over 0.8 s while the consumer takes none (a slow client does
    not make the worker look stalled), then goes quiet: the consumer gets all 43, then WorkerStalledError
    once 0.5 s passed without an event, not at once."""
    import ray

    async def scenario() -> None:
        actor, client = paced_worker(ray)
        stream = client.generate("r0", [1, 2, 3], SamplingParams(max_tokens=100), 0, None, first_timeout_s=30.0,
                                 token_timeout_s=0.5)
        first = asyncio.create_task(anext(stream))
        while await actor.open_streams.remote() < 1:
            await asyncio.sleep(0.01)
        await actor.step.remote(3, False)
        tokens = (await first).token_ids
        await actor.step.remote(40, False)  # 0.8 s, longer than the timeout, while nothing is taken
        loop = asyncio.get_running_loop()
        sent = loop.time()  # (the last token left the worker a step's 0.02 s before)
        with pytest.raises(WorkerStalledError, match="worker paced sent nothing for"):
            async for e in stream:
                tokens += e.token_ids
        assert tokens == list(range(3)) + list(range(40))
        assert loop.time() - sent >= 0.3  # the timeout ran from the last token, not from when it was taken
        await client.close()

    asyncio.run(scenario())


class RefusingQueue(TokenEventQueue):
    """A request's queue that fails on a token event, as a bug in the gateway's reader would."""

    def put_nowait(self, item) -> None:
        if isinstance(item, TokenEvent):
            raise RuntimeError("a bug in the reader")
        super().put_nowait(item)


@pytest.mark.timeout(60)  # (the session's Ray may start here)
def test_a_feed_whose_reader_breaks_fails_its_requests_at_once_and_is_cancelled_on_the_worker(
        ray_session, monkeypatch):
    import ray

    def open_refusing(reader: TokenFeedReader, request_id: str) -> TokenEventQueue:
        queue = reader._queues[request_id] = RefusingQueue()
        return queue

    async def scenario() -> None:
        actor, client = paced_worker(ray)
        stream = client.decode("r0", [1, 2, 3], 0, SamplingParams(max_tokens=5), 0, 0, token_timeout_s=30.0)
        monkeypatch.setattr(TokenFeedReader, "open", open_refusing)
        first = asyncio.create_task(anext(stream))
        while await actor.open_streams.remote() < 1:
            await asyncio.sleep(0.01)
        reader = client._token_feed
        await actor.step.remote(1)
        with pytest.raises(WorkerLostError, match="the token feed from paced broke: a bug in the reader") as failed:
            await first  # at once, not after the 30 s the stream may go without a token
        assert type(failed.value) is WorkerLostError and reader.broken
        for _ in range(500):  # the reader cancelled the worker's side of the feed
            if await actor.open_feeds.remote() == 0:
                break
            await asyncio.sleep(0.01)
        assert await actor.open_feeds.remote() == 0
        await client.close()

    asyncio.run(scenario())
