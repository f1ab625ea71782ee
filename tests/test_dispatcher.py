"""The dispatcher's request path with fake workers: no Ray, no engine, just the typed worker interface.

Each fake records the calls it got, so the tests check the order of reserve / prefill / decode, the
retry after a worker death before the first token, and that every exit path frees the decode lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time

import pytest

import services.dispatcher as dispatcher_module
from engine.errors import InvalidRequestError, OutOfBlocksError
from engine.output import FinishReason
from engine.sampling_params import SamplingParams
from kvstore.hashing import block_hashes, salt_for
from router.conductor import SLO, Conductor
from router.estimator import Estimator
from router.loads import WorkerLoad
from router.view import Replication
from services.background import cancel_and_wait
from services.dispatcher import Dispatcher, GenerateRequest
from services.errors import NoWorkersError, RequestRejected, WorkerDiedError
from services.load_reports import ChangeSignal, LoadBoard, LoadWriter, load_board_key
from services.messages import (
    EmbeddingResult,
    EngineStepError,
    KVTarget,
    PrefillResult,
    Role,
    TokenEvent,
    WorkerInfo,
    WorkerProfile,
)
from services.metrics import Metrics

pytestmark = pytest.mark.timeout(30)

PROMPT = list(range(40))


class FakeWorker:
    """The methods of ``WorkerClient``, answering from a script instead of an actor."""

    def __init__(self, worker_id: str, role: Role, *, die_on_prefill: bool = False,
                 fail_on_prefill: Exception | None = None, tokens: int = 3, full: bool = False) -> None:
        target = KVTarget(worker_id, "127.0.0.1:1", "cpu", "node-0", None) if role == Role.DECODE else None
        self.info = WorkerInfo(worker_id, role, "127.0.0.1", "node", "cpu", "fake-model", 16, 2048, 1024, 256,
                               WorkerProfile([], []), target, loras={"crab": "crab@0123"})
        self.alive = True
        self.die_on_prefill, self.fail_on_prefill, self.tokens = die_on_prefill, fail_on_prefill, tokens
        # full: its blocks were taken since its last report, so a reserve is refused; its next report says so
        self.full, self.free_blocks = full, 256
        self.calls: list[tuple[str, str]] = []
        self.leases: set[str] = set()
        self.reserve_waits: list[float] = []  # how long each reserve was allowed to wait for room
        self.reservations: list[tuple[int, int]] = []  # (prompt tokens, tokens it may decode) of each reserve
        self.refuse_after_s = 0.0
        self.actor = f"actor-of-{worker_id}"  # stands for the Ray handle a peer copy is asked through
        self.fetches: list = []  # the PrefixFetch of each prefill, and of each replication copy
        self.priorities: list = []  # the priority each prefill was queued with
        self.loras: list = []  # the LoRA adapter of each prefill, decode and colocated generate
        self.reports = itertools.count(1)  # numbers its load reports, as a worker does

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> Role:
        return self.info.role

    async def load(self, timeout_s: float) -> WorkerLoad:
        if not self.alive:
            raise WorkerDiedError(self.worker_id, f"{self.worker_id} died")
        return WorkerLoad(self.worker_id, str(self.role), free_blocks=self.free_blocks, total_blocks=256,
                          updated_at=time.time(), report_seq=next(self.reports))

    async def reserve(self, request_id: str, num_tokens: int, lease_s: float, wait_s: float, timeout_s: float,
                      max_new_tokens: int = 0) -> bool:
        self.calls.append(("reserve", request_id))
        self.reserve_waits.append(wait_s)
        self.reservations.append((num_tokens, max_new_tokens))
        if self.full:
            await asyncio.sleep(self.refuse_after_s)  # a worker refuses after waiting for room in vain
            self.free_blocks = 0
            raise OutOfBlocksError(-(-num_tokens // 16), 0)
        self.leases.add(request_id)
        return True

    async def prefill(self, request_id, prompt_ids, params, kv_target, fetch, deadline_s,
                      output_ids=(), priority=None, lease_pending=False, lora=None) -> PrefillResult:
        self.calls.append(("prefill", request_id))
        self.loras.append(lora)
        self.priorities.append(priority)
        self.fetches.append(fetch)
        assert kv_target is not None and kv_target.worker_id.startswith("d")
        if self.die_on_prefill:
            self.alive = False
            raise WorkerDiedError(self.worker_id, f"worker {self.worker_id} died")
        if self.fail_on_prefill is not None:
            raise self.fail_on_prefill
        return PrefillResult(7, "a", None, 16, 1000, 0.001, "grpc")

    async def embed(self, request_id, prompt_ids, dimensions, deadline_s, priority=None) -> EmbeddingResult:
        self.calls.append(("embed", request_id))
        if self.die_on_prefill:
            self.alive = False
            raise WorkerDiedError(self.worker_id, f"worker {self.worker_id} died")
        if self.fail_on_prefill is not None:
            raise self.fail_on_prefill
        return EmbeddingResult([1.0, 0.0], len(prompt_ids), 0)

    async def copy_prefix(self, token_ids, fetch, timeout_s) -> int:
        self.calls.append(("copy_prefix", str(len(token_ids))))
        self.fetches.append(fetch)
        return fetch.blocks

    async def release(self, request_id: str) -> None:
        self.calls.append(("release", request_id))
        self.leases.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))

    async def close(self) -> None:  # (a worker client stops reading the worker's token feed)
        self.calls.append(("close", ""))

    def decode(self, request_id, prompt_ids, first_token_id, params, index, num_cached_tokens, output_ids=(),
               token_timeout_s=60.0, lora=None):
        self.calls.append(("decode", request_id))
        self.loras.append(lora)
        self.leases.discard(request_id)  # the lease joins the batch
        return self._tokens(index, num_cached_tokens)

    def generate(self, request_id, prompt_ids, params, index, fetch, output_ids=(), first_timeout_s=120.0,
                 token_timeout_s=60.0, priority=None, lora=None):
        self.calls.append(("generate", request_id))
        self.loras.append(lora)
        return self._tokens(index, 0, first=True)

    async def _tokens(self, index: int, cached: int, first: bool = False):
        for i in range(self.tokens):
            last = i == self.tokens - 1
            await asyncio.sleep(0)
            yield TokenEvent(index, [100 + i], FinishReason.LENGTH if last else None, len(PROMPT), cached, "x")


def make_dispatcher(*workers: FakeWorker, policy: str = "round_robin",
                    load_board: LoadBoard | None = None) -> Dispatcher:
    estimator = Estimator.from_samples(
        prefill_samples=[(16, 0, 0.01), (64, 0, 0.02), (256, 0, 0.08)],
        decode_samples=[(1, 32, 0.01), (4, 128, 0.012), (8, 512, 0.02)], kv_bytes_per_token=1024)
    conductor = Conductor(policy, estimator, SLO(30.0, 1.0), block_size=16)

    class NoPrefixes:
        def longest_prefix(self, hashes):
            return {}

    return Dispatcher(list(workers), conductor, NoPrefixes(), tokenizer=None, metrics=Metrics(),
                      kv_transport="grpc", load_board=load_board)


async def collect(dispatcher: Dispatcher, request_id: str = "r1", n: int = 1, priority: int = 0,
                  lora: str | None = None, cache_salt: str | None = None) -> list[TokenEvent]:
    await dispatcher.refresh_loads()
    params = SamplingParams(max_tokens=4, temperature=0.0, n=n, cache_salt=cache_salt)
    return [e async for e in dispatcher.generate(GenerateRequest(request_id, PROMPT, params, priority, lora))]


def test_disaggregated_request_reserves_then_prefills_then_streams_decode():
    p, d = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    events = asyncio.run(collect(make_dispatcher(p, d)))
    assert [e.token_ids for e in events] == [[7], [100], [101], [102]]
    assert events[0].num_cached_tokens == 16 and events[-1].finish_reason == FinishReason.LENGTH
    assert d.calls == [("reserve", "r1"), ("decode", "r1")]
    assert d.reservations == [(len(PROMPT), 4)]  # the decode worker keeps room for the lease to grow
    assert p.calls == [("prefill", "r1")]
    assert not d.leases


def test_prefill_worker_death_before_first_token_retries_on_another_and_frees_the_lease():
    dead, spare, d = FakeWorker("p0", Role.PREFILL, die_on_prefill=True), FakeWorker("p1", Role.PREFILL), \
        FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(dead, spare, d)
    events = asyncio.run(collect(dispatcher))
    assert [e.token_ids for e in events] == [[7], [100], [101], [102]]
    # the retry runs under an id of its own: the failed attempt's may still be in use on a live worker
    assert ("prefill", "r1") in dead.calls and ("prefill", "r1/1") in spare.calls
    assert ("release", "r1") in d.calls  # the first attempt's lease
    assert not d.leases
    assert dispatcher.alive_workers() == 2  # the dead worker is marked so


def test_a_decode_worker_without_room_for_the_lease_is_routed_around_on_fresh_loads():
    """Its last report said it had room, but its blocks went to others since: the reserve is refused, and
    the request is routed again on fresh loads, which send it to the decode worker that has room."""
    p, full, spare = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE, full=True), \
        FakeWorker("d1", Role.DECODE)
    events = asyncio.run(collect(make_dispatcher(p, full, spare, policy="tidepool")))
    assert [e.token_ids for e in events] == [[7], [100], [101], [102]]
    # The refused reservation is released too: on a real worker it may still be waiting for room.
    assert full.calls == [("reserve", "r1"), ("release", "r1")] and not full.leases
    assert spare.calls == [("reserve", "r1/1"), ("decode", "r1/1")]
    assert p.calls == [("prefill", "r1/1")]


def test_a_report_that_arrives_after_a_later_refreshs_does_not_replace_it():
    """Refreshes overlap (a resume's, an added worker's): one held up by a slow worker ends last, and its
    report, taken before the later refresh's, must not step the router back to it."""
    p, d = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(p, d)
    asked, slow = asyncio.Event(), asyncio.Event()
    fast_load = d.load

    async def load(timeout_s: float) -> WorkerLoad:
        report = await fast_load(timeout_s)
        if report.free_blocks == 100:  # the older report: held until the later refresh is done
            asked.set()
            await slow.wait()
        return report

    d.load = load

    async def overlapping() -> int:
        d.free_blocks = 100
        older = asyncio.create_task(dispatcher.refresh_loads())
        await asked.wait()
        d.free_blocks = 200
        await dispatcher.refresh_loads()
        slow.set()
        await older
        return dispatcher.loads["d0"].free_blocks

    assert asyncio.run(overlapping()) == 200


