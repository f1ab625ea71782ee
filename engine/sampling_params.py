"""Sampling parameters of one request: what the gateway validates and the engine samples with.

Torch-free, so the gateway and the dispatcher can build and check them without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

# Temperatures below this are greedy (dividing by ~0 only overflows).
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: off; k: the sampled token's logprob plus the top k

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI accepts one string or a list
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self) -> None:
        """Raise ``InvalidRequestError(field, message)`` for the first bad parameter."""
        def bad(name: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(name, message)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
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
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
