"""Speculative decoding with a draft model (engine/draft_model.py): the engine drafting with a second checkpoint
against the engine without drafts: the same tokens, texts, logprobs and finish reasons (greedy and seeded
sampling), a draft of the model's own weights accepted at any temperature (float ties aside: it samples with
the verification's draws), a draft of other weights still giving transformers' greedy tokens and the plain
engine's seeded ones; a sequence imported from a prefill engine caught up by the draft in budget-sized
chunks before it drafts; the draft's blocks freed on finish, abort and preemption; drafts beside a JSON
schema, an attention window and a LoRA adapter; a prefill worker that loads no draft; and the settings
refused when they cannot work."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from test_engine_model import build_hf_checkpoint
from test_speculative import PROMPTS, SAMPLINGS, all_blocks_free, assert_same, generate

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def draft_blocks_free(engine: Engine) -> bool:
    blocks = engine.proposer.blocks
    return blocks.num_free_blocks == blocks.num_blocks and not blocks.seqs


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_a_draft_model_changes_nothing_but_the_number_of_steps(tiny, sampling):
    """The draft is the model itself: greedy drafts are the model's own greedy tokens, and sampled ones are
    drawn with the draws the verification samples with, so (up to float ties between a draft's decode rows and
    the verifying chunk, and the stop tokens min_tokens bans only in the verification) all are accepted."""
    params = SAMPLINGS[sampling]
    plain = generate(Engine(EngineConfig(model="tiny")), params)
    engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4, speculative_model="tiny"))
    assert_same(generate(engine, params), plain)
    stats = engine.stats().speculation
    assert stats.accepted_tokens >= 0.9 * stats.draft_tokens > 0
    assert stats.accepted_per_position[3] > 0  # whole drafts kept, the draft's K/V then caught up by two
    assert all_blocks_free(engine) and draft_blocks_free(engine)


def test_a_draft_of_the_models_weights_is_accepted_at_a_high_temperature_from_the_global_stream(tiny):
    """Unseeded sampling at temperature 1.5, where the most likely token is rarely the sampled one (a
    greedy draft would mostly fail): the draws taken ahead from the global stream serve the draft and the
    verification alike, so the model's own drafts are accepted."""
    params = SamplingParams(max_tokens=24, temperature=1.5, ignore_eos=True)
    engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4, speculative_model="tiny"))
    samples = generate(engine, params, PROMPTS[:3])
    stats = engine.stats().speculation
    assert stats.accepted_tokens >= 0.9 * stats.draft_tokens > 0
    assert all(len(s["tokens"]) == 24 for s in samples.values())
    greedy = generate(Engine(EngineConfig(model="tiny")), SamplingParams(max_tokens=24, temperature=0.0,
                                                                          ignore_eos=True), PROMPTS[:3])
    agree = sum(a == b for k in samples for a, b in zip(samples[k]["tokens"], greedy[k]["tokens"], strict=True))
    assert agree < 0.5 * 24 * 3  # the sampled tokens are mostly not the greedy ones
    assert all_blocks_free(engine) and draft_blocks_free(engine)


def test_a_draft_of_other_weights_keeps_transformers_greedy_tokens(tmp_path):
    hf = build_hf_checkpoint(tmp_path / "target", "llama")
    build_hf_checkpoint(tmp_path / "draft", "llama", num_hidden_layers=1)
    prompts = [[(5 * i) % 37 for i in range(30)] * 2, [3, 1, 4, 1, 5, 9, 2, 6] * 4]
    engine = Engine(EngineConfig(model=str(tmp_path / "target"), num_speculative_tokens=3,
                                 speculative_model=str(tmp_path / "draft")))
    got = generate(engine, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), prompts)
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            ids_t = torch.tensor([ids])
            expected = hf.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=40,
                                   do_sample=False)[0, len(ids):]
            assert got[(str(i), 0)]["tokens"] == expected.tolist()
    assert engine.stats().speculation.drafts > 0
    assert draft_blocks_free(engine)


