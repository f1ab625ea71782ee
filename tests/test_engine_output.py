"""Output handling without a model: finish reasons behave as strings, the stop decision (stop token, EOS,
stop string, length, prefilled), text held back while it could begin a stop string and cut at one, and
the modules services share with the gateway import without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.loader import resolve_model_dir
from engine.output import FinishReason, OutputText, check_finish
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

EOS = {257, 258}
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model_dir("tiny"))  # byte-level: ids below 256 are the bytes


def run(tokenizer: Tokenizer, params: SamplingParams, tokens: list[int], prefill_only: bool = False
        ) -> list[tuple[FinishReason | None, int | str | None, str]]:
    """(finish reason, stop reason, text handed out) per token, up to the one that ends the sample."""
    text = OutputText(tokenizer, list(b"prompt"), params)
    out = []
    for n, tok in enumerate(tokens, start=1):
        reason, stop = check_finish(tok, n, params, EOS, text, prefill_only)
        out.append((reason, stop, text.emit(final=reason not in (None, FinishReason.PREFILLED))))
        if reason is not None:
            break
    return out


def test_finish_reasons_compare_and_serialize_as_their_strings():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "prefilled"]
    assert FinishReason.STOP == "stop" and FinishReason.PREFILLED != "stop"
    assert json.dumps({"finish_reason": FinishReason.LENGTH}) == '{"finish_reason": "length"}'
    assert f"{FinishReason.ABORT}" == "abort" and FinishReason("prefilled") is FinishReason.PREFILLED


def test_stop_string_text_is_held_back_then_cut(tokenizer):
    params = SamplingParams(max_tokens=20, stop=["END", "zz"])
    got = run(tokenizer, params, list(b"abcENDxyz"))
    # the last 2 characters (longest stop string - 1) wait until they can no longer begin a stop string
    assert [t for _, _, t in got] == ["", "", "a", "b", "c", ""]
    assert got[-1][:2] == (FinishReason.STOP, "END")
    assert all(reason is None for reason, _, _ in got[:-1])


def test_include_stop_str_in_output_keeps_the_stop_string_that_ended_the_text(tokenizer):
    params = SamplingParams(max_tokens=20, stop=["END", "zz"], include_stop_str_in_output=True)
    got = run(tokenizer, params, list(b"abcENDxyz"))
    assert "".join(t for _, _, t in got) == "abcEND" and got[-1][:2] == (FinishReason.STOP, "END")


def test_special_tokens_have_text_only_when_not_skipped(tokenizer):
    """The tiny model's <|user|> (260) is a special token: no text by default, its own with
    skip_special_tokens false (as vLLM's); an end-of-sequence token is a stop token either way."""
    tokens = [ord("a"), 260, ord("b"), 257]
    assert "".join(t for _, _, t in run(tokenizer, SamplingParams(max_tokens=20), tokens)) == "ab"
    kept = run(tokenizer, SamplingParams(max_tokens=20, skip_special_tokens=False), tokens)
    assert "".join(t for _, _, t in kept) == "a<|user|>b" and kept[-1][:2] == (FinishReason.STOP, 257)


def test_stop_tokens_and_eos_end_the_sample_without_their_text(tokenizer):
    got = run(tokenizer, SamplingParams(max_tokens=20, stop_token_ids=[ord("!")]), list(b"hi!?"))
    assert got == [(None, None, "h"), (None, None, "i"), (FinishReason.STOP, ord("!"), "")]
    assert run(tokenizer, SamplingParams(max_tokens=20), [ord("a"), 257])[-1] == (FinishReason.STOP, 257, "")
    ignored = run(tokenizer, SamplingParams(max_tokens=2, ignore_eos=True), [ord("a"), 257])
    assert [reason for reason, _, _ in ignored] == [None, FinishReason.LENGTH]


def test_length_flushes_an_incomplete_character(tokenizer):
    got = run(tokenizer, SamplingParams(max_tokens=2), [ord("a"), 0xC3, ord("b")])  # 0xC3 starts "é"
    assert got == [(None, None, "a"), (FinishReason.LENGTH, None, "\ufffd")]


def test_prefilled_only_when_nothing_else_ends_the_sample(tokenizer):
    params = SamplingParams(max_tokens=4, stop=["ab"])
    assert run(tokenizer, params, [ord("a")], prefill_only=True) == [(FinishReason.PREFILLED, None, "")]
    assert run(tokenizer, SamplingParams(max_tokens=1), [ord("a")], prefill_only=True)[0][0] == "length"
    assert run(tokenizer, params, [257], prefill_only=True)[0][:2] == (FinishReason.STOP, 257)


@pytest.mark.parametrize("stop, expected", [(["z"], "abxy"), (["xyz"], "ab")])
def test_text_of_a_handed_off_sample_continues_where_the_prefill_side_stopped(tokenizer, stop, expected):
    """The decode side replays the first token (as Engine.add_imported_request does) and hands out only
    what the prefill side held back: with stop ["z"] the prefill side already handed out "a"."""
    params = SamplingParams(max_tokens=20, stop=stop)
    tokens = list(b"abxyz")
    whole = "".join(t for _, _, t in run(tokenizer, params, tokens))
    (first,) = run(tokenizer, params, tokens[:1], prefill_only=True)
    decode = OutputText(tokenizer, list(b"prompt"), params)
    decode.push(tokens[0])
    decode.emit(final=False)
    rest = []
    for n, tok in enumerate(tokens[1:], start=2):
        reason, _ = check_finish(tok, n, params, EOS, decode, False)
        rest.append(decode.emit(final=reason is not None))
    assert whole == first[2] + "".join(rest) == expected


@pytest.mark.parametrize("module", ["engine.sampling_params", "engine.output", "engine.block_events",
                                    "engine.request_limits"])
def test_module_imports_without_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)
