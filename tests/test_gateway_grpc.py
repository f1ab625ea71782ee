"""The gRPC API (tidepool.v1.Serving) against a live `tidepool serve`: streaming, health, reflection, statuses.

Fixtures as in test_gateway_http.py: `live_server`, `secured_server`, `overloaded_server`, `dead_server`, and
`tool_server` for tool calling.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from live_helpers import free_blocks, idle, wait_until
from test_openai_tools import CONVERSATION, SET_UNIT, TOOLS, token_events

from services.gateway.generation import Generation
from services.gateway.grpc_chat import fill_chunk
from services.gateway.responses import ResponseShape
from services.gateway.tool_calls import PARSERS
from tidepool.v1 import serving_pb2, serving_pb2_grpc

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(240)]

MESSAGES = [serving_pb2.ChatMessage(role="user", content="What lives in a tide pool?")]


def stub(server) -> serving_pb2_grpc.ServingStub:
    return serving_pb2_grpc.ServingStub(grpc.insecure_channel(server.grpc_target))


def greedy(max_tokens: int) -> serving_pb2.SamplingOptions:
    return serving_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def chat(server, sampling: serving_pb2.SamplingOptions, metadata=None, **fields) -> list[serving_pb2.GenerateChunk]:
    request = serving_pb2.ChatRequest(model=server.model_id, messages=MESSAGES, sampling=sampling, **fields)
    return list(stub(server).Chat(request, metadata=metadata, timeout=120))


def status_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value


def test_chat_streams_deltas_ids_finish_reason_and_usage(live_server):
    chunks = chat(live_server, greedy(7))
    assert sum(len(c.token_ids) for c in chunks) == 7
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    final = chunks[-1]
    assert final.HasField("usage") and final.usage.completion_tokens == 7 and final.usage.prompt_tokens > 0
    assert final.usage.cached_tokens <= final.usage.prompt_tokens
    assert len({c.request_id for c in chunks}) == 1
    # The same greedy chat over HTTP gives the same text: one frontend behind both APIs.
    http = http_chat(live_server, max_tokens=7, temperature=0.0, ignore_eos=True)
    assert "".join(c.text for c in chunks) == http["choices"][0]["message"]["content"]


def test_complete_from_token_ids_with_n2(live_server):
    ids = live_server.dispatcher.tokenizer.encode("Barnacles close at low tide")
    request = serving_pb2.CompleteRequest(model=live_server.model_id, prompt_token_ids=ids,
                                          sampling=serving_pb2.SamplingOptions(max_tokens=4, n=2, seed=3,
                                                                               ignore_eos=True))
    chunks = list(stub(live_server).Complete(request, timeout=120))
    assert {c.index: c.finish_reason for c in chunks if c.finish_reason} == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == len(ids)


def http_chat(server, **fields) -> dict:
    return httpx.post(f"{server.http_url}/v1/chat/completions", timeout=120, json={
        "model": server.model_id, "messages": [{"role": "user", "content": MESSAGES[0].content}], **fields}).json()


def test_logprobs_are_the_ones_http_reports(live_server):
    sampling = greedy(6)
    sampling.logprobs = 3
    chunks = chat(live_server, sampling)
    got = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in got] == [t for c in chunks for t in c.token_ids]  # one per token, in order
    content = http_chat(live_server, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3,
                        return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["content"]

    def token_id(name: str) -> int:
        return int(name.removeprefix("token_id:"))

    assert [lp.token_id for lp in got] == [token_id(e["token"]) for e in content]
    assert [lp.logprob for lp in got] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
    for lp, e in zip(got, content, strict=True):
        assert [t.token_id for t in lp.top] == [token_id(t["token"]) for t in e["top_logprobs"]]
        assert [t.logprob for t in lp.top] == pytest.approx([t["logprob"] for t in e["top_logprobs"]], abs=1e-4)
        assert lp.rank == 1  # greedy: the most likely token
    without = chat(live_server, greedy(2))
    assert not any(c.logprobs for c in without)


def test_prompt_logprobs_come_on_each_choices_first_chunk_as_http_reports_them(live_server):
    ids = live_server.dispatcher.tokenizer.encode("Hermit crabs trade up to larger shells")
    sampling = serving_pb2.SamplingOptions(max_tokens=3, n=2, seed=11, ignore_eos=True, prompt_logprobs=2)
    request = serving_pb2.CompleteRequest(model=live_server.model_id, prompt_token_ids=ids, sampling=sampling)
    chunks = list(stub(live_server).Complete(request, timeout=120))
    firsts = {}
    for c in chunks:
        if c.index in firsts:
            assert not c.prompt_logprobs  # once per choice
        else:
            firsts[c.index] = list(c.prompt_logprobs)
    assert sorted(firsts) == [0, 1] and firsts[0] == firsts[1]
    http = httpx.post(f"{live_server.http_url}/v1/completions", timeout=120, json={
        "model": live_server.model_id, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}).json()
    entries = http["choices"][0]["prompt_logprobs"][1:]  # vLLM's: null for the first token, nothing predicts it
    assert [lp.token_id for lp in firsts[0]] == ids[1:]
    for lp, entry in zip(firsts[0], entries, strict=True):
        assert lp.logprob == pytest.approx(entry[str(lp.token_id)]["logprob"], abs=1e-4)
        assert lp.rank == entry[str(lp.token_id)]["rank"]
        assert {t.token_id for t in lp.top} == {int(t) for t, e in entry.items() if e["rank"] <= 2}
        assert len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob
    bad = serving_pb2.SamplingOptions(max_tokens=1, prompt_logprobs=21)
    error = status_of(lambda: list(stub(live_server).Complete(serving_pb2.CompleteRequest(
        model=live_server.model_id, prompt="x", sampling=bad), timeout=60)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in error.details()


def test_penalties_sample_as_they_do_over_http(live_server):
    """Values exact in float32 (the proto's), so both APIs hand the sampler the same numbers."""
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.25)
    penalized = "".join(c.text for c in chat(live_server, serving_pb2.SamplingOptions(
        max_tokens=12, temperature=0.0, ignore_eos=True, **penalties)))
    http = http_chat(live_server, max_tokens=12, temperature=0.0, ignore_eos=True, **penalties)
    assert penalized == http["choices"][0]["message"]["content"]
    assert penalized != "".join(c.text for c in chat(live_server, greedy(12)))  # they changed the answer


