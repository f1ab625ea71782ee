"""Real token counts for the load test: a local Hugging Face ``tokenizer.json`` (``--tokenizer``).

With it, random prompts are built the way ``vllm bench serve``'s random dataset builds them (a run of
token ids, decoded to text, re-encoded and trimmed until the text is exactly the intended number of
tokens), ShareGPT lengths are counted, and output tokens are counted when a server reports no usage.
Without it the load test falls back to a characters-per-token estimate and says so in its report.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from loadtest.workloads import RequestSpec, synth_text

_MAX_RETRIES = 10  # vLLM's gen_prompt_decode_to_target_len gives up after this many adjustments


class PromptTokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids a random prompt may use."""

    def __init__(self, tokenizer: Tokenizer, name: str):
        self.tokenizer, self.name = tokenizer, name
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        # Ids whose text stands alone: special tokens would be stripped on decode, and a lone byte of a
        # multi-byte character decodes to U+FFFD, which re-encodes to other tokens and never converges.
        self.allowed = np.array([i for i in range(tokenizer.get_vocab_size(with_added_tokens=True))
                                 if i not in special and "\ufffd" not in tokenizer.decode([i])], dtype=np.int64)
        if not len(self.allowed):
            raise ValueError(f"tokenizer {name} has no ordinary tokens to build prompts from")
        post = tokenizer.post_processor
        self.num_special = post.num_special_tokens_to_add(False) if post is not None else 0

    @classmethod
    def load(cls, path: str | Path) -> PromptTokenizer:
        """A tokenizer directory (holding tokenizer.json) or the tokenizer.json file itself."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there (a local Hugging Face tokenizer "
                             "directory or file is needed)")
        try:
            return cls(Tokenizer.from_file(str(file)), str(path))
        except Exception as e:  # the tokenizers library raises bare Exceptions on bad files
            raise ValueError(f"--tokenizer {path}: cannot load {file.name}: {e}") from None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def count(self, text: str) -> int:
        """Tokens of ``text`` alone (an answer's length)."""
        return len(self.encode(text))

    def prompt_count(self, text: str) -> int:
        """Tokens of ``text`` as a prompt, with the special tokens the tokenizer adds (BOS, say)."""
        return len(self.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def chars_per_token(self, seed: int = 0) -> float:
        """How many characters of the load test's synthetic text make one token of this tokenizer."""
        sample = synth_text(random.Random(f"calibrate:{seed}"), 4000, 1.0)
        return len(sample) / max(1, self.count(sample))

    def fit(self, ids: list[int], target: int, rng: np.random.Generator) -> tuple[str, int]:
        """Text of ``target`` tokens from the ids ``ids``: decode, re-encode, then trim or extend with random
        allowed ids until the round trip holds (vLLM's procedure). Returns the text and its token count,
        which differs from ``target`` only if that failed ``_MAX_RETRIES`` times."""
        text = self.decode(ids)
        ids = self.encode(text)
        for _ in range(_MAX_RETRIES):
            if len(ids) == target:
                break
            if len(ids) > target:
                ids = ids[:target]
            else:
                ids = ids + self.allowed[rng.integers(0, len(self.allowed), target - len(ids))].tolist()
            text = self.decode(ids)
            ids = self.encode(text)
        return text, len(ids)


def random_token_requests(
    tok: PromptTokenizer, num_prompts: int, *, input_len: int, output_len: int, range_ratio: float = 0.0,
    prefix_len: int = 0, seed: int = 0, id_prefix: str = "",
) -> list[RequestSpec]:
    """vLLM's random dataset under a real tokenizer: ``prefix_len`` shared random tokens, then a run of
    consecutive allowed ids from a random offset; lengths uniform in [floor(L(1-r)), ceil(L(1+r))]. As in
    vLLM the text leaves room for the special tokens the tokenizer adds, so that a prompt of length L is
    L tokens as the server encodes it; ``prompt_len`` counts them too."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    real_input = max(0, input_len - tok.num_special)
    in_lo, in_hi = math.floor(real_input * (1 - range_ratio)), math.ceil(real_input * (1 + range_ratio))
    out_lo = max(1, math.floor(output_len * (1 - range_ratio)))
    out_hi = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + in_lo < 1:
        raise ValueError("random prompts would be empty: raise --random-input-len or --random-prefix-len")
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    offsets = rng.integers(0, len(tok.allowed), size=num_prompts)
    prefix = tok.allowed[rng.integers(0, len(tok.allowed), size=prefix_len)].tolist()
    specs = []
    for i in range(num_prompts):
        inner = tok.allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(tok.allowed)].tolist()
        prompt, n_tokens = tok.fit(prefix + inner, prefix_len + int(input_lens[i]), rng)
        specs.append(RequestSpec(request_id=f"{id_prefix}{i}", prompt_len=n_tokens + tok.num_special,
                                 max_tokens=int(output_lens[i]), prompt=prompt))
    return specs
