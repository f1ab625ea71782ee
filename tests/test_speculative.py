"""Speculative decoding by n-gram prompt lookup (engine/speculative.py): the proposer against a plain
reference search, and the engine with drafts against the engine without them: the same tokens, texts,
logprobs and finish reasons (greedy and seeded sampling, penalties, n > 1, min_tokens, stop strings) in
every KV cache format and under an attention window, with drafts proposed and accepted; against
transformers; the prefix cache holding only accepted tokens' K/V; blocks freed; drafts under a structured output
kept to its grammar (forced tokens, n-gram drafts cut where it refuses, a grammar starting mid-output);
and the settings refused when they contradict."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from test_engine_model import build_hf_checkpoint

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.speculative import NgramProposer, SpeculationStats, SpeculativeConfig
from engine.structured_output import StructuredOutput

pytestmark = pytest.mark.timeout(120)

# Prompts that repeat themselves (a pasted list, a counting pattern) and one that does not.
PROMPTS = [[(7 * i) % 50 + 3 for i in range(40)] * 3, list(range(10, 90)), [5, 6, 7, 8] * 20]


def reference_draft(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest suffix of ``tokens`` (hi down to lo)."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_the_draft_follows_the_latest_occurrence_of_the_longest_recurring_suffix():
    proposer = NgramProposer(SpeculativeConfig(4, prompt_lookup_min=2, prompt_lookup_max=3))
    # [1, 2, 3] recurs from index 0 (followed by 4, 9, 9); [2, 3] alone recurs later, followed by 5
    assert proposer.propose(1, [1, 2, 3, 4, 9, 9, 2, 3, 5, 9, 1, 2, 3], 8) == [4, 9, 9, 2]
    # the latest of two occurrences; the continuation may run into the suffix itself
    assert proposer.propose(2, [5, 6, 1, 5, 6, 2, 5, 6], 8) == [2, 5, 6]
    assert proposer.propose(3, [5, 6, 1, 5, 6, 2, 5, 6], 2) == [2, 5]  # at most max_tokens
    assert proposer.propose(4, [1, 2, 3, 4, 5], 4) == []  # nothing recurs
    assert proposer.propose(5, [7, 7], 4) == []  # a single token repeated is below prompt_lookup_min
    assert proposer.propose(6, [5, 6, 1, 5, 6], 0) == []


def test_the_proposer_equals_a_plain_search_as_histories_grow():
    """Random histories over a few token values whose bytes overlap (so the byte search meets matches that
    straddle tokens), extended step by step as a decoding sequence's are."""
    rng = random.Random(0)
    values = [0, 1, 256, 257, 65536, 65537, 16777216 + 1]
    for trial in range(40):
        proposer = NgramProposer(SpeculativeConfig(5, prompt_lookup_min=1 + trial % 2, prompt_lookup_max=4))
        tokens = [rng.choice(values) for _ in range(3)]
        for _ in range(30):
            k = rng.randint(1, 6)
            expected = reference_draft(tokens, min(k, 5), 1 + trial % 2, 4)
            assert proposer.propose(0, tokens, k) == expected, (tokens, k)
            tokens += [rng.choice(values) for _ in range(rng.randint(1, 3))]
        proposer.forget(0)
        assert proposer.propose(0, tokens[:4], 3) == reference_draft(tokens[:4], 3, 1 + trial % 2, 4)


def test_acceptance_counts_per_position():
    stats = SpeculationStats()
    stats.record(4, 2)
    stats.record(3, 3)
    stats.record(5, 0)
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (3, 12, 5)
    assert stats.accepted_per_position == [2, 2, 1, 0, 0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_speculative_tokens=-1), "num_speculative_tokens must be >= 0"),
    (dict(num_speculative_tokens=3, prompt_lookup_min=5, prompt_lookup_max=4), "prompt_lookup_min <= prompt_lookup_max"),
    (dict(num_speculative_tokens=3, prompt_lookup_min=0), "1 <= prompt_lookup_min"),
])
def test_contradicting_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="tiny", **kwargs)


