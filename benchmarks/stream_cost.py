"""What one streamed token costs the gateway's process: through the whole request path (an in-process cluster
of the built-in tiny model, one prefill and one decode worker, requests through ``Dispatcher.generate``, their
tokens on the decode worker's token feed: one Ray object per engine step for all of them), and through a bare
Ray streaming generator per request (a stand-in actor yielding one item a token, nothing else), the transport
the workers streamed on before the token feed: one Ray object per token per request, its cost alone.

    python benchmarks/stream_cost.py --requests 16 --tokens 200 --json stream_cost.json
    python benchmarks/stream_cost.py --requests 64 --tokens 300 --stream-interval 1,4,16 --json stream_cost.json

With ``--stream-interval`` (a list), the whole path is measured once per interval (``--stream-interval N``:
the decode worker sends a stream's tokens N at a time), and the bare generator is not.

The figure is the process's CPU time (every thread, Ray's own included) over the streamed tokens, and the
tokens a second one gateway core could stream at that cost. The load average is recorded: run it on an
otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from benchmarks._report import format_table, load_average  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from services.cluster import Cluster  # noqa: E402
from services.config import ClusterConfig  # noqa: E402
from services.dispatcher import Dispatcher, GenerateRequest  # noqa: E402


@ray.remote(num_cpus=0)
class TokenStandIn:
    """Streams ``tokens`` items a request, one every ``step_s`` (a decode step), as a decode worker yields."""

    async def generate(self, tokens: int, step_s: float):
        for i in range(tokens):
            await asyncio.sleep(step_s)
            yield [i]


async def timed(streams: list) -> tuple[int, float, float]:
    """(tokens, the process's CPU seconds, wall seconds) to drain ``streams`` (async iterators of token lists)."""

    async def drain(stream) -> int:
        return sum([len(tokens) async for tokens in stream])

    cpu, wall = time.process_time(), time.perf_counter()
    tokens = sum(await asyncio.gather(*(drain(s) for s in streams)))
    return tokens, time.process_time() - cpu, time.perf_counter() - wall


async def through_dispatcher(dispatcher: Dispatcher, requests: int, tokens: int, tag: str) -> tuple[int, float, float]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def tokens_of(i: int):
        async for event in dispatcher.generate(GenerateRequest(f"{tag}-{i}", list(range(10 + i, 42 + i)), params)):
            yield event.token_ids

    return await timed([tokens_of(i) for i in range(requests)])


async def through_ray(stand_in, requests: int, tokens: int, step_s: float) -> tuple[int, float, float]:
    async def tokens_of():
        async for ref in stand_in.generate.remote(tokens, step_s):
            yield await ref

    return await timed([tokens_of() for _ in range(requests)])


def row(way: str, tokens: int, cpu: float, wall: float) -> dict:
    return {"way": way, "tokens": tokens, "tokens_per_s": tokens / wall, "gateway_cores": cpu / wall,
            "gateway_cpu_us_per_token": 1e6 * cpu / tokens, "tokens_per_gateway_core_s": tokens / cpu}


async def run(args: argparse.Namespace, stream_interval: int = 1) -> list[dict]:
    # SLOs out of the way: this measures streaming, not admission (a slow 2-core decode batch breaks a TBT SLO).
    cluster = Cluster(ClusterConfig(engine=EngineConfig(model=args.model, num_blocks=2048, max_num_seqs=128),
                                    prefill=1, decode=1, threads_per_worker=1, ttft_slo_s=600.0, tbt_slo_s=600.0,
                                    stream_interval=stream_interval))
    dispatcher = await cluster.start()
    try:
        await through_dispatcher(dispatcher, 4, 16, "warm")
        tokens, cpu, wall = await through_dispatcher(dispatcher, args.requests, args.tokens, "measured")
        if args.stream_interval:
            return [row(f"whole path, --stream-interval {stream_interval}", tokens, cpu, wall)]
        # The stand-in streams at the decode worker's measured pace, so both ways see the same token rate.
        step_s = wall / args.tokens
        stand_in = TokenStandIn.remote()
        await through_ray(stand_in, 2, 4, step_s)
        bare = await through_ray(stand_in, args.requests, args.tokens, step_s)
        return [row("whole path, token feed", tokens, cpu, wall), row("a Ray generator a request, bare", *bare)]
    finally:
        await cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a checkpoint directory or the built-in tiny model")
    parser.add_argument("--requests", type=int, default=16, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=200, help="tokens each request streams")
    parser.add_argument("--stream-interval", type=lambda s: [int(n) for n in s.split(",")], default=None,
                        help="comma-separated intervals to measure the whole path at (no bare generator then)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.stream_interval:
        results = [r for n in args.stream_interval for r in asyncio.run(run(args, n))]
    else:
        results = asyncio.run(run(args))
    report = {"model": args.model, "requests": args.requests, "tokens": args.tokens, "load_average": load_average(),
              "results": results}
    print(f"load average {report['load_average']}; {args.requests} streams of {args.tokens} tokens")
    print(format_table(["way", "tokens/s", "gateway cores", "gateway CPU µs a token", "tokens a gateway core-second"],
                       [[r["way"], r["tokens_per_s"], r["gateway_cores"], r["gateway_cpu_us_per_token"],
                         r["tokens_per_gateway_core_s"]] for r in results]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
