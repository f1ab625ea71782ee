"""Quantized KV cache (``--kv-cache-dtype`` int8 | fp8 | kivi2): round-trip error bounds, attention through
the paged cache against full precision, the full-precision window of fp8/kivi2, exact export/import of
records and windows, the blocks a byte budget buys, greedy generation end to end, the receiver and the
pool refusing KV of another format, and the options that select a format."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
import torch
from receiver_helpers import leased_receiver
from test_pool_engine import load_prefix

from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import add_generate_parser
from engine.kv_cache import KVCache, block_bytes, num_blocks_for
from engine.kv_format import record_layout, window_layer_bytes
from engine.kv_quant import decode_into, encode_blocks
from engine.runner import ModelRunner, SeqChunk
from engine.sampling_params import SamplingParams
from kvstore.payload import BlockError, BlockLayout, decode_block, encode_block
from kvstore.transfer import TransferRejected
from kvstore.transfer.wire import TransferHeader
from services.config import add_serve_arguments, configs_from_args
from services.engine_loop import EngineLoop
from services.pool_link import PoolLink

pytestmark = pytest.mark.timeout(180)
QUANTIZED = ("int8", "fp8", "kivi2")


def runner(tiny, fmt: str, num_blocks: int = 8) -> ModelRunner:
    model, cfg = tiny
    return ModelRunner(model, cfg, KVCache(cfg, num_blocks, 16, torch.float32, "cpu", fmt))


def window(cache: KVCache, block: int) -> torch.Tensor:
    """Every layer's K and V of ``block``'s full-precision window."""
    return cache.windows.data[:, :, cache.windows.slot(block)]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def error_bound(fmt: str, kind: str, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |dequantize(quantize(x)) - x| from the format's definition (fp16 scales
    included), computed from ``x`` alone."""
    if fmt == "int8":  # half a step of amax / 127 per token and head
        return x.abs().amax(-1, keepdim=True) / 254 * 1.001 + 1e-7
    if fmt == "fp8":  # e4m3's half ulp (2^-4 relative) plus subnormal and scale rounding, per block and head
        amax = x.abs().amax(dim=(1, 3), keepdim=True)
        return x.abs() / 16 + amax * 6e-4 + 1e-7
    groups = x if kind == "k" else x.unflatten(-1, (-1, record_layout("kivi2", 16, 4, 64).value_group))
    dim = 1 if kind == "k" else -1  # keys per channel over the block's tokens, values per token group
    lo, hi = groups.amin(dim, keepdim=True), groups.amax(dim, keepdim=True)
    bound = (hi - lo) / 6 * 1.001 + lo.abs() / 1024 + 1e-6  # half a step of range / 3, fp16 zero point
    return bound.expand_as(groups).reshape(x.shape)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_round_trip_error_is_within_the_format_bound(fmt):
    layout = record_layout(fmt, 16, 4, 64)
    g = torch.Generator().manual_seed(0)
    # channels of very different magnitudes, as real keys have, and a zero block (scale stored as 1)
    k = torch.randn(6, 16, 4, 64, generator=g) * torch.logspace(-2, 1, 64)
    v = torch.randn(6, 16, 4, 64, generator=g) * 3
    k[5] = v[5] = 0
    records = encode_blocks(layout, k, v)
    assert records.shape == (6, layout.record_bytes) and records.dtype == torch.uint8
    for kind, x in (("k", k), ("v", v)):
        got = decode_into(layout, records, kind, torch.empty_like(x))
        assert ((got - x).abs() <= error_bound(fmt, kind, x)).all(), f"{fmt} {kind}"
        assert torch.equal(got[5], x[5])
        assert (got - x).abs().max() > 0  # it is quantized


