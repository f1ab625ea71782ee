"""``tidepool bench`` with ``vllm bench serve``'s flags and defaults, against a small OpenAI-compatible server
on loopback that records what it is sent: the model taken from /v1/models, no temperature and no ignore_eos
unless asked (ignore_eos on for random prompts, as vLLM does), host/port/endpoint, result file names and
content, datasets, and token counts from --tokenizer. Every option's help shows its default."""

from __future__ import annotations

import argparse
import json
import re
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from test_loadtest_tokens import _sharegpt, write_bpe_tokenizer

from loadtest.cli import add_bench_parser
from loadtest.tokens import PromptTokenizer
from services.cli import build_parser

pytestmark = pytest.mark.timeout(60)
MODELS = ["org/served-model", "other"]


def _app(requests: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": m, "object": "model"} for m in MODELS]}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    @app.post("/proxy/v1/completions")
    async def generate(request: Request):
        body = await request.json()
        requests.append({"path": request.url.path, "body": body})
        n, chat = body["max_tokens"], "messages" in body

        async def events():
            for i in range(n):
                piece = f"word{i} "
                choice = {"delta": {"content": piece}} if chat else {"text": piece}
                yield f"data: {json.dumps({'choices': [{'index': 0, **choice}]})}\n\n"
            if body["model"] != "no-usage":
                usage = {"prompt_tokens": 1000, "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def http_server():
    requests: list[dict] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_app(requests), log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield requests, sock.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def server(http_server):
    requests, port = http_server
    requests.clear()
    return requests, port


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool")
    add_bench_parser(parser.add_subparsers())
    return parser


def bench(*argv: str) -> int:
    args = _parser().parse_args(["bench", "--disable-tqdm", *argv])
    return args.func(args)


def test_defaults_are_vllm_bench_serve_defaults():
    from loadtest.cli import config_from_args

    args = _parser().parse_args(["bench"])
    assert (args.backend, args.host, args.port, args.endpoint, args.dataset_name) == (
        "openai", "127.0.0.1", 8000, None, "random")
    assert (args.seed, args.input_len, args.random_output_len, args.range_ratio) == (0, 1024, 128, 0.0)
    assert (args.metric_percentiles, args.percentile_metrics, args.save_result) == ("99", "ttft,tpot,itl", False)
    config = config_from_args(args)
    assert config.num_prompts == 1000 and config.max_requests is None
    assert config.model is None and config.base_url == "http://127.0.0.1:8000" and config.request_rate is None
    assert config.temperature is None and config.ignore_eos is True  # random prompts run to their length
    chat = config_from_args(_parser().parse_args(["bench", "--workload", "chat", "--host", "::1", "--port", "9"]))
    assert chat.ignore_eos is False and chat.base_url == "http://[::1]:9" and chat.workload == "chat"
    off = config_from_args(_parser().parse_args(["bench", "--no-ignore-eos", "--temperature", "0"]))
    assert off.ignore_eos is False and off.temperature == 0.0
    old = config_from_args(_parser().parse_args(  # the flags tidepool bench had before keep working
        ["bench", "--input-len", "7", "--output-len", "3", "--range-ratio", "0.5", "--prefix-len", "2",
         "--trace", "t.jsonl", "--workload", "mooncake", "--no-session", "--base-url", "http://h:1/v1"]))
    assert (old.input_len, old.output_len, old.range_ratio, old.prefix_len, old.file_path) == (7, 3, 0.5, 2, "t.jsonl")
    assert old.use_session is False and old.base_url == "http://h:1/v1" and old.sharegpt_output_len == 3


def test_model_comes_from_v1_models_and_sampling_is_left_to_the_server(server, tmp_path):
    requests, port = server
    assert bench("--port", str(port), "--num-prompts", "3", "--random-input-len", "8", "--random-output-len",
                 "2", "--save-result", "--result-dir", str(tmp_path)) == 0
    assert len(requests) == 3 and {r["path"] for r in requests} == {"/v1/completions"}
    for body in (r["body"] for r in requests):
        assert body["model"] == "org/served-model" and "temperature" not in body
        assert body["ignore_eos"] is True and body["max_tokens"] == 2 and len(body["prompt"]) == 8
    (path,) = tmp_path.iterdir()  # vLLM's name: backend, rate, the model's last path part, the date
    assert re.fullmatch(r"openai-infqps-served-model-\d{8}-\d{6}\.json", path.name), path.name
    result = json.loads(path.read_text())
    assert (result["model_id"], result["backend"], result["request_rate"], result["num_prompts"]) == (
        "org/served-model", "openai", "inf", 3)
    assert result["completed"] == 3 and result["total_output_tokens"] == 6 and result["tokenizer_id"] is None
    assert result["prompt_lengths"].startswith("estimated at 1 characters per token")
    assert result["date"] == path.name[-20:-5]


def test_result_file_names_and_the_old_result_json_flag(server, tmp_path, monkeypatch):
    _, port = server
    monkeypatch.chdir(tmp_path)
    common = ("--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m", "--num-prompts", "2",
              "--random-input-len", "4", "--random-output-len", "1")
    assert bench(*common, "--result-dir", "ignored") == 0  # no --save-result: nothing written (as vLLM)
    assert list(tmp_path.iterdir()) == []
    assert bench(*common, "--save-result", "--request-rate", "50", "--max-concurrency", "2", "--label", "tp") == 0
    (named,) = tmp_path.iterdir()
    assert re.fullmatch(r"tp-50\.0qps-concurrency2-m-\d{8}-\d{6}\.json", named.name), named.name
    assert bench(*common, "--save-result", "--result-dir", "out", "--result-filename", "x.json") == 0
    assert json.loads((tmp_path / "out" / "x.json").read_text())["max_concurrency"] is None
    assert bench(*common, "--result-json", str(tmp_path / "deep" / "r.json")) == 0
    assert json.loads((tmp_path / "deep" / "r.json").read_text())["completed"] == 2


def test_sharegpt_over_the_chat_api_sends_no_ignore_eos_unless_asked(server, tmp_path):
    requests, port = server
    data = str(_sharegpt(tmp_path / "sg.json"))
    assert bench("--port", str(port), "--backend", "openai-chat", "--dataset-name", "sharegpt",
                 "--dataset-path", data, "--num-prompts", "4", "--sharegpt-output-len", "2") == 0
    assert [r["path"] for r in requests] == ["/v1/chat/completions"] * 4
    for body in (r["body"] for r in requests):
        assert "ignore_eos" not in body and "temperature" not in body and body["max_tokens"] == 2
        assert body["messages"][0]["role"] == "user" and len(body["messages"][0]["content"]) > 20
    requests.clear()
    assert bench("--port", str(port), "--endpoint", "/proxy/v1/completions", "--dataset-name", "sharegpt",
                 "--dataset-path", data, "--num-prompts", "1", "--output-len", "3", "--ignore-eos",
                 "--temperature", "0.5") == 0
    (sent,) = requests
    assert sent["path"] == "/proxy/v1/completions" and "prompt" in sent["body"]
    assert (sent["body"]["ignore_eos"], sent["body"]["temperature"], sent["body"]["max_tokens"]) == (True, 0.5, 3)


def test_tokenizer_sizes_prompts_and_counts_answers_without_usage(server, tmp_path):
    requests, port = server
    tok_dir = write_bpe_tokenizer(tmp_path / "tok")
    out = tmp_path / "r.json"
    assert bench("--port", str(port), "--model", "no-usage", "--tokenizer", str(tok_dir), "--num-prompts", "5",
                 "--random-input-len", "24", "--random-output-len", "3", "--result-json", str(out)) == 0
    tok = PromptTokenizer.load(tok_dir)
    assert [tok.prompt_count(r["body"]["prompt"]) for r in requests] == [24] * 5
    result = json.loads(out.read_text())
    assert result["total_input_tokens"] == 5 * 24 and result["tokenizer_id"] == str(tok_dir)
    assert result["total_output_tokens"] == 5 * tok.count("word0 word1 word2 ") != 5 * 3
    assert result["prompt_lengths"] == f"tokenizer {tok_dir}"


def test_bad_input_fails_before_sending(server, tmp_path, capsys):
    requests, port = server
    assert bench("--backend", "grpc", "--target", "127.0.0.1:1") == 2
    assert "--model is required with --backend grpc" in capsys.readouterr().err
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    assert bench("--port", str(dead)) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{dead}/v1/models" in err and "--model" in err
    assert bench("--port", str(port), "--model", "m", "--dataset-name", "sharegpt") == 2
    assert "needs --dataset-path" in capsys.readouterr().err
    assert bench("--port", str(port), "--model", "m", "--dataset-path", str(tmp_path)) == 2
    assert "reads no file" in capsys.readouterr().err
    assert bench("--port", str(port), "--model", "m", "--tokenizer", str(tmp_path)) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert bench("--port", str(port), "--model", "m", "--endpoint", "/v1/rerank") == 2
    assert "expected a .../completions, .../chat/completions or .../embeddings path" in capsys.readouterr().err
    assert bench("--port", str(port), "--model", "m", "--backend", "openai-embeddings", "--dataset-name", "chat") == 2
    assert "the chat workload needs the chat endpoint" in capsys.readouterr().err
    # Counts and lengths of nothing: once an empty run's report, or prompts and answers of no tokens.
    for flags, named in ((["--num-prompts", "0"], "num_prompts"), (["--random-input-len", "0"], "input_len"),
                         (["--random-output-len", "0"], "output_len"),
                         (["--dataset-name", "chat", "--turns", "0"], "turns")):
        assert bench("--port", str(port), "--model", "m", *flags) == 2
        assert f"{named} must be at least 1, got 0" in capsys.readouterr().err
    assert requests == []


def test_bench_help_states_the_number_of_prompts_default():
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    text = " ".join(action.choices["bench"].format_help().split())
    assert "number of requests: random, sharegpt (default: 1000); mooncake: the first N rows" in text


def test_num_prompts_limits_a_trace_replay_and_is_refused_where_it_would_be_ignored(server, tmp_path, capsys):
    """vLLM's --num-prompts applies to every dataset: a Mooncake trace replays its first N rows. The chat
    workload's count is its users and turns, so there the flag is refused rather than ignored."""
    from loadtest.cli import config_from_args

    requests, port = server
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 20, "output_length": 2,
                                         "hash_ids": [i]}) + "\n" for i in range(6)))
    result_json = tmp_path / "result.json"
    assert bench("--port", str(port), "--model", "m", "--dataset-name", "mooncake", "--dataset-path", str(trace),
                 "--length-scale", "0.05", "--num-prompts", "4", "--result-json", str(result_json)) == 0
    assert len(requests) == 4 and json.loads(result_json.read_text())["num_prompts"] == 4
    assert config_from_args(_parser().parse_args(
        ["bench", "--dataset-name", "mooncake", "--trace", "t.jsonl", "--max-requests", "3"])).max_requests == 3

    assert bench("--port", str(port), "--model", "m", "--dataset-name", "mooncake", "--dataset-path", str(trace),
                 "--num-prompts", "4", "--max-requests", "5") == 2
    assert "--num-prompts 4 and --max-requests 5 both limit the trace replay; give one" in capsys.readouterr().err
    assert bench("--port", str(port), "--model", "m", "--dataset-name", "chat", "--num-prompts", "40") == 2
    assert "the chat workload sends --num-users x --turns requests (8 x 4); drop --num-prompts" in \
        capsys.readouterr().err
    assert len(requests) == 4  # nothing sent by the refused runs
