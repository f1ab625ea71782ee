"""The OpenAI-compatible HTTP API (FastAPI): chat, completions and responses, streamed (SSE) or not.

Request flow: `_Guard` (API key, body size) -> pydantic body -> `Frontend` (prompt, limits, session) ->
`Generation` (dispatcher events -> text) -> JSON or SSE (`http_streams.py`). Every error goes through
`errors.classify`.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import FastAPI, Header, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from services.config import GatewayConfig
from services.dispatcher import Dispatcher
from services.gateway import errors
from services.gateway.auth import check_bearer
from services.gateway.cluster_api import cluster_routes
from services.gateway.frontend import Frontend
from services.gateway.generation import Generation
from services.gateway.http_streams import chat_stream, run_to_end, unless_client_leaves
from services.gateway.json_body import StrictJSONRoute
from services.gateway.logprobs import LogprobShapes
from services.gateway.lora_api import lora_routes
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from services.gateway.responses import ResponseShape
from services.gateway.responses_api import responses_routes
from services.response_store import ResponseStore
from services.sessions import SessionStore

if TYPE_CHECKING:  # the scaler's module imports the workers' actor classes, and with them torch
    from services.autoscaler import Autoscaler
    from services.lora_updates import LoRAUpdates
    from services.scaling import Scaler

_OPEN_PATHS = ("/health",)
_SCRAPE_PATHS = ("/metrics", "/docs", "/openapi.json", "/redoc")  # open too, unless --metrics-require-key


class _Guard:
    """ASGI middleware: the API key check and the body size limit, before any parsing.

    The body is buffered up to the limit and replayed; after it, `receive` goes to the server again so
    the streaming response still hears the client disconnect. It also counts answers per path and status.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics,
                 open_paths: tuple[str, ...]) -> None:
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start" and path != "/metrics":  # scrapes are not API calls
                # The route's template, not the path: session ids must not become label values.
                route = getattr(scope.get("route"), "path", "unrouted")
                self.metrics.inc_request(route, str(message["status"]))
            await send(message)

        if not path.startswith(self.open_paths):
            try:
                check_bearer(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"), self.api_key)
            except errors.UnauthorizedError as exc:
                return await errors.http_response(exc)(scope, receive, counted_send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                return await errors.http_response(errors.BodyTooLargeError(self.max_body_bytes))(
                    scope, receive, counted_send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, counted_send)


def create_app(dispatcher: Dispatcher, sessions: SessionStore | None, response_store: ResponseStore | None,
               config: GatewayConfig, scaler: Scaler | None = None,
               autoscaler: Autoscaler | None = None, lora_updates: LoRAUpdates | None = None) -> FastAPI:
    """The HTTP gateway; serve it with uvicorn (``response_store``: None keeps no Responses API responses;
    ``scaler``: None, the cluster routes cannot resize the cluster; ``autoscaler``: shown in the status)."""
    frontend = Frontend(dispatcher, sessions, config)
    served_since = int(time.time())  # the model cards' "created": when this gateway began serving them
    app = FastAPI(title="Tidepool", description="OpenAI-compatible serving of a disaggregated LLM cluster",
                  version="0.1.0")
    app.router.route_class = StrictJSONRoute  # NaN, Infinity and lone surrogates are malformed JSON
    app.add_middleware(_Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       metrics=dispatcher.metrics,
                       open_paths=_OPEN_PATHS + (() if config.metrics_require_key else _SCRAPE_PATHS))
    if config.allowed_origins:  # outside the guard: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return errors.http_response(exc)

    # Known errors are answered by the router's handlers; anything else reaches Starlette's outermost
    # handler, which answers in the same shape (a 500) and re-raises so the server logs the traceback.
    for cls in (*errors.KNOWN_ERRORS, Exception):
        app.add_exception_handler(cls, on_error)

    def _logprobs(gen: Generation, body: ChatCompletionRequest | CompletionRequest) -> LogprobShapes:
        return LogprobShapes(frontend.token_texts, body.return_tokens_as_token_ids, len(gen.texts))

    async def _answer(gen: Generation, shape: ResponseShape, body: ChatCompletionRequest | CompletionRequest,
                      request: Request) -> Response:
        """SSE chunks, or the whole response once the generation ends."""
        if body.stream:
            return chat_stream(gen, shape, body.include_usage, body.continuous_usage)
        await run_to_end(gen, request)
        return JSONResponse(shape.complete())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               x_session_id: str | None = Header(None)) -> Response:
        # In a thread: a structured output's grammar compiles there (milliseconds for a large schema, the first
        # time), which would stall every stream this event loop serves.
        options = await asyncio.to_thread(body.chat_options, config.tool_call_parser)
        messages = [m.as_dict() for m in body.messages]
        gen = await unless_client_leaves(request, frontend.chat(body.model, messages, options,
                                                                 body.session_id or x_session_id))
        shape = ResponseShape(gen, body.model, chat=True, logprobs=_logprobs(gen, body) if body.logprobs else None,
                              tool_calls=options.tool_call_reader(config.tool_call_parser),
                              reasoning=config.reasoning_parser,
                              prompt_logprobs=None if body.prompt_logprobs is None else _logprobs(gen, body),
                              token_ids=body.return_token_ids)
        return await _answer(gen, shape, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        options = await asyncio.to_thread(body.completion_options)  # as chat's
        gen = await unless_client_leaves(request, frontend.complete(body.model, body.prompts(), options))
        shape = ResponseShape(gen, body.model, chat=False,
                              logprobs=None if body.logprobs is None else _logprobs(gen, body),
                              prompt_logprobs=None if body.prompt_logprobs is None else _logprobs(gen, body),
                              token_ids=body.return_token_ids)
        return await _answer(gen, shape, body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
        results = await unless_client_leaves(request, frontend.embed(body.model, body.inputs(), body.dimensions,
                                                                     body.add_special_tokens))
        tokens = sum(r.num_prompt_tokens for r in results)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": body.model,
                "data": [{"object": "embedding", "index": i, "embedding": _encoded_vector(r.embedding,
                                                                                          body.encoding_format)}
                         for i, r in enumerate(results)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's: the token ids a completion prompt or a chat gets here, and the context they go into."""
        kwargs = body.template_kwargs(config.tool_call_parser)
        if body.model is not None:
            frontend.check_model(body.model)
        if body.messages is not None:
            ids = await frontend.chat_prompt_ids([m.as_dict() for m in body.messages], kwargs,
                                                 body.add_generation_prompt, body.continue_final_message)
        else:
            ids = await frontend.prompt_ids(body.prompt, body.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": dispatcher.max_model_len, "tokens": ids,
                "token_strs": [frontend.token_texts.text(t) for t in ids] if body.return_token_strs else None}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """vLLM's: what a client needs to tokenize as this server does (lm-evaluation-harness's remote
        tokenizer reads it, then calls /tokenize and /detokenize)."""
        tok = dispatcher.tokenizer
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "chat_template": tok.chat_template, "model_max_length": dispatcher.max_model_len,
                "vocab_size": tok.vocab_size}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        body.check_extra("")
        if body.model is not None:
            frontend.check_model(body.model)
        return {"prompt": await frontend.detokenize(body.tokens)}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(dispatcher, name, None, served_since)
                                           for name in dispatcher.served_model_names] + [
            _model_card(dispatcher, lora, frontend.model_id, served_since) for lora in dispatcher.loras]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str) -> dict:
        lora = frontend.check_model(model)
        return _model_card(dispatcher, model, None if lora is None else frontend.model_id, served_since)

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict:
        if sessions is None or not await sessions.delete(session_id):
            raise errors.NotFoundError("session", session_id, None)
        return {"id": session_id, "object": "session", "deleted": True}

    @app.get("/health")
    async def health() -> dict:
        missing = dispatcher.missing_roles()  # e.g. until a dead worker's replacement serves
        if missing:
            raise errors.NoWorkersError(f"degraded: no live {' or '.join(missing)} worker")
        alive = dispatcher.alive_workers()
        if not dispatcher.index.pool.up:  # the pool mirror's last call to Redis failed
            raise errors.RedisDownError()
        return {"status": "ok", "workers": alive}

    @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)  # Prometheus', not the API's
    async def metrics() -> Response:
        return Response(dispatcher.metrics.render(), media_type=dispatcher.metrics.content_type)

    responses, background = responses_routes(frontend, response_store, config)
    app.include_router(responses)
    app.state.background_responses = background  # stopped by the server before the store closes
    app.include_router(cluster_routes(dispatcher, scaler, autoscaler))
    if lora_updates is not None:  # --allow-runtime-lora-updating
        app.include_router(lora_routes(lora_updates))
    return app


def _encoded_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as the request asked: JSON numbers, or OpenAI's base64 of its float32 values (little-endian)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def _model_card(dispatcher: Dispatcher, name: str, parent: str | None, created: int) -> dict:
    """The card of the base model under one of its names, or of a LoRA adapter (its ``parent`` the base model, as
    vLLM lists adapters)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "tidepool",
            "max_model_len": dispatcher.max_model_len, "parent": parent}
