"""Attention sinks + sliding window (``--kv-window``, ``--kv-sinks``; engine/streaming_window.py) on the tiny
random Llama of test_engine_loop: a window longer than the sequence changes nothing, blocks behind the
window go back to the block manager (and stay cached for others), preemption recomputes the same tokens,
the engine's logits equal a plain torch StreamingLLM decoder's, sequences outgrow the model's context
(engine, CLI, and a chat session through the gateway), quantized caches, and the disaggregated handoff (a
prompt longer than the window moves only the blocks the window keeps)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import openai
import pytest
import torch
import transformers
from live_helpers import idle, wait_until
from test_engine_loop import GREEDY, prompt, run, run_outputs, write_model

from engine.block_manager import NO_BLOCK
from engine.config import DEFAULT_MAX_LEN, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.output import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from services.cli import build_parser, main
from services.config import ClusterConfig, GatewayConfig, configs_from_args
from services.local_redis import free_port
from services.serve import ThreadedServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("attention-sinks"))  # max_position_embeddings 512


def make_engine(model_dir, block_size: int = 16, **kwargs) -> Engine:
    kwargs.setdefault("num_blocks", 128)
    return Engine(EngineConfig(model=str(model_dir), block_size=block_size, **kwargs))


def outputs_of(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    return run_outputs(engine)


def held_blocks(engine: Engine, seq_id: int) -> list[int]:
    return [b for b in engine.block_manager.block_table(seq_id) if b != NO_BLOCK]


def streaming_reference(hf: transformers.LlamaForCausalLM, ids: list[int], sinks: int, window: int
                        ) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` of StreamingLLM decoding one token at a time, written from the paper
    with the checkpoint's weights: each layer caches keys before rotation; position t attends to the first
    ``sinks`` tokens and the ``window`` most recent ones (itself included), and the kept keys are rotated by
    their place in that cache (0, 1, ...), the query by the last place."""
    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = cfg.hidden_size // heads
    inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))

    def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [..., len(pos), dim]
        angles = pos.float()[:, None] * inv_freq
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    caches = [([], []) for _ in hf.model.layers]  # per layer: every token's raw K and V [kv_heads, dim]
    logits = []
    with torch.no_grad():
        for t, token in enumerate(ids):
            keep = sorted(set(range(min(sinks, t + 1))) | set(range(max(0, t - window + 1), t + 1)))
            places = torch.arange(len(keep))
            h = hf.model.embed_tokens.weight[token][None]
            for layer, (keys, values) in zip(hf.model.layers, caches, strict=True):
                attn, x = layer.self_attn, layer.input_layernorm(h)
                keys.append(attn.k_proj(x).view(kv_heads, dim))
                values.append(attn.v_proj(x).view(kv_heads, dim))
                k = rope(torch.stack([keys[j] for j in keep], 1), places).repeat_interleave(heads // kv_heads, 0)
                v = torch.stack([values[j] for j in keep], 1).repeat_interleave(heads // kv_heads, 0)
                q = rope(attn.q_proj(x).view(heads, 1, dim), places[-1:])
                weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(dim), dim=-1)
                h = h + attn.o_proj((weights @ v).reshape(1, heads * dim))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            logits.append(hf.lm_head(hf.model.norm(h))[0])
    return torch.stack(logits)


def logprob_error(outputs: list[RequestOutput], ids: list[int], reference: torch.Tensor, mean: bool = False
                  ) -> float:
    """Largest (or mean) gap between the engine's top-k logprobs (first token onwards) and the reference's."""
    ref = reference.log_softmax(-1)
    rows = range(len(ids) - 1, len(ids) - 1 + len(outputs))
    gaps = [abs(ref[row, token].item() - value)
            for row, out in zip(rows, outputs, strict=True) for token, value in out.logprobs[0].top]
    return sum(gaps) / len(gaps) if mean else max(gaps)


def test_a_window_longer_than_every_sequence_changes_nothing(model_dir):
    requests = {f"g{i}": (prompt(n, seed=i), SamplingParams(max_tokens=40, logprobs=5, **GREEDY))
                for i, n in enumerate((7, 45, 90))}
    requests["n2"] = (prompt(30, seed=9), SamplingParams(max_tokens=30, temperature=0.9, seed=4, n=2))

    def key(out: RequestOutput) -> tuple:
        ranked = [(lp.token_id, [t for t, _ in lp.top]) for lp in out.logprobs or ()]
        return out.request_id, out.index, out.new_token_ids, ranked, out.finish_reason

    def values(out: RequestOutput) -> list[float]:
        return [v for lp in out.logprobs or () for v in (lp.logprob, *(v for _, v in lp.top))]

    full = outputs_of(make_engine(model_dir), requests)
    windowed = outputs_of(make_engine(model_dir, kv_window=140, kv_sinks=4), requests)
    assert [key(o) for o in windowed] == [key(o) for o in full]
    # the same attention: equal to float32 summation order (the full run of this file saw 1e-4 apart)
    for got, want in zip(windowed, full, strict=True):
        assert values(got) == pytest.approx(values(want), abs=1e-3)


def test_blocks_behind_the_window_are_freed_and_a_sequence_holds_at_most_sinks_plus_window(model_dir):
    sinks, window = 4, 32  # one sink block, and the window spans 2 blocks (+1 when not aligned)
    engine = make_engine(model_dir, num_blocks=12, kv_window=window, kv_sinks=sinks)
    bm, bound = engine.block_manager, 1 + 2 + 1
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=1, n=2, ignore_eos=True)
    ids = prompt(40, seed=3)
    with pytest.raises(InvalidRequestError):  # 340 tokens = 22 blocks a sample: no room without the window
        make_engine(model_dir, num_blocks=12).add_request("r", ids, params)
    engine.add_request("r", ids, params)
    free, freed_while_running, steps = [], 0, 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        samples = engine.requests.get("r", [])
        held = {b for s in samples for b in held_blocks(engine, s.seq_id)}
        assert all(len(held_blocks(engine, s.seq_id)) <= bound for s in samples)
        assert bm.num_free_blocks == bm.num_blocks - len(held)  # nothing leaks, nothing is freed twice
        assert all(r >= 0 for r in bm.ref)
        if len(samples) == 2:
            sink = bm.block_table(samples[0].seq_id)[0]
            assert bm.block_table(samples[1].seq_id)[0] == sink and bm.ref[sink] == 2  # shared sink block
            table = bm.block_table(samples[0].seq_id)
            assert set(table[1:-3]) <= {NO_BLOCK}  # everything between sinks and window is gone
        if free and bm.num_free_blocks > free[-1] and samples:
            freed_while_running += 1
        free.append(bm.num_free_blocks)
    assert steps > 300 and freed_while_running >= 300 // 16  # about one block back per 16 tokens
    assert bm.num_free_blocks == bm.num_blocks


