"""The one place that turns exceptions into API statuses: HTTP (OpenAI error shape) and gRPC codes agree.

Everything below the gateway raises plain exceptions that name the cause; `classify` decides what the
client sees. Unknown exceptions become a 500 / INTERNAL without their message (it may leak internals).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pydantic
import redis.exceptions
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import InvalidRequestError, LoRAAdapterError, OutOfBlocksError
from kvstore.transfer import TransferError, TransferTimeout
from services.errors import (
    NoWorkersError,
    PlacementError,
    PrefillTimeoutError,
    PromptTooLongError,
    RequestRejected,
    ScalingConflictError,
    UnknownAdapterError,
    UnknownWorkerError,
    WorkerFailedError,
)
from services.messages import EngineStepError
from services.sessions import InvalidSessionIdError, SessionBusyError

log = logging.getLogger(__name__)


class UnauthorizedError(Exception):
    """The API key is missing or wrong."""


class NotFoundError(Exception):
    """An unknown model or session; ``param`` names the request field that held it."""

    def __init__(self, kind: str, name: str, param: str | None) -> None:
        super().__init__(f"the {kind} {name!r} does not exist")
        self.kind = kind
        self.param = param


class BodyTooLargeError(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is over the limit of {limit} bytes")


class MalformedBodyError(Exception):
    """The request body is not a valid JSON document or protobuf message."""


class UnsupportedFieldError(Exception):
    """A request field (or value of it) this server does not implement; ``param`` is the top-level field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ClientLeftError(Exception):
    """The client disconnected before its request started streaming (the answer is never delivered)."""


class RedisDownError(Exception):
    """Redis does not answer: sessions and the KV pool wait for it (``/health`` reports degraded)."""

    def __init__(self) -> None:
        super().__init__("degraded: Redis is unreachable, so sessions and the KV pool are unavailable "
                         "(chats without a session are still served)")


class PromptTextTooLongError(Exception):
    """A prompt's text is too long to fit the token limit, whatever the tokenizer makes of it."""

    def __init__(self, chars: int, max_chars: int, limit_tokens: int) -> None:
        super().__init__(f"prompt has {chars} characters; at most {max_chars} can fit in {limit_tokens} tokens")


@dataclass(frozen=True)
class ApiError:
    """What the client is told: the same decision for HTTP and gRPC."""

    http_status: int
    grpc_code: grpc.StatusCode
    type: str
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def retry_after_header(self) -> str | None:
        # Retry-After takes whole seconds; round up so a client never retries too early.
        return None if self.retry_after_s is None else str(max(1, math.ceil(self.retry_after_s)))


def _validation_error(errors: list[dict]) -> ApiError:
    # `param` is the top-level field; the message carries the full location (union members included).
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # its loc is the character position, not a field
        pos = first.get("loc", ("body", 0))[-1]
        return ApiError(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error",
                        f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')} "
                        f"(at character {pos})")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    message = first.get("msg", "invalid request")
    return ApiError(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error",
                    f"{'.'.join(loc)}: {message}" if loc else message, param=param, code="invalid_value")


def _http_error(exc: StarletteHTTPException) -> ApiError:
    # Routing errors (unknown path, wrong method) still answer in the OpenAI shape.
    return ApiError(exc.status_code, grpc.StatusCode.UNKNOWN, "invalid_request_error", str(exc.detail))


