"""Chat tool calling (``--tool-call-parser hermes``, beside ``--reasoning-parser qwen3``): the Hermes parser on answers as they stream, the
response shapes it gives (message and stream deltas, finish_reason "tool_calls"), and, through the
official `openai` client against a server whose chat template renders tools, calls and tool answers, that
tools reach the prompt and every refusal names its field (`tool_server`, conftest.py). (A random-weight model writes no tool call, so
the parser's output is checked on the gateway's own Generation fed with token events.)"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from test_openai_features import client

from services.gateway.generation import Generation
from services.gateway.protocol import ChatMessage
from services.gateway.responses import ResponseShape
from services.gateway.structured_outputs import forced_call_output
from services.gateway.tagged_text import parsed
from services.gateway.tool_calls import (
    PARSERS,
    ForcedCallsParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    call_parser,
)
from services.messages import TokenEvent

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = f"Let me look.\n{CALL}\n<tool_call>\n{{\"name\": \"now\", \"arguments\": {{}}}}\n</tool_call>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


# ---- the parser ---------------------------------------------------------------------------------------------

def parse_tool_calls(kind: str, text: str) -> tuple[str, list[ToolCall]]:
    return parsed(PARSERS[kind](), text, final=True)


@pytest.mark.timeout(10)
def test_calls_are_split_from_content_whole_or_streamed_a_character_at_a_time():
    content, calls = parse_tool_calls("hermes", ANSWER)
    assert content.strip() == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert len({c.id for c in calls}) == 2
    parser, streamed, found = HermesParser(), "", []
    for ch in ANSWER:
        text, new = parser.feed(ch)
        assert OPEN_TAIL not in text  # never a piece of a tag
        streamed, found = streamed + text, found + new
    rest, more = parser.finish()
    assert streamed + rest == content and [c.name for c in found + more] == ["get_weather", "now"]


OPEN_TAIL = "<tool"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("answer, content, names", [
    ("a <toolbox> b", "a <toolbox> b", []),  # held back while it could begin a tag, then released
    ("x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),  # not a call: content
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', "", ["f"]),  # the answer ended inside a whole call
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),  # cut short: content
    ("ends with <tool_c", "ends with <tool_c", []),
])
def test_what_is_not_a_whole_call_stays_content(answer, content, names):
    got, calls = parse_tool_calls("hermes", answer)
    assert (got, [c.name for c in calls]) == (content, names)
    parser = HermesParser()
    streamed = "".join(parser.feed(ch)[0] for ch in answer)
    assert streamed + parser.finish()[0] == content


LLAMA_CALLS = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}'


@pytest.mark.timeout(10)
@pytest.mark.parametrize("answer, content, calls", [
    (LLAMA_CALLS, "", [("get_weather", {"city": "Paris"}), ("now", {})]),  # the whole answer is the calls
    ('  {"name": "f", "arguments": {"a": 1}}  ', "", [("f", {"a": 1})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", {})]),  # the tag, where special tokens are kept
    ('{"result": 4} is the JSON', '{"result": 4} is the JSON', []),  # an object, but not a call: content
    ('{"name": "f", "parameters": {}} and more', '{"name": "f", "parameters": {}} and more', []),
    ('{"name": "f", "param', '{"name": "f", "param', []),  # cut short: content
    ('The call is {"name": "f"}', 'The call is {"name": "f"}', []),  # a call inside text is text
])
def test_llama3_json_reads_an_answer_that_is_nothing_but_calls(answer, content, calls):
    got, found = parse_tool_calls("llama3_json", answer)
    assert (got, [(c.name, json.loads(c.arguments)) for c in found]) == (content, calls)
    parser = Llama3JsonParser()
    streamed = "".join(parser.feed(ch)[0] for ch in answer)
    assert streamed + parser.finish()[0] == content


MISTRAL_CALLS = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]'
# Mistral v0.3's way with tools, in a template of our own: the calls and the answers that come back must carry
# ids of nine letters and digits, or the template refuses the conversation
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}{% if not (c.id is string and c.id|length == 9 and c.id.isalnum()) %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{% elif m.role == 'tool' %}{% if m.tool_call_id|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_RESULTS] {{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("answer, content, calls", [
    (MISTRAL_CALLS, "", [("get_weather", {"city": "Paris"}), ("now", {})]),  # [TOOL_CALLS] dropped from the text
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})]),  # the token, where kept
    ("[1] is the footnote", "[1] is the footnote", []),  # a list, but not of calls: content
    ('[{"name": "f", "arguments": {}}] and more', '[{"name": "f", "arguments": {}}] and more', []),
    ('[{"name": "f", "argu', '[{"name": "f", "argu', []),  # cut short: content
    ("[]", "[]", []),
    ('Call [{"name": "f"}]', 'Call [{"name": "f"}]', []),  # calls inside text are text
    # where special tokens keep their text (a mistral server's tool requests): text, then the tagged calls
    ('Let me look. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', "Let me look. ", [("f", {"a": 1})]),
    # v11 tokenizers on: name[ARGS]{...}, each call after its own tag
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}', "",
     [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("Ok [TOOL_CALLS] not a call", "Ok [TOOL_CALLS] not a call", []),  # after the tag, no call: all text
    ('[TOOL_CALLS]f[ARGS]{"a": 1}, "name": "g"}', '[TOOL_CALLS]f[ARGS]{"a": 1}, "name": "g"}', []),
])
def test_mistral_reads_an_answer_that_is_nothing_but_a_list_of_calls(answer, content, calls):
    got, found = parse_tool_calls("mistral", answer)
    assert (got, [(c.name, json.loads(c.arguments)) for c in found]) == (content, calls)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in found) and len({c.id for c in found}) == len(found)
    parser = MistralParser()
    streamed = "".join(parser.feed(ch)[0] for ch in answer)
    assert "[TOOL" not in streamed or "[TOOL_CALLS]" in content  # no piece of a tag that opens calls goes out
    assert streamed + parser.finish()[0] == content


@pytest.mark.timeout(10)
def test_a_mistral_servers_tool_requests_keep_special_tokens_text_unless_a_call_is_forced():
    from services.gateway.protocol import ChatCompletionRequest

    def skips(parser: str, **fields) -> bool:
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], **fields)
        return body.chat_options(parser).skip_special_tokens

    assert not skips("mistral", tools=TOOLS) and not skips("mistral", tools=TOOLS, tool_choice="auto")
    assert skips("mistral") and skips("hermes", tools=TOOLS) and skips("mistral", tools=TOOLS, tool_choice="none")
    assert skips("mistral", tools=TOOLS, tool_choice="required")  # a forced list is read without the token


@pytest.mark.timeout(10)
def test_mistral_calls_forced_or_not_go_back_through_a_template_that_takes_only_nine_character_ids():
    """The next turn sends the calls and their answers back under the ids the parser gave them: a Mistral
    template renders them, where the ids every other parser gives are refused."""
    from engine.errors import InvalidRequestError
    from engine.loader import resolve_model_dir
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_dir("tiny")).with_chat_template(MISTRAL_TEMPLATE)
    forced = call_parser("mistral", TOOLS, tool_choice="required")()
    forced.feed('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    for calls in (parse_tool_calls("mistral", MISTRAL_CALLS)[1], forced.finish()[1],
                  parse_tool_calls("hermes", CALL)[1]):
        turn = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [c.as_dict() for c in calls]},
                *({"role": "tool", "tool_call_id": c.id, "content": "Sunny"} for c in calls)]
        messages = [ChatMessage.model_validate(m).as_dict() for m in turn]
        if calls[0].id.startswith("call_"):  # hermes: OpenAI-style ids
            with pytest.raises(InvalidRequestError, match="length 9"):
                tokenizer.apply_chat_template(messages)
            continue
        rendered = tokenizer.apply_chat_template(messages)
        assert all(f'"id": "{c.id}"' in rendered and f'"call_id": "{c.id}"' in rendered for c in calls)


# ---- the response shapes -------------------------------------------------------------------------------------

async def token_events(pieces: list[str], finish_reason: str = "stop"):
    """The dispatcher's events for one choice whose answer arrives in ``pieces``, a token each."""
    for k, piece in enumerate(pieces):
        yield TokenEvent(0, [k], finish_reason if k == len(pieces) - 1 else None, 5, 0, piece)


