"""Stored responses of OpenAI's Responses API, in Redis: a client continues a conversation by naming the
last response (``previous_response_id``) instead of sending it whole, and reads or deletes a response by id.

One key per response holds the response object and the conversation that led to it: every input and
output item of the chain, oldest first, without instructions (OpenAI does not carry those over). A
response is written once, when it has finished, and never changed, so a chain needs no lock and two
responses may continue the same one (branches). Each key holds its whole conversation, so continuing one is
a single GET; a key's size grows with the conversation, and the TTL (from its own finish) bounds how long
it is kept. As with sessions, the next prompt starts with the previous one and its answer, which the KV
pool still holds.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from services.messages import SessionSequence
from services.sessions import gateway_redis

_KEY_PREFIX = "tidepool:response:"
_VALID_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")  # ids land in Redis keys


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as it was returned
    conversation: list[dict[str, Any]]  # the items before its output, oldest first
    turn: dict[str, Any] | None = None  # its prompt's and answer's token ids (a SessionSequence's fields)

    @property
    def sequence(self) -> SessionSequence | None:
        return None if self.turn is None else SessionSequence(**self.turn)

    @property
    def items(self) -> list[dict[str, Any]]:
        """The conversation a response continuing this one starts from: its items, then its output."""
        return [*self.conversation, *self.response["output"]]


class ResponseStore:
    """Finished responses, each kept ``ttl_s`` seconds."""

    def __init__(self, redis_url: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a response store keeps responses for a positive time, got ttl_s={ttl_s}")
        self.ttl_s = ttl_s
        self._redis = gateway_redis(redis_url)

    async def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
                  sequence: SessionSequence | None = None) -> None:
        """Keep ``response`` and the items that led to it (``sequence``: the turn as token ids, so a response
        continuing it finds its KV: ``chat_prompt.encode_chat``)."""
        turn = None if sequence is None else dataclasses.asdict(sequence)
        value = json.dumps({"response": response, "conversation": conversation, "turn": turn}, ensure_ascii=False)
        await self._redis.set(_KEY_PREFIX + response["id"], value, px=int(self.ttl_s * 1000))

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, expired, deleted, or not an id this store makes)."""
        if not _VALID_ID.match(response_id):
            return None
        value = await self._redis.get(_KEY_PREFIX + response_id)
        return None if value is None else StoredResponse(**json.loads(value))

    async def delete(self, response_id: str) -> bool:
        """Forget the response; False when there was none. Responses that continued it keep their copy of
        the conversation."""
        return bool(_VALID_ID.match(response_id)) and bool(await self._redis.delete(_KEY_PREFIX + response_id))

    async def close(self) -> None:
        await self._redis.aclose()

