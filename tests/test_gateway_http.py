"""The OpenAI-compatible HTTP API against a live `tidepool serve`, through the official `openai` client.

Fixtures (tests/conftest.py): `live_server` (the default server), `secured_server` (the same with an API
key), `overloaded_server` (a TTFT SLO no request can meet, so the router rejects everything) and
`dead_server` (every worker killed). Each has `.http_url`, `.grpc_target`, `.api_key`, `.model_id`,
`.max_body_bytes`, `.dispatcher` and `.worker_stats()`.
"""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest
from live_helpers import free_blocks, idle, last_sequence, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(240)]

CHAT = [{"role": "user", "content": "Tell me about tide pools and the creatures living in them."}]


def client(server, api_key: str | None = None) -> openai.OpenAI:
    # No retries: a 429 or 503 must reach the test, not be retried away.
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=api_key or server.api_key or "none",
                         max_retries=0, timeout=120)


def greedy(max_tokens: int = 8, **extra) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "extra_body": {"ignore_eos": True, **extra}}


# ---- chat and completions ----------------------------------------------------------------------------------

def test_chat_returns_text_and_usage_with_cached_tokens(live_server):
    resp = client(live_server).chat.completions.create(model=live_server.model_id, messages=CHAT, **greedy(8))
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == live_server.model_id
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    assert 0 <= resp.usage.prompt_tokens_details.cached_tokens <= resp.usage.prompt_tokens


def test_chat_stream_joins_to_the_same_text_and_ends_with_usage(live_server):
    c = client(live_server)
    full = c.chat.completions.create(model=live_server.model_id, messages=CHAT, **greedy(10))
    chunks = list(c.chat.completions.create(model=live_server.model_id, messages=CHAT, stream=True,
                                            stream_options={"include_usage": True}, **greedy(10)))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(live_server, endpoint):
    # GuideLLM's streaming request: continuous usage, no stop, ignore_eos
    c = client(live_server)
    kwargs = dict(model=live_server.model_id, max_tokens=6, stream=True, stop=None, extra_body={"ignore_eos": True},
                  stream_options={"include_usage": True, "continuous_usage_stats": True})
    create = c.chat.completions.create if endpoint == "chat" else c.completions.create
    chunks = list(create(**kwargs, **({"messages": CHAT} if endpoint == "chat" else {"prompt": "Sea slugs"})))
    assert all(ch.usage is not None for ch in chunks)
    completion = [ch.usage.completion_tokens for ch in chunks]
    assert completion == sorted(completion) and completion[-1] == 6 and chunks[-1].choices == []
    prompt = chunks[-1].usage.prompt_tokens
    assert {ch.usage.prompt_tokens for ch in chunks} == {prompt}  # known from the first chunk on
    assert all(ch.usage.total_tokens == prompt + ch.usage.completion_tokens for ch in chunks)