def test_logit_bias_forces_a_token_and_stop_token_ids_end_the_choice(live_server):
    token = live_server.dispatcher.tokenizer.encode("z")[-1]
    forced = chat(live_server, serving_pb2.SamplingOptions(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                           logit_bias={token: 100.0}))
    assert [t for c in forced for t in c.token_ids] == [token] * 5
    stopped = chat(live_server, serving_pb2.SamplingOptions(max_tokens=5, temperature=0.0, logit_bias={token: 100.0},
                                                            stop_token_ids=[token]))
    assert [c.finish_reason for c in stopped if c.finish_reason] == ["stop"]
    assert stopped[-1].usage.completion_tokens == 1
    # min_tokens keeps the stop token out of the first three (one sampled by the prefill worker)
    held = chat(live_server, serving_pb2.SamplingOptions(max_tokens=5, temperature=0.0, logit_bias={token: 100.0},
                                                         stop_token_ids=[token], min_tokens=3))
    tokens = [t for c in held for t in c.token_ids]
    assert len(tokens) == 4 and token not in tokens[:3] and tokens[3] == token
    assert [c.finish_reason for c in held if c.finish_reason] == ["stop"]


def test_a_prediction_changes_no_token_and_its_usage_counts_it_as_over_http(live_server):
    letters = live_server.dispatcher.tokenizer.encode("abcdefghijklmnopqrstuvwxyz ", False)  # (text, not any bytes)
    sampling = serving_pb2.SamplingOptions(max_tokens=24, temperature=0.0, ignore_eos=True, allowed_token_ids=letters)
    plain = chat(live_server, sampling)
    answer = "".join(c.text for c in plain)
    assert not plain[-1].usage.HasField("accepted_prediction_tokens")  # no prediction, no counts
    prediction = answer[:12] + "\u00e9" + answer[12:]  # two bytes the answer does not hold, in the middle
    predicted = chat(live_server, sampling, prediction=prediction)
    assert "".join(c.text for c in predicted) == answer
    usage = predicted[-1].usage
    http = http_chat(live_server, max_tokens=24, temperature=0.0, ignore_eos=True, allowed_token_ids=letters,
                     prediction={"type": "content", "content": prediction})["usage"]["completion_tokens_details"]
    assert (usage.accepted_prediction_tokens, usage.rejected_prediction_tokens) == (
        http["accepted_prediction_tokens"], http["rejected_prediction_tokens"])
    assert usage.accepted_prediction_tokens > usage.rejected_prediction_tokens >= 1


