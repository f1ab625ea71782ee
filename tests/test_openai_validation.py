"""What the live server refuses, and how: every field is implemented or refused with a 400 naming it (no-op
defaults are accepted), malformed JSON and out-of-range values are 400s, oversized prompt text is refused
before tokenizing, and gRPC answers the same mistakes with INVALID_ARGUMENT."""

from __future__ import annotations

import concurrent.futures

import grpc
import httpx
import openai
import pytest

from tidepool.v1 import serving_pb2, serving_pb2_grpc

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(120)]

CHAT = [{"role": "user", "content": "What do anemones eat?"}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0, timeout=60)


def post(server, path: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{server.http_url}{path}", content=content, headers={"Content-Type": "application/json"},
                      timeout=60)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"extra_body": {"reasoning_effort": "high"}}, "reasoning_effort"),
    ({"extra_body": {"typical_p": 0.9}}, "typical_p"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
])
def test_unsupported_chat_fields_are_400_naming_the_field(live_server, fields, param):
    kwargs = {"model": live_server.model_id, "messages": CHAT, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as exc:
        client(live_server).chat.completions.create(**kwargs)
    assert exc.value.param == param, exc.value.message
    assert exc.value.type == "invalid_request_error"


@pytest.mark.parametrize("fields, param", [
    ({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
])
def test_unsupported_completion_fields_are_400_naming_the_field(live_server, fields, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client(live_server).completions.create(model=live_server.model_id, prompt="Crabs", max_tokens=2, **fields)
    assert exc.value.param == param, exc.value.message


def test_no_op_values_and_identifying_fields_are_accepted(live_server):
    resp = client(live_server).chat.completions.create(
        model=live_server.model_id, messages=CHAT, max_tokens=2, response_format={"type": "text"},
        tool_choice="none", tools=[], store=False, service_tier="auto", user="u-1", metadata={"k": "v"},
        parallel_tool_calls=True, extra_body={"safety_identifier": "s", "prompt_cache_key": "p", "top_k": None})
    assert resp.usage.completion_tokens >= 1
    # A replayed assistant message carries its null fields.
    replay = [*CHAT, {"role": "assistant", "content": "Plankton.", "refusal": None, "tool_calls": None,
                      "function_call": None, "audio": None, "annotations": []}, *CHAT]
    assert client(live_server).chat.completions.create(model=live_server.model_id, messages=replay,
                                                       max_tokens=1).usage.completion_tokens == 1


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 5}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 17}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"extra_body": {"stop_token_ids": [999999]}}, "stop_token_ids"),
    ({"extra_body": {"priority": 2**31}}, "priority"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
])
def test_values_out_of_range_are_400_naming_the_field(live_server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client(live_server).chat.completions.create(model=live_server.model_id, messages=CHAT, max_tokens=2,
                                                    **kwargs)
    assert exc.value.param == param, exc.value.message


@pytest.mark.parametrize("body, says", [
    (b'{"model": "m", "messages": [}', "not valid JSON"),
    (b'{"model": "m", "temperature": NaN, "messages": []}', "NaN"),
    (b'{"model": "m", "temperature": -Infinity, "messages": []}', "Infinity"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
    (b'\xff\xfe not utf-8', "UTF-8"),
])
def test_malformed_json_is_400_about_the_json_not_a_field(live_server, body, says):
    resp = post(live_server, "/v1/chat/completions", body)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] is None and error["type"] == "invalid_request_error"
    assert says in error["message"]


def test_an_overflowing_number_is_refused_as_out_of_range(live_server):
    body = b'{"model": "%s", "temperature": 1e999, "messages": [{"role": "user", "content": "hi"}]}'
    resp = post(live_server, "/v1/chat/completions", body % live_server.model_id.encode())
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"


def test_a_paired_surrogate_escape_is_text(live_server):
    body = b'{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "\\ud83e\\udd80"}]}'
    assert post(live_server, "/v1/chat/completions", body % live_server.model_id.encode()).status_code == 200


def test_huge_prompts_are_refused_unread_while_health_answers(live_server):
    big = "crab " * ((7 << 20) // 5)  # about 7 MiB of text: far more characters than 2047 tokens can hold
    assert len(big) > live_server.dispatcher.max_model_len * 64
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        posts = [pool.submit(httpx.post, f"{live_server.http_url}/v1/completions", timeout=60,
                             json={"model": live_server.model_id, "prompt": big, "max_tokens": 1})
                 for _ in range(3)]
        health = [httpx.get(f"{live_server.http_url}/health", timeout=30).status_code for _ in range(5)]
        answers = [p.result() for p in posts]
    assert health == [200] * 5
    for resp in answers:
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "context_length_exceeded"
        assert "characters" in resp.json()["error"]["message"]


# ---- gRPC ---------------------------------------------------------------------------------------------------

def test_a_priority_is_taken_on_either_api_and_changes_no_answer(live_server):
    def http(**extra) -> str:
        return client(live_server).chat.completions.create(
            model=live_server.model_id, messages=CHAT, max_tokens=4, temperature=0.0, extra_body=extra
        ).choices[0].message.content

    request = serving_pb2.ChatRequest(model=live_server.model_id, messages=[serving_pb2.ChatMessage(**CHAT[0])],
                                      sampling=serving_pb2.SamplingOptions(max_tokens=4, temperature=0.0, priority=-3))
    with grpc.insecure_channel(live_server.grpc_target) as channel:
        chunks = list(serving_pb2_grpc.ServingStub(channel).Chat(request, timeout=60))
    assert http(priority=-5) == http() == "".join(c.text for c in chunks)


def grpc_status(server, call) -> grpc.RpcError:
    """The status a call ends with; ``call(channel)`` makes it."""
    with grpc.insecure_channel(server.grpc_target) as channel, pytest.raises(grpc.RpcError) as exc:
        list(call(channel))
    return exc.value


@pytest.mark.parametrize("sampling, says", [
    (serving_pb2.SamplingOptions(max_tokens=2, n=2**32 - 1), "n"),
    (serving_pb2.SamplingOptions(max_tokens=2, temperature=float("nan")), "temperature"),
    (serving_pb2.SamplingOptions(max_tokens=2, temperature=3.0), "temperature"),
    (serving_pb2.SamplingOptions(max_tokens=2, logprobs=21), "logprobs"),
    (serving_pb2.SamplingOptions(max_tokens=2, presence_penalty=2.5), "presence_penalty"),
    (serving_pb2.SamplingOptions(max_tokens=2, frequency_penalty=float("-inf")), "frequency_penalty"),
    (serving_pb2.SamplingOptions(max_tokens=2, repetition_penalty=0.0), "repetition_penalty"),
    (serving_pb2.SamplingOptions(max_tokens=2, logit_bias={1: 101.0}), "logit_bias"),
    (serving_pb2.SamplingOptions(max_tokens=2, logit_bias={10**6: 1.0}), "logit_bias"),
])
def test_grpc_bad_values_are_invalid_argument(live_server, sampling, says):
    request = serving_pb2.ChatRequest(model=live_server.model_id, sampling=sampling,
                                      messages=[serving_pb2.ChatMessage(role="user", content="hi")])
    err = grpc_status(live_server, lambda channel: serving_pb2_grpc.ServingStub(channel).Chat(request, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(says)


@pytest.mark.parametrize("method", ["Chat", "Complete"])
def test_grpc_malformed_protobuf_is_invalid_argument(live_server, method):
    bad = b"\x0a\xff\xff\xff"  # field 1, a length past the end of the bytes
    err = grpc_status(live_server,
                      lambda channel: channel.unary_stream(f"/tidepool.v1.Serving/{method}")(bad, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid tidepool.v1." in err.details()
