"""OpenAI's Responses API (``POST /v1/responses``) through the official `openai` client: answers equal the chat
completions answer for the same conversation, streamed events build the same items in order, input items
(function calls and their outputs) reach the prompt as chat renders them, tools and text.format work, and
every refusal names the Responses field. Stored responses continue by previous_response_id as the chat
conversation they stand for, and are read and deleted by id."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from live_helpers import wait_until
from test_openai_features import client
from test_openai_tools import CONVERSATION, SET_UNIT, TOOLS, token_events

from services.errors import WorkerFailedError
from services.gateway.background_responses import BackgroundResponses
from services.gateway.errors import UnsupportedFieldError
from services.gateway.generation import Generation
from services.gateway.responses_output import ResponsesOutput
from services.gateway.responses_request import ResponsesRequest
from services.gateway.tool_calls import PARSERS
from services.messages import TokenEvent
from services.response_store import ResponseStore

INSTRUCTIONS = "Answer in one word."
QUESTION = "Which creature hides in a shell?"


def prompt_tokens(server, messages: list[dict], tools: list[dict] | None = None) -> int:
    """The tokens of the chat prompt ``messages`` (and ``tools``) render to on ``server``."""
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    return httpx.post(f"{server.http_url}/tokenize", timeout=60, json=body).json()["count"]


def event_types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


# ---- the output items, on the gateway's own Generation ------------------------------------------------------

def fed(pieces: list[str], finish_reason: str = "stop") -> tuple[list[dict], dict]:
    """(every event, the final response) for an answer arriving in ``pieces`` on a server with the qwen3
    reasoning parser and hermes tool calls."""
    async def run() -> tuple[list[dict], dict]:
        gen = Generation("chatcmpl-abc", token_events(pieces, finish_reason), 1)
        await gen.start()
        output = ResponsesOutput(gen, {"model": "m"}, PARSERS["hermes"], "qwen3")
        got = output.start()
        async for d in gen:
            got += output.feed(d)
        return got + output.finish(), output.response()

    return asyncio.run(run())


@pytest.mark.timeout(10)
def test_thinking_text_and_a_call_become_three_items_opened_filled_and_closed_in_order():
    answer = '<think>Crabs.</think>A crab.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    events, response = fed([answer[i:i + 5] for i in range(0, len(answer), 5)])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [t for t in event_types(events) if not t.endswith(".delta")]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Crabs."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "A crab."
    reasoning, message, call = response["output"]
    assert reasoning["content"][0] == {"type": "reasoning_text", "text": "Crabs."}
    assert message["content"][0]["text"] == "A crab." and message["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("get_weather", {"city": "Oslo"}, "completed")
    assert response["status"] == "completed" and events[-1]["response"] == response
    assert response["id"] == "resp_abc" and response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


@pytest.mark.timeout(10)
def test_an_answer_cut_by_max_output_tokens_is_incomplete():
    events, response = fed(["A cr", "ab"], finish_reason="length")
    assert events[-1]["type"] == "response.incomplete" and response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


# ---- a live server ------------------------------------------------------------------------------------------

@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_response_is_the_chat_answer_to_the_same_conversation_whole_or_streamed(live_server):
    c = client(live_server)
    kwargs = dict(model=live_server.model_id, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12,
                  temperature=0.0)
    whole = c.responses.create(**kwargs)
    chat = c.chat.completions.create(model=live_server.model_id, max_tokens=12, temperature=0.0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(c.responses.create(**kwargs, stream=True))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output[0].content[0].text == whole.output_text


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_function_calls_and_their_outputs_in_input_reach_the_prompt_as_chat_renders_them(tool_server):
    call, answer = CONVERSATION[1]["tool_calls"][0], CONVERSATION[2]
    items = [{"role": "user", "content": CONVERSATION[0]["content"]},
             {"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
              "arguments": call["function"]["arguments"]},
             {"type": "function_call_output", "call_id": answer["tool_call_id"], "output": answer["content"]}]
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    resp = client(tool_server).responses.create(model=tool_server.model_id, input=items, tools=tools,
                                                max_output_tokens=1)
    assert resp.usage.input_tokens == prompt_tokens(tool_server, CONVERSATION, TOOLS)


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_forced_function_and_a_json_schema_format_keep_the_answer(tool_server):
    c = client(tool_server)
    closed = "Which unit? <think></think>"  # the server's reasoning parser: the prompt ends the thinking
    tool = {"type": "function", **SET_UNIT["function"]}
    forced = c.responses.create(model=tool_server.model_id, input=closed, tools=[tool], temperature=0.0,
                                tool_choice={"type": "function", "name": "set_unit"}, max_output_tokens=32)
    (call,) = forced.output
    assert call.type == "function_call" and call.name == "set_unit" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) in ({"unit": "celsius"}, {"unit": "fahrenheit"})
    schema = {**SET_UNIT["function"]["parameters"]}
    formatted = c.responses.create(model=tool_server.model_id, input=closed, temperature=0.0, max_output_tokens=32,
                                   text={"format": {"type": "json_schema", "name": "unit", "schema": schema}})
    assert json.loads(formatted.output_text)["unit"] in ("celsius", "fahrenheit")


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fields, param", [
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_what_the_responses_api_here_cannot_do_is_a_400_naming_the_field(live_server, fields, param):
    kwargs = {"model": live_server.model_id, "input": QUESTION, "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as exc:
        client(live_server).responses.create(**kwargs)
    assert exc.value.param == param, exc.value.message


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(60)
def test_a_body_with_nan_is_malformed_json_here_too(live_server):
    body = json.dumps({"model": live_server.model_id, "input": "hi", "temperature": float("nan")})  # NaN, bare
    answer = httpx.post(f"{live_server.http_url}/v1/responses", content=body, timeout=30,
                        headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "not valid JSON" in answer.json()["error"]["message"]


# ---- stored responses ---------------------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_store_follows_the_request_and_a_server_keeping_none_refuses_to_store_or_continue():
    def request(**fields) -> ResponsesRequest:
        return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})

    assert request().stored(True) and request(store=True).stored(True)
    assert not request(store=False).stored(True) and not request().stored(False)
    for fields in ({"store": True}, {"previous_response_id": "resp_1"}):
        with pytest.raises(UnsupportedFieldError) as exc:
            request(**fields).stored(False)
        assert exc.value.param == next(iter(fields)) and "--response-ttl" in str(exc.value)


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_previous_response_id_continues_the_conversation_as_a_session_does_from_its_token_ids(live_server):
    """A continuation's prompt keeps the earlier turn's token ids (its answer's text, encoded again, could give
    other tokens: this random model writes invalid UTF-8), as a chat session's next turn does: the same
    prompt, the same answer. With other instructions its prompt is the conversation's text."""
    c = client(live_server)
    kwargs = dict(model=live_server.model_id, max_output_tokens=8, temperature=0.0)
    first = c.responses.create(**kwargs, instructions=INSTRUCTIONS, input=QUESTION)
    follow_up = "And which one sings?"
    second = c.responses.create(**kwargs, instructions=INSTRUCTIONS, input=follow_up, previous_response_id=first.id)
    session = {"session_id": f"responses-{first.id}"}
    for messages in ([{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
                     [{"role": "user", "content": follow_up}]):
        turn = c.chat.completions.create(model=live_server.model_id, max_tokens=8, temperature=0.0,
                                         messages=messages, extra_body=session)
    assert (first.store, second.previous_response_id) == (True, first.id)
    assert (second.output_text, second.usage.input_tokens) == (turn.choices[0].message.content,
                                                                turn.usage.prompt_tokens)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16
    # Instructions are not carried over: without its own, the continuation has no system message, and its
    # prompt is the conversation through the template.
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": follow_up}]
    bare = c.responses.create(**kwargs, input=follow_up, previous_response_id=first.id)
    assert bare.usage.input_tokens == prompt_tokens(live_server, conversation)
    # Its input items: the conversation it answered, newest first by default, a page at a time.
    newest = c.responses.input_items.list(second.id)
    assert [(i.role, i.content[0].text) for i in newest.data] == [(m["role"], m["content"]) for m in conversation[::-1]]
    assert newest.data[1].id == first.output[0].id and not newest.has_more
    page = c.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [i.id for i in newest.data[:0:-1]] and page.has_more
    rest = c.responses.input_items.list(second.id, order="asc", after=page.data[-1].id)
    assert [i.id for i in rest.data] == [newest.data[0].id] and not rest.has_more
    with pytest.raises(openai.BadRequestError) as exc:
        c.responses.input_items.list(second.id, after="msg_none")
    assert exc.value.param == "after"


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_stored_response_is_read_and_deleted_by_id_and_store_false_keeps_nothing(live_server):
    c = client(live_server)
    kwargs = dict(model=live_server.model_id, input=QUESTION, max_output_tokens=4)
    events = list(c.responses.create(**kwargs, stream=True))
    done = events[-1].response
    # Stored before the last event went out: readable at once.
    assert c.responses.retrieve(done.id).model_dump() == done.model_dump()
    c.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(done.id)
    with pytest.raises(openai.NotFoundError) as exc:
        c.responses.create(**kwargs, previous_response_id=done.id)
    assert exc.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(done.id)
    unkept = c.responses.create(**kwargs, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unkept.id)


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_function_call_answered_after_previous_response_id_reaches_the_prompt_as_chat_renders_it(tool_server):
    c = client(tool_server)
    question = "Which unit? <think></think>"  # closes the thinking, so the forced call starts at once
    tool = {"type": "function", **SET_UNIT["function"]}
    forced = c.responses.create(model=tool_server.model_id, input=question, tools=[tool], temperature=0.0,
                                tool_choice={"type": "function", "name": "set_unit"}, max_output_tokens=32)
    (call,) = forced.output
    answered = c.responses.create(model=tool_server.model_id, previous_response_id=forced.id, tools=[tool],
                                  max_output_tokens=1, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                               "output": "set"}])
    conversation = [{"role": "user", "content": question},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": "set_unit", "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "set"}]
    assert answered.usage.input_tokens == prompt_tokens(tool_server, conversation, [SET_UNIT])


