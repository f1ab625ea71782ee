"""Chat sessions in Redis: history in order, turns stored whole, idle expiry, delete, and one turn at a time
(a per-session lock: refused while held, released on finish, cancel and failure, expiring if abandoned)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
from live_helpers import wait_until

from services.messages import TokenEvent
from services.sessions import InvalidSessionIdError, SessionBusyError, SessionStore

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

USER = {"role": "user", "content": "hi"}


def run(coro):
    return asyncio.run(coro)


async def _with_store(redis_url: str, body, ttl_s: float = 60, lock_ttl_s: float = 30):
    store = SessionStore(redis_url, ttl_s=ttl_s, lock_ttl_s=lock_ttl_s)
    try:
        return await body(store)
    finally:
        await store.close()


async def _turn(store: SessionStore, session_id: str, text: str, reply: str) -> bool:
    turn = await store.begin_turn(session_id, [{"role": "user", "content": text}])
    return await turn.finish(reply)


def event(index: int, text: str, finish_reason: str | None = None) -> TokenEvent:
    return TokenEvent(index=index, token_ids=[1], finish_reason=finish_reason, num_prompt_tokens=4,
                      num_cached_tokens=0, text=text)


async def events_of(items: list[TokenEvent], pause_s: float = 0.0, fail: Exception | None = None):
    for item in items:
        await asyncio.sleep(pause_s)
        yield item
    if fail is not None:
        raise fail


async def drain(stream) -> list[TokenEvent]:
    return [e async for e in stream]


# ---- history --------------------------------------------------------------------------------------------------
def test_new_session_has_empty_history(redis_client, redis_url):
    assert run(_with_store(redis_url, lambda s: s.history("fresh"))) == []


def test_turns_accumulate_in_order(redis_client, redis_url):
    async def body(store: SessionStore):
        assert await _turn(store, "s1", "hi", "hello ✓")
        assert await _turn(store, "s1", "again", "sure")
        return await store.history("s1")

    assert run(_with_store(redis_url, body)) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello ✓"},
        {"role": "user", "content": "again"}, {"role": "assistant", "content": "sure"}]


def test_sessions_are_separate(redis_client, redis_url):
    async def body(store: SessionStore):
        await _turn(store, "a", "for a", "ok")
        return await store.history("b")

    assert run(_with_store(redis_url, body)) == []


def test_each_turn_refreshes_the_idle_ttl(redis_client, redis_url):
    async def body(store: SessionStore):
        await _turn(store, "t", "x", "y")
        return await store._redis.pttl("tidepool:session:t")

    ttl_ms = run(_with_store(redis_url, body, ttl_s=30))
    assert 0 < ttl_ms <= 30_000


def test_idle_session_expires(redis_client, redis_url):
    run(_with_store(redis_url, lambda s: _turn(s, "short", "x", "y"), ttl_s=0.2))
    deadline = time.monotonic() + 10
    while run(_with_store(redis_url, lambda s: s.history("short"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run(_with_store(redis_url, lambda s: s.history("short"))) == []


def test_delete_forgets_the_session(redis_client, redis_url):
    async def body(store: SessionStore):
        await _turn(store, "d", "x", "y")
        first = await store.delete("d")
        second = await store.delete("d")
        return first, second, await store.history("d")

    assert run(_with_store(redis_url, body)) == (True, False, [])


@pytest.mark.parametrize("bad", ["", "has space", "x" * 129, "a/b"])
def test_invalid_session_ids_are_refused(redis_client, redis_url, bad):
    with pytest.raises(InvalidSessionIdError):
        run(_with_store(redis_url, lambda s: s.history(bad)))
    with pytest.raises(InvalidSessionIdError):
        run(_with_store(redis_url, lambda s: s.begin_turn(bad, [USER])))


# ---- one turn at a time ------------------------------------------------------------------------------------------
def test_a_second_turn_is_refused_while_the_first_runs(redis_client, redis_url):
    async def body(store: SessionStore):
        first = await store.begin_turn("busy", [USER])
        with pytest.raises(SessionBusyError, match="turn in progress"):
            await store.begin_turn("busy", [USER])
        await store.begin_turn("other", [USER])  # other sessions are not held up
        await first.finish("done")
        second = await store.begin_turn("busy", [{"role": "user", "content": "next"}])
        await second.finish("done too")
        return await store.history("busy")

    assert [m["content"] for m in run(_with_store(redis_url, body))] == ["hi", "done", "next", "done too"]


def test_a_turn_run_to_its_end_stores_choice_zeros_reply_before_its_last_event(redis_client, redis_url):
    async def body(store: SessionStore):
        turn = await store.begin_turn("ran", [USER])
        stream = [event(0, "hel"), event(1, "other"), event(0, "lo", "stop"), event(1, "!", "length"),
                  event(1, "", "length")]  # a straggler after the end changes nothing
        seen, history_at_end = [], None
        async for e in turn.run(events_of(stream), n=2):
            seen.append(e)
            if len(seen) == 4:  # the last choice's end: the turn is stored and the session free already
                history_at_end = await store.history("ran")
                await (await store.begin_turn("ran", [USER])).release()
        assert seen == stream  # passed through unchanged
        return history_at_end, await store.history("ran")

    at_end, after = run(_with_store(redis_url, body))
    assert at_end == after == [USER, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("ending", ["failure", "cancel", "abort", "unfinished"])
def test_a_turn_that_does_not_complete_frees_the_session_and_stores_nothing(redis_client, redis_url, ending):
    async def body(store: SessionStore):
        turn = await store.begin_turn("cut", [USER])
        first = [event(0, "partial")]
        if ending == "failure":
            with pytest.raises(RuntimeError, match="worker died"):
                await drain(turn.run(events_of(first, fail=RuntimeError("worker died")), n=1))
        elif ending == "cancel":
            task = asyncio.create_task(drain(turn.run(events_of(first + [event(0, "x")], pause_s=30), n=1)))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        elif ending == "abort":
            await drain(turn.run(events_of([event(0, "partial", "abort")]), n=1))
        else:  # the events end before the choice finished
            await drain(turn.run(events_of(first), n=1))
        await (await store.begin_turn("cut", [USER])).release()  # raises SessionBusyError if still held
        return await store.history("cut")

    assert run(_with_store(redis_url, body)) == []


def test_a_running_turn_keeps_the_session_past_the_lock_ttl(redis_client, redis_url):
    async def body(store: SessionStore):
        turn = await store.begin_turn("long", [USER])
        stream = [event(0, "a"), event(0, "b"), event(0, "c", "stop")]
        running = asyncio.create_task(drain(turn.run(events_of(stream, pause_s=0.4), n=1)))
        await asyncio.sleep(0.9)  # three lock TTLs
        with pytest.raises(SessionBusyError):
            await store.begin_turn("long", [USER])
        await running
        return await store.history("long")

    history = run(_with_store(redis_url, body, lock_ttl_s=0.3))
    assert history == [USER, {"role": "assistant", "content": "abc"}]


def test_an_abandoned_turn_frees_the_session_after_the_lock_ttl(redis_client, redis_url):
    async def body(store: SessionStore):
        await store.begin_turn("crashed", [USER])  # its owner never ends it (a gateway that died)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                return await store.begin_turn("crashed", [USER])
            except SessionBusyError:
                await asyncio.sleep(0.05)
        return None

    assert run(_with_store(redis_url, body, lock_ttl_s=0.3)) is not None


def test_a_turn_that_lost_its_lock_stores_nothing_and_leaves_the_new_owner_alone(redis_client, redis_url):
    async def body(store: SessionStore):
        stale = await store.begin_turn("lost", [{"role": "user", "content": "stale"}])
        await asyncio.sleep(0.5)  # its lock expired (it was never renewed)
        fresh = await store.begin_turn("lost", [{"role": "user", "content": "fresh"}])
        assert await stale.finish("late reply") is False
        await stale.release()  # not the owner any more: no effect
        with pytest.raises(SessionBusyError):
            await store.begin_turn("lost", [USER])
        assert await fresh.finish("on time")
        return await store.history("lost")

    history = run(_with_store(redis_url, body, lock_ttl_s=0.2))
    assert [m["content"] for m in history] == ["fresh", "on time"]


# ---- through the HTTP API ------------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.timeout(240)
def test_concurrent_turns_of_one_session_get_409_and_the_history_keeps_turn_order(live_server):
    sid = f"order-{uuid.uuid4().hex}"
    url = f"{live_server.http_url}/v1/chat/completions"

    def body(text: str, max_tokens: int, stream: bool = False) -> dict:
        return {"model": live_server.model_id, "messages": [{"role": "user", "content": text}], "stream": stream,
                "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "session_id": sid}

    with httpx.Client(timeout=120) as http:
        with http.stream("POST", url, json=body("first", 200, stream=True)) as first:
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # the turn is running
            busy = http.post(url, json=body("second", 4))
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"
            first_text = "".join(_sse_texts(lines))
        second = http.post(url, json=body("second", 4))  # the first turn ended: its reply is stored
        assert second.status_code == 200, second.text

        with http.stream("POST", url, json=body("cancelled", 200, stream=True)) as cancelled:
            assert next(line for line in cancelled.iter_lines() if line.startswith("data:"))
        # The client left mid-turn: the session is free again, and the cancelled turn left nothing behind.
        assert wait_until(lambda: http.post(url, json=body("third", 4)).status_code == 200, 60)

    history = asyncio.run(_with_store(live_server.server.cluster.redis_url, lambda s: s.history(sid)))
    assert [m["content"] for m in history if m["role"] == "user"] == ["first", "second", "third"]
    assert history[1] == {"role": "assistant", "content": first_text}


def _sse_texts(lines):
    for line in lines:
        if line.startswith("data:") and line != "data: [DONE]":
            for choice in json.loads(line[5:])["choices"]:
                yield choice["delta"].get("content") or ""
