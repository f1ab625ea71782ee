"""The load board: each worker writes its load report into one Redis hash per cluster, and the router reads
them all with one command, instead of asking every worker with a Ray call.

Asking costs the gateway about a millisecond of CPU per worker per ask (``benchmarks/load_reports.py``): at 20
asks a second, 50 busy workers would take its whole event loop. A worker writes its report when it changes (its
engine took new stats, its reservations moved: a ``ChangeSignal`` wakes the writer), at most every
``interval_s``, and at least every ``heartbeat_s``; the dispatcher reads the board on its own rhythm (every 50
ms while requests run) and decodes only the reports that changed. A worker's report numbers
(``WorkerLoad.report_seq``) advance with each write, so one whose number stops is silent: the dispatcher asks
it directly (the call finds a dead worker out), as it asks everyone while the board can't be read.

Reports are JSON, checked field by field as read: whatever else writes to the hash can't make the router
read a malformed report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.loads import WorkerLoad
from services.background import cancel_requested

log = logging.getLogger(__name__)

WRITE_INTERVAL_S = 0.025  # at most one write this often: a busy engine's every step changes the report
HEARTBEAT_S = 0.25  # an unchanged report is written again (newly numbered) this often
_BOARD_TTL_MS = 60_000  # the board outlives its last write by this much: a crashed cluster's goes away

_FIELDS = {f.name: f for f in dataclasses.fields(WorkerLoad)}


class InvalidLoadReportError(ValueError):
    """A value on the load board that is not a load report."""


def load_board_key(cluster_id: str) -> str:
    """The Redis hash a cluster's workers write their load reports in (field: the worker's id)."""
    return f"tidepool:{cluster_id}:loads"


def encode_load(load: WorkerLoad) -> bytes:
    return json.dumps({name: getattr(load, name) for name in _FIELDS}, separators=(",", ":")).encode()


def _check_type(name: str, value: object) -> None:
    default = _FIELDS[name].default
    if _FIELDS[name].default_factory is not dataclasses.MISSING:
        expected: tuple[type, ...] = (dict,)
    elif default is dataclasses.MISSING:
        expected = (str,)  # worker_id, role
    elif default is None:
        expected = (list, type(None))
    elif isinstance(default, bool):
        expected = (bool,)
    elif isinstance(default, float):
        expected = (int, float)
    elif isinstance(default, tuple):
        expected = (list,)
    else:
        expected = (type(default),)
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
        raise InvalidLoadReportError(f"field {name!r} is a {type(value).__name__}, not "
                                     f"{'/'.join(t.__name__ for t in expected)}")
    if isinstance(value, dict):
        cells = list(value.values())
    elif isinstance(value, list):  # numbers, names, or rows of numbers (the step samples)
        cells = [x for item in value for x in (item if isinstance(item, list) else [item])]
    else:
        return
    for x in cells:
        if not isinstance(x, int | float | str):
            raise InvalidLoadReportError(f"field {name!r} holds a {type(x).__name__}")


def decode_load(data: bytes) -> WorkerLoad:
    """The report ``encode_load`` wrote; ``InvalidLoadReportError`` for anything else."""
    try:
        fields = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidLoadReportError(f"not JSON: {exc}") from exc
    if not isinstance(fields, dict):
        raise InvalidLoadReportError(f"a JSON {type(fields).__name__}, not an object")
    if unknown := fields.keys() - _FIELDS.keys():
        raise InvalidLoadReportError(f"unknown fields {sorted(unknown)}")
    if missing := {"worker_id", "role"} - fields.keys():
        raise InvalidLoadReportError(f"missing fields {sorted(missing)}")
    for name, value in fields.items():
        _check_type(name, value)
        if isinstance(value, list):
            fields[name] = tuple(tuple(item) if isinstance(item, list) else item for item in value)
    return WorkerLoad(**fields)


class ChangeSignal:
    """Wakes a writer waiting on its event loop when something its report shows changed, from any thread
    (the engine thread after a step), at most once per wait: a step's notice costs nothing when the writer
    is not waiting for one. ``arm()`` before reading the state, so a change while it is read is not missed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self._armed = False

    def notify(self) -> None:
        if self._armed:
            self._armed = False
            self._loop.call_soon_threadsafe(self._event.set)

    def arm(self) -> None:
        self._event.clear()
        self._armed = True

    async def wait(self, timeout_s: float) -> None:
        """Until a change since ``arm()``, or ``timeout_s``."""
        with contextlib.suppress(TimeoutError):  # (asyncio.timeout: wait_for may swallow a cancel before 3.12)
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await self._event.wait()


