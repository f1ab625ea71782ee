"""The path of one request through the cluster: route, reserve, prefill + transfer, stream decode.

The gateway hands a tokenized request to ``Dispatcher.generate``; the dispatcher asks the conductor for a
prefill/decode pair (or rejects early), has the decode worker reserve blocks (a lease with a deadline),
has the prefill worker compute the prompt and push its KV into that lease, then streams the decode
worker's tokens. Workers are reached through typed clients (``services/worker_client.py``), so this file
holds no Ray calls. Every step has a deadline; whatever fails or is cancelled frees both sides' blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from kvstore.hashing import block_hashes, salt_for
from router.conductor import Conductor, Decision, Reject, RouteRequest, WorkerLoad
from services.errors import NoWorkersError, PromptTooLongError, RequestRejected, WorkerDiedError
from services.messages import Role, TokenEvent
from services.metrics import Metrics
from services.worker_client import WorkerClient

log = logging.getLogger(__name__)

_LOAD_REFRESH_S = 0.05
_LOAD_TIMEOUT_S = 10.0


@dataclass
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Deadlines:
    reserve_s: float = 10.0
    prefill_s: float = 120.0  # queueing + compute + transfer of the prompt
    lease_s: float = 150.0  # a decode reservation that is never filled is freed after this


class Dispatcher:
    def __init__(
        self,
        workers: list[WorkerClient],
        conductor: Conductor,
        index: object,  # PoolMirror: longest_prefix(hashes) -> {holder: blocks}
        tokenizer: Tokenizer,
        metrics: Metrics,
        kv_transport: str,
        redis_url: str = "",
        deadlines: Deadlines | None = None,
    ) -> None:
        self.workers = {w.worker_id: w for w in workers}
        first = workers[0].info
        self.model_id = first.model_id
        self.block_size = first.block_size
        self.max_model_len = first.max_model_len
        self.conductor = conductor
        self.index = index
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.kv_transport = kv_transport
        self.redis_url = redis_url
        self.rejections = 0
        self.deadlines = deadlines or Deadlines()
        self._salt = salt_for(self.model_id)
        self._loads: dict[str, WorkerLoad] = {}
        self._refresher: asyncio.Task | None = None

    # ---- worker state -------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh_loads()
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(_LOAD_REFRESH_S)
            try:
                await self.refresh_loads()
            except Exception:  # the refresher must outlive any one bad report
                log.exception("load refresh failed")

    async def refresh_loads(self) -> None:
        workers = list(self.workers.values())
        results = await asyncio.gather(*(w.load(_LOAD_TIMEOUT_S) for w in workers), return_exceptions=True)
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, WorkerLoad):
                previous = self._loads.get(worker.worker_id)
                if (worker.role == Role.DECODE and previous is not None and result.steps > previous.steps
                        and result.num_running):
                    # A decode worker's steps are decode-only: measured TBT points refit the estimator.
                    self.conductor.observe_decode_step(worker.worker_id, result.num_running,
                                                       result.running_context_tokens, result.last_step_s)
                self._loads[worker.worker_id] = result
                self.metrics.set_worker_load(result)
            elif isinstance(result, WorkerDiedError):
                self._mark_dead(worker.worker_id)
            else:
                log.warning("no load report from %s: %s", worker.worker_id, result)

    def _mark_dead(self, worker_id: str) -> None:
        load = self._loads.get(worker_id)
        if load is not None and load.alive:
            log.warning("worker %s is dead", worker_id)
            self._loads[worker_id] = dataclasses.replace(load, alive=False)
            self.metrics.set_worker_load(self._loads[worker_id])

    def alive_workers(self) -> int:
        return sum(1 for load in self._loads.values() if load.alive)

    async def worker_stats(self) -> list[dict]:
        """One JSON row per worker, for ``/status`` and ``tidepool status``."""
        out = []
        for worker in self.workers.values():
            load = self._loads.get(worker.worker_id)
            out.append({
                "id": worker.worker_id, "role": str(worker.role), "alive": bool(load and load.alive),
                "node": worker.info.node, "device": worker.info.device,
                "free_blocks": load.free_blocks if load else 0, "total_blocks": load.total_blocks if load else 0,
                "waiting": len(load.queued_prefills) if load else 0, "running": load.num_running if load else 0,
            })
        return out

    async def cluster_status(self) -> dict:
        """What ``tidepool status`` shows: the workers, the pool's Redis and the router."""
        url = urlsplit(self.redis_url)
        shown = url._replace(netloc=f"***@{url.hostname}:{url.port}") if url.password else url
        return {
            "model": self.model_id, "policy": self.conductor.policy_name, "kv_transport": self.kv_transport,
            "redis": {"url": urlunsplit(shown), "up": bool(self.index.pool.up),
                      "indexed_blocks": self.index.indexed_blocks},
            "router": {"policy": self.conductor.policy_name, "rejections": self.rejections},
            "workers": await self.worker_stats(),
        }

    # ---- one request ----------------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Yield the request's token events; n > 1 runs n sub-requests whose events interleave."""
        req.params.validate()
        if not req.prompt_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if len(req.prompt_ids) + req.params.max_tokens > self.max_model_len:
            raise PromptTooLongError(len(req.prompt_ids) + req.params.max_tokens, self.max_model_len)
        if self.alive_workers() == 0:
            raise NoWorkersError("no worker is alive")
        if req.params.n == 1:
            async for event in self._generate_one(req.request_id, req.prompt_ids, req.params, 0):
                yield event
            return
        async for event in self._generate_fanout(req):
            yield event

    async def _generate_fanout(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        # Each choice is its own request (seed + i keeps seeded runs reproducible); the prompt's blocks are
        # computed once and hit the prefix cache for the others.
        streams = []
        for i in range(req.params.n):
            seed = None if req.params.seed is None else req.params.seed + i
            params = dataclasses.replace(req.params, n=1, seed=seed)
            streams.append(self._generate_one(f"{req.request_id}-{i}", req.prompt_ids, params, i))
        # Route every choice before yielding, so a rejection surfaces before the first event.
        firsts = [await anext(s) for s in streams]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(stream: AsyncIterator[TokenEvent]) -> None:
            try:
                async for event in stream:
                    await queue.put(event)
                await queue.put(None)
            except BaseException as exc:
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(s)) for s in streams]
        try:
            for event in firsts:
                yield event
            pending = len(tasks)  # every pump sends an end marker, even for a stream already finished
            while pending:
                item = await queue.get()
                if item is None:
                    pending -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                await stream.aclose()

    async def _generate_one(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int
    ) -> AsyncIterator[TokenEvent]:
        hashes = block_hashes(prompt_ids, self.block_size, self._salt)
        route_req = RouteRequest(request_id, len(prompt_ids), hashes, params.max_tokens)
        started = time.monotonic()
        excluded: set[str] = set()
        while True:
            decision = self._route(route_req, excluded)
            if decision.prefill == decision.decode:
                stream = self._run_colocated(decision, request_id, prompt_ids, params, index)
            else:
                stream = self._run_disaggregated(decision, request_id, prompt_ids, params, index)
            first_time = last_time = None
            count = 0
            try:
                async for event in stream:
                    now = time.monotonic()
                    if first_time is None:
                        first_time = now
                        self.metrics.observe_ttft(now - started)
                        self.metrics.add_cached_tokens(event.num_cached_tokens)
                    last_time = now
                    count += len(event.token_ids)
                    yield event
            except WorkerDiedError as exc:
                self._mark_dead(exc.worker_id)
                # Only before the first token: nothing has reached the client yet.
                if first_time is not None or exc.worker_id in excluded:
                    raise
                excluded.add(exc.worker_id)
                log.warning("request %s: %s; routing again", request_id, exc)
                continue
            finally:
                await stream.aclose()
            if count > 1 and first_time is not None and last_time is not None:
                self.metrics.observe_tpot((last_time - first_time) / (count - 1))
            return

    def _route(self, route_req: RouteRequest, excluded: set[str]) -> Decision:
        loads = list(self._loads.values())
        if excluded:  # workers that failed this request are out for its retry
            loads = [dataclasses.replace(ld, alive=False) if ld.worker_id in excluded else ld for ld in loads]
        if not any(load.alive for load in loads):
            raise NoWorkersError("no worker is alive")
        decision = self.conductor.route(route_req, loads, self.index)
        if isinstance(decision, Reject):
            self.rejections += 1
            self.metrics.inc_rejection(decision.reason)
            raise RequestRejected(decision.reason, decision.retry_after_s)
        return decision

    async def _run_colocated(
        self, decision: Decision, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int
    ) -> AsyncIterator[TokenEvent]:
        worker = self.workers[decision.prefill]
        async for event in worker.generate(request_id, prompt_ids, params, index, decision.fetch_from):
            yield event

    async def _run_disaggregated(
        self, decision: Decision, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int
    ) -> AsyncIterator[TokenEvent]:
        prefill = self.workers[decision.prefill]
        decode = self.workers[decision.decode]
        await decode.reserve(request_id, len(prompt_ids), self.deadlines.lease_s, self.deadlines.reserve_s)
        handed_off = completed = False
        try:
            result = await prefill.prefill(request_id, prompt_ids, params, decode.info.kv_target,
                                           decision.fetch_from, self.deadlines.prefill_s)
            if result.transport:
                self.metrics.observe_transfer(result.transport, result.transfer_bytes, result.transfer_s)
            first = TokenEvent(index, [result.first_token_id], result.finish_reason, len(prompt_ids),
                               result.num_cached_tokens, result.text)
            if result.finish_reason is not None:
                yield first
                return
            stream = decode.decode(request_id, prompt_ids, result.first_token_id, params, index,
                                   result.num_cached_tokens)
            handed_off = True
            yield first
            async for event in stream:
                yield event
            completed = True
        finally:
            if not handed_off:
                # The lease is freed whether or not the KV arrived; the prefill side cleans itself up.
                await decode.release(request_id)
                await prefill.abort(request_id)
            elif not completed:
                # The consumer left, possibly before the decode stream was first read (then its own
                # cleanup never ran): stop the decode request.
                await stream.aclose()
                await decode.abort(request_id)