def test_the_flags_reach_the_engine_config():
    from services.cli import build_parser
    from services.config import configs_from_args

    parser = build_parser()
    assert configs_from_args(parser.parse_args(["serve"]))[0].engine.speculative is None
    cluster, _ = configs_from_args(parser.parse_args(
        ["serve", "--num-speculative-tokens", "5", "--prompt-lookup-max", "6", "--prompt-lookup-min", "3"]))
    assert cluster.engine.speculative == SpeculativeConfig(5, 3, 6)
    cluster, _ = configs_from_args(parser.parse_args(
        ["serve", "--num-speculative-tokens", "2", "--speculative-disable-by-batch-size", "8"]))
    assert cluster.engine.speculative == SpeculativeConfig(2, disable_by_batch_size=8)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size must be >= 1"):
        configs_from_args(parser.parse_args(["serve", "--num-speculative-tokens", "2",
                                             "--speculative-disable-by-batch-size", "0"]))
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        configs_from_args(parser.parse_args(["serve", "--num-speculative-tokens", "2", "--prompt-lookup-min", "9"]))


def generate(engine: Engine, params: SamplingParams, prompts=PROMPTS) -> dict:
    """Every sample's tokens, text, logprobs and finish reason, driving ``engine`` to completion."""
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    samples: dict[tuple[str, int], dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            s = samples.setdefault((out.request_id, out.index), {"tokens": [], "text": "", "top": [],
                                                                  "logprobs": []})
            s["tokens"] += out.new_token_ids
            s["text"] += out.text
            s["top"] += [(lp.token_id, tuple(t for t, _ in lp.top)) for lp in out.logprobs or ()]
            s["logprobs"] += [lp.logprob for lp in out.logprobs or ()]
            s["finish"] = (out.finish_reason, out.stop_reason) if out.finished else None
    return samples


def assert_same(got: dict, expected: dict) -> None:
    """The same samples: tokens, texts, top tokens and finish reasons exactly; logprobs up to float noise (a
    draft's chunk and a decode row compute the same logits through differently shaped products)."""
    assert {k: {f: v for f, v in s.items() if f != "logprobs"} for k, s in got.items()} == {
        k: {f: v for f, v in s.items() if f != "logprobs"} for k, s in expected.items()}
    for key, sample in got.items():
        assert sample["logprobs"] == pytest.approx(expected[key]["logprobs"], abs=1e-3)


def all_blocks_free(engine: Engine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not engine.requests and not engine.held


SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=28, temperature=0.0),
    # seeded sampling, two samples each, penalties, logprobs, min_tokens and a stop string
    "seeded": SamplingParams(max_tokens=28, temperature=0.5, top_k=3, seed=11, n=2, logprobs=2,
                             repetition_penalty=1.05, presence_penalty=0.1, min_tokens=5, stop=["xy"]),
}
CACHES = {"auto": {}, "int8": dict(kv_cache_dtype="int8"), "fp8": dict(kv_cache_dtype="fp8"),
          "kivi2": dict(kv_cache_dtype="kivi2"), "window": dict(kv_window=32, kv_sinks=4)}


@pytest.mark.parametrize("sampling, cache", [("greedy", cache) for cache in CACHES] + [
    ("seeded", cache) for cache in ("auto", "kivi2", "window")])  # sampling and the cache format meet little
def test_drafts_change_nothing_but_the_number_of_steps(tiny, cache, sampling):
    params = SAMPLINGS[sampling]
    plain = generate(Engine(EngineConfig(model="tiny", **CACHES[cache])), params)
    engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4, **CACHES[cache]))
    assert_same(generate(engine, params), plain)
    stats = engine.stats().speculation
    assert stats.accepted_tokens > 0 and stats.draft_tokens > stats.accepted_tokens  # both outcomes happened
    assert stats.draft_tokens <= 4 * stats.drafts
    assert all_blocks_free(engine)


def test_a_drafted_step_counts_the_tokens_its_decoding_sequences_produced(tiny):
    """What the router's per-token decode speed reads (StepComposition): the drafting sequences apart from
    the prompt chunks, and every token a step's decoding sequences produced, accepted drafts included."""
    engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4))
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, SAMPLINGS["greedy"])
    gained = 0
    while engine.has_unfinished():
        produced = sum(len(out.new_token_ids) for out in engine.step())
        step = engine.last_step
        if step is None or step.drafted_seqs < len(step.prefill_chunks):
            continue  # prompt work in the step (its first tokens are no decoding)
        assert step.decoded_tokens == produced
        assert step.drafted_context_tokens >= step.drafted_seqs
        gained = max(gained, step.decoded_tokens - step.decode_seqs - step.drafted_seqs)
    assert gained > 0  # some step kept accepted draft tokens


