"""The path of one request through the cluster: route, reserve, prefill + transfer, stream decode.

The gateway hands a tokenized request to ``Dispatcher.generate``; the dispatcher asks the conductor for a
prefill/decode pair (or rejects early), has the decode worker reserve blocks (a lease with a deadline),
has the prefill worker compute the prompt and push its KV into that lease, then streams the decode
worker's tokens (``services/attempt.py``); workers are reached through typed clients, so this file holds
no Ray calls. Every step has a deadline; whatever fails or is cancelled frees both sides' blocks. A
request whose workers fail is resumed on a live pair (a replacement, if need be) after its streamed tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import long_rope_applies
from engine.errors import InvalidRequestError
from engine.generation_defaults import GenerationDefaults
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from kvstore.hashing import block_hashes, salt_for
from router.conductor import Conductor, Decision, Reject, RouteRequest, WorkerLoad
from router.loads import DECODE_ROLES, PREFILL_ROLES
from services.attempt import Attempt, Deadlines, Progress, resumable, run_colocated, run_disaggregated
from services.background import cancel_and_wait, cancel_requested
from services.errors import (
    NoWorkersError,
    PromptTooLongError,
    RequestRejected,
    WorkerDiedError,
    WorkerLostError,
)
from services.fanout import interleave
from services.in_flight import InFlight
from services.load_reports import LoadBoard
from services.messages import EmbeddingResult, PrefillResult, TokenEvent
from services.metrics import Metrics
from services.prefix_copies import PrefixCopies
from services.request_metrics import RequestTracker
from services.worker_client import WorkerClient

log = logging.getLogger(__name__)

# The workers write their load reports on the load board (services/load_reports.py), which the dispatcher reads
# this often while requests run and for _BUSY_TAIL_S after the last ends (its blocks come back just after its
# stream ends); idle, only every _IDLE_LOAD_REFRESH_S, and a request that arrives wakes it at once. It asks a
# worker for its report only when the worker wrote none for _SILENCE_S (four heartbeats: it died, and the call
# finds that out), and asks every worker while there is no board to read. Each ask is a Ray call: asking every
# worker 20 times a second, an idle cluster of 2 workers kept a core 14% busy.
_LOAD_REFRESH_S = 0.05
_BUSY_TAIL_S = 2.0
_IDLE_LOAD_REFRESH_S = 0.5
_SILENCE_S = 1.0
_LOAD_TIMEOUT_S = 10.0
_RESUME_LOAD_TIMEOUT_S = 1.0  # a resumed request does not wait long on a stalled worker's report
_MAX_ATTEMPTS = 4  # a request is resumed at most 3 times


@dataclass
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is served first among the prompts waiting on a worker (vLLM's request priority)
    lora: str | None = None  # the LoRA adapter it runs with (one of ``Dispatcher.loras``); None: the base model


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
        generation_defaults: GenerationDefaults | None = None,
        served_model_names: tuple[str, ...] = (),
        load_board: LoadBoard | None = None,
    ) -> None:
        self.workers = {w.worker_id: w for w in workers}
        first = workers[0].info
        self.model_id = first.model_id  # the checkpoint's: it salts the prefix hashes, whatever the API calls it
        # the names requests may give the model (--served-model-name; default: its id), the first the cards'
        self.served_model_names = served_model_names or (self.model_id,)
        self.block_size = first.block_size
        self.max_model_len, self.max_kv_tokens = first.max_model_len, first.max_kv_tokens
        self.long_rope_from, self.quantized_at_load = first.long_rope_from, first.quantized_at_load
        # what embedding requests need to know of the model (engine/pooling.py), and whether it generates at all
        self.hidden_size, self.pooling, self.generates = first.hidden_size, first.pooling, first.generates
        # the LoRA adapters every worker serves: name -> adapter id (services/lora_updates.py changes it)
        self.loras = dict(first.loras)
        self.conductor = conductor
        self.index = index
        self.tokenizer = tokenizer
        # the model's sampling defaults (generation_config.json), which the gateways apply to requests
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self.metrics = metrics
        self.kv_transport = kv_transport
        self.redis_url = redis_url
        self.rejections = 0
        self.resumed = 0  # requests continued on another pair after streaming some tokens
        self.deadlines = deadlines or Deadlines()
        self.copies = PrefixCopies(self.workers, conductor, self.block_size, self.deadlines.prefill_s)
        self._loads: dict[str, WorkerLoad] = {}
        self.load_board = load_board  # where the workers write their reports; None: every report is asked for
        self._reported_at: dict[str, float] = {}  # when each worker's kept report arrived (monotonic)
        self._deaths: dict[str, asyncio.Event] = {}  # set when the worker is found dead
        self._active: set[asyncio.Task] = set()  # the tasks driving requests, cancelled at shutdown
        self._last_active = time.monotonic()  # when a request last ended (or the dispatcher was made)
        self._request_arrived = asyncio.Event()  # wakes an idle refresher
        self._routed = itertools.count()  # routing order, kept by the workers' engine queues
        self.in_flight = InFlight()  # attempts running on each worker
        self.draining: set[str] = set()  # workers routed to no more (services/scaling.py)
        self._refresher: asyncio.Task | None = None

    # ---- worker state -------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh_loads()
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        self.copies.running.cancel()
        await cancel_and_wait([self._refresher])
        if self.load_board is not None:
            await self.load_board.close()
        await asyncio.gather(*(worker.close() for worker in self.workers.values()))

    async def _refresh_forever(self) -> None:
        while not cancel_requested():  # (its board reads go through redis-py, which may swallow the cancel)
            await self._until_next_refresh()
            try:
                await self.refresh_loads(silent_for_s=_SILENCE_S if await self._read_board() else 0.0)
            except Exception:  # the refresher must outlive any one bad report
                log.exception("load refresh failed")

    def busy(self) -> bool:
        """Whether a request runs, or one ended less than ``_BUSY_TAIL_S`` ago."""
        return bool(self._active) or time.monotonic() - self._last_active < _BUSY_TAIL_S

    async def _until_next_refresh(self) -> None:
        """``_LOAD_REFRESH_S`` while busy; idle, ``_IDLE_LOAD_REFRESH_S`` or until a request arrives."""
        if self.busy():
            await asyncio.sleep(_LOAD_REFRESH_S)
            return
        self._request_arrived.clear()
        with contextlib.suppress(TimeoutError):  # (asyncio.timeout: wait_for may swallow a cancel before 3.12)
            async with asyncio.timeout(_IDLE_LOAD_REFRESH_S):
                await self._request_arrived.wait()

    async def _read_board(self) -> bool:
        """Take the reports written on the load board since the last read; False if there is no board to read."""
        reports = None if self.load_board is None else await self.load_board.read()
        for load in reports or ():
            self.take_report(load)
        return reports is not None

    async def refresh_loads(self, timeout_s: float = _LOAD_TIMEOUT_S, silent_for_s: float = 0.0) -> None:
        """Ask every worker (only those whose latest report arrived ``silent_for_s`` or more ago) for its load
        report; a worker found dead is marked so."""
        now = time.monotonic()
        workers = [w for w in self.workers.values()
                   if now - self._reported_at.get(w.worker_id, -math.inf) >= silent_for_s]
        results = await asyncio.gather(*(w.load(timeout_s) for w in workers), return_exceptions=True)
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, WorkerLoad):
                self.take_report(result, asked=True)
            elif isinstance(result, WorkerDiedError):
                self._mark_dead(worker.worker_id)
            else:
                log.warning("no load report from %s: %s", worker.worker_id, result)

    def take_report(self, load: WorkerLoad, asked: bool = False) -> None:
        """Keep a worker's load report, ``asked`` for or read on the board. Reports cross (an ask waiting on a
        slow worker, a board read): one replaces the kept one only if the worker took it later, so the
        router never steps back to an older report, nor refits its estimator on steps it has seen; and none
        revives a worker found dead or unhealthy (that is final: a replacement comes under a new id)."""
        worker_id = load.worker_id
        previous = self._loads.get(worker_id)
        if worker_id not in self.workers or (previous is not None and (
                not previous.alive or load.report_seq <= previous.report_seq)):
            return  # (or a worker removed while its report was on its way)
        self._reported_at[worker_id] = time.monotonic()
        self.metrics.count_load_report(asked)
        seen = previous.steps if previous is not None else 0
        # Measured engine steps refit the estimator, each once: those after the previous report.
        for step, pairs, new, chunks, seconds in load.prefill_steps:
            if step > seen:
                self.conductor.observe_prefill_step(worker_id, (pairs, new, chunks), seconds)
        for step, batch, context, seconds in load.decode_steps:
            if step > seen:
                self.conductor.observe_decode_step(worker_id, batch, context, seconds)
        for step, batch, context, seconds, tokens in load.drafted_steps:
            if step > seen:
                self.conductor.observe_drafted_step(worker_id, batch, context, seconds, tokens)
        self._loads[worker_id] = load
        self.metrics.set_worker_load(load, self.conductor.prefill_speeds.factor(worker_id),
                                     self.conductor.decode_speeds.factor(worker_id))

    def _mark_dead(self, worker_id: str) -> None:
        load = self._loads.get(worker_id)
        if worker_id in self.workers and (load is None or load.alive):  # None: it died before its first report
            log.warning("worker %s is dead", worker_id)
            self._loads[worker_id] = dataclasses.replace(load, alive=False) if load else WorkerLoad(
                worker_id, str(self.workers[worker_id].role), alive=False)
            self.metrics.set_worker_load(self._loads[worker_id])
        if worker_id in self._deaths:
            self._deaths[worker_id].set()  # handoffs into it stop waiting

    def report_age_s(self, worker_id: str) -> float | None:
        """Seconds since the worker's latest report was taken, read on the board or asked for; None: none yet."""
        taken = self._reported_at.get(worker_id)
        return None if taken is None else time.monotonic() - taken

    @property
    def loads(self) -> dict[str, WorkerLoad]:
        """The latest load report of each worker (read-only: the refresher replaces it)."""
        return self._loads

    def alive_workers(self) -> int:
        return sum(1 for load in self._loads.values() if load.alive)

    @property
    def speculates(self) -> bool:
        """Whether the workers that decode verify drafts (speculative decoding), which predicted outputs need."""
        return any(w.info.num_speculative_tokens > 0 for w in self.workers.values() if w.info.role in DECODE_ROLES)

    def missing_roles(self, excluded: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """The roles ("prefill", "decode") that no live worker outside ``excluded`` serves."""
        live = {ld.role for ld in self._loads.values() if ld.alive and ld.worker_id not in excluded}
        return [role for role, serving in (("prefill", PREFILL_ROLES), ("decode", DECODE_ROLES))
                if not live.intersection(serving)]

    def dead_workers(self) -> list[WorkerClient]:
        """Workers found dead, or reporting themselves unhealthy (an engine step failed)."""
        return [w for w in self.workers.values()
                if (load := self._loads.get(w.worker_id)) is not None and not load.alive]

    def add_worker(self, worker: WorkerClient) -> None:  # routed to from its first load report
        self.workers[worker.worker_id] = worker

    def remove_worker(self, worker_id: str) -> None:
        """Forget a dead or drained worker (requests that were on it resume on their own) and its series."""
        self.workers.pop(worker_id, None)
        self._deaths.pop(worker_id, None)
        self._reported_at.pop(worker_id, None)
        if self.load_board is not None:
            self.load_board.forget(worker_id)
        self.conductor.forget_worker(worker_id)
        if (load := self._loads.pop(worker_id, None)) is not None and load.alive:
            self.metrics.set_worker_load(dataclasses.replace(load, alive=False))

    async def drain(self, grace_s: float, cleanup_s: float) -> None:
        """Shutdown: running requests get ``grace_s`` to finish, then the rest are cancelled (their streams
        end) and their cleanup, which calls workers and so must end before Ray does, gets ``cleanup_s``."""
        if self._active:
            await asyncio.wait(list(self._active), timeout=grace_s)
        tasks = list(self._active)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=cleanup_s)

    # ---- one request ----------------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Yield the request's token events; n > 1 runs n sub-requests whose events interleave."""
        if not self.generates:
            raise InvalidRequestError("model", "this checkpoint is a base model without its LM head (an embedding "
                                               "model's): it serves /v1/embeddings only")
        req.params.validate()
        if not req.prompt_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if len(req.prompt_ids) + req.params.max_tokens > self.max_model_len:
            raise PromptTooLongError(len(req.prompt_ids) + req.params.max_tokens, self.max_model_len)
        if req.lora is not None and req.lora not in self.loras:
            raise InvalidRequestError("lora", f"no LoRA adapter {req.lora!r} is served")
        task = asyncio.current_task()
        self._active.add(task)
        self._request_arrived.set()
        try:
            if req.params.n == 1:
                async for event in self._generate_one(req.request_id, req.prompt_ids, req.params, 0, req.priority,
                                                      req.lora):
                    yield event
                return
            async for event in self._generate_fanout(req):
                yield event
        finally:
            self._active.discard(task)
            self._last_active = time.monotonic()

    async def embed(self, request_id: str, prompt_ids: list[int], dimensions: int | None = None,
                    priority: int = 0) -> EmbeddingResult:
        """One prompt's embedding (``dimensions`` values; None: the hidden size): the prompt is routed alone to the
        prefill (or colocated) worker that ends it first after the prefix it holds (``Conductor.route_prompt``)
        and computed there; a worker that dies meanwhile costs a new route. (The worker's engine checks
        ``dimensions`` and the model's pooling; the gateway before it tokenizes.)"""
        if not prompt_ids:
            raise InvalidRequestError("input", "the input is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(len(prompt_ids), self.max_model_len - 1)  # (as a prompt's: a token of room)
        task = asyncio.current_task()
        self._active.add(task)
        self._request_arrived.set()
        arrived = time.monotonic()
        salt = salt_for(self.model_id, None, long_rope_applies(self.long_rope_from, len(prompt_ids)),
                        self.quantized_at_load)
        route_req = RouteRequest(request_id, len(prompt_ids), block_hashes(prompt_ids, self.block_size, salt), 0,
                                 self.max_kv_tokens)
        excluded: set[str] = set()
        try:
            for attempt in itertools.count():
                decision = (self._route(route_req, excluded, prompt_only=True) if attempt == 0
                            else await self._route_again(route_req, excluded, prompt_only=True))
                routed = time.monotonic()
                use = self.in_flight.use(decision.prefill)
                try:
                    result = await self.workers[decision.prefill].embed(
                        request_id if attempt == 0 else f"{request_id}/{attempt}", prompt_ids, dimensions,
                        self.deadlines.prefill_s, (priority, next(self._routed)))
                except WorkerLostError as exc:
                    if attempt + 1 == _MAX_ATTEMPTS:
                        raise
                    if isinstance(exc, WorkerDiedError):
                        self._mark_dead(exc.worker_id)
                    excluded.add(exc.worker_id)
                    log.warning("embedding request %s: %s; routing it again", request_id, exc)
                    continue
                finally:
                    use.release(decision.prefill)
                self.conductor.observe_ttft(decision, time.monotonic() - routed)
                self.metrics.observe_embedding(result.num_prompt_tokens, time.monotonic() - arrived)
                return result
        finally:
            self._active.discard(task)
            self._last_active = time.monotonic()

    async def _generate_fanout(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        # Each choice is its own request (seed + i keeps seeded runs reproducible); the prompt's blocks are
        # computed once and hit the prefix cache for the others.
        streams = []
        for i in range(req.params.n):
            seed = None if req.params.seed is None else req.params.seed + i
            params = dataclasses.replace(req.params, n=1, seed=seed)
            streams.append(self._generate_one(f"{req.request_id}-{i}", req.prompt_ids, params, i, req.priority,
                                              req.lora))
        async for event in interleave(streams):
            yield event

    async def _generate_one(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int, priority: int,
        lora: str | None,
    ) -> AsyncIterator[TokenEvent]:
        track = RequestTracker(self.metrics, on_ttft=self.conductor.observe_ttft)
        progress = Progress()
        excluded: set[str] = set()  # workers found dead while serving this request
        adapter_id = None if lora is None else self.loras[lora]  # an adapter's blocks are its own
        try:
            for attempt in range(_MAX_ATTEMPTS):
                tokens = [*prompt_ids, *progress.output_ids]
                # Prompt logprobs come with the first token; a prompt scored for them is computed whole, so the
                # router counts no cached prefix for it (an attempt resumed after that token uses the cache).
                if progress.output_ids and params.prompt_logprobs is not None:
                    params = dataclasses.replace(params, prompt_logprobs=None)
                # (a LongRoPE prompt past the original context rotates with the long factors: its blocks too)
                salt = salt_for(self.model_id, adapter_id, long_rope_applies(self.long_rope_from, len(tokens)),
                                self.quantized_at_load, params.cache_salt)
                hashes = block_hashes(tokens, self.block_size, salt) if params.prompt_logprobs is None else []
                route_req = RouteRequest(request_id, len(tokens), hashes,
                                         params.max_tokens - len(progress.output_ids), self.max_kv_tokens, lora)
                decision = self._route(route_req, excluded) if attempt == 0 else await self._route_again(
                    route_req, excluded)
                if not track.streaming:
                    track.route(decision)
                self.copies.replicate(decision, tokens, salt)
                stream = self._run(decision, Attempt(
                    request_id if attempt == 0 else f"{request_id}/{attempt}", prompt_ids, params, index,
                    tuple(progress.output_ids), self.copies.fetch_for(decision, salt), (priority, next(self._routed)),
                    self._reserve_wait_s(track.arrived, decision), lora))
                try:
                    async for event in stream:
                        progress.add(event)
                        # Recorded before the yield: a consumer that stops after the last event never resumes us.
                        track.on_event(event)
                        yield event
                    return
                except Exception as exc:
                    if not resumable(exc) or attempt + 1 == _MAX_ATTEMPTS:
                        raise
                    failed = getattr(exc, "worker_id", None)  # a dead or a stalled worker
                    if isinstance(exc, WorkerDiedError):
                        self._mark_dead(failed)
                    if failed and (isinstance(exc, WorkerDiedError) or not self.missing_roles(excluded | {failed})):
                        excluded.add(failed)  # a stalled one only while another can take its place
                    if progress.output_ids:
                        self.resumed += 1
                        self.metrics.resumed.inc()
                    log.warning("request %s: %s; resuming after %d tokens", request_id, exc,
                                len(progress.output_ids))
                finally:
                    await stream.aclose()
        finally:
            track.stop(sys.exc_info()[1])  # whatever is ending the stream, if anything

    def _reserve_wait_s(self, arrived: float, decision: Decision) -> float:
        """How long the decode reservation may wait for room: what the TTFT SLO leaves of the request's time
        after the router's estimate (the router admitted it on blocks projected free by its prefill's end), so
        a lease granted at the end of its wait meets the SLO even when its prompt was not computed meanwhile.
        Never past the prefill's deadline (a TTFT SLO may be longer): a wait that finds no room ends with the
        decode worker's refusal, which is routed again, before the prefill times out waiting for it.
        One budget per request: an attempt routed again after a wait has less."""
        budget = min(self.conductor.slo.ttft_s, self.deadlines.prefill_s)
        return max(0.0, budget - (time.monotonic() - arrived) - decision.est_ttft_s)

    def _route(self, route_req: RouteRequest, excluded: set[str], prompt_only: bool = False) -> Decision:
        """A pair for the request, or a prefill worker alone for a ``prompt_only`` one (an embedding)."""
        excluded = excluded | self.draining  # out: workers that failed this request, and those being drained
        missing = self.missing_roles(excluded)
        if prompt_only:
            missing = [role for role in missing if role == "prefill"]
        if missing:  # 503, not the conductor's 429: no queue to wait in
            raise NoWorkersError(f"no live {' or '.join(missing)} worker")
        loads = list(self._loads.values())
        if excluded:
            loads = [dataclasses.replace(ld, alive=False) if ld.worker_id in excluded else ld for ld in loads]
        route = self.conductor.route_prompt if prompt_only else self.conductor.route
        decision = route(route_req, loads, self.index)
        if isinstance(decision, Reject):
            self.rejections += 1
            self.metrics.inc_rejection(decision.reason)
            raise RequestRejected(decision.reason, decision.retry_after_s)
        return decision

    async def _route_again(self, route_req: RouteRequest, excluded: set[str], prompt_only: bool = False
                           ) -> Decision:
        """A failed attempt's next pair: wait up to the resume deadline for one (a dead worker's replacement)."""
        await self.refresh_loads(_RESUME_LOAD_TIMEOUT_S)  # a broken handoff may mean a dead worker
        deadline = time.monotonic() + self.deadlines.resume_s
        while self.missing_roles(excluded) and time.monotonic() < deadline:
            await asyncio.sleep(_LOAD_REFRESH_S)
        return self._route(route_req, excluded, prompt_only)

    def _run(self, decision: Decision, attempt: Attempt) -> AsyncIterator[TokenEvent]:
        use = self.in_flight.use(decision.prefill, decision.decode)
        if decision.prefill == decision.decode:
            return use.during(run_colocated(attempt, self.workers[decision.prefill], self.deadlines))
        died = self._deaths.setdefault(decision.decode, asyncio.Event())

        def observe(result: PrefillResult) -> None:
            use.release(decision.prefill)  # the handoff is done: the rest is the decode worker's
            if result.transport:
                self.metrics.observe_transfer(result.transport, result.transfer_bytes, result.transfer_s,
                                              result.exposed_s)
            if result.transport and result.link_s > 0:
                self.conductor.observe_transfer(decision.prefill, decision.decode, result.transfer_bytes, result.link_s)
            for source, nbytes, seconds in result.prefix_copies:
                self.conductor.observe_transfer(source, decision.prefill, nbytes, seconds)

        return use.during(run_disaggregated(attempt, self.workers[decision.prefill], self.workers[decision.decode],
                                            self.deadlines, died, observe))
