"""The Responses API's background mode (``background: true``): a response that runs on after its request has
been answered or its stream has been left, read with ``GET /v1/responses/{id}`` (or streamed again from an
event, ``?stream=true&starting_after=N``) and stopped with ``POST /v1/responses/{id}/cancel``.

The request is answered once its generation has started (routed, the prompt computed: a rejection is still
the request's error), with the response ``in_progress`` and kept in the store; streamed, its events follow
as they come. The rest of the answer runs in a task of the gateway's, which logs every event (so a stream
can resume after the last one its client saw) and keeps the response again when it ends: ``completed`` or
``incomplete``, ``cancelled`` (the cancel route, or the server stopping) or ``failed`` (with the error a
request would have got). A client leaving a stream leaves the response running. The task holds the
request's resources as a foreground request does, and closing its generation frees them. A response whose
gateway died stays ``in_progress`` until its key expires.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from redis.exceptions import RedisError

from engine.errors import InvalidRequestError
from services.gateway import errors
from services.gateway.responses_output import ResponsesOutput
from services.response_store import ResponseStore

log = logging.getLogger(__name__)


class _Run:
    """One running background response: its output and every event so far (an event's sequence number is
    its index), and a signal for those following them."""

    def __init__(self, output: ResponsesOutput) -> None:
        self.output = output
        self.events: list[dict[str, Any]] = []
        self.ended = False
        self._appended = asyncio.Event()

    def add(self, events: list[dict[str, Any]], last: bool = False) -> None:
        self.events += events
        self.ended = last
        self._appended.set()
        self._appended = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[dict[str, Any]]:
        """The events after sequence number ``after`` (-1: all of them), as they come, to the last one."""
        index = after + 1
        while True:
            appended = self._appended
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.ended:
                return
            await appended.wait()


class BackgroundResponses:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._runs: dict[str, _Run] = {}  # running responses by id
        self._tasks: dict[str, asyncio.Task] = {}  # the task finishing each

    async def start(self, output: ResponsesOutput, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """Keep the started response as it is now and finish it in a task; the response now (its events:
        ``follow``)."""
        run = _Run(output)
        run.add(output.start())
        try:
            await self.store.put(output.response(), conversation)  # its answer's ids come at its end
        except BaseException:  # not kept, so nobody could read it: stop it (the request's error says why)
            output.gen.close()
            raise
        self._runs[output.id] = run
        task = asyncio.create_task(self._finish(run, conversation))
        self._tasks[output.id] = task
        task.add_done_callback(lambda _: (self._runs.pop(output.id, None), self._tasks.pop(output.id, None)))
        return output.response()

    async def _finish(self, run: _Run, conversation: list[dict[str, Any]]) -> None:
        output = run.output
        try:
            async for delta in output.gen:
                run.add(output.feed(delta))
            if output.finish_reason in (None, "abort"):  # stopped under it (the server drained its requests)
                run.add(output.end("cancelled"))
        except asyncio.CancelledError:
            run.add(output.end("cancelled"))
        except Exception as exc:
            error = errors.classify(exc).body()["error"]
            run.add(output.end("failed", {"code": error["code"] or error["type"], "message": error["message"]}))
        finally:
            output.gen.close()
        try:  # kept before the last event goes out: a client that saw it reads the response as it ended
            await self.store.put(output.response(), conversation, output.sequence())
        except RedisError as exc:
            log.warning("background response %s ended %s but was not stored: %s", output.id,
                        output.response()["status"], exc)
        run.add(output.finish(), last=True)

    async def events(self, response_id: str, after: int = -1) -> AsyncIterator[dict[str, Any]] | None:
        """The response's events after sequence number ``after``, as they come: from its log while it runs
        here, else (it has ended) only its last event; None for an unknown id, a 400 for a foreground one."""
        if (run := self._runs.get(response_id)) is not None:
            return run.follow(after)
        stored = await self._background(response_id)
        if stored is None:
            return None
        return _ended(stored)

    async def cancel(self, response_id: str) -> dict[str, Any] | None:
        """Stop a running background response and return it as kept (one that has ended: as it ended); None
        for an unknown id; a 400 for a response that ran in the foreground."""
        if (task := self._tasks.get(response_id)) is not None:
            task.cancel()
            await asyncio.wait([task])
        return await self._background(response_id)

    async def _background(self, response_id: str) -> dict[str, Any] | None:
        stored = await self.store.get(response_id)
        if stored is None:
            return None
        if not stored.response.get("background"):
            raise InvalidRequestError("response_id", f"response {response_id!r} was not created with background: "
                                                     "true; only those can be cancelled or streamed again")
        return stored.response

    async def stop(self) -> None:
        """Cancel every running background response (the server is stopping); each is kept as cancelled."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


async def _ended(response: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """A response that ended before its stream was asked for again: its last event (none while its gateway
    is gone and it still says in_progress, nor when it was cancelled)."""
    if response["status"] not in ("in_progress", "cancelled"):
        yield {"type": f"response.{response['status']}", "sequence_number": None, "response": response}
