"""Speculative decoding by n-gram prompt lookup (vLLM's "ngram" method), and what any proposer shares (a draft
model's proposer is ``engine/draft_model.py``).

A decoding sequence whose last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) occurred
earlier in its prompt or output proposes the tokens that followed that occurrence (the latest one) as its
draft: up to ``num_speculative_tokens``. The engine then computes the sequence's last token and the draft in
one chunk, samples every position as if the draft were its output, and keeps the draft up to the first
token the sampler disagrees with, plus that sampled token (or one more after a wholly accepted draft). So a
step yields 1..k+1 tokens for the price of one pass over the weights, which is what bounds a memory-bound
decode step; code edits, quoting, retrieval answers and multi-turn chats repeat enough to gain. Under a
structured output the draft is what the grammar forces, if anything (SGLang's jump-forward), else the
n-gram one cut where the grammar would refuse a token, and each position is masked as the grammar stands
there (``Engine._propose_drafts``, ``GrammarMasks.draft_masks``).

Each position is sampled with the random draw plain decoding would give it (the sequence's next draws, in
order; the draws after the first rejection are given back), so the output equals plain decoding's token for
token, seeded sampling included (up to floating-point differences between a chunk's and a decode row's
logits), and the sampled distribution is the model's: this is rejection sampling of a point-mass draft,
whose acceptance probability p(draft) is the optimal one for a draft given as tokens. A draft model does
better than point masses by drafting with those same draws (``engine/draft_model.py``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (engine.config reads SpeculativeConfig from here, and the sampler imports what imports it)
    from engine.sampler import Draws
    from engine.sampling_params import SamplingParams
    from engine.structured_output import GrammarMatcher

_ITEM = array("i").itemsize  # token ids live in C ints, searched as bytes


@dataclass
class DraftRequest:
    """What a proposer is asked for one decoding sequence."""

    seq_id: int
    token_ids: list[int]  # its tokens so far
    max_tokens: int  # the most draft tokens it takes
    params: SamplingParams
    num_prompt_tokens: int
    # The draws its draft's positions are verified with, for a proposer that samples (``samples_drafts``) and
    # a sequence that is not greedy; None otherwise
    draws: Draws | None = None
    rules: DraftRules | None = None  # what its verification refuses, for a proposer that samples


@dataclass
class DraftRules:
    """What the verification refuses at a sequence's next positions besides what its sampling parameters
    shape: the stop tokens ``min_tokens`` holds back, the tokens completing a bad word, and what its structured
    output's grammar rules out. A proposer that samples drafts within them: a draft token they refuse is never
    kept, and costs the rest of its draft."""

    # the tokens refused after the draft so far, given whether the grammar is complete there
    banned: Callable[[list[int], bool], list[int]]
    grammar: GrammarMatcher | None = None  # the sequence's grammar, once started (a draft takes and gives back)


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # the most draft tokens a sequence proposes per step (>= 1)
    prompt_lookup_min: int = 2  # the shortest suffix matched
    prompt_lookup_max: int = 4  # the longest suffix matched (tried first)
    # No drafts in a step while more sequences than this are running: a large batch is compute-bound, so a
    # draft's extra rows cost about what they would save (vLLM's speculative_disable_by_batch_size). None: always.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    def drafts_at(self, batch_size: int) -> bool:
        """Whether a step with ``batch_size`` running sequences drafts at all."""
        return self.disable_by_batch_size is None or batch_size <= self.disable_by_batch_size


@dataclass
class SpeculationStats:
    """Cumulative counts since the engine started (vLLM's spec_decode metrics)."""

    drafts: int = 0  # verification chunks run (a sequence's step with a draft)
    draft_tokens: int = 0  # draft tokens proposed and computed
    accepted_tokens: int = 0  # draft tokens the sampler agreed with
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


class NgramProposer:
    """Drafts from each sequence's own history. The history is kept per sequence as the bytes of C ints and
    only grows (a sequence's tokens are never taken back), so a step appends its new tokens and searches in
    place with ``bytearray.rfind``: linear in the history, at C speed."""

    samples_drafts = False  # a draft is what followed, whatever the sampling

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._history: dict[int, bytearray] = {}  # seq_id -> its tokens so far, as C ints

    def propose_all(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's draft (``propose``)."""
        return [self.propose(r.seq_id, r.token_ids, r.max_tokens) for r in requests]

    def propose(self, seq_id: int, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the longest suffix of
        ``token_ids`` (between the configured lengths); [] when none recurs."""
        limit = min(max_tokens, self.config.num_speculative_tokens)
        if limit <= 0:
            return []
        history = self._history.setdefault(seq_id, bytearray())
        history += array("i", token_ids[len(history) // _ITEM:]).tobytes()  # the tokens since the last step
        total, lo, hi = len(token_ids), self.config.prompt_lookup_min, self.config.prompt_lookup_max

        def latest(n: int) -> int | None:  # the start of the latest earlier occurrence of the last n tokens
            if n > total - 1:
                return None
            return _find_tokens(history, history[(total - n) * _ITEM:], 0, (total - 1) * _ITEM, latest=True)

        def following(start: int) -> list[int]:
            return array("i", history[start * _ITEM:(start + limit) * _ITEM]).tolist()

        shortest = latest(lo)
        if shortest is None:  # then no longer suffix recurs either: one scan for most steps of most sequences
            return []
        for n in range(min(hi, total - 1), lo, -1):
            if (start := latest(n)) is not None:
                return following(start + n)
        return following(shortest + lo)

    def forget(self, seq_id: int) -> None:
        """Drop a finished, aborted or preempted sequence's history (a preempted one's is read again)."""
        self._history.pop(seq_id, None)


class PredictedOutput:
    """A request's predicted output (OpenAI's Predicted Outputs: text the answer is expected to mostly repeat,
    such as a file being edited) as its drafts. A cursor follows the output through the prediction: each output
    token equal to the prediction's next moves it on, a different one loses it, and a lost cursor is found again
    after the longest run of the output's last tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) in the
    prediction, first looking on from where it was lost (an edit's end), then from the start. The draft is what
    follows the cursor. Followed lazily, from the output itself, so steps without drafts and tokens sampled
    elsewhere (a prefill worker's first) are followed too."""

    def __init__(self, prediction: list[int], config: SpeculativeConfig, output_from: int):
        """``output_from``: where the output starts in the sequence's tokens (its prompt's length)."""
        self._tokens = array("i", prediction)
        self._bytes = self._tokens.tobytes()
        self._longest, self._shortest = config.prompt_lookup_max, config.prompt_lookup_min
        self._output_from = output_from
        self._at: int | None = 0  # the output so far ends where the prediction's first ``_at`` tokens do
        self._lost_at = 0  # where the cursor was when it was last lost
        self._followed = output_from  # the sequence's tokens followed

    def draft(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens of the prediction after the sequence's output so far (``token_ids``: its
        prompt and output); [] where the output has left the prediction and its last tokens occur nowhere in
        it, or the prediction is used up."""
        for token in token_ids[self._followed:]:
            if self._at is not None and self._at < len(self._tokens) and self._tokens[self._at] == token:
                self._at += 1
            elif self._at is not None:
                self._lost_at, self._at = self._at, None
        self._followed = len(token_ids)
        if self._at is None:
            self._at = self._find_again(token_ids)
        return [] if self._at is None else self._tokens[self._at:self._at + max_tokens].tolist()

    def _find_again(self, token_ids: list[int]) -> int | None:
        """Where the output's longest recurring suffix ends in the prediction (the class's search order)."""
        for n in range(min(self._longest, len(token_ids) - self._output_from), self._shortest - 1, -1):
            needle = array("i", token_ids[-n:]).tobytes()
            for start in (self._lost_at, 0):
                if (at := _find_tokens(self._bytes, needle, start * _ITEM, len(self._bytes))) is not None:
                    return at + n
        return None


def _find_tokens(data: bytes | bytearray, needle: bytes | bytearray, start: int, end: int,
                 latest: bool = False) -> int | None:
    """The token index of the first (``latest``: the last) occurrence of ``needle`` within bytes
    ``start``..``end`` of ``data``, aligned to whole tokens; None when there is none."""
    while (at := data.rfind(needle, start, end) if latest else data.find(needle, start, end)) >= 0:
        if at % _ITEM == 0:
            return at // _ITEM
        if latest:  # a match straddling tokens: look further back, or on
            end = at + len(needle) - 1
        else:
            start = at + 1
    return None
