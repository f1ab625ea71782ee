"""Predicted outputs (OpenAI's ``prediction``): the cursor that follows an output through its prediction
(engine/speculative.py's PredictedOutput) across edits, and the engine drafting from a prediction: the tokens
those of the engine without drafts (greedy and seeded), a prediction the output repeats accepted whole in
fewer steps, an edited one still accepted around the edits, one unrelated to the output changing nothing;
the outputs count the prediction's draft tokens kept and not kept."""

from __future__ import annotations

import dataclasses

import pytest
from test_speculative import PROMPTS, all_blocks_free, generate

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.speculative import PredictedOutput, SpeculativeConfig

pytestmark = pytest.mark.timeout(120)
CONFIG = SpeculativeConfig(4, prompt_lookup_max=3)
PROMPT = [900, 901, 902]


def drafts_along(prediction: list[int], output: list[int], k: int = 3) -> list[list[int]]:
    """The draft after each output token, the output growing one token at a time."""
    cursor = PredictedOutput(prediction, CONFIG, len(PROMPT))
    return [cursor.draft(PROMPT + output[:i + 1], k) for i in range(len(output))]


def test_the_cursor_follows_the_output_and_finds_its_place_again_after_an_edit():
    prediction = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert PredictedOutput(prediction, CONFIG, len(PROMPT)).draft(PROMPT, 3) == [1, 2, 3]  # before any output
    assert drafts_along(prediction, [1, 2, 3])[-1] == [4, 5, 6]
    # replaced: 4 -> 40; found again once the output's last two tokens (prompt_lookup_min) are the prediction's
    assert drafts_along(prediction, [1, 2, 3, 40, 5, 6])[-3:] == [[], [], [7, 8, 9]]
    # inserted: 41 42 before 4
    assert drafts_along(prediction, [1, 2, 3, 41, 42, 4, 5])[-2:] == [[], [6, 7, 8]]
    # deleted: 4 5 6 skipped
    assert drafts_along(prediction, [1, 2, 3, 7, 8])[-2:] == [[], [9, 10]]
    # used up, and an output that leaves it for good
    assert drafts_along(prediction, prediction)[-1] == []
    assert drafts_along(prediction, [50, 51, 52]) == [[], [], []]


def test_a_lost_cursor_prefers_the_longest_recurring_run_and_the_place_after_the_edit():
    prediction = [5, 6, 1, 2, 9, 5, 6, 3, 4, 5, 6, 7]
    cursor = PredictedOutput(prediction, CONFIG, len(PROMPT))
    assert cursor.draft(PROMPT + [5, 6, 1, 2, 9, 5, 6, 3], 2) == [4, 5]  # followed all the way
    assert cursor.draft(PROMPT + [5, 6, 1, 2, 9, 5, 6, 3, 77, 5, 6], 2) == [7]  # lost at 9, found on from there
    other = PredictedOutput(prediction, CONFIG, len(PROMPT))
    assert other.draft(PROMPT + [80, 2, 9], 3) == [5, 6, 3]  # "2 9" beats the 9s alone
    assert other.draft(PROMPT + [80, 2, 9, 81, 1], 2) == []  # "81 1" and "1" alone: one token places nothing
    assert other.draft(PROMPT + [80, 2, 9, 81, 1, 2], 2) == [9, 5]  # not on from where it was lost: from the start
    # the prompt is not the output: its tokens never place the cursor
    assert PredictedOutput([7, 8, 9], CONFIG, 2).draft([7, 8, 55], 2) == []


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_prediction_changes_the_steps_and_not_the_tokens(tiny, sampling):
    """A prediction equal to the plain engine's output is accepted nearly whole; one with every twentieth token
    changed is still accepted around the edits; one unrelated to the output is rejected; every time the tokens
    are the plain engine's."""
    params = SamplingParams(max_tokens=40, ignore_eos=True,
                            **(dict(temperature=0.0) if sampling == "greedy" else dict(temperature=0.7, seed=5)))
    prompts = PROMPTS[1:]
    plain = generate(Engine(EngineConfig(model="tiny")), params, prompts)
    answer = plain[("0", 0)]["tokens"]
    edited = [t if i % 20 != 10 else (t + 1) % 256 for i, t in enumerate(answer)]
    stats = {}  # (where an unrelated prediction has no draft the n-gram proposer drafts)
    for name, prediction in (("same", answer), ("edited", edited), ("unrelated", [3, 1, 4, 1, 5] * 8)):
        engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4, prompt_lookup_min=4))
        engine.add_request("0", prompts[0], dataclasses.replace(params, prediction_ids=prediction))
        tokens, steps, counted = [], 0, [0, 0]  # the outputs' prediction counts: kept, not kept
        while engine.has_unfinished():
            steps += 1
            for out in engine.step():
                tokens += out.new_token_ids
                counted = [counted[0] + out.accepted_prediction_tokens, counted[1] + out.rejected_prediction_tokens]
        assert tokens == answer, name
        stats[name] = (engine.stats().speculation, steps)
        assert all_blocks_free(engine)
        spec = engine.stats().speculation  # (the n-gram proposer drafts where the prediction has nothing)
        assert counted[0] <= spec.accepted_tokens and sum(counted) <= spec.draft_tokens, name
        if name == "same":  # every draft the prediction's
            assert counted == [spec.accepted_tokens, spec.draft_tokens - spec.accepted_tokens]
        if name == "edited":
            assert counted[0] > counted[1] > 0
    same, same_steps = stats["same"]
    assert same.accepted_tokens >= 0.9 * same.draft_tokens > 0 and same_steps <= 0.4 * len(answer)
    edited_stats, edited_steps = stats["edited"]
    assert edited_stats.draft_tokens > edited_stats.accepted_tokens >= 0.5 * len(answer)
    assert same_steps < edited_steps < len(answer)


def test_an_engine_that_does_not_speculate_samples_as_without_a_prediction(tiny):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = generate(Engine(EngineConfig(model="tiny")), params, PROMPTS[:1])
    engine = Engine(EngineConfig(model="tiny"))
    got = generate(engine, dataclasses.replace(params, prediction_ids=plain[("0", 0)]["tokens"]), PROMPTS[:1])
    assert got == plain


def test_a_prediction_that_is_not_token_ids_is_refused_by_name():
    from engine.errors import InvalidRequestError

    for bad in ([1, -2], ["a"], "text"):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(prediction_ids=bad).validate()
        assert err.value.field == "prediction"
