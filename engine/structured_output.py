"""Structured outputs: a sample's text kept to a JSON schema, a regular expression, a list of choices or a
grammar (Lark or GBNF), as OpenAI's ``response_format`` and vLLM's ``structured_outputs`` ask.

The spec travels as plain strings in ``SamplingParams.structured_output`` (it pickles to the workers and is
checked at the gateway). Each engine compiles it with llguidance (the Rust library behind vLLM's "guidance"
backend) into one matcher per sample. Before each sampling step the matchers give the tokens each
constrained row may take next, as a bitmask over the vocabulary (computed before the forward pass, so it
overlaps a GPU's kernels); the row's other logits become -inf and the sampled token advances the matcher. Once the grammar is complete only end-of-sequence tokens remain, so the
sample ends as any other does. A sample that began elsewhere (the prefill worker sampled its first token, or
a failed worker's tokens are resumed) replays its tokens into a fresh matcher.

llguidance is imported only where it is installed: the engine also runs without it (the GPU check's bare
CUDA machine), and then refuses structured outputs with a 400. Torch is needed only by
``GrammarMasks.fill`` and ``apply``, so the gateway can check specs without it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# json: a JSON schema (text); regex: a regular expression (Rust's syntax) the whole output matches; choice: a
# JSON list of strings, the output being one of them; grammar: a Lark grammar, or a GBNF one (llama.cpp's).
KINDS = ("json", "regex", "choice", "grammar")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a bare engine install; serving installs it (pyproject)
        raise InvalidRequestError("structured_output", "this server cannot keep to a structured output: the "
                                                       "llguidance package is not installed") from exc
    return llguidance


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of KINDS
    spec: str
    # The spec applies to what follows the first occurrence of these tokens in the output (a reasoning model's
    # end of thinking, "</think>": the gateway sets it), and the output is free until then; empty: from the
    # first token.
    start_after: tuple[int, ...] = ()

    def validate(self) -> None:
        """InvalidRequestError("structured_output", why) for an unknown kind or a spec that does not compile."""
        if not isinstance(self.start_after, tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.start_after):
            raise InvalidRequestError("structured_output", f"start_after must be a tuple of token ids, got "
                                                           f"{self.start_after!r}")
        compile_grammar(self.kind, self.spec)


@functools.lru_cache(maxsize=256)  # each worker checks and compiles the same spec: once each
def compile_grammar(kind: str, spec: str) -> str:
    """llguidance's grammar for a structured output; InvalidRequestError when it does not compile."""
    if kind not in KINDS:
        raise InvalidRequestError("structured_output", f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidRequestError("structured_output", f"the {kind} spec is empty")
    llguidance = _llguidance()
    if kind == "choice":
        choices = _json(spec, "choice")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("structured_output", "choice must be a non-empty list of non-empty strings")
    elif kind == "json" and not isinstance(_json(spec, "json schema"), dict | bool):
        raise InvalidRequestError("structured_output", "a JSON schema is an object (or true / false)")
    try:
        grammar = llguidance.grammar_from(kind, spec)
    except ValueError as exc:  # GBNF that does not convert, a schema that is not an object
        raise InvalidRequestError("structured_output", str(exc)) from exc
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError("structured_output", f"the {kind} spec does not compile: {error}")
    return grammar


def _json(spec: str, what: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError("structured_output", f"the {what} is not valid JSON: {exc}") from exc


class GrammarMatcher:
    """One sample's position in its grammar; before its ``start_after`` tokens have been sampled (if it has
    them), not active: the output is free and ``matcher`` is None."""

    def __init__(self, start: Callable[[], Any], start_after: tuple[int, ...]):
        self._start = start  # a fresh llguidance matcher
        self._start_after = start_after
        self._recent: list[int] = []  # the output's last tokens, while waiting for start_after
        self.matcher: Any = None if start_after else start()

    def advance(self, token_id: int) -> None:
        """Take a sampled token (always one the mask allowed; a later mask step may still fail, see
        ``GrammarMasks.fill``)."""
        if self.matcher is None:
            self._recent = [*self._recent, token_id][-len(self._start_after):]
            if tuple(self._recent) == self._start_after:
                self.matcher = self._start()
        elif not self.matcher.consume_token(token_id):
            log.warning("structured output: token %d refused: %s", token_id, self.matcher.get_error())

    @property
    def started(self) -> bool:
        """Whether the grammar constrains the output yet (it waits for its ``start_after`` tokens, if any)."""
        return self.matcher is not None

    @property
    def complete(self) -> bool:
        """Whether the grammar can take nothing more than an end-of-sequence token."""
        return self.matcher is not None and self.matcher.is_stopped()

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows next and nothing else (a draft that cannot miss, as SGLang's
        jump-forward); [] when the next token is a choice, or the grammar has not started."""
        return [] if self.matcher is None else self.matcher.compute_ff_tokens()

    def take_draft(self, token_id: int) -> bool:
        """Advance a started grammar by a draft token, to be given back (``give_back``); False, and not taken,
        when the grammar refuses it (taking it would leave the matcher in error)."""
        if self.matcher.validate_tokens([token_id]) != 1:
            return False
        return self.matcher.consume_token(token_id)

    def give_back(self, count: int) -> None:
        """Return the last ``count`` draft tokens taken (``take_draft``)."""
        if count:
            self.matcher.rollback(count)

    def draft_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` a draft may keep: those the grammar accepts in a row; before it starts,
        those ahead of the token that would start it (the position after that one needs its first mask)."""
        if self.matcher is not None:
            return self.matcher.validate_tokens(tokens)
        recent = list(self._recent)
        for i, token in enumerate(tokens):
            recent = [*recent, token][-len(self._start_after):]
            if tuple(recent) == self._start_after:
                return i
        return len(tokens)


class GrammarMasks:
    """One engine's side of structured outputs: the vocabulary as llguidance sees it, a matcher per
    constrained sample, and the per-step mask over a batch's logits."""

    def __init__(self, tokenizer_file: Path | None, vocab_size: int, eos_token_ids: list[int]):
        """``tokenizer_file``: the checkpoint's tokenizer.json (None: it has none)."""
        self._tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's vocabulary
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._executor: Any = None
        # Built now where llguidance is installed (0.3 s for a 49k vocabulary here), not in the middle of a
        # batch's step when the first structured request arrives.
        if tokenizer_file is not None:
            with contextlib.suppress(InvalidRequestError):  # llguidance is not installed: refused per request
                self._build_tokenizer()

    def _build_tokenizer(self) -> None:
        llguidance = _llguidance()
        if self._tokenizer_file is None:
            raise InvalidRequestError("structured_output", "this model has no tokenizer.json to match a "
                                                           "structured output against")
        self._tokenizer = llguidance.LLTokenizer(str(self._tokenizer_file), n_vocab=self.vocab_size,
                                                 eos_token=self._eos)
        self._executor = llguidance.LLExecutor()

    def matcher(self, spec: StructuredOutput, output_ids: list[int] | tuple[int, ...] = ()) -> GrammarMatcher:
        """A fresh matcher for ``spec`` that has taken ``output_ids`` (tokens sampled elsewhere);
        InvalidRequestError when the spec does not compile or the tokens break it."""
        grammar = compile_grammar(spec.kind, spec.spec)
        llguidance = _llguidance()
        if self._tokenizer is None:
            self._build_tokenizer()
        tokenizer = self._tokenizer
        matcher = GrammarMatcher(lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0), spec.start_after)
        if matcher.matcher is not None and matcher.matcher.is_error():  # a grammar this vocabulary cannot meet
            raise InvalidRequestError("structured_output", matcher.matcher.get_error())
        for token in output_ids:
            matcher.advance(token)
            if matcher.matcher is not None and matcher.matcher.is_error():
                raise InvalidRequestError("output_ids", f"the tokens already sampled break the {spec.kind} spec: "
                                                        f"{matcher.matcher.get_error()}")
        return matcher

    def fill(self, matchers: list[GrammarMatcher | None]) -> torch.Tensor | None:
        """The tokens each row may take next, as an int32 bitmask ``[rows, ceil(vocab / 32)]`` on the CPU (all
        ones for a row without a matcher); None when no row has one. The engine calls it before the forward
        pass, so on a GPU this CPU work overlaps the kernels."""
        rows = [r for r, m in enumerate(matchers) if m is not None and m.matcher is not None]
        if not rows:
            return None
        bitmask = self._all_allowed(len(matchers))
        # llguidance fills the rows in parallel, straight into the tensor's memory (its torch helper's way,
        # without importing that helper's torch.compile).
        self._executor.unsafe_compute_mask_ptr([(matchers[r].matcher, r) for r in rows], bitmask.data_ptr(),
                                               bitmask.shape[1] * 4, len(matchers))
        for r in rows:
            self._end_on_error(matchers[r].matcher, bitmask[r])
        return bitmask

    def draft_masks(self, grammar: GrammarMatcher, draft: list[int]) -> tuple[torch.Tensor | None, list[bool]]:
        """The bitmask of each position of a draft's chunk (``len(draft) + 1`` rows: before each draft token,
        then after the last; ``draft`` is one ``draft_prefix`` allowed), and whether the grammar is complete
        at each; (None, all False) before the grammar starts (the draft stops short of its start). The
        matcher takes the draft and gives it back: the kept tokens advance it as sampled ones do."""
        m = grammar.matcher
        if m is None:
            return None, [False] * (len(draft) + 1)
        bitmask, complete = self._all_allowed(len(draft) + 1), []
        for j in range(len(draft) + 1):
            m.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), bitmask.shape[1] * 4)
            self._end_on_error(m, bitmask[j])
            complete.append(m.is_stopped())
            if j < len(draft):
                m.consume_token(draft[j])
        m.rollback(len(draft))
        return bitmask, complete

    def allowed_rows(self, bitmask: torch.Tensor | None, rows: int) -> torch.Tensor:
        """``bitmask``, or ``rows`` rows allowing every token when it is None (an unconstrained sample beside
        constrained ones)."""
        return self._all_allowed(rows) if bitmask is None else bitmask

    def _all_allowed(self, rows: int) -> torch.Tensor:
        return all_allowed(rows, self.vocab_size)

    def _end_on_error(self, matcher: Any, row: torch.Tensor) -> None:
        """A matcher that failed (a grammar past llguidance's per-step limits) allows only end-of-sequence
        tokens, ending its sample."""
        if matcher.is_error():
            log.warning("structured output: ended early: %s", matcher.get_error())
            row.zero_()
            for eos in self._eos:
                row[eos // 32] |= _bit(eos % 32)

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """``logits [rows, vocab]`` with what ``bitmask`` (``fill``'s, one row each) rules out at -inf: a copy,
        as the input stays raw for logprobs."""
        import torch

        from engine.to_device import device_copy

        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        bits = device_copy(bitmask, logits.device)  # (an async-scheduled step's forward pass is still running)
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :logits.shape[1]]
        return logits.masked_fill(~allowed, float("-inf"))


def all_allowed(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask (``GrammarMasks.fill``'s layout) of ``rows`` rows allowing every token."""
    import torch

    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def _bit(k: int) -> int:
    """Bit ``k`` of an int32 word (bit 31 is the sign bit)."""
    return 1 << k if k < 31 else -(1 << 31)
