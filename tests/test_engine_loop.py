"""Engine serving loop on a tiny random Llama: continuous batching, prefix caching, preemption, abort,
n > 1 with copy-on-write, stop conditions, request validation, block waste, and greedy parity with
transformers ``generate``. The model and helpers here also serve test_engine_handoff and
test_engine_thread."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.loader import resolve_model_dir
from engine.output import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams

VOCAB = 272  # the built-in tiny model's byte-level vocabulary, so its tokenizer files fit
GREEDY = dict(temperature=0.0, ignore_eos=True)


def write_model(parent: Path) -> Path:
    """hidden 64, 2 layers, GQA; weights scaled up so greedy outputs vary from token to token."""
    path = parent / "loop-llama"
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=[257, 258])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tiny = resolve_model_dir("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, path / name)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("engine-loop"))


def make_engine(model_dir, **kwargs) -> Engine:
    kwargs.setdefault("num_blocks", 256)
    kwargs.setdefault("enable_block_events", True)
    return Engine(EngineConfig(model=str(model_dir), block_size=16, **kwargs))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], arrivals=None
        ) -> dict[tuple[str, int], list[int]]:
    """Drive the engine to completion; request i joins at step ``arrivals[i]`` (all at once by default)."""
    arrivals = arrivals or [0] * len(requests)
    pending = sorted(zip(arrivals, requests.items(), strict=True), key=lambda a: a[0])
    tokens: dict[tuple[str, int], list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, (rid, (ids, params)) = pending.pop(0)
            engine.add_request(rid, ids, params)
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        step += 1
    return tokens


def alone(model_dir, ids: list[int], params: SamplingParams) -> list[int]:
    return run(make_engine(model_dir, enable_prefix_caching=False), {"x": (ids, params)})[("x", 0)]


@pytest.mark.timeout(120)
def test_sixteen_staggered_requests_equal_each_alone(model_dir):
    engine = make_engine(model_dir, max_num_batched_tokens=64)  # chunked prefill mixes with decodes
    requests = {f"r{i}": (prompt(5 + 9 * i, seed=i), SamplingParams(max_tokens=10 + i % 4, **GREEDY))
                for i in range(16)}
    got = run(engine, requests, arrivals=[i // 2 * 3 for i in range(16)])
    for rid, (ids, params) in requests.items():
        assert got[(rid, 0)] == alone(model_dir, ids, params), rid
    assert len({tuple(t) for t in got.values()}) > 8  # outputs really differ between prompts


@pytest.mark.timeout(60)
def test_prefix_cache_computes_only_uncached_tokens(model_dir):
    engine = make_engine(model_dir)
    shared = prompt(48, seed=1)  # 3 full blocks
    first, second = shared + prompt(5, seed=2), shared + prompt(11, seed=3)
    params = SamplingParams(max_tokens=8, **GREEDY)
    run(engine, {"a": (first, params)})
    computed = engine.stats().prompt_tokens_computed
    engine.add_request("b", second, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    stats = engine.stats()
    assert stats.prompt_tokens_computed - computed == 11
    assert stats.prompt_tokens_cached == 48
    assert outs[0].num_cached_tokens == 48
    assert [o.new_token_ids[0] for o in outs] == alone(model_dir, second, params)


@pytest.mark.timeout(60)
def test_preemption_under_a_small_block_budget_keeps_greedy_outputs(model_dir):
    requests = {f"r{i}": (prompt(20 + 7 * i, seed=10 + i), SamplingParams(max_tokens=24, **GREEDY))
                for i in range(6)}
    engine = make_engine(model_dir, num_blocks=12)  # 6 requests need ~24 blocks at their longest
    got = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    assert got == run(make_engine(model_dir), requests)
    assert engine.stats().free_blocks == 12


@pytest.mark.timeout(60)
def test_abort_before_during_and_after_prefill_frees_every_block(model_dir):
    engine = make_engine(model_dir, max_num_batched_tokens=32, max_num_seqs=2)
    baseline = engine.stats().free_blocks
    params = SamplingParams(max_tokens=50, **GREEDY)
    engine.add_request("decoding", prompt(20, 1), params)
    engine.add_request("prefilling", prompt(90, 2), params)
    engine.add_request("waiting", prompt(30, 3), params)
    engine.step()
    engine.step()
    states = {s.request_id: (s.num_computed_tokens, s.num_tokens) for s in engine.scheduler.running}
    assert states["decoding"][0] == states["decoding"][1] - 1  # past prefill
    assert 0 < states["prefilling"][0] < 90  # mid chunked prefill
    assert [s.request_id for s in engine.scheduler.waiting] == ["waiting"]
    assert engine.stats().free_blocks < baseline
    for rid in ("waiting", "prefilling", "decoding"):
        engine.abort(rid)
    outs = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [
        ("decoding", FinishReason.ABORT), ("prefilling", FinishReason.ABORT), ("waiting", FinishReason.ABORT)]
    assert engine.stats().free_blocks == baseline and not engine.has_unfinished()


@pytest.mark.timeout(60)
def test_n2_shares_prompt_blocks_copy_on_write_and_seeds_reproduce(model_dir):
    engine = make_engine(model_dir)
    ids = prompt(40, seed=5)  # 2 full blocks + 8 tokens in a shared partial block
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=2)
    engine.add_request("n2", ids, params)
    first = engine.step()
    assert [o.index for o in first] == [0, 1]
    s0, s1 = engine.requests["n2"]
    bm = engine.block_manager
    shared = list(bm.block_table(s0.seq_id))
    assert bm.block_table(s1.seq_id) == shared and [bm.ref[b] for b in shared] == [2, 2, 2]
    second = engine.step()  # both write position 40: the partial block is copied for one of them
    t0, t1 = bm.block_table(s0.seq_id), bm.block_table(s1.seq_id)
    assert t0[:2] == t1[:2] == shared[:2] and t0[2] != t1[2]
    assert [bm.ref[b] for b in t0] == [2, 2, 1]
    kv = engine.kv_cache.data
    assert torch.equal(kv[:, :, t0[2], :8], kv[:, :, t1[2], :8])  # the copy carries the prompt's K/V
    got = run_rest(engine, {("n2", o.index): o.new_token_ids + second[o.index].new_token_ids for o in first})
    # the same seeds in another engine, batched with other requests, give the same two samples
    other = make_engine(model_dir)
    again = run(other, {"noise": (prompt(33, 9), SamplingParams(max_tokens=6, temperature=0.9)),
                        "n2": (ids, params)})
    assert again[("n2", 0)] == got[("n2", 0)] and again[("n2", 1)] == got[("n2", 1)]
    assert got[("n2", 0)] != got[("n2", 1)]


@pytest.mark.timeout(60)
def test_forked_samples_draw_from_their_prompts_logits_beside_a_partial_prompt(model_dir):
    # The n = 2 prompt completes (and forks) in the first step, where the long prompt is only partly computed:
    # both samples must draw from the short prompt's last row, never from the long prompt's partial chunk.
    engine = make_engine(model_dir, max_num_batched_tokens=40, enable_prefix_caching=False)
    ids = prompt(30, seed=1)
    got = run(engine, {"fork": (ids, SamplingParams(max_tokens=4, n=2, **GREEDY)),
                       "long": (prompt(100, seed=2), SamplingParams(max_tokens=2, **GREEDY))})
    expected = alone(model_dir, ids, SamplingParams(max_tokens=4, **GREEDY))
    assert got[("fork", 0)] == got[("fork", 1)] == expected


def run_rest(engine: Engine, tokens: dict) -> dict:
    """Finish whatever the engine has in flight, appending to ``tokens``."""
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    return tokens


@pytest.mark.timeout(60)
def test_stop_strings_stop_tokens_and_logprobs(model_dir):
    engine = make_engine(model_dir)
    ids = engine.tokenizer.encode("The tide comes in")
    base = run(engine, {"a": (ids, SamplingParams(max_tokens=12, **GREEDY))})[("a", 0)]
    text = engine.tokenizer.decode(base)
    # a stop token ends the sample with that token, whose text is not output
    engine.add_request("b", ids, SamplingParams(max_tokens=12, stop_token_ids=[base[4]], **GREEDY))
    outs = run_outputs(engine)
    assert [o.new_token_ids[0] for o in outs] == base[:base.index(base[4]) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == base[4]
    # a stop string: the text ends right before it (OpenAI semantics), tokens run up to its completion
    stop = text[5:7]
    engine.add_request("c", ids, SamplingParams(max_tokens=12, stop=[stop], logprobs=2, **GREEDY))
    outs = run_outputs(engine)
    assert "".join(o.text for o in outs) == text[:text.index(stop)]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == stop
    assert all(len(o.logprobs) == 1 and o.logprobs[0].token_id == o.new_token_ids[0]
               and len(o.logprobs[0].top) == 2 for o in outs)
    assert all(o.logprobs[0].top[0] == (o.new_token_ids[0], o.logprobs[0].logprob) for o in outs)  # greedy


@pytest.mark.timeout(60)
def test_min_tokens_keep_stop_tokens_and_stop_strings_out_of_the_first_tokens(model_dir):
    engine = make_engine(model_dir)
    ids = prompt(20, seed=8)
    eos = 257  # one of the model's two EOS ids; a bias makes it the greedy choice at every step
    forced = dict(temperature=0.0, logit_bias=[(eos, 100.0)])
    engine.add_request("eos", ids, SamplingParams(max_tokens=8, **forced))
    assert [o.new_token_ids for o in run_outputs(engine)] == [[eos]]  # without min_tokens: stops at once
    engine.add_request("min3", ids, SamplingParams(max_tokens=8, min_tokens=3, **forced))
    outs = run_outputs(engine)
    tokens = [o.new_token_ids[0] for o in outs]
    assert len(tokens) == 4 and tokens[3] == eos and not {*tokens[:3]} & {257, 258}  # neither EOS id
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == eos
    # a stop token id too, and ignore_eos leaves the EOS ids alone (only stop_token_ids are kept out)
    engine.add_request("stop-id", ids, SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[eos],
                                                      ignore_eos=True, **forced))
    assert [o.new_token_ids[0] for o in run_outputs(engine)][2:] == [eos]
    # a stop string the first tokens complete is not matched before min_tokens
    base = run(make_engine(model_dir), {"a": (ids, SamplingParams(max_tokens=6, **GREEDY))})[("a", 0)]
    first = engine.tokenizer.decode(base[:1])
    engine.add_request("s", ids, SamplingParams(max_tokens=6, stop=[first], **GREEDY))
    assert [o.new_token_ids[0] for o in run_outputs(engine)] == base[:1]
    engine.add_request("s-min", ids, SamplingParams(max_tokens=6, min_tokens=6, stop=[first], **GREEDY))
    assert [o.new_token_ids[0] for o in run_outputs(engine)] == base


def run_outputs(engine: Engine) -> list[RequestOutput]:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ids, kwargs, field", [
    ([], dict(max_tokens=4), "prompt"),
    ([i % 256 for i in range(600)], dict(max_tokens=4), "prompt"),  # longer than the 512-token context
    ([i % 256 for i in range(500)], dict(max_tokens=20), "max_tokens"),  # fits, but not with its output
    ([1, 2, 3], dict(max_tokens=0), "max_tokens"),
    ([1, 2, 3], dict(top_p=0.0), "top_p"),
    ([1, 2, 3], dict(top_p=1.01), "top_p"),
    ([1, 2, 3], dict(stop=7), "stop"),
    ([1, 2, VOCAB], dict(max_tokens=4), "prompt"),  # token id outside the vocabulary
    ([1, 2, 3], dict(max_tokens=4, stop_token_ids=[VOCAB]), "stop_token_ids"),
    ([1, 2, 3], dict(max_tokens=4, logit_bias=[(VOCAB, 1.0)]), "logit_bias"),
    ([1, 2, 3], dict(max_tokens=4, min_tokens=5), "min_tokens"),
])
def test_bad_requests_raise_before_any_block_is_taken(model_dir, ids, kwargs, field):
    engine = make_engine(model_dir)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", ids, SamplingParams(**kwargs))
    assert err.value.field == field
    assert engine.stats().free_blocks == engine.stats().total_blocks
    assert not engine.has_unfinished() and "bad" not in engine.requests


@pytest.mark.timeout(60)
def test_block_waste_of_a_mixed_batch_is_under_4_percent(model_dir):
    engine = make_engine(model_dir, num_blocks=512, max_num_batched_tokens=8192)
    for i in range(12):
        engine.add_request(f"w{i}", prompt(60 + 37 * i, seed=i), SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    engine.step()
    allocated, used = engine.block_manager.usage()
    assert len(engine.scheduler.running) == 12
    assert (allocated - used) / allocated < 0.04


@pytest.mark.timeout(60)
def test_greedy_matches_transformers_generate(model_dir):
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    requests = {f"h{i}": (prompt(n, seed=20 + i), SamplingParams(max_tokens=24, **GREEDY))
                for i, n in enumerate((7, 23, 41))}
    got = run(make_engine(model_dir), requests)
    for rid, (ids, _) in requests.items():
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        assert got[(rid, 0)] == ref[0, len(ids):].tolist(), rid