def test_preempted_windowed_sequences_recompute_to_the_same_tokens(model_dir):
    options = dict(kv_window=32, kv_sinks=4)
    requests = {f"r{i}": (prompt(20 + 7 * i, seed=10 + i), SamplingParams(max_tokens=100, **GREEDY))
                for i in range(6)}
    engine = make_engine(model_dir, num_blocks=14, **options)  # 6 sequences of up to 4 blocks each
    got = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0 and engine.stats().free_blocks == 14
    for rid, request in requests.items():
        assert got[(rid, 0)] == run(make_engine(model_dir, **options), {rid: request})[(rid, 0)], rid


def test_a_dropped_block_of_a_cached_prefix_serves_a_later_prompt(model_dir):
    engine = make_engine(model_dir, kv_window=32, kv_sinks=4)
    shared = prompt(64, seed=5)  # 4 full blocks; after the prompt the window (from 36) has passed block 1
    engine.add_request("a", shared + prompt(3, seed=6), SamplingParams(max_tokens=80, **GREEDY))
    (a,) = engine.requests["a"]
    while a.num_computed_tokens < 67:  # chunks of at most the window
        engine.step()
    dropped = engine.block_manager.cached_prefix(shared)[0][1]
    assert engine.block_manager.block_table(a.seq_id)[1] == NO_BLOCK and engine.block_manager.ref[dropped] == 0
    engine.add_request("b", shared + prompt(5, seed=7), SamplingParams(max_tokens=4, **GREEDY))
    outs = run_outputs(engine)
    assert next(o for o in outs if o.request_id == "b").num_cached_tokens == 64
    assert engine.stats().free_blocks == engine.stats().total_blocks


