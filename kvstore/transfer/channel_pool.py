"""Open KV channels by peer, bounded: at most ``max_open``, least recently used evicted, idle ones closed.

A worker meets many peers over a cluster's life (N prefill x M decode pairs, replacements with new
addresses); each collective channel holds a process group with its sockets and threads. The pool keeps
the ones in use: a channel is *held* while a transfer needs it (until ``release``, or its hold's deadline
for a peer that vanished), and only channels not held are evicted, to make room or after ``idle_s``
unused. Eviction calls ``on_close(peer, channel)`` outside the pool's lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstore.transfer import TransferRejected

C = TypeVar("C")


@dataclass(frozen=True)
class ChannelUse:
    """What a worker's pool holds now, against its bound (``tidepool status``-style reporting, tests)."""

    open_channels: int
    transfer_threads: int  # live threads of the pool's transfers (named by their executor's prefix)
    bound: int


@dataclass
class _Entry(Generic[C]):
    channel: C
    last_used: float
    held_until: float = 0.0  # monotonic; a hold past its deadline no longer protects the channel


class ChannelPool(Generic[C]):
    def __init__(self, max_open: int, idle_s: float, on_close: Callable[[str, C], None]) -> None:
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        self.max_open, self.idle_s, self._on_close = max_open, idle_s, on_close
        self._entries: OrderedDict[str, _Entry[C]] = OrderedDict()
        self._lock = threading.Lock()  # the actor's event loop and transfer threads both use the pool

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, peer: str) -> C | None:
        with self._lock:
            entry = self._entries.get(peer)
            if entry is None:
                return None
            self._entries.move_to_end(peer)
            entry.last_used = time.monotonic()
            return entry.channel

    def hold(self, peer: str, channel: C, until: float) -> None:
        """Add (or keep) ``channel`` for ``peer``, held until ``release`` or the monotonic ``until``.

        Raises TransferRejected when the pool is full of held channels: no transfer's channel is closed
        under it; the caller fails this transfer (or uses another transport) instead.
        """
        now = time.monotonic()
        with self._lock:
            evicted = []
            entry = self._entries.pop(peer, None)
            if entry is not None and entry.channel is not channel:
                evicted.append((peer, entry.channel))  # replaced: a broken or stale channel
            while len(self._entries) >= self.max_open:
                victim = next((p for p, e in self._entries.items() if e.held_until < now), None)
                if victim is None:
                    break
                evicted.append((victim, self._entries.pop(victim).channel))
            admitted = len(self._entries) < self.max_open
            if admitted:
                self._entries[peer] = _Entry(channel, now, until)
            else:
                evicted.append((peer, channel))
        self._close(evicted)
        if not admitted:
            raise TransferRejected(f"all {self.max_open} KV channels are held by transfers in flight; "
                                   f"retry later or raise --max-kv-channels")

    def release(self, peer: str, channel: C) -> None:
        """The transfer on ``channel`` ended: it may be evicted from now on."""
        with self._lock:
            entry = self._entries.get(peer)
            if entry is not None and entry.channel is channel:
                entry.held_until, entry.last_used = 0.0, time.monotonic()

    def pop(self, peer: str) -> C | None:
        """Forget ``peer``'s channel without closing it (the caller closes it)."""
        with self._lock:
            entry = self._entries.pop(peer, None)
        return None if entry is None else entry.channel

    def close_idle(self, now: float | None = None) -> list[str]:
        """Close every channel not held and unused for ``idle_s``; returns their peers."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [p for p, e in self._entries.items() if e.held_until < now and now - e.last_used >= self.idle_s]
            evicted = [(p, self._entries.pop(p).channel) for p in idle]
        self._close(evicted)
        return idle

    def use(self, thread_prefix: str) -> ChannelUse:
        threads = sum(t.name.startswith(thread_prefix) for t in threading.enumerate())
        return ChannelUse(len(self._entries), threads, self.max_open)

    def close_all(self) -> None:
        with self._lock:
            evicted = [(p, e.channel) for p, e in self._entries.items()]
            self._entries.clear()
        self._close(evicted)

    def _close(self, evicted: list[tuple[str, C]]) -> None:
        for peer, channel in evicted:
            self._on_close(peer, channel)