_BAD = grpc.StatusCode.INVALID_ARGUMENT
_FULL = grpc.StatusCode.RESOURCE_EXHAUSTED
_DOWN = grpc.StatusCode.UNAVAILABLE
# First match wins (isinstance), so subclasses come before their bases.
_RULES: list[tuple[type[BaseException], Callable[[Any], ApiError]]] = [
    (RequestValidationError, lambda e: _validation_error(list(e.errors()))),
    (pydantic.ValidationError, lambda e: _validation_error(list(e.errors()))),
    (InvalidRequestError, lambda e: ApiError(400, _BAD, "invalid_request_error", str(e),
                                             param=e.field, code="invalid_value")),
    (InvalidSessionIdError, lambda e: ApiError(400, _BAD, "invalid_request_error", str(e), param="session_id",
                                               code="invalid_value")),
    (UnauthorizedError, lambda e: ApiError(401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error",
                                           str(e), code="invalid_api_key")),
    (NotFoundError, lambda e: ApiError(404, grpc.StatusCode.NOT_FOUND, "invalid_request_error", str(e),
                                       param=e.param, code=f"{e.kind}_not_found")),
    (BodyTooLargeError, lambda e: ApiError(413, _FULL, "invalid_request_error", str(e),
                                           code="request_too_large")),
    (UnsupportedFieldError, lambda e: ApiError(400, _BAD, "invalid_request_error", str(e), param=e.param,
                                               code="unsupported_parameter")),
    (MalformedBodyError, lambda e: ApiError(400, _BAD, "invalid_request_error", str(e))),
    (PromptTextTooLongError, lambda e: ApiError(413, _BAD, "invalid_request_error", str(e),
                                                code="context_length_exceeded")),
    (PromptTooLongError, lambda e: ApiError(413, _BAD, "invalid_request_error", str(e),
                                            code="context_length_exceeded")),
    (RequestRejected, lambda e: ApiError(429, _FULL, "rate_limit_error", f"server overloaded: {e.reason}",
                                         code="overloaded", retry_after_s=e.retry_after_s)),
    (OutOfBlocksError, lambda e: ApiError(429, _FULL, "rate_limit_error", f"no KV memory for the request: {e}",
                                          code="overloaded", retry_after_s=1.0)),
    # A role without a live worker: its replacement is usually seconds away.
    (NoWorkersError, lambda e: ApiError(503, _DOWN, "service_unavailable", str(e) or "no worker is alive",
                                        code="no_workers", retry_after_s=2.0)),
    # Its own message names the engine's internals: the client is told what happened, not how.
    (EngineStepError, lambda e: ApiError(500, grpc.StatusCode.INTERNAL, "internal_error",
                                         "the worker's engine failed while running this request; the worker "
                                         "is being replaced", code="engine_step_failed")),
    # The prefill workers are behind: the client may retry once the queues drain.
    (PrefillTimeoutError, lambda e: ApiError(504, grpc.StatusCode.DEADLINE_EXCEEDED, "service_unavailable", str(e),
                                             code="prefill_timeout", retry_after_s=1.0)),
    (WorkerFailedError, lambda e: ApiError(503, _DOWN, "service_unavailable", f"worker failed: {e}",
                                           code="worker_failed")),
    (LoRAAdapterError, lambda e: ApiError(400, _BAD, "invalid_request_error", str(e),
                                          code="invalid_lora_adapter")),
    (UnknownAdapterError, lambda e: ApiError(404, grpc.StatusCode.NOT_FOUND, "invalid_request_error", str(e),
                                             param="lora_name", code="lora_adapter_not_found")),
    (UnknownWorkerError, lambda e: ApiError(404, grpc.StatusCode.NOT_FOUND, "invalid_request_error", str(e),
                                            code="worker_not_found")),
    (ScalingConflictError, lambda e: ApiError(409, grpc.StatusCode.FAILED_PRECONDITION, "invalid_request_error",
                                              str(e), code="conflict")),
    # Ray could not place a worker being added within the placement timeout: the cluster lacks room.
    (PlacementError, lambda e: ApiError(503, _DOWN, "service_unavailable", str(e), code="placement_failed")),
    (SessionBusyError, lambda e: ApiError(409, grpc.StatusCode.ABORTED, "invalid_request_error", str(e),
                                          param="session_id", code="session_busy")),
    # The handoff's own messages name internal addresses: the client gets the kind of failure only.
    (TransferTimeout, lambda e: ApiError(504, grpc.StatusCode.DEADLINE_EXCEEDED, "service_unavailable",
                                         "the KV cache handoff between workers timed out",
                                         code="kv_transfer_timeout", retry_after_s=1.0)),
    (TransferError, lambda e: ApiError(503, _DOWN, "service_unavailable",
                                       "the KV cache handoff between workers failed", code="kv_transfer_failed",
                                       retry_after_s=1.0)),
    # nginx's "client closed request": logged and counted only
    (ClientLeftError, lambda e: ApiError(499, grpc.StatusCode.CANCELLED, "invalid_request_error",
                                         "the client closed the request", code="client_closed_request")),
    (RedisDownError, lambda e: ApiError(503, _DOWN, "service_unavailable", str(e), code="redis_unavailable",
                                        retry_after_s=2.0)),
    (redis.exceptions.ConnectionError, lambda e: ApiError(503, _DOWN, "service_unavailable",
                                                          "session or response store unavailable", code="sessions_unavailable",
                                                          retry_after_s=2.0)),
    (redis.exceptions.TimeoutError, lambda e: ApiError(503, _DOWN, "service_unavailable",
                                                       "session or response store unavailable", code="sessions_unavailable",
                                                       retry_after_s=2.0)),
    (StarletteHTTPException, _http_error),
]
KNOWN_ERRORS: tuple[type[BaseException], ...] = tuple(cls for cls, _ in _RULES)


def classify(exc: BaseException) -> ApiError:
    """Map an exception to the status the client gets."""
    for cls, build in _RULES:
        if isinstance(exc, cls):
            return build(exc)
    log.error("unhandled error in the gateway", exc_info=exc)
    return ApiError(500, grpc.StatusCode.INTERNAL, "internal_error", "internal server error")


def http_response(exc: BaseException) -> JSONResponse:
    err = classify(exc)
    header = err.retry_after_header()
    return JSONResponse(err.body(), status_code=err.http_status,
                        headers={"Retry-After": header} if header else None)


async def grpc_abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the mapped status, by raising (retry-after travels as trailing metadata)."""
    err = classify(exc)
    header = err.retry_after_header()
    await context.abort(err.grpc_code, err.message, trailing_metadata=(("retry-after", header),) if header else ())
