"""The engine's disaggregation and pool API on the tiny random Llama of test_engine_loop: KV export and
import between engines (tokens and text as a single engine gives them), reservations, pool inserts, the
block events the prefix cache queues, and the layer callback that ships completing prompts early."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine_loop import GREEDY, alone, make_engine, prompt, run, run_outputs, write_model

from engine.block_events import BlockRemoved, BlockStored
from engine.errors import OutOfBlocksError
from engine.output import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from kvstore.hashing import block_hashes, salt_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("engine-handoff"))


def hand_off(model_dir, ids: list[int], params: SamplingParams) -> tuple[list[RequestOutput], int, int]:
    """Prefill on one engine, move the KV to another and decode there: (the outputs of both sides, blocks
    moved, hashes exported). Both engines end with every block free."""
    prefill = make_engine(model_dir)
    prefill.add_request("r", ids, params, prefill_only=True)
    (first,) = prefill.step()
    assert first.finish_reason is FinishReason.PREFILLED and not prefill.has_unfinished()
    block_ids = prefill.request_block_ids("r")
    tensor, hashes = prefill.kv_cache.export_blocks(block_ids), prefill.export_cached_prefix(ids)[1]
    prefill.release("r")
    assert prefill.stats().free_blocks == prefill.stats().total_blocks

    decode = make_engine(model_dir)
    reserved = decode.reserve_blocks("r", len(ids))
    decode.kv_cache.import_blocks(reserved, tensor)
    decode.add_imported_request("r", ids, first.new_token_ids[0], params, reserved)
    outputs = [first, *run_outputs(decode)]
    assert decode.stats().free_blocks == decode.stats().total_blocks
    return outputs, len(block_ids), len(hashes)


@pytest.mark.parametrize("sampling", [GREEDY, dict(temperature=0.8, seed=3, ignore_eos=True)])
def test_export_import_decode_equals_single_engine(model_dir, sampling):
    ids = prompt(37, seed=4)
    params = SamplingParams(max_tokens=16, **sampling)
    single = make_engine(model_dir)
    single.add_request("r", ids, params)
    expected = run_outputs(single)
    outputs, num_blocks, num_hashes = hand_off(model_dir, ids, params)
    assert (num_blocks, num_hashes) == (3, 2)  # the two full blocks have hashes, the partial third not
    assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in expected]
    assert [o.text for o in outputs] == [o.text for o in expected]


def test_handed_off_text_holds_back_and_cuts_a_stop_string_as_one_engine_does(model_dir):
    engine = make_engine(model_dir)
    ids = engine.tokenizer.encode("The tide comes in")
    base = run(engine, {"a": (ids, SamplingParams(max_tokens=12, **GREEDY))})[("a", 0)]
    text = engine.tokenizer.decode(base)
    params = SamplingParams(max_tokens=12, stop=[text[5:7]], **GREEDY)
    engine.add_request("b", ids, params)
    expected = run_outputs(engine)
    assert expected[-1].finish_reason is FinishReason.STOP
    outputs, _, _ = hand_off(model_dir, ids, params)

    def fields(o: RequestOutput) -> tuple:
        return o.new_token_ids, o.text, o.finished, o.finish_reason, o.stop_reason
    assert outputs[0].text == expected[0].text
    assert [fields(o) for o in outputs[1:]] == [fields(o) for o in expected[1:]]


def test_a_reservation_leaves_each_running_sequence_a_block_to_grow_into(model_dir):
    """Taking the block a running sequence needs next would preempt it: on a decode worker that means
    computing its prompt again."""
    engine = make_engine(model_dir, num_blocks=8)
    engine.add_request("running", prompt(20, seed=3), SamplingParams(max_tokens=28, **GREEDY))
    engine.step()  # prefilled: it decodes now, and wants a third (its last) block at its 33rd token
    free = engine.stats().free_blocks
    assert free == 6
    with pytest.raises(OutOfBlocksError) as refused:
        engine.reserve_blocks("lease", free * 16)
    assert (refused.value.needed, refused.value.kept) == (free, 1)
    assert len(engine.reserve_blocks("lease", (free - 1) * 16)) == free - 1
    outputs = [o for _ in range(27) for o in engine.step()]  # it grows into the block that was kept
    assert len(outputs) == 27 and outputs[-1].finish_reason == FinishReason.LENGTH
    assert engine.scheduler.num_preemptions == 0


def test_num_reserved_decode_tokens_keeps_room_for_running_sequences_to_finish(model_dir):
    """With --num-reserved-decode-tokens 64 a reservation leaves the running sequence the blocks for its next
    64 tokens (its 59 left, here: up to position 79, 5 blocks), so it finishes without a preemption where
    the default keeps it one block."""
    engine = make_engine(model_dir, num_blocks=8, num_reserved_decode_tokens=64)
    engine.add_request("running", prompt(20, seed=3), SamplingParams(max_tokens=60, **GREEDY))
    engine.step()  # 21 tokens in 2 blocks; 80 tokens take 5
    free = engine.stats().free_blocks
    with pytest.raises(OutOfBlocksError) as refused:
        engine.reserve_blocks("lease", (free - 2) * 16)
    assert (refused.value.needed, refused.value.kept) == (free - 2, 3)
    assert len(engine.reserve_blocks("lease", (free - 3) * 16)) == free - 3
    outputs = [o for _ in range(59) for o in engine.step()]
    assert len(outputs) == 59 and outputs[-1].finish_reason == FinishReason.LENGTH
    assert engine.scheduler.num_preemptions == 0


def test_a_lease_still_waiting_for_its_kv_keeps_room_to_grow_like_a_running_sequence(model_dir):
    """A lease joins the batch once its K/V arrives: a reservation made meanwhile leaves it the blocks for
    its next --num-reserved-decode-tokens (at most the max_new_tokens it was reserved with), and none once
    it is released."""
    engine = make_engine(model_dir, num_blocks=8, num_reserved_decode_tokens=64)
    assert len(engine.reserve_blocks("arriving", 20, max_new_tokens=59)) == 2  # 79 positions take 5 blocks
    with pytest.raises(OutOfBlocksError) as refused:
        engine.reserve_blocks("next", 4 * 16)
    assert (refused.value.free, refused.value.kept) == (6, 3)
    assert len(engine.reserve_blocks("next", 3 * 16, max_new_tokens=1)) == 3
    engine.release("arriving")
    engine.release("next")
    assert len(engine.reserve_blocks("alone", 8 * 16)) == 8


def test_reservations_and_pool_inserts(model_dir):
    engine = make_engine(model_dir, num_blocks=8)
    with pytest.raises(OutOfBlocksError):
        engine.reserve_blocks("big", 9 * 16)
    block_ids = engine.reserve_blocks("lease", 20)
    assert len(block_ids) == 2 and engine.stats().free_blocks == 6
    engine.release("lease")
    assert engine.stats().free_blocks == 8
    assert engine.take_block_events() == []  # reserved blocks are not registered

    # KV fetched from another engine's cache becomes a local prefix hit with the same output
    source = make_engine(model_dir)
    shared = prompt(48, seed=6)
    hashes = block_hashes(shared, 16, salt_for(source.model_id))
    source.add_request("s", shared + [1], SamplingParams(max_tokens=4, **GREEDY), prefill_only=True)
    source.step()
    assert source.take_block_events() == [BlockStored(hashes)]
    tensor, _ = source.export_cached_prefix(shared)
    target = make_engine(model_dir)
    assert target.cached_prefix_len(shared) == 0
    assert target.insert_cached_blocks(shared, tensor) == 3
    assert target.take_block_events() == [BlockStored(hashes)]  # published like computed blocks
    assert target.cached_prefix_len(shared) == 48
    ids = shared + prompt(6, seed=7)
    params = SamplingParams(max_tokens=6, **GREEDY)
    assert run(target, {"t": (ids, params)})[("t", 0)] == alone(model_dir, ids, params)
    assert target.stats().prompt_tokens_computed == 6


def test_block_events_queue_stored_then_evicted_blocks_in_order(model_dir):
    engine = make_engine(model_dir, num_blocks=4)
    a, b = prompt(33, seed=11), prompt(40, seed=12)  # 2 full blocks each; 3 blocks with their output
    salt = salt_for(engine.model_id)
    run(engine, {"a": (a, SamplingParams(max_tokens=4, **GREEDY))})
    run(engine, {"b": (b, SamplingParams(max_tokens=4, **GREEDY))})  # takes the 2 free blocks and a's tail
    hashes_a = block_hashes(a, 16, salt)
    assert engine.take_block_events() == [BlockStored(hashes_a), BlockRemoved(hashes_a[1:]),
                                          BlockStored(block_hashes(b, 16, salt))]
    assert engine.take_block_events() == []


def test_layer_callback_sees_the_requests_completing_prefill(model_dir):
    engine = make_engine(model_dir, max_num_batched_tokens=32)
    engine.add_request("p", prompt(50, 1), SamplingParams(max_tokens=4, **GREEDY), prefill_only=True)
    seen = []
    while engine.has_unfinished():
        engine.step(on_layer_done=lambda layer, completing: seen.append((layer, dict(completing))))
    # chunks of 32 + 18 tokens: only the second step completes the prompt
    assert [layer for layer, _ in seen] == [0, 1, 0, 1]
    assert [c for _, c in seen[:2]] == [{}, {}]
    assert seen[2][1] == seen[3][1] == {"p": engine.request_block_ids("p")}
