"""A worker's start-up profile of its own engine: prefill times by prompt length, decode steps by batch.

The router's estimator is fitted from these points before the first request arrives (measured steps
refit it later). Runs on the engine thread, before the worker joins the pool, so the throwaway prompts
are never published.
"""

from __future__ import annotations

import random
import time

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from router.estimator import DecodeModel, PrefillModel
from services.messages import WorkerProfile

_PROFILE_PROMPT_LENS = (16, 64, 128, 256, 512)
_DECODE_STEPS = 4
# Batch size and context vary apart (short and long prompts), so the TBT fit can tell the
# per-sequence cost from the per-context-token cost.
_DECODE_SHAPES = ((1, 32), (4, 32), (8, 32), (1, 512), (2, 512))


def profile_engine(engine: Engine) -> WorkerProfile:
    """Time prefills of several lengths and decode steps of several batch sizes and contexts: plain ones,
    without speculation (the measured steps price a draft's chunk as a prompt chunk)."""
    proposer, engine.proposer = engine.proposer, None
    try:
        return _profile(engine)
    finally:
        engine.proposer = proposer


def _profile(engine: Engine) -> WorkerProfile:
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefill: list[tuple[int, int, float]] = []
    for n in _PROFILE_PROMPT_LENS:
        if n + 1 > engine.max_model_len:
            break
        engine.add_request(f"profile-p{n}", [rng.randrange(vocab) for _ in range(n)], greedy_one)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        prefill.append((n, 0, time.perf_counter() - start))
    decode: list[tuple[int, int, float]] = []
    for batch, prompt_len in _DECODE_SHAPES:
        if prompt_len + _DECODE_STEPS + 1 > engine.max_model_len:
            continue
        params = SamplingParams(max_tokens=_DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            engine.add_request(f"profile-d{batch}-{prompt_len}-{i}", prompt, params)
        while engine.stats().num_waiting or engine.stats().waiting_prompt_tokens:
            engine.step()  # the prefills
        for step in range(_DECODE_STEPS):
            start = time.perf_counter()
            engine.step()
            decode.append((batch, batch * (prompt_len + 1 + step), time.perf_counter() - start))
        while engine.has_unfinished():
            engine.step()
    return WorkerProfile(prefill=prefill, decode=decode)


def prefill_batch_tokens(profile: WorkerProfile, overhead_share: float = 0.1) -> int:
    """DistServe's saturation length, from the measured profile: the prompt tokens from which one step's
    compute is so large that its fixed cost (what a step costs with nothing in it: the decode fit's
    intercept) is at most ``overhead_share`` of it. Batching prompts past that saves almost nothing and
    makes the prompts ahead wait for the ones behind: on CPUs a few dozen tokens, on GPUs more than a
    step's budget."""
    prefill, decode = PrefillModel.fit(profile.prefill), DecodeModel.fit(profile.decode)
    target = max(decode.fixed_s, 0.0) * (1 - overhead_share) / overhead_share
    tokens = 1
    while prefill.predict(tokens, 0) - prefill.fixed_s < target and tokens < 1 << 20:
        tokens *= 2
    return tokens