@pytest.mark.parametrize("sinks", [0, 2])
def test_engine_logits_equal_a_torch_streaming_llm_decoder(model_dir, sinks):
    window, ids = 10, prompt(23, seed=11)  # blocks of 4: sinks and window both cut blocks
    engine = make_engine(model_dir, block_size=4, kv_window=window, kv_sinks=sinks)
    outs = outputs_of(engine, {"r": (ids, SamplingParams(max_tokens=30, logprobs=20, **GREEDY))})
    tokens = [o.new_token_ids[0] for o in outs]
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = streaming_reference(hf, ids + tokens[:-1], sinks, window)
    assert tokens == reference[len(ids) - 1:].argmax(-1).tolist()
    assert logprob_error(outs, ids, reference) < 1e-4
    full = streaming_reference(hf, ids + tokens[:-1], 0, len(ids) + len(tokens))
    assert logprob_error(outs, ids, full) > 1e-2  # the window did change what attention sees


def test_a_sequence_longer_than_the_context_runs_with_a_window_and_is_refused_without(model_dir):
    ids, params = prompt(100, seed=12), SamplingParams(max_tokens=450, **GREEDY)  # 550 > 512 positions
    with pytest.raises(InvalidRequestError) as err:
        make_engine(model_dir).add_request("r", ids, params)
    assert err.value.field == "max_tokens"
    engine = make_engine(model_dir, num_blocks=16, kv_window=64, kv_sinks=4)
    assert engine.max_model_len == DEFAULT_MAX_LEN
    outs = outputs_of(engine, {"r": (ids, params)})
    assert sum(len(o.new_token_ids) for o in outs) == 450 and outs[-1].finish_reason is FinishReason.LENGTH
    long_prompt = prompt(700, seed=13)  # a prompt beyond the context is prefilled in windowed chunks
    outs = outputs_of(engine, {"p": (long_prompt, SamplingParams(max_tokens=5, **GREEDY))})
    assert outs[-1].finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError, match="exceed the model's context"):
        make_engine(model_dir, kv_window=510, kv_sinks=4)


def test_max_model_len_caps_the_context_and_only_a_window_lets_it_pass_the_models(model_dir):
    """--max-model-len 200 of the model's 512 positions: a request of 150 + 60 tokens is refused by its
    max_tokens, one of 150 + 50 runs; 600 is refused without a window (ValueError naming the context) and
    taken with one."""
    engine = make_engine(model_dir, max_model_len=200)
    assert engine.max_model_len == 200
    ids = prompt(150, seed=14)
    with pytest.raises(InvalidRequestError, match=r"exceeds the context of 200 tokens") as err:
        engine.add_request("long", ids, SamplingParams(max_tokens=60, **GREEDY))
    assert err.value.field == "max_tokens"
    outs = outputs_of(engine, {"fits": (ids, SamplingParams(max_tokens=50, **GREEDY))})
    assert sum(len(o.new_token_ids) for o in outs) == 50
    for too_long in (600, 1):
        with pytest.raises(ValueError, match=f"max_model_len {too_long} must be between 2 and the model's context, "
                                             r"512 tokens \(max_position_embeddings\)"):
            make_engine(model_dir, max_model_len=too_long)
    assert make_engine(model_dir, max_model_len=600, kv_window=64, kv_sinks=4).max_model_len == 600


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "kivi2"])
def test_quantized_caches_keep_the_window(model_dir, kv_cache_dtype):
    """The window adds no error of its own to a quantized cache: against the StreamingLLM decoder, the
    windowed engine is off by about what the same format costs full attention against the full model."""
    window, sinks, ids = 10, 2, prompt(23, seed=11)
    params = SamplingParams(max_tokens=30, logprobs=20, **GREEDY)
    quantized = dict(block_size=4, kv_cache_dtype=kv_cache_dtype)
    short = {"s": (prompt(20, seed=14), SamplingParams(max_tokens=10, logprobs=5, **GREEDY))}
    assert outputs_of(make_engine(model_dir, kv_window=40, kv_sinks=sinks, **quantized), short) == \
        outputs_of(make_engine(model_dir, **quantized), short)
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    errors = {}
    for name, options in {"window": dict(kv_window=window, kv_sinks=sinks), "full": {}}.items():
        outs = outputs_of(make_engine(model_dir, num_blocks=16, **quantized, **options), {"r": (ids, params)})
        tokens = ids + [o.new_token_ids[0] for o in outs][:-1]
        for reference, (s, w) in {"streaming": (sinks, window), "full": (0, len(tokens))}.items():
            errors[name, reference] = logprob_error(outs, ids, streaming_reference(hf, tokens, s, w), mean=True)
    assert errors["window", "streaming"] < 2 * errors["full", "full"]
    assert errors["window", "streaming"] < 0.5 * errors["window", "full"]


