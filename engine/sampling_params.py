"""Sampling parameters of one request: what the gateway validates and the engine samples with.

Torch-free, so the gateway and the dispatcher can build and check them without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput

# Temperatures below this are greedy (dividing by ~0 only overflows).
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's range; above it sampling is close to uniform noise
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: +-100 bans or forces a token


# A waiting request's place among an engine's waiting prompts, lower first: (the request's own priority, as
# vLLM's request priority, then the order the router sent requests in, whose TTFT estimates assume it).
Priority = tuple[int, int]

@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p x the most likely one are never drawn (0: off)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the output text
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the text stays in it
    skip_special_tokens: bool = True  # vLLM's: special tokens (a chat template's markers) have no text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's: the first min_tokens output tokens are never a stop token (EOS unless ignore_eos, stop_token_ids)
    # nor complete a stop string.
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None  # None: off; k: the sampled token's logprob plus the top k
    # None: off; k: each prompt token's logprob (after the first) plus the top k at its position (vLLM's
    # prompt_logprobs). The prompt is then computed whole: a prefix-cache hit has no logits.
    prompt_logprobs: int | None = None
    # OpenAI: subtracted from the logit of every token the output already holds (presence: once;
    # frequency: once per occurrence).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF / vLLM: logits of tokens in the prompt or the output are divided by it (multiplied when negative).
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, added to its logit)
    # vLLM's: the only tokens the output may hold (None: any); not with a structured output, which masks too
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words, as token sequences (the gateway encodes each word, also after a space): a sequence's
    # last token is never drawn where it would complete the sequence (a one-token word: never)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # The output kept to a JSON schema, regex, choice list or grammar (engine/structured_output.py); None: free.
    structured_output: StructuredOutput | None = None
    # OpenAI's predicted output, as token ids: drafts for an engine that speculates (engine/speculative.py's
    # PredictedOutput), verified as any draft, so it changes how fast the output comes, never the output
    prediction_ids: list[int] = field(default_factory=list)
    # vLLM's: the prompt's blocks are hashed under it too (kvstore.hashing.salt_for), so only requests that send
    # the same salt share cached prefixes. A tenant's secret, not a sampling choice, but it travels with these.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI accepts one string or a list
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the sequence's token history."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise ``InvalidRequestError(field, message)`` for the first bad parameter."""
        def bad(name: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(name, message)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v: object) -> bool:  # NaN and infinities are refused everywhere
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        for flag in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, f"must be true or false, got {getattr(self, flag)!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}")
        if not is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1] (0 = off), got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise bad(name, f"must be in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0 (1 = off), got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, list | tuple) or not all(
                isinstance(e, list | tuple) and len(e) == 2 and is_int(e[0]) and e[0] >= 0 and is_number(e[1])
                and abs(e[1]) <= MAX_LOGIT_BIAS for e in self.logit_bias):
            raise bad("logit_bias", f"must map token ids to biases in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise bad("stop", "stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list | tuple) or not all(is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be a list of integers, got {self.stop_token_ids!r}")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list | tuple) or not self.allowed_token_ids or not all(
                    is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", f"must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
            if self.structured_output is not None:
                raise bad("allowed_token_ids", "cannot be combined with a structured output (it decides the tokens)")
        if not isinstance(self.bad_words_token_ids, list | tuple) or not all(
                isinstance(s, list | tuple) and s and all(is_int(t) and t >= 0 for t in s) for s in self.bad_words_token_ids):
            raise bad("bad_words", f"must be token sequences, got {self.bad_words_token_ids!r}")
        if not isinstance(self.prediction_ids, list | tuple) or not all(is_int(t) and t >= 0
                                                                      for t in self.prediction_ids):
            raise bad("prediction", f"must be a list of token ids, got {self.prediction_ids!r}")
        if self.bad_words_token_ids and (self.structured_output is not None or self.allowed_token_ids is not None):
            # either could leave only banned tokens: a row with nothing to draw
            raise bad("bad_words", "cannot be combined with a structured output or allowed_token_ids")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise bad("structured_output", f"must be a StructuredOutput, got {self.structured_output!r}")
            if self.ignore_eos:  # a complete grammar allows only end-of-sequence tokens
                raise bad("ignore_eos", "cannot be combined with a structured output, which ends with EOS")
            self.structured_output.validate()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", f"must be a non-empty string when given, got {self.cache_salt!r}")
