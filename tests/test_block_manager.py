"""Block manager: free list and reference counts, prefix cache (hash hits confirmed against token ids),
LRU reuse of freed cached blocks with stored/removed events in order, copy-on-write, reservations, waste."""

from __future__ import annotations

import random

import pytest

import engine.block_manager as block_manager_module
from engine.block_events import BlockRemoved, BlockStored
from engine.block_manager import BlockManager
from engine.errors import OutOfBlocksError
from kvstore.hashing import block_hashes, salt_for

B = 4
SALT = salt_for("test-model")
pytestmark = pytest.mark.timeout(30)


def manager(num_blocks: int = 16, **kwargs) -> BlockManager:
    kwargs.setdefault("record_events", True)
    return BlockManager(num_blocks, B, SALT, **kwargs)


def run_prompt(bm: BlockManager, seq_id: int, tokens: list[int]) -> list[int]:
    """Admit a prompt the way the scheduler does, 'compute' it and register its full blocks."""
    prefix = bm.cached_prefix(tokens, (len(tokens) - 1) // B)
    cached = len(prefix[0]) * B
    assert bm.allocate(seq_id, cached, len(tokens) - cached, prefix)
    bm.commit(seq_id, tokens, len(tokens))
    return bm.block_table(seq_id)


def test_allocate_and_free_restore_the_free_count():
    bm = manager(8)
    assert bm.allocate(1, 0, 9)  # 3 blocks
    assert bm.num_free_blocks == 5
    assert [bm.ref[b] for b in bm.block_table(1)] == [1, 1, 1]
    assert not bm.allocate(2, 0, 6 * B)  # 6 blocks > 5 free: refused, nothing taken
    assert bm.num_free_blocks == 5 and 2 not in bm.seqs
    assert bm.allocate(1, 9, 3)  # positions 9..11 still fit in block 3
    assert len(bm.block_table(1)) == 3
    assert bm.allocate(1, 12, 1)
    assert len(bm.block_table(1)) == 4
    bm.free(1)
    assert bm.num_free_blocks == 8 and all(r == 0 for r in bm.ref)


def test_prefix_hit_reuses_blocks_and_reports_stored_hashes():
    bm = manager(16)
    prompt = list(range(100, 114))  # 3 full blocks + 2 tokens
    table_a = run_prompt(bm, 1, prompt)
    stored = block_hashes(prompt, B, SALT)  # the engine, pool and router agree on hashes
    assert bm.take_events() == [BlockStored(stored)]
    bm.free(1)
    assert bm.num_free_blocks == 16  # cached blocks are free (reusable) but keep their contents
    blocks, hashes = bm.cached_prefix(prompt + [7, 8, 9])
    assert blocks == table_a[:3] and hashes == stored
    table_b = run_prompt(bm, 2, prompt[:12] + [1, 2, 3, 4, 5])
    assert table_b[:3] == table_a[:3]
    assert [bm.ref[b] for b in table_b] == [1] * len(table_b)
    # only the fourth block is new
    assert bm.take_events() == [BlockStored(block_hashes(prompt[:12] + [1, 2, 3, 4], B, SALT)[3:])]
    assert bm.cached_prefix(prompt[:4] + [0, 0, 0, 0]) == ([table_a[0]], stored[:1])


def test_hash_hit_is_confirmed_against_token_ids(monkeypatch):
    bm = manager(16)
    # every block of every prompt now hashes alike: only the stored token ids can tell them apart
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent, tokens, salt: 42)
    run_prompt(bm, 1, [1, 2, 3, 4, 5])
    assert bm.cached_prefix([1, 2, 3, 4, 9]) == ([bm.block_table(1)[0]], [42])
    assert bm.cached_prefix([9, 9, 9, 9, 9]) == ([], [])


def test_freed_cached_blocks_are_reused_last_in_lru_order():
    bm = manager(6)
    run_prompt(bm, 1, [1] * 8 + [0])  # blocks: 2 cached + 1 partial
    run_prompt(bm, 2, [2] * 4 + [0])  # 1 cached + 1 partial
    hashes_1, hashes_2 = bm.seqs[1].hashes, bm.seqs[2].hashes
    assert bm.take_events() == [BlockStored(hashes_1), BlockStored(hashes_2)]
    bm.free(1)
    bm.free(2)  # freed after seq 1: evicted after seq 1's blocks
    assert bm.num_free_blocks == 6
    assert bm.allocate(3, 0, 3 * B)  # the 3 never-cached free blocks first: nothing evicted
    assert bm.take_events() == []
    assert bm.cached_prefix([1] * 8)[0] and bm.cached_prefix([2] * 4)[0]
    assert bm.allocate(4, 0, B)  # now the least recently freed cached block: seq 1's tail first
    assert bm.take_events() == [BlockRemoved([hashes_1[1]])]
    assert bm.allocate(4, B, 2 * B)
    assert bm.take_events() == [BlockRemoved([hashes_1[0], hashes_2[0]])]
    assert bm.cached_prefix([1] * 8) == ([], [])
    assert bm.num_free_blocks == 0


