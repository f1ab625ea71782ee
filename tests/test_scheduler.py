"""Scheduler without a model: token budget, decode rows first, chunked prefill, max_num_seqs,
preemption by recompute when blocks run out (the lowest priority first; a draft gives way before anyone),
and removal at any point."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SeqStatus, Sequence
from kvstore.hashing import salt_for

B = 4
pytestmark = pytest.mark.timeout(30)


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 32) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, B, salt_for("sched-test"))
    return Scheduler(bm, max_num_seqs, budget), bm


def seq(seq_id: int, prompt_len: int, max_tokens: int = 4) -> Sequence:
    prompt = [seq_id * 1000 + i for i in range(prompt_len)]  # distinct prompts: no prefix hits
    return Sequence(seq_id, f"r{seq_id}", prompt, prompt_len, SamplingParams(max_tokens=max_tokens))


def advance(sch: Scheduler, bm: BlockManager) -> list[tuple[Sequence, int]]:
    """One step with a fake model: computed tokens advance, a complete sequence 'samples' a token."""
    batch = sch.schedule()
    done = []
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        bm.commit(s.seq_id, s.token_ids, s.num_computed_tokens)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(len(s.token_ids))
            if s.num_output_tokens >= s.params.max_tokens:
                done.append(s)
    sch.remove(done)
    for s in done:
        bm.free(s.seq_id)
    return list(zip(batch.seqs, batch.num_new_tokens, strict=True))


def test_budget_chunks_long_prompts_and_decodes_go_first():
    sch, bm = make(budget=16)
    sch.add(seq(1, 6))
    assert advance(sch, bm) == [(sch.running[0], 6)]
    long = seq(2, 40)
    sch.add(long)
    step = advance(sch, bm)
    # the decode row of seq 1 comes first, the long prompt takes the rest of the budget
    assert [(s.seq_id, n) for s, n in step] == [(1, 1), (2, 15)]
    step = advance(sch, bm)
    assert [(s.seq_id, n) for s, n in step] == [(1, 1), (2, 15)]
    assert sum(n for _, n in step) <= 16
    step = advance(sch, bm)
    assert [(s.seq_id, n) for s, n in step] == [(1, 1), (2, 10)]  # prompt done: 15 + 15 + 10
    assert long.num_output_tokens == 1


def test_max_num_seqs_caps_the_running_set():
    sch, bm = make(max_num_seqs=3, budget=1000)
    for i in range(5):
        sch.add(seq(i, 5))
    advance(sch, bm)
    assert len(sch.running) == 3 and len(sch.waiting) == 2
    while sch.has_unfinished():
        advance(sch, bm)
        assert len(sch.running) <= 3
    assert bm.num_free_blocks == 64


def test_preemption_by_recompute_finishes_everything():
    sch, bm = make(num_blocks=10, budget=64)  # 40 slots; 4 sequences want 4 * (8 + 8) = 64
    seqs = [seq(i, 8, max_tokens=8) for i in range(4)]
    for s in seqs:
        sch.add(s)
    steps = 0
    while sch.has_unfinished():
        step = advance(sch, bm)
        # a preempted sequence restarts from position 0 with its generated tokens as prompt
        for s, n in step:
            assert s.status in (SeqStatus.RUNNING, SeqStatus.FINISHED) and n >= 1
        steps += 1
        assert steps < 200
    assert sch.num_preemptions > 0
    assert [s.num_output_tokens for s in seqs] == [8] * 4
    # each output token equals the sequence length when it was sampled: recompute lost nothing
    assert all(s.token_ids[8:] == list(range(8, 16)) for s in seqs)
    assert bm.num_free_blocks == 10


def test_remove_at_any_point_keeps_queues_consistent():
    sch, bm = make(budget=8)
    a, b, c = seq(1, 4), seq(2, 20), seq(3, 4)
    for s in (a, b, c):
        sch.add(s)
    advance(sch, bm)  # a prefilled, b partly prefilled, c waiting
    assert b.num_computed_tokens == 4 and c.status is SeqStatus.WAITING
    sch.remove([b, c])
    for s in (b, c):
        bm.free(s.seq_id)
    assert sch.running == [a] and not sch.waiting
    sch.remove([a])
    bm.free(a.seq_id)
    assert not sch.has_unfinished() and bm.num_free_blocks == 64


def test_prefill_batch_tokens_starts_no_new_prompt_past_the_saturation_length():
    """Prompts that arrived together run one after another once a step holds the saturation length: the
    first prompt's first token does not wait for the second's compute. Short prompts still share a step."""
    sch, bm = make(budget=64)
    sch.prefill_batch_tokens = 10
    first, second, third = seq(1, 12), seq(2, 12), seq(3, 4)
    for s in (first, second, third):
        sch.add(s)
    assert [(s.seq_id, n) for s, n in advance(sch, bm)] == [(1, 12)]  # 12 >= 10: nobody starts beside it
    assert [(s.seq_id, n) for s, n in advance(sch, bm)] == [(1, 1), (2, 12)]  # the first decodes meanwhile
    small = [seq(4, 3), seq(5, 3), seq(6, 3), seq(7, 3)]
    sch2, bm2 = make(budget=64)
    sch2.prefill_batch_tokens = 10
    for s in small:
        sch2.add(s)
    assert [s.seq_id for s, _ in advance(sch2, bm2)] == [4, 5, 6, 7]  # 3 + 3 + 3 < 10 when the 4th starts
    unlimited, bm3 = make(budget=64)
    for s in (seq(8, 12), seq(9, 12)):
        unlimited.add(s)
    assert [s.seq_id for s, _ in advance(unlimited, bm3)] == [8, 9]


def test_waiting_prompts_keep_their_priority_then_the_routers_order_not_their_arrival_order():
    """Requests reach the engine in another order than the router sent them: the waiting queue sorts them
    by priority (their own, then the router's order), never ahead of a preempted sequence, and unprioritized
    ones go last."""
    sch, bm = make(budget=64)
    sch.prefill_batch_tokens = 1  # one new prompt a step: the order shows
    late, early, plain, urgent = seq(1, 8), seq(2, 8), seq(3, 8), seq(7, 8)
    late.priority, early.priority, urgent.priority = (0, 7), (0, 3), (-1, 9)
    for s in (plain, late, early, urgent):
        sch.add(s)
    assert [s.seq_id for s in sch.waiting] == [3, 7, 2, 1]  # none before the unprioritized one ahead of them
    sch2, bm2 = make(budget=64)
    sch2.prefill_batch_tokens = 1
    preempted = seq(4, 8)
    preempted.priority, preempted.admitted = (0, 9), True  # put back at the front after preemption
    sch2.waiting.appendleft(preempted)
    for s in (seq(5, 8), seq(6, 8)):
        s.priority = (0, 10 - s.seq_id)  # 5 -> 5, 6 -> 4: the second arrival was routed first
        sch2.add(s)
    assert [s.seq_id for s in sch2.waiting] == [4, 6, 5]
    assert [s.seq_id for s, _ in advance(sch2, bm2)] == [4]


def test_the_lowest_priority_is_preempted_and_waits_behind_higher_ones():
    """Blocks run out for three decoding sequences: the one of the lowest own priority goes, though it was
    admitted first (without priorities the latest admitted would); it waits behind a waiting request of a
    higher priority, and a later arrival of a higher priority goes ahead of it too, one of its own priority
    not."""
    sch, bm = make(num_blocks=6)
    low, high, mid = seq(1, 8), seq(2, 8), seq(3, 8)
    for s, own in ((low, 5), (high, 0), (mid, 2)):
        assert bm.allocate(s.seq_id, 0, 8)
        s.num_computed_tokens, s.priority = 7, (own, s.seq_id)
        s.token_ids.append(99)  # decoding: a token sampled, its K/V computed next (a third block each)
        s.num_computed_tokens = 8
        sch.add_running(s)
    waiting = seq(4, 8)
    waiting.priority = (1, 4)
    sch.add(waiting)
    batch = sch.schedule()
    assert batch.preempted == [low] and [s.seq_id for s in batch.seqs] == [2, 3]
    assert [s.seq_id for s in sch.waiting] == [4, 1]
    urgent, same = seq(5, 8), seq(6, 8)
    urgent.priority, same.priority = (3, 5), (5, 6)
    for s in (urgent, same):
        sch.add(s)
    assert [s.seq_id for s in sch.waiting] == [4, 5, 1, 6]


def test_a_draft_gives_way_before_a_sequence_is_preempted():
    """Two decoding sequences fill every block; a draft reaching into a third block is dropped (the sequence
    decodes one token) and nobody is preempted."""
    sch, bm = make(num_blocks=4)
    seqs = [seq(i, 7) for i in range(2)]
    for s in seqs:
        assert bm.allocate(s.seq_id, 0, 7)
        s.num_computed_tokens = 6  # decoding: its last token's K/V is computed next
        sch.add_running(s)
    seqs[0].draft_ids = [8, 9, 10]  # positions 7..9, past the sequence's two blocks
    batch = sch.schedule()
    assert batch.num_new_tokens == [1, 1] and not batch.preempted
    assert seqs[0].draft_ids == []


def test_a_draft_is_cut_to_the_token_budget():
    sch, bm = make(budget=3)
    s = seq(1, 7)
    assert bm.allocate(s.seq_id, 0, 7)
    s.num_computed_tokens = 6
    sch.add_running(s)
    s.draft_ids = [8, 9, 10, 11]
    assert sch.schedule().num_new_tokens == [3]
    assert s.draft_ids == [8, 9]


def _prompt(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), len(tokens), SamplingParams(max_tokens=1))


def test_a_prompt_whose_next_block_another_computes_in_the_step_waits_a_step_and_finds_it_cached():
    sch, bm = make(budget=64)
    system = list(range(500, 512))  # three full blocks, shared
    first, second = _prompt(1, [*system, 1, 2, 3]), _prompt(2, [*system, 7, 8])
    other, uncacheable = _prompt(3, list(range(900, 910))), _prompt(4, [*system, 9])
    uncacheable.prompt_logprobs = []  # scored whole: it takes nothing from the cache, so it never waits for it
    for s in (first, second, other, uncacheable):
        sch.add(s)
    step = advance(sch, bm)
    assert [(s.seq_id, n) for s, n in step] == [(1, 15), (3, 10), (4, 13)]  # the second waits; the others go
    assert [s.seq_id for s in sch.waiting] == [2]
    step = advance(sch, bm)
    assert (second, 2) in step and second.num_cached_tokens == 12  # the shared blocks, computed once
    assert sch.prompt_tokens_cached == 12


def test_a_prompt_does_not_wait_for_blocks_a_full_precision_residual_keeps_out_of_the_cache():
    bm = BlockManager(64, B, salt_for("sched-test"), residual_blocks=1)
    sch = Scheduler(bm, 8, 64)
    system = list(range(500, 512))
    for s in (_prompt(1, [*system, 1]), _prompt(2, [*system, 2])):
        sch.add(s)
    assert len(advance(sch, bm)) == 2  # waiting would not find them cached after the step
