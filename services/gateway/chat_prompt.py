"""A chat's prompt tokens, with message text kept as text.

The chat template writes role markers and turn ends as special-token strings (the tiny model's
``<|user|>``, ``<|eot|>``), and the tokenizer turns every such string into its special token. Message
content must not get that treatment, or a user could end their turn and write the assistant's (or the
system's) part. So after the usual render-and-encode, special-token strings that lie inside a message's
content are encoded again as plain text. The tokenizer splits its input at special tokens anyway, so only
those strings' own tokens change. Locating the content needs a template that copies message content
verbatim; one that rewrites it, where such strings occur, is refused with a 400.
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Callable

from engine.errors import InvalidRequestError
from services.gateway.token_texts import TokenTexts
from services.messages import SessionSequence

Render = Callable[[list[dict]], str]  # messages -> the prompt text the chat template renders for them


def encode_chat(texts: TokenTexts, messages: list[dict], previous: SessionSequence | None = None,
                template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                continue_final: bool = False) -> list[int]:
    """Token ids of ``messages`` through the chat template, ready for generation (blocking: run it in a
    thread for long prompts). ``template_kwargs``: further template variables (vLLM's chat_template_kwargs).
    ``add_generation_prompt``: end with the template's opening of the assistant's turn; ``continue_final``
    (without it): end where the final message's content ends instead, so the answer continues that text
    (vLLM's continue_final_message; InvalidRequestError when the template rewrites content, as the end of
    that text cannot then be found).

    ``previous``: the session turn whose reply is the last assistant message of ``messages``. Its token ids
    are kept as they were, and only the text after the reply is encoded: encoding the reply's text again
    may give other tokens (BPE merges across the boundary; a random model's invalid UTF-8, decoded as
    U+FFFD), and the turn's KV, in the pool under its own tokens, would then be recomputed.
    """
    render = functools.partial(texts.tokenizer.apply_chat_template, add_generation_prompt=add_generation_prompt,
                               **(template_kwargs or {}))
    prompt = render(messages)
    spans = None
    if continue_final:
        try:
            spans = _content_spans(render, messages, prompt)
        except InvalidRequestError:
            raise InvalidRequestError("continue_final_message", "this model's chat template rewrites message "
                                      "content, so the final message's text cannot be continued") from None
        prompt = prompt[:spans[-1][1]]
    kept = None if previous is None else _continued(texts, render, messages, prompt, previous)
    if kept is not None:
        ids, start = kept
        return ids + _encode(texts, render, messages, prompt, start, spans)
    return _encode(texts, render, messages, prompt, 0, spans)


def _continued(texts: TokenTexts, render: Render, messages: list[dict], prompt: str,
               previous: SessionSequence) -> tuple[list[int], int] | None:
    """(the previous turn's ids, where in ``prompt`` the text after its reply starts), when ``prompt``
    renders that turn exactly (its prompt's text, then its reply's); None otherwise."""
    tokenizer = texts.tokenizer
    reply_at = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if reply_at is None:
        return None
    try:
        start, end = _content_spans(render, messages, prompt)[reply_at]
        if prompt[:start] != render(messages[:reply_at]):
            return None
    except InvalidRequestError:  # content rewritten: no exact place for the reply; or a history the template refuses
        return None
    reply = previous.ids[previous.prompt_len:]
    while reply and texts.is_special(reply[-1]):  # an end-of-turn token: the template writes its own
        reply = reply[:-1]
    if tokenizer.decode(reply) != messages[reply_at]["content"]:  # e.g. a stop string cut the text
        return None
    return previous.ids[:previous.prompt_len] + reply, end


def _encode(texts: TokenTexts, render: Render, messages: list[dict], prompt: str, start: int,
            spans: list[tuple[int, int]] | None = None) -> list[int]:
    """Token ids of ``prompt[start:]``, special-token strings inside message content encoded as text
    (``spans``: the contents' places, when known already)."""
    tokenizer = texts.tokenizer
    ids = tokenizer.encode(prompt[start:])
    specials = {texts.text(t) for t in set(ids) if texts.is_special(t)}
    forged = {s for s in specials if any(s in m["content"] for m in messages)}
    if not forged:
        return ids
    pattern = re.compile("|".join(re.escape(s) for s in sorted(forged, key=len, reverse=True)))
    out: list[int] = []
    done = start  # characters of ``prompt`` encoded so far
    for span_start, span_end in spans or _content_spans(render, messages, prompt):
        for match in pattern.finditer(prompt, max(span_start, start), max(span_end, start)):
            out += tokenizer.encode(prompt[done:match.start()]) + _encode_plain(texts, match.group())
            done = match.end()
    return out + tokenizer.encode(prompt[done:])


def _content_spans(render: Render, messages: list[dict], prompt: str) -> list[tuple[int, int]]:
    """Where each message's content lies in ``prompt``: the template is rendered again with a marker
    in place of each content, and the real prompt must be that skeleton with the contents put back."""
    marker = f"\x00{uuid.uuid4().hex}"
    marked = [{**m, "content": f"{marker}{i}\x00"} for i, m in enumerate(messages)]
    skeleton = render(marked)
    pieces = re.split(re.escape(marker) + r"(\d+)\x00", skeleton)
    # pieces: text, content index, text, content index, ..., text
    order = [int(i) for i in pieces[1::2]]
    spans, pos, rebuilt = [], 0, []
    for k, text in enumerate(pieces[0::2]):
        rebuilt.append(text)
        pos += len(text)
        if k < len(order):
            content = messages[order[k]]["content"]
            spans.append((pos, pos + len(content)))
            rebuilt.append(content)
            pos += len(content)
    if order != list(range(len(messages))) or "".join(rebuilt) != prompt:
        raise InvalidRequestError("messages", "message content holds special-token text, and this model's "
                                  "chat template rewrites message content, so it cannot be kept as plain text")
    return spans


def _encode_plain(texts: TokenTexts, text: str) -> list[int]:
    """``text`` (a special token's string) as ordinary tokens: encoded from its second character on, its
    first on its own, so the tokenizer no longer sees the special token in it."""
    ids = texts.tokenizer.encode(text)
    if not any(texts.is_special(t) for t in ids) or len(text) == 1:
        return ids
    return texts.tokenizer.encode(text[0]) + _encode_plain(texts, text[1:])
