"""The load board (services/load_reports.py): the reports' format and its checks, when a worker writes, what a
read returns, and a board that comes back after a Redis restart."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time

import pytest
from live_helpers import wait_until

from router.loads import WorkerLoad
from services.load_reports import (
    ChangeSignal,
    InvalidLoadReportError,
    LoadBoard,
    LoadWriter,
    decode_load,
    encode_load,
    load_board_key,
)
from services.local_redis import LocalRedis

pytestmark = pytest.mark.timeout(60)

FULL = WorkerLoad(
    "decode-0", "decode", alive=True, report_seq=7, queued_prefills=((40, 16), (8, 0)), num_running=3,
    running_context_tokens=900, free_blocks=12, total_blocks=64, block_size=16, updated_at=1.5e9,
    steps=42, last_step_s=0.004, prefill_steps=((40, 1.0, 40.0, 1.0, 0.01),), decode_steps=((41, 3, 900, 0.004),),
    drafted_steps=((42, 3, 903, 0.005, 7),), waiting_leases=1, waiting_lease_blocks=3, num_waiting=2,
    prefix_cache_queries=100, prefix_cache_hits=50, prompt_tokens_computed=50, pool_hit_tokens={"redis": 16},
    spec_accepted_per_position=(3, 1), max_loras=2, running_loras=("crab",), waiting_loras=("crab", "kelp"),
)


def test_a_report_crosses_the_wire_unchanged():
    assert decode_load(encode_load(FULL)) == FULL
    assert decode_load(encode_load(WorkerLoad("prefill-0", "prefill"))) == WorkerLoad("prefill-0", "prefill")


def fields(**changes) -> bytes:
    return json.dumps({**json.loads(encode_load(FULL)), **changes}).encode()


@pytest.mark.parametrize("message, reason", [
    (b"\x80not json", "not JSON"),
    (b"[1, 2]", "a JSON list, not an object"),
    (fields(gpu_temperature=70), "unknown fields ['gpu_temperature']"),
    (json.dumps({"role": "decode"}).encode(), "missing fields ['worker_id']"),
    (fields(num_running="3"), "field 'num_running' is a str, not int"),
    (fields(alive=1), "field 'alive' is a int, not bool"),
    (fields(num_running=True), "field 'num_running' is a bool, not int"),
    (fields(last_step_s=None), "field 'last_step_s' is a NoneType, not int/float"),
    (fields(decode_steps=[[41, 3, {"x": 1}, 0.1]]), "field 'decode_steps' holds a dict"),
    (fields(pool_hit_tokens={"redis": [1]}), "field 'pool_hit_tokens' holds a list"),
    (fields(queued_features="abc"), "field 'queued_features' is a str, not list/NoneType"),
])
def test_a_message_that_is_not_a_load_report_is_refused_with_what_is_wrong(message, reason):
    with pytest.raises(InvalidLoadReportError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        decode_load(message)


class Reports:
    """A worker's reports, numbered as it takes them; ``free_blocks`` is what changes between them."""

    def __init__(self) -> None:
        self.free_blocks = 10
        self.numbers = itertools.count(1)
        self.taken = 0

    async def take(self) -> WorkerLoad:
        self.taken += 1
        return WorkerLoad("decode-0", "decode", free_blocks=self.free_blocks, report_seq=next(self.numbers))


async def read_until(board: LoadBoard, predicate, timeout_s: float = 20.0) -> list[WorkerLoad]:
    """Read the board until what it returns satisfies ``predicate``; every report read meanwhile."""
    got: list[WorkerLoad] = []
    async with asyncio.timeout(timeout_s):
        while True:
            got += await board.read() or []
            if predicate(got):
                return got
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(work):
    task = asyncio.create_task(work)
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_notice_from_another_thread_ends_the_wait_armed_before_it_and_an_unarmed_one_schedules_nothing():
    """Armed before the report is read, a notice that comes meanwhile still ends the next wait; unarmed (the
    writer not waiting for one), a notice schedules nothing."""

    async def scenario() -> None:
        signal = ChangeSignal(asyncio.get_running_loop())
        signal.arm()
        notifier = threading.Thread(target=signal.notify)  # as the engine thread does after a step
        notifier.start()
        notifier.join()
        async with asyncio.timeout(10):
            await signal.wait(3600.0)
        signal.notify()  # not armed again: nothing is scheduled (a set scheduled now would end the wait below)
        signal.arm()
        start = time.monotonic()
        await signal.wait(0.2)  # nothing changed since arming: the whole wait
        assert time.monotonic() - start >= 0.2

    asyncio.run(scenario())