def shaped(pieces: list[str], tool_calls=PARSERS["hermes"], reasoning: str | None = None,
           finish_reason: str = "stop") -> tuple[list[dict], dict]:
    """The stream's chunk choices and the whole response's choice for an answer arriving in ``pieces``, through
    the gateway's Generation and response shapes (the dispatcher's events replaced by ``pieces``)."""
    async def run() -> tuple[list[dict], dict]:
        gen = Generation("chatcmpl-test", token_events(pieces, finish_reason), 1)
        await gen.start()
        def shape() -> ResponseShape:
            return ResponseShape(gen, "m", chat=True, logprobs=None, tool_calls=tool_calls, reasoning=reasoning)

        streamed = shape()
        choices = [c async for d in gen if (c := streamed.delta(d)) is not None]
        return choices, shape().complete()["choices"][0]

    return asyncio.run(run())


@pytest.mark.timeout(10)
def test_a_streamed_answer_with_calls_sends_content_then_one_delta_per_call():
    choices, whole = shaped([ANSWER[i:i + 7] for i in range(0, len(ANSWER), 7)])
    content = "".join(c["delta"].get("content", "") for c in choices)
    calls = [call for c in choices for call in c["delta"].get("tool_calls", [])]
    assert content.strip() == "Let me look."
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [(0, "function", "get_weather"),
                                                                               (1, "function", "now")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["tool_calls"]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"].strip() == "Let me look."
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather", "now"]


@pytest.mark.timeout(10)
def test_a_llama_answer_of_calls_streams_nothing_until_it_ends_then_every_call():
    choices, whole = shaped([LLAMA_CALLS[i:i + 6] for i in range(0, len(LLAMA_CALLS), 6)], tool_calls=PARSERS["llama3_json"])
    assert len(choices) == 1 and "content" not in choices[0]["delta"]  # held, then one chunk at the end
    assert [c["function"]["name"] for c in choices[0]["delta"]["tool_calls"]] == ["get_weather", "now"]
    assert choices[0]["finish_reason"] == whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] is None and len(whole["message"]["tool_calls"]) == 2


