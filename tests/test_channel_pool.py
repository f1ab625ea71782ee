"""The bounded pool of KV channels (``kvstore/transfer/channel_pool.py``): LRU eviction, holds, idle close."""

from __future__ import annotations

import time

import pytest

from kvstore.transfer import TransferRejected
from kvstore.transfer.channel_pool import ChannelPool

pytestmark = pytest.mark.timeout(30)


class Channel:
    def __init__(self, name: str) -> None:
        self.name, self.closed = name, False


def pool_of(max_open: int, idle_s: float = 60.0) -> tuple[ChannelPool[Channel], list[str]]:
    closed: list[str] = []

    def close(peer: str, channel: Channel) -> None:
        channel.closed = True
        closed.append(peer)

    return ChannelPool(max_open, idle_s, close), closed


def test_the_least_recently_used_channel_is_closed_to_make_room():
    pool, closed = pool_of(2)
    a, b, c = Channel("a"), Channel("b"), Channel("c")
    pool.hold("a", a, 0.0)
    pool.hold("b", b, 0.0)
    assert pool.get("a") is a  # "a" used last: "b" is the least recently used now
    pool.hold("c", c, 0.0)
    assert closed == ["b"] and b.closed and not a.closed
    assert len(pool) == 2 and pool.get("b") is None and pool.get("c") is c


def test_a_held_channel_is_never_evicted_and_a_full_pool_refuses_the_newcomer():
    pool, closed = pool_of(1)
    busy, newcomer = Channel("busy"), Channel("new")
    pool.hold("a", busy, time.monotonic() + 60)
    with pytest.raises(TransferRejected, match="1 KV channels are held"):
        pool.hold("b", newcomer, time.monotonic() + 60)
    assert newcomer.closed and not busy.closed and closed == ["b"]  # nobody owns the refused one
    pool.release("a", busy)
    pool.hold("b", newcomer, time.monotonic() + 60)
    assert busy.closed and pool.get("b") is newcomer


def test_a_hold_past_its_deadline_no_longer_protects_the_channel():
    pool, closed = pool_of(1)
    pool.hold("a", Channel("a"), time.monotonic() - 1)  # its transfer's peer vanished
    pool.hold("b", Channel("b"), time.monotonic() + 60)
    assert closed == ["a"]


def test_replacing_a_peers_channel_closes_the_old_one():
    pool, closed = pool_of(4)
    old, new = Channel("old"), Channel("new")
    pool.hold("a", old, 0.0)
    pool.hold("a", old, 0.0)  # the same channel again: kept
    assert closed == []
    pool.hold("a", new, 0.0)
    assert old.closed and pool.get("a") is new and len(pool) == 1


def test_idle_channels_are_closed_and_held_ones_kept():
    pool, closed = pool_of(4, idle_s=10)
    pool.hold("idle", Channel("idle"), 0.0)
    pool.hold("busy", Channel("busy"), time.monotonic() + 60)
    assert pool.close_idle(time.monotonic() + 5) == []
    assert pool.close_idle(time.monotonic() + 11) == ["idle"]
    assert closed == ["idle"] and pool.get("busy") is not None


def test_pop_forgets_without_closing_and_close_all_closes_the_rest():
    pool, closed = pool_of(4)
    a, b = Channel("a"), Channel("b")
    pool.hold("a", a, 0.0)
    pool.hold("b", b, 0.0)
    assert pool.pop("a") is a and not a.closed and pool.pop("a") is None
    pool.close_all()
    assert closed == ["b"] and len(pool) == 0


def test_the_bound_must_be_positive():
    with pytest.raises(ValueError, match="max_open"):
        pool_of(0)
