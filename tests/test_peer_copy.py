"""Prefix copies between two engines over a real gRPC KV transfer server: the copy is exact (the output
equals a cold run), a holder still computing the blocks waits for them, and a push whose blocks do not
continue the taker's chain is refused before anything is placed."""

from __future__ import annotations

import asyncio
import contextlib
import random
from types import SimpleNamespace

import pytest
from test_pool_engine import GREEDY, _engine, _generate

from kvstore.hashing import block_hashes, salt_for
from kvstore.transfer import TransferRejected
from services.engine_loop import EngineLoop
from services.messages import PrefixFetch
from services.peer_copy import PrefixCopier

SECRET = "test-secret"


def handle_of(copier: PrefixCopier) -> SimpleNamespace:
    """What the taker calls on the holder: the shape of a Ray actor handle's ``push_prefix.remote``."""
    return SimpleNamespace(push_prefix=SimpleNamespace(remote=copier.push))


async def take(taker: PrefixCopier, holder: PrefixCopier, prompt: list[int], blocks: int, wait_s: float):
    """The taker's copy of the base model's blocks of ``prompt`` that ``holder`` has (the taker none yet)."""
    salt = taker.engine.prefix_salt(None)
    return await taker.take(prompt, PrefixFetch("a", blocks, wait_s, handle_of(holder), salt), 0, 10.0, salt)


@contextlib.asynccontextmanager
async def holder_and_taker(model_dir):
    aio = asyncio.get_running_loop()
    loops = [EngineLoop(_engine(model_dir), aio) for _ in range(2)]
    holder = PrefixCopier(loops[0].engine, loops[0], SECRET, host=None)  # holders need no server
    taker = PrefixCopier(loops[1].engine, loops[1], SECRET, host="127.0.0.1")
    try:
        yield loops, holder, taker
    finally:
        for loop in loops:
            loop.stop()


def prompt_of(seed: int, n: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


@pytest.mark.timeout(120)
def test_copied_prefix_is_placed_exactly_and_the_output_equals_a_cold_run(serving_model_dir):
    prompt = prompt_of(1)

    async def run():
        async with holder_and_taker(serving_model_dir) as ((a, b), holder, taker):
            cold, _ = await _generate(a, "cold", prompt, GREEDY)  # A computes the prompt: it holds the blocks
            fetched = await take(taker, holder, prompt, 4, 0.0)
            placed = await b.acall(b.engine.insert_cached_blocks, prompt, fetched.tensor, fetched.first_block)
            tokens, cached = await _generate(b, "copied", prompt, GREEDY)
            return cold, fetched, placed, tokens, cached, b.engine.block_size

    cold, fetched, placed, tokens, cached, size = asyncio.run(run())
    usable = (len(prompt) - 1) // size
    # the router knew of 4 blocks; the holder had every usable one and sent them all
    assert fetched.blocks == placed == usable and fetched.counts == (("peer", usable),)
    assert fetched.nbytes == fetched.tensor.numel() * fetched.tensor.element_size() > 0
    assert cached == usable * size and tokens == cold


@pytest.mark.timeout(120)
def test_a_copy_asked_while_the_holder_computes_the_prefix_waits_for_it(serving_model_dir):
    prompt = prompt_of(2, 300)

    async def run():
        async with holder_and_taker(serving_model_dir) as ((a, b), holder, taker):
            computing = asyncio.create_task(_generate(a, "on-a", prompt, GREEDY, prefill_only=True))
            usable = (len(prompt) - 1) // a.engine.block_size
            fetched = await take(taker, holder, prompt, usable, 30.0)
            await computing
            return fetched.blocks, usable

    copied, usable = asyncio.run(run())
    assert copied == usable


@pytest.mark.timeout(120)
def test_blocks_that_do_not_continue_the_takers_chain_are_refused(serving_model_dir):
    prompt, other = prompt_of(3), prompt_of(4)

    async def run():
        async with holder_and_taker(serving_model_dir) as ((a, b), holder, taker):
            await _generate(a, "other", other, GREEDY, prefill_only=True)
            size = b.engine.block_size
            expected = block_hashes(prompt[:len(prompt) // size * size], size, salt_for(b.engine.model_id))
            taker.sink.expect_sized("copy-x", lambda header: taker._destination(header, expected))
            with pytest.raises(TransferRejected, match="do not continue"):
                await holder.push("copy-x", other, 0, 1, taker.address, 0.0, 10.0, salt_for(a.engine.model_id))
            # a holder that no longer has the blocks sends none, and the taker computes them
            missing = await take(taker, holder, prompt, 3, 0.0)
            return missing.blocks, b.engine.cached_prefix_len(prompt)

    copied, cached = asyncio.run(run())
    assert copied == 0 and cached == 0
