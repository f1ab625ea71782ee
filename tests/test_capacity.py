"""kv-calc: the DESIGN.md section 3 worked examples, GQA's saving, device fit, and one-line errors."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.capacity import PRESETS, add_kv_calc_parser, format_report, plan, shape_from_dir

pytestmark = pytest.mark.timeout(30)


def kv_calc(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="tidepool")
    add_kv_calc_parser(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(["kv-calc", *argv])
        code = args.func(args)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_llama_13b_at_2048_tokens_is_1_68_gb(capsys):
    code, out, _ = kv_calc(["--preset", "llama-13b", "--context", "2048", "--dtype", "float16", "--json"], capsys)
    result = json.loads(out)
    assert code == 0
    assert result["kv_bytes_per_token"] == 819_200
    assert result["kv_bytes_per_request"] == 1_677_721_600  # 1.68 GB (the papers round to 1.7 GB)


def test_opt_13b_and_llama_3_70b_bytes_per_token():
    assert plan(PRESETS["opt-13b"], "float16", 1, 1, None).kv_bytes_per_token == 819_200
    assert plan(PRESETS["llama-3-70b"], "float16", 1, 1, None).kv_bytes_per_token == 327_680


def test_llama_2_70b_gqa_is_8x_smaller_than_mha(capsys):
    code, out, _ = kv_calc(["--preset", "llama-2-70b", "--dtype", "fp16"], capsys)
    assert code == 0
    assert "2,621,440 B (GQA saves 8x)" in out
    assert "KV bytes per token        327,680 B" in out


def test_model_dir_and_device_fit(tmp_path, capsys):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, _ = kv_calc(["--model", str(tmp_path), "--context", "4096", "--batch", "8",
                            "--gpu-mem-gib", "80", "--json"], capsys)
    r = json.loads(out)
    assert code == 0
    assert r["weight_bytes"] == PRESETS["llama-2-7b"].num_parameters * 2  # Llama-2-7B's shape
    per_request = 2 * 32 * 32 * 128 * 2 * 4096
    assert r["max_concurrent_requests"] == (int(80 * 1024**3 * 0.9) - r["weight_bytes"]) // per_request
    assert r["batch_fits"] is True


@pytest.mark.parametrize("argv", [
    ["--preset", "gpt-5"],
    ["--preset", "llama-13b", "--context", "-5"],
    ["--preset", "llama-13b", "--context", "abc"],
    ["--preset", "llama-13b", "--dtype", "float13"],
    ["--model", "/nonexistent/checkpoint"],
    ["--context", "10"],
    ["--preset", "llama-13b", "--kv-cache-dtype", "int4"],
])
def test_bad_arguments_give_one_line_error(argv, capsys):
    code, out, err = kv_calc(argv, capsys)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and "error" in err and "Traceback" not in err


def test_unsupported_architecture_names_the_field(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    code, _, err = kv_calc(["--model", str(tmp_path)], capsys)
    assert code == 2 and "architectures" in err and "LlamaForCausalLM" in err


def test_kv_cache_dtype_counts_codes_scales_and_window(capsys):
    """Llama-3-8B (32 layers, 8 KV heads of 128 channels), fp16, blocks of 16 tokens."""
    per_token = {}
    for fmt in ("auto", "int8", "fp8", "kivi2"):
        code, out, _ = kv_calc(["--preset", "llama-3-8b", "--kv-cache-dtype", fmt, "--context", "4096",
                                "--gpu-mem-gib", "80", "--json"], capsys)
        assert code == 0
        per_token[fmt] = r = json.loads(out)
        assert r["kv_cache_dtype"] == fmt
        assert r["kv_bytes_per_request"] == r["kv_bytes_per_token"] * 4096 + r["window_bytes_per_request"]
    L, H, D, B = 32, 8, 128, 16
    assert per_token["auto"]["kv_bytes_per_token"] == 2 * L * H * D * 2
    assert per_token["int8"]["kv_bytes_per_token"] == 2 * L * (H * D + H * 2)  # fp16 scale per token and head
    assert per_token["fp8"]["kv_bytes_per_token"] == 2 * L * (B * H * D + H * 2) // B  # fp16 scale per block
    # kivi2: 2 bits a value; fp16 scale + zero per key channel over the block, per 32 value channels a token
    kivi2_block = 2 * B * H * D // 4 + 2 * H * D * 2 + 2 * B * H * (D // 32) * 2
    assert per_token["kivi2"]["kv_bytes_per_token"] == L * kivi2_block // B
    assert per_token["auto"]["window_bytes_per_request"] == per_token["int8"]["window_bytes_per_request"] == 0
    # fp8: the block being filled; kivi2 also its residual block (one by default)
    assert per_token["fp8"]["window_bytes_per_request"] == B * per_token["auto"]["kv_bytes_per_token"]
    assert per_token["kivi2"]["window_bytes_per_request"] == 2 * B * per_token["auto"]["kv_bytes_per_token"]
    fits = {fmt: r["max_concurrent_requests"] for fmt, r in per_token.items()}
    assert fits["kivi2"] > 4 * fits["auto"] and 1.9 * fits["auto"] < fits["int8"] <= 2 * fits["auto"]
    code, out, _ = kv_calc(["--preset", "llama-3-8b", "--kv-cache-dtype", "kivi2"], capsys)
    assert "KV cache kivi2" in out and "of which windows        4,194,304 B" in out and "+ 1 residual" in out


@pytest.mark.timeout(30)
def test_a_sliding_window_model_holds_only_its_windows_blocks(tmp_path):
    """Mistral v0.1's 4,096-token window: a 32k request holds the 257 blocks of 16 that 4,096 consecutive
    positions touch, not 2,048; a request shorter than the window holds all of its own."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "sliding_window": 4096}))
    shape = shape_from_dir(tmp_path)
    assert shape.sliding_window == 4096
    per_token = 2 * 32 * 8 * 128 * 2
    assert plan(shape, "float16", 32768, 1, None).kv_bytes_per_request == 257 * 16 * per_token
    assert plan(shape, "float16", 1000, 1, None).kv_bytes_per_request == 1000 * per_token
    assert "sliding window of 4096 tokens bounds it" in format_report(plan(shape, "float16", 32768, 1, None))


