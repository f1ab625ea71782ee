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
        p, q = (p / p.sum()).double(), (q / q.sum()).double()
        draws = torch.empty(200_000, 7).exponential_(generator=gen)
        counted = float(((p / draws).argmax(dim=1) == (q / draws).argmax(dim=1)).double().mean())
        exact = coupled_acceptance(p, q)
        assert exact == pytest.approx(counted, abs=0.006), trial
        brute = sum(1 / float(torch.maximum(p / p[i], q / q[i]).sum()) for i in range(7))  # the definition
        assert exact == pytest.approx(brute, rel=1e-9)
        assert exact <= float(torch.minimum(p, q).sum()) + 1e-9  # never above rejection sampling's bound


def test_a_draft_equal_to_the_model_is_always_accepted_and_a_greedy_one_with_its_tokens_chance():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert coupled_acceptance(p, p) == pytest.approx(1.0)
    one_hot = torch.tensor([0.0, 1.0, 0.0, 0.0])  # a point mass samples its token whatever the draw
    assert coupled_acceptance(p, one_hot) == pytest.approx(0.3)
    assert coupled_acceptance(p, torch.tensor([0.0, 0.0, 0.0, 1.0])) == pytest.approx(0.05)
    assert coupled_acceptance(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.5, 0.5])) == pytest.approx(1 / 3)
    got = position_acceptance(p, torch.tensor([0.1, 0.6, 0.2, 0.1]))
    assert got["greedy"] == pytest.approx(0.3) and got["rejection"] == pytest.approx(0.1 + 0.3 + 0.15 + 0.05)