def test_an_idle_dispatcher_stops_polling_the_workers_and_a_request_wakes_it(monkeypatch):
    """Idle (no request for _BUSY_TAIL_S, none here), the refresher waits _IDLE_LOAD_REFRESH_S (an hour here)
    instead of asking every worker 20 times a second; a request that arrives wakes it at once, and the
    dispatcher is busy while the request runs."""
    monkeypatch.setattr(dispatcher_module, "_BUSY_TAIL_S", 0.0)
    monkeypatch.setattr(dispatcher_module, "_IDLE_LOAD_REFRESH_S", 3600.0)
    p, d = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(p, d)
    reports = 0
    fast_load = d.load

    async def load(timeout_s: float) -> WorkerLoad:
        nonlocal reports
        reports += 1
        return await fast_load(timeout_s)

    d.load = load

    async def scenario() -> tuple[int, list[bool], bool]:
        await dispatcher.start()
        await asyncio.sleep(0.3)  # polled, this would be 6 refreshes
        idle_reports = reports
        busy = []
        params = SamplingParams(max_tokens=4, temperature=0.0)
        async for _ in dispatcher.generate(GenerateRequest("r1", PROMPT, params)):
            busy.append(dispatcher.busy())
        async with asyncio.timeout(10):
            while reports == idle_reports:  # the arrival's refresh, not an hour later
                await asyncio.sleep(0.01)
        await dispatcher.stop()
        return idle_reports, busy, dispatcher.busy()

    idle_reports, busy, busy_after = asyncio.run(scenario())
    assert idle_reports == 1  # the start's report only
    assert busy and all(busy) and not busy_after


