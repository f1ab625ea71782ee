"""One running request as the APIs see it: dispatcher token events in, per-choice text deltas out.

The dispatcher's event generator is driven by its own asyncio task (the pump), not by the HTTP or gRPC
handler. A handler that is cancelled (client gone) then only has to cancel the pump: the cancellation
reaches the dispatcher generator once, at the point where it waits, and its cleanup (abort, free blocks)
runs to completion. Driven directly from Starlette's streaming task instead, that cleanup would be
cancelled again at its first await.

A completions request with several prompts runs one dispatcher request per prompt; ``merge_streams``
interleaves their events, whose choice indices the frontend has shifted to ``prompt * n + choice``. With
``echo``, each choice's first delta starts with its prompt's text and, when logprobs were asked for, the
prompt tokens' logprobs (which the request's first event carries).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from engine.output import TokenLogprobs
from services.event_queue import TokenEventQueue

_END = object()  # the dispatcher's generator is exhausted, or the generation was closed
T = TypeVar("T")


@dataclass
class Delta:
    """New text for one choice; ``finish_reason`` is set on the choice's last delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked for them


@dataclass(frozen=True)
class Echo:
    """Completions' echo: each prompt's text and token ids go before its choices' output."""

    texts: list[str]
    token_ids: list[list[int]]
    output: bool = True  # False (max_tokens 0): the prompt only; the one token computed is not returned


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # With a predicted output (None without): its tokens the decode workers drafted and the answers kept, and
    # those they drafted and did not keep, summed over the choices (OpenAI's completion_tokens_details)
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Generation:
    """Iterate it for `Delta`s; `start()` first, which raises the dispatcher's up-front errors."""

    def __init__(self, request_id: str, events: AsyncIterator, n: int,
                 choices_per_prompt: int | None = None, echo: Echo | None = None,
                 predicted: bool = False, prompts: list[list[int]] | None = None) -> None:
        """``n`` choices in all, ``choices_per_prompt`` of them (default: all) for each prompt;
        ``predicted``: the request has a predicted output (its usage counts the prediction's drafts);
        ``prompts``: each prompt's token ids, when known (for stored turns and vLLM's return_token_ids)."""
        self.echo = echo
        self._echo_sent: set[int] = set()  # choices whose prompt was echoed
        self.request_id = request_id
        self.prompts = prompts
        self.texts = [""] * n  # each choice's text so far (the engine already cut any stop string)
        self.token_ids: list[list[int]] = [[] for _ in range(n)]  # each choice's output tokens so far
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]  # each choice's, when asked
        # each prompt's tokens' logprobs after its first (prompt_logprobs asked for), from its first event
        self.prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        self.finish_reasons: list[str | None] = [None] * n
        self.usage = Usage()
        if predicted:
            self.usage.accepted_prediction_tokens = self.usage.rejected_prediction_tokens = 0
        self._per_prompt = choices_per_prompt or n
        self._prompt_tokens: dict[int, int] = {}  # prompt -> its tokens
        self._cached_tokens: dict[int, int] = {}  # prompt -> its prefix-cache hit
        self._queue = TokenEventQueue()  # what the client has not taken yet is joined: a slow one stays current
        self._pump_task = asyncio.get_running_loop().create_task(self._pump(events))
        self._first: object = _END

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason."""
        return all(r is not None for r in self.finish_reasons)

    async def _pump(self, events: AsyncIterator) -> None:
        try:
            async for event in events:
                self._queue.put_nowait(event)
            self._queue.put_nowait(_END)
        except asyncio.CancelledError:
            self._queue.put_nowait(_END)  # closed: a consumer still waiting stops too
            raise
        except Exception as exc:  # handed to the consumer, which maps it to a status
            self._queue.put_nowait(exc)

    async def _next(self) -> object:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def start(self) -> None:
        """Wait for the first event, so rejections and errors surface before any response is sent (its
        prompt's tokens count in the usage from then on)."""
        self._first = await self._next()
        if self._first is not _END:
            self._count_prompt(self._first)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        event = self._first
        while event is not _END:
            yield self._apply(event)
            if self.finished:
                break
            event = await self._next()
        self.close()

    def _count_prompt(self, event) -> None:
        prompt = event.index // self._per_prompt
        self._prompt_tokens[prompt] = event.num_prompt_tokens
        if event.index % self._per_prompt == 0:  # the later choices hit the blocks choice 0 computed: its own hit
            self._cached_tokens[prompt] = event.num_cached_tokens
        self.usage.prompt_tokens = sum(self._prompt_tokens.values())
        self.usage.cached_tokens = sum(self._cached_tokens.values())

    def _apply(self, event) -> Delta:
        i = event.index
        prompt = i // self._per_prompt
        self._count_prompt(event)
        text, token_ids, logprobs, finish_reason = event.text, list(event.token_ids), event.logprobs, event.finish_reason
        if event.prompt_logprobs is not None:
            self.prompt_logprobs.setdefault(prompt, event.prompt_logprobs)
        if self.echo is not None:
            text, token_ids, logprobs, finish_reason = self._with_echo(event, prompt, text, logprobs, finish_reason)
        self.usage.completion_tokens += len(token_ids)
        if self.usage.accepted_prediction_tokens is not None:
            self.usage.accepted_prediction_tokens += event.accepted_prediction_tokens
            self.usage.rejected_prediction_tokens += event.rejected_prediction_tokens
        self.texts[i] += text
        self.token_ids[i] += token_ids
        if logprobs:
            self.logprobs[i] += logprobs
        self.finish_reasons[i] = finish_reason
        return Delta(i, text, token_ids, finish_reason, logprobs)

    def _with_echo(self, event, prompt: int, text: str, logprobs: list[TokenLogprobs] | None, finish_reason: str | None
                ) -> tuple[str, list[int], list[TokenLogprobs] | None, str | None]:
        """(text, token ids, logprobs, finish reason) of ``event`` with echo: the prompt's text and logprobs go
        before the choice's first event's; with max_tokens 0, the token computed is not part of the answer."""
        token_ids = list(event.token_ids)
        if not self.echo.output:
            text, token_ids, logprobs, finish_reason = "", [], logprobs and [], finish_reason and "length"
        if event.index not in self._echo_sent:
            self._echo_sent.add(event.index)
            text = self.echo.texts[prompt] + text
            if event.prompt_logprobs is not None:
                first = TokenLogprobs(self.echo.token_ids[prompt][0], None)  # nothing predicts it
                logprobs = [first, *event.prompt_logprobs, *(logprobs or ())]
        return text, token_ids, logprobs, finish_reason

    def prompt_of(self, choice: int) -> list[int]:
        """``choice``'s prompt's token ids (``prompts`` must be known)."""
        return self.prompts[choice // self._per_prompt]

    def prompt_logprobs_of(self, choice: int) -> list[TokenLogprobs]:
        """The logprobs of ``choice``'s prompt's tokens after the first ([] when none arrived)."""
        return self.prompt_logprobs.get(choice // self._per_prompt, [])

    def close(self) -> None:
        """Stop the request if it is still running (the dispatcher aborts it and frees its blocks)."""
        if not self._pump_task.done():
            self._pump_task.cancel()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The events of all ``streams`` as they arrive, each stream driven by its own task.

    Nothing is yielded until every stream has produced its first event (or ended), so an up-front
    rejection of any of them surfaces before the first event, as with one stream. The first error ends
    the merge; however it ends, every stream still running is cancelled (which runs its cleanup).
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[T]) -> None:
        try:
            async for event in stream:
                queue.put_nowait((k, event))
        except Exception as exc:  # handed to the consumer
            queue.put_nowait((k, exc))
            return
        queue.put_nowait((k, _END))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        started: set[int] = set()
        held: list[T] = []  # events not yielded yet: all of them until every stream has started
        open_streams = len(tasks)
        while open_streams:
            k, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            started.add(k)
            if item is _END:
                open_streams -= 1
            else:
                held.append(item)
            if len(started) == len(tasks):
                for event in held:
                    yield event
                held.clear()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
