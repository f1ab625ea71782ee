"""Penalty counts kept on the device across steps (``engine/token_counts.py``): brought up to date token by
token they equal counts taken afresh, extra tokens touch only the batch's copy, a row given back is cleared for
its next sequence, and the tables grow; batched penalties equal each row's alone; and the engine, decoding
with penalties through chunked prefill, preemption, async scheduling and speculation, gives transformers'
greedy tokens under the same penalties, and gives every row back."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_engine_model import build_hf_checkpoint, prompts
from transformers import LogitsProcessor, LogitsProcessorList

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampler import apply_penalties
from engine.sampling_params import SamplingParams
from engine.scheduler import Sequence
from engine.token_counts import TokenCounts

V = 40
pytestmark = pytest.mark.timeout(60)


def seq(seq_id: int, tokens: list[int], num_prompt: int, **penalties: float) -> Sequence:
    params = SamplingParams(**(penalties or dict(repetition_penalty=1.2)))
    return Sequence(seq_id, "", tokens, num_prompt, params)


def fresh(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output counts, seen) of ``seqs``' rows, counted from their whole histories in a new table."""
    counts = TokenCounts(V, "cpu", len(seqs)).penalties(seqs)
    return counts.output_counts, counts.seen


def test_counts_brought_up_to_date_token_by_token_equal_counts_taken_afresh():
    table = TokenCounts(V, "cpu", 4)
    a, b = seq(1, [3, 3, 5], 2), seq(2, [7, 8, 9, 9], 4, frequency_penalty=0.5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        got = table.penalties([a, b])
        want = fresh([seq(1, list(a.token_ids), 2), seq(2, list(b.token_ids), 4, frequency_penalty=0.5)])
        assert torch.equal(got.output_counts, want[0]) and torch.equal(got.seen, want[1])
        a.token_ids.append(int(torch.randint(0, V, (), generator=gen)))
        b.token_ids += torch.randint(0, 6, (2,), generator=gen).tolist()  # (two a step: a kept draft)
    assert got.output_counts[0].sum() == len(a.token_ids) - 1 - 2  # the output only, the prompt apart
    assert got.seen[0, 3] and got.output_counts[0, 3] == a.token_ids[2:-1].count(3)


def test_extra_tokens_count_in_the_batch_copy_only_and_rows_may_share_a_sequence():
    table = TokenCounts(V, "cpu", 2)
    s = seq(1, [1, 2, 4], 2)
    plain = seq(2, [1, 2], 2, repetition_penalty=1.0)  # no penalties: no row of its own
    # a draft [6, 6] verified position by position: the rows see nothing, then 6, then 6 twice
    got = table.penalties([s, plain, s, s], extra=([2, 3, 3], torch.tensor([6, 6, 6])))
    assert got.rows == [0, 2, 3] and got.row_index.tolist() == [0, 2, 3]
    assert got.output_counts[:, 6].tolist() == [0, 1, 2] and got.output_counts[:, 4].tolist() == [1, 1, 1]
    again = table.penalties([s])
    assert again.output_counts[0, 6] == 0 and not again.seen[0, 6]  # the table never took the draft


def test_a_row_given_back_is_cleared_for_the_next_sequence_and_the_tables_grow_past_capacity():
    table = TokenCounts(V, "cpu", 1)
    first = seq(1, [5, 5, 7, 7, 7], 2)
    table.penalties([first])
    table.forget(1)
    assert len(table) == 0
    second = seq(2, [1, 2], 1)  # takes the row the first held
    got = table.penalties([second])
    assert table.output.shape[0] == 1 and got.output_counts[0].tolist() == fresh([second])[0][0].tolist()
    assert not got.seen[0, 5] and not got.seen[0, 7]
    others = [seq(3 + i, [i, i + 1, 9], 2) for i in range(3)]  # four sequences at once: doubled, then doubled
    got = table.penalties([second, *others])
    assert table.output.shape[0] == 4 and len(table) == 4
    assert torch.equal(got.output_counts, fresh([second, *others])[0])
    assert torch.equal(got.seen, fresh([second, *others])[1])


def test_batched_penalties_equal_each_rows_alone_exactly():
    gen = torch.Generator().manual_seed(3)
    seqs = [seq(1, [1, 4, 4, 9, 2], 2),
            seq(2, [3, 3, 8, 8, 8], 2, frequency_penalty=0.25, presence_penalty=0.5),
            seq(3, [5, 6], 2, repetition_penalty=1.0),
            seq(4, [0, 7, 7, 1], 1, repetition_penalty=0.7, frequency_penalty=-0.3, presence_penalty=1.5),
            seq(5, [2, 6, 6], 1, presence_penalty=0.8)]  # (alone, a batch with no repetition penalty)
    x = torch.randn(len(seqs), V, generator=gen) * 3
    params = [s.params for s in seqs]
    together = apply_penalties(x, params, TokenCounts(V, "cpu", len(seqs)).penalties(seqs))
    for r, s in enumerate(seqs):
        alone = apply_penalties(x[r:r + 1], [s.params], TokenCounts(V, "cpu", 1).penalties([s]))
        assert torch.equal(together[r], alone[0]), r
    assert torch.equal(together[2], x[2])  # a row without penalties is left as it is
    assert together[4, 6] == x[4, 6] - 0.8 and torch.equal(together[4, :6], x[4, :6])
    assert torch.equal(apply_penalties(x[2:3], params[2:3], None), x[2:3])
    with pytest.raises(ValueError, match="TokenCounts"):
        apply_penalties(x, params, None)


class OpenAIPenalties(LogitsProcessor):
    """The frequency and presence penalties over a batch's output tokens (those after ``prompt_len``)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones(output.shape, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


PENALTIES = [dict(repetition_penalty=1.5), dict(frequency_penalty=0.7, presence_penalty=0.4),
             dict(repetition_penalty=1.3, frequency_penalty=0.3),
             dict(repetition_penalty=0.8, presence_penalty=1.0)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["sync", "async", "speculative"])
def test_the_engine_decodes_with_penalties_as_transformers_does(tmp_path, mode):
    """Four penalized requests (and one without), two running at a time in too few blocks for both, so a
    sequence is preempted and its row given back until it runs again, and a finished one's row goes to the
    next. Speculating, each request's predicted output is transformers' own, so its drafts are kept, and each
    verified position is penalized for the draft tokens before it."""
    hf = build_hf_checkpoint(tmp_path, "llama")
    requests = prompts((9, 21, 30, 12, 17))
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **p) for p in [*PENALTIES, {}]]
    want = []
    with torch.no_grad():
        for ids, p in zip(requests, params, strict=True):
            penalties = OpenAIPenalties(len(ids), p.frequency_penalty, p.presence_penalty)
            processors = LogitsProcessorList([penalties])
            tokens = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                 repetition_penalty=p.repetition_penalty, logits_processor=processors)
            want.append(tokens[0, len(ids):].tolist())
    extra = {"sync": {}, "async": dict(async_scheduling=True),
             "speculative": dict(num_speculative_tokens=3)}[mode]
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=16, num_blocks=5, max_num_seqs=2,
                                 max_num_batched_tokens=16, **extra))
    for i, (ids, p, tokens) in enumerate(zip(requests, params, want, strict=True)):
        engine.add_request(str(i), ids, replace(p, prediction_ids=tokens) if mode == "speculative" else p)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert len(engine.token_counts) <= len(engine.scheduler.running)  # none held while waiting
    assert engine.scheduler.num_preemptions > 0 and len(engine.token_counts) == 0
    if mode == "speculative":
        assert engine.speculation.accepted_tokens > len(requests) * 10
    assert [got[str(i)] for i in range(len(requests))] == want


def test_an_aborted_sequence_gives_its_row_back(tmp_path):
    build_hf_checkpoint(tmp_path, "llama")
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=16, num_blocks=16))
    engine.add_request("a", prompts((20,))[0], SamplingParams(max_tokens=50, repetition_penalty=1.2))
    while len(engine.token_counts) == 0:
        engine.step()
    engine.abort("a")
    assert len(engine.token_counts) == 0