def test_a_report_never_steps_the_router_back_nor_revives_a_worker_found_dead():
    """Reports read on the board and asked for cross: the worker's numbering decides which is later. A worker found dead
    stays dead whatever report of its arrives late, and a worker the dispatcher does not know is ignored."""
    dispatcher = make_dispatcher(FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE))
    dispatcher.take_report(WorkerLoad("d0", "decode", free_blocks=200, report_seq=5))
    dispatcher.take_report(WorkerLoad("d0", "decode", free_blocks=100, report_seq=4))
    dispatcher.take_report(WorkerLoad("d0", "decode", free_blocks=100, report_seq=5))
    assert dispatcher.loads["d0"].free_blocks == 200
    dispatcher._mark_dead("d0")
    dispatcher.take_report(WorkerLoad("d0", "decode", free_blocks=300, report_seq=6))
    assert not dispatcher.loads["d0"].alive and dispatcher.loads["d0"].free_blocks == 200
    dispatcher.take_report(WorkerLoad("d9", "decode", free_blocks=300, report_seq=1))
    assert "d9" not in dispatcher.loads


def count_asks(*workers: FakeWorker) -> dict[str, int]:
    """Count the load reports the dispatcher asks each worker for (its ``load`` method, wrapped); the
    worker's own ``load`` stays reachable as ``report`` for its board writer."""
    asks = {w.worker_id: 0 for w in workers}
    for worker in workers:
        worker.report = worker.load

        async def asked(timeout_s: float, worker=worker) -> WorkerLoad:
            asks[worker.worker_id] += 1
            return await worker.report(timeout_s)

        worker.load = asked
    return asks