def test_a_draft_of_other_weights_keeps_the_plain_engines_seeded_samples(tmp_path):
    """A one-layer draft of other random weights, seeded sampling at temperature 1: the draft samples with
    the verification's draws, which changes which tokens it proposes and nothing of what is kept."""
    build_hf_checkpoint(tmp_path / "target", "llama")
    build_hf_checkpoint(tmp_path / "draft", "llama", num_hidden_layers=1)
    prompts = [[(5 * i) % 37 for i in range(30)] * 2, [3, 1, 4, 1, 5, 9, 2, 6] * 4]
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=7, n=2, ignore_eos=True)
    plain = generate(Engine(EngineConfig(model=str(tmp_path / "target"))), params, prompts)
    engine = Engine(EngineConfig(model=str(tmp_path / "target"), num_speculative_tokens=3,
                                 speculative_model=str(tmp_path / "draft")))
    assert_same(generate(engine, params, prompts), plain)
    stats = engine.stats().speculation
    assert stats.draft_tokens > stats.accepted_tokens > 0
    assert draft_blocks_free(engine)


def test_an_imported_sequence_is_caught_up_in_budget_sized_chunks_before_it_drafts(tiny):
    """The disaggregated path: the prompt's K/V comes from a prefill engine, so the draft model computes the
    prompt itself, at most max_num_batched_tokens tokens a step (120 + the first token: 48, 48, then 25 and
    the first draft), while the target decodes; the tokens equal a colocated plain run's."""
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ids = PROMPTS[0]
    prefill = Engine(EngineConfig(model="tiny"))
    prefill.add_request("r", ids, greedy, prefill_only=True)
    (first,) = [o for o in prefill.step() if o.request_id == "r"]
    decode = Engine(EngineConfig(model="tiny", num_speculative_tokens=4, speculative_model="tiny",
                                 max_num_batched_tokens=48))
    blocks = decode.reserve_blocks("r", len(ids), greedy.max_tokens)
    decode.kv_cache.import_blocks(blocks, prefill.kv_cache.export_blocks(prefill.request_block_ids("r")))
    prefill.release("r")
    decode.add_imported_request("r", ids, first.new_token_ids[0], greedy, blocks)
    tokens, drafted_at = [*first.new_token_ids], []  # the steps (from 1) that verified a draft
    for step in itertools.count(1):
        if not decode.has_unfinished():
            break
        before = decode.speculation.drafts
        tokens += [t for o in decode.step() for t in o.new_token_ids]
        if decode.speculation.drafts > before:
            drafted_at.append(step)
    assert tokens == generate(Engine(EngineConfig(model="tiny")), greedy, [ids])[("0", 0)]["tokens"]
    assert drafted_at[:3] == [3, 4, 5]  # two plain decode steps while catching up, then every step drafts
    assert all_blocks_free(decode) and draft_blocks_free(decode)


def test_an_aborted_sequence_frees_its_draft_blocks(tiny):
    engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4, speculative_model="tiny"))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, params)
    for _ in range(4):
        engine.step()
    assert engine.proposer.blocks.seqs  # the decoding sequences hold draft blocks
    for i in range(len(PROMPTS)):
        engine.abort(str(i))
    engine.step()
    assert not engine.has_unfinished() and all_blocks_free(engine) and draft_blocks_free(engine)


def test_a_draft_models_cache_is_paid_from_the_engines_budget(tiny):
    plain = Engine(EngineConfig(model="tiny"))
    drafting = Engine(EngineConfig(model="tiny", num_speculative_tokens=2, speculative_model="tiny"))
    # the same model as draft: each block costs twice, so half as many fit the same bytes
    assert drafting.block_manager.num_blocks == plain.block_manager.num_blocks // 2
    assert drafting.proposer.blocks.num_blocks == drafting.block_manager.num_blocks


def test_the_settings_are_refused_when_a_draft_model_cannot_work(tiny, tmp_path):
    with pytest.raises(ValueError, match="speculative_model needs num_speculative_tokens"):
        EngineConfig(model="tiny", speculative_model="tiny")
    build_hf_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="vocabulary of 128 tokens and the model 272.*share the model's tokenizer"):
        Engine(EngineConfig(model="tiny", num_speculative_tokens=2, speculative_model=str(tmp_path)))
    build_hf_checkpoint(tmp_path / "short", "llama", vocab_size=272, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"the speculative model: kv_sinks \+ kv_window \(4 \+ 100\) exceed the "
                                         r"model's context of 64"):
        Engine(EngineConfig(model="tiny", num_speculative_tokens=2, speculative_model=str(tmp_path / "short"),
                            kv_window=100, kv_sinks=4))


def engine_from(*flags: str) -> EngineConfig:
    from services.cli import build_parser
    from services.config import configs_from_args

    return configs_from_args(build_parser().parse_args(["serve", *flags]))[0].engine