def test_bad_words_are_never_completed(live_server):
    z = live_server.dispatcher.tokenizer.encode("z")[-1]
    chunks = chat(live_server, serving_pb2.SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                           logit_bias={z: 100.0}, bad_words=["zz"]))
    text = "".join(c.text for c in chunks)
    assert "zz" not in text and text[0::2] == "zz"


def test_allowed_token_ids_keep_a_choice_to_them(live_server):
    a = live_server.dispatcher.tokenizer.encode("a")[-1]
    chunks = chat(live_server, serving_pb2.SamplingOptions(max_tokens=4, temperature=1.0, ignore_eos=True,
                                                           allowed_token_ids=[a]))
    assert [t for c in chunks for t in c.token_ids] == [a] * 4


def test_special_tokens_and_stop_strings_keep_their_text_as_asked(live_server):
    tok = live_server.dispatcher.tokenizer
    user, z = tok.token_to_id("<|user|>"), tok.encode("z")[-1]

    def text(**fields) -> str:
        return "".join(c.text for c in chat(live_server, serving_pb2.SamplingOptions(max_tokens=3, temperature=0.0,
                                                                                     **fields)))

    assert text(ignore_eos=True, logit_bias={user: 100.0}) == ""
    assert text(ignore_eos=True, logit_bias={user: 100.0}, skip_special_tokens=False) == "<|user|>" * 3
    assert text(logit_bias={z: 100.0}, stop=["zz"]) == ""
    assert text(logit_bias={z: 100.0}, stop=["zz"], include_stop_str_in_output=True) == "zz"


