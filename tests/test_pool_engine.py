"""Engines sharing prefix KV through the Redis pool tier (the worker's PoolLink), output unchanged; their
block events reach the pool index through the engine loop's sink."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from kvstore.hashing import block_hashes, salt_for
from kvstore.pool import hex_of, namespace
from services.engine_loop import EngineLoop
from services.pool_link import PoolLink

pytestmark = pytest.mark.redis

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), num_blocks=256, enable_block_events=True))


async def _generate(loop: EngineLoop, request_id: str, prompt: list[int], params: SamplingParams,
                    prefill_only: bool = False, lora: str | None = None) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one request on the engine thread (``lora``: its adapter)."""
    stream = loop.open_queue(request_id)
    await loop.acall(loop.engine.add_request, request_id, prompt, params, prefill_only, (), None, lora)
    tokens, cached = [], 0
    while True:
        out = await stream.get()
        tokens += out.new_token_ids
        cached = out.num_cached_tokens
        if out.finished:
            loop.close_stream(request_id)
            return tokens, cached


@contextlib.asynccontextmanager
async def _two_engines_on_the_pool(model_dir, redis_url):
    """Engines A and B, each on its engine thread and linked to the same Redis pool."""
    aio = asyncio.get_running_loop()
    loops = [EngineLoop(_engine(model_dir), aio) for _ in range(2)]
    links = [PoolLink(redis_url, f"engine-{name}", loop.engine, redis_max_bytes=64 << 20)
             for name, loop in zip("ab", loops, strict=True)]
    for loop, link in zip(loops, links, strict=True):
        loop.set_block_event_sink(link.publish)  # as the worker wires them
    try:
        yield loops, links
    finally:
        for link in links:
            link.close()
        for loop in loops:
            loop.stop()


async def load_prefix(loop: EngineLoop, link: PoolLink, prompt: list[int]) -> tuple[int, dict[str, int]]:
    """Read the prompt's missing prefix blocks from the pool and place them, as a worker admitting it does:
    (blocks placed, blocks read per tier)."""
    salt = loop.engine.prefix_salt(None, len(prompt))
    have = await loop.acall(loop.engine.cached_prefix_len, prompt, salt) // loop.engine.block_size
    fetched = await link.read_prefix(prompt, have, salt)
    if fetched.tensor is None:
        return 0, {}
    placed = await loop.acall(loop.engine.insert_cached_blocks, prompt, fetched.tensor, fetched.first_block, salt)
    return placed, dict(fetched.counts)


async def _compute_and_share(loop: EngineLoop, link: PoolLink, request_id: str, prompt: list[int]) -> None:
    """Compute the prompt as a prefill worker does, share its blocks through the pool, release them."""
    await _generate(loop, request_id, prompt, GREEDY, prefill_only=True)
    await link.store_prefix(loop, prompt, 0, loop.engine.prefix_salt(None, len(prompt)))
    await link.wait_shared()
    await loop.acall(loop.engine.release, request_id)


@pytest.mark.timeout(120)
def test_prefix_computed_by_engine_a_is_served_by_engine_b_from_redis(redis_url, redis_client,
                                                                        serving_model_dir):
    prompt = random.Random(1).choices(range(3, 250), k=100)

    async def run() -> None:
        async with _two_engines_on_the_pool(serving_model_dir, redis_url) as ((loop_a, loop_b), (link_a, link_b)):
            tokens_plain, cached_plain = await _generate(loop_a, "plain", prompt, GREEDY)
            await _compute_and_share(loop_a, link_a, "on-a", prompt)
            placed, _ = await load_prefix(loop_b, link_b, prompt)
            tokens_b, cached_b = await _generate(loop_b, "on-b", prompt, GREEDY)
            engine = loop_a.engine
            hashes = block_hashes(prompt, engine.block_size, salt_for(engine.model_id))
            assert link_a.publisher.flush() and link_b.publisher.flush()
            holders = link_a.pool.longest_prefix(hashes)
        block_size = loop_b.engine.block_size
        assert placed == (len(prompt) - 1) // block_size
        # A computed every full block of the prompt; B placed all of them from the pool tier
        assert holders["engine-a"] == holders["engine-b"] == len(hashes) == placed
        assert cached_b == placed * block_size > 0 and cached_plain == 0
        assert loop_b.engine.stats().prompt_tokens_computed == len(prompt) - cached_b
        assert tokens_b == tokens_plain

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_corrupted_pool_block_is_a_miss_and_the_prompt_is_recomputed(redis_url, redis_client,
                                                                       serving_model_dir):
    prompt = random.Random(2).choices(range(3, 250), k=80)

    async def run() -> None:
        async with _two_engines_on_the_pool(serving_model_dir, redis_url) as ((loop_a, loop_b), (link_a, link_b)):
            expected, _ = await _generate(loop_a, "on-a", prompt, GREEDY)
            await _compute_and_share(loop_a, link_a, "on-a2", prompt)
            # Flip one byte in the middle of the first block's stored payload.
            a = loop_a.engine
            first = block_hashes(prompt, a.block_size, salt_for(a.model_id))[0]
            key = f"{namespace(a.model_id, a.block_size)}p:{hex_of(first)}"
            data = bytearray(redis_client.get(key))
            data[len(data) // 2] ^= 0xFF
            redis_client.set(key, bytes(data))
            placed, _ = await load_prefix(loop_b, link_b, prompt)
            tokens_b, cached_b = await _generate(loop_b, "on-b", prompt, GREEDY)
        assert placed == 0 and cached_b == 0
        assert tokens_b == expected

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_a_longrope_prompts_blocks_reach_another_engine_under_the_long_salt_only(redis_url, tmp_path):
    """A prompt past LongRoPE's original context rotates every key with the long factors: its blocks go through
    the pool under a salt of their own, where another engine's long prompt with that prefix takes them and
    answers as transformers does, while a short prompt of the same tokens finds none."""
    import torch
    from test_engine_model import build_hf_checkpoint, longrope, prompts

    hf = build_hf_checkpoint(tmp_path, "phi3", **longrope())  # original context: 32 positions
    (long,) = prompts((50,))
    longer = long[:48] + prompts((6,))[0]  # the same first three blocks of 16

    async def run() -> tuple[int, list[int], int, int]:
        aio = asyncio.get_running_loop()
        loops = [EngineLoop(Engine(EngineConfig(model=str(tmp_path), num_blocks=64, enable_block_events=True)), aio)
                 for _ in range(2)]
        links = [PoolLink(redis_url, f"longrope-{i}", lp.engine, redis_max_bytes=16 << 20)
                 for i, lp in enumerate(loops)]
        try:
            await _compute_and_share(loops[0], links[0], "long", long)
            short = await links[1].read_prefix(long[:31], 0, loops[1].engine.prefix_salt(None, 31))
            placed, _ = await load_prefix(loops[1], links[1], longer)
            tokens, cached = await _generate(loops[1], "longer", longer, GREEDY)
            return (0 if short.tensor is None else short.blocks), tokens, cached, placed
        finally:
            for link in links:
                link.close()
            for loop in loops:
                loop.stop()

    short_blocks, tokens, cached, placed = asyncio.run(run())
    assert short_blocks == 0 and placed == 3 and cached == 48
    with torch.no_grad():
        want = hf.generate(torch.tensor([longer]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
    assert tokens == want[0, len(longer):].tolist()
