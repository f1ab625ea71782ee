"""OpenAI's response objects for a running `Generation`: `chat.completion(.chunk)` for chat, `text_completion`
for completions, whole or as stream chunks; with a reasoning parser, a chat answer's thinking is split off
(`reasoning.py`), and with tool calling on, its calls are read out of the rest (`tool_calls.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from services.gateway.generation import Delta, Generation, Usage
from services.gateway.logprobs import LogprobShapes
from services.gateway.reasoning import ReasoningParser, parse_reasoning
from services.gateway.tagged_text import parsed
from services.gateway.tool_calls import ToolCallParser


def _usage(usage: Usage) -> dict:
    """OpenAI's usage object."""
    shaped = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
              "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if usage.accepted_prediction_tokens is not None:
        shaped["completion_tokens_details"] = {"accepted_prediction_tokens": usage.accepted_prediction_tokens,
                                               "rejected_prediction_tokens": usage.rejected_prediction_tokens}
    return shaped


class ResponseShape:
    """One request's response objects, whole (``complete``) or as stream chunks (``opening``, ``delta``,
    ``chunk``)."""

    def __init__(self, gen: Generation, model: str, chat: bool, logprobs: LogprobShapes | None,
                 tool_calls: Callable[[], ToolCallParser] | None = None, reasoning: str | None = None,
                 prompt_logprobs: LogprobShapes | None = None, token_ids: bool = False) -> None:
        """``logprobs``: how to shape them, when the request asked for them; ``tool_calls``: makes the parser
        each answer is read for tool calls with (``tool_calls.call_parser``); ``reasoning``: the server's
        reasoning parser, which splits the thinking off first (``reasoning.py``); ``prompt_logprobs``: how to
        shape vLLM's ``prompt_logprobs`` (a chat response's, each completion choice's), when asked for;
        ``token_ids``: vLLM's return_token_ids, each choice's output token ids (a stream chunk's: its delta's)
        and the prompt's (a chat response's, in a stream its first chunk's; each completion choice's, in a
        stream that choice's first chunk's)."""
        self.gen, self.chat, self.logprobs, self.reasoning, self.tool_calls = gen, chat, logprobs, reasoning, tool_calls
        self.prompt_logprobs, self.with_token_ids = prompt_logprobs, token_ids
        self._prompts_sent: set[int] = set()  # streamed: the choices (chat: the response, -1) given their prompt
        self.base = {"id": gen.request_id, "created": int(time.time()), "model": model}
        n = len(gen.texts)  # each streamed choice's parsers
        self.tool_parsers = [tool_calls() for _ in range(n)] if tool_calls else None
        self.reasoning_parsers = [ReasoningParser(reasoning) for _ in range(n)] if reasoning else None

    def _choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: list, token_ids: list[int],
                *, streaming: bool, fields: dict | None = None) -> dict:
        """``fields``: a chat message's (or delta's) further fields (reasoning_content, tool_calls)."""
        if not self.chat:
            body = {"text": text}
        elif streaming:
            body = {"delta": {**({"content": text} if text else {}), **(fields or {})}}
        else:
            body = {"message": {"role": "assistant", "content": text, **(fields or {})}}
        if self.logprobs is None:
            shaped = None
        else:
            shaped = self.logprobs.chat(logprobs) if self.chat else self.logprobs.completion(index, logprobs)
        choice = {"index": index, **body, "logprobs": shaped, "finish_reason": finish_reason}
        if self.with_token_ids:
            if not self.chat and self._prompt_due(index, streaming):
                choice["prompt_token_ids"] = self.gen.prompt_of(index)
            choice["token_ids"] = token_ids
        return choice

    def _prompt_due(self, key: int, streaming: bool) -> bool:
        """Whether the prompt's token ids go out now under ``key`` (a choice, or -1 for a chat's response):
        always in a whole response, in a stream the first time."""
        if not streaming:
            return True
        due = key not in self._prompts_sent
        self._prompts_sent.add(key)
        return due

    def opening(self) -> list[dict]:
        """Chat streams announce the assistant role first, one chunk choice per index."""
        if not self.chat:
            return []
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(len(self.gen.texts))]

    def chunk(self, choices: list[dict], usage: Usage | None = None, *, with_usage: bool) -> dict:
        out = {**self.base, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "choices": choices}
        if self.with_token_ids and self.chat and self._prompt_due(-1, streaming=True):
            out["prompt_token_ids"] = self.gen.prompt_of(0)
        # With include_usage, every chunk has "usage": null (the usage so far with continuous_usage_stats) except
        # the last, which has no choices.
        return {**out, "usage": _usage(usage) if usage else None} if with_usage else out

    def delta(self, d: Delta) -> dict | None:
        """The stream chunk's choice for ``d``; None when there is nothing to send (text a parser holds back)."""
        text, fields, finish_reason = d.text, {}, d.finish_reason
        final = finish_reason is not None
        if self.reasoning_parsers is not None:
            reasoning, text = parsed(self.reasoning_parsers[d.index], text, final)
            if reasoning:
                fields["reasoning_content"] = reasoning
        if self.tool_parsers is not None:
            parser = self.tool_parsers[d.index]
            text, calls = parsed(parser, text, final)
            first = len(parser.calls) - len(calls)  # the new calls' places among the choice's
            if calls:
                fields["tool_calls"] = [call.as_dict(index=first + k) for k, call in enumerate(calls)]
            if final and parser.calls and parser.ends_with_calls:
                finish_reason = "tool_calls"
        # (with return_token_ids, tokens whose text is held back still go out: the client counts on every id)
        if not (text or fields or finish_reason or d.logprobs or (self.with_token_ids and d.token_ids)):
            return None
        return self._choice(d.index, text, finish_reason, d.logprobs or [], d.token_ids, streaming=True,
                            fields=fields)

    def complete(self) -> dict:
        choices = []
        for i, text in enumerate(self.gen.texts):
            finish_reason, fields = self.gen.finish_reasons[i], {}
            if self.reasoning is not None:
                reasoning, text = parse_reasoning(self.reasoning, text)
                fields["reasoning_content"] = reasoning or None
            if self.tool_calls is not None and (calls := parsed(parser := self.tool_calls(), text, final=True))[1]:
                text = calls[0] if calls[0].strip() else None
                fields["tool_calls"] = [call.as_dict() for call in calls[1]]
                finish_reason = "tool_calls" if parser.ends_with_calls else finish_reason
            choices.append(self._choice(i, text, finish_reason, self.gen.logprobs[i], self.gen.token_ids[i],
                                        streaming=False, fields=fields))
            if self.prompt_logprobs is not None and not self.chat:
                choices[-1]["prompt_logprobs"] = self.prompt_logprobs.prompt(self.gen.prompt_logprobs_of(i))
        response = {**self.base, "object": "chat.completion" if self.chat else "text_completion",
                    "choices": choices, "usage": _usage(self.gen.usage)}
        if self.prompt_logprobs is not None and self.chat:
            response["prompt_logprobs"] = self.prompt_logprobs.prompt(self.gen.prompt_logprobs_of(0))
        if self.with_token_ids and self.chat:
            response["prompt_token_ids"] = self.gen.prompt_of(0)
        return response
