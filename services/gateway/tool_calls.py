"""Tool calls in a chat answer's text, in the Hermes format (vLLM's ``--tool-call-parser hermes``).

Qwen2.5, Qwen3 and the Hermes models write each call as ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` after any plain text; their chat templates render the request's ``tools`` and earlier calls
and results that way. ``ToolCallParser`` splits a growing answer into content and complete calls as it
streams: content is released as it comes except a tail that could still begin ``<tool_call>``, and a call
once its closing tag (or the end of the answer) arrives. A block that is not a JSON object with a string
``name`` stays content, as vLLM leaves it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from services.gateway.tagged_text import parsed, split_at

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)  # --tool-call-parser choices


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
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"],
                    arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """One choice's answer: ``feed`` each new piece of text, ``finish`` at its end; both return (content
    released, calls completed)."""

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


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer's (content, calls)."""
    return parsed(ToolCallParser(), text, final=True)
