"""``tidepool generate``: --json output shape (one object per prompt), agreement with the engine, text
prompts through the tokenizer, --n with a seed, --min-p, --lora, --prediction, and a one-line error for a bad
request."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import add_generate_parser
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def generate(argv: list[str], capsys) -> tuple[int, list[str], str]:
    parser = argparse.ArgumentParser(prog="tidepool")
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["generate", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


def test_json_prompt_ids_one_object_per_prompt_matching_the_engine(serving_model_dir, capsys):
    model = str(serving_model_dir)
    code, lines, _ = generate(["--model", model, "--prompt-ids", "1,2,3,4,5", "--prompt-ids", "72,105,33",
                               "--max-tokens", "6", "--ignore-eos", "--json"], capsys)
    assert code == 0 and len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert [r["prompt_ids"] for r in records] == [[1, 2, 3, 4, 5], [72, 105, 33]]
    engine = Engine(EngineConfig(model=model))
    for r in records:
        assert set(r) == {"prompt_ids", "token_ids", "text"}
        engine.add_request("x", r["prompt_ids"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        expected = []
        while engine.has_unfinished():
            expected += [t for o in engine.step() for t in o.new_token_ids]
        assert r["token_ids"] == expected
        assert r["text"] == engine.tokenizer.decode(expected)


def test_text_prompt_is_tokenized_and_a_single_prompt_prints_one_object(serving_model_dir, capsys):
    code, lines, _ = generate(["--model", str(serving_model_dir), "--prompt", "Hello tide", "--max-tokens", "4",
                               "--ignore-eos", "--json"], capsys)
    assert code == 0 and len(lines) == 1
    record = json.loads(lines[0])
    assert record["prompt_ids"] == list(b"Hello tide")  # the byte-level tokenizer: one id per byte
    assert len(record["token_ids"]) == 4


def test_n_samples_with_a_seed_reproduce(serving_model_dir, capsys):
    argv = ["--model", str(serving_model_dir), "--prompt-ids", "9,8,7", "--max-tokens", "8", "--ignore-eos",
            "--temperature", "1.0", "--seed", "5", "--n", "2", "--json"]
    _, first, _ = generate(argv, capsys)
    _, again, _ = generate(argv, capsys)
    assert first == again
    record = json.loads(first[0])
    assert len(record["samples"]) == 2 and record["token_ids"] == record["samples"][0]["token_ids"]


def test_min_p_of_one_samples_the_greedy_tokens(serving_model_dir, capsys):
    argv = ["--model", str(serving_model_dir), "--prompt-ids", "9,8,7", "--max-tokens", "8", "--ignore-eos", "--json"]
    _, greedy, _ = generate(argv, capsys)
    _, kept, _ = generate([*argv, "--temperature", "1.0", "--seed", "5", "--min-p", "1.0"], capsys)
    _, sampled, _ = generate([*argv, "--temperature", "1.0", "--seed", "5"], capsys)
    assert kept == greedy != sampled


def test_bad_request_is_a_one_line_error(serving_model_dir, capsys):
    code, lines, err = generate(["--model", str(serving_model_dir), "--prompt-ids", "1,2", "--max-tokens", "0"],
                                capsys)
    assert code == 2 and lines == []
    assert err.strip().count("\n") == 0 and "max_tokens" in err


def test_a_prediction_is_drafted_from_and_changes_no_token(serving_model_dir, tmp_path, capsys):
    # (letters only: the random model's bytes would not all be text)
    model = ["--model", str(serving_model_dir), "--prompt", "Tide", "--max-tokens", "24", "--regex", "[a-z]{30}",
             "--json"]
    _, lines, _ = generate([*model, "--num-speculative-tokens", "4"], capsys)
    predicted = tmp_path / "prediction.txt"
    predicted.write_text(json.loads(lines[0])["text"])
    code, again, err = generate([*model, "--num-speculative-tokens", "4", "--prediction", f"@{predicted}"], capsys)
    assert code == 0 and again == lines
    accepted, drafted = map(int, err.split("speculative decoding: ")[1].split(" draft")[0].split(" of "))
    assert accepted == drafted >= 18  # every draft token of the prediction, 23 decoded in steps of up to 5
    code, lines, err = generate([*model, "--prediction", "Tide"], capsys)
    assert code == 2 and lines == [] and "add --num-speculative-tokens" in err


def test_structured_output_flags_keep_every_sample_and_a_bad_spec_is_refused(serving_model_dir, tmp_path, capsys):
    model = ["--model", str(serving_model_dir), "--prompt", "Tide", "--max-tokens", "12", "--json"]
    _, lines, _ = generate([*model, "--choice", "low", "--choice", "high", "--n", "3", "--temperature", "1"], capsys)
    assert {s["text"] for s in json.loads(lines[0])["samples"]} <= {"low", "high"}
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}))
    _, lines, _ = generate([*model, "--json-schema", f"@{schema}"], capsys)
    assert json.loads(json.loads(lines[0])["text"]) in ({"ok": True}, {"ok": False})
    code, lines, err = generate([*model, "--regex", "[0-9"], capsys)
    assert code == 2 and lines == [] and "structured_output" in err


def test_lora_runs_every_prompt_with_the_adapter_and_a_bad_one_is_one_line(serving_model_dir, tmp_path, capsys):
    from benchmarks.lora_batch import write_adapter
    from engine.config import ModelConfig

    write_adapter(tmp_path / "crab", ModelConfig.from_dir(serving_model_dir), rank=4, seed=1, scale=0.2)
    argv = ["--model", str(serving_model_dir), "--prompt-ids", "9,8,7", "--max-tokens", "6", "--ignore-eos", "--json"]
    code, lines, _ = generate([*argv, "--lora", str(tmp_path / "crab")], capsys)
    engine = Engine(EngineConfig(model=str(serving_model_dir), lora_modules={"crab": str(tmp_path / "crab")}))
    engine.add_request("x", [9, 8, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), lora="crab")
    expected = []
    while engine.has_unfinished():
        expected += [t for o in engine.step() for t in o.new_token_ids]
    assert code == 0 and json.loads(lines[0])["token_ids"] == expected
    assert json.loads(generate(argv, capsys)[1][0])["token_ids"] != expected  # the base model answers otherwise
    code, _, err = generate([*argv, "--lora", str(tmp_path)], capsys)
    assert code == 2 and "adapter_config.json not found" in err and len(err.splitlines()) == 1
