"""A gateway slower than its decode worker: does each stream stay current, or fall further behind?

A GPU decode worker steps a batch of 64 every few milliseconds (tens of thousands of tokens a second); one
gateway process turns every token event into a stream chunk at a cost of its own (``benchmarks/stream_cost.py``),
so a gateway can be the slower of the two. A stand-in decode worker (a Ray actor whose "engine" gives every open
request one token each ``--step-ms``, sent on the real token feeds, ``services/token_feed.py``) streams
``--requests`` requests of ``--tokens`` tokens to this process, which reads them as the gateway does: the
worker client's streams (``WorkerClient.decode``), each through a ``Generation`` into chat completion chunks
(``chat_stream``'s SSE text, everything but the socket write).

    python benchmarks/slow_gateway.py --requests 64 --tokens 1000 --step-ms 5 --json slow_gateway.json

Reported: the tokens a second the worker produced and the gateway delivered, each stream's lag (from its
last token's production to its last chunk's arrival: how far behind the reader was by the end), the chunks
each token took, and the gateway process's CPU per token. The load average is recorded: run it on an
otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from benchmarks._report import format_table, load_average  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from services.gateway.generation import Generation  # noqa: E402
from services.gateway.http_streams import chat_stream  # noqa: E402
from services.gateway.responses import ResponseShape  # noqa: E402
from services.messages import Role, TokenEvent, WorkerInfo, WorkerProfile  # noqa: E402
from services.token_feed import FeedServer, TokenFeeds  # noqa: E402
from services.worker_client import WorkerClient  # noqa: E402


@ray.remote(num_cpus=0)
class PacedDecodeWorker(FeedServer):
    """Stands in for a GPU decode worker: every ``step_s`` each open request gets one token (as one batch step
    gives them), sent on the real token feeds by the worker's own stream methods (``FeedServer``)."""

    def __init__(self, step_s: float) -> None:
        self.feeds = TokenFeeds()
        self.step_s = step_s
        self.step: asyncio.Future | None = None  # resolved when the next step is done (None: no clock running)
        self.open = 0  # requests decoding
        self.last_token_at: dict[str, float] = {}  # request -> wall time its last token was produced

    def produced(self) -> dict[str, float]:
        return self.last_token_at

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        while self.open:
            await asyncio.sleep(self.step_s)
            done, self.step = self.step, loop.create_future()
            done.set_result(None)
        self.step = None

    async def generate(self, emit, request_id: str, prompt_ids: list[int], first_token_id: int,
                       params: SamplingParams, index: int, *_) -> None:
        self.open += 1
        if self.step is None:
            self.step = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._steps())
        try:
            for i in range(params.max_tokens):
                await self.step
                last = i == params.max_tokens - 1
                emit(TokenEvent(index, [97 + i % 26], "length" if last else None, len(prompt_ids), 0,
                                text=chr(97 + i % 26)))
            self.last_token_at[request_id] = time.time()
        finally:
            self.open -= 1


def stand_in_client(actor: ray.actor.ActorHandle) -> WorkerClient:
    info = WorkerInfo("stand-in", Role.DECODE, "127.0.0.1", "", "cpu", "bench", 16, 4096, 1, 1, WorkerProfile([], []))
    return WorkerClient(info, actor)


async def stream(client: WorkerClient, request_id: str, tokens: int) -> tuple[int, int, float]:
    """(tokens, chunks, wall time of the last chunk) of one request, read as the gateway streams a chat."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    events = client.decode(request_id, list(range(32)), 0, params, 0, 0, token_timeout_s=600.0)
    gen = Generation(request_id, events, n=1)
    await gen.start()
    chunks = 0
    async for _ in chat_stream(gen, ResponseShape(gen, "bench", chat=True, logprobs=None), False, False).body_iterator:
        chunks += 1
    return gen.usage.completion_tokens, chunks - 2, time.time()  # less the role's opening chunk and [DONE]


async def run(args: argparse.Namespace) -> dict:
    actor = PacedDecodeWorker.remote(args.step_ms / 1000)
    client = stand_in_client(actor)
    await asyncio.gather(*(stream(client, f"warm-{i}", 8) for i in range(4)))
    cpu, start = time.process_time(), time.time()
    results = await asyncio.gather(*(stream(client, f"r{i}", args.tokens) for i in range(args.requests)))
    cpu = time.process_time() - cpu
    produced = await actor.produced.remote()
    await client.close()
    tokens = sum(r[0] for r in results)
    lags = [received - produced[f"r{i}"] for i, (_, _, received) in enumerate(results)]
    produced_s = max(produced[f"r{i}"] for i in range(args.requests)) - start
    delivered_s = max(r[2] for r in results) - start
    return {"tokens": tokens, "produced_tokens_per_s": tokens / produced_s,
            "delivered_tokens_per_s": tokens / delivered_s, "lag_median_s": statistics.median(lags),
            "lag_max_s": max(lags), "chunks_per_token": sum(r[1] for r in results) / tokens,
            "gateway_cores": cpu / delivered_s, "gateway_cpu_us_per_token": 1e6 * cpu / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens each request streams")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the stand-in's decode step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    result = asyncio.run(run(args))
    report = {"requests": args.requests, "tokens": args.tokens, "step_ms": args.step_ms,
              "load_average": load_average(), **result}
    print(f"load average {report['load_average']}; {args.requests} streams of {args.tokens} tokens, "
          f"a step every {args.step_ms} ms")
    print(format_table(["produced tok/s", "delivered tok/s", "lag median s", "lag max s", "chunks a token",
                        "gateway cores", "gateway CPU µs a token"],
                       [[result["produced_tokens_per_s"], result["delivered_tokens_per_s"], result["lag_median_s"],
                         result["lag_max_s"], result["chunks_per_token"], result["gateway_cores"],
                         result["gateway_cpu_us_per_token"]]]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