def test_fork_shares_blocks_and_copy_on_write_separates_them():
    bm = manager(16)
    prompt = list(range(10))  # 2 full blocks + a partial one holding 2 tokens
    run_prompt(bm, 1, prompt)
    bm.fork(1, 2)
    shared = list(bm.block_table(1))
    assert bm.block_table(2) == shared and [bm.ref[b] for b in shared] == [2, 2, 2]
    # sample 1 writes position 10 into the shared partial block: it gets a copy first
    assert bm.allocate(1, 10, 1)
    (copy,) = bm.take_copies()
    assert copy == (shared[2], bm.block_table(1)[2]) and bm.block_table(1)[2] != shared[2]
    assert bm.block_table(1)[:2] == shared[:2]
    assert [bm.ref[b] for b in bm.block_table(1)] == [2, 2, 1]
    # sample 2 is now the only reader of the original partial block: it writes in place
    assert bm.allocate(2, 10, 1)
    assert bm.take_copies() == [] and bm.block_table(2) == shared
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 16


def test_reserve_raises_out_of_blocks():
    bm = manager(4)
    assert len(bm.reserve("r1", 3 * B)) == 3
    with pytest.raises(OutOfBlocksError) as err:
        bm.reserve("r2", 2 * B)
    assert err.value.needed == 2 and err.value.free == 1
    bm.free("r1")
    assert bm.num_free_blocks == 4


def test_reserve_leaves_the_blocks_it_is_asked_to_keep_free():
    bm = manager(4)
    with pytest.raises(OutOfBlocksError, match=r"need 3 KV blocks \(and 2 kept for running sequences to grow "
                                               r"into\), 4 free") as err:
        bm.reserve("r1", 3 * B, keep_free=2)
    assert (err.value.needed, err.value.free, err.value.kept) == (3, 4, 2) and bm.num_free_blocks == 4
    assert len(bm.reserve("r1", 3 * B, keep_free=1)) == 3


def test_insert_makes_fetched_blocks_prefix_hits():
    bm = manager(8)
    tokens = list(range(50, 61))  # 2 full blocks
    placed = bm.insert(tokens, 2)
    assert [i for i, _ in placed] == [0, 1]
    assert bm.take_events() == [BlockStored(block_hashes(tokens, B, SALT))]
    assert bm.cached_prefix(tokens)[0] == [b for _, b in placed]
    assert bm.num_free_blocks == 8  # cached, unreferenced
    assert bm.insert(tokens, 2) == []  # already cached: nothing placed twice
    assert bm.take_events() == []


def test_events_come_out_in_the_order_they_happened_and_take_clears_them():
    bm = manager(2)
    run_prompt(bm, 1, [1] * B + [0])  # one full block registered, one partial
    (first,) = bm.seqs[1].hashes
    bm.free(1)
    # two fetched blocks: the partial block is reused, then the cached one is evicted for the second
    fetched = [2] * 2 * B
    assert [i for i, _ in bm.insert(fetched, 2)] == [0, 1]
    assert bm.take_events() == [BlockStored([first]), BlockRemoved([first]),
                                BlockStored(block_hashes(fetched, B, SALT))]
    assert bm.take_events() == []


def test_events_are_not_kept_unless_asked_for():
    bm = manager(2, record_events=False)  # an engine with no pool to publish to
    run_prompt(bm, 1, [1] * B + [0])
    bm.free(1)
    bm.insert([2] * 2 * B, 2)
    assert bm.take_events() == []


def test_waste_of_a_mixed_batch_is_under_4_percent():
    rng = random.Random(0)
    bm = BlockManager(4096, 16, SALT)
    for seq_id in range(40):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(64, 900))]
        run_prompt(bm, seq_id, prompt)
    allocated, used = bm.usage()
    assert used <= allocated
    assert (allocated - used) / allocated < 0.04
