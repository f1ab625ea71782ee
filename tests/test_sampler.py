"""Sampler: parameter validation, greedy, top-k / top-p truncation, per-request seeds independent of the
batch a row is sampled in, draws taken ahead giving the tokens the stream would, logprobs, and penalties
(repetition against transformers' processor) and bias."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.output import TokenLogprobs
from engine.sampler import apply_penalties, bad_word_bans, draw_ahead, make_generator, sample, top_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Sequence
from engine.token_counts import PenaltyCounts, TokenCounts

V = 50
pytestmark = pytest.mark.timeout(30)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def counts(params: list[SamplingParams], histories: list[list[int]],
           prompt_lens: list[int]) -> PenaltyCounts | None:
    """The penalty counts of rows whose sequences hold these histories, from a fresh table."""
    seqs = [Sequence(row, "", history, n, p)
            for row, (p, history, n) in enumerate(zip(params, histories, prompt_lens, strict=True))]
    return TokenCounts(V, "cpu", len(seqs)).penalties(seqs)


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
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(bad_words_token_ids=[[]]), "bad_words"),
    (dict(bad_words_token_ids=[[1]], allowed_token_ids=[1, 2]), "bad_words"),
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


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_most_likely_after_temperature():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log().expand(400, 4).contiguous()
    assert set(sample(x, [SamplingParams(min_p=0.5)] * 400, [None] * 400)) == {0, 1}  # 0.15 < 0.5 * 0.5
    assert set(sample(x, [SamplingParams(min_p=0.2)] * 400, [None] * 400)) == {0, 1, 2}
    # At temperature 2 the probabilities flatten to sqrt(p): 0.05 ** 0.5 / 0.5 ** 0.5 = 0.32 survives 0.3.
    assert set(sample(x, [SamplingParams(min_p=0.3, temperature=2.0)] * 400, [None] * 400)) == {0, 1, 2, 3}
    # Row by row: a row without min_p draws from the whole vocabulary beside one that truncates.
    mixed = sample(x, [SamplingParams(min_p=0.9), SamplingParams()] * 200, [None] * 400)
    assert set(mixed[::2]) == {0} and set(mixed[1::2]) == {0, 1, 2, 3}


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


def test_draws_taken_ahead_sample_what_the_stream_would_and_are_taken_only_as_far_as_used():
    """A draft model samples with the draws its verification will use: taking them ahead leaves a seeded
    stream where it was, sampling with them gives the stream's own tokens, and taking the first k moves the
    stream on by k tokens' draws; the global stream's draws are plain random ones."""
    params = [SamplingParams(temperature=1.3, seed=5)] * 6
    x = logits(6, seed=3)
    stream = make_generator(5, 0, "cpu")
    ahead = draw_ahead(stream, 6, V, "cpu")
    assert ahead.values.shape == (6, V) and len(ahead.states) == 7
    own = sample(x, params, [stream] * 6)  # the stream's next six draws, one a row
    with_draws = sample(x, params, [make_generator(5, 0, "cpu")] * 6, draws=list(ahead.values))
    assert with_draws == own and len(set(own)) > 1
    for used in (0, 2, 6):
        taken = make_generator(5, 0, "cpu")
        ahead.take(taken, used)
        reference = make_generator(5, 0, "cpu")
        sample(x[:used], params[:used], [reference] * used)
        assert torch.equal(taken.get_state(), reference.get_state())
    unseeded = draw_ahead(None, 4, V, "cpu")
    assert unseeded.states is None and bool((unseeded.values > 0).all()) and unseeded.values.std() > 0.1
    mixed = sample(x[:2], [SamplingParams(temperature=0), params[0]], [None, None], draws=[None, ahead.values[1]])
    assert mixed == [int(x[0].argmax()), own[1]]  # a greedy row beside a row with its draw


def test_logprobs_hold_the_sampled_token_and_the_top_n():
    x = logits(3)
    entries = top_logprobs(x, [7, 3, 11], [2, None, 0])  # the middle row asked for no logprobs
    ref = x.log_softmax(-1)
    top2 = ref[0].topk(2)
    assert entries[0].token_id == 7 and entries[0].logprob == pytest.approx(ref[0, 7].item())
    assert [t for t, _ in entries[0].top] == top2.indices.tolist()  # most likely first
    assert [lp for _, lp in entries[0].top] == pytest.approx(top2.values.tolist())
    assert entries[1] is None
    ranks = [int((ref[row] > ref[row, tok]).sum()) + 1 for row, tok in ((0, 7), (2, 11))]
    assert entries[0].rank == ranks[0]
    assert entries[2] == TokenLogprobs(11, pytest.approx(ref[2, 11].item()), (), ranks[1])
    assert top_logprobs(x, [7, 3, 11], [None] * 3) == [None] * 3


# ---- penalties and logit bias ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=2.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(logit_bias=[(3, 101.0)]), "logit_bias"),
    (dict(logit_bias=[(-1, 1.0)]), "logit_bias"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
])
def test_validate_refuses_out_of_range_and_non_finite_values(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs).validate()
    assert err.value.field == field


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    x = logits(3, seed=5)
    histories = [[1, 4, 4, 9], [0, 2, 2, 2, 7, 30], [49]]
    params = [SamplingParams(repetition_penalty=penalty)] * 3
    ours = apply_penalties(x, params, counts(params, histories, [2, 3, 1]))
    for row, history in enumerate(histories):
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), x[row:row + 1].clone())
        torch.testing.assert_close(ours[row], theirs[0], rtol=0, atol=0)
    assert not torch.equal(ours, x)  # the raw logits (reported as logprobs) are left alone


def test_presence_and_frequency_penalties_follow_openai_over_the_output_only():
    x = logits(1, seed=6)
    history = [3, 3, 5, 8, 8, 8]  # prompt [3, 3], output [5, 8, 8, 8]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]
    out = apply_penalties(x, params, counts(params, [history], [2]))[0]
    expected = x[0].clone()
    expected[5] -= 0.25 * 1 + 0.5
    expected[8] -= 0.25 * 3 + 0.5
    torch.testing.assert_close(out, expected)  # token 3 is prompt-only: untouched


def test_logit_bias_forces_and_bans_tokens_for_greedy_rows_too():
    x = logits(2, seed=7)
    worst = x[0].argmin().item()
    best = x[1].argmax().item()
    params = [SamplingParams(temperature=0, logit_bias=[(worst, 100.0)]),
              SamplingParams(temperature=1.0, seed=1, logit_bias=[(best, -100.0)])]
    for _ in range(5):
        tokens = sample(x, params, [None, make_generator(1, 0, "cpu")])
        assert tokens[0] == worst and tokens[1] != best


def test_allowed_token_ids_are_the_only_tokens_a_row_draws_and_leave_other_rows_alone():
    x = logits(3, seed=11)
    allowed = [3, 17, 29]
    params = [SamplingParams(temperature=1.0, seed=2, allowed_token_ids=allowed),
              SamplingParams(temperature=0, allowed_token_ids=[x[1].argmin().item()]), SamplingParams(temperature=0)]
    masked = apply_penalties(x, params)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == allowed and torch.equal(masked[2], x[2])
    for _ in range(5):
        tokens = sample(x, params, [make_generator(2, 0, "cpu"), None, None])
        assert tokens[0] in allowed and tokens[1] == x[1].argmin().item() and tokens[2] == x[2].argmax().item()


def test_a_bad_word_bans_the_token_that_would_complete_it_and_a_one_token_word_always():
    words = [[5, 6, 7], [9]]
    assert bad_word_bans(words, []) == [9]
    assert bad_word_bans(words, [1, 5]) == [9]  # only 5 so far: 6 is still fine
    assert bad_word_bans(words, [1, 5, 6]) == [7, 9]
    assert bad_word_bans(words, [5, 6, 8]) == [9] and bad_word_bans([], [5, 6]) == []


def test_a_frequency_penalty_stops_greedy_repetition_and_keeps_rows_independent():
    x = torch.zeros(2, V)
    x[:, 7] = 1.0  # greedy always picks 7 ...
    x[:, 9] = 0.9
    history = [1, 2, 7]  # ... unless the penalty counts the 7 already in the output
    plain, penalized = SamplingParams(temperature=0), SamplingParams(temperature=0, frequency_penalty=0.5)
    for params in ([plain, penalized], [penalized, plain]):
        expected = [9 if p is penalized else 7 for p in params]
        assert sample(x, params, [None, None], counts(params, [history, history], [2, 2])) == expected


def test_seeded_penalized_rows_reproduce_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=42, presence_penalty=1.0, repetition_penalty=1.2)
    x = logits(3, seed=8)
    history = [1, 2, 3, 4, 4]

    def draw(rows: list[int]) -> int:
        batch = [params if r == 0 else SamplingParams(temperature=0.8) for r in rows]
        gens = [make_generator(42, 0, "cpu") if r == 0 else None for r in rows]
        penalties = counts(batch, [history] * len(rows), [3] * len(rows))
        return sample(x[rows], batch, gens, penalties)[rows.index(0)]

    assert draw([0]) == draw([1, 0, 2]) == draw([2, 1, 0])


def test_a_batchs_bias_allowed_ids_and_bans_equal_each_rows_alone():
    """They are applied to all rows at once (a few ops a step, not a few a row): each row comes out as it
    would alone, a row with none of them untouched, a repeated bias added twice."""
    x = logits(5, seed=12)
    params = [SamplingParams(logit_bias=[(3, 2.5), (9, -1.0), (3, 0.5)]), SamplingParams(),
              SamplingParams(allowed_token_ids=[4, 8, 15], logit_bias=[(8, -3.0)]),
              SamplingParams(allowed_token_ids=[1, 2]), SamplingParams(temperature=0)]
    banned = [[7], [], [15], [], [0, 49]]
    together = apply_penalties(x, params, None, banned)
    for r in range(len(params)):
        alone = apply_penalties(x[r:r + 1], params[r:r + 1], None, banned[r:r + 1])
        assert torch.equal(together[r], alone[0]), r
    assert together[0, 3] == x[0, 3] + 3.0 and together[0, 7] == float("-inf")
    assert torch.equal(together[1], x[1])
    assert torch.isfinite(together[2]).nonzero().flatten().tolist() == [4, 8]
    assert together[2, 8] == x[2, 8] - 3.0 and torch.isfinite(together[3]).sum() == 2
    assert not torch.isfinite(together[4, [0, 49]]).any() and torch.isfinite(together[4]).sum() == V - 2
