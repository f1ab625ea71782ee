"""Sampler: parameter validation, greedy, top-k / top-p truncation, per-request seeds independent of the
batch a row is sampled in, and logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampler import make_generator, sample, top_logprobs
from engine.sampling_params import SamplingParams

V = 50
pytestmark = pytest.mark.timeout(30)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(n=0), "n"),
    (dict(stop=5), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(top_k=-1), "top_k"),
    (dict(logprobs=99), "logprobs"),
])
def test_validate_names_the_bad_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs).validate()
    assert err.value.field == field


def test_a_single_stop_string_becomes_a_list():
    params = SamplingParams(stop="END")
    params.validate()
    assert params.stop == ["END"]


def test_greedy_and_degenerate_truncations_pick_the_argmax():
    x = logits(6)
    best = x.argmax(-1).tolist()
    assert sample(x, [SamplingParams(temperature=0)] * 6, [None] * 6) == best
    assert sample(x, [SamplingParams(temperature=1.0, top_k=1)] * 6, [None] * 6) == best
    assert sample(x, [SamplingParams(temperature=1.0, top_p=1e-6)] * 6, [None] * 6) == best


def test_top_k_only_draws_from_the_k_most_likely():
    x = logits(1).expand(400, V).contiguous()
    allowed = set(x[0].topk(3).indices.tolist())
    drawn = sample(x, [SamplingParams(temperature=5.0, top_k=3)] * 400, [None] * 400)
    assert set(drawn) <= allowed and len(set(drawn)) > 1


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log().expand(400, 4).contiguous()
    drawn = sample(x, [SamplingParams(top_p=0.7)] * 400, [None] * 400)
    assert set(drawn) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 are cut


def test_seeded_rows_reproduce_whatever_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), SamplingParams(top_k=5, seed=9)]

    def draws(companions: list[SamplingParams]) -> list[int]:
        gen = make_generator(params.seed, 0, "cpu")
        comp_gens = [make_generator(p.seed, 0, "cpu") for p in companions]
        out = []
        for step in range(8):
            x = logits(1 + len(companions), seed=step)
            x[len(companions)] = logits(1, seed=100 + step)[0]  # our row's logits never change
            tokens = sample(x, [*companions, params], [*comp_gens, gen])
            out.append(tokens[-1])
        return out

    alone = draws([])
    assert draws(others) == alone
    assert draws(others[::-1] + others) == alone
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_logprobs_hold_the_sampled_token_and_the_top_n():
    x = logits(3)
    entries = top_logprobs(x, [7, 3, 11], [2, None, 0])  # the middle row asked for no logprobs
    ref = x.log_softmax(-1)
    top2 = ref[0].topk(2).indices.tolist()
    assert set(entries[0]) == {7, *top2}
    assert entries[0][7] == pytest.approx(ref[0, 7].item())
    assert entries[0][top2[0]] == pytest.approx(ref[0, top2[0]].item())
    assert entries[1] is None
    assert entries[2] == {11: pytest.approx(ref[2, 11].item())}
    assert top_logprobs(x, [7, 3, 11], [None] * 3) == [None] * 3
