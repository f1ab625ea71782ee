"""The ``tidepool`` command line: errors name what was wrong, every option says what it does and its default."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.cli import COMMANDS, build_parser, main
from services.config import configs_from_args


def test_an_unknown_option_before_the_command_is_named(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'--bogus'" in err and "serve" in err


def test_an_unknown_command_is_named(capsys):
    with pytest.raises(SystemExit):
        main(["bogus"])
    assert "'bogus'" in capsys.readouterr().err


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_text_and_its_default(command):
    parser = _subparsers(build_parser())[command]
    text = parser.format_help()
    assert "``" not in text and "(default: None)" not in text  # no docstring markup, no unexplained None
    assert parser.description
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"tidepool {command} {action.option_strings[0]}: no help text"
        if action.default is not None and action.default is not argparse.SUPPRESS:
            assert "(default: " in formatter._get_help_string(action), action.option_strings


def test_serve_help_shows_the_config_defaults():
    text = _subparsers(build_parser())["serve"].format_help()
    assert "(default: tidepool)" in text  # --policy, from ClusterConfig
    assert f"(default: {8 << 20})" in text  # --max-body-bytes, from GatewayConfig


def test_commands_list_matches_the_parser():
    assert set(_subparsers(build_parser())) == set(COMMANDS)


def test_hot_prefix_replication_is_refused_with_a_policy_that_has_none():
    parser = build_parser()
    cluster, _ = configs_from_args(parser.parse_args(["serve", "--replicate-hot-prefixes"]))
    assert cluster.policy_options() == {"replicate": True}
    with pytest.raises(ValueError, match="tidepool policy's, not round_robin's"):
        configs_from_args(parser.parse_args(["serve", "--policy", "round_robin", "--replicate-hot-prefixes"]))


def test_gpu_engine_and_channel_options_reach_the_configs():
    parser = build_parser()
    cluster, _ = configs_from_args(parser.parse_args(
        ["serve", "--gpu-memory-utilization", "0.8", "--attention-backend", "torch", "--max-kv-channels", "4",
         "--quantization", "fp8"]))
    assert (cluster.engine.gpu_memory_utilization, cluster.engine.attention_backend) == (0.8, "torch")
    assert cluster.engine.quantization == "fp8"
    assert cluster.max_kv_channels == 4
    with pytest.raises(ValueError, match="max-kv-channels must be at least 1"):
        configs_from_args(parser.parse_args(["serve", "--max-kv-channels", "0"]))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        configs_from_args(parser.parse_args(["serve", "--gpu-memory-utilization", "1.5"]))
    with pytest.raises(ValueError, match="triton' has no attention sinks"):
        configs_from_args(parser.parse_args(["serve", "--attention-backend", "triton", "--kv-window", "64",
                                             "--kv-sinks", "4"]))
    windowed, _ = configs_from_args(parser.parse_args(["serve", "--attention-backend", "triton", "--kv-window", "64"]))
    assert (windowed.engine.attention_backend, windowed.engine.kv_window) == ("triton", 64)  # runs in the kernels


def test_block_size_reaches_the_engine_and_only_powers_of_two_are_taken(capsys):
    parser = build_parser()
    assert configs_from_args(parser.parse_args(["serve", "--block-size", "32"]))[0].engine.block_size == 32
    assert configs_from_args(parser.parse_args(["serve"]))[0].engine.block_size == 16
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--block-size", "12"])
    assert "argument --block-size: invalid choice: 12" in capsys.readouterr().err


def test_num_reserved_decode_tokens_reaches_the_engine_and_a_negative_count_is_refused():
    parser = build_parser()
    assert configs_from_args(parser.parse_args(["serve"]))[0].engine.num_reserved_decode_tokens == 16
    cluster, _ = configs_from_args(parser.parse_args(["serve", "--num-reserved-decode-tokens", "256"]))
    assert cluster.engine.num_reserved_decode_tokens == 256
    with pytest.raises(ValueError, match="num_reserved_decode_tokens must be >= 0, got -1"):
        configs_from_args(parser.parse_args(["serve", "--num-reserved-decode-tokens", "-1"]))


def test_ttls_and_ray_cpus_reach_the_configs_and_a_negative_ttl_is_refused():
    parser = build_parser()
    cluster, gateway = configs_from_args(parser.parse_args(["serve", "--session-ttl", "60", "--response-ttl", "0",
                                                            "--ray-num-cpus", "8"]))
    assert (gateway.session_ttl_s, gateway.response_ttl_s, cluster.ray_num_cpus) == (60, 0, 8)
    for flags, says in ((["--session-ttl", "0"], "--session-ttl must be positive, got 0"),
                        (["--response-ttl", "-1"], "--response-ttl must be at least 0")):
        with pytest.raises(ValueError, match=says):
            configs_from_args(parser.parse_args(["serve", *flags]))


def serve_refusal(monkeypatch, *flags: str) -> str:
    """What ``tidepool serve FLAGS`` exits with, asserting it is one line and came before Ray and Redis start."""
    from services.cluster import Cluster

    def started(_self):
        raise AssertionError(f"Ray and Redis started for {flags}")

    monkeypatch.setattr(Cluster, "start_infrastructure", started)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    message = str(exit_info.value.code)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("files", "named"), [
    ({}, "config.json: not found"),
    ({"config.json": "{"}, "config.json: not valid JSON"),
    ({"config.json": '{"architectures": ["GPT2LMHeadModel"]}'}, "'GPT2LMHeadModel'] is not supported"),
    ({"config.json": '{"architectures": ["LlamaForCausalLM"]}'}, "required key 'num_attention_heads' is missing"),
    ("tiny config", "tokenizer.json: not found"),
])
def test_serve_refuses_a_model_dir_it_cannot_serve_in_one_line_before_starting_anything(
        tmp_path, monkeypatch, files, named):
    """A bad --model ends with the file and what is wrong with it, not a traceback from inside a worker,
    and before Ray and the private Redis start."""
    from engine.loader import resolve_model_dir

    if files == "tiny config":  # a valid config.json, no tokenizer
        files = {"config.json": (resolve_model_dir("tiny") / "config.json").read_text()}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    message = serve_refusal(monkeypatch, "--model", str(tmp_path))
    assert message.startswith(f"tidepool serve: --model {tmp_path}: ") and named in message


def test_serving_names_chat_template_and_context_options_reach_the_configs(tmp_path, capsys):
    """--served-model-name, --chat-template (a file, or the template itself) and --max-model-len; names that
    repeat or that an adapter has, and a template that is neither a file nor Jinja, are refused by flag."""
    parser = build_parser()
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    cluster, _ = configs_from_args(parser.parse_args(
        ["serve", "--served-model-name", "gpt-4o", "alias", "--chat-template", str(tmp_path / "chat.jinja"),
         "--max-model-len", "1024"]))
    assert cluster.served_model_names == ("gpt-4o", "alias") and cluster.chat_template == template
    assert cluster.engine.max_model_len == 1024
    assert configs_from_args(parser.parse_args(["serve", "--chat-template", template]))[0].chat_template == template
    default, _ = configs_from_args(parser.parse_args(["serve"]))
    assert (default.served_model_names, default.chat_template, default.engine.max_model_len) == ((), None, None)
    for names in (["a", "a"], ["a", "ad"]):
        with pytest.raises(ValueError, match="--served-model-name takes distinct"):
            configs_from_args(parser.parse_args(["serve", "--served-model-name", *names, "--lora-modules",
                                                 f"ad={tmp_path}"]))
    for value, says in ((str(tmp_path / "missing.jinja"), "neither a file nor a Jinja template"),
                        ("{% for m in messages %}", "not a valid Jinja template")):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--chat-template", value])
        err = capsys.readouterr().err
        assert "argument --chat-template: " in err and says in err


def test_allowed_origins_take_vllms_json_list_and_refuse_what_is_not_an_origin(capsys):
    parser = build_parser()
    _, gateway = configs_from_args(parser.parse_args(["serve", "--allowed-origins", '["https://a.example", "*"]']))
    assert gateway.allowed_origins == ("https://a.example", "*")
    assert configs_from_args(parser.parse_args(["serve"]))[1].allowed_origins == ()
    for value in ("https://a.example", '["a.example"]', "{}"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--allowed-origins", value])
        assert "argument --allowed-origins:" in capsys.readouterr().err


def test_vllms_enable_auto_tool_choice_is_taken_with_a_tool_call_parser_and_refused_without():
    parser = build_parser()
    _, gateway = configs_from_args(parser.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser",
                                                      "hermes"]))
    assert gateway.tool_call_parser == "hermes"
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        configs_from_args(parser.parse_args(["serve", "--enable-auto-tool-choice"]))


def test_serve_refuses_a_max_model_len_past_the_models_context_in_one_line_before_starting_anything(
        monkeypatch):
    assert serve_refusal(monkeypatch, "--max-model-len", "5000") == ("tidepool serve: max_model_len 5000 must be between 2 and the model's "
                                         "context, 4096 tokens (max_position_embeddings)")


def test_serve_makes_a_relative_model_dir_absolute_and_keeps_its_name(tmp_path, monkeypatch):
    from engine.loader import model_id_for

    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    engine = configs_from_args(parser.parse_args(["serve", "--model", "ckpt/my-model"]))[0].engine
    assert engine.model == str(tmp_path / "ckpt" / "my-model")  # workers run in other directories
    assert model_id_for(engine.model) == "my-model"  # served as the directory's name, as before
    assert configs_from_args(parser.parse_args(["serve"]))[0].engine.model == "tiny"


def test_serve_takes_a_tokenizer_apart_and_refuses_one_that_is_not_the_models_before_starting_anything(
        tmp_path, monkeypatch):
    from engine.loader import resolve_model_dir

    parser = build_parser()
    tiny_dir = str(resolve_model_dir("tiny"))
    assert configs_from_args(parser.parse_args(["serve", "--tokenizer", tiny_dir]))[0].engine.tokenizer == tiny_dir
    relative = configs_from_args(parser.parse_args(["serve", "--tokenizer", "tok"]))[0].engine.tokenizer
    assert relative == str(Path("tok").resolve())  # workers run in other directories
    message = serve_refusal(monkeypatch, "--tokenizer", str(tmp_path))
    assert message.startswith(f"tidepool serve: the tokenizer '{tmp_path}': ") and "tokenizer.json: not found" in message
