"""One request's engine outputs turned into the token events its gateway is sent, as the engine delivers them.

The engine thread hands a step's outputs to the worker's event loop in one callback (``EngineLoop._deliver``),
which calls each request's ``OutputStream.push``: the event is made and handed on (``emit``: to the gateway's
token feed) right there, so a step costs the loop one callback for all its requests. A task a request woken for
each of its outputs (an asyncio queue read by a generator, forwarded by another task) cost the loop 15-28 µs a
request a step with the feed's pickling, twice what it costs now (``benchmarks/worker_loop.py``): milliseconds a
step for a large batch, taken from the engine thread wherever it needs the GIL. The request's own task
(``Worker._stream``) wakes once, at its end.
"""

from __future__ import annotations

import asyncio

from engine.output import RequestOutput
from services.messages import EngineStepError, TokenEvent, join_events
from services.token_feed import Emit


class OutputStream:
    """Events are held until they make ``interval`` tokens or finish the request (``--stream-interval``);
    ``first_at_once``: the first output is the answer's first token (its time to first token), which leaves at
    once whatever the interval. ``done`` resolves when the request finishes, with the tokens it generated and the
    prompt tokens the engine found cached, or fails with what ended it (the failed step's ``EngineStepError``)."""

    def __init__(self, index: int, interval: int, first_at_once: bool, emit: Emit) -> None:
        self.index, self.interval, self.first_at_once, self.emit = index, interval, first_at_once, emit
        self.done: asyncio.Future[tuple[list[int], int]] = asyncio.get_running_loop().create_future()
        self.ended = False  # the engine is done with the request (finished, or its step failed and aborted it)
        self._generated: list[int] = []
        self._held: list[TokenEvent] = []  # outputs not sent yet, fewer tokens than the interval
        self._held_tokens = 0

    def push(self, item: RequestOutput | EngineStepError) -> None:
        """The event loop, in the engine's delivery: one output of the request, or the error that ends it."""
        if self.done.done():  # (it ended, failed, or its task was cancelled): nothing more is sent
            return
        if isinstance(item, EngineStepError):
            self.ended = True
            self.done.set_exception(item)
            return
        try:
            event = _event(item, self.index)
            self._held_tokens += len(item.new_token_ids)
            finished = item.finish_reason is not None
            if not (finished or self.first_at_once or self._held_tokens >= self.interval):
                self._held.append(event)
                return
            if self._held:
                event, self._held = join_events([*self._held, event]), []
            self._held_tokens, self.first_at_once = 0, False
            self._generated += event.token_ids
            self.emit(event)
        except Exception as exc:  # a fault here is this request's: the step's other requests are delivered on
            self.done.set_exception(exc)
            return
        if finished:
            self.ended = True
            self.done.set_result((self._generated, item.num_cached_tokens))


def _event(output: RequestOutput, index: int) -> TokenEvent:
    return TokenEvent(
        index=index, token_ids=output.new_token_ids, finish_reason=output.finish_reason,
        num_prompt_tokens=output.num_prompt_tokens, num_cached_tokens=output.num_cached_tokens, text=output.text,
        logprobs=output.logprobs, prompt_logprobs=output.prompt_logprobs,
        accepted_prediction_tokens=output.accepted_prediction_tokens,
        rejected_prediction_tokens=output.rejected_prediction_tokens,
    )
