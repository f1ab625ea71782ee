"""``/v1/embeddings`` and the gRPC ``Embed`` as clients call them: on the disaggregated server each input is
routed alone to a prefill worker and its vector is the engine's on the same checkpoint (the official client's
base64 default, JSON floats, Matryoshka dimensions); a repeated input finds its prefix cached, and an input's
blocks go to the pool; bad requests
are 400s (INVALID_ARGUMENT) naming the field; and a checkpoint of the base model alone, whose LM head it lacks,
serves embeddings and refuses generation."""

from __future__ import annotations

import shutil

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
import transformers
from live_helpers import wait_until
from test_gateway_grpc import status_of, stub
from test_kv_sharing import _pooled_blocks
from test_openai_features import client

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from tidepool.v1 import serving_pb2

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(120)]

TEXTS = ["Tide pools hold anemones, sculpins and hermit crabs between the waves.", "Kelp"]


@pytest.fixture(scope="module")
def reference(serving_model_dir) -> Engine:
    """The served checkpoint in an engine of this process: the vectors the cluster must return."""
    return Engine(EngineConfig(model=str(serving_model_dir), num_blocks=64))


def _expected(engine: Engine, prompt: list[int], dimensions: int | None = None) -> list[float]:
    engine.add_embedding_request("ref", prompt, dimensions)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs[0].embedding


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.http_url}/v1/embeddings", json=body, timeout=60)


def test_each_input_gets_the_engines_vector_in_order_through_the_official_client(live_server, reference):
    token_lists = [[5, 80, 81, 82, 9], [200, 2]]
    for inputs, prompts in ((TEXTS, [reference.tokenizer.encode(text, True) for text in TEXTS]),
                            (token_lists, token_lists)):
        resp = client(live_server).embeddings.create(model=live_server.model_id, input=inputs)  # base64 on the wire
        assert [d.index for d in resp.data] == [0, 1]
        for data, prompt in zip(resp.data, prompts, strict=True):
            np.testing.assert_allclose(data.embedding, _expected(reference, prompt), atol=1e-5)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(p) for p in prompts)
        assert resp.model == live_server.model_id


def test_float_format_and_dimensions_over_plain_json(live_server, reference):
    body = post(live_server, {"model": live_server.model_id, "input": TEXTS[0], "encoding_format": "float",
                              "dimensions": 8}).json()
    (data,) = body["data"]
    assert body["object"] == "list" and data["object"] == "embedding" and len(data["embedding"]) == 8
    expected = _expected(reference, reference.tokenizer.encode(TEXTS[0], True), dimensions=8)
    np.testing.assert_allclose(data["embedding"], expected, atol=1e-5)
    assert np.linalg.norm(data["embedding"]) == pytest.approx(1.0, abs=1e-5)


def test_grpc_embed_returns_the_same_vectors_and_a_repeated_input_finds_its_prefix_cached(live_server):
    long_text = TEXTS[0] * 3  # several blocks
    request = serving_pb2.EmbedRequest(model=live_server.model_id, inputs=[serving_pb2.EmbedInput(text=long_text)])
    first = stub(live_server).Embed(request, timeout=60)
    again = stub(live_server).Embed(request, timeout=60)
    http = client(live_server).embeddings.create(model=live_server.model_id, input=long_text)
    assert first.usage.cached_tokens == 0 or first.usage.cached_tokens < again.usage.cached_tokens
    assert again.usage.cached_tokens >= first.usage.prompt_tokens - 16  # all but the last block's tokens
    np.testing.assert_allclose(again.embeddings[0].values, first.embeddings[0].values, atol=1e-5)
    np.testing.assert_allclose(http.data[0].embedding, first.embeddings[0].values, atol=1e-5)


def test_an_inputs_blocks_go_to_the_pool_as_a_prompts_do(live_server):
    ids = [(7 * i) % 250 + 3 for i in range(70)]  # four full blocks of 16
    client(live_server).embeddings.create(model=live_server.model_id, input=[ids])
    assert wait_until(lambda: _pooled_blocks(live_server, ids) == 4, 30)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 4096}, "dimensions"),
    ({"input": [[]]}, "input"),
    ({"input": [[1, 10**6]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, None),
    ({"input": "x", "truncate": True}, "truncate"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(live_server, body, param):
    resp = post(live_server, {"model": live_server.model_id, **body})
    assert resp.status_code == 400, resp.text
    if param is not None:
        assert resp.json()["error"]["param"] == param


def test_an_input_longer_than_the_context_and_an_unknown_model_are_refused(live_server):
    too_long = post(live_server, {"model": live_server.model_id, "input": [[7] * 5000]})
    assert too_long.status_code == 413 and "5000 tokens" in too_long.json()["error"]["message"]  # as for prompts
    assert post(live_server, {"model": "nope", "input": "x"}).status_code == 404
    error = status_of(lambda: stub(live_server).Embed(serving_pb2.EmbedRequest(
        model=live_server.model_id, inputs=[serving_pb2.EmbedInput(text="x")], dimensions=100000), timeout=60))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "dimensions" in error.details()


@pytest.fixture(scope="module")
def embedding_only_server(start_server, serving_model_dir, tmp_path_factory):
    """One colocated worker serving a Qwen3 body saved alone, untied from its LM head (as Qwen3-Embedding-4B and
    8B ship), with the service tests' tokenizer."""
    vocab = ModelConfig.from_dir(serving_model_dir).vocab_size
    torch.manual_seed(3)
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=2048, tie_word_embeddings=False)
    model = tmp_path_factory.mktemp("embedding-model") / "qwen3-embedding"
    transformers.Qwen3Model(config).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (serving_model_dir / name).exists():
            shutil.copy(serving_model_dir / name, model / name)
    server = start_server(colocated=1, model_dir=model)
    server.reference = transformers.Qwen3Model.from_pretrained(model).eval()
    yield server
    server.stop()


def test_a_base_checkpoint_without_its_lm_head_serves_embeddings_and_refuses_generation(embedding_only_server):
    server = embedding_only_server
    resp = client(server).embeddings.create(model=server.model_id, input=[[5, 6, 7, 8]])
    with torch.no_grad():
        hidden = server.reference(input_ids=torch.tensor([[5, 6, 7, 8]])).last_hidden_state[0, -1]
    np.testing.assert_allclose(resp.data[0].embedding, torch.nn.functional.normalize(hidden, dim=0), atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="it serves /v1/embeddings only"):
        client(server).chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "hi"}])
