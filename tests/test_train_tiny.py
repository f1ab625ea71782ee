"""benchmarks/train_tiny.py (the trained checkpoint) and benchmarks/kv_quality.py (its measuring stick):
a few training steps on a small slice of the stdlib corpus give a checkpoint that loads in the engine
and in transformers with the same logits and that beats its untrained self; the engine-side scoring
of kv_quality.py equals transformers' teacher-forced loss on the same text."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.kv_quality import (
    FULL,
    agreement,
    make_engine,
    room_for,
    run_dtypes,
    score_documents,
    token_nll,
)
from benchmarks.train_tiny import (
    TrainArgs,
    build_model,
    byte_nll,
    ensure_trained,
    held_out_documents,
    model_config,
    save,
)
from engine.loader import load_model
from engine.runner import SeqChunk

CORPUS_LIMIT = 40


def small_args(out) -> TrainArgs:
    return TrainArgs(out=out, max_steps=30, corpus_limit=CORPUS_LIMIT, hidden=64, layers=2, heads=4,
                     kv_heads=2, intermediate=128, seq_len=128, short_seq_len=64, tokens_per_step=1024,
                     lr=3e-3, warmup_steps=5, eval_tokens=2048, threads=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    args = small_args(tmp_path_factory.mktemp("trained") / "model")
    return args, ensure_trained(args, log=lambda *_: None)


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """An untrained (random-weight) checkpoint of the same shape, saved the way train_tiny saves."""
    args = small_args(tmp_path_factory.mktemp("random") / "model")
    torch.manual_seed(1)
    config = model_config(args)
    save(build_model(config, "cpu"), config, args.out, {"untrained": True})
    return args.out


def hf_logits(model_dir, tokens: list[int]) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens])).logits[0]


@pytest.mark.timeout(60)
def test_training_lowers_held_out_bits_per_byte(trained):
    args, report = trained
    assert report["steps"] == args.max_steps
    assert report["held_out_bits_per_byte"] < report["untrained_bits_per_byte"] - 1.0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "training.json"):
        assert (args.out / name).is_file(), name


@pytest.mark.timeout(60)
def test_trained_checkpoint_logits_match_transformers(trained):
    args, _ = trained
    tokens = held_out_documents(CORPUS_LIMIT)[0][:200]
    model, cfg = load_model(args.out)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads) == (args.hidden, args.layers, args.kv_heads)
    engine = make_engine(str(args.out), len(tokens))
    ours = engine.runner.run([SeqChunk(tokens, 0, engine.reserve_blocks("r", len(tokens)), all_logits=True)])
    torch.testing.assert_close(ours, hf_logits(args.out, tokens), atol=1e-4, rtol=0)


@pytest.mark.timeout(60)
def test_ensure_trained_reuses_a_finished_checkpoint(trained):
    args, report = trained
    weights = (args.out / "model.safetensors").read_bytes()
    messages = []
    assert ensure_trained(args, log=messages.append) == report
    assert any("reusing" in m for m in messages)
    assert (args.out / "model.safetensors").read_bytes() == weights


@pytest.mark.timeout(60)
def test_engine_scoring_equals_transformers_teacher_forced_loss(random_checkpoint):
    docs = [d[:150] for d in held_out_documents(CORPUS_LIMIT)[:1]] + [[256, *b"def f(x):\n    return x\n" * 4]]
    engine = make_engine(str(random_checkpoint), room_for(docs))  # scored together: room for all of them
    nll, count = 0.0, 0
    for doc in docs:
        logits = hf_logits(random_checkpoint, doc)
        n, c = byte_nll(logits[:-1], torch.tensor(doc[1:]))
        nll, count = nll + n, count + c
        # per token too, in chunks of 32 and one a step: every step after the first reads K/V back from
        # the paged cache
        theirs = F.cross_entropy(logits[:-1], torch.tensor(doc[1:]), reduction="none")
        for chunk in (32, 1):
            ours, _ = token_nll(engine, doc, chunk)
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    expected = nll / count / math.log(2)
    assert expected > 6.0  # untrained: close to uniform over 272 ids, so scoring is not trivially equal
    assert score_documents(engine, docs, 32) == pytest.approx(expected, rel=1e-5)


@pytest.mark.timeout(60)
def test_run_dtypes_reports_full_precision_and_marks_unknown_dtypes_unavailable(random_checkpoint):
    """And entries with AWQ weights (a 4-bit copy of the checkpoint) and 8-bit GPTQ ones weigh their packed
    projections: the 4-bit copy less than the 8-bit one, both less than float32; a w8a8 copy (int8 a scale a
    row, no zeros) weighs less than the GPTQ one (a scale and a zero a group) and scores otherwise."""
    docs = [held_out_documents(CORPUS_LIMIT)[0][:100]]
    prompts = [docs[0][:24], docs[0][30:50]]
    args = argparse.Namespace(model=str(random_checkpoint), dtypes=[FULL, "no-such-dtype", "auto/awq", "auto/gptq:8",
                                                                     "auto/w8a8"],
                              chunk=32, prompt_len=24, new_tokens=8, cache_bytes=1 << 20, seq_len=64)
    results = run_dtypes(args, docs, prompts)
    full = results[FULL]
    assert full["available"] and full["token_agreement"] == 1.0 and full["identical_sequences"] == 2
    # float32 K and V: 2 x layers x kv_heads x head_dim x 4 bytes, by the engine's block accounting
    assert full["kv_bytes_per_token"] == full["formula_kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert full["sequences_fit"] == (1 << 20) // (64 * full["kv_bytes_per_token"])
    assert results["no-such-dtype"]["available"] is False and results["no-such-dtype"]["note"]
    awq, int8 = results["auto/awq"], results["auto/gptq:8"]
    assert awq["available"] and awq["weight_bytes"] < int8["weight_bytes"] < full["weight_bytes"]
    assert awq["bits_per_byte"] != full["bits_per_byte"] and int8["available"]
    w8a8 = results["auto/w8a8"]
    assert w8a8["available"] and w8a8["weight_bytes"] < int8["weight_bytes"]
    assert w8a8["bits_per_byte"] not in (full["bits_per_byte"], int8["bits_per_byte"])


def test_agreement_counts_positions_and_first_divergence():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    other = [[1, 2, 9, 4], [5, 6, 7, 8]]
    result = agreement(reference, other)
    assert result["token_agreement"] == 7 / 8
    assert result["identical_sequences"] == 1
    assert result["min_first_divergence"] == 2
    assert result["mean_first_divergence"] == (2 + 4) / 2