def writer(redis_url: str, key: str, worker: FakeWorker) -> LoadWriter:
    """A board writer for ``worker`` (in a running loop), writing on its heartbeat: nothing notifies it."""
    return LoadWriter(redis_url, key, lambda: worker.report(1.0), ChangeSignal(asyncio.get_running_loop()),
                      interval_s=0.01, heartbeat_s=0.05)


async def until(predicate, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def board_reports(dispatcher: Dispatcher) -> float:
    return dispatcher.metrics.load_reports.labels(dispatcher.metrics.model_name, "board")._value.get()


def test_the_board_keeps_the_router_current_and_no_worker_is_asked_while_its_reports_come(redis_url, monkeypatch):
    """The start asks each worker once; then, busy or idle, the reports the workers write on the board are all
    the dispatcher needs: a change reaches the router without a call to any worker."""
    monkeypatch.setattr(dispatcher_module, "_SILENCE_S", 3600.0)  # no worker ever counts as silent here
    p, d = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    key = load_board_key("current")
    dispatcher = make_dispatcher(p, d, load_board=LoadBoard(redis_url, key))
    asks = count_asks(p, d)

    async def scenario() -> list[TokenEvent]:
        await dispatcher.start()
        writers = [asyncio.create_task(writer(redis_url, key, w).run()) for w in (p, d)]
        d.free_blocks = 123
        params = SamplingParams(max_tokens=4, temperature=0.0)
        events = [e async for e in dispatcher.generate(GenerateRequest("r1", PROMPT, params))]
        await until(lambda: dispatcher.loads["d0"].free_blocks == 123)  # (busy: the board is read every 50 ms)
        await asyncio.sleep(0.3)  # asking every worker, this would be 6 rounds
        for task in writers:
            task.cancel()
        await dispatcher.stop()
        return events

    assert [e.token_ids for e in asyncio.run(scenario())] == [[7], [100], [101], [102]]
    assert asks == {"p0": 1, "d0": 1}
    assert board_reports(dispatcher) >= 2


def test_a_worker_whose_reports_stop_is_asked_and_found_dead(redis_url, monkeypatch):
    monkeypatch.setattr(dispatcher_module, "_SILENCE_S", 0.3)
    monkeypatch.setattr(dispatcher_module, "_IDLE_LOAD_REFRESH_S", 0.05)
    p, d = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    key = load_board_key("silenced")
    dispatcher = make_dispatcher(p, d, load_board=LoadBoard(redis_url, key))
    asks = count_asks(p, d)

    async def scenario() -> None:
        await dispatcher.start()
        writers = {w.worker_id: asyncio.create_task(writer(redis_url, key, w).run()) for w in (p, d)}
        await until(lambda: board_reports(dispatcher) >= 4)
        writers["d0"].cancel()  # the worker is gone: no more reports, and a call finds it dead
        d.alive = False
        await until(lambda: dispatcher.alive_workers() == 1)
        writers["p0"].cancel()
        await dispatcher.stop()

    asyncio.run(scenario())
    assert [w.worker_id for w in dispatcher.dead_workers()] == ["d0"] and asks["d0"] >= 2


class SwallowingBoard:
    """A load board whose read swallows a cancel that lands in it, as redis-py can (handing a connection back
    to its pool)."""

    async def read(self) -> list[WorkerLoad]:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1.0)
        return []

    async def close(self) -> None:
        pass


