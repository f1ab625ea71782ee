"""Tool calls in a chat answer's text, in the formats of vLLM's ``--tool-call-parser hermes | llama3_json``.

Qwen2.5, Qwen3 and the Hermes models write each call as ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` after any plain text (``HermesParser``); Llama 3.1 and later write the whole answer as the
call, ``{"name": ..., "parameters": {...}}``, several joined by ``;`` (``Llama3JsonParser``). Their chat
templates render the request's ``tools`` and earlier calls and results that way. A parser splits a growing
answer into content and complete calls as it streams; what is not a JSON object with a string ``name`` stays
content, as vLLM leaves it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from services.gateway.tagged_text import parsed, split_at

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama's: a special token, dropped from the text unless special tokens are kept


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def as_dict(self, index: int | None = None) -> dict:
        """OpenAI's shape: a message's tool call, or with ``index`` a stream delta's."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(block: str) -> ToolCall | None:
    try:
        return _call_of(json.loads(block))
    except json.JSONDecodeError:
        return None


def _call_of(value: object) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"],
                    arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    """One choice's answer: ``feed`` each new piece of text, ``finish`` at its end; both return (content
    released, calls completed). Content is released as it comes except a tail that could still begin
    ``<tool_call>``, and a call once its closing tag (or the end of the answer) arrives."""

    def __init__(self) -> None:
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
        call = _call(block.strip())
        if call is None:
            return f"{OPEN}{block}{CLOSE if closed else ''}"
        calls.append(call)
        self.calls.append(call)
        return ""


class Llama3JsonParser:
    """One choice's answer, as ``HermesParser``'s. An answer that starts with ``{`` is held until it ends, then
    read as calls, or released as content when it is not one; any other answer is released as it comes."""

    def __init__(self) -> None:
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
        calls = _json_calls(rest.strip().removeprefix(PYTHON_TAG)) if self._holding else None
        if not calls:
            return rest, []
        self.calls += calls
        return "", calls


def _json_calls(text: str) -> list[ToolCall] | None:
    """The calls of ``text`` when it is nothing but JSON call objects joined by ``;``; else None."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        if (call := _call_of(value)) is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        at = len(text) - len(rest.removeprefix(";").lstrip())
    return calls


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}  # --tool-call-parser choices


def parse_tool_calls(kind: str, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer's (content, calls), read by the ``kind`` parser."""
    return parsed(PARSERS[kind](), text, final=True)
