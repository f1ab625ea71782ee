"""Stored responses of OpenAI's Responses API, in Redis: a client continues a conversation by naming the
last response (``previous_response_id``) instead of sending it whole, and reads or deletes a response by id.

One key per response holds the response object and only what its turn added: the input items after the
ones it continued (no instructions: OpenAI does not carry those over), and its turn's token ids after the
ones of the response it continued, when its prompt extended them. The key also lists the chain of responses
it continued, oldest first, so reading a response's whole conversation is two round trips (its key, then
every ancestor's at once) and a conversation of n turns takes memory linear in n, not quadratic. Storing a
response extends each ancestor's TTL to the new one's, so a chain lives as long as its newest response; a
chain missing a link (evicted) reads as expired. A response is written when it finishes (a background one
also when it starts) and never changed otherwise, so a chain needs no lock and two responses may continue
the same one (branches). Deleting a response makes it unreadable and no longer continuable, but its items
stay, until its TTL, for the responses that continued it, whose conversations include them. As with
sessions, the next prompt starts with the previous one and its answer, which the KV pool still holds.
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
# KEYS: the ancestors; ARGV[1]: a TTL in ms. Each key's TTL is raised to it, never lowered (PEXPIRE's GT
# option, which Redis gained only in 7.0).
_EXTEND = """
for _, key in ipairs(KEYS) do
  local left = redis.call('PTTL', key)
  if left >= 0 and left < tonumber(ARGV[1]) then redis.call('PEXPIRE', key, ARGV[1]) end
end
"""


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
    """Finished responses, each kept ``ttl_s`` seconds (and as long as a response continuing it)."""

    def __init__(self, redis_url: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a response store keeps responses for a positive time, got ttl_s={ttl_s}")
        self.ttl_s = ttl_s
        self._redis = gateway_redis(redis_url)
        self._extend = self._redis.register_script(_EXTEND)

    async def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
                  sequence: SessionSequence | None = None) -> None:
        """Keep ``response`` and the items that led to it (``sequence``: the turn as token ids, so a response
        continuing it finds its KV: ``chat_prompt.encode_chat``)."""
        parent_id = response.get("previous_response_id")
        chain = await self._chain(parent_id) if parent_id else None
        record: dict[str, Any] = {"response": response, "ancestors": [], "items": conversation, "turn": None,
                                  "deleted": False}
        if chain is not None:
            inherited = _conversation(chain, with_last_output=True)
            if conversation[:len(inherited)] == inherited:  # it continues the chain (it always should)
                record["ancestors"] = [*chain[-1]["ancestors"], parent_id]
                record["items"] = conversation[len(inherited):]
        if sequence is not None:
            turn = dataclasses.asdict(sequence)
            before = _token_ids(chain) if record["ancestors"] else None
            extends = before is not None and sequence.ids[:len(before)] == before
            record["turn"] = {**turn, "ids": turn["ids"][len(before):] if extends else turn["ids"],
                              "extends": extends}
        ttl_ms = int(self.ttl_s * 1000)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(_KEY_PREFIX + response["id"], json.dumps(record, ensure_ascii=False), px=ttl_ms)
            if record["ancestors"]:
                await self._extend(keys=[_KEY_PREFIX + a for a in record["ancestors"]], args=[ttl_ms], client=pipe)
            await pipe.execute()

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, expired, deleted, a link of its chain gone, or not an
        id this store makes)."""
        chain = await self._chain(response_id) if _VALID_ID.match(response_id) else None
        if chain is None or chain[-1]["deleted"]:
            return None
        turn = chain[-1]["turn"]
        if turn is not None:
            turn = {"prompt_len": turn["prompt_len"], "ids": _token_ids(chain)}
        return StoredResponse(chain[-1]["response"], _conversation(chain, with_last_output=False), turn)

    async def delete(self, response_id: str) -> bool:
        """Make the response unreadable and impossible to continue; False when there was none. Its items stay,
        until its TTL, for the responses that continued it."""
        key = _KEY_PREFIX + response_id
        value = await self._redis.get(key) if _VALID_ID.match(response_id) else None
        if value is None:
            return False
        record = _record(value)
        if record["deleted"]:
            return False
        record["deleted"] = True
        return bool(await self._redis.set(key, json.dumps(record, ensure_ascii=False), keepttl=True, xx=True))

    async def close(self) -> None:
        await self._redis.aclose()

    async def _chain(self, response_id: str) -> list[dict[str, Any]] | None:
        """The records of ``response_id``'s ancestors, then its own, oldest first; None when any is gone."""
        value = await self._redis.get(_KEY_PREFIX + response_id)
        if value is None:
            return None
        record = _record(value)
        ancestors = record["ancestors"]
        values = await self._redis.mget([_KEY_PREFIX + a for a in ancestors]) if ancestors else []
        if any(v is None for v in values):
            return None
        return [*(_record(v) for v in values), record]


def _record(value: str | bytes) -> dict[str, Any]:
    """A stored record; one an earlier version wrote (the whole conversation in each response) reads as a
    chain's first link, so a rolling upgrade keeps the responses stored before it."""
    record = json.loads(value)
    if "conversation" in record:
        turn = record["turn"]
        return {"response": record["response"], "ancestors": [], "items": record["conversation"],
                "turn": None if turn is None else {**turn, "extends": False}, "deleted": False}
    return record


def _conversation(chain: list[dict[str, Any]], with_last_output: bool) -> list[dict[str, Any]]:
    """The items of a chain, oldest first: each response's own items, then its output (the last one's only
    when asked: a response's conversation is what came before its output)."""
    items: list[dict[str, Any]] = []
    for i, record in enumerate(chain):
        items += record["items"]
        if with_last_output or i < len(chain) - 1:
            items += record["response"]["output"]
    return items


def _token_ids(chain: list[dict[str, Any]]) -> list[int] | None:
    """The last response's whole turn as token ids, its own after those of the turns it extends; None when it
    has none."""
    parts: list[list[int]] = []
    for record in reversed(chain):
        turn = record["turn"]
        if turn is None:
            return None
        parts.append(turn["ids"])
        if not turn["extends"]:
            return [t for part in reversed(parts) for t in part]
    return None  # (the oldest turn never extends another)
