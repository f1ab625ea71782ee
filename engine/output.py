"""What a step hands out for each sample, and the text and stop handling behind it.

``RequestOutput`` carries a sample's new token, its text and, when the sample ends, a ``FinishReason``.
``check_finish`` decides whether a sampled token ends the sample (stop token, stop string, length, or
the end of a prefill-only request). ``OutputText`` detokenizes a sample's tokens incrementally, cuts a
matched stop string and what follows it (OpenAI semantics), and holds back text that could still become
a stop string until it can't. Torch-free: the services that relay outputs need not load torch.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Set
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

DETOKENIZER_CONTEXT = 4  # prompt tokens decoded ahead of the output so the first word spaces right


class FinishReason(enum.StrEnum):
    """A str, so comparisons with the plain strings and JSON encoding keep working."""

    STOP = "stop"  # a stop token, an EOS token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"
    PREFILLED = "prefilled"  # a prefill-only request sampled its first token; its blocks are kept


def pickled_by_fields(cls: type) -> type:
    """Class decorator for a dataclass streamed in bulk (every token's event crosses to the gateway): its
    instances pickle as the class and their field values in order, not their ``__dict__`` (no keys; unpickling
    calls the constructor instead of setting attributes one by one): a step's 256 token events pickled in a third
    less time, and unpickled in a quarter of it."""
    values = operator.attrgetter(*(f.name for f in dataclasses.fields(cls)))

    def __reduce__(self) -> tuple:
        return cls, values(self)

    cls.__reduce__ = __reduce__
    return cls


@pickled_by_fields
@dataclass(frozen=True)
class TokenLogprobs:
    """A token's logprob and the ``k`` most likely tokens' at its position, from the model's raw distribution.

    Plain ints and floats (it crosses process boundaries inside ``TokenEvent`` and ``PrefillResult``)."""

    token_id: int
    logprob: float | None  # None: a prompt's first token, which nothing before it predicts (an echoed prompt)
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    rank: int | None = None  # the token's place in the distribution, 1 = the most likely (vLLM's prompt_logprobs)


@dataclass
class RequestOutput:
    request_id: str
    index: int  # which of the request's n samples
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None  # per new token, when the request asked for them
    # New text (when the model has a tokenizer). A matched stop string and what follows it are cut
    # (OpenAI semantics), and text that could still become a stop string is held back until it can't.
    text: str = ""
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the sample
    # With the first token, when the request asked for prompt logprobs: one per prompt token after the first
    # (nothing predicts the first), each with the prompt_logprobs most likely tokens at its position.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Draft tokens of the request's predicted output this output's step verified: kept, and not kept
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # An embedding request's vector (``engine/pooling.py``), in its one output; None: a generation
    embedding: list[float] | None = None


class OutputText:
    """One sample's output text: pushed token by token, handed out by ``emit``."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams):
        self._detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens,
                                                   context=prompt_ids[-DETOKENIZER_CONTEXT:])
        self._stop = params.stop
        self._keep_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1  # what might begin a stop string
        self.text = ""
        self._sent = 0  # characters of ``text`` already handed out

    def push(self, token_id: int, match: bool = True) -> str | None:
        """Add a sampled token's text; returns the stop string it completes (the text is cut before it), when
        ``match``."""
        before = len(self.text)
        self.text += self._detokenizer.push(token_id)
        if match and self._stop and len(self.text) > before:
            return self._match_stop(before)
        return None

    def flush(self) -> None:
        """Take in text the detokenizer still holds (an incomplete character at the end of generation)."""
        self.text += self._detokenizer.flush()

    def emit(self, final: bool) -> str:
        """Text not handed out yet: all of it when the sample is done, else all but a tail that might
        begin a stop string."""
        visible = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        new = self.text[self._sent:visible]
        self._sent = max(self._sent, visible)
        return new

    def _match_stop(self, before: int) -> str | None:
        """Cut ``text`` at the earliest stop string that text from ``before`` on completes (after it, with
        include_stop_str_in_output)."""
        longest = max(len(s) for s in self._stop)
        lo = max(0, before - longest + 1)
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, lo)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[:i + len(s) if self._keep_stop else i]
        return s


def check_finish(token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: Set[int],
                 text: OutputText | None, prefill_only: bool) -> tuple[FinishReason | None, int | str | None]:
    """(why the sample ends with ``token_id``, or None; the stop token or stop string that ended it).

    ``num_output_tokens`` counts ``token_id``. The token's text goes into ``text`` unless it is a stop
    token, whose text is not output. Nothing stops the first ``params.min_tokens`` tokens but their count
    (the sampler kept stop tokens out of them; a stop string they hold is not matched, as in vLLM)."""
    may_stop = num_output_tokens > params.min_tokens
    if may_stop and (token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids)):
        return FinishReason.STOP, token_id
    if text is not None and (stop := text.push(token_id, match=may_stop)) is not None:
        return FinishReason.STOP, stop
    if num_output_tokens >= params.max_tokens:
        if text is not None:
            text.flush()
        return FinishReason.LENGTH, None
    return (FinishReason.PREFILLED if prefill_only else None), None
