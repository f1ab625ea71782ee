"""What handing a step's outputs to their streams costs the engine thread, between one step and the next.

The engine runs on its own thread (``services/engine_loop.py``); each step's outputs go to their requests'
streams on the worker's event loop (here asyncio queues, drained as they fill). Waking the loop once per output
(a write to its self-pipe under its lock, what the engine loop did) is measured against ``EngineLoop._deliver``
(one wake-up a step for all of them), in the same run: the engine thread's CPU time per step, for batches of
``--batches`` requests, with the loop thread consuming as a worker's streams do and a ``--step-ms`` pause
standing in for the GPU step. Every output handed out must reach its stream, either way, or the run fails.

    python benchmarks/output_delivery.py --batches 64,256 --json output_delivery.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import format_table, load_average  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.output import RequestOutput  # noqa: E402
from services.engine_loop import EngineLoop  # noqa: E402


def per_step_cpu_us(deliver, sinks: list, steps: int, step_s: float) -> float:
    """The calling thread's CPU time per step, in µs, to hand one output to each of ``sinks``."""
    outputs = [RequestOutput(f"r{i}", 0, [7], False, None, 16, 0) for i in range(len(sinks))]
    cpu = time.thread_time()
    for _ in range(steps):
        deliver(list(zip(sinks, outputs, strict=True)))
        time.sleep(step_s)
    return 1e6 * (time.thread_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=lambda s: [int(n) for n in s.split(",")], default=[64, 256])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=2.0, help="the pause standing in for a GPU step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    # Its engine idles: only _deliver is called here.
    engine_loop = EngineLoop(Engine(EngineConfig(model="tiny", num_blocks=16)), loop)

    drains: list[asyncio.Task] = []  # a worker's streams, taking what arrives
    delivered = [0]  # outputs the streams took: every one handed out must arrive, either way

    async def make_queues(n: int) -> list[asyncio.Queue]:
        queues = [asyncio.Queue() for _ in range(n)]
        drains.extend(asyncio.get_running_loop().create_task(drain(q)) for q in queues)
        return queues

    async def drain(q: asyncio.Queue) -> None:
        while True:
            await q.get()
            delivered[0] += 1

    async def arrived(expected: int) -> int:  # what arrived, given a second to reach ``expected``
        for _ in range(100):
            if delivered[0] >= expected:
                break
            await asyncio.sleep(0.01)
        return delivered[0]

    async def stop_draining() -> None:
        for task in drains:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)

    def one_wakeup_each(items: list) -> None:
        for sink, output in items:
            loop.call_soon_threadsafe(sink, output)

    rows = []
    try:
        for batch in args.batches:
            queues = asyncio.run_coroutine_threadsafe(make_queues(batch), loop).result()
            sinks = [q.put_nowait for q in queues]  # the streams' (EngineLoop.open_stream's)
            each, once = [], []
            for _ in range(args.rounds):  # alternating, so both see the same machine
                each.append(per_step_cpu_us(one_wakeup_each, sinks, args.steps, args.step_ms / 1000))
                once.append(per_step_cpu_us(engine_loop._deliver, sinks, args.steps, args.step_ms / 1000))
            expected = 2 * args.rounds * args.steps * batch
            if (got := asyncio.run_coroutine_threadsafe(arrived(expected), loop).result()) != expected:
                raise SystemExit(f"{got} outputs reached the streams of {expected} handed out")
            delivered[0] = 0
            rows.append({"batch": batch, "one_wakeup_each_us": statistics.median(each),
                         "one_wakeup_a_step_us": statistics.median(once)})
    finally:
        engine_loop.stop()
        asyncio.run_coroutine_threadsafe(stop_draining(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
    print(f"load average {load_average()}; engine-thread CPU per step, medians of {args.rounds} rounds of "
          f"{args.steps} steps")
    print(format_table(["batch", "a wake-up an output (µs)", "one wake-up a step (µs)", "ratio"],
                       [[r["batch"], r["one_wakeup_each_us"], r["one_wakeup_a_step_us"],
                         r["one_wakeup_each_us"] / r["one_wakeup_a_step_us"]] for r in rows]))
    if args.json:
        Path(args.json).write_text(json.dumps({"load_average": load_average(), "step_ms": args.step_ms,
                                               "results": rows}, indent=2))


if __name__ == "__main__":
    main()