def test_the_dispatcher_stops_even_when_a_board_read_swallows_the_refreshers_cancel():
    dispatcher = make_dispatcher(FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE),
                                 load_board=SwallowingBoard())

    async def scenario() -> None:
        await dispatcher.start()
        await asyncio.sleep(0.3)  # the refresher is inside its first read (0.05 s in, 1 s long)
        stopping = asyncio.create_task(dispatcher.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)
        assert done, "stop() never returned: the refresher outlived its cancel"
    asyncio.run(scenario())


def test_a_caller_cancelled_while_it_waits_for_the_tasks_it_cancelled_is_cancelled_too():
    """``cancel_and_wait`` (the dispatcher's, the supervisor's and the autoscaler's stop) suppresses the tasks'
    own cancellation, never its caller's."""

    async def scenario() -> None:
        async def slow_to_end() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(0.5)  # its cleanup
                raise

        task = asyncio.create_task(slow_to_end())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(cancel_and_wait([task]))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(scenario())


def test_while_the_board_cant_be_read_every_worker_is_asked():
    """Redis unreachable: no report can be read, so the dispatcher asks every worker at its usual pace."""
    p, d = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(p, d, load_board=LoadBoard("redis://127.0.0.1:1", load_board_key("none")))
    asks = count_asks(p, d)

    async def scenario() -> None:
        await dispatcher.start()
        params = SamplingParams(max_tokens=4, temperature=0.0)
        _ = [e async for e in dispatcher.generate(GenerateRequest("r1", PROMPT, params))]  # busy: every 50 ms
        await until(lambda: min(asks.values()) >= 3)
        assert not dispatcher.load_board.readable
        await dispatcher.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("ttft_slo_s", [30.0, 1e-4, 10_000.0])