# ---- background responses -----------------------------------------------------------------------------------

def run_in_background(redis_url: str, events, cancel: bool) -> tuple[dict, dict]:
    """(the response a background request is answered with, the response kept at its end) for a generation
    of ``events``; ``cancel``: cancel it once its first text is in."""
    async def run() -> tuple[dict, dict]:
        gen = Generation(f"chatcmpl-bg{id(events)}", events, 1)
        await gen.start()
        store = ResponseStore(redis_url, ttl_s=60)
        background = BackgroundResponses(store)
        output = ResponsesOutput(gen, {"model": "m", "background": True}, None, None)
        answered = await background.start(output, [{"role": "user", "content": QUESTION}])
        while not output.items:
            await asyncio.sleep(0.01)
        if cancel:
            kept = await background.cancel(output.id)
        else:
            async for _ in await background.events(output.id):  # to its last event
                pass
            kept = (await store.get(output.id)).response
        await store.close()
        return answered, kept

    return asyncio.run(run())


@pytest.mark.redis
@pytest.mark.timeout(20)
def test_a_cancelled_background_response_is_kept_cancelled_and_its_generation_stopped(redis_url):
    stopped = []

    async def endless():
        try:
            yield TokenEvent(0, [1], None, 5, 0, "A crab")
            await asyncio.Event().wait()  # never ends by itself
        finally:
            stopped.append(True)

    answered, kept = run_in_background(redis_url, endless(), cancel=True)
    assert answered["status"] == "in_progress" and answered["usage"] is None
    assert kept["status"] == "cancelled" and kept["id"] == answered["id"] and stopped == [True]
    assert kept["output"][0]["content"][0]["text"] == "A crab" and kept["output"][0]["status"] == "incomplete"


