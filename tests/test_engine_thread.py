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
    stream = loop.open_queue(request_id)
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


def test_the_stats_listener_hears_every_step_and_command_and_a_failed_step_with_nothing_after_it(model_dir):
    """``on_stats`` (what wakes the load-board writer) is told on the engine thread each time the stats are
    taken: after each step and each command, and after a step that failed even when no work follows it (the
    step that ends its aborted requests takes them), so the report that says the worker is unhealthy, with
    the failed requests' blocks free, goes out at once."""

    async def main() -> None:
        loop = EngineLoop(make_engine(model_dir), asyncio.get_running_loop())
        told: list[tuple[str, int, str | None]] = []
        loop.on_stats = lambda: told.append((threading.current_thread().name, loop.stats.num_running, loop.failure))
        try:
            outputs = await generate(loop, "ok", prompt(20, seed=1))
            assert len(told) >= 1 + len(outputs)  # the add_request command, then every step
            assert {name for name, _, _ in told} == {"engine-loop"}
            told.clear()

            def failing_run(*args, **kwargs):  # a kernel fault, once the step has scheduled the request
                raise RuntimeError("illegal memory access")

            loop.engine.runner.run = failing_run
            stream = loop.open_queue("doomed")
            await loop.acall(loop.engine.add_request, "doomed", prompt(20, seed=2),
                             SamplingParams(max_tokens=4, **GREEDY))
            await stream.get()  # the step's error
            async with asyncio.timeout(10):
                while not any(failure for _, _, failure in told):
                    await asyncio.sleep(0.01)
            assert told[-1] == ("engine-loop", 0, "RuntimeError: illegal memory access")
        finally:
            loop.stop()

    asyncio.run(main())


class CountingLoop:
    """The event loop, counting the wake-ups the engine thread asks of it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.wakeups = loop, 0

    def call_soon_threadsafe(self, *args):
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(*args)


def test_a_steps_outputs_reach_every_request_with_one_wake_up_of_the_event_loop(model_dir):
    async def main() -> None:
        counting = CountingLoop(asyncio.get_running_loop())
        loop = EngineLoop(make_engine(model_dir), counting)
        try:
            streams = {f"r{i}": loop.open_queue(f"r{i}") for i in range(8)}

            def add_all() -> None:  # one command: the eight decode in the same steps
                for i, request_id in enumerate(streams):
                    loop.engine.add_request(request_id, prompt(10, seed=i), SamplingParams(max_tokens=5, **GREEDY))

            steps = loop.steps
            await loop.acall(add_all)
            outputs = {request_id: [] for request_id in streams}
            async with asyncio.timeout(60):
                for request_id, stream in streams.items():
                    while not (outputs[request_id] and outputs[request_id][-1].finished):
                        outputs[request_id].append(await stream.get())
            assert all(sum(len(o.new_token_ids) for o in outs) == 5 for outs in outputs.values())
            assert counting.wakeups <= loop.steps - steps  # one a step for all eight, not one an output
        finally:
            loop.stop()

    asyncio.run(main())