def test_the_decode_reservation_may_wait_for_room_the_ttft_slos_slack_over_the_routers_estimate(ttft_slo_s):
    """The router admitted the request on blocks projected free by its prefill's end; the reservation may wait
    for them as long as the TTFT SLO leaves room after the router's whole estimate, so that a lease granted
    at the end of its wait still meets the SLO when its prompt was not computed meanwhile (none when the
    estimate is already past it: round_robin never rejects). A TTFT SLO longer than the prefill's deadline
    (batch jobs set one) counts as the deadline: a wait in vain ends with the decode worker's refusal, which
    is routed again, before the prefill times out waiting for it."""
    p, d = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(p, d)
    dispatcher.conductor.slo = SLO(ttft_slo_s, 1.0)
    budget_s = min(ttft_slo_s, dispatcher.deadlines.prefill_s)
    decisions = []
    route = dispatcher.conductor.route
    dispatcher.conductor.route = lambda *args: decisions.append(route(*args)) or decisions[-1]
    asyncio.run(collect(dispatcher))
    assert 0 < decisions[0].est_ttft_s < 30.0
    assert d.reserve_waits == [pytest.approx(max(0.0, budget_s - decisions[0].est_ttft_s), abs=0.5)]


def test_a_request_routed_again_after_waiting_for_room_waits_only_what_its_slo_has_left():
    """The wait is one budget per request, not one per attempt: the refusal came after a wait (here 0.3 s)
    and the next decode worker may wait that much less."""
    p, full, spare = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE, full=True), \
        FakeWorker("d1", Role.DECODE)
    full.refuse_after_s = 0.3
    asyncio.run(collect(make_dispatcher(p, full, spare, policy="tidepool")))
    (first,), (second,) = full.reserve_waits, spare.reserve_waits
    assert 0 < second <= first - 0.3


def test_a_lease_no_decode_worker_has_room_for_is_rejected_with_a_retry_after():
    """The one decode worker refused the lease: on its fresh report the router rejects the request (429
    with a retry-after) rather than trying it again, and no prefill ran."""
    p, full = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE, full=True)
    with pytest.raises(RequestRejected) as rejected:
        asyncio.run(collect(make_dispatcher(p, full, policy="tidepool")))
    assert rejected.value.retry_after_s > 0
    assert full.calls == [("reserve", "r1"), ("release", "r1")] and not full.leases and not p.calls


def test_prefill_error_frees_the_lease_and_reaches_the_caller():
    p, d = FakeWorker("p0", Role.PREFILL, fail_on_prefill=ValueError("bad prompt")), FakeWorker("d0", Role.DECODE)
    with pytest.raises(ValueError, match="bad prompt"):
        asyncio.run(collect(make_dispatcher(p, d)))
    assert d.calls == [("reserve", "r1"), ("release", "r1")]
    assert ("abort", "r1") in p.calls


def test_consumer_leaving_after_the_first_token_aborts_the_decode_request():
    p, d = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(p, d)

    async def first_only() -> TokenEvent:
        await dispatcher.refresh_loads()
        stream = dispatcher.generate(GenerateRequest("r1", PROMPT, SamplingParams(max_tokens=4)))
        event = await anext(stream)
        await stream.aclose()
        return event

    assert asyncio.run(first_only()).token_ids == [7]
    assert ("abort", "r1") in d.calls


def test_a_requests_priority_comes_before_the_routers_order_on_the_worker():
    p, d = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(p, d)
    for request_id, priority in (("r1", 5), ("r2", -2)):
        asyncio.run(collect(dispatcher, request_id, priority=priority))
    (first, routed_first), (second, routed_second) = p.priorities
    assert (first, second) == (5, -2) and routed_first < routed_second


def test_fanout_runs_n_choices_as_sub_requests():
    c = FakeWorker("c0", Role.COLOCATED)
    events = asyncio.run(collect(make_dispatcher(c), n=2))
    assert sorted({e.index for e in events}) == [0, 1]
    assert sorted(rid for call, rid in c.calls if call == "generate") == ["r1-0", "r1-1"]
    assert sum(e.finish_reason is not None for e in events) == 2


def test_no_live_worker_is_refused_before_any_call():
    p, d = FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    p.alive = d.alive = False
    dispatcher = make_dispatcher(p, d)
    with pytest.raises(NoWorkersError):
        asyncio.run(collect(dispatcher))
    assert p.calls == d.calls == []


