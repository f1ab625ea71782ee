"""Engines sharing prefix KV through the Redis pool tier (the worker's PoolLink), output unchanged."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampler import SamplingParams
from kvstore.hashing import block_hashes, salt_for
from kvstore.pool import hex_of, namespace
from services.engine_loop import EngineLoop
from services.pool_link import PoolLink

pytestmark = pytest.mark.redis

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), num_blocks=256))


async def _generate(loop: EngineLoop, request_id: str, prompt: list[int], params: SamplingParams,
                    prefill_only: bool = False) -> tuple[list[int], int]:
    stream = loop.open_stream(request_id)
    await loop.acall(loop.engine.add_request, request_id, prompt, params, prefill_only)
    tokens, cached = [], 0
    while True:
        out = await stream.get()
        tokens += out.new_token_ids
        cached = out.num_cached_tokens
        if out.finished:
            loop.close_stream(request_id)
            return tokens, cached


@pytest.mark.timeout(120)
def test_prefix_computed_by_engine_a_is_served_by_engine_b_from_redis(redis_url, redis_client,
                                                                        serving_model_dir):
    prompt = [random.Random(1).randrange(3, 250) for _ in range(100)]

    async def run() -> None:
        aio = asyncio.get_running_loop()
        a, b, plain = _engine(serving_model_dir), _engine(serving_model_dir), _engine(serving_model_dir)
        loop_a, loop_b, loop_plain = EngineLoop(a, aio), EngineLoop(b, aio), EngineLoop(plain, aio)
        link_a = PoolLink(redis_url, "engine-a", a, redis_max_bytes=64 << 20)
        link_b = PoolLink(redis_url, "engine-b", b, redis_max_bytes=64 << 20)
        try:
            # A computes the prompt (as a prefill worker does) and shares its blocks.
            await _generate(loop_a, "on-a", prompt, GREEDY, prefill_only=True)
            await link_a.store_request_blocks(loop_a, "on-a")
            await link_a.wait_shared()
            await loop_a.acall(a.release, "on-a")

            placed = await link_b.load_prefix(loop_b, prompt)
            tokens_b, cached_b = await _generate(loop_b, "on-b", prompt, GREEDY)
            tokens_plain, cached_plain = await _generate(loop_plain, "plain", prompt, GREEDY)
        finally:
            for link in (link_a, link_b):
                link.close()
            for loop in (loop_a, loop_b, loop_plain):
                loop.stop()
        assert placed == (len(prompt) - 1) // a.block_size
        assert cached_b == placed * a.block_size > 0 and cached_plain == 0
        assert b.stats().prompt_tokens_computed == len(prompt) - cached_b
        assert tokens_b == tokens_plain

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_corrupted_pool_block_is_a_miss_and_the_prompt_is_recomputed(redis_url, redis_client,
                                                                       serving_model_dir):
    prompt = [random.Random(2).randrange(3, 250) for _ in range(80)]

    async def run() -> None:
        aio = asyncio.get_running_loop()
        a, b = _engine(serving_model_dir), _engine(serving_model_dir)
        loop_a, loop_b = EngineLoop(a, aio), EngineLoop(b, aio)
        link_a = PoolLink(redis_url, "engine-a", a, redis_max_bytes=64 << 20)
        link_b = PoolLink(redis_url, "engine-b", b, redis_max_bytes=64 << 20)
        try:
            expected, _ = await _generate(loop_a, "on-a", prompt, GREEDY, prefill_only=False)
            await _generate(loop_a, "on-a2", prompt, GREEDY, prefill_only=True)
            await link_a.store_request_blocks(loop_a, "on-a2")
            await link_a.wait_shared()
            await loop_a.acall(a.release, "on-a2")
            # Flip one byte in the middle of the first block's stored payload.
            first = block_hashes(prompt, a.block_size, salt_for(a.model_id))[0]
            key = f"{namespace(a.model_id, a.block_size)}p:{hex_of(first)}"
            data = bytearray(redis_client.get(key))
            data[len(data) // 2] ^= 0xFF
            redis_client.set(key, bytes(data))
            placed = await link_b.load_prefix(loop_b, prompt)
            tokens_b, cached_b = await _generate(loop_b, "on-b", prompt, GREEDY)
        finally:
            for link in (link_a, link_b):
                link.close()
            for loop in (loop_a, loop_b):
                loop.stop()
        assert placed == 0 and cached_b == 0
        assert tokens_b == expected

    asyncio.run(run())
