"""OpenAI's Responses API request (``POST /v1/responses``), served on the chat path.

A request's ``instructions`` and its conversation (the items of the response it continues, named by
``previous_response_id``, then its own ``input`` items: messages, ``function_call`` items and their
``function_call_output``) become chat messages, its ``tools``, ``tool_choice`` and ``text.format`` the chat
request's tools, tool choice and response format, so every check, template and parser is the chat
completions one (``protocol.ChatCompletionRequest``). Errors name the Responses field, not the chat one.
Responses are stored (``services/response_store.py``) unless ``store`` is false or the server keeps none; a
stored one may run in the background (``background_responses.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from engine.errors import InvalidRequestError
from engine.generation_defaults import GenerationDefaults
from services.gateway.errors import UnsupportedFieldError
from services.gateway.protocol import IGNORED_FIELDS, ChatCompletionRequest
from services.gateway.request_body import Body, refuse
from services.gateway.responses_output import item_id

# The chat request's field -> the Responses field an error about it names.
_FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
_NOT_STORED = "this server stores no responses (it runs with --response-ttl 0): send the whole conversation in input"
_ROLES = ("user", "system", "developer", "assistant")


class ResponsesTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextOptions(Body):
    format: dict[str, Any] | None = Field(None, description="{type: text | json_object | json_schema, name, schema, "
                                                            "strict, description}")
    verbosity: Literal["medium"] | None = Field(None, description="Only medium.")


class ResponsesRequest(Body):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = Field(None, description="Sent first, as a system message.")
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per answer.")
    text: TextOptions | None = None
    priority: int | None = Field(None, description="As for chat completions (vLLM). Extension.")
    cache_salt: str | None = Field(None, description="As for chat completions (vLLM). Extension.")
    stream: bool = False
    stream_options: dict[str, Any] | None = Field(None, description="Accepted; no obfuscation padding is added.")
    # Accepted only with their no-op values: see `chat_request`.
    store: bool | None = Field(None, description="Keep the response to continue or read later (default: true, "
                                                 "unless the server keeps none).")
    previous_response_id: str | None = Field(None, description="Continue this stored response's conversation.")
    background: bool | None = Field(None, description="Answer once the generation has started and finish it "
                                                      "in the background, whether or not the client stays "
                                                      "(needs store).")
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = Field(None, description="Only empty: a reasoning model thinks as it was trained.")
    truncation: Literal["disabled"] | None = None
    service_tier: str | None = None

    def stored(self, server_stores: bool) -> bool:
        """Whether the response is to be kept (``server_stores``: the server keeps responses); a 400 when it
        asks for a store the server does not keep."""
        for name, value in (("store", self.store), ("previous_response_id", self.previous_response_id),
                            ("background", self.background)):
            if value and not server_stores:
                raise refuse(name, _NOT_STORED)
        if self.background and self.store is False:
            raise InvalidRequestError("background", "a background response is read back later: it needs store")
        return server_stores and self.store is not False

    def input_items(self) -> list[dict[str, Any]]:
        """The request's own input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    def kept_items(self) -> list[dict[str, Any]]:
        """The input items as a stored response keeps them (and lists them): each with an id, a message's
        text as one part."""
        return [_kept(item) for item in self.input_items()]

    def chat_request(self, earlier: list[dict[str, Any]] = ()) -> ChatCompletionRequest:
        """The chat completions request that serves this one, after the ``earlier`` items of the response it
        continues; 400s name this request's fields."""
        self.check_extra("", IGNORED_FIELDS)
        if self.include:
            raise refuse("include", "no extra output data (reasoning.encrypted_content, logprobs, ...) is available")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise refuse("reasoning", "a reasoning model thinks as it was trained (no effort or summary settings)")
        if self.text is not None:
            self.text.check_extra("text")
        chat: dict[str, Any] = {"model": self.model, "messages": self._messages(earlier), "stream": self.stream,
                                "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
                                "service_tier": self.service_tier, "priority": self.priority,
                                "cache_salt": self.cache_salt}
        if self.tools is not None:
            for k, tool in enumerate(self.tools):
                tool.check_extra(f"tools.{k}")
            chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = self._chat_tool_choice()
        if self.text is not None and self.text.format is not None:
            chat["response_format"] = _response_format(self.text.format)
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            loc = exc.errors()[0]["loc"]
            field = _FIELD_NAMES.get(str(loc[0]), str(loc[0])) if loc else "input"
            raise InvalidRequestError(field, exc.errors()[0]["msg"]) from None

    def echoed(self, stored: bool, defaults: GenerationDefaults) -> dict[str, Any]:
        """The request's settings, as a response object repeats them (``stored``: whether it is kept); a
        sampling field it left unset shows the value used: the model's default, else the API's."""
        sampling = defaults.apply({"temperature": self.temperature, "top_p": self.top_p})
        return {"model": self.model, "store": stored, "background": bool(self.background),
                "previous_response_id": self.previous_response_id, "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens,
                "temperature": sampling.get("temperature", 1.0), "top_p": sampling.get("top_p", 1.0),
                "tools": self._tools_echoed(),
                "tool_choice": self.tool_choice or "auto", "parallel_tool_calls": self.parallel_tool_calls is not False,
                "text": {"format": self.text.format if self.text and self.text.format else {"type": "text"}},
                "truncation": "disabled", "metadata": (self.model_extra or {}).get("metadata") or {}}

    def renders_as(self, response: dict[str, Any]) -> bool:
        """Whether ``response``'s prompt was rendered with this request's instructions and tools (so this
        request's prompt may start with its token ids)."""
        return response.get("instructions") == self.instructions and response.get("tools") == self._tools_echoed()

    def _tools_echoed(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    def _messages(self, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [(f"previous_response_id.{k}", item) for k, item in enumerate(earlier)]
        items += [(f"input.{k}", item) for k, item in enumerate(self.input_items())]
        for path, item in items:
            kind = item.get("type", "message")
            if kind == "message":
                messages.append(_message(item, path))
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", path), "type": "function",
                        "function": {"name": _string(item, "name", path),
                                     "arguments": _string(item, "arguments", path)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # its text, then its calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", path),
                                 "content": _string(item, "output", path)})
            elif kind != "reasoning":  # earlier thinking: chat templates leave it out of later turns
                raise UnsupportedFieldError("input", f"{path}.type: {kind!r} items are not supported (messages, "
                                                     "function_call, function_call_output and reasoning are)")
        return messages

    def _chat_tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or len(choice) != 2:
                raise InvalidRequestError("tool_choice", 'a named choice is {"type": "function", "name": ...}')
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

def renamed(exc: BaseException) -> BaseException:
    """``exc`` (a 400 about the chat request that serves a Responses request) naming the Responses field."""
    if isinstance(exc, InvalidRequestError):
        field, message = exc.field, exc.message
    elif isinstance(exc, UnsupportedFieldError):
        field, message = exc.param, str(exc).removeprefix(f"{exc.param}: ")
    else:
        return exc
    name = _FIELD_NAMES.get(field, field)
    if name == field:
        return exc
    return InvalidRequestError(name, message) if isinstance(exc, InvalidRequestError) else \
        UnsupportedFieldError(name, f"{name}: {message}")


def _message(item: dict[str, Any], path: str) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in _ROLES:
        raise InvalidRequestError("input", f"{path}.role: must be one of {', '.join(_ROLES)}, got {role!r}")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise UnsupportedFieldError("input", f"{path}.content.{j}: only input_text and output_text parts "
                                                     "are supported")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise InvalidRequestError("input", f"{path}.content: must be a string or a list of text parts")
    unknown = sorted(set(item) - {"type", "role", "content", "id", "status"})
    if unknown:
        raise UnsupportedFieldError("input", f"{path}.{unknown[0]}: not supported by this server")
    return {"role": role, "content": content}


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _kept(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    kept = {**item, "type": kind, "id": item.get("id") or item_id(_ID_PREFIXES.get(kind, "item"))}
    if kind == "message" and isinstance(kept.get("content"), str):
        part = "output_text" if kept.get("role") == "assistant" else "input_text"
        kept["content"] = [{"type": part, "text": kept["content"]}]
    return kept


def _string(item: dict[str, Any], name: str, path: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidRequestError("input", f"{path}.{name}: must be a string")
    return value


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """text.format (flat: ``{type, name, schema, strict, description}``) as chat's response_format."""
    if fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
