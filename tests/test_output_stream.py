"""services/output_stream.py: a request's engine outputs become its token events in the engine's delivery, held to
the stream interval (the answer's first token at once, the last with whatever is held); ``done`` says how the
request ended: finished (with what it generated), its step failed, or a fault of its own, which never reaches the
step's other requests. No engine, no Ray."""

from __future__ import annotations

import asyncio

import pytest

from engine.output import FinishReason, RequestOutput
from services.engine_loop import _put_all
from services.messages import EngineStepError, TokenEvent
from services.output_stream import OutputStream

pytestmark = pytest.mark.timeout(30)


def output(*tokens: int, finished: bool = False, cached: int = 32) -> RequestOutput:
    reason = FinishReason.LENGTH if finished else None
    return RequestOutput("r", 0, list(tokens), finished, reason, 40, cached, text="".join(chr(97 + t) for t in tokens))


def test_events_leave_n_tokens_at_a_time_the_first_at_once_and_the_last_with_what_is_held():
    async def scenario() -> None:
        sent: list[TokenEvent] = []
        stream = OutputStream(2, 3, True, sent.append)
        for step in ([0], [1], [2, 3], [4], [5], [6]):
            stream.push(output(*step))
            assert not stream.done.done()
        stream.push(output(7, finished=True, cached=16))
        assert [e.token_ids for e in sent] == [[0], [1, 2, 3], [4, 5, 6], [7]]
        assert [e.text for e in sent] == ["a", "bcd", "efg", "h"] and {e.index for e in sent} == {2}
        assert sent[-1].finish_reason is FinishReason.LENGTH and stream.ended
        assert await stream.done == ([0, 1, 2, 3, 4, 5, 6, 7], 16)  # the engine's cached prompt tokens

    asyncio.run(scenario())


def test_a_resumed_stream_holds_its_first_tokens_too_and_nothing_is_sent_after_its_end():
    async def scenario() -> None:
        sent: list[TokenEvent] = []
        stream = OutputStream(0, 2, False, sent.append)
        stream.push(output(5))
        assert sent == []  # not the answer's first token: held like the rest
        stream.push(output(6, finished=True))
        stream.push(output(9))  # (nothing follows a finish; were it delivered, it is not sent)
        assert [e.token_ids for e in sent] == [[5, 6]] and (await stream.done)[0] == [5, 6]

    asyncio.run(scenario())


def test_a_failed_step_fails_the_stream_and_marks_it_ended_so_it_is_not_aborted_again():
    async def scenario() -> None:
        sent: list[TokenEvent] = []
        stream = OutputStream(0, 4, True, sent.append)
        stream.push(output(1))
        stream.push(output(2))  # held: fewer than four tokens
        stream.push(EngineStepError("the engine step running r failed: RuntimeError: boom"))
        assert stream.ended and [e.token_ids for e in sent] == [[1]]
        with pytest.raises(EngineStepError, match="boom"):
            await stream.done

    asyncio.run(scenario())


def test_a_fault_in_one_stream_fails_that_request_alone_and_the_steps_other_outputs_are_delivered():
    async def scenario() -> None:
        def broken(event: TokenEvent) -> None:
            raise ValueError("cannot send")

        sent: list[TokenEvent] = []
        faulty, healthy = OutputStream(0, 1, True, broken), OutputStream(0, 1, True, sent.append)
        _put_all([(faulty.push, output(1)), (healthy.push, output(1))])  # one step's delivery
        assert [e.token_ids for e in sent] == [[1]]
        assert not faulty.ended  # the engine still runs it: its task aborts it
        with pytest.raises(ValueError, match="cannot send"):
            await faulty.done

    asyncio.run(scenario())


def test_outputs_delivered_after_the_consumer_was_cancelled_are_dropped():
    async def scenario() -> None:
        sent: list[TokenEvent] = []
        stream = OutputStream(0, 1, True, sent.append)
        async def request_task() -> None:  # as the worker's: it waits for the end
            await stream.done

        task = asyncio.create_task(request_task())
        await asyncio.sleep(0)
        task.cancel()  # the gateway stopped the request: the future it awaited is cancelled with it
        await asyncio.gather(task, return_exceptions=True)
        stream.push(output(3))
        stream.push(EngineStepError("late"))
        assert sent == [] and stream.done.cancelled()

    asyncio.run(scenario())
