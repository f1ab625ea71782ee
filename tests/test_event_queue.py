"""The queue between a stream's token events and their consumer (services/event_queue.py): a consumer that
keeps up takes each event as it was sent; one that fell behind takes what piled up for a choice as one event,
every token, its text and logprobs in order; nothing is joined past a choice's last event or across an end."""

from __future__ import annotations

import asyncio

import pytest

from engine.output import FinishReason, TokenLogprobs
from services.event_queue import TokenEventQueue
from services.messages import TokenEvent, join_events

pytestmark = pytest.mark.timeout(10)


def event(index: int, token: int, last: bool = False, **fields) -> TokenEvent:
    return TokenEvent(index, [token], FinishReason.STOP if last else None, 4, 2, f"<{token}>", **fields)


def test_a_consumer_that_keeps_up_takes_each_event_as_it_was_sent():
    async def scenario() -> None:
        queue = TokenEventQueue()
        first, second = event(0, 1), event(0, 2)
        taking = asyncio.create_task(queue.get())
        await asyncio.sleep(0)  # the consumer waits
        queue.put_nowait(first)
        assert await taking is first
        queue.put_nowait(second)
        assert queue.get_nowait() is second and queue.empty()

    asyncio.run(scenario())


def test_what_piled_up_for_each_choice_is_taken_as_one_event_in_order():
    lp = [TokenLogprobs(t, -0.5) for t in range(4)]
    prompt_lp = [TokenLogprobs(9, -1.0)]
    queue = TokenEventQueue()
    queue.put_nowait(event(0, 1, logprobs=[lp[0]], prompt_logprobs=prompt_lp, accepted_prediction_tokens=1))
    queue.put_nowait(event(1, 5))
    queue.put_nowait(event(0, 2, logprobs=[lp[1]], rejected_prediction_tokens=2))
    queue.put_nowait(event(1, 6, last=True))
    queue.put_nowait(event(0, 3, logprobs=[lp[2]], accepted_prediction_tokens=1))
    assert queue.qsize() == 2
    choice0, choice1 = queue.get_nowait(), queue.get_nowait()
    assert choice0 == TokenEvent(0, [1, 2, 3], None, 4, 2, "<1><2><3>", logprobs=lp[:3], prompt_logprobs=prompt_lp,
                                 accepted_prediction_tokens=2, rejected_prediction_tokens=2)
    assert choice1 == TokenEvent(1, [5, 6], FinishReason.STOP, 4, 2, "<5><6>")


def test_nothing_is_joined_past_a_choices_last_event_or_across_an_end():
    queue = TokenEventQueue()
    failure = RuntimeError("the stream broke")
    queue.put_nowait(event(0, 1, last=True))
    queue.put_nowait(event(0, 2))  # (a later attempt's, say): a new event, not part of the finished one
    queue.put_nowait(failure)
    queue.put_nowait(event(0, 3))
    assert [queue.get_nowait() for _ in range(4)] == [event(0, 1, last=True), event(0, 2), failure, event(0, 3)]


def test_joined_events_have_logprobs_only_when_theirs_had_them_and_the_last_ones_counts():
    later = TokenEvent(0, [2], FinishReason.LENGTH, 5, 3, "b")
    joined = join_events([TokenEvent(0, [1], None, 4, 2, "a"), later])
    assert joined == TokenEvent(0, [1, 2], FinishReason.LENGTH, 5, 3, "ab") and joined.logprobs is None
    assert join_events([later]) is later


def test_a_generation_whose_client_fell_behind_gets_fewer_deltas_with_every_token_and_the_usage_unchanged():
    from services.gateway.generation import Generation

    async def events():
        for i in range(10):  # all sent before the client reads: it fell behind by the whole answer
            yield TokenEvent(i % 2, [i], FinishReason.LENGTH if i >= 8 else None, 4, 0, f"<{i}>")

    async def scenario() -> None:
        gen = Generation("r", events(), n=2)
        await gen.start()
        await asyncio.sleep(0.01)  # the pump queued the rest meanwhile
        deltas = [d async for d in gen]
        assert len(deltas) < 10
        assert [t for d in deltas if d.index == 0 for t in d.token_ids] == [0, 2, 4, 6, 8]
        assert gen.texts == ["<0><2><4><6><8>", "<1><3><5><7><9>"] and gen.finish_reasons == ["length", "length"]
        assert gen.usage.completion_tokens == 10 and gen.usage.prompt_tokens == 4

    asyncio.run(scenario())