def test_the_flag_reaches_the_decode_workers_and_not_the_prefill_workers():
    from services.messages import Role
    from services.placement import worker_engine

    cluster = engine_from("--num-speculative-tokens", "3", "--speculative-model", "tiny")
    assert cluster.speculative_model == "tiny" and cluster.num_speculative_tokens == 3
    assert engine_from("--num-speculative-tokens", "3", "--speculative-model", "draft/dir").speculative_model == str(
        Path("draft/dir").resolve())  # workers run in other directories
    decode = worker_engine(cluster, Role.DECODE, "cpu", True)
    assert decode == dataclasses.replace(cluster, device="cpu", enable_block_events=True)
    prefill = worker_engine(cluster, Role.PREFILL, "cpu", True)
    assert prefill.speculative is None and prefill.speculative_model is None


def test_vllms_speculative_config_sets_the_same_fields():
    plain = engine_from("--num-speculative-tokens", "5", "--prompt-lookup-max", "6", "--prompt-lookup-min", "3",
                        "--speculative-disable-by-batch-size", "8")
    assert engine_from("--speculative-config", json.dumps({
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6, "prompt_lookup_min": 3,
        "disable_by_batch_size": 8})) == plain
    drafting = engine_from("--speculative-config", '{"model": "tiny", "num_speculative_tokens": 4}')
    assert drafting == engine_from("--num-speculative-tokens", "4", "--speculative-model", "tiny")


