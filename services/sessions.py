"""Chat sessions: the conversation so far, kept in Redis, so a client sends only its new message(s).

One Redis list per session (one JSON message per item). A finished turn appends its new messages and the
assistant's reply in one transaction and refreshes the idle TTL; an idle session expires by itself.
Because the next prompt is the history plus the new messages, its prefix is the previous turn's prompt
and reply, which the KV pool still holds — that reuse is the point of keeping sessions server-side.
"""

from __future__ import annotations

import json
import re

import redis.asyncio as aioredis

_KEY_PREFIX = "tidepool:session:"
# Session ids land in Redis keys and logs: keep them short and printable.
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class InvalidSessionIdError(ValueError):
    """The session id is empty, too long or has characters outside [A-Za-z0-9._:-]."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"invalid session id {session_id[:40]!r}: use 1-128 characters from [A-Za-z0-9._:-]")


class SessionStore:
    """Per-session message history in Redis with an idle TTL of ``ttl_s`` seconds."""

    def __init__(self, redis_url: str, ttl_s: float = 3600.0) -> None:
        self.ttl_s = ttl_s
        self._redis = aioredis.Redis.from_url(redis_url)

    @staticmethod
    def _key(session_id: str) -> str:
        if not _VALID_ID.match(session_id):
            raise InvalidSessionIdError(session_id)
        return _KEY_PREFIX + session_id

    async def history(self, session_id: str) -> list[dict]:
        """The session's messages, oldest first ([] for a new or expired session)."""
        items = await self._redis.lrange(self._key(session_id), 0, -1)
        return [json.loads(item) for item in items]

    async def append(self, session_id: str, messages: list[dict]) -> None:
        """Add a finished turn's messages and restart the idle clock."""
        key = self._key(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            if messages:
                pipe.rpush(key, *(json.dumps(m, ensure_ascii=False) for m in messages))
            pipe.pexpire(key, int(self.ttl_s * 1000))
            await pipe.execute()

    async def delete(self, session_id: str) -> bool:
        """Forget the session; False when there was none."""
        return bool(await self._redis.delete(self._key(session_id)))

    async def close(self) -> None:
        await self._redis.aclose()
