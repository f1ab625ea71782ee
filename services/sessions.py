"""Chat sessions: the conversation so far, kept in Redis, so a client sends only its new message(s).

One Redis list per session (one JSON message per item). A finished turn appends its new messages and the
assistant's reply in one step and refreshes the idle TTL; an idle session expires by itself.
Because the next prompt is the history plus the new messages, its prefix is the previous turn's prompt
and reply, which the KV pool still holds — that reuse is the point of keeping sessions server-side.

Turns of one session run one at a time, so each sees the one before it and the history keeps their
order: a turn holds the session's lock (``SET NX PX`` with an owner token, renewed while the turn runs)
from its start until it ends. A second turn meanwhile is refused (``SessionBusyError``, HTTP 409). The
appending and the release are one Lua script that checks the token, so a turn whose lock was lost (it
expired, or Redis restarted) stores nothing; any other end (cancel, failure) releases the lock alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from services.messages import SessionSequence, TokenEvent

log = logging.getLogger(__name__)

_KEY_PREFIX = "tidepool:session:"
_IDS_PREFIX = "tidepool:session-ids:"  # the last turn's token ids (JSON), for the next turn's prompt
_LOCK_PREFIX = "tidepool:session-lock:"
# Session ids land in Redis keys and logs: keep them short and printable.
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

# KEYS[1] the lock; ARGV[1] the owner's token (ARGV[2] a TTL in ms): only the owner renews or releases.
_RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end "
          "return 0")
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# KEYS[1] the history, KEYS[2] the lock, KEYS[3] the token ids; ARGV[1] the token, ARGV[2] the idle TTL in
# ms, ARGV[3] the turn's token ids ("": none), ARGV[4..] messages.
_COMMIT = """
if redis.call('get', KEYS[2]) ~= ARGV[1] then return 0 end
for i = 4, #ARGV do redis.call('rpush', KEYS[1], ARGV[i]) end
if #ARGV > 3 then redis.call('pexpire', KEYS[1], ARGV[2]) end
if ARGV[3] == '' then redis.call('del', KEYS[3]) else redis.call('set', KEYS[3], ARGV[3], 'PX', ARGV[2]) end
redis.call('del', KEYS[2])
return 1
"""


class InvalidSessionIdError(ValueError):
    """The session id is empty, too long or has characters outside [A-Za-z0-9._:-]."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"invalid session id {session_id[:40]!r}: use 1-128 characters from [A-Za-z0-9._:-]")


class SessionBusyError(Exception):
    """Another turn of the session is still running (turns of one session run one at a time)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} has a turn in progress: send the next turn after it finishes")
        self.session_id = session_id


def gateway_redis(redis_url: str) -> aioredis.Redis:
    """The gateway's connection to Redis for what it keeps there (sessions, stored responses). Short timeouts
    and one quick retry: a connection broken by a Redis restart is replaced on the next call, and while Redis
    is down a request fails in about a second instead of backing off for many."""
    return aioredis.Redis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=5.0,
                                   retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 1))


def _check_id(session_id: str) -> str:
    if not _VALID_ID.match(session_id):
        raise InvalidSessionIdError(session_id)
    return session_id


class SessionStore:
    """Per-session message history in Redis with an idle TTL of ``ttl_s`` seconds; turns hold a lock whose
    TTL, ``lock_ttl_s``, bounds how long a crashed gateway keeps a session busy."""

    def __init__(self, redis_url: str, ttl_s: float = 3600.0, lock_ttl_s: float = 30.0) -> None:
        self.ttl_s = ttl_s
        self.lock_ttl_s = lock_ttl_s
        self._redis = gateway_redis(redis_url)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)
        self._commit = self._redis.register_script(_COMMIT)

    async def history(self, session_id: str) -> list[dict]:
        """The session's messages, oldest first ([] for a new or expired session)."""
        items = await self._redis.lrange(_KEY_PREFIX + _check_id(session_id), 0, -1)
        return [json.loads(item) for item in items]

    async def last_sequence(self, session_id: str) -> SessionSequence | None:
        """The session's last turn as token ids (None when it has none stored)."""
        ids = await self._redis.get(_IDS_PREFIX + _check_id(session_id))
        return None if ids is None else SessionSequence(**json.loads(ids))

    async def begin_turn(self, session_id: str, messages: list[dict]) -> SessionTurn:
        """Take the session's lock for a turn that adds ``messages``; SessionBusyError while another runs."""
        lock = _LOCK_PREFIX + _check_id(session_id)
        token = secrets.token_hex(16)
        if not await self._redis.set(lock, token, nx=True, px=int(self.lock_ttl_s * 1000)):
            raise SessionBusyError(session_id)
        return SessionTurn(self, session_id, token, messages)

    async def delete(self, session_id: str) -> bool:
        """Forget the session; False when there was none."""
        session_id = _check_id(session_id)
        return bool(await self._redis.delete(_KEY_PREFIX + session_id, _IDS_PREFIX + session_id))

    async def close(self) -> None:
        await self._redis.aclose()


