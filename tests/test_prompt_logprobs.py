"""Prompt logprobs in the engine (vLLM's ``prompt_logprobs``): every prompt token's logprob after the first,
against transformers' log-softmax on the same weights, across chunked-prefill steps; the prefix cache is
bypassed for such a prompt (a cached position has no logits) and still filled by it."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_engine_loop import GREEDY, alone, make_engine, prompt, run, write_model

import engine.scheduler as scheduler
from engine.sampling_params import SamplingParams

TOP = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("prompt-logprobs"))


def reference(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each position, float32: row i is the distribution of token i + 1."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].log_softmax(-1)


def first_outputs(engine, requests: dict) -> dict:
    """Each request's (index 0) first output, running the engine to completion."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    firsts = {}
    while engine.has_unfinished():
        for out in engine.step():
            firsts.setdefault((out.request_id, out.index), out)
    return firsts


def assert_match(entries, ids: list[int], ref: torch.Tensor) -> None:
    assert [e.token_id for e in entries] == ids[1:]
    for i, e in enumerate(entries):
        assert e.logprob == pytest.approx(ref[i, ids[i + 1]].item(), abs=1e-4)
        top_vals, top_ids = ref[i].topk(TOP)
        assert [t for t, _ in e.top] == top_ids.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(top_vals.tolist(), abs=1e-4)


def assert_match_top0(entries, ids: list[int], ref: torch.Tensor) -> None:
    assert all(e.top == () for e in entries)
    assert [e.logprob for e in entries] == pytest.approx(
        [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)], abs=1e-4)


@pytest.mark.timeout(120)
def test_prompt_logprobs_match_transformers_over_steps_that_score_a_bounded_number_of_rows(model_dir, monkeypatch):
    monkeypatch.setattr(scheduler, "PROMPT_LOGPROBS_ROWS", 48)  # a step scores at most 48 prompt tokens in all
    engine = make_engine(model_dir, max_num_batched_tokens=128)
    ids, second, other = prompt(200, seed=11), prompt(60, seed=14), prompt(90, seed=12)
    scored_per_step, plain_per_step = [], []
    step = engine.step

    def recording_step():
        outputs = step()
        if engine.last_step is not None:
            chunks = engine.last_step.prefill_chunks
            scored_per_step.append(sum(n for rid, n, _ in chunks if rid.startswith("scored")))
            plain_per_step.append(sum(n for rid, n, _ in chunks if rid == "plain"))
        return outputs

    engine.step = recording_step
    params = SamplingParams(max_tokens=5, prompt_logprobs=TOP, n=2, **GREEDY)
    firsts = first_outputs(engine, {"scored": (ids, params), "scored-too": (second, params),
                                    "plain": (other, SamplingParams(max_tokens=5, **GREEDY))})
    # both scored prompts share each step's 48 rows; the plain one is not held to them
    assert max(scored_per_step) == 48 and sum(scored_per_step) == len(ids) + len(second)
    assert max(plain_per_step) > 48
    for rid, tokens in (("scored", ids), ("scored-too", second)):
        ref = reference(model_dir, tokens)
        for index in (0, 1):  # each of the n samples hands them out with its first token
            assert len(firsts[(rid, index)].prompt_logprobs) == len(tokens) - 1
            assert_match(firsts[(rid, index)].prompt_logprobs, tokens, ref)
    assert firsts[("plain", 0)].prompt_logprobs is None
    # the first token is the one the prompt's last row gives, as without prompt logprobs
    assert firsts[("scored", 0)].new_token_ids == alone(model_dir, ids, SamplingParams(max_tokens=1, **GREEDY))


@pytest.mark.timeout(120)
def test_a_scored_prompt_bypasses_the_prefix_cache_and_fills_it(model_dir):
    engine = make_engine(model_dir)
    ids = prompt(70, seed=13)
    run(engine, {"warm": (ids, SamplingParams(max_tokens=1, **GREEDY))})
    scored = first_outputs(engine, {"scored": (ids, SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))})
    out = scored[("scored", 0)]
    assert out.num_cached_tokens == 0  # every position computed: a cached one has no logits
    assert_match_top0(out.prompt_logprobs, ids, reference(model_dir, ids))
    again = first_outputs(engine, {"again": (ids, SamplingParams(max_tokens=1, **GREEDY))})
    assert again[("again", 0)].num_cached_tokens == 64  # the prompt's full blocks are cached as before
