"""services.engine_loop.EngineLoop, the engine on its own thread: block events reach the sink only once one
is set (and a command's events before the command returns), layer hooks get the prompts completing in
the step, on the engine thread. No Ray, no Redis."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from test_engine_loop import GREEDY, make_engine, prompt, write_model

from engine.block_events import BlockEvent, BlockStored
from engine.output import RequestOutput
from engine.sampling_params import SamplingParams
from kvstore.hashing import block_hashes, salt_for
from services.engine_loop import EngineLoop

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("engine-thread"))


async def generate(loop: EngineLoop, request_id: str, ids: list[int], prefill_only: bool = False
                   ) -> list[RequestOutput]:
    stream = loop.open_stream(request_id)
    await loop.acall(loop.engine.add_request, request_id, ids, SamplingParams(max_tokens=4, **GREEDY),
                     prefill_only)
    outputs = [await stream.get()]
    while not outputs[-1].finished:
        outputs.append(await stream.get())
    loop.close_stream(request_id)
    return outputs


def test_block_events_reach_the_sink_only_while_one_is_set(model_dir):
    async def main() -> None:
        loop = EngineLoop(make_engine(model_dir), asyncio.get_running_loop())
        salt = salt_for(loop.engine.model_id)
        got: list[BlockEvent] = []
        try:
            await generate(loop, "unseen", prompt(40, seed=1))  # no sink yet: its events are dropped
            loop.set_block_event_sink(got.extend)
            ids = prompt(40, seed=2)
            await generate(loop, "seen", ids)
            assert got == [BlockStored(block_hashes(ids, 16, salt))]
            # a command's events are with the sink by the time the command returns
            fetched = prompt(32, seed=3)
            tensor = await loop.acall(loop.engine.kv_cache.export_blocks, [0, 1])
            assert await loop.acall(loop.engine.insert_cached_blocks, fetched, tensor) == 2
            assert got[1:] == [BlockStored(block_hashes(fetched, 16, salt))]
            loop.set_block_event_sink(None)
            await generate(loop, "unseen-again", prompt(40, seed=4))
            assert len(got) == 2
        finally:
            loop.stop()

    asyncio.run(main())


def test_layer_hooks_get_the_completing_prompts_on_the_engine_thread(model_dir):
    seen: list[tuple[int, dict[str, list[int]], str]] = []

    def hook(layer: int, completing: dict[str, list[int]]) -> None:
        seen.append((layer, dict(completing), threading.current_thread().name))

    async def main() -> None:
        loop = EngineLoop(make_engine(model_dir), asyncio.get_running_loop())
        try:
            loop.add_layer_hook(hook)
            await generate(loop, "p", prompt(20, seed=5), prefill_only=True)
            table = await loop.acall(loop.engine.request_block_ids, "p")
            assert seen == [(0, {"p": table}, "engine-loop"), (1, {"p": table}, "engine-loop")]
            await generate(loop, "d", prompt(20, seed=6))  # a plain request: the hook runs, nothing completes
            assert [(layer, completing) for layer, completing, _ in seen[2:4]] == [(0, {}), (1, {})]
            loop.remove_layer_hook(hook)
            count = len(seen)
            await generate(loop, "after", prompt(20, seed=7))
            assert len(seen) == count
        finally:
            loop.stop()

    asyncio.run(main())
