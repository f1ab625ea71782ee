"""A model's sampling defaults (generation_config.json, ``--generation-config``; engine/generation_defaults.py):
read as vLLM reads them, under what a request sets, on the HTTP (chat, completions, Responses) and gRPC APIs
of a live server whose checkpoint asks for greedy answers of at most a few tokens; and min_p through the API."""

from __future__ import annotations

import json
import shutil

import grpc
import httpx
import openai
import pytest

from engine.errors import CheckpointError
from engine.generation_defaults import GenerationDefaults
from services.cli import build_parser
from services.config import configs_from_args
from services.gateway.frontend import Options
from tidepool.v1 import serving_pb2, serving_pb2_grpc

pytestmark = pytest.mark.timeout(60)

QWEN3 = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2], "temperature": 0.6, "top_k": 20,
         "top_p": 0.95, "max_new_tokens": 512}


def write_generation_config(directory, values: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(values))
    return directory


def test_auto_reads_the_models_sampling_fields_and_vllm_reads_none(tmp_path):
    model = write_generation_config(tmp_path / "model", QWEN3)
    defaults = GenerationDefaults.load("auto", model)
    assert defaults.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # no token ids, no do_sample
    assert defaults.max_tokens == 512
    assert GenerationDefaults.load("vllm", model) == GenerationDefaults()
    other = write_generation_config(tmp_path / "other", {"repetition_penalty": 1.1, "min_p": 0.05})
    assert GenerationDefaults.load(str(other), model).sampling == {"min_p": 0.05, "repetition_penalty": 1.1}
    assert GenerationDefaults.load("auto", tmp_path / "no-such-file") == GenerationDefaults()


def test_overrides_set_fields_over_the_file_or_over_none(tmp_path):
    model = write_generation_config(tmp_path, QWEN3)
    over = GenerationDefaults.load("auto", model, {"temperature": 0.2, "max_new_tokens": 64})
    assert over.sampling == {"temperature": 0.2, "top_p": 0.95, "top_k": 20} and over.max_tokens == 64
    assert GenerationDefaults.load("vllm", model, {"min_p": 0.1}).sampling == {"min_p": 0.1}
    with pytest.raises(CheckpointError, match="--override-generation-config: do_sample is not one of"):
        GenerationDefaults.load("auto", model, {"do_sample": False})
    with pytest.raises(CheckpointError, match="with --override-generation-config: top_k"):
        GenerationDefaults.load("auto", model, {"top_k": -2})


@pytest.mark.parametrize("values, field", [({"temperature": 3.0}, "temperature"), ({"top_p": 0}, "top_p"),
                                           ({"max_new_tokens": 0}, "max_new_tokens")])
def test_a_value_no_request_could_take_fails_the_start_naming_the_file_and_field(tmp_path, values, field):
    with pytest.raises(CheckpointError, match=f"generation_config.json: {field}"):
        GenerationDefaults.load("auto", write_generation_config(tmp_path, values))
    with pytest.raises(CheckpointError, match="not a directory"):
        GenerationDefaults.load(str(tmp_path / "missing"), tmp_path)


def test_a_request_overrides_each_default_it_sets_and_max_new_tokens_caps_only_an_unset_max_tokens():
    defaults = GenerationDefaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20}, max_tokens=512)
    params = Options(temperature=0.2).sampling_params(4000, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.2, 0.95, 20, 512)
    assert Options(max_tokens=900).sampling_params(4000, defaults).max_tokens == 900
    assert Options().sampling_params(16, defaults).max_tokens == 16  # completions' own default is smaller
    plain = Options().sampling_params(16, GenerationDefaults())
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


def test_the_cli_options_reach_the_cluster_config_and_bad_json_is_refused(capsys):
    parse = build_parser().parse_args
    plain = configs_from_args(parse(["serve"]))[0]
    assert (plain.generation_config, plain.override_generation_config) == ("auto", {})
    given = configs_from_args(parse(["serve", "--generation-config", "vllm", "--override-generation-config",
                                     '{"temperature": 0.5}']))[0]
    assert (given.generation_config, given.override_generation_config) == ("vllm", {"temperature": 0.5})
    for bad in ("{temperature: 0.5}", "[0.5]"):
        with pytest.raises(SystemExit):
            parse(["serve", "--override-generation-config", bad])
        assert "--override-generation-config" in capsys.readouterr().err


@pytest.fixture(scope="module")
def greedy_server(start_server, serving_model_dir, tmp_path_factory):
    """The service tests' checkpoint with a generation_config.json asking for greedy answers of 3 tokens."""
    model = tmp_path_factory.mktemp("generation-defaults") / "greedy-llama"
    shutil.copytree(serving_model_dir, model)
    write_generation_config(model, {"temperature": 0.0, "max_new_tokens": 3})
    server = start_server(model_dir=model, colocated=1)
    yield server
    server.stop()


@pytest.mark.timeout(180)
def test_a_request_that_sets_nothing_samples_as_the_model_asks(greedy_server):
    client = openai.OpenAI(base_url=f"{greedy_server.http_url}/v1", api_key="none", max_retries=0, timeout=60)
    chat = [{"role": "user", "content": "Name a tide pool animal."}]
    answers = [client.chat.completions.create(model=greedy_server.model_id, messages=chat,
                                              extra_body={"ignore_eos": True}) for _ in range(2)]
    assert [a.usage.completion_tokens for a in answers] == [3, 3]  # max_new_tokens
    assert answers[0].choices[0].finish_reason == "length"
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content  # greedy
    longer = client.chat.completions.create(model=greedy_server.model_id, messages=chat, max_tokens=6,
                                            extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 6 and longer.choices[0].message.content.startswith(
        answers[0].choices[0].message.content)
    # A sampled request (its own temperature) draws from the distribution, seeded: not the greedy answer.
    sampled = {client.completions.create(model=greedy_server.model_id, prompt="Crabs", max_tokens=6,
                                         temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
                                         ).choices[0].text for seed in range(4)}
    assert len(sampled) > 1
    # min_p = 1 keeps only the most likely token: sampling at temperature 1 gives the greedy answer.
    kept = client.chat.completions.create(model=greedy_server.model_id, messages=chat, temperature=1.0,
                                          extra_body={"ignore_eos": True, "min_p": 1.0})
    assert kept.choices[0].message.content == answers[0].choices[0].message.content
    # The Responses API shows the temperature its answer used.
    response = httpx.post(f"{greedy_server.http_url}/v1/responses", timeout=60,
                          json={"model": greedy_server.model_id, "input": "Name a crab.", "store": False})
    assert response.status_code == 200, response.text
    assert response.json()["temperature"] == 0.0 and response.json()["usage"]["output_tokens"] <= 3
    # gRPC: an unset field takes the model's default too.
    stub = serving_pb2_grpc.ServingStub(grpc.insecure_channel(greedy_server.grpc_target))
    request = serving_pb2.ChatRequest(model=greedy_server.model_id, sampling=serving_pb2.SamplingOptions(
        ignore_eos=True), messages=[serving_pb2.ChatMessage(role="user", content=chat[0]["content"])])
    chunks = list(stub.Chat(request, timeout=60))
    assert "".join(c.text for c in chunks) == answers[0].choices[0].message.content
