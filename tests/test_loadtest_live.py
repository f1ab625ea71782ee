"""``tidepool bench`` against a live Tidepool server: without --model it benchmarks the server's own model
(from /v1/models), and with the served checkpoint's tokenizer every random prompt is exactly
--random-input-len tokens by the server's own count (its usage.prompt_tokens)."""

from __future__ import annotations

import argparse
import json

import pytest

from loadtest.cli import add_bench_parser

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(180)]


def test_bench_finds_the_model_and_sizes_prompts_with_its_tokenizer(live_server, serving_model_dir, tmp_path):
    parser = argparse.ArgumentParser(prog="tidepool")
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args([
        "bench", "--base-url", live_server.http_url, "--tokenizer", str(serving_model_dir), "--num-prompts",
        "4", "--random-input-len", "37", "--random-output-len", "3", "--save-result", "--result-dir",
        str(tmp_path), "--save-detailed", "--disable-tqdm"])
    assert args.func(args) == 0
    (path,) = tmp_path.iterdir()
    result = json.loads(path.read_text())
    assert result["model_id"] == live_server.model_id
    assert path.name.startswith("openai-infqps-" + live_server.model_id.split("/")[-1] + "-")
    assert result["completed"] == 4, result["error_samples"]
    assert result["input_lens"] == [37] * 4  # the server's usage.prompt_tokens, request by request
    assert result["output_lens"] == [3] * 4  # ignore_eos is on for random prompts, as in vLLM


def test_bench_measures_the_embeddings_api_with_prompts_as_inputs(live_server, serving_model_dir, tmp_path):
    parser = argparse.ArgumentParser(prog="tidepool")
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args([
        "bench", "--backend", "openai-embeddings", "--base-url", live_server.http_url, "--tokenizer",
        str(serving_model_dir), "--num-prompts", "6", "--random-input-len", "21", "--random-prefix-len", "32",
        "--result-dir", str(tmp_path), "--save-result", "--save-detailed", "--disable-tqdm"])
    assert args.func(args) == 0
    (path,) = tmp_path.iterdir()
    result = json.loads(path.read_text())
    assert path.name.startswith("openai-embeddings-infqps-")
    assert result["completed"] == 6, result["error_samples"]
    assert result["input_lens"] == [53] * 6 and result["output_lens"] == [0] * 6  # the server's usage
    assert result["total_output_tokens"] == 0 and result["request_throughput"] > 0
    assert all(t > 0 for t in result["ttfts"]) and result["itls"] == [[]] * 6  # its answer: one event
    assert result["mean_e2el_ms"] == pytest.approx(result["mean_ttft_ms"])