@pytest.mark.timeout(10)
def test_an_answer_that_is_only_a_call_has_null_content():
    message = shaped([CALL])[1]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind, write", [
    ("hermes", lambda call: f"<tool_call>{json.dumps(call)}</tool_call>"),
    ("llama3_json", json.dumps),
])
def test_a_strict_functions_call_is_a_call_only_when_its_arguments_validate(kind, write):
    """With tool_choice auto the model writes calls freely: a strict function's are checked, not constrained."""
    tools = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    parser = call_parser(kind, tools)
    good, bad = {"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {}}
    if kind == "llama3_json":
        good, bad = ({"name": c["name"], "parameters": c["arguments"]} for c in (good, bad))
    content, calls = parsed(parser(), write(good), final=True)
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    content, calls = parsed(parser(), write(bad), final=True)
    assert content == write(bad) and calls == []
    loose = call_parser(kind, [{"type": "function", "function": {**tools[0]["function"], "strict": False}}])
    assert len(parsed(loose(), write(bad), final=True)[1]) == 1  # not strict: returned as the model wrote it


@pytest.mark.timeout(10)
def test_a_named_forced_call_is_the_whole_answer_and_finishes_as_stop():
    answer = '{"city": "Paris"}'
    choices, whole = shaped([answer[:6], answer[6:]], tool_calls=lambda: ForcedCallsParser("get_weather"))
    assert len(choices) == 1 and choices[0]["finish_reason"] == "stop"  # held, then the call at the end
    (call,) = choices[0]["delta"]["tool_calls"]
    assert (call["index"], call["function"]["name"], call["function"]["arguments"]) == (0, "get_weather", answer)
    assert whole["finish_reason"] == "stop" and whole["message"]["content"] is None
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == answer


@pytest.mark.timeout(10)
def test_a_required_answer_is_a_list_of_calls_and_cut_short_it_is_content():
    answer = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    whole = shaped([answer], tool_calls=ForcedCallsParser)[1]
    calls = whole["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"] and whole["finish_reason"] == "tool_calls"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    cut = shaped([answer[:30]], tool_calls=ForcedCallsParser, finish_reason="length")[1]
    assert cut["message"]["content"] == answer[:30] and "tool_calls" not in cut["message"]
    assert cut["finish_reason"] == "length"


@pytest.mark.timeout(10)
def test_without_parallel_tool_calls_an_answer_keeps_only_its_first_call():
    parser = call_parser("hermes", TOOLS, parallel=False)
    choices, whole = shaped([ANSWER[i:i + 7] for i in range(0, len(ANSWER), 7)], tool_calls=parser)
    streamed = [call["function"]["name"] for c in choices for call in c["delta"].get("tool_calls", [])]
    assert streamed == [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"].strip() == "Let me look."


@pytest.mark.timeout(10)
def test_a_required_list_holds_calls_of_name_and_parameters_only_and_one_without_parallel_calls():
    def allows(single: bool, calls: list[dict]) -> bool:
        try:
            jsonschema.validate(calls, json.loads(forced_call_output([*TOOLS, SET_UNIT], None, single).spec))
        except jsonschema.ValidationError:
            return False
        return True

    one = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    two = [*one, {"name": "set_unit", "parameters": {"unit": "celsius"}}]
    assert allows(False, one) and allows(False, two) and allows(True, one) and not allows(True, two)
    assert not allows(False, [{**one[0], "action": "GET"}]) and not allows(False, [])


# ---- a live server ------------------------------------------------------------------------------------------

def tokenize(server, body: dict) -> dict:
    return httpx.post(f"{server.http_url}/tokenize", json=body, timeout=60).json()


def detokenize(server, ids: list[int]) -> str:
    return httpx.post(f"{server.http_url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_tools_calls_and_tool_answers_reach_the_prompt(tool_server):
    c = client(tool_server)
    prompt = tokenize(tool_server, {"messages": CONVERSATION, "tools": TOOLS})
    text = detokenize(tool_server, prompt["tokens"])
    assert "Tools: get_weather" in text  # the tools, rendered by the template
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text  # an object
    assert "<|tool|>Sunny, 21 C<|eot|><|assistant|>" in text
    resp = c.chat.completions.create(model=tool_server.model_id, messages=CONVERSATION, tools=TOOLS,
                                     tool_choice="auto", max_tokens=4, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == prompt["count"]
    # a random-weight model writes no call and no thinking: the answer is content, as it would be without either
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.reasoning_content is None and resp.choices[0].message.content
    streamed = c.chat.completions.create(model=tool_server.model_id, messages=CONVERSATION, tools=TOOLS,
                                         max_tokens=4, temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == resp.choices[0].message.content
    # tool_choice "none": the model is not shown the tools
    unseen = c.chat.completions.create(model=tool_server.model_id, messages=CONVERSATION, tools=TOOLS,
                                       tool_choice="none", max_tokens=1)
    assert unseen.usage.prompt_tokens == tokenize(tool_server, {"messages": CONVERSATION})["count"]


# Compact (llguidance's schema option), so that a random-weight model's forced arguments end within max_tokens.
SET_UNIT = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_forced_call_keeps_to_its_function_schema(tool_server):
    c = client(tool_server)
    # The server's reasoning parser holds the forced call back until the thinking ends: this prompt closes it
    # (see test_with_a_reasoning_parser_a_structured_output_waits_for_the_end_of_thinking).
    asked = [{"role": "user", "content": "Weather in Paris? <think></think>"}]
    kwargs = dict(model=tool_server.model_id, messages=asked, tools=[*TOOLS, SET_UNIT], temperature=0.0)
    named = c.chat.completions.create(**kwargs, max_tokens=32,
                                      tool_choice={"type": "function", "function": {"name": "set_unit"}})
    choice = named.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "stop" and choice.message.content is None and call.function.name == "set_unit"
    assert json.loads(call.function.arguments) in ({"unit": "celsius"}, {"unit": "fahrenheit"})
    streamed = c.chat.completions.create(**kwargs, max_tokens=32, stream=True,
                                         tool_choice={"type": "function", "function": {"name": "set_unit"}})
    deltas = [call for chunk in streamed for call in chunk.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("set_unit", call.function.arguments)]
    # "required": a JSON list of calls, which JSON's free whitespace may leave unfinished at max_tokens
    required = c.chat.completions.create(**kwargs, max_tokens=24, tool_choice="required").choices[0]
    if required.finish_reason == "tool_calls":
        assert {call.function.name for call in required.message.tool_calls} <= {"get_weather", "set_unit"}
    else:
        assert required.finish_reason == "length" and required.message.content.lstrip().startswith("[")


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_with_a_reasoning_parser_a_structured_output_waits_for_the_end_of_thinking(tool_server):
    """The server's qwen3 parser: an answer is kept to its spec from the first token when the prompt closed
    the thinking block (as Qwen3's template does with enable_thinking false; here a message writes the tags),
    else only after the answer's own </think>, which a random-weight model never writes: its answer is free."""
    c = client(tool_server)
    kwargs = dict(model=tool_server.model_id, max_tokens=12, temperature=0.0)
    digits = {"structured_outputs": {"regex": "[0-9]{4}"}}
    closed = [{"role": "user", "content": "Year? <think></think>"}]
    kept = c.chat.completions.create(messages=closed, extra_body=digits, **kwargs).choices[0]
    assert re.fullmatch("[0-9]{4}", kept.message.content) and kept.finish_reason == "stop"
    assert kept.message.reasoning_content is None
    opened = [{"role": "user", "content": "Year?"}]
    free = c.chat.completions.create(messages=opened, **kwargs).choices[0].message.content
    assert c.chat.completions.create(messages=opened, extra_body=digits, **kwargs).choices[0].message.content == free
    assert not re.fullmatch("[0-9]{4}", free)


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),  # not in tools
    ({"tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),  # the Responses API's shape
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": 5}}}]},
     "tools"),  # a strict function's calls are validated against its schema: it must be one
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),  # two outputs
    ({"extra_body": {"session_id": "s-tools"}}, "tools"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # which call it answers
    ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_what_tool_calling_here_cannot_do_is_a_400_naming_the_field(tool_server, fields, param):
    kwargs = {"model": tool_server.model_id, "messages": CONVERSATION, "tools": TOOLS, "max_tokens": 1, **fields}
    with pytest.raises(openai.BadRequestError) as exc:
        client(tool_server).chat.completions.create(**kwargs)
    assert exc.value.param == param, exc.value.message


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_server_without_a_tool_call_parser_refuses_tools(live_server):
    with pytest.raises(openai.BadRequestError) as exc:
        client(live_server).chat.completions.create(model=live_server.model_id, messages=CONVERSATION[:1],
                                                    tools=TOOLS, max_tokens=1)
    assert exc.value.param == "tools" and "--tool-call-parser" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        client(live_server).chat.completions.create(model=live_server.model_id, messages=CONVERSATION, max_tokens=1)
    assert exc.value.param == "messages"