def test_max_completion_tokens_limits_the_reply(live_server):
    resp = client(live_server).chat.completions.create(model=live_server.model_id, messages=CHAT,
                                                       max_completion_tokens=3, temperature=0.0,
                                                       extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


def test_completion_from_text_and_from_token_ids_agree(live_server):
    c = client(live_server)
    prompt = "The tide pool at dawn"
    ids = live_server.dispatcher.tokenizer.encode(prompt)
    from_text = c.completions.create(model=live_server.model_id, prompt=prompt, **greedy(6))
    from_ids = c.completions.create(model=live_server.model_id, prompt=ids, **greedy(6))
    assert from_text.object == "text_completion"
    assert from_text.choices[0].text == from_ids.choices[0].text
    assert from_text.usage.prompt_tokens == from_ids.usage.prompt_tokens == len(ids)
    assert from_text.usage.completion_tokens == 6


def test_completion_stream_joins_to_the_same_text(live_server):
    c = client(live_server)
    prompt = "Anemones and sea stars"
    full = c.completions.create(model=live_server.model_id, prompt=prompt, **greedy(8))
    chunks = list(c.completions.create(model=live_server.model_id, prompt=prompt, stream=True, **greedy(8)))
    assert "".join(ch.choices[0].text for ch in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_gives_two_choices_streamed_and_not(live_server):
    c = client(live_server)
    kwargs = {"model": live_server.model_id, "messages": CHAT, "n": 2, "max_tokens": 5, "temperature": 1.0,
              "seed": 7, "extra_body": {"ignore_eos": True}}
    resp = c.chat.completions.create(**kwargs)
    assert sorted(ch.index for ch in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == 10
    finished = {ch.choices[0].index: ch.choices[0].finish_reason
                for ch in c.chat.completions.create(stream=True, **kwargs) if ch.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_stop_string_ends_the_choice_and_is_not_returned(live_server):
    c = client(live_server)
    prompt = "Hermit crabs trade shells"
    text = c.completions.create(model=live_server.model_id, prompt=prompt, **greedy(24)).choices[0].text
    visible = [i for i, ch in enumerate(text) if ch.isprintable() and ch != "\ufffd"]
    assert len(visible) >= 2, f"greedy output too short to pick a stop string from: {text!r}"
    stop = text[visible[len(visible) // 2]]
    for stream in (False, True):
        resp = c.completions.create(model=live_server.model_id, prompt=prompt, stop=[stop], stream=stream,
                                    **greedy(24))
        chunks = list(resp) if stream else [resp]
        got = "".join(ch.choices[0].text for ch in chunks)
        assert got == text[:text.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


# ---- sessions ------------------------------------------------------------------------------------------------

def test_two_turn_session_reuses_the_prefix_and_continues_the_first_turns_tokens(live_server):
    """Turn 2's prompt is turn 1's prompt and answer as token ids (the answer was random bytes: its text,
    encoded again, would be other tokens), then the rest of the history through the template."""
    c = client(live_server)
    sid = f"s-{uuid.uuid4().hex}"
    first = [{"role": "user", "content": "Describe the intertidal zone in one sentence, please."}]
    second = [{"role": "user", "content": "And what lives there?"}]
    c.chat.completions.create(model=live_server.model_id, messages=first, extra_headers={"X-Session-Id": sid},
                              **greedy(6))
    turn1 = last_sequence(live_server, sid)
    turn2 = c.chat.completions.create(model=live_server.model_id, messages=second,
                                      extra_headers={"X-Session-Id": sid}, **greedy(6))
    assert turn2.usage.prompt_tokens_details.cached_tokens > 0
    prompt2 = last_sequence(live_server, sid)
    assert prompt2.ids[:len(turn1.ids)] == turn1.ids and len(turn1.ids) == turn1.prompt_len + 6
    assert prompt2.prompt_len == turn2.usage.prompt_tokens
    stateless = c.completions.create(model=live_server.model_id, prompt=prompt2.ids[:prompt2.prompt_len],
                                     **greedy(6))
    assert turn2.choices[0].message.content == stateless.choices[0].text




def test_session_id_in_the_body_and_delete(live_server):
    c = client(live_server)
    sid = f"s-{uuid.uuid4().hex}"
    c.chat.completions.create(model=live_server.model_id, messages=CHAT, **greedy(3, session_id=sid))
    deleted = httpx.delete(f"{live_server.http_url}/v1/sessions/{sid}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    again = httpx.delete(f"{live_server.http_url}/v1/sessions/{sid}")
    assert again.status_code == 404 and again.json()["error"]["code"] == "session_not_found"


# ---- disconnect ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("server_name", ["live_server", "secured_server"])
def test_client_disconnect_mid_stream_aborts_the_request_and_frees_the_blocks(server_name, request):
    """Disaggregated (live_server) and colocated (secured_server, where only the stream's own stop reaches the
    worker): the request ends when its client leaves, not at max_tokens."""
    live_server = request.getfixturevalue(server_name)
    assert wait_until(lambda: idle(live_server)), "the server never went idle"
    baseline = free_blocks(live_server)
    steps = lambda: sum(load.steps for load in live_server.dispatcher.loads.values())  # noqa: E731
    steps_before, max_tokens = steps(), live_server.dispatcher.max_model_len - 64
    stream = client(live_server).chat.completions.create(model=live_server.model_id, messages=CHAT, stream=True,
                                                         max_tokens=max_tokens, temperature=0.0,
                                                         extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it), next(it)
    assert wait_until(lambda: free_blocks(live_server) < baseline), "the request never held blocks"
    stream.close()
    assert wait_until(lambda: idle(live_server) and free_blocks(live_server) == baseline), \
        f"blocks not freed after disconnect: {live_server.worker_stats()}, baseline {baseline}"
    # Aborted, not run to its end: an answer of max_tokens takes at least max_tokens / (1 + drafts) steps (a
    # decode step verifies up to that many drafts); the disconnect is noticed well before half of them.
    drafts = max(w.info.num_speculative_tokens for w in live_server.dispatcher.workers.values())
    assert steps() - steps_before < max_tokens // (1 + drafts) // 2, "the request ran on after its client left"


@pytest.mark.timeout(120)
def test_client_disconnect_from_a_non_streamed_request_aborts_it(live_server):
    assert wait_until(lambda: idle(live_server)), "the server never went idle"
    baseline = free_blocks(live_server)
    session = f"leaver-{uuid.uuid4().hex}"
    body = {"model": live_server.model_id, "messages": CHAT, "temperature": 0.0, "ignore_eos": True,
            "max_tokens": live_server.dispatcher.max_model_len - 64}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the answer is being generated
        httpx.post(f"{live_server.http_url}/v1/chat/completions", json=body, headers={"X-Session-Id": session},
                   timeout=httpx.Timeout(60, read=0.3))
    assert wait_until(lambda: idle(live_server) and free_blocks(live_server) == baseline), \
        f"blocks not freed after disconnect: {live_server.worker_stats()}, baseline {baseline}"
    # A turn that completed would be in the session's history; an aborted one never is.
    assert httpx.delete(f"{live_server.http_url}/v1/sessions/{session}").status_code == 404


# ---- models, health, metrics, schema ---------------------------------------------------------------------------

def test_models_lists_the_served_model_created_when_the_gateway_began_serving_it(live_server):
    c = client(live_server)
    listed = c.models.list().data
    assert [m.id for m in listed] == [live_server.model_id]
    card = c.models.retrieve(live_server.model_id)
    assert card.id == live_server.model_id and card.owned_by == "tidepool"
    assert 0 < card.created == listed[0].created <= time.time()


def test_health_is_ok_with_live_workers(live_server):
    resp = httpx.get(f"{live_server.http_url}/health")
    assert resp.status_code == 200 and resp.json()["workers"] >= 1


def test_metrics_are_prometheus_text_with_the_serving_series(live_server):
    client(live_server).chat.completions.create(model=live_server.model_id, messages=CHAT, **greedy(4))
    resp = httpx.get(f"{live_server.http_url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    for series in ("tidepool_time_to_first_token_seconds_count", "tidepool_request_time_per_output_token_seconds_count",
                   "tidepool_worker_kv_blocks_used", "tidepool_prefix_cache_hits_total",
                   'api="/v1/chat/completions"'):
        assert series in resp.text, series


def test_openapi_schema_documents_the_api(live_server):
    schema = httpx.get(f"{live_server.http_url}/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/v1/sessions/{session_id}"):
        assert path in schema["paths"], path
    assert "ChatCompletionRequest" in schema["components"]["schemas"]


# ---- errors --------------------------------------------------------------------------------------------------

def test_invalid_field_is_400_naming_the_field(live_server):
    c = client(live_server)
    with pytest.raises(openai.BadRequestError) as bad_value:
        c.chat.completions.create(model=live_server.model_id, messages=CHAT, temperature=-1.0, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad_type:
        c.chat.completions.create(model=live_server.model_id, messages=CHAT, max_tokens="many")
    for exc, field in ((bad_value.value, "temperature"), (bad_type.value, "max_tokens")):
        assert exc.param == field and field in exc.message
        assert exc.type == "invalid_request_error"


def test_malformed_json_is_400(live_server):
    resp = httpx.post(f"{live_server.http_url}/v1/chat/completions", content=b"{not json",
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert resp.json()["error"]["param"] is None and "not valid JSON" in resp.json()["error"]["message"]


def test_unknown_model_is_404(live_server):
    with pytest.raises(openai.NotFoundError) as exc:
        client(live_server).chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert exc.value.code == "model_not_found"


def test_prompt_over_the_context_is_413(live_server):
    too_long = [1] * (live_server.dispatcher.max_model_len + 1)
    with pytest.raises(openai.APIStatusError) as exc:
        client(live_server).completions.create(model=live_server.model_id, prompt=too_long, max_tokens=1)
    assert exc.value.status_code == 413


def test_body_over_the_limit_is_413(live_server):
    body = b'{"model": "x", "prompt": "' + b"a" * (live_server.max_body_bytes + 1) + b'"}'
    resp = httpx.post(f"{live_server.http_url}/v1/completions", content=body,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_a_page_on_an_allowed_origin_may_call_the_api_and_others_get_no_cors_headers(secured_server, live_server):
    """A browser's preflight (no API key) is answered for the allowed origin; the answer to the call itself
    names it; another origin, or a server without --allowed-origins, gets no CORS header."""
    url = f"{secured_server.http_url}/v1/chat/completions"
    ui = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
          "Access-Control-Request-Headers": "authorization, content-type"}
    preflight = httpx.options(url, headers=ui, timeout=10)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://ui.example"
    models = httpx.get(f"{secured_server.http_url}/v1/models", timeout=10, headers={
        "Origin": "https://ui.example", "Authorization": f"Bearer {secured_server.api_key}"})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "https://ui.example"
    other = httpx.options(url, headers={**ui, "Origin": "https://evil.example"}, timeout=10)
    assert "access-control-allow-origin" not in other.headers
    plain = httpx.get(f"{live_server.http_url}/v1/models", headers={"Origin": "https://ui.example"}, timeout=10)
    assert "access-control-allow-origin" not in plain.headers


def test_api_key_is_required_when_set(secured_server):
    wrong = client(secured_server, api_key="wrong-key")
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=secured_server.model_id, messages=CHAT, max_tokens=2)
    no_key = httpx.get(f"{secured_server.http_url}/v1/models")
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    ok = client(secured_server).chat.completions.create(model=secured_server.model_id, messages=CHAT,
                                                        **greedy(2))
    assert ok.usage.completion_tokens == 2


def test_router_rejection_is_429_with_retry_after(overloaded_server):
    with pytest.raises(openai.RateLimitError) as exc:
        client(overloaded_server).chat.completions.create(model=overloaded_server.model_id, messages=CHAT,
                                                          max_tokens=4)
    assert int(exc.value.response.headers["retry-after"]) >= 1
    assert exc.value.code == "overloaded"


def test_no_live_worker_is_503(dead_server):
    with pytest.raises(openai.InternalServerError) as exc:
        client(dead_server).chat.completions.create(model=dead_server.model_id, messages=CHAT, max_tokens=4)
    assert exc.value.status_code == 503
    assert httpx.get(f"{dead_server.http_url}/health").status_code == 503
