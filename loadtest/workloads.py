"""What the load test sends: Mooncake trace replay, multi-turn chat, random lengths, ShareGPT files.

Prompts are synthesized text, reproducible from the seed. A server counts tokens with its own tokenizer,
so lengths here are approximate: ``chars_per_token`` sets how many characters stand for one token (1.0 for
the byte-level tiny model; about 4-6 for BPE tokenizers on this word list; ``loadtest.tokens`` measures it
for a given tokenizer and builds token-exact random prompts). Text is ASCII, so characters are bytes.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from router.trace import TRACE_BLOCK_TOKENS, TraceRequest

_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part river stone light green house field night sound place small large"
)
_WORDS = _WORD_TEXT.split()


@dataclass
class RequestSpec:
    """One request to send. ``messages`` selects the chat API, else ``prompt`` (completions)."""

    request_id: str
    prompt_len: int  # intended prompt tokens; the server's usage.prompt_tokens wins when reported
    max_tokens: int
    prompt: str = ""
    messages: list[dict] | None = None
    session_id: str | None = None
    hash_ids: list[int] = field(default_factory=list)
    model: str | None = None  # the model (a LoRA adapter) this request names; None: the run's model


def synth_text(rng: random.Random, n_tokens: int, chars_per_token: float) -> str:
    """Exactly ``round(n_tokens * chars_per_token)`` characters of words drawn from ``rng``."""
    n_chars = max(1, round(n_tokens * chars_per_token))
    words, size = [], 0
    while size < n_chars:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return (" ".join(words) + " ")[:n_chars]


class BlockTexts:
    """Text for a Mooncake hash id: the same id always yields the same characters (for a seed)."""

    def __init__(self, seed: int, block_tokens: int, chars_per_token: float):
        self.seed, self.block_tokens, self.chars_per_token = seed, block_tokens, chars_per_token
        self._cache: dict[int, str] = {}

    def __call__(self, hash_id: int) -> str:
        text = self._cache.get(hash_id)
        if text is None:
            # A string seed is hashed with SHA-512 by ``random``: stable across processes.
            rng = random.Random(f"mooncake:{self.seed}:{hash_id}")
            text = self._cache[hash_id] = synth_text(rng, self.block_tokens, self.chars_per_token)
        return text


def scaled_block_tokens(length_scale: float) -> int:
    return max(1, round(TRACE_BLOCK_TOKENS * length_scale))


def mooncake_requests(
    rows: list[TraceRequest], *, seed: int = 0, length_scale: float = 1.0, chars_per_token: float = 1.0,
    id_prefix: str = "",
) -> list[RequestSpec]:
    """One completions request per trace row; equal hash ids (in order) give identical prompt prefixes.

    With ``length_scale`` every block shrinks to ``round(512 * scale)`` tokens; the last block stays partial
    (a prefix of that hash id's full text) and output lengths scale the same way.
    """
    block = scaled_block_tokens(length_scale)
    texts = BlockTexts(seed, block, chars_per_token)
    specs = []
    for i, row in enumerate(rows):
        n_blocks = len(row.hash_ids)
        n_in = min(max(round(row.input_length * length_scale), (n_blocks - 1) * block + 1), n_blocks * block)
        last_chars = max(1, round((n_in - (n_blocks - 1) * block) * chars_per_token))
        prompt = "".join(texts(h) for h in row.hash_ids[:-1]) + texts(row.hash_ids[-1])[:last_chars]
        specs.append(RequestSpec(
            request_id=f"{id_prefix}{i}", prompt_len=n_in,
            max_tokens=max(1, round(row.output_length * length_scale)), prompt=prompt,
            hash_ids=list(row.hash_ids),
        ))
    return specs


def random_requests(
    num_prompts: int, *, input_len: int, output_len: int, range_ratio: float = 0.0, prefix_len: int = 0,
    seed: int = 0, chars_per_token: float = 1.0, id_prefix: str = "",
) -> list[RequestSpec]:
    """vLLM's random dataset: lengths uniform in [floor(L(1-r)), ceil(L(1+r))] after a shared prefix."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(f"random:{seed}")
    prefix = synth_text(random.Random(f"prefix:{seed}"), prefix_len, chars_per_token) if prefix_len else ""
    in_lo, in_hi = math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))
    out_lo, out_hi = math.floor(output_len * (1 - range_ratio)), math.ceil(output_len * (1 + range_ratio))
    specs = []
    for i in range(num_prompts):
        n_in, n_out = max(1, rng.randint(in_lo, in_hi)), max(1, rng.randint(out_lo, out_hi))
        specs.append(RequestSpec(
            request_id=f"{id_prefix}{i}", prompt_len=prefix_len + n_in, max_tokens=n_out,
            prompt=prefix + synth_text(rng, n_in, chars_per_token),
        ))
    return specs


