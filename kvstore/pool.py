"""The Redis prefix-hash index: which worker holds which KV block, and who has the longest cached prefix.

Keys live under one namespace per model and block size, ``tp:{model}:{block_size}:``:

    b:{hash}      HASH    holder -> tier bits (device=1, host=2, redis=4, disk=8)
    w:{holder}    SET     hashes the holder has in any tier (resync and cleanup read it)
    lru           ZSET    hash -> last access, seconds on the Redis clock
    hb            ZSET    worker -> last heartbeat, ms on the Redis clock
    workers       SET     holders that published or heartbeated
    seq:{holder}  STRING  number of events the holder has written
    events        STREAM  membership changes (events.py reads them)
    epoch         STRING  a token the first writer sets; a new one means Redis lost its data

Every write changes the index and appends its event in one Lua script (kvstore/lua/), so the stream and
the index never disagree. Holders whose id starts with ``@`` (the Redis payload tier, ``POOL_HOLDER``)
need no heartbeat. Every call is fail-soft: while Redis is unreachable lookups return misses and writes
are dropped with a warning; the client reconnects on its own and no Redis error reaches a request.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from importlib import resources
from typing import TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import NoScriptError
from redis.retry import Retry

from kvstore.names import POOL_HOLDER as POOL_HOLDER  # re-exported: the pool's users name the tier

log = logging.getLogger(__name__)
T = TypeVar("T")

TIERS = {"device": 1, "host": 2, "redis": 4, "disk": 8}
ALL_TIERS = 15


def hex_of(h: int) -> str:
    return f"{h:016x}"


def namespace(model_id: str, block_size: int) -> str:
    return f"tp:{model_id}:{block_size}:"


def new_epoch() -> str:
    """A fresh token for every write: whichever write first finds the namespace empty (a new or a
    restarted Redis) sets it, so readers see a new epoch exactly when Redis lost its data."""
    return uuid.uuid4().hex


def connect(url: str) -> redis.Redis:
    """A client for ``redis://`` / ``rediss://`` URLs (user and password in the URL), with short timeouts
    and one quick retry so a connection broken by a Redis restart is replaced on the next call."""
    return redis.Redis.from_url(
        url, socket_timeout=5.0, socket_connect_timeout=1.0, health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 1))


def execute(pipe: redis.client.Pipeline) -> list:
    """Run a pipeline and raise its first error as is (redis-py's own raise formats every argument of
    the failed command into the message: seconds for a batch of payload blocks)."""
    results = pipe.execute(raise_on_error=False)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


class FailSoft:
    """Runs Redis calls so that none raises: an error logs, returns the default and backs off (calls
    during the backoff return the default without touching the network), the next call after it tries
    again. A script error (``ResponseError``) is logged but does not trip the backoff."""

    def __init__(self, what: str, max_backoff_s: float = 2.0) -> None:
        self.what = what
        self.max_backoff_s = max_backoff_s
        self.failures = 0
        self._retry_at = 0.0

    @property
    def up(self) -> bool:
        return self.failures == 0

    def run(self, fn: Callable[[], T], default: T) -> T:
        if self.failures and time.monotonic() < self._retry_at:
            return default
        try:
            result = fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self.failures += 1
            self._retry_at = time.monotonic() + min(self.max_backoff_s, 0.05 * 2 ** self.failures)
            if self.failures == 1 or self.failures % 50 == 0:
                log.warning("%s: Redis unreachable (%s); serving misses, dropping writes", self.what, e)
            return default
        except redis.RedisError as e:
            log.error("%s: Redis error: %s", self.what, e)
            return default
        if self.failures:
            log.warning("%s: Redis reachable again after %d failed calls", self.what, self.failures)
            self.failures = 0
        return result


def lua_script(*names: str) -> str:
    """kvstore/lua/prelude.lua followed by the named files of kvstore/lua/, as one script."""
    lua = resources.files("kvstore") / "lua"
    return "".join((lua / f"{name}.lua").read_text(encoding="utf-8") for name in ("prelude", *names))


_PUBLISH = lua_script("publish")
_REPLACE = lua_script("replace")
_LOOKUP = lua_script("lookup")
_HEARTBEAT = lua_script("heartbeat")
_DROP = lua_script("drop")
_CENSUS = lua_script("census")


class KVPool:
    """The pool index for one model and block size (see the module docstring for the key layout)."""

    def __init__(self, redis_url: str, model_id: str, block_size: int, ttl_s: float = 10.0,
                 stream_maxlen: int = 100_000) -> None:
        self.client = connect(redis_url)
        self.model_id, self.block_size, self.ttl_s = model_id, block_size, ttl_s
        self.ns = namespace(model_id, block_size)
        self.stream = self.ns + "events"
        self.stream_maxlen = stream_maxlen
        self.guard = FailSoft(f"kv pool {self.ns}")
        self._scripts: list[redis.commands.core.Script] = []
        self._loaded = False  # scripts are loaded before the first call, then again after NOSCRIPT
        self.publish_script = self.script(_PUBLISH)
        self._replace = self.script(_REPLACE)
        self._lookup = self.script(_LOOKUP)
        self._heartbeat = self.script(_HEARTBEAT)
        self._drop = self.script(_DROP)
        self.census_script = self.script(_CENSUS)

    def script(self, source: str) -> redis.commands.core.Script:
        """Register a Lua script that ``run`` reloads when Redis has forgotten it (after a restart)."""
        s = self.client.register_script(source)
        self._scripts.append(s)
        self._loaded = False
        return s

    def run(self, fn: Callable[[], T], default: T) -> T:
        """Call ``fn`` fail-soft; scripts missing on the server are loaded and ``fn`` runs once more
        (every caller's ``fn`` is idempotent, so a partly applied pipeline may run again)."""
        def attempt() -> T:
            if not self._loaded:
                self._load_scripts()
            try:
                return fn()
            except NoScriptError:
                self._load_scripts()
                return fn()
        return self.guard.run(attempt, default)

    def _load_scripts(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for s in self._scripts:
            pipe.script_load(s.script)
        for s, sha in zip(self._scripts, execute(pipe), strict=True):
            s.sha = sha
        self._loaded = True

    @property
    def up(self) -> bool:
        return self.guard.up

    def _publish_args(self, worker: str, op: str, tier: str | None, hashes: Sequence[int]) -> list:
        bits = ALL_TIERS if tier is None else TIERS[tier]
        return [self.ns, worker, op, bits, tier or "*", self.stream_maxlen, new_epoch(), *map(hex_of, hashes)]

    def publish_stored(self, worker: str, hashes: Sequence[int], tier: str = "device") -> bool:
        """Record that ``worker`` holds ``hashes`` in ``tier``; False when Redis dropped the write."""
        return self.publish_batch(worker, [("stored", tier, hashes)])

    def publish_removed(self, worker: str, hashes: Sequence[int], tier: str | None = None) -> bool:
        """Record that ``worker`` no longer holds ``hashes`` in ``tier`` (None: in any tier)."""
        return self.publish_batch(worker, [("removed", tier, hashes)])

    def publish_batch(self, worker: str, ops: Sequence[tuple[str, str | None, Sequence[int]]]) -> bool:
        """Apply ``(op, tier, hashes)`` changes in order, in one round trip."""
        ops = [op for op in ops if op[2]]
        if not ops:
            return True

        def send() -> bool:
            pipe = self.client.pipeline(transaction=False)
            for op, tier, hashes in ops:
                pipe.evalsha(self.publish_script.sha, 0, *self._publish_args(worker, op, tier, hashes))
            execute(pipe)
            return True
        return self.run(send, False)

    def replace_holdings(self, worker: str, holdings: dict[int, int]) -> bool:
        """Make ``worker``'s entries exactly ``holdings`` (hash -> tier bits), publishing the difference."""
        args = [self.ns, worker, self.stream_maxlen, new_epoch()]
        for h, bits in holdings.items():
            args += (hex_of(h), bits)
        return self.run(lambda: self.client.evalsha(self._replace.sha, 0, *args) is not None, False)

    def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """``{holder: number of leading blocks of hashes it holds}`` for live holders, in one round trip;
        ``{}`` while Redis is unreachable."""
        if not hashes:
            return {}
        args = [self.ns, int(self.ttl_s * 1000), *map(hex_of, hashes)]
        flat = self.run(lambda: self.client.evalsha(self._lookup.sha, 0, *args), [])
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def heartbeat(self, worker: str) -> bool | None:
        """Mark ``worker`` alive; True when it was not registered (its holdings should be republished),
        None when Redis is unreachable."""
        result = self.run(lambda: self.client.evalsha(self._heartbeat.sha, 0, self.ns, worker), None)
        return None if result is None else bool(result)

    def cleanup(self) -> list[str]:
        """Drop every worker whose heartbeat is older than the TTL, with its holdings (a ``drop`` event
        each); returns the workers dropped."""
        return self._drop_workers([])

    def retire(self, worker: str) -> bool:
        """Drop ``worker`` and its holdings now (a worker shutting down cleanly)."""
        return worker in self._drop_workers([worker])

    def _drop_workers(self, workers: list[str]) -> list[str]:
        args = [self.ns, int(self.ttl_s * 1000), self.stream_maxlen, new_epoch(), *workers]
        dropped = self.run(lambda: self.client.evalsha(self._drop.sha, 0, *args), [])
        return [w.decode() for w in dropped]

    def close(self) -> None:
        self.client.close()
