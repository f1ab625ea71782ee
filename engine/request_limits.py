"""An engine's limits on a request (vocabulary, context length, KV blocks), checked before the request
takes any resource. Torch-free (the attention window is only a type here).

With an attention window (``engine/streaming_window.py``) ``max_model_len`` bounds the sequence, not the
model's context: sinks + window fit the context, whatever the prompt and output add up to, and a sequence
holds at most the window's blocks, and a disaggregated prompt's hand-off carries only those."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.streaming_window import StreamingWindow


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    window: StreamingWindow | None = None
    eos_token_ids: frozenset[int] = frozenset()

    def check(self, prompt_ids: list[int], params: SamplingParams, prefill_only: bool,
              reserved: bool) -> None:
        """Raise ``InvalidRequestError(field, message)`` for the first limit the request breaks.
        ``prefill_only``: the request stops after its first token; ``reserved``: its prompt K/V is imported
        into reserved blocks (both are disaggregated, so one sample each)."""
        if len(prompt_ids) == 0:
            raise InvalidRequestError("prompt", "the prompt is empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab})")
        # The sampler indexes the vocabulary with these: one out of range would fail the whole batch's step.
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise InvalidRequestError("logit_bias", f"token ids must be in [0, {vocab})")
        if params.allowed_token_ids is not None:
            if any(not 0 <= t < vocab for t in params.allowed_token_ids):
                raise InvalidRequestError("allowed_token_ids", f"token ids must be in [0, {vocab})")
            # the first min_tokens tokens may not be stop tokens: with nothing else allowed, no token could be drawn
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            if params.min_tokens and set(params.allowed_token_ids) <= stops:
                raise InvalidRequestError("allowed_token_ids", "holds only stop tokens, which min_tokens keeps out "
                                                               "of the first tokens")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"{len(prompt_ids)} tokens leave no room in the context of {self.max_model_len}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens")
        if (prefill_only or reserved) and params.n != 1:
            raise InvalidRequestError("n", "disaggregated requests take n = 1")
        need = -(-(len(prompt_ids) + (1 if prefill_only else params.max_tokens)) // self.block_size)
        if self.window is not None:
            need = min(need, self.window.max_blocks)
        if need > self.num_blocks:
            raise InvalidRequestError(
                "max_tokens", f"needs {need} KV blocks, the cache has {self.num_blocks}")
