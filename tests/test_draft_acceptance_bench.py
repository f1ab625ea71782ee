"""benchmarks/draft_acceptance.py's exact acceptance of a draft sampled with the verification's draw: the closed
form against counting shared exponential draws, and its limits (a draft equal to the model, a greedy draft)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.draft_acceptance import coupled_acceptance, position_acceptance

pytestmark = pytest.mark.timeout(60)


def test_the_closed_form_matches_counting_shared_draws():
    gen = torch.Generator().manual_seed(0)
    for trial in range(3):
        p = torch.rand(7, generator=gen) ** 3
        q = torch.rand(7, generator=gen) ** 3
        p, q = p / p.sum(), q / q.sum()
        draws = torch.empty(200_000, 7).exponential_(generator=gen)
        counted = float(((p / draws).argmax(dim=1) == (q / draws).argmax(dim=1)).double().mean())
        exact, left_out = coupled_acceptance(p, q)
        assert exact == pytest.approx(counted, abs=0.006) and left_out == 0.0, trial
        assert exact <= float(torch.minimum(p, q).sum()) + 1e-9  # never above rejection sampling's bound


def test_a_draft_equal_to_the_model_is_always_accepted_and_a_greedy_one_with_its_tokens_chance():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert coupled_acceptance(p, p)[0] == pytest.approx(1.0)
    one_hot = torch.tensor([0.0, 1.0, 0.0, 0.0])  # a point mass samples its token whatever the draw
    assert coupled_acceptance(p, one_hot)[0] == pytest.approx(0.3)
    got = position_acceptance(p, torch.tensor([0.1, 0.6, 0.2, 0.1]))
    assert got["greedy"] == pytest.approx(0.3) and got["rejection"] == pytest.approx(0.1 + 0.3 + 0.15 + 0.05)
    # the sum stopped after the two likeliest tokens: each term is then p_i, and what is left out says 0.2
    assert coupled_acceptance(p, p, chunk=2, most=2) == (pytest.approx(0.8), pytest.approx(0.2))
    assert coupled_acceptance(p, p, chunk=1, tolerance=0.1) == (pytest.approx(0.95), pytest.approx(0.05))
