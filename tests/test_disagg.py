"""Disaggregated serving on real Ray actors: parity with colocated, cleanup on abort/deadline/death."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest
import ray
import torch
from live_helpers import one_engine_outputs

from engine.errors import OutOfBlocksError
from engine.sampling_params import SamplingParams
from kvstore.transfer import IpcUnavailable
from kvstore.transfer.ipc import PayloadShare
from kvstore.transfer.wire import TransferHeader
from services.attempt import Attempt, resumable, run_disaggregated
from services.dispatcher import Deadlines, GenerateRequest
from services.errors import PrefillTimeoutError, ReservationReleased

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Mixed lengths, some sharing a prefix, so prefix caching and chunking are part of what is compared.
    shared = [rng.randrange(3, 250) for _ in range(40)]
    out = []
    for i in range(count):
        tail = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 90))]
        out.append(shared + tail if i % 3 == 0 else tail)
    return out


async def _collect(dispatcher, request_id: str, prompt: list[int], max_tokens: int = 12) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    async for event in dispatcher.generate(GenerateRequest(request_id, prompt, params)):
        tokens.extend(event.token_ids)
    return tokens


def _run_batch(server, prompts: list[list[int]], tag: str) -> list[list[int]]:
    dispatcher = server.server.cluster.dispatcher

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(_collect(dispatcher, f"{tag}-{i}", p) for i, p in enumerate(prompts)))

    return server.run(run(), 240)


def _free_blocks(server) -> dict[str, int]:
    stats = server.worker_stats()
    return {s["id"]: s["free_blocks"] for s in stats if s["alive"]}


def _wait_free_blocks(server, baseline: dict[str, int], timeout_s: float = 20.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        current = _free_blocks(server)
        if current == baseline:
            return current
        time.sleep(0.1)
    return _free_blocks(server)


def _settled_free_blocks(server, timeout_s: float = 20.0) -> dict[str, int]:
    """The workers' free blocks once nothing runs or waits on them and the counts held still for a moment
    (a request that just ended gives its blocks back in the background)."""
    deadline, previous = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        rows = [row for row in server.worker_stats() if row["alive"]]
        current = {row["id"]: row["free_blocks"] for row in rows}
        if all(row["running"] == row["waiting"] == 0 for row in rows):
            if current == previous:
                return current
            previous = current
        time.sleep(0.2)
    raise AssertionError(f"the workers did not settle: {server.worker_stats()}")


@pytest.fixture(scope="module")
def colocated_outputs(serving_model_dir) -> list[list[int]]:
    """The 16 prompts colocated: prefilled and decoded by one engine, batched together, as a colocated
    worker runs them (here in the test's process, with no worker to start)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = one_engine_outputs(serving_model_dir, dict(enumerate(_prompts(16))), params)
    return list(outputs.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("transport", "layerwise", "async_scheduling"), [
    ("grpc", True, False), ("grpc", False, False), ("collective", True, False), ("collective", False, False),
    ("ipc", True, False),  # shared memory on one node: the whole KV once computed, whatever --layerwise says
    ("grpc", True, True),  # the decode worker launching each step before the last one's tokens reach the host
], ids=["grpc-layerwise", "grpc-whole", "collective-layerwise", "collective-whole", "ipc",
        "grpc-layerwise-async-scheduling"])
def test_disaggregated_greedy_equals_colocated(start_server, colocated_outputs, transport, layerwise,
                                               async_scheduling):
    server = start_server(prefill=1, decode=1, kv_transport=transport, layerwise=layerwise,
                          engine_options={"async_scheduling": async_scheduling})
    try:
        assert _run_batch(server, _prompts(16), f"{transport}-{layerwise}") == colocated_outputs
        metrics = server.server.cluster.dispatcher.metrics
        moved = {way: metrics.registry.get_sample_value("tidepool_kv_transfer_bytes_total",
                                                        {"model_name": metrics.model_name, "transport": way}) or 0
                 for way in ("grpc", "collective", "ipc")}
        assert moved[transport] > 0 and sum(moved.values()) == moved[transport]  # none fell back
        # Every handoff's wait after the compute is recorded; sent after the prefill, it covers the transfer.
        def sample(name: str) -> float:
            return metrics.registry.get_sample_value(name, {"model_name": metrics.model_name, "transport": transport})

        handoffs = sample("tidepool_kv_transfer_seconds_count")
        assert sample("tidepool_kv_transfer_exposed_seconds_count") == handoffs == 16
        assert sample("tidepool_kv_transfer_exposed_seconds_sum") > 0
        if not layerwise or transport == "ipc":
            assert sample("tidepool_kv_transfer_exposed_seconds_sum") >= sample("tidepool_kv_transfer_seconds_sum")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pd_server(start_server):
    server = start_server(prefill=1, decode=2, kv_transport="grpc")
    yield server
    server.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cancel_after_s", [0.02, 0.1, 0.4])
def test_abort_during_transfer_returns_blocks_on_both_sides(pd_server, cancel_after_s):
    # A long prompt and a long answer: the cancel lands in prefill, in the KV push or in decode,
    # and wherever it lands both workers must end with the blocks they started with.
    baseline = _settled_free_blocks(pd_server)
    dispatcher = pd_server.server.cluster.dispatcher
    prompt = random.Random(7).choices(range(3, 250), k=1500)

    async def start_then_cancel() -> None:
        task = asyncio.create_task(_collect(dispatcher, f"abort-{cancel_after_s}", prompt, max_tokens=500))
        await asyncio.sleep(cancel_after_s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    pd_server.run(start_then_cancel())
    assert _wait_free_blocks(pd_server, baseline) == baseline


@pytest.mark.timeout(120)
def test_missed_deadline_fails_the_request_and_returns_blocks(pd_server):
    baseline = _settled_free_blocks(pd_server)
    dispatcher = pd_server.server.cluster.dispatcher
    saved = dispatcher.deadlines
    # A deadline no prompt can meet, whatever the machine's speed: it passes while the prompt is admitted.
    dispatcher.deadlines = Deadlines(reserve_s=10.0, prefill_s=1e-6, lease_s=30.0)
    prompt = random.Random(8).choices(range(3, 250), k=1800)
    try:
        # The worker's own verdict, not the client's backstop ("did not answer within 5s"): it answered.
        with pytest.raises(PrefillTimeoutError, match="not computed within its deadline of 1e-06s"):
            pd_server.run(_collect(dispatcher, "too-slow", prompt))
    finally:
        dispatcher.deadlines = saved
    assert _wait_free_blocks(pd_server, baseline) == baseline


@pytest.mark.timeout(120)
def test_a_share_a_decode_worker_cannot_map_reaches_the_sender_as_ipc_unavailable_and_keeps_the_lease(pd_server):
    """What a prefill worker's fallback relies on: through Ray the refusal keeps its type (the sender catches
    IpcUnavailable), nothing was written and the lease stays open, so the same KV can still arrive."""
    baseline = _settled_free_blocks(pd_server)
    decode = pd_server.server.cluster.dispatcher.workers["decode-0"]

    def on_worker(fn):
        return ray.get(decode.actor.__ray_call__.remote(fn), timeout=30)

    shape, dtype, model = on_worker(lambda w: (w.engine.kv_cache.payload_shape(2), w.engine.kv_cache.payload_dtype,
                                               w.engine.model_id))
    header = TransferHeader.describe("ipc-refused", model, shape, dtype)
    payload = torch.randn(shape).to(dtype)
    ray.get(decode.actor.reserve.remote("ipc-refused", 32, 60.0), timeout=30)
    try:
        gone = PayloadShare(payload)
        gone.close()  # as a share from a process the decode worker cannot map looks to it
        with pytest.raises(IpcUnavailable):
            ray.get(decode.actor.receive_shared.remote(header, gone.shared), timeout=30)
        with PayloadShare(payload) as share:  # the lease is still open: the KV arrives another way
            assert ray.get(decode.actor.receive_shared.remote(header, share.shared), timeout=30) == header.total_bytes
        assert torch.equal(on_worker(lambda w: w.engine.kv_cache.export_blocks(
            w.engine.request_block_ids("ipc-refused"))), payload)
    finally:
        ray.get(decode.actor.release.remote("ipc-refused"), timeout=30)
    assert _wait_free_blocks(pd_server, baseline) == baseline


@pytest.mark.timeout(60)
def test_a_reservation_over_the_free_blocks_reaches_the_caller_as_out_of_blocks(pd_server):
    """What the dispatcher's re-route and the gateway's 429 rely on: through Ray the refusal keeps its type
    and its counts (it once failed to unpickle in the caller, and the client got a 500), and holds nothing."""
    baseline = _settled_free_blocks(pd_server)
    decode = pd_server.server.cluster.dispatcher.workers["decode-0"]
    blocks = decode.info.total_blocks + 1
    with pytest.raises(OutOfBlocksError) as refused:
        # More than the whole cache: refused without waiting for room that can never come.
        asyncio.run(decode.reserve("over-the-free-blocks", blocks * decode.info.block_size, 60.0, 30.0, 10.0))
    assert refused.value.needed == blocks and refused.value.free < blocks
    # Its own message, which the gateway's 429 quotes: not Ray's, which is the worker's traceback, pid and IP.
    assert str(refused.value) == f"need {blocks} KV blocks, {refused.value.free} free"
    assert _settled_free_blocks(pd_server) == baseline


async def _reserved(decode, request_id: str, num_tokens: int, wait_s: float = 30.0) -> None:
    """Reserve, and when the reservation must wait for room, wait until it has it (as the KV push does)."""
    if not await decode.reserve(request_id, num_tokens, 60.0, wait_s, 10.0):
        await decode.actor.wait_for_lease.remote(request_id, 60.0)


async def _until_waiting(decode, leases: int, blocks: int, *waiters: asyncio.Task) -> None:
    """Until the decode worker's load report shows the reservations waiting, and the blocks they wait for."""
    while ((load := await decode.load(10.0)).waiting_leases, load.waiting_lease_blocks) != (leases, blocks):
        assert not any(w.done() for w in waiters), [w.exception() for w in waiters if w.done()]
        await asyncio.sleep(0.02)


def _on_a_full_decode_worker(pd_server, scenario):
    """The result of ``await scenario(decode, block_size, free)``, run while a reservation ``"hog"`` holds every free block
    of decode-0 (``scenario`` releases it, as a finishing sequence frees its blocks; else it is released
    after), then check that every block came back."""
    baseline = _settled_free_blocks(pd_server)
    decode = pd_server.server.cluster.dispatcher.workers["decode-0"]
    bs, free = decode.info.block_size, baseline["decode-0"]

    async def run():
        assert await decode.reserve("hog", free * bs, 60.0, 0.0, 10.0)
        try:
            return await scenario(decode, bs, free)
        finally:
            await decode.release("hog")

    result = pd_server.run(run())
    assert _wait_free_blocks(pd_server, baseline) == baseline
    return result


@pytest.mark.timeout(60)
def test_a_reservation_without_room_waits_for_the_blocks_a_finishing_request_frees(pd_server):
    """The router admits a request on decode blocks projected free by the end of its prefill, and the lease
    is taken before the prefill: it waits for them instead of being refused (a 429 before). While it waits
    the load report shows it and the blocks it waits for, which the router counts as taken."""
    async def scenario(decode, bs: int, free: int) -> None:
        waiter = asyncio.create_task(_reserved(decode, "waiter", 2 * bs))
        await _until_waiting(decode, 1, 2, waiter)
        await decode.release("hog")
        await waiter
        await decode.release("waiter")

    _on_a_full_decode_worker(pd_server, scenario)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("asked", ["before", "after"])
def test_a_released_waiting_reservation_gives_up_and_holds_nothing(pd_server, asked):
    """The request failed or was cancelled while its reservation waited: releasing it ends the wait, and the
    prefill worker's wait for the lease learns why, whether it asked before the release or after."""
    async def scenario(decode, bs: int, free: int) -> None:
        assert not await decode.reserve("gives-up", 2 * bs, 60.0, 30.0, 10.0)
        await _until_waiting(decode, 1, 2)
        if asked == "before":
            waiter = asyncio.ensure_future(decode.actor.wait_for_lease.remote("gives-up", 60.0))
            await asyncio.sleep(0.2)  # the wait has begun (a wait_for_lease sent after release is the other case)
        await decode.release("gives-up")
        if asked == "after":
            waiter = asyncio.ensure_future(decode.actor.wait_for_lease.remote("gives-up", 60.0))
        with pytest.raises(ReservationReleased, match="'gives-up' was released while it waited"):
            await waiter

    _on_a_full_decode_worker(pd_server, scenario)


@pytest.mark.timeout(60)
def test_a_large_waiting_reservation_is_not_starved_by_a_small_one_behind_it(pd_server):
    """Waiting reservations take blocks in arrival order: the small one does not take the first block
    freed, which would leave the large one short for as long as small ones keep coming."""
    async def scenario(decode, bs: int, free: int) -> None:
        large = asyncio.create_task(_reserved(decode, "large", free * bs))
        await _until_waiting(decode, 1, free, large)
        small = asyncio.create_task(_reserved(decode, "small", bs))
        await _until_waiting(decode, 2, free + 1, large, small)
        await decode.release("hog")
        await large  # it got every block: the small one, next in line, waits on
        assert not small.done()
        await decode.release("large")
        await small
        await decode.release("small")

    _on_a_full_decode_worker(pd_server, scenario)


@pytest.mark.timeout(60)
def test_a_reservation_behind_another_gives_up_at_its_deadline_or_release_and_the_line_moves_on(pd_server):
    """Those behind the first in line sleep until the line moves (they do not poll), yet one whose budget
    ends is refused on time, one released stops waiting at once, and neither holds anything or blocks
    the first, which gets its blocks when they free."""
    async def scenario(decode, bs: int, free: int) -> None:
        first = asyncio.create_task(_reserved(decode, "first", 2 * bs))
        await _until_waiting(decode, 1, 2, first)
        hurried = asyncio.create_task(_reserved(decode, "hurried", bs, wait_s=0.5))
        patient = asyncio.create_task(_reserved(decode, "patient", bs))
        await _until_waiting(decode, 3, 4, first, hurried, patient)
        started = time.monotonic()
        with pytest.raises(OutOfBlocksError):
            await hurried
        assert time.monotonic() - started < 5.0  # its budget, not the first's
        await decode.release("patient")
        with pytest.raises(ReservationReleased):
            await asyncio.wait_for(patient, 5.0)
        await _until_waiting(decode, 1, 2, first)
        await decode.release("hog")
        await first
        await decode.release("first")

    _on_a_full_decode_worker(pd_server, scenario)


def _handoff(pd_server, decode, request_id: str, prompt: list[int], reserve_wait_s: float,
             deadlines: Deadlines | None = None) -> asyncio.Task:
    """One disaggregated attempt from prefill-0 to ``decode``, as the dispatcher runs it; its tokens."""
    dispatcher = pd_server.server.cluster.dispatcher
    attempt = Attempt(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), 0, (),
                      None, 0, reserve_wait_s)

    async def tokens() -> list[int]:
        stream = run_disaggregated(attempt, dispatcher.workers["prefill-0"], decode,
                                   deadlines or dispatcher.deadlines, asyncio.Event(), lambda result: None)
        return [token async for event in stream for token in event.token_ids]

    return asyncio.create_task(tokens())


@pytest.mark.timeout(120)
def test_a_prompt_whose_lease_waits_is_computed_once_first_in_line_and_its_kv_follows_the_lease(pd_server):
    """The end of the wait for decode room overlaps the prefill: the prompt is computed once its reservation
    is first in line (not further back, where it would take the prefill worker from prompts that can be
    sent now), its KV leaves once the lease has its blocks, and the answer is the one the same prompt gets
    when there is room."""
    prefill = pd_server.server.cluster.dispatcher.workers["prefill-0"]
    prompt = random.Random(11).choices(range(3, 250), k=200)

    async def computed() -> int:
        return (await prefill.load(10.0)).prompt_tokens_computed

    async def scenario(decode, bs: int, free: int) -> list[int]:
        before = await computed()
        ahead = asyncio.create_task(_reserved(decode, "ahead", bs))
        await _until_waiting(decode, 1, 1, ahead)
        answer = _handoff(pd_server, decode, "overlapped", prompt, reserve_wait_s=30.0)
        await _until_waiting(decode, 2, 1 + -(-len(prompt) // bs), ahead, answer)
        await asyncio.sleep(1.0)  # the prefill worker is idle, yet the prompt second in line waits
        assert await computed() == before and not answer.done()
        await decode.release("ahead")  # it leaves the line: the prompt is first now
        with pytest.raises(ReservationReleased):
            await ahead
        while await computed() < before + len(prompt):
            assert not answer.done(), answer.exception()
            await asyncio.sleep(0.02)
        assert (await decode.load(10.0)).waiting_leases == 1 and not answer.done()  # computed, not yet sent
        await decode.release("hog")
        return await answer

    overlapped = _on_a_full_decode_worker(pd_server, scenario)
    with_room = pd_server.run(_collect(pd_server.server.cluster.dispatcher, "with-room", prompt, max_tokens=8))
    assert overlapped == with_room and len(overlapped) == 8


@pytest.mark.timeout(120)
def test_a_reservation_that_finds_no_room_in_time_fails_the_handoff_as_out_of_blocks_and_frees_both_sides(
        pd_server):
    """The prompt was computed, but the lease never got its blocks: the attempt fails with the decode worker's
    OutOfBlocksError, which the dispatcher routes again (resumable), and neither worker keeps any block."""
    prompt = random.Random(12).choices(range(3, 250), k=100)

    async def scenario(decode, bs: int, free: int) -> None:
        with pytest.raises(OutOfBlocksError) as refused:
            await _handoff(pd_server, decode, "no-room", prompt, reserve_wait_s=0.5)
        assert resumable(refused.value)

    _on_a_full_decode_worker(pd_server, scenario)


@pytest.mark.timeout(120)
def test_a_prompt_whose_lease_waits_past_the_prefill_deadline_fails_as_a_prefill_timeout_and_frees_both_sides(
        pd_server):
    """Second in line, the prompt waits to be computed; when the prefill's deadline passes first, the client is
    told the prefill timed out (a 504), not an unexplained error, and no block stays taken."""
    prompt = random.Random(13).choices(range(3, 250), k=100)
    deadlines = dataclasses.replace(pd_server.server.cluster.dispatcher.deadlines, prefill_s=2.0)

    async def scenario(decode, bs: int, free: int) -> None:
        ahead = asyncio.create_task(_reserved(decode, "ahead-of-a-deadline", bs))
        await _until_waiting(decode, 1, 1, ahead)
        try:
            with pytest.raises(PrefillTimeoutError, match="deadline of 2s"):
                await _handoff(pd_server, decode, "past-its-deadline", prompt, 30.0, deadlines)
        finally:
            await decode.release("ahead-of-a-deadline")
            with pytest.raises(ReservationReleased):
                await ahead

    _on_a_full_decode_worker(pd_server, scenario)


@pytest.mark.timeout(180)
def test_decode_worker_killed_before_handoff_fails_over(start_server):
    server = start_server(prefill=1, decode=2, kv_transport="grpc")
    try:
        dispatcher = server.server.cluster.dispatcher
        victim = dispatcher.workers["decode-0"]
        ray.kill(victim.actor)
        started = time.monotonic()
        outputs = _run_batch(server, _prompts(6, seed=3), "after-kill")
        assert all(len(tokens) == 12 for tokens in outputs)
        assert time.monotonic() - started < 120
        assert not any(s["alive"] for s in server.worker_stats() if s["id"] == "decode-0")
    finally:
        server.stop()