def test_a_prompts_last_token_computed_alone_is_no_draft(tiny):
    """A 33-token prompt that repeats itself, under a 32-token budget: its last token is computed alone, a
    decode row to the scheduler but still the prompt (whose n = 2 samples fork after it); both samples equal
    the plain engine's."""
    params = SamplingParams(max_tokens=24, temperature=0.7, top_k=4, seed=5, n=2)
    looped = [[4, 5, 6] * 11]
    plain = generate(Engine(EngineConfig(model="tiny", max_num_batched_tokens=32)), params, looped)
    engine = Engine(EngineConfig(model="tiny", max_num_batched_tokens=32, num_speculative_tokens=4))
    assert_same(generate(engine, params, looped), plain)
    assert len(plain) == 2 and engine.stats().speculation.drafts > 0


def test_greedy_drafts_match_transformers(tmp_path):
    hf = build_hf_checkpoint(tmp_path, "llama")
    prompts = [[(5 * i) % 37 for i in range(30)] * 2, [3, 1, 4, 1, 5, 9, 2, 6] * 4]
    engine = Engine(EngineConfig(model=str(tmp_path), num_speculative_tokens=3))
    got = generate(engine, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), prompts)
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            ids_t = torch.tensor([ids])  # the mask given: token 0 is the checkpoint's pad token
            expected = hf.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=40,
                                   do_sample=False)[0, len(ids):]
            assert got[(str(i), 0)]["tokens"] == expected.tolist()
    assert engine.stats().speculation.accepted_tokens > 0


def test_no_drafts_while_the_batch_is_larger_than_the_limit(tiny):
    """Three sequences over a limit of two: no step drafts until one has finished."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4, speculative_disable_by_batch_size=2))
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, greedy if i else dataclasses.replace(greedy, max_tokens=10))
    drafted_at: list[int] = []
    while engine.has_unfinished():
        before = engine.speculation.drafts
        running = len(engine.scheduler.running)
        engine.step()
        if engine.speculation.drafts > before:
            drafted_at.append(running)
    assert drafted_at and max(drafted_at) <= 2


def test_the_prefix_cache_holds_only_accepted_tokens(tiny):
    """A second turn (prompt + answer + more) reuses the first turn's blocks, written during verification:
    its answer equals a fresh engine's, which computes everything."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4))
    first = generate(engine, greedy, PROMPTS[:1])[("0", 0)]["tokens"]
    assert engine.stats().speculation.draft_tokens > engine.stats().speculation.accepted_tokens > 0
    second_turn = [*PROMPTS[0], *first, 9, 8, 7]
    engine.add_request("turn2", second_turn, greedy)
    again = generate(engine, greedy, [])  # drives the request just added
    assert engine.stats().prompt_tokens_cached >= len(PROMPTS[0]) + len(first) - 16
    fresh = generate(Engine(EngineConfig(model="tiny", enable_prefix_caching=False)), greedy, [second_turn])
    assert again[("turn2", 0)]["tokens"] == fresh[("0", 0)]["tokens"]


def test_a_seeded_request_resumed_elsewhere_continues_as_it_would_have(tiny):
    """A failed worker's streamed tokens are resumed on another (``output_ids``): its random stream is advanced
    one row of draws per token, which is what a drafting worker took for each token it kept."""
    params = dataclasses.replace(SAMPLINGS["seeded"], n=1)
    whole = generate(Engine(EngineConfig(model="tiny", num_speculative_tokens=4)), params, PROMPTS[:1])
    tokens = whole[("0", 0)]["tokens"]
    engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4))
    engine.add_request("0", PROMPTS[0], params, output_ids=tokens[:12])
    rest = generate(engine, params, [])[("0", 0)]["tokens"]
    assert rest == tokens[12:] and engine.stats().speculation.accepted_tokens > 0


def test_max_tokens_and_aborts_with_drafts(tiny):
    engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4))
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True))
    engine.add_request("gone", PROMPTS[2], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    counts: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 6:
            engine.abort("gone")
        for out in engine.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    assert [counts[str(i)] for i in range(3)] == [10, 11, 12]  # a draft never runs past max_tokens
    assert engine.stats().speculation.accepted_tokens > 0
    assert all_blocks_free(engine)


STRUCTURED = {
    # forced all the way: every draft is what the grammar forces (jump-forward), all accepted
    "regex": StructuredOutput("regex", "(ab){12}"),
    # free choices between forced stretches: n-gram drafts cut where the grammar would refuse a token
    "json": StructuredOutput("json", json.dumps({
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "legs": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"enum": ["ab", "abc"]}}},
        "required": ["name", "legs", "tags"], "additionalProperties": False})),
    # free until the output holds "mm" (a reasoning model's end of thinking; the tiny model writes it after
    # the second prompt), then the regex, forced
    "start_after": StructuredOutput("regex", "x(yz){6}", start_after=(109, 109)),
}