@pytest.mark.redis
@pytest.mark.timeout(20)
def test_a_background_response_whose_generation_fails_is_kept_failed_with_the_error(redis_url):
    async def failing():
        yield TokenEvent(0, [1], None, 5, 0, "A cr")
        raise WorkerFailedError("the decode worker died")

    _, kept = run_in_background(redis_url, failing(), cancel=False)
    assert kept["status"] == "failed" and kept["error"]["code"] == "worker_failed"
    assert "worker failed" in kept["error"]["message"]


@pytest.mark.redis
@pytest.mark.timeout(20)
def test_a_background_stream_left_midway_runs_on_and_resumes_after_the_last_event_seen(redis_url):
    gate = asyncio.Event()

    async def gated():
        yield TokenEvent(0, [1], None, 5, 0, "A crab")
        await gate.wait()
        yield TokenEvent(0, [2], "stop", 5, 0, " hides.")

    async def run() -> tuple[list[dict], list[dict], list[dict], dict]:
        gen = Generation("chatcmpl-bgstream", gated(), 1)
        await gen.start()
        store = ResponseStore(redis_url, ttl_s=60)
        background = BackgroundResponses(store)
        output = ResponsesOutput(gen, {"model": "m", "background": True}, None, None)
        await background.start(output, [{"role": "user", "content": QUESTION}])
        seen = []
        async for event in await background.events(output.id):  # the first client, until its first text
            seen.append(event)
            if event["type"] == "response.output_text.delta":
                break
        gate.set()  # the answer goes on without it
        resumed = [e async for e in await background.events(output.id, seen[-1]["sequence_number"])]
        # Asked again of a gateway that no longer holds its log (restarted, say): its last event, kept.
        after_end = [e async for e in await BackgroundResponses(store).events(output.id, 0)]
        kept = (await store.get(output.id)).response
        await store.close()
        return seen, resumed, after_end, kept

    seen, resumed, after_end, kept = asyncio.run(run())
    assert [e["sequence_number"] for e in seen + resumed] == list(range(len(seen) + len(resumed)))
    text = "".join(e["delta"] for e in seen + resumed if e["type"] == "response.output_text.delta")
    assert text == "A crab hides." and resumed[-1]["type"] == "response.completed"
    assert resumed[-1]["response"] == kept and kept["status"] == "completed"
    assert event_types(after_end) == ["response.completed"] and after_end[0]["response"] == kept


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_background_response_finishes_after_its_answer_as_the_foreground_one_does(live_server):
    c = client(live_server)
    kwargs = dict(model=live_server.model_id, input=QUESTION, max_output_tokens=12, temperature=0.0)
    foreground = c.responses.create(**kwargs)
    started = c.responses.create(**kwargs, background=True)
    assert started.background and started.status == "in_progress"
    assert wait_until(lambda: c.responses.retrieve(started.id).status != "in_progress", 60)
    done = c.responses.retrieve(started.id)
    assert (done.status, done.output_text, done.usage.output_tokens) == (
        foreground.status, foreground.output_text, foreground.usage.output_tokens)
    assert c.responses.cancel(started.id).status == done.status  # ended already: returned as it ended
    with pytest.raises(openai.BadRequestError) as exc:
        c.responses.cancel(foreground.id)
    assert "only those can be cancelled" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        c.responses.cancel("resp_unknown")
    with pytest.raises(openai.BadRequestError) as exc:
        c.responses.create(**kwargs, background=True, store=False)
    assert exc.value.param == "background"
    # Streamed: the same answer, and streamed again after its second event (by now it has ended).
    events = list(c.responses.create(**kwargs, background=True, stream=True))
    assert events[0].type == "response.created" and events[-1].type == f"response.{foreground.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == foreground.output_text
    again = list(c.responses.retrieve(events[-1].response.id, stream=True, starting_after=1))
    assert again[-1].type == events[-1].type and again[-1].response.output_text == foreground.output_text
    assert all(e.sequence_number > 1 for e in again[:-1])  # the log's rest, if the gateway still holds it
