"""The Responses API's routes: ``POST /v1/responses`` on the chat path (``responses_request.py``), kept in the
response store (``services/response_store.py``) unless ``store`` is false, streamed, whole or in the background
(``background_responses.py``); and ``GET`` (the response, or its input items), ``POST .../cancel`` and
``DELETE`` of a kept response."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from engine.errors import InvalidRequestError
from services.config import GatewayConfig
from services.gateway import errors
from services.gateway.background_responses import BackgroundResponses
from services.gateway.frontend import Frontend
from services.gateway.http_streams import events_stream, response_stream, run_to_end, unless_client_leaves
from services.gateway.json_body import StrictJSONRoute
from services.gateway.responses_output import ResponsesOutput
from services.gateway.responses_request import ResponsesRequest, renamed
from services.messages import SessionSequence
from services.response_store import ResponseStore, StoredResponse

log = logging.getLogger(__name__)


def responses_routes(frontend: Frontend, response_store: ResponseStore | None, config: GatewayConfig
                     ) -> tuple[APIRouter, BackgroundResponses | None]:
    """The routes, and the background responses they start (None without a store: the server stops those
    before the store closes)."""
    router = APIRouter(route_class=StrictJSONRoute)  # NaN, Infinity and lone surrogates refused, as elsewhere
    background = None if response_store is None else BackgroundResponses(response_store)

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API on the chat path (``responses_request.py``), kept in ``response_store``."""
        try:
            store = body.stored(response_store is not None)
            earlier, continued = await _continued(body)
            chat = body.chat_request(earlier)
            options = await asyncio.to_thread(chat.chat_options, config.tool_call_parser)  # as chat's
            gen = await unless_client_leaves(request, frontend.chat(
                chat.model, [m.as_dict() for m in chat.messages], options, continued=continued))
        except (InvalidRequestError, errors.UnsupportedFieldError) as exc:
            if (named := renamed(exc)) is exc:
                raise
            raise named from None
        output = ResponsesOutput(gen, body.echoed(store, frontend.dispatcher.generation_defaults), options.tool_call_reader(config.tool_call_parser),
                                 config.reasoning_parser)
        conversation = [*earlier, *body.kept_items()]
        if body.background:
            started = await background.start(output, conversation)
            if body.stream:
                return events_stream(await background.events(output.id))
            return JSONResponse(started)
        keep = (lambda: _keep(output, conversation)) if store else None
        if body.stream:
            return response_stream(gen, output, keep)
        await run_to_end(gen, request, output.feed)
        if keep is not None:
            await keep()
        return JSONResponse(output.response())

    async def _continued(body: ResponsesRequest) -> tuple[list[dict], SessionSequence | None]:
        """(the items a response continuing ``previous_response_id`` starts from, and that response's turn as
        token ids when its prompt was rendered as this one's will be: the same instructions and tools)."""
        if body.previous_response_id is None:
            return [], None
        stored = await _stored(body.previous_response_id, "previous_response_id")
        return stored.items, stored.sequence if body.renders_as(stored.response) else None

    async def _stored(response_id: str, param: str | None = None) -> StoredResponse:
        """The kept response; a 404 (naming ``param``) for one never kept, expired or deleted."""
        stored = None if response_store is None else await response_store.get(response_id)
        if stored is None:
            raise errors.NotFoundError("response", response_id, param)
        return stored

    async def _keep(output: ResponsesOutput, conversation: list[dict]) -> None:
        """Store a response that finished; when Redis fails, the answer still goes out, saying store: false."""
        if output.finish_reason in (None, "abort"):
            return
        try:
            await response_store.put(output.response(), conversation, output.sequence())
        except RedisError as exc:
            log.warning("response %s was not stored: %s", output.id, exc)
            output.request["store"] = False

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False, starting_after: int = Query(-1, ge=-1)
                           ) -> Response:
        """A kept response; ``stream``: a background one's events after ``starting_after``, as they come."""
        if stream:
            events = None if background is None else await background.events(response_id, starting_after)
            if events is None:
                raise errors.NotFoundError("response", response_id, None)
            return events_stream(events)
        return JSONResponse((await _stored(response_id)).response)

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc", after: str | None = None) -> dict:
        """The items a stored response answered (those of the responses it continued first), a page at a time:
        ``limit`` of them in ``order`` (desc: newest first), after the item ``after``."""
        stored = await _stored(response_id)
        items = stored.conversation if order == "asc" else stored.conversation[::-1]
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise InvalidRequestError("after", f"response {response_id!r} has no input item {after!r}")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
                "last_id": page[-1].get("id") if page else None, "has_more": len(items) > limit}

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict:
        """Stop a background response; it is kept (and returned) as cancelled, or as it ended."""
        cancelled = None if background is None else await background.cancel(response_id)
        if cancelled is None:
            raise errors.NotFoundError("response", response_id, None)
        return cancelled

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        """Forget a stored response (those that continued it keep their own copy of the conversation)."""
        if response_store is None or not await response_store.delete(response_id):
            raise errors.NotFoundError("response", response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    return router, background
