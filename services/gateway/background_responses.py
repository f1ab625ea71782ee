"""The Responses API's background mode (``background: true``): a response that runs on after its request has
been answered, read with ``GET /v1/responses/{id}`` and stopped with ``POST /v1/responses/{id}/cancel``.

The request is answered once its generation has started (routed, the prompt computed: a rejection is still
the request's error), with the response ``in_progress`` and kept in the store. The rest of the answer runs
in a task of the gateway's, which keeps the response again when it ends: ``completed`` or ``incomplete``,
``cancelled`` (the cancel route, or the server stopping) or ``failed`` (with the error a request would have
got). The task holds the request's resources as a foreground request does, and closing its generation
frees them. A response whose gateway died stays ``in_progress`` until its key expires.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.exceptions import RedisError

from engine.errors import InvalidRequestError
from services.gateway import errors
from services.gateway.responses_output import ResponsesOutput
from services.response_store import ResponseStore

log = logging.getLogger(__name__)


class BackgroundResponses:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._running: dict[str, asyncio.Task] = {}  # response id -> the task finishing it

    async def start(self, output: ResponsesOutput, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """Keep the started response as it is now and finish it in a task; the response now."""
        try:
            await self.store.put(output.response(), conversation)
        except BaseException:  # not kept, so nobody could read it: stop it (the request's error says why)
            output.gen.close()
            raise
        task = asyncio.create_task(self._finish(output, conversation))
        self._running[output.id] = task
        task.add_done_callback(lambda _: self._running.pop(output.id, None))
        return output.response()

    async def _finish(self, output: ResponsesOutput, conversation: list[dict[str, Any]]) -> None:
        try:
            async for delta in output.gen:
                output.feed(delta)
            if output.finish_reason in (None, "abort"):  # stopped under it (the server drained its requests)
                output.end("cancelled")
        except asyncio.CancelledError:
            output.end("cancelled")
        except Exception as exc:
            error = errors.classify(exc).body()["error"]
            output.end("failed", {"code": error["code"] or error["type"], "message": error["message"]})
        finally:
            output.gen.close()
        try:
            await self.store.put(output.response(), conversation)
        except RedisError as exc:
            log.warning("background response %s ended %s but was not stored: %s", output.id,
                        output.response()["status"], exc)

    async def cancel(self, response_id: str) -> dict[str, Any] | None:
        """Stop a running background response and return it as kept (one that has ended: as it ended); None
        for an unknown id; a 400 for a response that ran in the foreground."""
        if (task := self._running.get(response_id)) is not None:
            task.cancel()
            await asyncio.wait([task])
        stored = await self.store.get(response_id)
        if stored is None:
            return None
        if not stored.response.get("background"):
            raise InvalidRequestError("response_id", f"response {response_id!r} was not created with background: "
                                                     "true; only those can be cancelled")
        return stored.response

    async def stop(self) -> None:
        """Cancel every running background response (the server is stopping); each is kept as cancelled."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
