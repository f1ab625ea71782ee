"""Structured outputs in the engine (engine/structured_output.py) on the tiny random Llama of
test_engine_loop: every kind keeps the output to its spec, greedy and sampled, beside free requests; the
handoff and resumed tokens continue the same matcher; bad specs are refused before anything is taken."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from test_engine_loop import make_engine, prompt, run, write_model

from engine.errors import InvalidRequestError
from engine.output import FinishReason
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput

pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]


def kept_to(kind: str, text: str) -> bool:
    """Whether ``text`` is a whole output of this test's spec of ``kind``."""
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"ax+!", text) is not None  # the Lark grammar below


# Compact JSON (llguidance's own schema option, which vLLM's disable_any_whitespace sets): a random model
# would otherwise write whitespace until max_tokens.
SPECS = {"json": json.dumps({**SCHEMA, "x-guidance": {"whitespace_flexible": False}}), "regex": r"[0-9]{3}-[a-z]{2,4}", "choice": json.dumps(CHOICES),
         "grammar": 'start: "a" rest\nrest: "x"+ "!"'}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("structured-output"))


def params(kind: str, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 200)  # a random model writes much JSON whitespace before it closes
    return SamplingParams(structured_output=StructuredOutput(kind, SPECS[kind]), **kwargs)


def finish(engine, requests: dict) -> dict[str, tuple[str, FinishReason]]:
    """Run ``requests`` to the end: each request's (text, finish reason)."""
    texts: dict[str, str] = {}
    reasons: dict[str, FinishReason] = {}
    for rid, (ids, p) in requests.items():
        engine.add_request(rid, ids, p)
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {rid: (texts[rid], reasons[rid]) for rid in requests}


@pytest.mark.parametrize("kind", list(SPECS))
def test_each_kind_keeps_greedy_and_sampled_outputs_to_its_spec_beside_a_free_request(model_dir, kind):
    engine = make_engine(model_dir)
    free = (prompt(30, seed=99), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    requests = {"free": free}
    for i in range(3):
        requests[f"greedy{i}"] = (prompt(9 + 7 * i, seed=i), params(kind, temperature=0.0))
        requests[f"sampled{i}"] = (prompt(9 + 7 * i, seed=i), params(kind, temperature=1.0, seed=i))
    got = finish(engine, requests)
    for rid, (text, reason) in got.items():
        if rid != "free":
            assert reason is FinishReason.STOP and kept_to(kind, text), (rid, text)
    alone = run(make_engine(model_dir), {"free": free})[("free", 0)]
    assert engine.tokenizer.decode(alone) == got["free"][0]  # the masks touched no other row
    assert engine.stats().free_blocks == engine.stats().total_blocks


def test_forked_samples_each_keep_to_the_spec(model_dir):
    engine = make_engine(model_dir)
    engine.add_request("r", prompt(21, seed=5), params("regex", temperature=1.0, seed=2, n=3))
    texts = ["", "", ""]
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.index] += out.text
    assert all(kept_to("regex", t) for t in texts), texts


def test_a_handed_off_request_continues_the_grammar_its_first_token_began(model_dir):
    """The prefill engine samples the first token under the mask; the decode engine replays it into a fresh
    matcher and gives the tokens one engine gives."""
    ids, p = prompt(37, seed=4), params("json", temperature=0.7, seed=11)
    single = make_engine(model_dir)
    expected = run(single, {"r": (ids, p)})[("r", 0)]

    prefill = make_engine(model_dir)
    prefill.add_request("r", ids, p, prefill_only=True)
    (first,) = prefill.step()
    block_ids = prefill.request_block_ids("r")
    tensor = prefill.kv_cache.export_blocks(block_ids)
    prefill.release("r")
    decode = make_engine(model_dir)
    reserved = decode.reserve_blocks("r", len(ids))
    decode.kv_cache.import_blocks(reserved, tensor)
    decode.add_imported_request("r", ids, first.new_token_ids[0], p, reserved)
    tokens = first.new_token_ids + run(decode, {})[("r", 0)]
    assert tokens == expected
    assert kept_to("json", decode.tokenizer.decode(tokens[:-1]))  # the last token is the EOS