def test_bytes_per_block_include_scales_and_set_the_block_count(tiny):
    _, cfg = tiny
    auto = block_bytes(cfg, 16, "bfloat16", "auto")
    assert auto == cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 2
    H, D, L = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    # + an fp16 scale per token and head (int8), per block and head (fp8, padded to 16 bytes)
    assert block_bytes(cfg, 16, "bfloat16", "int8") == L * 2 * (16 * H * D + 16 * H * 2)
    assert block_bytes(cfg, 16, "bfloat16", "fp8") == L * 2 * (16 * H * D + 16)
    # kivi2: 2-bit codes, fp16 scale and zero per key channel and per value group of 32 channels
    assert block_bytes(cfg, 16, "bfloat16", "kivi2") == L * (2 * 16 * H * D // 4 + 2 * H * D * 2
                                                             + 2 * 16 * H * (D // 32) * 2)
    assert 0.2 < block_bytes(cfg, 16, "bfloat16", "kivi2") / auto < 0.23  # 2/16 + scales
    # the windows (per sequence of a full batch: the block it fills and its residual, one full block by
    # default, in the attention dtype) come off the budget
    config = EngineConfig(model="tiny", dtype="bfloat16", kv_cache_bytes=64 << 20, kv_cache_dtype="kivi2")
    window = L * window_layer_bytes("kivi2", 16, H, D, 2, config.residual_blocks)
    assert config.residual_blocks == 1 and window == 2 * auto
    kivi2 = block_bytes(cfg, 16, "bfloat16", "kivi2")
    assert num_blocks_for(cfg, config) == ((64 << 20) - config.max_num_seqs * window) // kivi2


def teacher_forced_logits(model, cfg, fmt: str, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Logits of the prompt (in two chunks, the second over the cached first) and of each forced token."""
    r = runner((model, cfg), fmt, num_blocks=16)
    table = [9, 2, 14, 5, 11, 0, 7]
    out = [r.run([SeqChunk(prompt[:37], 0, table)])[0], r.run([SeqChunk(prompt[37:], 37, table)])[0]]
    for i, tok in enumerate(forced):
        out.append(r.run([SeqChunk([tok], len(prompt) + i, table)])[0])
    return torch.stack(out)


PROMPT, FORCED = tokens(70, 1), tokens(12, 2)


@pytest.fixture(scope="module")
def full_precision_logits(tiny) -> torch.Tensor:
    return teacher_forced_logits(*tiny, "auto", PROMPT, FORCED)


# Relative logit error on random weights, whose diffuse attention averages little quantization error away
# (the trained model's bits per byte are in docs/BENCHMARKS.md).
@pytest.mark.parametrize(("fmt", "bound"), [("int8", 0.02), ("fp8", 0.06), ("kivi2", 0.75)])
def test_attention_through_the_quantized_cache_stays_close_to_full_precision(tiny, full_precision_logits, fmt,
                                                                             bound):
    ref = full_precision_logits
    got = teacher_forced_logits(*tiny, fmt, PROMPT, FORCED)
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < bound
    # the context really was read back quantized, the first chunk's own K/V included (as after a prefix hit)
    assert rel.min() > 0


@pytest.mark.parametrize("fmt", ["fp8", "kivi2"])
def test_the_block_being_filled_stays_exact_until_its_last_token(tiny, fmt):
    runners = {f: runner(tiny, f) for f in ("auto", fmt)}
    prompt, forced = tokens(10, 3), tokens(7, 4)
    logits = {f: [r.run([SeqChunk(prompt, 0, [3])])[0]] for f, r in runners.items()}
    for i, tok in enumerate(forced):  # positions 10..16: position 15 fills block 3, 16 opens block 6
        for f, r in runners.items():
            logits[f].append(r.run([SeqChunk([tok], 10 + i, [3, 6])])[0])
    auto, quant = torch.stack(logits["auto"]), torch.stack(logits[fmt])
    # positions 0..14 are all in the window: their K/V are exact (the prompt reads them from the cache,
    # so only the float summation order differs from the plain cache's fresh-prompt attention)
    torch.testing.assert_close(quant[:6], auto[:6], atol=1e-5, rtol=0)
    assert (quant[6] - auto[6]).abs().max() > 1e-3  # position 15 completed the block: read quantized now
    assert ((quant[6:] - auto[6:]).norm(dim=-1) / auto[6:].norm(dim=-1)).max() < 0.4
    cache = runners[fmt].kv_cache
    assert cache.windows.slot(3) == -1 and cache.windows.slot(6) >= 0
    # layer 0's K/V of position 16 (later layers saw the quantized block) is stored as computed
    assert torch.equal(window(cache, 6)[0, :, :1], runners["auto"].kv_cache.data[0, :, 6, :1])
    cache.copy_block(6, 1)  # copy-on-write carries the window
    assert torch.equal(window(cache, 1), window(cache, 6))


def greedy(r: ModelRunner, last: int, start: int, table: list[int], steps: int) -> list[int]:
    out = []
    for i in range(steps):
        last = int(r.run([SeqChunk([last], start + i, table)])[0].argmax())
        out.append(last)
    return out


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_export_import_moves_codes_scales_and_window_exactly(tiny, fmt):
    _, cfg = tiny
    prefill, decode = runner(tiny, fmt), runner(tiny, fmt)
    src, dst = prefill.kv_cache, decode.kv_cache
    prompt = tokens(40, 5)  # 2 full blocks + 8 tokens in a third
    src_table, dst_table = [2, 0, 5, 6], [7, 3, 1, 4]
    first = int(prefill.run([SeqChunk(prompt, 0, src_table)])[0].argmax())
    payload = src.export_blocks(src_table[:3])
    assert payload.dtype == torch.uint8 and tuple(payload.shape) == src.payload_shape(3)
    dst.import_blocks(dst_table[:3], payload)
    assert torch.equal(dst.data[:, :, dst_table[:3]], src.data[:, :, src_table[:3]])  # codes and scales
    layered = KVCache(cfg, 8, 16, torch.float32, "cpu", fmt)
    for layer in range(cfg.num_layers):
        layered.import_layer(layer, dst_table[:3], src.export_layer(layer, src_table[:3]))
    assert torch.equal(layered.data, dst.data)
    if src.windows is not None:  # the partial block travels in full precision
        assert src.windows.slot(5) >= 0 and src.windows.slot(2) == -1
        for cache in (dst, layered):
            assert torch.equal(window(cache, 1), window(src, 5))
            assert cache.windows.slot(7) == cache.windows.slot(3) == -1
    assert greedy(decode, first, 40, dst_table, 10) == greedy(prefill, first, 40, src_table, 10)
    if src.windows is not None:  # a full block from the pool (records only) replaces a window
        dst.import_blocks([1], src.export_blocks([0])[:, :, :1])
        assert dst.windows.slot(1) == -1 and torch.equal(dst.data[:, :, 1], src.data[:, :, 0])
    with pytest.raises(ValueError, match="shape"):
        dst.import_blocks([0], payload)


def test_window_pool_reclaims_blocks_no_longer_in_use_before_growing(tiny):
    _, cfg = tiny
    in_use = {0, 1}
    cache = KVCache(cfg, 8, 16, torch.float32, "cpu", "kivi2", window_slots=2,
                    block_in_use=in_use.__contains__)
    cache.for_step(torch.tensor([0 * 16, 1 * 16]), [([0], 0, 1), ([1], 0, 1)])  # blocks 0 and 1 open windows
    assert cache.windows.num_slots == 2
    in_use.discard(0)
    in_use.add(2)
    cache.for_step(torch.tensor([2 * 16]), [([2], 0, 1)])  # block 0 was freed: its slot is reused
    assert cache.windows.num_slots == 2 and cache.windows.slot(0) == -1 and cache.windows.slot(2) >= 0
    in_use.add(3)
    cache.for_step(torch.tensor([3 * 16]), [([3], 0, 1)])  # every window is live: the pool grows
    slots = [cache.windows.slot(b) for b in (1, 2, 3)]
    assert cache.windows.num_slots == 4 and min(slots) >= 0 and len(set(slots)) == 3


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_int8_engine_holds_twice_the_blocks_and_generates_greedily(tiny):
    base = dict(model="tiny", dtype="bfloat16", kv_cache_bytes=16 << 20)
    auto, int8 = Engine(EngineConfig(**base)), Engine(EngineConfig(**base, kv_cache_dtype="int8"))
    # one fp16 scale per token and head of 64 channels: 2 * 64 / (64 + 2) times the bf16 blocks
    assert 1.9 < int8.stats().total_blocks / auto.stats().total_blocks <= 2.0
    prompts = [tokens(n, 10 + n) for n in (37, 20)]
    want, got = run_engine(auto, prompts, 16), run_engine(int8, prompts, 16)
    assert all(len(got[k]) == 16 for k in want)
    # not token for token: the prompt itself is read back quantized, and random weights leave near-ties
    agree = sum(a == b for k in want for a, b in zip(got[k], want[k], strict=True))
    assert agree >= 0.75 * 16 * len(prompts)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_cached_prefix_gives_the_tokens_of_a_cold_run(fmt):
    """A prompt whose first two blocks another request left in the prefix cache decodes exactly as it does
    cold: every chunk, a fresh prompt's included, reads its K/V back from the quantized cache. kivi2 keeps
    its last full block (16-31) in full precision, as a cold run has it, so that one is recomputed."""
    prompt, config = tokens(45, 3), EngineConfig(model="tiny", kv_cache_dtype=fmt, num_blocks=32)
    cold = run_engine(Engine(config), [prompt], 8)["0"]
    engine = Engine(config)
    run_engine(engine, [prompt[:40]], 1)  # leaves blocks 0-1 (16 tokens each) in the prefix cache
    engine.add_request("warm", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    warm, cached = [], 0
    while engine.has_unfinished():
        for o in engine.step():
            warm, cached = warm + o.new_token_ids, o.num_cached_tokens
    assert cached == (16 if fmt == "kivi2" else 32) and warm == cold


def test_receiver_refuses_kv_of_another_format(tiny):
    async def main() -> None:
        async with leased_receiver("r", 40, kv_cache_dtype="int8") as leased:
            engine, receiver = leased.engine, leased.receiver
            shape = engine.kv_cache.payload_shape(len(leased.blocks))

            def header(kv_format: str) -> TransferHeader:
                return TransferHeader.describe("r", engine.model_id, shape, torch.uint8, kv_format=kv_format)

            for other in ("auto", "fp8", "kivi2"):
                with pytest.raises(TransferRejected, match=f"format '{other}'.*holds 'int8'"):
                    receiver.begin(header(other))
            assert TransferHeader.from_proto(header("int8").to_proto()).kv_format == "int8"
            receiver.begin(header("int8")).abort("the test ends here")  # the same format is accepted

    asyncio.run(main())


def test_a_pool_block_of_another_format_is_a_miss():
    block = torch.arange(2 * 1 * 64, dtype=torch.uint8).view(2, 1, 64)
    data = encode_block("tiny", 7, block, "fp8")
    assert torch.equal(decode_block(data, "tiny", 7, BlockLayout("uint8", (2, 1, 64), "fp8")), block)
    with pytest.raises(BlockError, match="fp8.*expects int8"):
        decode_block(data, "tiny", 7, BlockLayout("uint8", (2, 1, 64), "int8"))


async def generate(loop: EngineLoop, request_id: str, prompt: list[int], prefill_only: bool = False
                   ) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one greedy request on the engine thread."""
    stream = loop.open_queue(request_id)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    await loop.acall(loop.engine.add_request, request_id, prompt, params, prefill_only)
    out, cached = [], 0
    while True:
        o = await stream.get()
        out, cached = out + o.new_token_ids, o.num_cached_tokens
        if o.finished:
            loop.close_stream(request_id)
            return out, cached


@pytest.mark.redis
@pytest.mark.timeout(120)
def test_quantized_blocks_go_through_the_pool_exactly_and_other_formats_miss(redis_url, redis_client,
                                                                            serving_model_dir):
    prompt = tokens(100, 9)  # 6 full blocks (the pool's) + 4 tokens

    async def run() -> None:
        aio = asyncio.get_running_loop()
        loops = [EngineLoop(Engine(EngineConfig(model=str(serving_model_dir), num_blocks=64, kv_cache_dtype=fmt)),
                             aio) for fmt in ("kivi2", "kivi2", "int8")]
        links = [PoolLink(redis_url, f"quant-{i}", loop.engine, redis_max_bytes=16 << 20)
                 for i, loop in enumerate(loops)]
        (a, b, c), (link_a, link_b, link_c) = loops, links
        try:
            await generate(a, "share", prompt, prefill_only=True)
            await a.acall(a.engine.release, "share")  # registers the residual block (5) too
            await link_a.store_prefix(a, prompt, 0, a.engine.prefix_salt(None))
            await link_a.wait_shared()
            want = await generate(a, "again", prompt)  # reads its own quantized prefix blocks
            # a read stops before block 5, the residual a cold run keeps in full precision, which is
            # recomputed: the same bytes, the same tokens
            assert (await load_prefix(b, link_b, prompt))[0] == 5
            assert await generate(b, "fetched", prompt) == want == (want[0], 80)
            assert (await load_prefix(c, link_c, prompt))[0] == 0  # kivi2 blocks are a miss for an int8 cache
        finally:
            for link in links:
                link.close()
            for loop in loops:
                loop.stop()

    asyncio.run(run())


def test_serve_and_generate_options_select_the_format(tiny, capsys):
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    assert configs_from_args(serve.parse_args([]))[0].engine.kv_cache_dtype == "auto"
    cluster, _ = configs_from_args(serve.parse_args(["--kv-cache-dtype", "kivi2"]))
    assert cluster.engine.kv_cache_dtype == "kivi2"
    cli = argparse.ArgumentParser()
    add_generate_parser(cli.add_subparsers())
    args = cli.parse_args(["generate", "--prompt-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos",
                           "--kv-cache-dtype", "fp8", "--json"])
    assert args.func(args) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
