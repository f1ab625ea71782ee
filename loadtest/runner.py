"""The run loop: build the workload, send it on schedule, measure, report.

Everything that can be wrong with the input (a bad trace line, a bad option) fails before the first
request goes out. Interrupting a run (Ctrl-C cancels the main task under ``asyncio.run``) stops sending,
marks the requests in flight as failed ("interrupted") and still computes and writes what was measured.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from datetime import datetime

from tqdm import tqdm

from loadtest.arrivals import synthetic_arrivals, trace_arrivals
from loadtest.clients import GrpcClient, OpenAIClient, RequestRecord
from loadtest.metrics import compute_metrics
from loadtest.report import detailed, format_table, result_dict, write_json, write_plots
from loadtest.workloads import ChatSession, RequestSpec, chat_sessions, mooncake_requests, random_requests
from router.trace import load_trace


@dataclass
class BenchConfig:
    model: str
    backend: str = "openai"  # "openai" (any OpenAI-compatible server) | "grpc" (Tidepool's Serving)
    base_url: str = "http://127.0.0.1:8000"
    target: str = "127.0.0.1:50051"
    workload: str = "random"  # "mooncake" | "chat" | "random"
    endpoint: str | None = None  # "chat" | "completions"; None: chat for the chat workload, else completions
    # mooncake
    trace: str | None = None
    time_scale: float = 1.0
    length_scale: float = 1.0
    max_requests: int | None = None
    # chat
    num_users: int = 8
    turns: int = 4
    think_time_s: float = 1.0
    use_session: bool = True
    # random (input/output/prefix lengths are also chat's per-turn message, answer and system prompt)
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prompts: int = 1000
    chars_per_token: float = 1.0
    # arrivals: request_rate None = the trace's timestamps (mooncake) or everything at once
    request_rate: float | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    # requests
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    timeout_s: float = 6 * 3600
    seed: int = 0
    # output
    goodput: dict[str, float] = field(default_factory=dict)
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    result_json: str | None = None
    plot_dir: str | None = None
    save_detailed: bool = False
    progress: bool = True
    print_table: bool = True


class _Run:
    """Sends requests through one client under the concurrency cap and keeps every record, in send order."""

    def __init__(self, client: OpenAIClient | GrpcClient, total: int, max_concurrency: int | None,
                 progress: bool):
        self.client = client
        self.records: list[RequestRecord] = []
        self.tasks: list[asyncio.Task] = []
        self._limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.pbar = tqdm(total=total, disable=not progress, unit="req")

    async def send(self, spec: RequestSpec) -> RequestRecord:
        if self._limit:
            async with self._limit:
                return await self._send(spec)
        return await self._send(spec)

    async def _send(self, spec: RequestSpec) -> RequestRecord:
        rec = RequestRecord(spec.request_id, prompt_tokens=spec.prompt_len)
        self.records.append(rec)  # sent from here on: it will be counted, however it ends
        try:
            await self.client.send(spec, rec)
        except asyncio.CancelledError:
            rec.fail("interrupted")
            raise
        except Exception as e:  # a client bug must cost one request, not the run's results
            rec.fail(f"{type(e).__name__}: {e}")
        finally:
            rec.end_s = time.perf_counter()
            self.pbar.update(1)
        return rec

    def spawn(self, coro: Coroutine) -> None:
        self.tasks.append(asyncio.create_task(coro))


def _open_loop(specs: list[RequestSpec], arrivals: list[float]) -> Callable[[_Run], Awaitable[None]]:
    async def drive(run: _Run) -> None:
        t0 = time.perf_counter()
        for i in sorted(range(len(specs)), key=arrivals.__getitem__):
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            run.spawn(run.send(specs[i]))
        await asyncio.gather(*run.tasks)
    return drive


def _sessions(sessions: list[ChatSession], starts: list[float], turns: int,
              think_time_s: float) -> Callable[[_Run], Awaitable[None]]:
    async def user(run: _Run, session: ChatSession, start: float, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
        for turn in range(turns):
            if turn:
                await asyncio.sleep(think_time_s)
            rec = await run.send(session.request(turn))
            if rec.status != "ok":  # the conversation cannot go on without its answer
                run.pbar.total -= turns - turn - 1
                run.pbar.refresh()
                return
            session.add_reply(rec.generated_text)

    async def drive(run: _Run) -> None:
        t0 = time.perf_counter()
        for session, start in zip(sessions, starts, strict=True):
            run.spawn(user(run, session, start, t0))
        await asyncio.gather(*run.tasks)
    return drive


def plan(config: BenchConfig, id_prefix: str = "") -> tuple[int, Callable[[_Run], Awaitable[None]]]:
    """(number of requests, the coroutine that sends them); raises on bad input before anything is sent."""
    for name in ("length_scale", "chars_per_token", "timeout_s"):
        if not getattr(config, name) > 0:
            raise ValueError(f"{name} must be positive, got {getattr(config, name)}")
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {config.max_concurrency}")
    rate = math.inf if config.request_rate is None else config.request_rate
    endpoint = config.endpoint or ("chat" if config.workload == "chat" else "completions")
    if endpoint not in ("chat", "completions"):
        raise ValueError(f"unknown endpoint {endpoint!r}")
    if config.workload == "chat":
        if endpoint != "chat":
            raise ValueError("the chat workload needs the chat endpoint")
        sessions = chat_sessions(
            config.num_users, config.turns, input_len=config.input_len, output_len=config.output_len,
            prefix_len=config.prefix_len, seed=config.seed, chars_per_token=config.chars_per_token,
            use_session=config.use_session, id_prefix=id_prefix)
        starts = synthetic_arrivals(config.num_users, rate, config.burstiness, config.seed)
        return config.num_users * config.turns, _sessions(sessions, starts, config.turns, config.think_time_s)
    if config.workload == "mooncake":
        if not config.trace:
            raise ValueError("the mooncake workload needs --trace FILE")
        rows = load_trace(config.trace, config.max_requests)
        specs = mooncake_requests(rows, seed=config.seed, length_scale=config.length_scale,
                                  chars_per_token=config.chars_per_token, id_prefix=id_prefix)
        arrivals = (trace_arrivals(rows, config.time_scale) if config.request_rate is None
                    else synthetic_arrivals(len(specs), rate, config.burstiness, config.seed))
    elif config.workload == "random":
        specs = random_requests(
            config.num_prompts, input_len=config.input_len, output_len=config.output_len,
            range_ratio=config.range_ratio, prefix_len=config.prefix_len, seed=config.seed,
            chars_per_token=config.chars_per_token, id_prefix=id_prefix)
        arrivals = synthetic_arrivals(len(specs), rate, config.burstiness, config.seed)
    else:
        raise ValueError(f"unknown workload {config.workload!r}")
    if endpoint == "chat":
        for spec in specs:
            spec.messages = [{"role": "user", "content": spec.prompt}]
    return len(specs), _open_loop(specs, arrivals)


def make_client(config: BenchConfig) -> OpenAIClient | GrpcClient:
    common = dict(api_key=config.api_key, ignore_eos=config.ignore_eos, temperature=config.temperature,
                  timeout_s=config.timeout_s)
    if config.backend == "openai":
        return OpenAIClient(config.base_url, config.model, max_connections=config.max_concurrency, **common)
    if config.backend == "grpc":
        return GrpcClient(config.target, config.model, **common)
    raise ValueError(f"unknown backend {config.backend!r}")


async def arun_benchmark(config: BenchConfig) -> dict:
    """Run one benchmark and return the result dict (also written to ``result_json`` / ``plot_dir``)."""
    run_id = uuid.uuid4().hex[:8]
    total, drive = plan(config, id_prefix=f"bench-{run_id}-")
    run = _Run(make_client(config), total, config.max_concurrency, config.progress)
    start = time.perf_counter()
    interrupted = False
    try:
        await drive(run)
    except asyncio.CancelledError:
        interrupted = True
        for task in run.tasks:
            task.cancel()
        await asyncio.gather(*run.tasks, return_exceptions=True)
    finally:
        duration = time.perf_counter() - start
        run.pbar.close()
        await run.client.aclose()

    metrics = compute_metrics(run.records, duration, config.percentiles, config.goodput)
    result = {
        "date": datetime.now().isoformat(timespec="seconds"), "run_id": run_id, "interrupted": interrupted,
        "planned": total, **result_dict(metrics),
        "error_samples": sorted({r.error for r in run.records if r.error})[:5],
        "config": {k: v for k, v in asdict(config).items() if k != "api_key"},
    }
    if config.save_detailed:
        result.update(detailed(run.records))
    if config.print_table:
        print(format_table(metrics, request_rate=config.request_rate, max_concurrency=config.max_concurrency,
                           sections=config.percentile_metrics))
    if config.result_json:
        write_json(config.result_json, result)
    if config.plot_dir:
        write_plots(config.plot_dir, run.records, start)
    return result


def run_benchmark(config: BenchConfig) -> dict:
    """Synchronous entry point (CLI and tests): ``asyncio.run`` turns Ctrl-C into a graceful stop."""
    return asyncio.run(arun_benchmark(config))