@pytest.mark.parametrize("spec, match", [
    ({"method": "eagle", "model": "tiny", "num_speculative_tokens": 3}, "method 'eagle' is not supported"),
    ({"model": "tiny", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size not supported; it takes method, model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, 'method "draft_model" needs model'),
    ({"method": "ngram", "model": "tiny", "num_speculative_tokens": 3}, '"ngram" takes none'),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer, got '3'"),
    ({"model": 7, "num_speculative_tokens": 3}, "model must be a checkpoint directory"),
])
def test_a_speculative_config_that_cannot_work_is_refused_saying_what_to_fix(spec, match):
    with pytest.raises(ValueError, match=match):
        engine_from("--speculative-config", json.dumps(spec))
    with pytest.raises(ValueError, match="either --speculative-config or --num-speculative-tokens"):
        engine_from("--num-speculative-tokens", "2", "--speculative-config", '{"num_speculative_tokens": 2}')


def test_serve_refuses_a_draft_of_another_vocabulary_in_one_line_before_starting_anything(tmp_path, monkeypatch):
    from test_cli import serve_refusal

    build_hf_checkpoint(tmp_path / "draft", "llama")
    for draft, named in [(tmp_path / "draft", "has a vocabulary of 128 tokens and the model 272"),
                         (tmp_path / "none", "config.json: not found")]:
        message = serve_refusal(monkeypatch, "--num-speculative-tokens", "2", "--speculative-model", str(draft))
        assert message.startswith(f"tidepool serve: the speculative model '{draft}'") and named in message


def test_a_preempted_sequence_gives_its_draft_blocks_back(tiny):
    """Too few blocks for three growing sequences: the scheduler preempts, each preempted sequence's draft
    blocks are freed with its own (only running sequences hold any), and the tokens equal a plain engine's
    under the same pressure."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[0][:100], PROMPTS[1], PROMPTS[2][:60]]
    plain = generate(Engine(EngineConfig(model="tiny", num_blocks=20)), params, prompts)
    engine = Engine(EngineConfig(model="tiny", num_blocks=20, num_speculative_tokens=4, speculative_model="tiny"))
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    samples: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            samples.setdefault(out.request_id, []).extend(out.new_token_ids)
        running = {seq.seq_id for seq in engine.scheduler.running}
        assert set(engine.proposer.blocks.seqs) <= running
    assert engine.stats().num_preemptions > 0 and engine.stats().speculation.accepted_tokens > 0
    assert {rid: tokens for rid, tokens in samples.items()} == {rid: s["tokens"] for (rid, _), s in plain.items()}
    assert all_blocks_free(engine) and draft_blocks_free(engine)


@pytest.mark.parametrize("sampling, refusing", itertools.product(SAMPLINGS, ["a JSON schema", "bans"]))
def test_a_draft_model_drafts_within_what_the_verification_refuses(tiny, sampling, refusing):
    """A JSON schema, or min_tokens and bad words: the draft of the model's own weights is masked and banned as
    the verification will be at each of its positions (the grammar taking each draft token and given them
    back), so it is accepted nearly whole and most of the answer comes from drafts, where a draft of the
    unrefused model was rejected at a ban or cut before the schema's first refusal (greedy JSON: 10 of 72
    tokens drafted); the samples equal the plain engine's. (The cache formats meet drafts in the engine,
    whichever proposer made them: test_speculative.)"""
    params = dataclasses.replace(SAMPLINGS[sampling], max_tokens=36)
    if refusing == "a JSON schema":
        pytest.importorskip("llguidance")
        from test_speculative import STRUCTURED

        params = dataclasses.replace(params, structured_output=STRUCTURED["json"])
    else:  # bans that bite: the tokens the model writes most often, and its stop tokens until 30 are out
        unbanned = generate(Engine(EngineConfig(model="tiny")), params, PROMPTS[:2])
        common = collections.Counter(t for s in unbanned.values() for t in s["tokens"]).most_common(3)
        params = dataclasses.replace(params, min_tokens=30, bad_words_token_ids=[[t] for t, _ in common])
    plain = generate(Engine(EngineConfig(model="tiny")), params, PROMPTS[:2])
    engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4, speculative_model="tiny"))
    assert_same(generate(engine, params, PROMPTS[:2]), plain)
    stats = engine.stats().speculation
    assert stats.accepted_tokens >= 0.9 * stats.draft_tokens > 0
    assert stats.accepted_tokens >= 0.5 * sum(len(s["tokens"]) for s in plain.values())
    assert all(seq.grammar is None for seqs in engine.requests.values() for seq in seqs)
    assert all_blocks_free(engine) and draft_blocks_free(engine)


@pytest.mark.parametrize("window", ["--kv-window", "the model's sliding window"])
def test_under_an_attention_window_the_draft_attends_as_the_engine_and_holds_as_few_blocks(tiny, tmp_path, window):
    """--kv-window 32 --kv-sinks 4, or a Mistral checkpoint's own sliding window of 32 (its draft: the same
    weights, configured without one); prompts of 120 and 80 tokens and 64 more: the draft attends through the
    engine's window, so its drafts stay the model's tokens (nearly all accepted) past the window, and it drops
    the blocks the window has passed: a sequence never holds more draft blocks than a step of the engine
    holds, plus the one its draft may reach into."""
    if window == "--kv-window":
        model, draft, options = "tiny", "tiny", dict(kv_window=32, kv_sinks=4)
    else:
        model, draft, options = str(tmp_path / "target"), str(tmp_path / "draft"), {}
        build_hf_checkpoint(model, "mistral", sliding_window=32, vocab_size=272)
        build_hf_checkpoint(draft, "mistral", sliding_window=None, vocab_size=272)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    plain = generate(Engine(EngineConfig(model=model, **options)), params, PROMPTS[:2])
    engine = Engine(EngineConfig(model=model, num_speculative_tokens=4, speculative_model=draft, **options))
    for i, ids in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {}
    most = 0  # the most draft blocks a sequence held after a step
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        most = max([most, *(sum(b >= 0 for b in s.table) for s in engine.proposer.blocks.seqs.values())])
    assert tokens == {rid: s["tokens"] for (rid, _), s in plain.items()}
    assert 0 < most <= engine.window.max_blocks + 1 < -(-(120 + 64) // engine.block_size)
    stats = engine.stats().speculation
    assert stats.accepted_tokens >= 0.9 * stats.draft_tokens > 0
    assert all_blocks_free(engine) and draft_blocks_free(engine)


def test_a_sequence_with_a_lora_adapter_drafts_with_the_base_model(tmp_path):
    """The draft model knows no adapters: it drafts the base model's tokens for an adapter's sequence, which
    the adapter's verification accepts only where they agree; the tokens are PEFT's."""
    from test_lora import ALL_PROJECTIONS, peft_adapter, reference

    hf = build_hf_checkpoint(tmp_path / "base", "llama")
    adapted = peft_adapter(hf, tmp_path / "a", ALL_PROJECTIONS, rank=8, seed=1, lora_alpha=16)
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), num_speculative_tokens=3,
                                 speculative_model=str(tmp_path / "base"), lora_modules={"a": str(tmp_path / "a")}))
    ids = [(5 * i) % 37 + 1 for i in range(30)]  # (no 0: the checkpoint's pad token, which PEFT's generate masks)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for rid, lora in (("base", None), ("a", "a")):
        engine.add_request(rid, ids, greedy, lora=lora)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens == {"base": reference(hf, ids), "a": reference(adapted, ids)}
    assert engine.stats().speculation.drafts > 0 and draft_blocks_free(engine)
