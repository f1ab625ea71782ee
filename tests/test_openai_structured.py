"""Structured outputs through the official `openai` client against the live server (one prefill and one
decode worker, so the first token is sampled under the grammar on the prefill side and the rest on the
decode side): OpenAI's response_format and vLLM's structured_outputs on chat and completions, streamed and
not, and every refusal naming its field. (The engine's own tests, test_structured_output.py, cover each
kind in depth.)"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from live_helpers import idle, wait_until
from test_openai_features import CHAT, client

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(120)]

SCHEMA = {"type": "object", "properties": {"creature": {"enum": ["crab", "anemone", "limpet"]},
                                           "count": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["creature", "count"], "additionalProperties": False}


def test_a_chat_answer_keeps_to_a_json_schema_streamed_or_not(live_server):
    c = client(live_server)
    # compact JSON (vLLM's disable_any_whitespace): a random-weight model would write whitespace for long
    kwargs = dict(model=live_server.model_id, messages=CHAT, max_tokens=64, temperature=0.0,
                  extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    whole = c.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in c.chat.completions.create(**kwargs, stream=True))
    assert streamed == whole.choices[0].message.content
    sampled = c.chat.completions.create(**{**kwargs, "temperature": 1.0, "n": 3, "seed": 7})
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert wait_until(lambda: idle(live_server), 30)  # every block back, on both workers


def test_response_format_json_schema_and_json_object_start_a_json_answer(live_server):
    """OpenAI's response_format allows JSON's whitespace (as vLLM does by default), which a random-weight model
    may spend max_tokens on: the answer is JSON when it stops, and starts as its type in any case."""
    c = client(live_server)
    formats = {"{": {"type": "json_schema", "json_schema": {"name": "pool", "schema": SCHEMA, "strict": True}},
               "{ ": {"type": "json_object"}}
    for start, response_format in formats.items():
        resp = c.chat.completions.create(model=live_server.model_id, messages=CHAT, max_tokens=24, temperature=0.0,
                                         response_format=response_format)
        content, reason = resp.choices[0].message.content, resp.choices[0].finish_reason
        assert content.lstrip().startswith(start[0]), content
        if reason == "stop":
            assert isinstance(json.loads(content), dict)
        else:
            assert reason == "length"


def test_completions_keep_to_a_regex_and_a_choice(live_server):
    c = client(live_server)
    regex = c.completions.create(model=live_server.model_id, prompt=["Tide at ", "Pool "], max_tokens=16,
                                 temperature=1.0, seed=3, n=2, extra_body={"structured_outputs": {"regex": r"[0-9]{2}:[0-5][0-9]"}})
    assert len(regex.choices) == 4
    assert all(re.fullmatch(r"[0-9]{2}:[0-5][0-9]", ch.text) and ch.finish_reason == "stop" for ch in regex.choices)
    choices = ["crab", "anemone", "sea star"]
    streamed = c.completions.create(model=live_server.model_id, prompt="The best creature is", max_tokens=8,
                                    stream=True, extra_body={"structured_outputs": {"choice": choices}})
    assert "".join(chunk.choices[0].text for chunk in streamed) in choices


@pytest.mark.parametrize("fields, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}}, "response_format",
     "json_schema goes with"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                 "format": "v2"}}}, "response_format", "format"),
    ({"extra_body": {"structured_outputs": {"regex": "[0-9"}}}, "structured_outputs", "does not compile"),
    ({"extra_body": {"structured_outputs": {"json": {"type": "object", "minProperties": "2"}}}}, "structured_outputs",
     "does not compile"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: missing"}}}, "structured_outputs", "does not compile"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs", "non-empty"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs", "exactly one"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}}, "structured_outputs",
     "only applies"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}}, "structured_outputs",
     "whitespace_pattern"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs", "only one"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos", "EOS"),
])
def test_a_structured_output_that_cannot_be_kept_is_a_400_naming_its_field(live_server, fields, param, fragment):
    kwargs = {"model": live_server.model_id, "messages": CHAT, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as exc:
        client(live_server).chat.completions.create(**kwargs)
    assert exc.value.param == param and fragment in exc.value.message, exc.value.message