def test_resumed_tokens_continue_the_grammar_and_tokens_that_break_it_are_refused(model_dir):
    engine = make_engine(model_dir)
    ids, p = prompt(15, seed=8), params("regex", temperature=0.0)
    whole = run(engine, {"r": (ids, p)})[("r", 0)]
    resumed = make_engine(model_dir)
    resumed.add_request("r", ids, p, output_ids=whole[:3])
    assert run(resumed, {})[("r", 0)] == whole[3:]

    broken = make_engine(model_dir)
    letters = broken.tokenizer.encode("ab")  # the regex starts with digits
    with pytest.raises(InvalidRequestError) as err:
        broken.add_request("r", ids, p, output_ids=letters)
    assert err.value.field == "output_ids"
    assert not broken.has_unfinished() and broken.stats().free_blocks == broken.stats().total_blocks


def test_an_output_is_free_until_its_start_after_tokens_then_kept(model_dir):
    """A reasoning model's end of thinking (``start_after``): tokens before it are the model's own; once it is
    in the output, the rest keeps to the spec."""
    engine = make_engine(model_dir)
    tok = engine.tokenizer
    spec = StructuredOutput("regex", SPECS["regex"], start_after=tuple(tok.encode("</think>")))
    ids = prompt(15, seed=8)

    def text_after(output_ids: list[int], params: SamplingParams) -> str:
        engine.add_request("r", ids, params, output_ids=output_ids)
        got = ""
        while engine.has_unfinished():
            got += "".join(out.text for out in engine.step())
        return got

    ended = text_after(tok.encode("<think>hm</think>"), SamplingParams(max_tokens=40, temperature=0.0,
                                                                      structured_output=spec))
    assert kept_to("regex", ended), ended
    thinking = tok.encode("<think>hm")
    free = text_after(thinking, SamplingParams(max_tokens=10, temperature=0.0))
    assert text_after(thinking, SamplingParams(max_tokens=10, temperature=0.0, structured_output=spec)) == free
    assert not kept_to("regex", free)


def test_min_tokens_yields_to_a_complete_grammar(model_dir):
    """A choice is complete after one or two tokens; min_tokens cannot hold its EOS back past that."""
    engine = make_engine(model_dir)
    got = finish(engine, {"r": (prompt(12, seed=3), params("choice", temperature=0.0, min_tokens=8))})
    assert got["r"][1] is FinishReason.STOP and got["r"][0] in CHOICES


def test_logprobs_are_the_raw_distribution_not_the_masked_one(model_dir):
    ids = prompt(25, seed=6)
    logprobs: dict[str, list] = {}
    for name, p in {"free": SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, ignore_eos=True),
                    "kept": params("regex", max_tokens=1, temperature=0.0, logprobs=5)}.items():
        engine = make_engine(model_dir)
        engine.add_request(name, ids, p)
        (out,) = engine.step()
        logprobs[name] = out.logprobs[0]
    assert logprobs["kept"].top == logprobs["free"].top
    assert chr(logprobs["kept"].token_id).isdigit()  # byte-level vocabulary: the regex's first character


@pytest.mark.parametrize("kind, spec, fragment", [
    ("json", "{not json", "not valid JSON"),
    ("json", "[1, 2]", "is an object"),
    ("regex", "[0-9", "does not compile"),
    ("choice", "[]", "non-empty list"),
    ("choice", '["a", 1]', "non-empty list"),
    ("grammar", "start: undefined_rule", "does not compile"),
    ("yaml", "a: 1", "kind must be one of"),
])
def test_a_spec_that_does_not_compile_is_refused_by_validate(kind, spec, fragment):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_output=StructuredOutput(kind, spec)).validate()
    assert err.value.field == "structured_output" and fragment in err.value.message


def test_ignore_eos_is_refused_with_a_structured_output():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput("regex", "a+")).validate()
    assert err.value.field == "ignore_eos"
