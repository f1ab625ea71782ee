"""The run loop: build the workload, send it on schedule, measure, report.

Everything that can be wrong with the input (a bad trace line, a bad option, no model to be found) fails
before the first request goes out. Interrupting a run (Ctrl-C cancels the main task under ``asyncio.run``)
stops sending, marks the requests in flight as failed ("interrupted") and still computes and writes what
was measured.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, replace
from datetime import datetime

from tqdm import tqdm

from loadtest.clients import GrpcClient, OpenAIClient, RequestRecord, first_model
from loadtest.config import OPENAI_BACKENDS, BenchConfig, endpoint_kind, rate_word, result_path
from loadtest.metrics import compute_metrics
from loadtest.plan import Workload, build_workload, chars_per_token
from loadtest.report import detailed, format_table, result_dict, write_json, write_plots
from loadtest.tokens import PromptTokenizer
from loadtest.workloads import ChatSession, RequestSpec

__all__ = ["BenchConfig", "arun_benchmark", "run_benchmark"]


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


def _drive(w: Workload, config: BenchConfig) -> Callable[[_Run], Awaitable[None]]:
    if w.sessions:
        return _sessions(w.sessions, w.starts, config.turns, config.think_time_s)
    return _open_loop(w.specs, w.arrivals)


def make_client(config: BenchConfig) -> OpenAIClient | GrpcClient:
    common = dict(api_key=config.api_key, ignore_eos=config.ignore_eos, temperature=config.temperature,
                  timeout_s=config.timeout_s)
    if config.backend in OPENAI_BACKENDS:
        kind, path = endpoint_kind(config)
        return OpenAIClient(config.base_url, config.model, max_connections=config.max_concurrency, path=path,
                            embeddings=kind == "embeddings", **common)
    if config.backend == "grpc":
        return GrpcClient(config.target, config.model, **common)
    raise ValueError(f"unknown backend {config.backend!r}")


async def _model(config: BenchConfig) -> str:
    """``config.model``, else the server's first model (what vLLM does without --model)."""
    if config.model:
        return config.model
    if config.backend == "grpc":
        raise ValueError("--model is required with --backend grpc: Tidepool's gRPC API lists no models")
    model = await asyncio.to_thread(first_model, config.base_url, config.api_key)
    if config.print_table:
        print(f"No --model given: using the server's first model, {model}")
    return model


def _count_outputs(records: list[RequestRecord], tok: PromptTokenizer) -> None:
    """Output tokens under the tokenizer for answers whose server reported no usage (vLLM does the same)."""
    for rec in records:
        if rec.status == "ok" and not rec.server_usage:
            rec.output_tokens = tok.count(rec.generated_text)


def _setup(config: BenchConfig, tok: PromptTokenizer | None, date: str, num_prompts: int) -> dict:
    """vLLM's result header (backend, model_id, tokenizer_id, request_rate, ...) and how lengths were sized;
    ``num_prompts``: the requests the workload holds (a trace's rows, a chat's users x turns)."""
    if tok:
        sizing = f"tokenizer {tok.name}"
    else:
        sizing = (f"estimated at {chars_per_token(config, tok):g} characters per token (no --tokenizer); "
                  "the server's usage replaces the estimate where it reports one")
    return {"date": date, "backend": config.backend, "label": config.label, "model_id": config.model,
            "tokenizer_id": config.tokenizer, "dataset_name": config.workload, "num_prompts": num_prompts,
            "request_rate": rate_word(config), "burstiness": config.burstiness,
            "max_concurrency": config.max_concurrency, "prompt_lengths": sizing}


async def arun_benchmark(config: BenchConfig) -> dict:
    """Run one benchmark and return the result dict (also written to the result file / ``plot_dir``)."""
    tok = PromptTokenizer.load(config.tokenizer) if config.tokenizer else None
    run_id = uuid.uuid4().hex[:8]
    workload = build_workload(config, tok, id_prefix=f"bench-{run_id}-")
    config = replace(config, model=await _model(config))
    run = _Run(make_client(config), workload.total, config.max_concurrency, config.progress)
    start = time.perf_counter()
    interrupted = False
    try:
        await _drive(workload, config)(run)
    except asyncio.CancelledError:
        interrupted = True
        for task in run.tasks:
            task.cancel()
        await asyncio.gather(*run.tasks, return_exceptions=True)
    finally:
        duration = time.perf_counter() - start
        run.pbar.close()
        await run.client.aclose()

    if tok:
        _count_outputs(run.records, tok)
    metrics = compute_metrics(run.records, duration, config.percentiles, config.goodput)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")  # vLLM's format, also the file name's
    result = {
        **_setup(config, tok, date, workload.total), "run_id": run_id, "interrupted": interrupted, "planned": workload.total,
        **result_dict(metrics), "error_samples": sorted({r.error for r in run.records if r.error})[:5],
        "config": {k: v for k, v in asdict(config).items() if k != "api_key"},
    }
    if config.save_detailed:
        result.update(detailed(run.records))
    if config.print_table:
        print(format_table(metrics, request_rate=config.request_rate, max_concurrency=config.max_concurrency,
                           sections=config.percentile_metrics))
        if not tok:
            print(f"Note: prompt lengths {result['prompt_lengths']}.")
    if path := result_path(config, config.model, date):
        write_json(path, result)
        if config.print_table:
            print(f"Results written to {path}")
    if config.plot_dir:
        write_plots(config.plot_dir, run.records, start)
    return result


def run_benchmark(config: BenchConfig) -> dict:
    """Synchronous entry point (CLI and tests): ``asyncio.run`` turns Ctrl-C into a graceful stop."""
    return asyncio.run(arun_benchmark(config))
