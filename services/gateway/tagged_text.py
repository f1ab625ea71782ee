"""Splitting text that streams in at a tag (``<tool_call>``, ``</think>``) that may arrive in pieces."""

from __future__ import annotations

from typing import Protocol


def split_at(text: str, tag: str) -> tuple[str, str, bool]:
    """(text before ``tag``, text after it, True), or when ``text`` holds no ``tag``: (what can be released,
    the tail held back because it may begin ``tag``, False)."""
    at = text.find(tag)
    if at >= 0:
        return text[:at], text[at + len(tag):], True
    keep = next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)
    return text[:len(text) - keep], text[len(text) - keep:], False


class StreamParser(Protocol):
    """Reads an answer as it streams: ``feed`` each piece, ``finish`` at the end; each returns a pair of
    outputs (for example content and tool calls) that add up piece by piece."""

    def feed(self, text: str) -> tuple: ...

    def finish(self) -> tuple: ...


def parsed(parser: StreamParser, text: str, final: bool) -> tuple:
    """``parser``'s outputs for ``text`` and, when ``final``, for what it still held back."""
    first = parser.feed(text)
    if not final:
        return first
    rest = parser.finish()
    return first[0] + rest[0], first[1] + rest[1]