def sharegpt_requests(
    path: str, num_prompts: int, count: Callable[[str], int], *, output_len: int | None = None, seed: int = 0,
    id_prefix: str = "",
) -> list[RequestSpec]:
    """vLLM's ShareGPT dataset from a local JSON file: each conversation's first turn is the prompt and its
    second turn's length the output length (unless ``output_len``); conversations are shuffled with the
    seed, pairs outside vLLM's bounds (prompt 4-1024 tokens, output at least 4, total at most 2048)
    skipped, and the rest reused at random when there are fewer than ``num_prompts``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        entries = [e["conversations"] for e in data if len(e.get("conversations") or ()) >= 2]
        pairs = [(c[0]["value"], c[1]["value"]) for c in entries]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{path}: not a ShareGPT JSON file ({type(e).__name__}: {e})") from None
    rng = random.Random(seed)
    rng.shuffle(pairs)
    specs: list[RequestSpec] = []
    for prompt, completion in pairs:
        if len(specs) == num_prompts:
            break
        n_in, n_out = count(prompt), count(completion) if output_len is None else output_len
        if n_in < 4 or n_in > 1024 or n_in + n_out > 2048 or (output_len is None and n_out < 4):
            continue
        specs.append(RequestSpec(request_id=f"{id_prefix}{len(specs)}", prompt_len=n_in, max_tokens=n_out,
                                 prompt=prompt))
    if not specs:
        raise ValueError(f"{path}: no conversation within ShareGPT's length bounds")
    sampled = list(specs)
    for i in range(len(specs), num_prompts):
        specs.append(replace(rng.choice(sampled), request_id=f"{id_prefix}{i}"))
    return specs


@dataclass
class ChatSession:
    """One simulated user. With a ``session_id`` the server keeps the history and each turn carries only
    the new message; without one (``--no-session``) every turn resends the whole conversation."""

    user: int
    turns: list[str]  # the user's message for each turn, fixed up front so runs are reproducible
    max_tokens: int
    chars_per_token: float
    session_id: str | None = None
    system: str = ""
    history: list[dict] = field(default_factory=list)
    id_prefix: str = ""
    count: Callable[[str], int] | None = None  # a real tokenizer's count; else chars / chars_per_token

    def request(self, turn: int) -> RequestSpec:
        """The request for ``turn``; call ``add_reply`` with the answer before asking for the next turn."""
        if not self.history and self.system:
            self.history.append({"role": "system", "content": self.system})
        new = [{"role": "user", "content": self.turns[turn]}]
        full = self.history + new
        sent = ([m for m in full if m["role"] == "system"] if turn == 0 else []) + new
        self.history = full
        text = "".join(m["content"] for m in full)
        prompt_len = self.count(text) if self.count else round(len(text) / self.chars_per_token)
        return RequestSpec(
            request_id=f"{self.id_prefix}u{self.user}-t{turn}",
            prompt_len=max(1, prompt_len), max_tokens=self.max_tokens,
            messages=sent if self.session_id else full, session_id=self.session_id,
        )

    def add_reply(self, text: str) -> None:
        self.history.append({"role": "assistant", "content": text})


def chat_sessions(
    num_users: int, turns: int, *, input_len: int, output_len: int, prefix_len: int = 0, seed: int = 0,
    chars_per_token: float = 1.0, use_session: bool = True, id_prefix: str = "",
    count: Callable[[str], int] | None = None,
) -> list[ChatSession]:
    """``num_users`` users with ``turns`` messages of ``input_len`` tokens each; ``prefix_len`` tokens of
    system prompt are shared by every user."""
    system = synth_text(random.Random(f"system:{seed}"), prefix_len, chars_per_token) if prefix_len else ""
    sessions = []
    for user in range(num_users):
        rng = random.Random(f"chat:{seed}:{user}")
        sessions.append(ChatSession(
            user=user, turns=[synth_text(rng, input_len, chars_per_token) for _ in range(turns)],
            max_tokens=output_len, chars_per_token=chars_per_token,
            session_id=f"{id_prefix}u{user}" if use_session else None, system=system, id_prefix=id_prefix,
            count=count,
        ))
    return sessions