@pytest.mark.parametrize("link_s", [0.0, 0.01])
def test_the_router_learns_the_link_from_the_time_the_bytes_moved(link_s):
    class Handoff(FakeWorker):
        async def prefill(self, *args, **kwargs) -> PrefillResult:
            await super().prefill(*args, **kwargs)
            # layer-wise: 1 s from the first layer to the ack, of which 0.01 s the bytes were moving
            return PrefillResult(7, "a", None, 16, 1 << 20, 1.0, "grpc", link_s=link_s)

    dispatcher = make_dispatcher(Handoff("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE))
    asyncio.run(collect(dispatcher))
    learned = dispatcher.conductor.estimator.transfer.pairs.get("p0", {})
    if not link_s:  # nothing moved (or nothing measured): nothing to learn
        assert "d0" not in learned
    else:  # the waits for layers still computing are not the link's
        assert learned["d0"].time(1 << 20) < 0.1


@pytest.mark.parametrize("source", ["p1", "pool"])
def test_a_peer_fetch_reaches_the_prefill_worker_with_its_holder_and_a_pool_fetch_is_the_workers_call(source):
    p0, p1, d0 = FakeWorker("p0", Role.PREFILL), FakeWorker("p1", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(p0, p1, d0)
    route = dispatcher.conductor.route
    dispatcher.conductor.route = lambda *a, **k: dataclasses.replace(
        route(*a, **k), prefill="p0", fetch_from=source, fetch_blocks=2, cached_blocks=2)
    asyncio.run(collect(dispatcher))
    (fetch,) = p0.fetches
    if source == "pool":
        assert fetch is None  # the worker weighs the pool's tiers itself, whatever the policy
    else:
        assert (fetch.source, fetch.blocks, fetch.actor) == ("p1", 2, "actor-of-p1") and fetch.wait_s > 0


def test_replications_the_conductor_asks_for_run_on_their_destination_from_their_source():
    p0, p1, d0 = FakeWorker("p0", Role.PREFILL), FakeWorker("p1", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(p0, p1, d0)
    route = dispatcher.conductor.route
    dispatcher.conductor.route = lambda *a, **k: dataclasses.replace(
        route(*a, **k), replicate=(Replication("p0", "p1", 2),))

    async def run() -> None:
        await collect(dispatcher)
        await dispatcher.copies.running.wait()  # the copy runs beside the request, off its path

    asyncio.run(run())
    copy = p1.fetches[-1]
    assert ("copy_prefix", str(2 * 16 + 1)) in p1.calls  # two blocks, and a token after them
    assert (copy.source, copy.blocks, copy.actor) == ("p0", 2, "actor-of-p0")


@pytest.mark.parametrize("long_rope_from, long", [(None, False), (64, False), (32, True)])
def test_a_longrope_prompt_past_the_original_context_is_routed_by_its_long_blocks_hashes(long_rope_from, long):
    """Its blocks rotate with the long factors, so the workers, peers and pool hold them under a salt of their
    own: the router looks them up under it, and a prefix copy fetches them under it."""
    workers = [FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)]
    for w in workers:
        w.info = dataclasses.replace(w.info, long_rope_from=long_rope_from)
    dispatcher = make_dispatcher(*workers)
    seen, route = [], dispatcher.conductor.route
    dispatcher.conductor.route = lambda req, *a, **k: seen.append(req) or route(req, *a, **k)
    asyncio.run(collect(dispatcher))
    (req,) = seen
    assert req.block_hashes == block_hashes(PROMPT, 16, salt_for("fake-model", long_rope=long))  # 40 tokens


def test_a_salted_request_is_routed_and_its_prefix_fetched_by_its_salted_hashes():
    """The router, the pool and the peers hold a request's blocks under its cache_salt: it is looked up, and a
    prefix copy fetched, under that salt, which the workers receive with the request's parameters."""
    workers = [FakeWorker("p0", Role.PREFILL), FakeWorker("d0", Role.DECODE)]
    dispatcher = make_dispatcher(*workers)
    seen, route = [], dispatcher.conductor.route
    dispatcher.conductor.route = lambda req, *a, **k: seen.append(req) or dataclasses.replace(
        route(req, *a, **k), fetch_from=workers[0].worker_id, cached_blocks=1)
    asyncio.run(collect(dispatcher, cache_salt="tenant-secret"))
    salted = salt_for("fake-model", cache_salt="tenant-secret")
    assert seen[0].block_hashes == block_hashes(PROMPT, 16, salted) != block_hashes(PROMPT, 16, salt_for("fake-model"))
    assert workers[0].fetches[0].salt == salted


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_a_lora_request_runs_its_adapter_on_every_worker_and_is_routed_by_its_adapters_hashes(colocated):
    workers = [FakeWorker("c0", Role.COLOCATED)] if colocated else [FakeWorker("p0", Role.PREFILL),
                                                                     FakeWorker("d0", Role.DECODE)]
    dispatcher = make_dispatcher(*workers)
    seen, route = [], dispatcher.conductor.route
    dispatcher.conductor.route = lambda req, *a, **k: seen.append(req) or dataclasses.replace(
        route(req, *a, **k), fetch_from=workers[0].worker_id if not colocated else None, cached_blocks=1)
    events = asyncio.run(collect(dispatcher, lora="crab"))
    assert events[-1].finish_reason == FinishReason.LENGTH
    assert all(w.loras == ["crab"] for w in workers)  # prefill and decode, or generate
    assert seen[0].block_hashes == block_hashes(PROMPT, 16, salt_for("fake-model", "crab@0123"))
    if not colocated:  # a peer copy fetches the adapter's blocks, hashed as the router looked them up
        assert workers[0].fetches[0].salt == salt_for("fake-model", "crab@0123")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'kelp' is served"):
        asyncio.run(collect(dispatcher, "r2", lora="kelp"))
    assert all(len(w.loras) == 1 for w in workers)  # refused before any worker was called


# ---- embeddings: a prompt routed alone --------------------------------------------------------------------

async def _embed(dispatcher: Dispatcher) -> EmbeddingResult:
    await dispatcher.refresh_loads()
    return await dispatcher.embed("e1", PROMPT)


def test_an_embedding_goes_to_a_prefill_worker_alone_and_a_dead_one_costs_a_new_route():
    dying, spare, d = FakeWorker("p0", Role.PREFILL, die_on_prefill=True), FakeWorker("p1", Role.PREFILL), \
        FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(dying, spare, d)  # round robin: p0 first
    result = asyncio.run(_embed(dispatcher))
    assert result == EmbeddingResult([1.0, 0.0], len(PROMPT), 0)
    assert dying.calls[-1] == ("embed", "e1") and ("embed", "e1/1") in spare.calls
    assert not [call for call in d.calls if call[0] != "close"]  # the decode worker had no part in it
    assert [w.worker_id for w in dispatcher.dead_workers()] == ["p0"]
    assert dispatcher.in_flight.count("p1") == 0  # its use ended with it


def test_an_embedding_needs_no_decode_worker_but_a_prefill_one_and_its_step_error_is_not_retried():
    alone = make_dispatcher(FakeWorker("c0", Role.PREFILL))
    assert asyncio.run(_embed(alone)).num_prompt_tokens == len(PROMPT)
    with pytest.raises(NoWorkersError, match="no live prefill worker"):
        asyncio.run(_embed(make_dispatcher(FakeWorker("d0", Role.DECODE))))
    failing = FakeWorker("p0", Role.PREFILL, fail_on_prefill=EngineStepError("step failed"))
    spare = FakeWorker("p1", Role.PREFILL)
    with pytest.raises(EngineStepError):
        asyncio.run(_embed(make_dispatcher(failing, spare)))
    assert not spare.calls or all(call[0] != "embed" for call in spare.calls)
