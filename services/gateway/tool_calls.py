"""Tool calls in a chat answer's text, in the formats of vLLM's ``--tool-call-parser hermes | llama3_json |
mistral``.

Qwen2.5, Qwen3 and the Hermes models write each call as ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` after any plain text (``HermesParser``); Llama 3.1 and later write the whole answer as the
call, ``{"name": ..., "parameters": {...}}``, several joined by ``;`` (``Llama3JsonParser``); Mistral's
instruct models write ``[TOOL_CALLS]`` after any text, then a JSON list of ``{"name": ..., "arguments": {...}}``
(v0.3, Nemo, Small) or, from their v11 tokenizers on, ``name[ARGS]{...}`` per call, each call after its own
``[TOOL_CALLS]`` (``MistralParser``; their calls' ids nine letters and digits, the only ids their chat
templates take back). Mistral's and Llama's tokens are special: a request with tools on a ``mistral`` server
keeps special tokens' text (``skip_special_tokens`` off, as vLLM turns it), and where they are dropped an
answer that is nothing but a JSON list of calls (Llama: call objects) still reads as calls. The chat
templates render the request's ``tools`` and earlier calls and results that way. A parser splits a growing
answer into content and complete calls as it streams; what is not a JSON object with a string ``name`` stays
content, as vLLM leaves it, and so is a call to a ``strict`` function whose arguments do not validate against
its schema (a call the model may write freely is checked, not constrained). A forced call (``tool_choice: "required"`` or a named function) is kept to a schema
while it is sampled (``structured_outputs.py``) and read whole by ``ForcedCallsParser``.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema

from services.gateway.tagged_text import split_at

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama's: a special token, dropped from the text unless special tokens are kept
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"  # Mistral's, likewise
_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def as_dict(self, index: int | None = None) -> dict:
        """OpenAI's shape: a message's tool call, or with ``index`` a stream delta's."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(block: str, strict: Mapping[str, Any], new_id: Callable[[], str]) -> ToolCall | None:
    try:
        return _call_of(json.loads(block), strict, new_id)
    except json.JSONDecodeError:
        return None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other id on a call sent back to them."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def _call_of(value: object, strict: Mapping[str, Any], new_id: Callable[[], str]) -> ToolCall | None:
    """The call ``value`` writes; None when it is not one, or its function is strict (``strict``: name ->
    parameters schema) and the arguments do not validate."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if value["name"] in strict and not _valid(arguments, strict[value["name"]]):
        return None
    return ToolCall(new_id(), value["name"],
                    arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _valid(arguments: Any, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


class HermesParser:
    """One choice's answer: ``feed`` each new piece of text, ``finish`` at its end; both return (content
    released, calls completed). Content is released as it comes except a tail that could still begin
    ``<tool_call>``, and a call once its closing tag (or the end of the answer) arrives."""

    ends_with_calls = True  # an answer with calls finishes as "tool_calls"
    new_id = staticmethod(_call_id)  # a call's id

    def __init__(self, strict: Mapping[str, Any] | None = None) -> None:
        """``strict``: the strict functions' parameter schemas, by name."""
        self._strict = strict or {}
        self._pending = ""  # text not released yet: a possible start of a tag, or an open call's body
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return content, calls
                block, self._pending, self._in_call = self._pending[:end], self._pending[end + len(CLOSE):], False
                content += self._take(block, calls, closed=True)
                continue
            released, self._pending, self._in_call = split_at(self._pending, OPEN)
            content += released
            if not self._in_call:
                return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: an unclosed call that parses is a call (the answer ended inside it), else content."""
        calls: list[ToolCall] = []
        content = self._take(self._pending, calls, closed=False) if self._in_call else self._pending
        self._pending, self._in_call = "", False
        return content, calls

    def _take(self, block: str, calls: list[ToolCall], closed: bool) -> str:
        """A call from ``block`` (added to ``calls``), or the block, tags and all, as content when it is not one."""
        call = _call(block.strip(), self._strict, self.new_id)
        if call is None:
            return f"{OPEN}{block}{CLOSE if closed else ''}"
        calls.append(call)
        self.calls.append(call)
        return ""


class Llama3JsonParser:
    """One choice's answer, as ``HermesParser``'s. An answer that starts with ``{`` is held until it ends, then
    read as calls, or released as content when it is not one; any other answer is released as it comes."""

    ends_with_calls = True
    new_id = staticmethod(_call_id)

    def __init__(self, strict: Mapping[str, Any] | None = None) -> None:
        self._strict = strict or {}
        self._pending = ""
        self._holding: bool | None = None  # None: undecided until the first character that is not a space
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        if self._holding is None:
            start = self._pending.lstrip().removeprefix(PYTHON_TAG).lstrip()
            if not start or PYTHON_TAG.startswith(start):
                return "", []
            self._holding = start.startswith("{")
        if self._holding:
            return "", []
        content, self._pending = self._pending, ""
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._pending = self._pending, ""
        text = rest.strip().removeprefix(PYTHON_TAG).lstrip()
        calls = _json_calls(text, self._strict, self.new_id) if self._holding else None
        if not calls:
            return rest, []
        self.calls += calls
        return "", calls


def _json_list_calls(text: str, strict: Mapping[str, Any], new_id: Callable[[], str]) -> list[ToolCall] | None:
    """The calls of ``text`` when it is a non-empty JSON list of call objects; else None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [_call_of(item, strict, new_id) for item in value] if isinstance(value, list) else []
    return calls if calls and None not in calls else None


def _json_calls(text: str, strict: Mapping[str, Any], new_id: Callable[[], str]) -> list[ToolCall] | None:
    """The calls of ``text`` when it is nothing but JSON call objects joined by ``;``; else None."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        if (call := _call_of(value, strict, new_id)) is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        at = len(text) - len(rest.removeprefix(";").lstrip())
    return calls


class MistralParser:
    """One choice's answer, as ``HermesParser``'s: text is released as it comes except a tail that could
    still begin ``[TOOL_CALLS]``; after the tag the rest of the answer is held and read as calls at its end
    (released, tag and all, when it is not calls). An answer that opens with ``[`` (the tag dropped with the
    special tokens) is held whole and read as a JSON list of calls."""

    ends_with_calls = True
    new_id = staticmethod(mistral_call_id)

    def __init__(self, strict: Mapping[str, Any] | None = None) -> None:
        self._strict = strict or {}
        self._pending = ""
        self._mode: str | None = None  # None: undecided; "text", "calls" (after the tag), "list" (opens with "[")
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        if self._mode is None:
            start = self._pending.lstrip()
            if not start or TOOL_CALLS.startswith(start):
                return "", []
            self._mode = "list" if start[0] == "[" and not start.startswith(TOOL_CALLS) else "text"
        if self._mode != "text":
            return "", []
        content, self._pending, found = split_at(self._pending, TOOL_CALLS)
        if found:
            self._mode = "calls"
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._pending = self._pending, ""
        calls = None
        if self._mode == "calls":
            calls = _mistral_calls(rest, self._strict)
            rest = TOOL_CALLS + rest
        elif self._mode == "list":
            calls = _json_list_calls(rest.strip(), self._strict, self.new_id)
        if not calls:
            return rest, []
        self.calls += calls
        return "", calls


def _mistral_calls(text: str, strict: Mapping[str, Any]) -> list[ToolCall] | None:
    """The calls after a ``[TOOL_CALLS]``: a JSON list of call objects, or ``name[ARGS]{...}`` ones each after
    its own tag (v11 tokenizers on); None when ``text`` is not that."""
    if ARGS not in text:
        return _json_list_calls(text.strip(), strict, mistral_call_id)
    calls = []
    for part in text.split(TOOL_CALLS):
        name, found, written = part.partition(ARGS)
        try:
            arguments = json.loads(written) if found and name.strip() else None
        except json.JSONDecodeError:
            return None
        call = _call_of({"name": name.strip(), "arguments": arguments}, strict, mistral_call_id) \
            if isinstance(arguments, dict) else None
        if call is None:
            return None
        calls.append(call)
    return calls


class ForcedCallsParser:
    """A forced answer, held whole and read at its end. With ``name`` (a named function) the answer is that
    function's arguments, and stays its call even when max_tokens cut it (finish_reason says so), as vLLM
    returns it; the answer finishes as "stop", as OpenAI's does. Without (``tool_choice: "required"``) the
    answer is a JSON list of ``{"name", "parameters"}`` calls and finishes as "tool_calls"; one that is not
    (cut short) is content."""

    def __init__(self, name: str | None = None, new_id: Callable[[], str] = _call_id) -> None:
        """``new_id``: the calls' ids, as the server's parser gives them (Mistral's nine characters)."""
        self._name = name
        self._new_id = new_id
        self._pending = ""
        self.ends_with_calls = name is None
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._pending = self._pending, ""
        if self._name is not None:
            calls = [ToolCall(self._new_id(), self._name, rest.strip())]
        else:
            calls = _json_list_calls(rest, {}, self._new_id)
            if calls is None:
                return rest, []
        self.calls += calls
        return "", calls


class FirstCallParser:
    """Another parser's reading of an answer, with only its first call (``parallel_tool_calls: false``); the
    later calls' text is dropped with them."""

    ends_with_calls = True

    def __init__(self, parser: HermesParser | Llama3JsonParser | MistralParser) -> None:
        self._parser = parser
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._first(*self._parser.feed(text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._first(*self._parser.finish())

    def _first(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        calls = [] if self.calls else calls[:1]
        self.calls += calls
        return content, calls


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,  # --tool-call-parser choices
           "mistral": MistralParser}
ToolCallParser = HermesParser | Llama3JsonParser | MistralParser | ForcedCallsParser | FirstCallParser


def call_parser(kind: str, tools: list[dict], tool_choice: str = "auto", name: str | None = None,
                parallel: bool = True) -> Callable[[], ToolCallParser]:
    """How a choice's answer is read: by the server's ``kind`` parser when the model may call any of ``tools``
    (``tool_choice`` "auto"; strict functions' calls are checked against their schemas), else as the forced
    call(s) (``name``: the function a "named" choice forces), which their schemas constrained. Not
    ``parallel``: calls after an answer's first are dropped (a forced list already holds one)."""
    if tool_choice != "auto":
        return lambda: ForcedCallsParser(name, PARSERS[kind].new_id)  # name None: "required"
    strict = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools
              if t["function"].get("strict")}
    if parallel:
        return lambda: PARSERS[kind](strict)
    return lambda: FirstCallParser(PARSERS[kind](strict))
