"""Running a `Generation` for an HTTP client: to its end, or as server-sent events (chat and completions
chunks, or the Responses API's ``response.*`` events), stopping it whenever the client leaves; and a
background response's events, which run on without it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from services.gateway import errors
from services.gateway.generation import Delta, Generation
from services.gateway.responses import ResponseShape
from services.gateway.responses_output import ResponsesOutput

_DISCONNECT_POLL_S = 0.25
# The characters JSON leaves unescaped that Unicode-aware line readers (Python's str.splitlines, so httpx's
# aiter_lines) take for line ends, cutting an event's data line in two. SSE ends lines only at CR and LF, which
# JSON escapes; these are escaped too (the same JSON), so that a client reading by such lines still gets events.
_LINE_BREAKS_JSON_KEEPS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_ESCAPE_LINE_BREAKS = str.maketrans(_LINE_BREAKS_JSON_KEEPS)


class GenerationStream(StreamingResponse):
    """A streaming response that stops its generation however the response ends (done, error, disconnect).

    The disconnect closes the generation as soon as the server reports it, rather than through
    Starlette's cancellation of the streaming task: that cancellation is only delivered while the task
    waits, and a task woken by a token on every loop turn may never be seen waiting.
    """

    def __init__(self, gen: Generation, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        async def watched_receive():
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gen.close()
            return message

        try:
            await super().__call__(scope, watched_receive, send)
        finally:
            self.gen.close()


def sse_json(obj: dict) -> str:
    """``obj`` as JSON for one SSE data line: UTF-8 text as is, but no character any line reader splits at."""
    text = json.dumps(obj, ensure_ascii=False)
    # (looked for first: three scans cost a twentieth of the translation, which nearly every event skips)
    return text.translate(_ESCAPE_LINE_BREAKS) if any(c in text for c in _LINE_BREAKS_JSON_KEEPS) else text


T = TypeVar("T")


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else sse_json(obj)}\n\n"


async def unless_client_leaves(request: Request, starting: Awaitable[T]) -> T:
    """The started generation (or an embedding's answer), unless the client leaves first: then prompt, session,
    routing and prefill up to the first event are cancelled (which aborts the request and frees its blocks)."""
    task = asyncio.ensure_future(starting)
    try:
        while not task.done():
            await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise errors.ClientLeftError()
        return task.result()
    finally:
        task.cancel()  # the handler itself was cancelled (shutdown); no-op once done


async def run_to_end(gen: Generation, request: Request, on_delta: Callable[[Delta], object] | None = None) -> None:
    """Run a non-streamed request to its end (``on_delta`` sees each delta), unless the client leaves first
    (then it is aborted)."""

    async def watch_client() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(_DISCONNECT_POLL_S)
        gen.close()

    watcher = asyncio.create_task(watch_client())
    try:
        async for d in gen:
            if on_delta is not None:
                on_delta(d)
    finally:
        watcher.cancel()
        gen.close()


def response_stream(gen: Generation, output: ResponsesOutput,
                    keep: Callable[[], Awaitable[None]] | None = None) -> StreamingResponse:
    """The Responses API's SSE events (``event:`` names its type); an error after the start is an ``error``
    event, as OpenAI sends it. ``keep`` stores the finished response before its last event goes out, so a
    client that has seen it can continue it."""
    async def events() -> AsyncIterator[str]:
        try:
            for event in output.start():
                yield _sse_event(event)
            async for d in gen:
                for event in output.feed(d):
                    yield _sse_event(event)
            if keep is not None:
                await keep()
            for event in output.finish():
                yield _sse_event(event)
        except Exception as exc:
            err = errors.classify(exc).body()["error"]
            yield _sse_event({"type": "error", "sequence_number": output.next_sequence(), "code": err["code"],
                              "message": err["message"], "param": err["param"]})

    return GenerationStream(gen, events())


def events_stream(events: AsyncIterator[dict]) -> StreamingResponse:
    """Responses API events already made (a background response's, which runs on whether or not the client
    stays), as SSE."""
    async def sse() -> AsyncIterator[str]:
        async for event in events:
            yield _sse_event(event)

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {sse_json(event)}\n\n"


def chat_stream(gen: Generation, shape: ResponseShape, include_usage: bool, continuous_usage: bool) -> StreamingResponse:
    """SSE chunks; ``continuous_usage``: each carries the usage so far (else only the last, when included)."""
    async def events() -> AsyncIterator[str]:
        try:
            opening = shape.opening()
            if opening:
                yield _sse(shape.chunk(opening, gen.usage if continuous_usage else None, with_usage=include_usage))
            async for d in gen:
                if (choice := shape.delta(d)) is not None:
                    yield _sse(shape.chunk([choice], gen.usage if continuous_usage else None,
                                           with_usage=include_usage))
            if include_usage:
                yield _sse(shape.chunk([], gen.usage, with_usage=True))
        except Exception as exc:  # headers are gone: report in-band, as OpenAI does
            yield _sse(errors.classify(exc).body())
        yield _sse("[DONE]")

    return GenerationStream(gen, events())