@pytest.mark.parametrize("kind", list(STRUCTURED))
def test_structured_outputs_draft_within_their_grammar(tiny, kind):
    """Drafts under a structured output: each position is masked by the grammar as it stands after the draft
    tokens before it; the samples equal the plain engine's (greedy, and seeded with min_tokens, which a
    complete grammar lifts)."""
    pytest.importorskip("llguidance")
    prompts = [PROMPTS[0], [33, 35, 36] * 12 + [33]]
    for params in (SamplingParams(max_tokens=40, temperature=0.0, structured_output=STRUCTURED[kind]),
                   SamplingParams(max_tokens=40, temperature=0.6, top_k=3, seed=4, min_tokens=30, n=2,
                                  structured_output=STRUCTURED[kind])):
        plain = generate(Engine(EngineConfig(model="tiny")), params, prompts)
        engine = Engine(EngineConfig(model="tiny", num_speculative_tokens=4))
        assert_same(generate(engine, params, prompts), plain)
        stats = engine.stats().speculation
        assert stats.accepted_tokens > 0
        if kind == "regex":
            assert plain[("0", 0)]["text"] == "ab" * 12 and stats.accepted_tokens == stats.draft_tokens
        if kind == "start_after":
            assert plain[("1", 0)]["text"].endswith("mm" + "x" + "yz" * 6)
        assert all_blocks_free(engine)


def test_a_draft_stops_short_of_the_token_that_starts_the_grammar(tiny):
    """The position after that token needs the grammar's first mask, which a draft cannot know before its
    tokens are sampled; once started, a draft keeps the tokens the grammar accepts in a row."""
    pytest.importorskip("llguidance")
    masks = Engine(EngineConfig(model="tiny")).grammars
    grammar = masks.matcher(STRUCTURED["start_after"])
    assert grammar.draft_prefix([5, 109, 109, 120]) == 2
    grammar.advance(109)
    assert grammar.draft_prefix([109, 120]) == 0 and grammar.draft_prefix([5, 6]) == 2
    grammar.advance(109)
    assert grammar.forced_tokens()[:1] == [ord("x")]
    assert grammar.draft_prefix([ord(c) for c in "xyzyq"]) == 4
    bitmask, complete = masks.draft_masks(grammar, [ord(c) for c in "xyz"])
    allowed = masks.apply(torch.zeros(4, masks.vocab_size), bitmask).isfinite()
    assert [allowed[j].nonzero().flatten().tolist() for j in range(4)] == [[ord(c)] for c in "xyzy"]
    assert complete == [False] * 4 and grammar.draft_prefix([ord("x")]) == 1  # the draft was given back


def test_a_decode_worker_imported_sequence_drafts(tiny):
    """The disaggregated path: K/V computed by a prefill engine, imported into a speculating decode engine;
    the tokens equal a colocated plain run's."""
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ids = PROMPTS[0]
    prefill = Engine(EngineConfig(model="tiny"))
    prefill.add_request("r", ids, greedy, prefill_only=True)
    (first,) = [o for o in prefill.step() if o.request_id == "r"]
    decode = Engine(EngineConfig(model="tiny", num_speculative_tokens=4))
    blocks = decode.reserve_blocks("r", len(ids), greedy.max_tokens)
    decode.kv_cache.import_blocks(blocks, prefill.kv_cache.export_blocks(prefill.request_block_ids("r")))
    prefill.release("r")
    decode.add_imported_request("r", ids, first.new_token_ids[0], greedy, blocks)
    tokens = [*first.new_token_ids]
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == generate(Engine(EngineConfig(model="tiny")), greedy, [ids])[("0", 0)]["tokens"]
    assert decode.stats().speculation.accepted_tokens > 0
    assert all_blocks_free(decode)


def test_generate_cli_takes_the_flag(tiny, capsys):
    from services.cli import main

    ids = ",".join(map(str, PROMPTS[2]))
    assert main(["generate", "--prompt-ids", ids, "--max-tokens", "12", "--json"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "--prompt-ids", ids, "--max-tokens", "12", "--json",
                 "--num-speculative-tokens", "3"]) == 0
    assert capsys.readouterr().out == plain
    assert main(["generate", "--prompt-ids", ids, "--max-tokens", "12", "--json",
                 "--num-speculative-tokens", "3", "--speculative-model", "tiny"]) == 0
    assert capsys.readouterr().out == plain
