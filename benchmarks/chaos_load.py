"""Load and probes for ``benchmarks/chaos.py``: a bounded number of concurrent greedy streaming completions,
each classified as completed, rejected (429 with Retry-After), unavailable (503 with Retry-After), another 5xx,
or lost (anything else: a broken
stream, an error event mid-stream, a stream without its end, another status)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from loadtest.clients import sse_data, sse_lines

PROMPT = "The tide comes in and the tide goes out; between the two, the harbour"


@dataclass
class LoadTally:
    sent: int = 0
    completed: int = 0
    rejected: int = 0  # 429 with Retry-After: the server said no cleanly
    unavailable: int = 0  # 503 with Retry-After: no live worker of a role yet (a replacement is starting)
    server_errors: int = 0
    lost: int = 0
    error_statuses: list[int] = field(default_factory=list)  # each 5xx answer's status code
    ttfts_s: list[float] = field(default_factory=list)  # completed requests' time to first token

    @property
    def in_flight(self) -> int:
        return self.sent - self.completed - self.rejected - self.unavailable - self.server_errors - self.lost

    def p99_ttft_s(self) -> float | None:
        if not self.ttfts_s:
            return None
        ordered = sorted(self.ttfts_s)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _stream(client: httpx.AsyncClient, model: str, max_tokens: int, tally: LoadTally) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    tally.sent += 1
    start, first, finished = time.perf_counter(), None, False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code in (429, 503) and "retry-after" in response.headers:
                tally.rejected += response.status_code == 429
                tally.unavailable += response.status_code == 503
                return
            if response.status_code >= 500:
                tally.server_errors += 1
                tally.error_statuses.append(response.status_code)
                return
            if response.status_code != 200:
                tally.lost += 1
                return
            async for data in sse_data(sse_lines(response.aiter_text())):
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    break
                choice = event["choices"][0]
                if first is None and choice.get("text"):
                    first = time.perf_counter() - start
                finished = finished or bool(choice.get("finish_reason"))
    except (httpx.HTTPError, json.JSONDecodeError):
        finished = False
    if finished:
        tally.completed += 1
        if first is not None:
            tally.ttfts_s.append(first)
    else:
        tally.lost += 1


async def run_load(base_url: str, model: str, requests: int, concurrency: int, max_tokens: int,
                   tally: LoadTally, timeout_s: float = 120.0) -> LoadTally:
    """Send ``requests`` streams into ``tally``, at most ``concurrency`` at once; each bounded by ``timeout_s``."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        async def one() -> None:
            async with gate:
                await _stream(client, model, max_tokens, tally)
        await asyncio.gather(*(one() for _ in range(requests)))
    return tally


async def probe(base_url: str, model: str) -> bool:
    """/health answers 200 and one short request completes."""
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
            if (await client.get("/health")).status_code != 200:
                return False
            tally = LoadTally()
            await _stream(client, model, 4, tally)
            return tally.completed == 1
    except httpx.HTTPError:
        return False


async def time_to_recover(base_url: str, model: str, since: float, limit_s: float = 120.0) -> float | None:
    """Seconds from ``since`` (a perf_counter time) until a probe succeeds; None if not within ``limit_s``."""
    while time.perf_counter() - since < limit_s:
        if await probe(base_url, model):
            return time.perf_counter() - since
        await asyncio.sleep(0.2)
    return None
