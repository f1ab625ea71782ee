"""KIVI's full-precision residual (``kv_residual_blocks``): an fp8/kivi2 sequence keeps its last full blocks
in windows next to their records, reads them exactly until it is that many blocks past, carries them
through export/import, registers them in the prefix cache only once it has moved past or freed them (so no
other sequence reads a window), and a prompt never takes them from the prefix cache, since a cold run
holds them in full precision. The options that set it and the memory it takes."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from test_kv_quant import greedy, run_engine, tokens, window

from engine.block_events import BlockStored
from engine.block_manager import BlockManager
from engine.capacity import add_kv_calc_parser
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_cache import KVCache, block_bytes, num_blocks_for
from engine.runner import ModelRunner, SeqChunk
from engine.sampler import make_generator
from engine.sampling_params import SamplingParams
from kvstore.hashing import salt_for
from services.config import add_serve_arguments, configs_from_args

pytestmark = pytest.mark.timeout(180)


def runner(tiny, fmt: str, residual: int = 1, num_blocks: int = 8) -> ModelRunner:
    model, cfg = tiny
    return ModelRunner(model, cfg, KVCache(cfg, num_blocks, 16, torch.float32, "cpu", fmt,
                                           residual_blocks=residual))


@pytest.mark.parametrize("fmt", ["fp8", "kivi2"])
def test_the_residual_block_stays_exact_until_the_sequence_is_a_block_past_it(tiny, fmt):
    runners = {"auto": runner(tiny, "auto", 0), fmt: runner(tiny, fmt, 1)}
    prompt, forced = tokens(10, 3), tokens(24, 4)
    table = [3, 6, 1]
    logits = {f: [r.run([SeqChunk(prompt, 0, table)])[0]] for f, r in runners.items()}
    for i, tok in enumerate(forced):  # positions 10..33
        for f, r in runners.items():
            logits[f].append(r.run([SeqChunk([tok], 10 + i, table)])[0])
    auto, quant = torch.stack(logits["auto"]), torch.stack(logits[fmt])
    # up to position 30 every block is read from its window: block 3 filled at position 15 and has its
    # record, but the sequence keeps it as its residual (the exact K/V; only summation order differs)
    torch.testing.assert_close(quant[:22], auto[:22], atol=1e-5, rtol=0)
    # position 31 fills block 6, which becomes the residual: block 3 is read as its record from then on
    assert (quant[22] - auto[22]).abs().max() > 1e-3
    cache = runners[fmt].kv_cache
    assert cache.windows.slot(3) == -1 and cache.windows.slot(6) >= 0 and cache.windows.slot(1) >= 0
    # the residual's window holds exactly what was computed for it (in layer 0, which saw no quantized KV)
    assert torch.equal(window(cache, 6)[0, :, :], runners["auto"].kv_cache.data[0, :, 6])


@pytest.mark.parametrize("layerwise", [False, True])
def test_export_import_carries_every_window_of_the_residual(tiny, layerwise):
    _, cfg = tiny
    prefill, decode = runner(tiny, "kivi2"), runner(tiny, "kivi2")
    src, dst = prefill.kv_cache, decode.kv_cache
    prompt = tokens(40, 5)  # 2 full blocks + 8 tokens: blocks 0 (residual) and 5 (open) keep windows
    src_table, dst_table = [2, 0, 5, 6], [7, 3, 1, 4]
    first = int(prefill.run([SeqChunk(prompt, 0, src_table)])[0].argmax())
    assert src.windows.slot(2) == -1 and src.windows.slot(0) >= 0 and src.windows.slot(5) >= 0
    assert src.payload_shape(3)[2] == 3 + src.window_columns and src.window_columns % 2 == 0  # 2 sections
    if layerwise:
        for layer in range(cfg.num_layers):
            dst.import_layer(layer, dst_table[:3], src.export_layer(layer, src_table[:3]))
    else:
        dst.import_blocks(dst_table[:3], src.export_blocks(src_table[:3]))
    assert torch.equal(dst.data[:, :, dst_table[:3]], src.data[:, :, src_table[:3]])
    assert dst.windows.slot(7) == -1
    for s, d in ((0, 3), (5, 1)):
        assert torch.equal(window(dst, d), window(src, s))
    # 20 tokens: block 0 leaves the residual at position 47, block 5 at 63 is not reached
    assert greedy(decode, first, 40, dst_table, 20) == greedy(prefill, first, 40, src_table, 20)
    # one block whose window the payload does not carry (it is not among the last two) loses its own
    dst.import_blocks([3, 1, 4], src.export_blocks([0, 5, 6]))
    assert dst.windows.slot(3) == -1 and dst.windows.slot(1) >= 0


def test_residual_blocks_are_registered_once_passed_or_freed_and_never_hit_by_a_prompt():
    registered: list[int] = []
    bm = BlockManager(16, 4, salt_for("residual"), record_events=True, residual_blocks=1,
                      on_register=registered.extend)
    toks = list(range(100, 120))
    assert bm.allocate("a", 0, 10)
    bm.commit("a", toks, 10)  # blocks 0 and 1 are full; 1 is the residual
    table = bm.block_table("a")
    assert registered == table[:1] and len(bm.cached_prefix(toks)[0]) == 1
    assert bm.allocate("a", 10, 2)
    bm.commit("a", toks, 12)  # block 2 fills: block 1 is passed
    assert registered == table[:2]
    bm.free("a")  # the residual (block 2) is registered as the sequence goes
    assert registered == table[:3] and len(bm.cached_prefix(toks)[0]) == 3
    assert [e.hashes for e in bm.take_events() if isinstance(e, BlockStored)] == \
        [[bm.block_hash[table[0]]], [bm.block_hash[table[1]]], [bm.block_hash[table[2]]]]
    # a prompt leaves its last full block to be computed: 12 tokens take 2 blocks, 13-15 too, 16 take 3
    assert [bm.max_prefix_blocks(n) for n in (4, 8, 12, 13, 15, 16, 17)] == [0, 1, 2, 2, 2, 3, 3]
    # without a residual: every full block but the one holding the last token
    assert [BlockManager(4, 4, b"", residual_blocks=0).max_prefix_blocks(n) for n in (4, 5, 8)] == [0, 1, 1]


def test_a_residual_block_two_samples_share_is_registered_by_the_last_to_free_it():
    registered: list[int] = []
    bm = BlockManager(16, 4, salt_for("residual"), residual_blocks=1, on_register=registered.extend)
    toks = list(range(9))
    assert bm.allocate("p", 0, 9)
    bm.commit("p", toks, 9)
    bm.fork("p", "c")
    shared = bm.block_table("p")[1]
    assert registered == bm.block_table("p")[:1]
    bm.free("p")  # the child still keeps block 1 in its window
    assert shared not in registered
    bm.free("c")
    assert registered[-1] == shared


@pytest.mark.parametrize("temperature, num_blocks", [(0.0, 32), (1.0, 6)])
def test_kivi2_samples_sharing_a_residual_each_decode_as_a_request_of_one_does(temperature, num_blocks):
    """n = 2 on kivi2: after the fork both samples keep the prompt's residual block (16-31) and the partial
    block, then grow past them, copy-on-write and window moves included; with 6 blocks one sample is
    preempted and computed again while the other goes on, so the two fall out of step. Each sample must
    decode exactly as a lone request with its seed (sample i draws from ``make_generator(seed, i)``)."""
    prompt, seed = tokens(45, 11), 5
    params = dict(max_tokens=24, temperature=temperature, ignore_eos=True)  # to position 68: past blocks 1-2

    def decode(num_blocks: int, sampling: SamplingParams) -> tuple[dict[int, list[int]], int]:
        engine = Engine(EngineConfig(model="tiny", kv_cache_dtype="kivi2", num_blocks=num_blocks))
        engine.add_request("r", prompt, sampling)
        out: dict[int, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.index, []).extend(o.new_token_ids)
        return out, engine.stats().num_preemptions

    both, preemptions = decode(num_blocks, SamplingParams(**params, seed=seed, n=2))
    assert (preemptions > 0) == (num_blocks == 6)
    for index in (0, 1):
        alone_seed = make_generator(seed, index, "cpu").initial_seed()  # sample ``index``'s stream
        assert both[index] == decode(32, SamplingParams(**params, seed=alone_seed))[0][0]
    if temperature > 0:
        assert both[0] != both[1]  # the samples did diverge, so each grew its own blocks


def test_a_finished_sequence_leaves_its_residual_cached_as_records(tiny):
    engine = Engine(EngineConfig(model="tiny", kv_cache_dtype="kivi2", num_blocks=32))
    assert engine.config.residual_blocks == 1
    prompt = tokens(40, 7)
    # 9 tokens: 48 positions computed, blocks 0-2 full, block 2 the residual when the sequence finished
    sequence = prompt + run_engine(engine, [prompt], 9)["0"]
    blocks = engine.block_manager.cached_prefix(sequence)[0]
    registered = [b for b in range(32) if engine.block_manager.block_hash[b] is not None]
    assert len(blocks) == 3 and sorted(blocks) == registered
    assert all(engine.kv_cache.windows.slot(b) == -1 for b in blocks)  # read as records from now on


def test_options_set_the_residual_and_its_memory(tiny, capsys):
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    cluster, _ = configs_from_args(serve.parse_args(["--kv-cache-dtype", "kivi2", "--kv-residual-blocks", "3"]))
    assert cluster.engine.residual_blocks == 3
    assert configs_from_args(serve.parse_args(["--kv-cache-dtype", "fp8"]))[0].engine.residual_blocks == 0
    for bad, match in ((dict(kv_cache_dtype="int8", kv_residual_blocks=1), "windowed"),
                       (dict(kv_cache_dtype="kivi2", kv_residual_blocks=-1), ">= 0")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="tiny", **bad)
    # each sequence of a full batch holds the block it fills and the residual in the attention dtype
    _, cfg = tiny
    base = dict(model="tiny", kv_cache_dtype="kivi2", kv_cache_bytes=32 << 20, max_num_seqs=16)
    one, none = (num_blocks_for(cfg, EngineConfig(**base, kv_residual_blocks=r)) for r in (1, 0))
    window = block_bytes(cfg, 16, "float32", "auto")  # a block in the attention dtype
    assert (16 * window) // block_bytes(cfg, 16, "float32", "kivi2") <= none - one <= \
        -(-16 * window // block_bytes(cfg, 16, "float32", "kivi2"))
    cli = argparse.ArgumentParser()
    add_kv_calc_parser(cli.add_subparsers())
    for residual in ("0", "2"):
        args = cli.parse_args(["kv-calc", "--preset", "llama-2-7b", "--kv-cache-dtype", "kivi2", "--json",
                               "--kv-residual-blocks", residual])
        assert args.func(args) == 0
        report = json.loads(capsys.readouterr().out)
        # 32 layers x 2 x 16 tokens x 4096 channels x 2 bytes per window
        assert report["window_bytes_per_request"] == (int(residual) + 1) * 32 * 2 * 16 * 4096 * 2


@pytest.mark.parametrize("prompt_len", [45, 48])
def test_a_disaggregated_kivi2_request_decodes_the_tokens_of_a_colocated_one(prompt_len):
    """The prefill side keeps its residual and open block in windows; the decode side gets both with the
    records and decodes on as one engine does, across the blocks its residual moves past."""
    config = EngineConfig(model="tiny", kv_cache_dtype="kivi2", num_blocks=32)
    ids, params = tokens(prompt_len, 11), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    colocated = run_engine(Engine(config), [ids], 24)["0"]
    prefill, decode = Engine(config), Engine(config)
    prefill.add_request("r", ids, params, prefill_only=True)
    (first,) = prefill.step()
    block_ids = prefill.request_block_ids("r")
    assert sum(prefill.kv_cache.windows.slot(b) >= 0 for b in block_ids) == (2 if prompt_len % 16 else 1)
    payload = prefill.kv_cache.export_blocks(block_ids)
    prefill.release("r")
    reserved = decode.reserve_blocks("r", len(ids))
    decode.kv_cache.import_blocks(reserved, payload)
    decode.add_imported_request("r", ids, first.new_token_ids[0], params, reserved)
    out = list(first.new_token_ids)
    while decode.has_unfinished():
        out += [t for o in decode.step() for t in o.new_token_ids]
    assert out == colocated
