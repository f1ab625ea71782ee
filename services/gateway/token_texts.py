"""What single token ids read as: their text, and whether they are special tokens. Cached per id."""

from __future__ import annotations

from engine.tokenizer import Tokenizer


class TokenTexts:
    """Per-id text (special tokens spelled out) and special-ness, from the tokenizer's public ``decode``.

    A special token is one that ``decode(skip_special_tokens=True)`` drops. Lookups are memoized for the
    tokenizer's lifetime (at most one entry per vocabulary id); concurrent threads may fill the same entry.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._special: dict[int, bool] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def is_special(self, token_id: int) -> bool:
        special = self._special.get(token_id)
        if special is None:
            special = self._special[token_id] = (
                self.tokenizer.decode([token_id], skip_special_tokens=True) == "" and self.text(token_id) != "")
        return special
