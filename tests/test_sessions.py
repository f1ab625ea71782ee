"""Chat sessions in Redis: history in order, turns appended whole, idle expiry, delete."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.sessions import InvalidSessionIdError, SessionStore

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def run(coro):
    return asyncio.run(coro)


async def _with_store(redis_url: str, ttl_s: float, body):
    store = SessionStore(redis_url, ttl_s=ttl_s)
    try:
        return await body(store)
    finally:
        await store.close()


def test_new_session_has_empty_history(redis_client, redis_url):
    assert run(_with_store(redis_url, 60, lambda s: s.history("fresh"))) == []


def test_turns_accumulate_in_order(redis_client, redis_url):
    turn1 = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello ✓"}]
    turn2 = [{"role": "user", "content": "again"}, {"role": "assistant", "content": "sure"}]

    async def body(store: SessionStore):
        await store.append("s1", turn1)
        await store.append("s1", turn2)
        return await store.history("s1")

    assert run(_with_store(redis_url, 60, body)) == turn1 + turn2


def test_sessions_are_separate(redis_client, redis_url):
    async def body(store: SessionStore):
        await store.append("a", [{"role": "user", "content": "for a"}])
        return await store.history("b")

    assert run(_with_store(redis_url, 60, body)) == []


def test_each_turn_refreshes_the_idle_ttl(redis_client, redis_url):
    async def body(store: SessionStore):
        await store.append("t", [{"role": "user", "content": "x"}])
        return await store._redis.pttl("tidepool:session:t")

    ttl_ms = run(_with_store(redis_url, 30, body))
    assert 0 < ttl_ms <= 30_000


def test_idle_session_expires(redis_client, redis_url):
    async def write(store: SessionStore):
        await store.append("short", [{"role": "user", "content": "x"}])

    run(_with_store(redis_url, 0.2, write))
    deadline = time.monotonic() + 10
    while run(_with_store(redis_url, 0.2, lambda s: s.history("short"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run(_with_store(redis_url, 0.2, lambda s: s.history("short"))) == []


def test_delete_forgets_the_session(redis_client, redis_url):
    async def body(store: SessionStore):
        await store.append("d", [{"role": "user", "content": "x"}])
        first = await store.delete("d")
        second = await store.delete("d")
        return first, second, await store.history("d")

    assert run(_with_store(redis_url, 60, body)) == (True, False, [])


@pytest.mark.parametrize("bad", ["", "has space", "x" * 129, "a/b"])
def test_invalid_session_ids_are_refused(redis_client, redis_url, bad):
    with pytest.raises(InvalidSessionIdError):
        run(_with_store(redis_url, 60, lambda s: s.history(bad)))
