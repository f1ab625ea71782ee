"""Reasoning parsers (``--reasoning-parser qwen3 | deepseek_r1``): a reasoning model's thinking split from its
answer as it streams, and the response shapes it gives (``reasoning_content`` beside ``content``, before any
tool calls are read from the answer). A random-weight model writes no thinking, so the shapes are checked on
the gateway's own Generation fed with token events; the live server's side is in test_openai_tools.py."""

from __future__ import annotations

import pytest
from test_openai_tools import shaped

from engine.structured_output import StructuredOutput
from services.gateway.reasoning import ReasoningParser, after_thinking, parse_reasoning

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("kind, answer, reasoning, content", [
    ("qwen3", "<think>\nTide is low.\n</think>\n\nGo now.", "\nTide is low.\n", "\n\nGo now."),
    ("qwen3", "\n<think>a</think>b", "a", "b"),
    ("qwen3", "Go now.", "", "Go now."),  # thinking off: the template wrote the empty block into the prompt
    ("qwen3", "<thinking> is a word", "", "<thinking> is a word"),
    ("qwen3", "<think>cut short", "cut short", ""),  # the answer ended inside the block
    ("deepseek_r1", "Tide is low.</think>Go now.", "Tide is low.", "Go now."),  # the block opened in the prompt
    ("deepseek_r1", "<think>a</think>b", "a", "b"),
    ("deepseek_r1", "still thinking", "still thinking", ""),
])
def test_thinking_is_split_from_the_answer_whole_or_streamed_a_character_at_a_time(kind, answer, reasoning,
                                                                                   content):
    assert parse_reasoning(kind, answer) == (reasoning, content)
    parser, got = ReasoningParser(kind), ("", "")
    for ch in answer:
        r, c = parser.feed(ch)
        assert "</think" not in r  # a tag is never released in pieces
        got = (got[0] + r, got[1] + c)
    rest = parser.finish()
    assert (got[0] + rest[0], got[1] + rest[1]) == (reasoning, content)


def test_reasoning_content_streams_before_the_answer_and_stands_beside_it_whole():
    answer = "<think>Low tide at noon.</think>Go at noon."
    choices, whole = shaped([answer[i:i + 5] for i in range(0, len(answer), 5)], tool_calls=None, reasoning="qwen3")
    assert "".join(c["delta"].get("reasoning_content", "") for c in choices) == "Low tide at noon."
    assert "".join(c["delta"].get("content", "") for c in choices) == "Go at noon."
    last_thought = max(i for i, c in enumerate(choices) if "reasoning_content" in c["delta"])
    assert all("content" not in c["delta"] for c in choices[:last_thought])  # thinking first
    assert whole["message"] == {"role": "assistant", "content": "Go at noon.", "reasoning_content": "Low tide at noon."}


def test_tool_calls_are_read_from_the_answer_after_the_thinking():
    answer = '<think>I need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    choices, whole = shaped([answer[i:i + 9] for i in range(0, len(answer), 9)], reasoning="qwen3")
    message = whole["message"]
    assert message["reasoning_content"] == "I need the weather." and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert whole["finish_reason"] == "tool_calls"
    streamed = [call for c in choices for call in c["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["arguments"]) for c in streamed] == [(0, '{"city": "Oslo"}')]


THINK, END = [7, 8], [9]  # a two-token <think> and a one-token </think>


@pytest.mark.parametrize("prompt, waits", [
    ([1, 2, 3], True),  # Qwen3 thinking: the model opens and closes the block itself
    ([1, *THINK, 4], True),  # DeepSeek-R1: the template opened the block
    ([1, *THINK, 5, *END, 6], False),  # Qwen3 with enable_thinking false: an empty block, closed in the prompt
    ([1, *THINK, *END, 2, *THINK], True),  # an earlier turn's block is closed, this one is open
])
def test_a_structured_output_waits_for_the_end_of_thinking_unless_the_prompt_closed_it(prompt, waits):
    spec = StructuredOutput("regex", "[0-9]+")
    assert after_thinking(spec, prompt, THINK, END) == (StructuredOutput("regex", "[0-9]+", (9,)) if waits else spec)
