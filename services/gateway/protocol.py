"""OpenAI request bodies as pydantic models (they also make the OpenAPI schema), and which fields we serve.

pydantic checks types; value ranges are `SamplingParams.validate`'s job, so HTTP and gRPC reject the same
values with the same field names. Every field is either implemented or refused with a 400 that names it
(`UnsupportedFieldError`) unless its value is the no-op default: nothing is accepted and then ignored,
except `IGNORED_FIELDS`, which change no output by definition. A field sent as null counts as absent
(clients send unset fields as null). docs/openai.md lists every field and its status.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
from pydantic import Field

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_LOGPROBS
from engine.structured_output import StructuredOutput
from engine.tokenizer import Tokenizer
from services.gateway.errors import UnsupportedFieldError
from services.gateway.frontend import PRIORITY_LIMIT, Options
from services.gateway.request_body import Body as _Body
from services.gateway.request_body import refuse as _refuse
from services.gateway.structured_outputs import (
    ResponseFormat,
    StructuredOutputsParams,
    forced_call_output,
    requested_output,
)

# Accepted and ignored: they identify the caller or the cache, or only matter for stored completions.
IGNORED_FIELDS = frozenset({"user", "safety_identifier", "prompt_cache_key", "metadata"})
_TOOLS = "tool calling is off on this server (it is served with --tool-call-parser)"
_FUNCTIONS = "the deprecated functions API is not supported: use tools"


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="With include_usage, every chunk carries the usage so "
                                                            "far (vLLM). Extension.")
    include_obfuscation: bool | None = Field(None, description="Accepted; no padding is ever added.")


class ContentPart(_Body):
    type: str
    text: str | None = None


class Prediction(_Body):
    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        """The predicted text (text parts joined); 400 naming what else was sent."""
        self.check_extra("prediction")
        if isinstance(self.content, str):
            return self.content
        for k, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise InvalidRequestError("prediction", f"content.{k}: a prediction's content parts are text "
                                                        f"parts, got type {part.type!r}")
            part.check_extra(f"prediction.content.{k}")
        return "".join(part.text for part in self.content)


class FunctionCall(_Body):
    name: str
    arguments: str = Field(description="A JSON object, as the model wrote it.")


class MessageToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_dict(self) -> dict:
        """As chat templates read it: arguments as an object when they are one (as vLLM renders them)."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name,
                             "arguments": arguments if isinstance(arguments, dict) else self.function.arguments}}


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, description="Passed to the chat template with the message.")
    # An assistant's earlier calls and the tool's answers to them: only where tool calling is on.
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # Refused unless empty: the deprecated functions API, audio.
    function_call: Any | None = None
    refusal: str | None = None
    audio: Any | None = None
    annotations: list[Any] | None = Field(None, description="Accepted and ignored (citations of content).")

    def check(self, path: str, tools: bool) -> None:
        """``tools``: tool calling is on (tool messages and earlier calls are rendered)."""
        self.check_extra(path)
        if self.role == "function" or self.function_call:
            raise UnsupportedFieldError("messages", f"{path}: {_FUNCTIONS}")
        if not tools and (self.role == "tool" or self.tool_calls or self.tool_call_id):
            raise UnsupportedFieldError("messages", f"{path}: {_TOOLS}")
        if self.tool_calls and self.role != "assistant":
            raise InvalidRequestError("messages", f"{path}: only an assistant message holds tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequestError("messages", f"{path}: a tool message needs the tool_call_id it answers")
        for k, call in enumerate(self.tool_calls or ()):
            call.check_extra(f"{path}.tool_calls.{k}")
        if self.refusal or self.audio:
            raise UnsupportedFieldError("messages", f"{path}: only text messages are supported")
        for k, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type != "text" or part.text is None:
                raise UnsupportedFieldError("messages", f"{path}.content.{k}: only text content parts are "
                                            f"supported, got type {part.type!r}")
            part.check_extra(f"{path}.content.{k}")

    def as_dict(self) -> dict:
        """The message as the chat template and the session store take it (content parts joined)."""
        content = self.content if isinstance(self.content, str | None) else "".join(p.text for p in self.content)
        message = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionSpec(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of the arguments.")
    strict: bool | None = Field(None, description="Forced calls keep to the schema (constrained); a call the model "
                                                   "writes freely is returned only when its arguments validate.")


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec

    def check(self, path: str) -> None:
        self.check_extra(path)
        self.function.check_extra(f"{path}.function")
        if self.function.strict and self.function.parameters is not None:  # the calls are validated against it
            try:
                jsonschema.validators.validator_for(self.function.parameters).check_schema(self.function.parameters)
            except jsonschema.SchemaError as exc:
                raise InvalidRequestError("tools", f"{path}.function.parameters: not a valid JSON Schema: "
                                                   f"{exc.message}") from None


class _SamplingBody(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, description="In [0, 2]; 0 is greedy.")
    top_p: float | None = Field(None, description="In (0, 1].")
    top_k: int | None = Field(None, description="Sample from the k most likely tokens (0: off). Extension.")
    min_p: float | None = Field(None, description="In [0, 1]: never draw a token less likely than min_p x the "
                                                  "most likely one (0: off; vLLM). Extension.")
    n: int = Field(1, description="Choices per prompt, up to the server's --max-n.")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end a choice. Extension.")
    allowed_token_ids: list[int] | None = Field(None, description="The only token ids a choice may hold (vLLM). "
                                                                  "Extension.")
    bad_words: list[str] | None = Field(None, description="Words a choice never completes (vLLM). Extension.")
    seed: int | None = None
    presence_penalty: float | None = Field(None, description="In [-2, 2], over the output's tokens.")
    frequency_penalty: float | None = Field(None, description="In [-2, 2], per occurrence in the output.")
    repetition_penalty: float | None = Field(None, description="> 0, over prompt and output (vLLM). Extension.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias in [-100, 100].")
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence tokens. Extension.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string that ended a choice in its "
                                                                "text (vLLM). Extension.")
    skip_special_tokens: bool = Field(True, description="false: special tokens (a chat template's markers, a "
                                                        "model's tool-call token) keep their text (vLLM). Extension.")
    min_tokens: int | None = Field(None, description="Tokens generated before a stop token or string may end a "
                                                     "choice (vLLM). Extension.")
    priority: int = Field(0, description="Lower is served first among the prompts waiting on a worker, the "
                                         f"router's order breaking ties; in [{-PRIORITY_LIMIT}, {PRIORITY_LIMIT}] "
                                         "(vLLM). Extension.")
    return_tokens_as_token_ids: bool = Field(False, description="Logprobs name tokens 'token_id:<id>' (as "
                                                                "vLLM). Extension.")
    prompt_logprobs: int | None = Field(None, description=f"In [0, {MAX_LOGPROBS}]: each prompt token's logprob and "
                                                          "rank and the k most likely tokens' (vLLM's shape; the "
                                                          "prompt is computed whole); not with stream. Extension.")
    return_token_ids: bool = Field(False, description="Each choice's output token ids, and the prompt's (a stream: "
                                                     "the delta's ids, the prompt's in the first chunk) (vLLM). "
                                                     "Extension.")
    truncate_prompt_tokens: int | None = Field(None, description="Keep only the prompt's last k tokens; -1: as many "
                                                                 "as fit before max_tokens (vLLM). Extension.")
    cache_salt: str | None = Field(None, description="Only requests sending the same salt share cached prompt "
                                                     "prefixes: a tenant's secret, long and random (vLLM). "
                                                     "Extension.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema.")
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="One of json, regex, choice, grammar, json_object (vLLM). Extension.")

    def options(self, max_tokens: int | None, logprobs: int | None,
                forced_call: StructuredOutput | None = None) -> Options:
        """The sampling fields as `Options`, after refusing what this server does not implement
        (``forced_call``: what a forced tool call keeps to)."""
        self.check_extra("", IGNORED_FIELDS)
        if self.stream_options is not None:
            self.stream_options.check_extra("stream_options")
            if not self.stream:
                raise InvalidRequestError("stream_options", "only allowed when stream is true")
        try:
            bias = [(int(token), value) for token, value in (self.logit_bias or {}).items()]
        except ValueError:
            raise InvalidRequestError("logit_bias", "keys must be token ids") from None
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got "
                                                             f"{self.prompt_logprobs}")
            if self.stream:
                raise InvalidRequestError("prompt_logprobs", "not available with stream: true (as in vLLM); send "
                                                             "the request without streaming")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Options(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                       min_p=self.min_p, seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []), n=self.n,
                       allowed_token_ids=self.allowed_token_ids, bad_words=list(self.bad_words or []),
                       ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                       skip_special_tokens=self.skip_special_tokens, presence_penalty=self.presence_penalty,
                       frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                       logprobs=logprobs, logit_bias=bias, min_tokens=self.min_tokens, priority=self.priority,
                       prompt_logprobs=self.prompt_logprobs, cache_salt=self.cache_salt,
                       truncate_prompt_tokens=self.truncate_prompt_tokens,
                       structured_output=requested_output(self.response_format, self.structured_outputs, forced_call))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far in every chunk (vLLM's continuous_usage_stats, which needs include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, description="Replaces max_tokens (OpenAI's newer name).")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, description=f"In [0, {MAX_LOGPROBS}]; needs logprobs: true.")
    session_id: str | None = Field(None, description="Keep the conversation server-side (also header "
                                                     "X-Session-Id): send only the new messages. Extension.")
    # Accepted only with their no-op values: see `chat_options`.
    tools: list[ToolSpec] | None = Field(None, description="Functions the model may call (servers started with "
                                                            "--tool-call-parser).")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"auto", "none", "required" or {"type": "function", "function": {"name": ...}}.')
    functions: list[Any] | None = Field(None, description="Only empty (deprecated: use tools).")
    function_call: str | dict[str, Any] | None = Field(None, description='Only "none".')
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per answer (a forced list "
                                                                "holds one; later calls written freely are dropped).")
    modalities: list[str] | None = Field(None, description='Only ["text"].')
    store: bool | None = Field(None, description="Only false.")
    service_tier: str | None = Field(None, description='Only "auto" or "default".')
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Further chat template variables, e.g. "
                                                        "Qwen3's {\"enable_thinking\": false} (vLLM). Extension.")
    add_generation_prompt: bool = Field(True, description="false: the prompt ends after the last message, without "
                                                          "the assistant turn's opening (vLLM). Extension.")
    continue_final_message: bool = Field(False, description="The answer continues the final (assistant) message's "
                                                            "text; needs add_generation_prompt false (vLLM). "
                                                            "Extension.")
    prediction: Prediction | None = Field(None, description="Text the answer is expected to mostly repeat (a file "
                                                            "being edited): drafts for speculative decoding, on a "
                                                            "server started with --num-speculative-tokens.")

    def chat_options(self, tool_call_parser: str | None) -> Options:
        """``tool_call_parser``: the server's (None: tool calling is off)."""
        if self.functions:
            raise _refuse("functions", _FUNCTIONS)
        if self.function_call not in (None, "none"):
            raise _refuse("function_call", _FUNCTIONS)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequestError("tool_choice", "only allowed with tools")
        forced_name = self._forced_tool_name()
        forced = self.tool_choice == "required" or forced_name is not None
        if self.modalities is not None and self.modalities != ["text"]:
            raise _refuse("modalities", "only text output is supported")
        if self.store:
            raise _refuse("store", "stored completions are not supported")
        if self.service_tier not in (None, "auto", "default"):
            raise _refuse("service_tier", "this server has one service tier (auto / default)")
        # "none": the model is not shown the tools
        variables, shown = chat_template_variables(self.messages, self.tools, self.chat_template_kwargs,
                                                   tool_call_parser, show_tools=self.tool_choice != "none")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs", "needs logprobs: true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        single = self.parallel_tool_calls is False
        forced_call = forced_call_output(shown, forced_name, single) if forced else None
        check_chat_ending(self.messages, self.add_generation_prompt, self.continue_final_message)
        if self.continue_final_message and self.session_id:
            raise InvalidRequestError("continue_final_message", "not with a session: send the whole conversation "
                                                                "without session_id")
        options = self.options(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, forced_call)
        options.chat_template_kwargs, options.tools = variables, shown
        options.add_generation_prompt = self.add_generation_prompt
        options.continue_final_message = self.continue_final_message
        options.tool_choice = "required" if self.tool_choice == "required" else "named" if forced else "auto"
        options.tool_name, options.parallel_tool_calls = forced_name, not single
        options.prediction = None if self.prediction is None else self.prediction.text()
        if tool_call_parser == "mistral" and shown and not forced:  # its calls open with a special token
            options.skip_special_tokens = False
        return options

    def _forced_tool_name(self) -> str | None:
        """The function a tool_choice object names; None for the string choices (400 for an unknown one)."""
        if isinstance(self.tool_choice, dict):
            function = self.tool_choice.get("function")
            if (self.tool_choice.get("type") != "function" or not isinstance(function, dict)
                    or not isinstance(function.get("name"), str) or set(self.tool_choice) != {"type", "function"}):
                raise InvalidRequestError("tool_choice", 'a named choice is {"type": "function", "function": '
                                                         '{"name": ...}}')
            return function["name"]
        if self.tool_choice not in (None, "none", "auto", "required"):
            raise InvalidRequestError("tool_choice", f'must be "auto", "none", "required" or a named function, got '
                                                     f"{self.tool_choice!r}")
        return None


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="Text or token ids, or a list of either: each prompt gets its own n choices.")
    logprobs: int | None = Field(None, description=f"In [0, {MAX_LOGPROBS}]: the top k and the sampled token.")
    echo: bool = Field(False, description="The prompt before each choice's text; with logprobs, the prompt "
                                          "tokens' too (the first one's null). With max_tokens 0: the prompt only.")
    add_special_tokens: bool = Field(True, description="Text prompts get the tokenizer's special tokens (its "
                                                       "BOS, say), as in transformers and vLLM. Extension.")
    # Accepted only with their no-op values: see `completion_options`.
    suffix: str | None = Field(None, description="Only empty.")
    best_of: int | None = Field(None, description="Only equal to n.")

    def completion_options(self) -> Options:
        if self.suffix:
            raise _refuse("suffix", "insertion (suffix) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", "best_of other than n is not supported")
        # max_tokens 0 with echo scores the prompt (OpenAI's legacy use): one token is computed, none returned.
        prompt_only = self.echo and self.max_tokens == 0
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens", "must be a positive integer (0 only with echo: true), got 0")
        options = self.options(1 if prompt_only else self.max_tokens, self.logprobs)
        options.echo, options.echo_only = self.echo, prompt_only
        options.add_special_tokens = self.add_special_tokens
        if options.prompt_logprobs is None and self.echo:  # (as vLLM: an explicit prompt_logprobs serves both)
            options.prompt_logprobs = self.logprobs
        return options

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


