"""Strict JSON request bodies: what RFC 8259 allows, nothing Python's ``json`` adds.

Python's parser accepts ``NaN``, ``Infinity`` and ``-Infinity`` and lets an escaped lone surrogate
(``"\\ud800"``) through into a ``str`` that cannot be encoded (the tokenizer and the JSON answer then fail
with a 500). ``StrictJSONRoute`` makes FastAPI parse bodies with ``loads`` instead, so both are refused as
malformed JSON (a 400 whose message names the problem, see ``errors.py``). Numbers that overflow to
infinity (``1e999``) parse, and the value checks (``SamplingParams.validate``) refuse them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def loads(body: bytes) -> Any:
    """Parse a request body; ``json.JSONDecodeError`` (FastAPI answers it with a 400) when it is not JSON."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"not UTF-8 ({exc.reason})", "", exc.start) from None

    def constant(name: str) -> Any:
        raise json.JSONDecodeError(f"{name} is not a JSON value", text, max(0, text.find(name)))

    value = json.loads(text, parse_constant=constant)
    # A paired escape decodes to one code point; one left over is a lone surrogate. Only bodies that
    # escape a surrogate at all need the walk.
    if _SURROGATE_ESCAPE.search(body) and _has_lone_surrogate(value):
        match = _SURROGATE_ESCAPE.search(body)
        raise json.JSONDecodeError("a string holds a lone UTF-16 surrogate, which is not Unicode text", text,
                                   text.find(match.group().decode()))
    return value


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An ``APIRoute`` whose handlers parse JSON bodies with ``loads``."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict_handler
