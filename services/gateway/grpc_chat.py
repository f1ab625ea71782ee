"""gRPC chat: a ``ChatRequest``'s messages, tools, tool choice and prediction become the chat completions request
they stand for (``protocol.ChatCompletionRequest``), so its checks, chat template variables and forced-call
schema are HTTP's; its answer is read as HTTP's is (``responses.ResponseShape``: the reasoning parser, then
the tool-call parser), and each stream delta fills a ``GenerateChunk``'s text, reasoning and tool calls."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from engine.errors import InvalidRequestError
from services.gateway.frontend import Options
from services.gateway.protocol import ChatCompletionRequest
from tidepool.v1 import serving_pb2

# What a chat's own fields decide in its `Options` (the rest comes from the call's SamplingOptions).
_CHAT_FIELDS = ("chat_template_kwargs", "tools", "tool_choice", "tool_name", "parallel_tool_calls", "prediction")


def chat_request(request: serving_pb2.ChatRequest) -> ChatCompletionRequest:
    """The chat completions request of ``request``'s model, messages, tools, tool choice and prediction."""
    body: dict[str, Any] = {"model": request.model, "messages": [_message(m) for m in request.messages]}
    if request.tools:
        body["tools"] = [_tool(t, k) for k, t in enumerate(request.tools)]
    kind = request.tool_choice.WhichOneof("choice")
    if kind == "mode":
        body["tool_choice"] = request.tool_choice.mode
    elif kind == "function":
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.function}}
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.HasField("prediction"):
        body["prediction"] = {"type": "content", "content": request.prediction}
    return ChatCompletionRequest.model_validate(body)


def with_chat_fields(options: Options, chat: ChatCompletionRequest, tool_call_parser: str | None) -> Options:
    """``options`` (the call's SamplingOptions) with what the chat's own fields decide: the tools shown to the
    template, how the answer is read, a forced call's structured output (one structured output per request: a
    400 when the sampling options ask for another), and the prediction."""
    chosen = chat.chat_options(tool_call_parser)
    if chosen.structured_output is not None and options.structured_output is not None:
        raise InvalidRequestError("tool_choice", "only one structured output per request: a forced call is one, "
                                                 "and sampling.structured_output asks for another")
    return dataclasses.replace(options, **{name: getattr(chosen, name) for name in _CHAT_FIELDS},
                               structured_output=options.structured_output or chosen.structured_output,
                               skip_special_tokens=options.skip_special_tokens and chosen.skip_special_tokens)


def fill_chunk(chunk: serving_pb2.GenerateChunk, choice: dict | None) -> None:
    """``chunk``'s text, reasoning, calls and finish reason from its delta as HTTP shapes it (None: the parsers
    hold all of the delta's text back for now)."""
    delta = choice["delta"] if choice else {}
    chunk.text = delta.get("content") or ""
    chunk.reasoning = delta.get("reasoning_content") or ""
    for call in delta.get("tool_calls") or ():
        chunk.tool_calls.append(serving_pb2.ToolCall(id=call["id"], name=call["function"]["name"],
                                                     arguments=call["function"]["arguments"]))
    if choice and choice["finish_reason"]:
        chunk.finish_reason = choice["finish_reason"]  # "tool_calls" when the answer ends with calls


def _message(m: serving_pb2.ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                               "arguments": c.arguments}}
                                 for c in m.tool_calls]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def _tool(tool: serving_pb2.Tool, k: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError("tools", f"tools.{k}.parameters: not valid JSON: {exc}") from None
    if tool.strict:
        function["strict"] = True
    return {"type": "function", "function": function}
