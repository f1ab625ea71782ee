"""Async scheduling (``EngineConfig.async_scheduling``, engine/engine.py ``_step_ahead``): a step is launched
before the last one's tokens reach the host, fed those tokens on the device, and the host handles them while
its forward pass runs, then samples. Every request gets the tokens, text, finish reason and logprobs of
synchronous steps (greedy and seeded sampling, penalties, bad words, a structured output, stop tokens, stop
strings, min_tokens, max_tokens, prompts arriving while others decode, an abort, preemption, a failed step),
its outputs one step later; a sequence ended by a stop computes one position more and no other does; the step
computing the prompt of a request for n samples or for its prompt's logprobs runs synchronously, and the steps
after it ahead; and every block is free at the end. On the torch backend, with the built-in tiny model's
byte-level tokenizer (the Triton graph buffers' feed: test_triton_engine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import TOKEN_ON_DEVICE, Engine
from engine.output import FinishReason
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from engine.tiny import CONFIG, write_tiny_checkpoint
from services.cli import build_parser
from services.config import configs_from_args

pytestmark = pytest.mark.timeout(120)

# one layer, hidden 64: the tiny model's tokenizer, steps of a few milliseconds
SMALL = dict(CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("async-scheduling")
    write_tiny_checkpoint(path, SMALL)
    return path


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 37 + 11 * j) % 250 + 1 for j in range(n)]


def drive(engine: Engine, requests: dict[str, tuple[int, list[int], SamplingParams]],
          abort_after: tuple[str, int] | None = None) -> tuple[dict, list[dict[str, int]], int]:
    """Run to completion, adding each request (arrival call, prompt, params) before that call of ``step``,
    aborting ``abort_after[0]`` once it has received ``abort_after[1]`` tokens; returns (each request's
    tokens, text, finish reason and logprobs; per call, the tokens each request received; the decode rows
    the steps computed)."""
    results: dict[str, tuple] = {}
    calls: list[dict[str, int]] = []
    call = decode_rows = 0
    while call <= max(arrival for arrival, _, _ in requests.values()) or engine.has_unfinished():
        for rid, (arrival, ids, params) in requests.items():
            if arrival == call:
                engine.add_request(rid, ids, params)
        received: dict[str, int] = {}
        for out in engine.step():
            key = out.request_id if out.index == 0 else f"{out.request_id}#{out.index}"  # (samples of n > 1)
            tokens, text, _, logprobs = results.get(key, ([], "", None, []))
            results[key] = (tokens + out.new_token_ids, text + out.text, out.finish_reason,
                            logprobs + (out.logprobs or []))
            received[key] = received.get(key, 0) + len(out.new_token_ids)
        calls.append(received)
        decode_rows += 0 if engine.last_step is None else engine.last_step.decode_seqs
        if abort_after is not None:
            rid, count = abort_after
            if len(results.get(rid, [[]])[0]) >= count and results[rid][2] is None:
                engine.abort(rid)
        call += 1
    return results, calls, decode_rows


def both(model_dir: Path, requests: dict, abort_after: tuple[str, int] | None = None, **options
         ) -> dict[bool, tuple[dict, list, Engine]]:
    """``drive`` on a synchronous engine and an async-scheduled one, alike otherwise."""
    runs = {}
    for async_scheduling in (False, True):
        engine = Engine(EngineConfig(model=str(model_dir), attention_backend="torch",
                                     async_scheduling=async_scheduling, **options))
        runs[async_scheduling] = (*drive(engine, requests, abort_after)[:2], engine)
    return runs


def mixed_requests() -> dict[str, tuple[int, list[int], SamplingParams]]:
    """Greedy and seeded requests of every stop kind, two asking for logprobs, two with penalties, one with bad
    words, one with a structured output; some arrive while others decode."""
    return {
        "greedy-length": (0, prompt(40, 1), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                           logprobs=3)),
        "seeded": (0, prompt(23, 2), SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=7,
                                                    ignore_eos=True, logprobs=0)),
        "stop-token": (0, prompt(31, 3), SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[82])),
        "stop-string": (2, prompt(17, 4), SamplingParams(max_tokens=40, temperature=0.0, stop=["h\n"])),
        "min-tokens": (3, prompt(50, 5), SamplingParams(max_tokens=20, temperature=0.8, seed=3, min_tokens=12,
                                                        stop_token_ids=[115, 116, 117])),
        "late": (9, prompt(64, 6), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        # Penalties, bad words and grammars read the history, whose last token reaches the host while the next
        # step's forward pass runs. Two tokens allowed, none in the prompt: the penalty of the one just sampled
        # decides the next.
        "repetition": (0, prompt(30, 7), SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True,
                                                        repetition_penalty=1.4, allowed_token_ids=[252, 253])),
        "frequency": (4, prompt(26, 8), SamplingParams(max_tokens=28, temperature=0.3, seed=5, ignore_eos=True,
                                                       frequency_penalty=0.8, presence_penalty=0.5,
                                                       allowed_token_ids=[254, 255])),
        # ... and two tokens biased far above the rest, each a bad word when repeated: the two alternate
        "bad-words": (1, prompt(19, 9), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                       logit_bias=[(250, 100.0), (251, 99.0)],
                                                       bad_words_token_ids=[[250, 250], [251, 251]])),
        "structured": (2, prompt(21, 10), SamplingParams(max_tokens=30, temperature=0.7, seed=9,
                                                         structured_output=StructuredOutput("regex", REGEX))),
    }


REGEX = r"[0-9]{3}-[a-z]{2,4}"


def test_async_steps_give_each_request_the_tokens_text_and_finish_of_synchronous_steps_a_step_later(model_dir):
    runs = both(model_dir, mixed_requests())
    (sync, sync_calls, _), (ahead, ahead_calls, engine) = runs[False], runs[True]
    assert {rid: r[:3] for rid, r in ahead.items()} == {rid: r[:3] for rid, r in sync.items()}
    reasons = {rid: reason for rid, (_, _, reason, _) in sync.items()}
    # logprobs, computed on the device with each token: the sampled token's, its rank and the top ones asked for
    # (to float32 rounding: a step that computes a row for an ended sequence batches its matmuls otherwise)
    for rid in ("greedy-length", "seeded"):
        got, want = ahead[rid][3], sync[rid][3]
        assert [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in got] == [
            (lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in want]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-5)
    assert [len(lp.top) for lp in ahead["greedy-length"][3]] == [3] * 24 and len(ahead["seeded"][3]) == 30
    assert all(lp.rank == 1 for lp in ahead["greedy-length"][3])
    # the workload has what it claims: each kind of end, and a stop string cut out of the text
    assert reasons["stop-token"] is reasons["stop-string"] is FinishReason.STOP
    assert reasons["greedy-length"] is reasons["late"] is FinishReason.LENGTH
    assert len(sync["min-tokens"][0]) >= 12 and sync["stop-string"][0][-2:] == [104, 10]
    assert "h" not in sync["stop-string"][1]
    bad_words = sync["bad-words"][0]
    assert len(bad_words) == 16 and all(a != b for a, b in zip(bad_words, bad_words[1:], strict=False))
    assert re.fullmatch(REGEX, sync["structured"][1]) and reasons["structured"] is FinishReason.STOP
    # a request's tokens reach the caller one call later: what a call returns is the step before's
    for rid in sync:
        first_sync = next(i for i, got in enumerate(sync_calls) if rid in got)
        first_ahead = next(i for i, got in enumerate(ahead_calls) if rid in got)
        assert first_ahead == first_sync + 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_only_a_sequence_ended_by_a_stop_computes_a_token_past_its_end(model_dir):
    """One ended by its stop token or stop string is found ended while the next step runs, which computed a
    row for it; one ended by max_tokens is known to end and is not scheduled again."""
    decode_rows = {}
    for async_scheduling in (False, True):
        engine = Engine(EngineConfig(model=str(model_dir), attention_backend="torch",
                                     async_scheduling=async_scheduling))
        results, _, decode_rows[async_scheduling] = drive(engine, mixed_requests())
    stopped = sum(reason is FinishReason.STOP for _, _, reason, _ in results.values())
    assert stopped == 4 and decode_rows[True] == decode_rows[False] + stopped


def test_preempted_and_aborted_sequences_under_async_scheduling_end_as_synchronous_ones(model_dir):
    """Few blocks: sequences are preempted (a decoding one's last token is still on the device then: it is
    recomputed with that token once it is known) and one request is aborted while its next token is in
    flight; the others' outputs are the synchronous run's, the aborted one's a prefix of its, and no block
    is lost."""
    requests = {f"r{i}": (i // 3, prompt(30 + 7 * i, i), SamplingParams(
        max_tokens=26, temperature=0.0 if i % 2 else 0.7, seed=i, ignore_eos=True)) for i in range(8)}
    runs = both(model_dir, requests, abort_after=("r2", 5), num_blocks=36, block_size=16)
    (sync, _, sync_engine), (ahead, _, engine) = runs[False], runs[True]
    assert engine.scheduler.num_preemptions > 0 and sync_engine.scheduler.num_preemptions > 0
    assert {rid: r for rid, r in ahead.items() if rid != "r2"} == {
        rid: r for rid, r in sync.items() if rid != "r2"}
    aborted_tokens, _, reason, _ = ahead["r2"]
    assert reason is FinishReason.ABORT and aborted_tokens == sync["r2"][0][:len(aborted_tokens)]
    assert len(aborted_tokens) >= 5
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("kind", ["n-samples", "prompt-logprobs"])
def test_a_request_whose_prompt_step_needs_the_host_runs_that_step_synchronously_then_ahead(model_dir, kind):
    """A request for n = 3 seeded samples (forked from its prompt once that is computed) or for its prompt's
    logprobs (read from the logits of the step computing its prompt, handed out with its first token) joins a
    decoding one: the step that computes its prompt is synchronous (its first tokens come in the call that
    computed them), the steps after run ahead (its last tokens come a call later); its outputs equal the
    synchronous run's."""
    params = (SamplingParams(max_tokens=12, n=3, temperature=0.8, seed=11, ignore_eos=True) if kind == "n-samples"
              else SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2))
    requests = {
        "plain": (0, prompt(20, 1), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
        "new": (3, prompt(15, 2), params),
    }
    runs = both(model_dir, requests)
    (sync, sync_calls, _), (ahead, ahead_calls, _) = runs[False], runs[True]
    samples = ["new", "new#1", "new#2"] if kind == "n-samples" else ["new"]
    assert ahead == sync and all(len(sync[key][0]) == 12 for key in samples)
    assert len({tuple(sync[key][0]) for key in samples}) == len(samples)  # three samples, not one thrice
    for key in samples:
        calls = {run: [i for i, got in enumerate(c) if key in got] for run, c in (("sync", sync_calls),
                                                                                   ("ahead", ahead_calls))}
        assert calls["ahead"][0] == calls["sync"][0] and calls["ahead"][-1] == calls["sync"][-1] + 1


def test_async_scheduling_is_a_serve_flag_and_off_by_default():
    args = build_parser().parse_args(["serve", "--async-scheduling"])
    assert configs_from_args(args)[0].engine.async_scheduling
    assert not configs_from_args(build_parser().parse_args(["serve"]))[0].engine.async_scheduling


def test_a_step_that_fails_loses_no_token_of_the_step_in_flight(model_dir):
    """A step fails (injected in its forward pass) right after it preempted a sequence whose last token was
    still on the device; the caller then ends the requests the failed step ran, as ``EngineLoop`` does. The
    preempted sequence gets that token from the step before, which stays in flight, and ends as the
    synchronous run's; no other step fails and no block is lost."""
    requests = {f"r{i}": (i // 3, prompt(30 + 7 * i, i), SamplingParams(
        max_tokens=26, temperature=0.0 if i % 2 else 0.7, seed=i, ignore_eos=True)) for i in range(8)}
    sync = both(model_dir, requests, num_blocks=36, block_size=16)[False][0]
    engine = Engine(EngineConfig(model=str(model_dir), attention_backend="torch", async_scheduling=True,
                                 num_blocks=36, block_size=16))
    schedule, run, victims = engine._schedule, engine.runner.run, []

    def schedule_and_note_preempted_tokens_in_flight():
        batch = schedule()
        if not victims:
            victims.extend(s.request_id for s in batch.preempted if s.token_ids[-1] == TOKEN_ON_DEVICE)
        return batch

    def run_failing_once(*args):
        if victims and not failures:
            raise RuntimeError("injected")
        return run(*args)
    engine._schedule, engine.runner.run = schedule_and_note_preempted_tokens_in_flight, run_failing_once
    results: dict[str, list[int]] = {}
    ended: dict[str, FinishReason] = {}
    failures, failed_requests, call = [], set(), 0
    while call < 3 or engine.has_unfinished():
        for rid, (arrival, ids, params) in requests.items():
            if arrival == call:
                engine.add_request(rid, ids, params)
        try:
            outputs = engine.step()
        except RuntimeError as exc:
            failures.append(exc)
            failed_requests = {s.request_id for s in engine.scheduler.running}
            for rid in failed_requests:
                engine.abort(rid)
            outputs = []
        for out in outputs:
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                ended[out.request_id] = out.finish_reason
        call += 1
    assert len(failures) == 1 and victims and not set(victims) & failed_requests
    for rid in victims:
        assert results[rid] == sync[rid][0] and ended[rid] is FinishReason.LENGTH
    assert all(rid in ended for rid in requests)  # every request ended, the aborted ones with their notice
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_output_held_for_the_caller_comes_out_of_the_step_after_a_failed_one(model_dir, async_scheduling):
    """An abort notice waits for the next step; that step fails: the notice comes out of the one after."""
    engine = Engine(EngineConfig(model=str(model_dir), attention_backend="torch",
                                 async_scheduling=async_scheduling))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, rid in enumerate(("a", "b")):
        engine.add_request(rid, prompt(20, i), params)
    for _ in range(3):
        engine.step()
    engine.abort("a")
    run = engine.runner.run

    def fail(*args):
        raise RuntimeError("injected")
    engine.runner.run = fail
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.runner.run = run
    notices = [out for out in engine.step() if out.request_id == "a"]
    assert [(out.finished, out.finish_reason) for out in notices] == [(True, FinishReason.ABORT)]
