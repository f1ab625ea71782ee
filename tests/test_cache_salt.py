"""A request's ``cache_salt`` (vLLM's): only requests that send the same salt share cached prompt blocks. In the
engine's prefix cache, and through the live cluster (the prefill worker's cache, the KV pool, the router's
mirror of it), over HTTP and gRPC alike; a bad salt is a 400 (chat, completions, responses) or an
INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import uuid

import grpc
import httpx
import openai
import pytest
from live_helpers import wait_until
from test_engine_model import BLOCK, build_hf_checkpoint, prompts
from test_kv_sharing import LONG_PROMPT

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from kvstore.hashing import block_hashes, salt_for
from kvstore.pool import POOL_HOLDER, KVPool
from tidepool.v1 import serving_pb2, serving_pb2_grpc


def test_a_cache_salt_gives_a_prompt_blocks_of_its_own():
    assert len({salt_for("m"), salt_for("m", cache_salt="x"), salt_for("m", cache_salt="y"),
                salt_for("m", "adapter", cache_salt="x"), salt_for("m", long_rope=True, cache_salt="x")}) == 5


@pytest.mark.timeout(120)
def test_the_engine_shares_cached_blocks_only_between_requests_with_the_same_salt(tmp_path):
    build_hf_checkpoint(tmp_path, "llama")
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64))
    (prompt,) = prompts((40,))  # 2 full blocks of 16 can be reused (never the one with the last token)

    def cached_tokens(request_id: str, salt: str | None) -> int:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=2, temperature=0.0, cache_salt=salt))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        return next(o.num_cached_tokens for o in outputs if o.request_id == request_id)

    assert cached_tokens("tenant-a", "a" * 43) == 0
    assert [cached_tokens(f"other-{i}", salt) for i, salt in enumerate(["b" * 43, None])] == [0, 0]
    assert cached_tokens("tenant-a-again", "a" * 43) == 2 * BLOCK
    assert cached_tokens("unsalted-again", None) == 2 * BLOCK


def _pooled_blocks(server, ids: list[int], salt: str) -> int:
    """Leading blocks of ``ids``, hashed under ``salt``, that the pool's Redis tier holds."""
    model, size = server.dispatcher.model_id, server.dispatcher.block_size
    pool = KVPool(server.server.cluster.redis_url, model, size)
    try:
        return pool.longest_prefix(block_hashes(ids, size, salt_for(model, cache_salt=salt))).get(POOL_HOLDER, 0)
    finally:
        pool.close()


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(240)
def test_a_salted_prompt_is_cached_for_its_salt_only_across_the_cluster_and_both_apis(live_server):
    """Once tenant A's prompt and answer are in the pool under A's salt (the prompt's blocks from the prefill
    worker, the answer's from the decode worker), tenant B (another salt) and an unsalted request compute the
    prompt whole; A's next request, over HTTP or gRPC, finds it cached."""
    client = openai.OpenAI(base_url=f"{live_server.http_url}/v1", api_key="none", max_retries=0)
    a, b = (uuid.uuid4().hex * 2 for _ in range(2))
    prompt = live_server.dispatcher.tokenizer.encode(LONG_PROMPT)

    def complete(salt: str | None, max_tokens: int = 2) -> tuple[int, list[int]]:
        """(cached prompt tokens, the answer's token ids)"""
        extra = {"return_tokens_as_token_ids": True, "ignore_eos": True} | ({} if salt is None else {"cache_salt": salt})
        response = client.completions.create(model=live_server.model_id, prompt=LONG_PROMPT, max_tokens=max_tokens,
                                             temperature=0.0, logprobs=0, extra_body=extra)
        assert response.usage.prompt_tokens == len(prompt)
        answer = [int(token.removeprefix("token_id:")) for token in response.choices[0].logprobs.tokens]
        return response.usage.prompt_tokens_details.cached_tokens, answer

    first, answer = complete(a, max_tokens=20)  # at least one block past the prompt's last
    assert first == 0
    sequence = [*prompt, *answer]  # its last token's K/V is never computed
    full = (len(sequence) - 1) // live_server.dispatcher.block_size
    assert wait_until(lambda: _pooled_blocks(live_server, sequence, a) == full, 30)
    assert [complete(b)[0], complete(None)[0]] == [0, 0]
    assert complete(a)[0] >= 0.95 * len(prompt)
    grpc_request = serving_pb2.CompleteRequest(
        model=live_server.model_id, prompt=LONG_PROMPT,
        sampling=serving_pb2.SamplingOptions(max_tokens=2, temperature=0.0, cache_salt=a))
    chunks = list(serving_pb2_grpc.ServingStub(grpc.insecure_channel(live_server.grpc_target)).Complete(
        grpc_request, timeout=120))
    assert chunks[-1].usage.cached_tokens >= 0.95 * len(prompt)


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
@pytest.mark.parametrize("salt", ["", 7])
def test_an_empty_or_non_string_salt_is_a_400_naming_it(live_server, salt):
    body = {"model": live_server.model_id, "prompt": "tide", "max_tokens": 1, "cache_salt": salt}
    response = httpx.post(f"{live_server.http_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text
    chat = {"model": live_server.model_id, "messages": [{"role": "user", "content": "tide"}], "max_tokens": 1,
            "cache_salt": salt}
    response = httpx.post(f"{live_server.http_url}/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text
    responses = {"model": live_server.model_id, "input": "tide", "max_output_tokens": 1, "cache_salt": salt}
    response = httpx.post(f"{live_server.http_url}/v1/responses", json=responses, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_an_empty_salt_over_grpc_is_invalid_argument_naming_it(live_server):
    request = serving_pb2.CompleteRequest(model=live_server.model_id, prompt="tide",
                                          sampling=serving_pb2.SamplingOptions(max_tokens=1, cache_salt=""))
    with pytest.raises(grpc.RpcError) as exc:
        list(serving_pb2_grpc.ServingStub(grpc.insecure_channel(live_server.grpc_target)).Complete(request,
                                                                                                 timeout=60))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in exc.value.details()


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(240)
def test_a_sessions_next_turn_finds_its_history_cached_under_the_same_salt_only(live_server):
    """A chat session keeps its turns as token ids; the next turn, sent with the session's salt, finds the
    first turn's prompt cached, and one sent with another salt finds nothing."""
    url, salt = f"{live_server.http_url}/v1/chat/completions", uuid.uuid4().hex * 2

    def turn(sid: str, text: str, cache_salt: str, system: bool) -> dict:
        messages = ([{"role": "system", "content": LONG_PROMPT}] if system else []) + [{"role": "user", "content": text}]
        body = {"model": live_server.model_id, "messages": messages, "max_tokens": 4, "temperature": 0.0,
                "session_id": sid, "cache_salt": cache_salt}
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    for sid, second_salt in ((f"salted-{uuid.uuid4().hex}", salt), (f"resalted-{uuid.uuid4().hex}", salt[::-1])):
        first = turn(sid, "first", salt, system=True)
        second = turn(sid, "second", second_salt, system=False)
        cached = second["prompt_tokens_details"]["cached_tokens"]
        if second_salt == salt:  # at least every full block of the first turn's prompt
            assert first["prompt_tokens_details"]["cached_tokens"] == 0
            block = live_server.dispatcher.block_size
            assert cached >= (first["prompt_tokens"] - 1) // block * block
        else:
            assert cached == 0