def test_a_draft_model_adds_its_weights_and_a_kv_cache_of_the_positions_the_model_holds(tmp_path, capsys):
    """--speculative-model: the engine pairs each block with one of the draft's (in the model's dtype, whatever
    --kv-cache-dtype says), which holds the positions the model's blocks hold: the draft attends through the
    model's sliding window too."""
    target, draft = tmp_path / "mistral", tmp_path / "draft"
    for path, layers, window in ((target, 32, 4096), (draft, 4, None)):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({
            "architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096 if layers == 32 else 512,
            "intermediate_size": 14336 if layers == 32 else 1024, "num_hidden_layers": layers,
            "num_attention_heads": 32 if layers == 32 else 8, "num_key_value_heads": 8 if layers == 32 else 2,
            "max_position_embeddings": 32768, "sliding_window": window}))
    big, small = shape_from_dir(target), shape_from_dir(draft)
    per_token, draft_per_token = 2 * 32 * 8 * 128 * 2, 2 * 4 * 2 * 64 * 2
    alone = plan(big, "float16", 32768, 1, 80)
    both = plan(big, "float16", 32768, 1, 80, draft=small)
    assert alone.kv_bytes_per_request == 257 * 16 * per_token  # the window bounds the model's own
    assert both.draft_kv_bytes_per_token == draft_per_token and both.kv_bytes_per_token == per_token
    assert both.kv_bytes_per_request == 257 * 16 * (per_token + draft_per_token)
    assert both.weight_bytes == alone.weight_bytes + small.num_parameters * 2 == alone.weight_bytes + both.draft_weight_bytes
    assert both.max_concurrent_requests == (int(80 * 1024**3 * 0.9) - both.weight_bytes) // both.kv_bytes_per_request
    int8 = plan(big, "float16", 1024, 1, None, "int8", draft=small)
    assert int8.draft_kv_bytes_per_token == draft_per_token  # the draft's cache stays in the model's dtype
    assert int8.kv_bytes_per_request == 1024 * int8.kv_bytes_per_token + 1024 * draft_per_token
    code, out, _ = kv_calc(["--model", str(target), "--speculative-model", str(draft), "--context", "32768"], capsys)
    assert code == 0 and "  draft model draft: 2,048 B more" in out and "  of which the draft" in out
    assert "sliding window of 4096 tokens bounds it" in out
    code, _, err = kv_calc(["--preset", "llama-3-8b", "--speculative-model", str(tmp_path / "none")], capsys)
    assert code == 2 and err.startswith("tidepool kv-calc: error: ") and "config.json" in err
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": 32001}))
    code, _, err = kv_calc(["--model", str(target), "--speculative-model", str(draft)], capsys)  # as serve refuses it
    assert code == 2 and "vocabulary of 32001 tokens and the model 32000" in err
