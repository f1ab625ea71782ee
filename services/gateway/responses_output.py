"""OpenAI's Responses API output: a generation's answer as a ``response`` object, or as the stream of
``response.*`` events that builds it.

The answer goes through the server's reasoning and tool-call parsers, as a chat answer does, and becomes
output items in order: a ``reasoning`` item (the thinking, as ``reasoning_text``), a ``message`` with one
``output_text`` part, and a ``function_call`` item per call. Streamed, an item is opened
(``response.output_item.added``), filled by deltas and closed (``response.output_item.done``) as the text
arrives; a call goes out whole once its parser completes it, as chat streams calls. Whole, the same events
are built and only the final ``response`` is returned, so both shapes hold the same items.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from services.gateway.generation import Delta, Generation
from services.gateway.reasoning import ReasoningParser
from services.gateway.tagged_text import parsed
from services.gateway.tool_calls import ToolCall, ToolCallParser
from services.messages import SessionSequence


def item_id(prefix: str) -> str:
    """A new output or input item's id, OpenAI's shape (``msg_...``)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesOutput:
    """One response: ``start`` (the opening events), ``feed`` each delta, ``finish``; each returns events, and
    ``response()`` is the response object so far."""

    def __init__(self, gen: Generation, request: dict[str, Any], tool_calls: Callable[[], ToolCallParser] | None,
                 reasoning: str | None) -> None:
        """``request``: the response object's echo of the request (model, tools, text, store, ...); ``tool_calls``:
        makes the answer's tool-call parser (``tool_calls.call_parser``), None without tools; ``reasoning``: the
        server's reasoning parser."""
        self.gen, self.request = gen, request
        self.id = f"resp_{gen.request_id.split('-', 1)[-1]}"
        self.created_at = int(time.time())
        self.tool_parser = tool_calls() if tool_calls else None
        self.reasoning_parser = ReasoningParser(reasoning) if reasoning else None
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item text is going into
        self._sequence = 0
        self.reasoning_tokens = 0  # tokens of the deltas that carried thinking
        self.finish_reason: str | None = None
        self.ended: str | None = None  # "cancelled" or "failed": ended before the answer did (`end`)
        self.error: dict[str, Any] | None = None

    def response(self) -> dict[str, Any]:
        done = self.finish_reason is not None
        incomplete = self.finish_reason == "length"
        usage = self.gen.usage
        status = self.ended or (("incomplete" if incomplete else "completed") if done else "in_progress")
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": self.error,
                **self.request, "output": self.items,
                "usage": {"input_tokens": usage.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                          "output_tokens": usage.completion_tokens,
                          "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                          "total_tokens": usage.total_tokens} if done or self.ended else None}

    def end(self, status: str, error: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """End a response before its answer did: "cancelled", or "failed" with ``error`` ({code, message});
        the events that close its open item."""
        self.ended, self.error = status, error
        return self._close("incomplete")

    def sequence(self) -> SessionSequence | None:
        """The turn as the model saw and wrote it (its prompt's ids, then its answer's), which a response
        continuing this one starts from; None when the prompt is not known."""
        if self.gen.prompts is None:
            return None
        prompt = self.gen.prompt_of(0)
        return SessionSequence(len(prompt), [*prompt, *self.gen.token_ids[0]])

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, d: Delta) -> list[dict[str, Any]]:
        final = d.finish_reason is not None
        reasoning, text, calls = "", d.text, []
        if self.reasoning_parser is not None:
            reasoning, text = parsed(self.reasoning_parser, text, final)
        if self.tool_parser is not None:
            text, calls = parsed(self.tool_parser, text, final)
        events = []
        if reasoning:
            self.reasoning_tokens += len(d.token_ids)
            events += self._append("reasoning", reasoning)
        if text:
            events += self._append("message", text)
        for call in calls:
            events += self._close("completed") + self._call(call)
        if final:
            self.finish_reason = d.finish_reason
            events += self._close("incomplete" if d.finish_reason == "length" else "completed")
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The last event: response.completed, .incomplete or .failed (none for a cancelled response: its stream
        just ends)."""
        status = self.response()["status"]
        if status == "cancelled":
            return []
        return [self._event(f"response.{status}", response=self.response())]

    # -- items -----------------------------------------------------------------------------------------------
    def _append(self, kind: str, text: str) -> list[dict[str, Any]]:
        """``text`` into the open item of ``kind`` (opening one, and closing another, first)."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            item = ({"type": "reasoning", "id": item_id("rs"), "summary": [], "content": []} if kind == "reasoning"
                    else {"type": "message", "id": item_id("msg"), "status": "in_progress", "role": "assistant",
                          "content": []})
            events.append(self._event("response.output_item.added", output_index=len(self.items), item=_copy(item)))
            self.items.append(item)
            self._open = item
            part = _part(kind, "")
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.items) - 1, content_index=0, part=dict(part)))
        item = self._open
        item["content"][0]["text"] += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(delta, item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                                  delta=text, **extra))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, part = self.items.index(item), item["content"][0]
        kind = item["type"]
        item["status"] = status
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [self._event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        item = {"type": "function_call", "id": item_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        index = len(self.items)
        events = [self._event("response.output_item.added", output_index=index, item=dict(item))]
        item.update(arguments=call.arguments, status="completed")
        self.items.append(item)
        return events + [
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=call.arguments),
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=call.name, arguments=call.arguments),
            self._event("response.output_item.done", output_index=index, item=dict(item))]

    def next_sequence(self) -> int:
        """The next event's sequence number (taken)."""
        self._sequence += 1
        return self._sequence - 1

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": self.next_sequence(), **fields}


def _part(kind: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text} if kind == "reasoning" else \
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands now (events hold snapshots; the item goes on growing)."""
    return {**item, "content": [dict(part) for part in item.get("content", [])]}
