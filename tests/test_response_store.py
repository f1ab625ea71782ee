"""The Responses API's store (services/response_store.py) on a real Redis: a chain of responses reads back
whole while each key holds only its own turn (memory linear in the chain's length), branches, token ids
rebuilt across turns that extend each other and restarted where a turn does not, ancestors living as long
as their newest descendant, a deleted response unreadable while its descendants stay whole, a chain
missing a link reading as expired, and records an earlier version wrote still read."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.messages import SessionSequence
from services.response_store import _KEY_PREFIX, ResponseStore

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]

FILLER = "tide " * 200  # about 1 kB a turn


def turn_items(i: int) -> tuple[dict, dict]:
    """(the user's input item of turn i, the response's output item)."""
    return ({"role": "user", "content": f"question {i}: {FILLER}"},
            {"type": "message", "id": f"msg_{i}", "role": "assistant", "content": [{"type": "output_text",
                                                                                     "text": f"answer {i}"}]})


def response(i: int, previous: str | None) -> dict:
    return {"id": f"resp_t{i}", "object": "response", "previous_response_id": previous,
            "output": [turn_items(i)[1]]}


async def store_chain(store: ResponseStore, n: int, ids_per_turn: int = 50) -> list[str]:
    """n responses, each continuing the last (the conversation and token ids as the gateway passes them)."""
    conversation: list[dict] = []
    ids: list[int] = []
    previous = None
    for i in range(n):
        conversation = [*conversation, turn_items(i)[0]]
        ids = [*ids, *range(i * 1000, i * 1000 + ids_per_turn)]
        resp = response(i, previous)
        await store.put(resp, conversation, SessionSequence(len(ids) - 10, ids))
        conversation = [*conversation, *resp["output"]]
        previous = resp["id"]
    return [f"resp_t{i}" for i in range(n)]


def run(redis_url: str, body):
    async def go():
        store = ResponseStore(redis_url, ttl_s=60)
        try:
            return await body(store)
        finally:
            await store.close()
    return asyncio.run(go())


def test_a_chain_reads_back_whole_while_each_key_holds_its_own_turn(redis_url, redis_client):
    async def body(store):
        ids = await store_chain(store, 20)
        return ids, await store.get(ids[-1]), await store.get(ids[4])

    ids, last, fifth = run(redis_url, body)
    expected = [item for i in range(19) for item in turn_items(i)] + [turn_items(19)[0]]
    assert last.conversation == expected and last.items == [*expected, turn_items(19)[1]]
    assert fifth.conversation == expected[:9]
    assert last.sequence.ids == [t for i in range(20) for t in range(i * 1000, i * 1000 + 50)]
    assert last.sequence.prompt_len == 20 * 50 - 10
    sizes = [redis_client.strlen(_KEY_PREFIX + i) for i in ids]
    assert max(sizes) < 1.5 * min(sizes)  # the 20th turn's key is about the first's: linear, not quadratic


def test_branches_and_a_turn_rendered_anew_restart_the_token_ids(redis_url, redis_client):
    async def body(store):
        await store_chain(store, 2)
        base = (await store.get("resp_t1")).items
        # two responses continue resp_t1; the second's prompt was rendered otherwise (new instructions)
        a = {"id": "resp_a", "previous_response_id": "resp_t1", "output": [{"type": "message", "id": "msg_a"}]}
        b = {"id": "resp_b", "previous_response_id": "resp_t1", "output": [{"type": "message", "id": "msg_b"}]}
        parent_ids = (await store.get("resp_t1")).sequence.ids
        await store.put(a, [*base, {"role": "user", "content": "a?"}], SessionSequence(1, [*parent_ids, 7, 8]))
        await store.put(b, [*base, {"role": "user", "content": "b?"}], SessionSequence(1, [9, 9, 9]))
        return base, parent_ids, await store.get("resp_a"), await store.get("resp_b")

    base, parent_ids, a, b = run(redis_url, body)
    assert a.conversation == [*base, {"role": "user", "content": "a?"}]
    assert b.conversation == [*base, {"role": "user", "content": "b?"}]
    assert a.sequence.ids == [*parent_ids, 7, 8] and b.sequence.ids == [9, 9, 9]


def test_ancestors_live_as_long_as_their_newest_descendant(redis_url, redis_client):
    async def body(store):
        await store_chain(store, 1)
        redis_client.pexpire(_KEY_PREFIX + "resp_t0", 2000)  # about to expire
        first = (await store.get("resp_t0")).items
        await store.put(response(1, "resp_t0"), [*first, turn_items(1)[0]])
        return await store.get("resp_t1")

    assert run(redis_url, body) is not None
    assert redis_client.pttl(_KEY_PREFIX + "resp_t0") > 50_000  # raised to the new response's 60 s


def test_a_deleted_response_is_gone_but_the_responses_continuing_it_stay_whole(redis_url, redis_client):
    async def body(store):
        await store_chain(store, 3)
        deleted = await store.delete("resp_t1")
        return deleted, await store.delete("resp_t1"), await store.get("resp_t1"), await store.get("resp_t2")

    deleted, again, gone, child = run(redis_url, body)
    assert deleted and not again and gone is None
    assert child.conversation == [item for i in range(2) for item in turn_items(i)] + [turn_items(2)[0]]


def test_a_chain_missing_a_link_reads_as_expired(redis_url, redis_client):
    async def body(store):
        await store_chain(store, 3)
        redis_client.delete(_KEY_PREFIX + "resp_t0")  # evicted under memory pressure, say
        return await store.get("resp_t2"), await store.get("resp_t1")

    assert run(redis_url, body) == (None, None)


def test_a_response_an_earlier_version_stored_reads_and_is_continued(redis_url, redis_client):
    old = {"response": response(0, None), "conversation": [turn_items(0)[0]],
           "turn": {"prompt_len": 40, "ids": list(range(50))}}
    redis_client.set(_KEY_PREFIX + "resp_t0", json.dumps(old), px=60_000)

    async def body(store):
        first = await store.get("resp_t0")
        await store.put(response(1, "resp_t0"), [*first.items, turn_items(1)[0]],
                        SessionSequence(90, [*first.sequence.ids, *range(100, 150)]))
        return first, await store.get("resp_t1")

    first, second = run(redis_url, body)
    assert first.conversation == [turn_items(0)[0]] and first.sequence.ids == list(range(50))
    assert second.conversation == [*turn_items(0), turn_items(1)[0]]
    assert second.sequence.ids == [*range(50), *range(100, 150)]

