"""A reasoning model's thinking, split from its answer (vLLM's ``--reasoning-parser``).

Reasoning models write their thinking between ``<think>`` and ``</think>``, then the answer. Qwen3 writes
both tags itself (with ``enable_thinking: false`` its template writes an empty pair into the prompt, and the
answer has none); DeepSeek-R1, and Qwen3's thinking-only releases, whose templates open the block in the
prompt, write only the closing one. The thinking goes out as ``reasoning_content`` (DeepSeek's API name,
which vLLM uses), the rest as ``content``; an answer cut short inside the block is all thinking. A structured
output applies to the answer after the thinking (``after_thinking``), as vLLM applies it.
"""

from __future__ import annotations

import dataclasses

from engine.structured_output import StructuredOutput
from services.gateway.tagged_text import parsed, split_at

THINK, END_THINK = "<think>", "</think>"
# --reasoning-parser choices: whether the answer starts inside the thinking block (its opening tag in the prompt)
PARSERS = {"qwen3": False, "deepseek_r1": True}


class ReasoningParser:
    """One choice's answer: ``feed`` each new piece of text, ``finish`` at its end; both return (reasoning,
    content) released."""

    def __init__(self, kind: str) -> None:
        self._pending = ""  # text not released yet: a possible start of a tag
        self._opened = False  # past the start, where an opening tag may stand
        self._thinking = PARSERS[kind]
        self._done = False  # past the closing tag: all the rest is content

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        if not self._opened:
            start = self._pending.lstrip()
            if start.startswith(THINK):
                self._pending, self._thinking = start[len(THINK):], True
            elif THINK.startswith(start):  # (only whitespace, or a piece of the tag, so far)
                return "", ""
            self._opened = True
        if self._done:
            content, self._pending = self._pending, ""
            return "", content
        if not self._thinking:
            return self._answer()
        reasoning, self._pending, self._done = split_at(self._pending, END_THINK)
        if not self._done:
            return reasoning, ""
        return reasoning, self.feed("")[1]

    def _answer(self) -> tuple[str, str]:
        self._done = True
        content, self._pending = self._pending, ""
        return "", content

    def finish(self) -> tuple[str, str]:
        """What was held back: thinking when the answer ended inside the block, else content."""
        rest, self._pending = self._pending, ""
        return (rest, "") if self._thinking and not self._done else ("", rest)


def parse_reasoning(kind: str, text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    return parsed(ReasoningParser(kind), text, final=True)


def after_thinking(spec: StructuredOutput, prompt_ids: list[int], think_ids: list[int],
                   end_ids: list[int]) -> StructuredOutput:
    """``spec`` for a reasoning model's answer: from its first token when the prompt has closed the thinking
    block already (Qwen3's template with ``enable_thinking: false``), else once the answer has written
    ``end_ids`` (``</think>``), so the model thinks freely first. ``think_ids``: ``<think>``'s tokens."""
    if _last(prompt_ids, end_ids) > _last(prompt_ids, think_ids):
        return spec
    return dataclasses.replace(spec, start_after=tuple(end_ids))


def _last(ids: list[int], sub: list[int]) -> int:
    """Where ``sub`` last starts in ``ids``; -1 if nowhere."""
    n = len(sub)
    return next((i for i in range(len(ids) - n, -1, -1) if ids[i:i + n] == sub), -1)
