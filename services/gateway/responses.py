"""OpenAI's response objects for a running `Generation`: `chat.completion(.chunk)` for chat, `text_completion`
for completions, whole or as stream chunks; with tool calling on, a chat answer's calls are read out of its text
(`tool_calls.py`)."""

from __future__ import annotations

import time

from services.gateway.generation import Delta, Generation, Usage
from services.gateway.logprobs import LogprobShapes
from services.gateway.tool_calls import ToolCallParser, parse_tool_calls


def _usage(usage: Usage) -> dict:
    """OpenAI's usage object."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class ResponseShape:
    """One request's response objects, whole (``complete``) or as stream chunks (``opening``, ``delta``,
    ``chunk``)."""

    def __init__(self, gen: Generation, model: str, chat: bool, logprobs: LogprobShapes | None,
                 tool_calls: bool = False) -> None:
        """``logprobs``: how to shape them, when the request asked for them; ``tool_calls``: the answers are
        read for tool calls (``tool_calls.py``)."""
        self.gen, self.chat, self.logprobs = gen, chat, logprobs
        self.base = {"id": gen.request_id, "created": int(time.time()), "model": model}
        self.parsers = [ToolCallParser() for _ in gen.texts] if tool_calls else None  # each streamed choice's

    def _choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: list, *,
                streaming: bool, tool_calls: list[dict] | None = None) -> dict:
        if not self.chat:
            body = {"text": text}
        elif streaming:
            delta = {"content": text} if text else {}
            body = {"delta": {**delta, "tool_calls": tool_calls} if tool_calls else delta}
        else:
            message = {"role": "assistant", "content": text}
            body = {"message": {**message, "tool_calls": tool_calls} if tool_calls else message}
        if self.logprobs is None:
            shaped = None
        else:
            shaped = self.logprobs.chat(logprobs) if self.chat else self.logprobs.completion(index, logprobs)
        return {"index": index, **body, "logprobs": shaped, "finish_reason": finish_reason}

    def opening(self) -> list[dict]:
        """Chat streams announce the assistant role first, one chunk choice per index."""
        if not self.chat:
            return []
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(len(self.gen.texts))]

    def chunk(self, choices: list[dict], usage: Usage | None = None, *, with_usage: bool) -> dict:
        out = {**self.base, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "choices": choices}
        # With include_usage, every chunk has "usage": null (the usage so far with continuous_usage_stats) except
        # the last, which has no choices.
        return {**out, "usage": _usage(usage) if usage else None} if with_usage else out

    def delta(self, d: Delta) -> dict | None:
        """The stream chunk's choice for ``d``; None when there is nothing to send (text the tool call parser
        holds back)."""
        text, calls, finish_reason = d.text, None, d.finish_reason
        if self.parsers is not None:
            parser = self.parsers[d.index]
            done = len(parser.calls)
            text = parser.feed(text)[0] + (parser.finish()[0] if finish_reason else "")
            calls = [call.as_dict(index=k) for k, call in enumerate(parser.calls) if k >= done]
            if finish_reason and parser.calls:
                finish_reason = "tool_calls"
        if not (text or calls or finish_reason or d.logprobs):
            return None
        return self._choice(d.index, text, finish_reason, d.logprobs or [], streaming=True, tool_calls=calls)

    def complete(self) -> dict:
        choices = []
        for i, text in enumerate(self.gen.texts):
            finish_reason, calls = self.gen.finish_reasons[i], None
            if self.parsers is not None and (parsed := parse_tool_calls(text))[1]:
                text = parsed[0] if parsed[0].strip() else None
                finish_reason, calls = "tool_calls", [call.as_dict() for call in parsed[1]]
            choices.append(self._choice(i, text, finish_reason, self.gen.logprobs[i], streaming=False,
                                        tool_calls=calls))
        return {**self.base, "object": "chat.completion" if self.chat else "text_completion",
                "choices": choices, "usage": _usage(self.gen.usage)}