class LoadWriter:
    """A worker's side: ``run()`` writes ``report()`` on the board when ``changed`` says it may have changed
    (at most every ``interval_s``) and it did, or when ``heartbeat_s`` passed since the last write, until
    cancelled."""

    def __init__(self, redis_url: str, key: str, report: Callable[[], Awaitable[WorkerLoad]], changed: ChangeSignal,
                 interval_s: float = WRITE_INTERVAL_S, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=1.0)
        self.key, self.report, self.changed = key, report, changed
        self.interval_s, self.heartbeat_s = interval_s, heartbeat_s
        self.writes = 0

    async def run(self) -> None:
        written: WorkerLoad | None = None  # the last report written, unnumbered (numbers differ every time)
        written_at = 0.0
        failing = False  # log a Redis outage once, not every tick
        try:
            while not cancel_requested():  # (redis-py may swallow the cancel that stops this loop)
                self.changed.arm()
                load = await self.report()
                unnumbered = dataclasses.replace(load, report_seq=0)
                if unnumbered != written or time.monotonic() - written_at >= self.heartbeat_s:
                    try:
                        async with self.redis.pipeline(transaction=False) as pipe:
                            await pipe.hset(self.key, load.worker_id, encode_load(load))
                            await pipe.pexpire(self.key, _BOARD_TTL_MS).execute()
                    except (RedisError, OSError) as exc:
                        if not failing:
                            log.warning("writing the load board failed (the router will ask instead): %s", exc)
                        failing = True
                    else:
                        if failing:
                            log.info("writing the load board again")
                        failing = False
                        written, written_at = unnumbered, time.monotonic()
                        self.writes += 1
                await asyncio.sleep(self.interval_s)
                await self.changed.wait(written_at + self.heartbeat_s - time.monotonic())
        finally:
            await self.redis.aclose()


class LoadBoard:
    """The router's side: ``read()`` returns the reports written since the last read, or None while the
    board can't be read (Redis is down or restarting: the dispatcher asks the workers meanwhile)."""

    def __init__(self, redis_url: str, key: str) -> None:
        self.redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=1.0)
        self.key = key
        self.rejected = 0  # values that were not load reports
        self._seen: dict[bytes, bytes] = {}  # worker id -> the value last read
        self._forgotten: set[str] = set()  # removed workers whose values are yet to be deleted
        self.readable = True  # whether the last read succeeded (an outage is logged once)

    async def read(self) -> list[WorkerLoad] | None:
        try:
            if self._forgotten:
                await self.redis.hdel(self.key, *self._forgotten)
                self._forgotten.clear()
            values = await self.redis.hgetall(self.key)
        except (RedisError, OSError) as exc:
            if self.readable:
                log.warning("can't read the load board (asking the workers meanwhile): %s", exc)
            self.readable = False
            return None
        if not self.readable:
            log.info("reading the load board again")
        self.readable = True
        reports = []
        for worker, value in values.items():
            if self._seen.get(worker) == value:
                continue
            self._seen[worker] = value
            try:
                reports.append(decode_load(value))
            except InvalidLoadReportError as exc:
                self.rejected += 1
                log.warning("%r's value on the load board is not a load report: %s", worker, exc)
        return reports

    def forget(self, worker_id: str) -> None:
        """A worker left the cluster: its value goes at the next read."""
        self._forgotten.add(worker_id)
        self._seen.pop(worker_id.encode(), None)

    async def close(self) -> None:
        await self.redis.aclose()