@pytest.mark.parametrize("sinks", [4, 0], ids=["sinks", "sliding_window"])
def test_a_disaggregated_handoff_carries_only_the_blocks_the_window_keeps(model_dir, sinks):
    """A prompt far longer than the window is prefilled in window-sized chunks on one engine, which drops the
    blocks its chunks pass; the hand-off carries the sink blocks and the next query's window, the decode
    engine reserves only those (its table holds no block for the rest) and answers as one engine does."""
    window = 32
    options = dict(kv_window=window, kv_sinks=sinks)
    params = SamplingParams(max_tokens=100, **GREEDY)
    ids = prompt(150, seed=15)  # the query at 150 reads from 119: blocks 0 (sinks), 7, 8 and 9
    expected = outputs_of(make_engine(model_dir, **options), {"r": (ids, params)})
    prefill, decode = make_engine(model_dir, **options), make_engine(model_dir, num_blocks=8, **options)
    kept = [0, 7, 8, 9] if sinks else [7, 8, 9]
    assert prefill.handoff_blocks(len(ids)) == decode.handoff_blocks(len(ids)) == kept
    prefill.add_request("r", ids, params, prefill_only=True)
    (first,) = run_outputs(prefill)  # five chunks of at most the window
    block_ids = prefill.request_block_ids("r")
    assert len(block_ids) == len(kept)
    tensor = prefill.kv_cache.export_blocks(block_ids)
    prefill.release("r")
    reserved = decode.reserve_blocks("r", len(ids))
    assert len(reserved) == len(kept) and decode.stats().free_blocks == 8 - len(kept)
    decode.kv_cache.import_blocks(reserved, tensor)
    decode.add_imported_request("r", ids, first.new_token_ids[0], params, reserved)
    table = decode.block_manager.block_table(decode.requests["r"][0].seq_id)
    assert [i for i, b in enumerate(table) if b != NO_BLOCK] == kept
    outs = [first, *run_outputs(decode)]  # 250 tokens in 8 blocks: the decode side drops as it goes
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in expected]
    for engine in (prefill, decode):
        assert engine.stats().free_blocks == engine.stats().total_blocks and not engine.has_unfinished()


def test_cli_options_reach_the_engine_config_and_sinks_alone_are_refused(model_dir, capsys):
    parser = build_parser()
    cluster, _ = configs_from_args(parser.parse_args(["serve", "--colocated", "1", "--kv-window", "256",
                                                      "--kv-sinks", "4"]))
    assert (cluster.engine.kv_window, cluster.engine.kv_sinks) == (256, 4)
    with pytest.raises(ValueError, match="kv_sinks needs kv_window"):
        configs_from_args(parser.parse_args(["serve", "--kv-sinks", "4"]))
    ids = ",".join(map(str, prompt(100, seed=17)))  # 100 + 450 tokens: past the 512 positions
    args = ["generate", "--model", str(model_dir), "--prompt-ids", ids, "--max-tokens", "450", "--ignore-eos",
            "--json"]
    assert main([*args, "--kv-window", "64", "--kv-sinks", "4"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 450
    assert main(args) == 2 and "exceeds the context of 512" in capsys.readouterr().err
    assert main([*args, "--kv-sinks", "4"]) == 2 and "kv_sinks needs kv_window" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_chat_session_outgrows_the_model_context_on_a_windowed_server(ray_session, serving_model_dir):
    # 512 blocks: the router still sizes a request's KV as prompt + max_tokens, not by the window
    engine = EngineConfig(model=str(serving_model_dir), num_blocks=512, kv_window=256, kv_sinks=4)
    config = ClusterConfig(engine=engine, colocated=1, threads_per_worker=1)  # its own redis-server
    server = ThreadedServer(config, GatewayConfig(http_port=free_port(), grpc_port=free_port())).start()
    try:
        context = ModelConfig.from_dir(serving_model_dir).max_position_embeddings
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0, timeout=120)
        session, usage = {"X-Session-Id": "long-chat"}, []
        for turn in range(3):  # ~900 tokens a turn: the third prompt holds more than the context
            message = {"role": "user", "content": f"Turn {turn}: " + "the tide rises and falls. " * 35}
            reply = client.chat.completions.create(
                model=server.model_id, messages=[message], max_tokens=40, temperature=0.0,
                extra_headers=session, extra_body={"ignore_eos": True})
            assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content
            usage.append(reply.usage)
        assert usage[-1].prompt_tokens > context > usage[0].prompt_tokens
        assert usage[-1].prompt_tokens > usage[1].prompt_tokens + usage[1].completion_tokens  # the history
        assert wait_until(lambda: idle(server))
    finally:
        server.stop()