def test_a_change_while_the_report_is_taken_is_written_next_not_at_the_heartbeat(redis_url):
    """The engine steps while the writer takes the report: the report misses the step, and the step's
    notice must still wake the writer for the next one."""
    key = load_board_key("race")
    reports = Reports()

    async def scenario() -> list[WorkerLoad]:
        changed = ChangeSignal(asyncio.get_running_loop())

        async def take_while_stepping() -> WorkerLoad:
            load = await reports.take()
            if reports.taken == 1:
                reports.free_blocks = 9
                changed.notify()
            return load

        board = LoadBoard(redis_url, key)
        writer = LoadWriter(redis_url, key, take_while_stepping, changed, interval_s=0.01, heartbeat_s=3600.0)
        async with running(writer.run()):
            got = await read_until(board, lambda got: any(r.free_blocks == 9 for r in got), 10)
        await board.close()
        return got

    assert [r.free_blocks for r in asyncio.run(scenario())][-1] == 9


def test_a_worker_writes_a_changed_report_at_once_and_an_unchanged_one_only_as_a_heartbeat(redis_url,
                                                                                             redis_client):
    key = load_board_key("changes")
    reports = Reports()

    async def scenario() -> None:
        board = LoadBoard(redis_url, key)
        changed = ChangeSignal(asyncio.get_running_loop())
        quiet = LoadWriter(redis_url, key, reports.take, changed, interval_s=0.01, heartbeat_s=3600.0)
        async with running(quiet.run()):
            first = await read_until(board, bool)
            assert 0 < redis_client.pttl(key) <= 60_000  # a crashed cluster's board expires
            await asyncio.sleep(0.3)  # no notice: the report is not even taken
            assert reports.taken == 1
            changed.notify()  # a notice, but the report is the same: taken, not written
            async with asyncio.timeout(10):
                while reports.taken < 2:
                    await asyncio.sleep(0.01)
            assert await board.read() == [] and quiet.writes == 1
            reports.free_blocks = 9
            changed.notify()
            again = await read_until(board, bool)
        assert [r.free_blocks for r in first + again] == [10, 9]
        assert again[0].report_seq > first[0].report_seq
        beating = LoadWriter(redis_url, key, reports.take, changed, interval_s=0.01, heartbeat_s=0.05)
        async with running(beating.run()):
            beats = await read_until(board, lambda got: len(got) >= 3)  # the same report, newly numbered
        assert {r.free_blocks for r in beats} == {9}
        assert sorted({r.report_seq for r in beats}) == [r.report_seq for r in beats]
        await board.close()

    asyncio.run(scenario())


def test_the_board_returns_what_changed_refuses_what_is_not_a_report_and_drops_removed_workers(
        redis_url, redis_client):
    key = load_board_key("board")
    redis_client.hset(key, mapping={"decode-0": encode_load(WorkerLoad("decode-0", "decode", report_seq=1)),
                                    "intruder": b"{not a report"})

    board = LoadBoard(redis_url, key)

    async def scenario() -> tuple[list, list, list]:
        first, unchanged = await board.read(), await board.read()
        board.forget("decode-0")
        after_forget = await board.read()
        await board.close()
        return first, unchanged, after_forget

    first, unchanged, after_forget = asyncio.run(scenario())
    assert [r.worker_id for r in first] == ["decode-0"] and unchanged == [] and after_forget == []
    assert board.rejected == 1  # the intruder's value, refused once: it never changed
    assert not redis_client.hexists(key, "decode-0") and redis_client.hexists(key, "intruder")


@pytest.mark.timeout(90)
def test_the_board_is_unreadable_while_redis_restarts_and_reports_come_again_after():
    """The private redis-server dies and its watcher starts it again (empty): meanwhile a read says there is no
    board (the dispatcher asks the workers then); after, the worker's next writes are read again."""
    key = load_board_key("restart")
    reports = Reports()
    with LocalRedis(restart_on_exit=True) as server:
        async def scenario() -> None:
            board = LoadBoard(server.url, key)
            writer = LoadWriter(server.url, key, reports.take, ChangeSignal(asyncio.get_running_loop()),
                                interval_s=0.01, heartbeat_s=0.05)
            async with running(writer.run()):
                await read_until(board, bool)
                server.kill()
                async with asyncio.timeout(30):
                    while await board.read() is not None:
                        await asyncio.sleep(0.01)
                assert not board.readable
                await asyncio.to_thread(wait_until, lambda: server.restarts == 1, 30)
                reports.free_blocks = 3  # taken only after the restart
                await read_until(board, lambda got: any(r.free_blocks == 3 for r in got), 30)
                assert board.readable
            await board.close()

        asyncio.run(scenario())