class SessionTurn:
    """One turn of a session, holding its lock: ``finish`` stores the turn, ``release`` gives it up, and
    ``run`` does one of them for a turn's token events however they end."""

    def __init__(self, store: SessionStore, session_id: str, token: str, messages: list[dict]) -> None:
        self.store, self.session_id, self.messages = store, session_id, messages
        self.prompt_ids: list[int] | None = None  # the turn's prompt, once built
        self._token = token
        self._lock = _LOCK_PREFIX + session_id

    async def finish(self, reply: str, reply_ids: list[int] | None = None) -> bool:
        """Append the turn's messages and ``reply`` (and keep the turn's token ids: its prompt's, then
        ``reply_ids``) and release the lock, in one step; False (nothing stored) when the lock was lost
        meanwhile."""
        rows = [json.dumps(m, ensure_ascii=False) for m in [*self.messages, {"role": "assistant", "content": reply}]]
        ids = "" if self.prompt_ids is None or reply_ids is None else json.dumps(
            {"prompt_len": len(self.prompt_ids), "ids": [*self.prompt_ids, *reply_ids]})
        stored = bool(await self.store._commit(
            keys=[_KEY_PREFIX + self.session_id, self._lock, _IDS_PREFIX + self.session_id],
            args=[self._token, int(self.store.ttl_s * 1000), ids, *rows]))
        if not stored:
            log.warning("session %s: the turn's lock was lost before it finished; its messages were not stored",
                        self.session_id)
        return stored

    async def release(self) -> None:
        """Give the lock up without storing anything (a Redis error leaves it to expire by its TTL)."""
        try:
            await self.store._release(keys=[self._lock], args=[self._token])
        except RedisError as exc:
            log.warning("session %s: releasing the turn's lock failed (%s); it expires by itself", self.session_id,
                        exc)

    async def _keep_alive(self) -> None:
        ttl_ms = int(self.store.lock_ttl_s * 1000)
        while True:
            await asyncio.sleep(self.store.lock_ttl_s / 3)
            try:
                if not await self.store._renew(keys=[self._lock], args=[self._token, ttl_ms]):
                    return  # lost: finish will store nothing
            except RedisError as exc:  # Redis is down: the next renewal may still come in time
                log.warning("session %s: renewing the turn's lock failed: %s", self.session_id, exc)

    async def run(self, events: AsyncIterator[TokenEvent], n: int) -> AsyncIterator[TokenEvent]:
        """Pass the turn's events (``n`` choices) through. Once every choice has finished (not aborted), the
        turn is stored, choice 0's text as the reply, before the last event goes on: a client that has seen
        the end of a turn finds it in the history. Any other end releases the lock."""
        keep_alive = asyncio.create_task(self._keep_alive())
        texts: list[str] = [""] * n
        reply_ids: list[int] = []  # choice 0's, the reply kept
        reasons: list[str | None] = [None] * n
        stored = False
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    texts[event.index] += event.text
                    if event.index == 0:
                        reply_ids += event.token_ids
                    reasons[event.index] = event.finish_reason
                    if not stored and all(r is not None and r != "abort" for r in reasons):
                        await self.finish(texts[0], reply_ids)  # releases the lock, stored or not
                        stored = True
                    yield event
        finally:
            keep_alive.cancel()
            if not stored:
                # Shielded: a second cancel of the consumer must not leave the lock held.
                await asyncio.shield(self.release())