def test_a_structured_output_keeps_the_answer_as_it_does_over_http(live_server):
    schema = {"type": "object", "properties": {"tide": {"enum": ["low", "high"]}}, "required": ["tide"],
              "additionalProperties": False}
    kept = serving_pb2.StructuredOutput(json_schema=json.dumps(schema), disable_any_whitespace=True)
    text = "".join(c.text for c in chat(live_server, serving_pb2.SamplingOptions(
        max_tokens=48, temperature=0.0, structured_output=kept)))
    http = http_chat(live_server, max_tokens=48, temperature=0.0,
                     structured_outputs={"json": schema, "disable_any_whitespace": True})
    assert text == http["choices"][0]["message"]["content"] and json.loads(text)["tide"] in ("low", "high")
    choices = ["crab", "limpet"]
    one = chat(live_server, serving_pb2.SamplingOptions(max_tokens=8, structured_output=serving_pb2.StructuredOutput(
        choice=serving_pb2.Choices(values=choices))))
    assert "".join(c.text for c in one) in choices
    for bad, fragment in [(serving_pb2.StructuredOutput(regex="[0-9"), "does not compile"),
                          (serving_pb2.StructuredOutput(), "set one of")]:
        err = status_of(lambda b=bad: chat(live_server, serving_pb2.SamplingOptions(max_tokens=2, structured_output=b)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs" in err.details()
        assert fragment in err.details()


def test_session_turn_two_reuses_cached_prefix(live_server):
    sid = f"grpc-{uuid.uuid4().hex}"
    chat(live_server, greedy(4), session_id=sid)
    second = list(stub(live_server).Chat(serving_pb2.ChatRequest(
        model=live_server.model_id, session_id=sid, sampling=greedy(4),
        messages=[serving_pb2.ChatMessage(role="user", content="Tell me more.")]), timeout=120))
    assert second[-1].usage.cached_tokens > 0


def test_health_reports_serving(live_server):
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(live_server.grpc_target))
    for service in ("", "tidepool.v1.Serving"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def _reflect(target: str, method: str, request: reflection_pb2.ServerReflectionRequest):
    call = grpc.insecure_channel(target).stream_stream(
        method, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    return list(call(iter([request]), timeout=10))


@pytest.mark.parametrize("version", ["v1alpha", "v1"])
def test_reflection_lists_and_describes_the_serving_service(live_server, version):
    method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    (listed,) = _reflect(live_server.grpc_target, method, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = [s.name for s in listed.list_services_response.service]
    assert {"tidepool.v1.Serving", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= set(names)
    (described,) = _reflect(live_server.grpc_target, method,
                            reflection_pb2.ServerReflectionRequest(file_containing_symbol="tidepool.v1.Serving"))
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    assert any(svc.name == "Serving" for f in files for svc in f.service)


def test_health_list_reports_every_service(live_server):
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(live_server.grpc_target))
    resp = health.List(health_pb2.HealthListRequest(), timeout=10)
    assert {name: s.status for name, s in resp.statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING, "tidepool.v1.Serving": health_pb2.HealthCheckResponse.SERVING}


def test_client_cancel_frees_the_blocks(live_server):
    assert wait_until(lambda: idle(live_server)), "the server never went idle"
    baseline = free_blocks(live_server)
    request = serving_pb2.ChatRequest(model=live_server.model_id, messages=MESSAGES, sampling=greedy(live_server.dispatcher.max_model_len // 2))
    call = stub(live_server).Chat(request, timeout=120)
    next(call), next(call)
    assert wait_until(lambda: free_blocks(live_server) < baseline), "the request never held blocks"
    call.cancel()
    assert wait_until(lambda: idle(live_server) and free_blocks(live_server) == baseline), \
        f"blocks not freed after cancel: {live_server.worker_stats()}, baseline {baseline}"


def test_invalid_field_is_invalid_argument_naming_it(live_server):
    err = status_of(lambda: chat(live_server, serving_pb2.SamplingOptions(max_tokens=2, top_p=1.5)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.details()
    err = status_of(lambda: chat(live_server, serving_pb2.SamplingOptions(max_tokens=2, min_p=-0.5)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_p" in err.details()


@pytest.mark.parametrize("role", ["wizard", "tool", ""])
def test_a_role_no_chat_template_renders_is_invalid_argument_and_leaves_the_session_alone(live_server, role):
    """HTTP's schema refuses these; over gRPC they once reached the chat template (and a session's history)."""
    sid = f"grpc-role-{uuid.uuid4().hex}"
    request = serving_pb2.ChatRequest(model=live_server.model_id, session_id=sid, sampling=greedy(2),
                                      messages=[serving_pb2.ChatMessage(role=role, content="hi")])
    err = status_of(lambda: list(stub(live_server).Chat(request, timeout=60)))
    # The chat schema's own words (a tool message: "tool calling is off on this server").
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("messages.0")
    # The refused turn stored nothing: the session's first turn is the prompt a session-less chat sends.
    in_session = chat(live_server, greedy(2), session_id=sid)[-1].usage.prompt_tokens
    assert in_session == chat(live_server, greedy(2))[-1].usage.prompt_tokens


def test_unknown_model_is_not_found(live_server):
    request = serving_pb2.ChatRequest(model="no-such-model", messages=MESSAGES, sampling=greedy(2))
    err = status_of(lambda: list(stub(live_server).Chat(request, timeout=60)))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_api_key_is_required_when_set(secured_server):
    assert status_of(lambda: chat(secured_server, greedy(2))).code() == grpc.StatusCode.UNAUTHENTICATED
    wrong = status_of(lambda: chat(secured_server, greedy(2), metadata=[("authorization", "Bearer nope")]))
    assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = chat(secured_server, greedy(2), metadata=[("authorization", f"Bearer {secured_server.api_key}")])
    assert ok[-1].usage.completion_tokens == 2


def test_router_rejection_is_resource_exhausted_with_retry_after(overloaded_server):
    err = status_of(lambda: chat(overloaded_server, greedy(4)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(err.trailing_metadata())["retry-after"]) >= 1


def test_no_live_worker_is_unavailable_and_not_serving(dead_server):
    assert status_of(lambda: chat(dead_server, greedy(4))).code() == grpc.StatusCode.UNAVAILABLE
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(dead_server.grpc_target))
    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


# ---- tool calling (the `tool_server`: hermes calls, qwen3 thinking) --------------------------------------------

def _grpc_tool(spec: dict) -> serving_pb2.Tool:
    function = spec["function"]
    return serving_pb2.Tool(name=function["name"], description=function.get("description", ""),
                            parameters=json.dumps(function["parameters"]), strict=bool(function.get("strict")))


def test_tools_calls_and_tool_answers_reach_the_prompt_as_http_renders_them(tool_server):
    call = CONVERSATION[1]["tool_calls"][0]
    messages = [serving_pb2.ChatMessage(role="user", content=CONVERSATION[0]["content"]),
                serving_pb2.ChatMessage(role="assistant", tool_calls=[serving_pb2.ToolCall(
                    id=call["id"], name=call["function"]["name"], arguments=call["function"]["arguments"])]),
                serving_pb2.ChatMessage(role="tool", tool_call_id=call["id"], content=CONVERSATION[2]["content"])]
    request = serving_pb2.ChatRequest(model=tool_server.model_id, messages=messages, sampling=greedy(1),
                                      tools=[_grpc_tool(TOOLS[0])])
    chunks = list(stub(tool_server).Chat(request, timeout=120))
    prompt = httpx.post(f"{tool_server.http_url}/tokenize", timeout=60,
                        json={"messages": CONVERSATION, "tools": TOOLS}).json()
    assert chunks[-1].usage.prompt_tokens == prompt["count"]


def test_a_forced_call_arrives_as_a_tool_call_and_a_second_structured_output_is_refused(tool_server):
    closed = [serving_pb2.ChatMessage(role="user", content="Which unit? <think></think>")]  # thinking closed
    request = serving_pb2.ChatRequest(model=tool_server.model_id, messages=closed, tools=[_grpc_tool(SET_UNIT)],
                                      sampling=serving_pb2.SamplingOptions(max_tokens=32, temperature=0.0),
                                      tool_choice=serving_pb2.ToolChoice(function="set_unit"))
    chunks = list(stub(tool_server).Chat(request, timeout=120))
    (call,) = [c for chunk in chunks for c in chunk.tool_calls]
    assert call.name == "set_unit" and json.loads(call.arguments) in ({"unit": "celsius"}, {"unit": "fahrenheit"})
    assert "".join(c.text for c in chunks) == "" and chunks[-1].finish_reason == "stop"  # a named call, as HTTP
    request.sampling.structured_output.regex = "[0-9]+"
    err = status_of(lambda: list(stub(tool_server).Chat(request, timeout=60)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "only one structured output" in err.details()


def test_tools_the_server_cannot_take_are_invalid_argument_naming_why(live_server, tool_server):
    tool = serving_pb2.Tool(name="f", parameters="{not json")
    request = serving_pb2.ChatRequest(model=tool_server.model_id, messages=MESSAGES, sampling=greedy(1), tools=[tool])
    err = status_of(lambda: list(stub(tool_server).Chat(request, timeout=60)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools.0.parameters: not valid JSON" in err.details()
    request.tools[0].parameters = ""
    request.model = live_server.model_id  # a server without --tool-call-parser
    err = status_of(lambda: list(stub(live_server).Chat(request, timeout=60)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tool-call-parser" in err.details()


@pytest.mark.timeout(10)
def test_a_chat_answer_becomes_chunks_of_thinking_text_and_calls_as_http_reads_it():
    answer = '<think>Crabs.</think>A crab.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'

    async def run() -> list[serving_pb2.GenerateChunk]:
        gen = Generation("chatcmpl-grpc", token_events([answer[i:i + 4] for i in range(0, len(answer), 4)]), 1)
        await gen.start()
        shape = ResponseShape(gen, "m", chat=True, logprobs=None, tool_calls=PARSERS["hermes"], reasoning="qwen3")
        chunks = []
        async for d in gen:
            chunks.append(serving_pb2.GenerateChunk(text=d.text, finish_reason=d.finish_reason or ""))
            fill_chunk(chunks[-1], shape.delta(d))
        return chunks

    chunks = asyncio.run(run())
    assert "".join(c.reasoning for c in chunks) == "Crabs." and "".join(c.text for c in chunks) == "A crab."
    (call,) = [c for chunk in chunks for c in chunk.tool_calls]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]
