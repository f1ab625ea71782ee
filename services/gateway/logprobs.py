"""Token logprobs in OpenAI's two response shapes.

Chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": None}``,
where ``top_logprobs`` are the k most likely tokens. Completions (the legacy shape): ``{tokens,
token_logprobs, top_logprobs, text_offset}``, where each ``top_logprobs`` entry maps token to logprob for the
k most likely tokens and the sampled one (up to k + 1 entries, as OpenAI documents), and ``text_offset`` is
each token's character offset in the choice's text, continued across stream chunks. vLLM's
``prompt_logprobs``: per prompt token, null for the first (nothing predicts it), then ``{token id: {logprob,
rank, decoded_token}}`` for the prompt's token and the k most likely ones (ranks from 1).

A token is named by its text, the token decoded on its own (one holding part of a UTF-8 character reads as
U+FFFD), or as ``token_id:<id>`` when the request sets ``return_tokens_as_token_ids`` (vLLM's extension,
for clients that need the ids); ``bytes`` is the UTF-8 encoding of its text, as vLLM reports them.
"""

from __future__ import annotations

from engine.output import TokenLogprobs
from services.gateway.token_texts import TokenTexts

_FLOOR = -9999.0  # JSON has no -Infinity; a token the model rules out reports this (as vLLM does)


def _logprob(value: float) -> float:
    return max(value, _FLOOR)


class LogprobShapes:
    """One request's logprobs, shaped per choice; ``text_offset`` state is kept per choice."""

    def __init__(self, texts: TokenTexts, as_ids: bool, choices: int) -> None:
        self.texts, self.as_ids = texts, as_ids
        self._offsets = [0] * choices

    def _name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.texts.text(token_id)

    def chat(self, items: list[TokenLogprobs]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self._name(token_id), "logprob": _logprob(logprob),
                    "bytes": list(self.texts.text(token_id).encode("utf-8"))}

        content = [{**entry(it.token_id, it.logprob), "top_logprobs": [entry(t, lp) for t, lp in it.top]}
                   for it in items]
        return {"content": content, "refusal": None}

    def prompt(self, items: list[TokenLogprobs]) -> list[dict | None]:
        """vLLM's ``prompt_logprobs`` of a prompt whose tokens after the first have ``items``."""
        def entry(token_id: int, logprob: float, rank: int | None) -> dict:
            return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": self._name(token_id)}

        return [None, *({str(it.token_id): entry(it.token_id, it.logprob, it.rank),
                          **{str(t): entry(t, lp, place) for place, (t, lp) in enumerate(it.top, 1)
                             if t != it.token_id}} for it in items)]

    def completion(self, index: int, items: list[TokenLogprobs]) -> dict:
        """An echoed prompt's first token has no logprob: null, and null for its top tokens (as OpenAI)."""
        offsets = []
        for it in items:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(self.texts.text(it.token_id))
        top = [None if it.logprob is None else {self._name(t): _logprob(lp) for t, lp in
                                                 (*it.top, (it.token_id, it.logprob))} for it in items]
        return {"tokens": [self._name(it.token_id) for it in items],
                "token_logprobs": [None if it.logprob is None else _logprob(it.logprob) for it in items],
                "top_logprobs": top, "text_offset": offsets}