def chat_template_variables(messages: list[ChatMessage], tools: list[ToolSpec] | None,
                            kwargs: dict[str, Any] | None, tool_call_parser: str | None, show_tools: bool = True
                            ) -> tuple[dict[str, Any], list[dict] | None]:
    """(the chat template's variables beyond the messages: the request's chat_template_kwargs and the tools
    shown; the tools shown, if any), after refusing what this server cannot render or read back
    (``tool_call_parser``: the server's; None: tool calling is off)."""
    if tools and tool_call_parser is None:
        raise _refuse("tools", _TOOLS)
    for k, tool in enumerate(tools or ()):
        tool.check(f"tools.{k}")
    for k, message in enumerate(messages):
        message.check(f"messages.{k}", tool_call_parser is not None)
    taken = sorted(Tokenizer.TEMPLATE_VARIABLES.intersection(kwargs or {}))
    if taken:
        raise InvalidRequestError("chat_template_kwargs", f"{', '.join(taken)}: set by the server, not by a request")
    shown = [tool.model_dump(exclude_none=True) for tool in tools] if tools and show_tools else None
    return {**(kwargs or {}), **({"tools": shown} if shown else {})}, shown


def check_chat_ending(messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool) -> None:
    """continue_final_message needs add_generation_prompt false (the prompt cannot end in two places) and an
    assistant message to continue (vLLM's rules)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message", "needs add_generation_prompt false")
    if continue_final_message and (not messages or messages[-1].role != "assistant"):
        raise InvalidRequestError("continue_final_message", "the final message must be the assistant's")


class TokenizeRequest(_Body):
    """vLLM's ``/tokenize``: a completion prompt (``prompt``) or a chat (``messages``), tokenized as the server
    tokenizes it for generation."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="prompt: default true, as for completions; "
                                                              "messages: only false (the template writes them).")
    add_generation_prompt: bool = Field(True, description="messages: as for chat completions.")
    continue_final_message: bool = Field(False, description="messages: as for chat completions.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="messages: as for chat completions.")
    tools: list[ToolSpec] | None = Field(None, description="messages: as for chat completions.")
    return_token_strs: bool = Field(False, description="Each token's text in token_strs.")

    def template_kwargs(self, tool_call_parser: str | None) -> dict[str, Any]:
        """The chat template's further variables, after refusing what this request may not ask
        (``tool_call_parser``: the server's; None: tool calling is off)."""
        self.check_extra("")
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt", "send either prompt or messages")
        if self.messages is None:
            if self.chat_template_kwargs or self.tools:
                raise _refuse("chat_template_kwargs" if self.chat_template_kwargs else "tools", "only with messages")
            if not self.add_generation_prompt or self.continue_final_message:
                raise _refuse("add_generation_prompt" if not self.add_generation_prompt else "continue_final_message",
                              "only with messages")
        else:
            if self.add_special_tokens:
                raise _refuse("add_special_tokens", "a chat's special tokens come from its template")
            check_chat_ending(self.messages, self.add_generation_prompt, self.continue_final_message)
        return chat_template_variables(self.messages or [], self.tools, self.chat_template_kwargs, tool_call_parser)[0]


class EmbeddingRequest(_Body):
    """OpenAI's ``/v1/embeddings``."""

    model: str
    input: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="Text or token ids, or a list of either: one embedding each, in order.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's float32 values, little-endian, base64-encoded.")
    dimensions: int | None = Field(None, description="The vector's first `dimensions` values (Matryoshka), "
                                                     "normalized again when the model normalizes.")
    add_special_tokens: bool = Field(True, description="Text inputs get the tokenizer's special tokens, as for "
                                                       "completions. Extension (vLLM's).")

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: text, or token ids."""
        self.check_extra("", IGNORED_FIELDS)
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
