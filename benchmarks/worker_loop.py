"""What a worker's event loop spends per engine step on its requests' streams, beside the engine thread's CPU.

A colocated worker of the built-in tiny model, in this process, decodes ``--batches`` requests at once and
streams them to one gateway feed through its own stream methods (``start_stream``, ``feed``), read here as Ray
passes an actor generator's values: each pickled as Ray does (cloudpickle), then unpickled and decoded as the
gateway's reader does, timed apart (the gateway's CPU, not the worker's). The engine runs on its own thread and
the event loop on this one, sharing the GIL: what the loop spends per step is taken from the engine's next step
wherever the engine needs the GIL (scheduling, sampling, detokenizing: on a GPU, everything but the kernels).
Measured over the decode: each thread's CPU time per engine step, the loop's per request and step, the gateway's
decoding per step, and decoded tokens a second.

    python benchmarks/worker_loop.py --batches 64,256 --json worker_loop.json

The load average is recorded: run it on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402
import torch  # noqa: E402

from benchmarks._report import format_table, load_average  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from services.messages import Role  # noqa: E402
from services.token_feed import decode_batch  # noqa: E402
from services.worker import ColocatedWorker, WorkerSpec  # noqa: E402


def thread_cpu_s(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


async def decode_once(worker: ColocatedWorker, batch: int, tokens: int, tag: str) -> dict:
    """Stream ``batch`` requests of ``tokens`` tokens each through one feed; the threads' CPU per engine step."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    feed = worker.feed(tag)
    first = asyncio.ensure_future(anext(feed))  # the feed is open before any request starts
    await asyncio.sleep(0)
    for i in range(batch):
        request_id = f"{tag}-{i}"
        await worker.start_stream(tag, request_id, (request_id, [(7 * i + j) % 250 + 1 for j in range(16)], params))
    items = decode_batch(await first)
    decoding, ended = set(), 0
    while True:  # the prompts' steps: timing starts once every request decodes (or, a short one, has ended)
        decoding.update(request_id for request_id, _ in items)
        ended += sum(item is None for _, item in items)
        if len(decoding) == batch:
            break
        items = decode_batch(await anext(feed))
    engine_thread = worker.loop._thread.ident
    steps, loop_cpu, engine_cpu = worker.loop.steps, time.thread_time(), thread_cpu_s(engine_thread)
    wall, timed_tokens, gateway_cpu = time.perf_counter(), 0, 0.0
    while ended < batch:
        wire = ray.cloudpickle.dumps(await anext(feed), protocol=5)  # what Ray does with each value the feed yields
        gateway = time.thread_time()
        items = decode_batch(pickle.loads(wire))
        gateway_cpu += time.thread_time() - gateway
        ended += sum(item is None for _, item in items)
        timed_tokens += sum(len(item.token_ids) for _, item in items if item is not None)
    wall = time.perf_counter() - wall
    steps = worker.loop.steps - steps
    loop_us, engine_us = (1e6 * (time.thread_time() - loop_cpu - gateway_cpu) / steps,
                          1e6 * (thread_cpu_s(engine_thread) - engine_cpu) / steps)
    await feed.aclose()
    return {"batch": batch, "steps": steps, "loop_us_per_step": loop_us, "loop_us_per_request_step": loop_us / batch,
            "gateway_decode_us_per_step": 1e6 * gateway_cpu / steps, "engine_us_per_step": engine_us,
            "tokens_per_s": timed_tokens / wall}


async def run(args: argparse.Namespace) -> list[dict]:
    max_batch = max(args.batches)
    blocks = max_batch * ((16 + args.tokens) // 16 + 2)
    spec = WorkerSpec("bench", Role.COLOCATED, EngineConfig(model="tiny", num_blocks=blocks, max_num_seqs=max_batch,
                                                             enable_prefix_caching=False),
                      None, 1, "grpc", True, 16, 0, None, 0, "unused", "unused")
    worker = ColocatedWorker(spec)
    await worker.start()
    rows = []
    try:
        for batch in args.batches:
            rounds = [await decode_once(worker, batch, args.tokens, f"b{batch}-{r}") for r in range(args.rounds)]
            rows.append({"batch": batch, **{key: statistics.median(r[key] for r in rounds) for key in rounds[0]
                                            if key != "batch"}})
    finally:
        worker.loop.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=lambda s: [int(n) for n in s.split(",")], default=[64, 256])
    parser.add_argument("--tokens", type=int, default=32, help="tokens each request decodes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # (the worker asks for its node's id)
    torch.set_num_threads(1)
    try:
        rows = asyncio.run(run(args))
    finally:
        ray.shutdown()
    print(f"load average {load_average()}; medians of {args.rounds} rounds of {args.tokens} tokens a request")
    print(format_table(["batch", "engine steps", "loop µs/step", "loop µs/request-step", "gateway decode µs/step",
                        "engine µs/step", "tok/s"],
                       [[r["batch"], r["steps"], r["loop_us_per_step"], r["loop_us_per_request_step"],
                         r["gateway_decode_us_per_step"], r["engine_us_per_step"], r["tokens_per_s"]] for r in rows]))
    if args.json:
        Path(args.json).write_text(json.dumps({"load_average": load_average(), "tokens": args.tokens,
                                               "results": rows}, indent=2))


if __name__ == "__main__":
    main()
