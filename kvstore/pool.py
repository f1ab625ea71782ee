"""The Redis prefix-hash index: which worker holds which KV block, and who has the longest cached prefix.

Keys live under one namespace per model and block size, ``tp:{model}:{block_size}:``:

    b:{hash}      HASH    holder -> tier bits (device=1, host=2, redis=4)
    w:{holder}    SET     hashes the holder has in any tier (resync and cleanup read it)
    lru           ZSET    hash -> last access, seconds on the Redis clock
    hb            ZSET    worker -> last heartbeat, ms on the Redis clock
    workers       SET     holders that published or heartbeated
    seq:{holder}  STRING  number of events the holder has written
    events        STREAM  membership changes (events.py reads them)
    epoch         STRING  a token the first writer sets; a new one means Redis lost its data

Every write changes the index and appends its event in one Lua script, so the stream and the index never
disagree. Holders whose id starts with ``@`` (the Redis payload tier, ``POOL_HOLDER``) need no heartbeat.
Every call is fail-soft: while Redis is unreachable lookups return misses and writes are dropped with a
warning; the client reconnects on its own and no Redis error reaches a request.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import NoScriptError
from redis.retry import Retry

from kvstore.names import POOL_HOLDER as POOL_HOLDER  # re-exported: the pool's users name the tier

log = logging.getLogger(__name__)
T = TypeVar("T")

TIERS = {"device": 1, "host": 2, "redis": 4}
ALL_TIERS = 7


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


# Shared by every write script (pool and payload). ARGV[1] is the namespace.
PRELUDE = """
local ns = ARGV[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- One event per call that changed something; the holder's sequence number counts them.
local function emit(holder, op, tier, hexes, maxlen, epoch)
  redis.call('SET', ns .. 'epoch', epoch, 'NX')
  if #hexes == 0 and op ~= 'drop' then return end
  local seq = redis.call('INCR', ns .. 'seq:' .. holder)
  redis.call('XADD', ns .. 'events', 'MAXLEN', '~', maxlen, '*',
             'w', holder, 's', seq, 'op', op, 't', tier, 'h', table.concat(hexes, ','))
end
-- Change a holder's tier bits on one block (mode stored: OR, removed: AND NOT, set: replace).
local function update(holder, hex, bits, mode, now)
  local key = ns .. 'b:' .. hex
  local old = tonumber(redis.call('HGET', key, holder) or '0')
  local new = bits
  if mode == 'stored' then new = bit.bor(old, bits) elseif mode == 'removed' then new = bit.band(old, bit.bnot(bits)) end
  if new ~= 0 then
    if new ~= old then redis.call('HSET', key, holder, new) end
    if old == 0 then redis.call('SADD', ns .. 'w:' .. holder, hex) end
    redis.call('ZADD', ns .. 'lru', math.floor(now / 1000), hex)
  elseif old ~= 0 then
    redis.call('HDEL', key, holder)
    redis.call('SREM', ns .. 'w:' .. holder, hex)
    if redis.call('EXISTS', key) == 0 then redis.call('ZREM', ns .. 'lru', hex) end
  end
  return old, new
end
"""

# ARGV: ns, holder, op (stored|removed), bits, tier name, maxlen, epoch, hash...
_PUBLISH = PRELUDE + """
local holder, op, bits, tier = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
redis.call('SADD', ns .. 'workers', holder)
local now, changed = now_ms(), {}
for i = 8, #ARGV do
  local old, new = update(holder, ARGV[i], bits, op, now)
  if (old == 0) ~= (new == 0) then changed[#changed + 1] = ARGV[i] end
end
emit(holder, op, tier, changed, ARGV[6], ARGV[7])
return #changed
"""

# ARGV: ns, holder, maxlen, epoch, then (hash, bits) pairs: the holder's whole state, replacing the old.
_REPLACE = PRELUDE + """
local holder = ARGV[2]
redis.call('SADD', ns .. 'workers', holder)
local want, now, added, removed = {}, now_ms(), {}, {}
for i = 5, #ARGV, 2 do want[ARGV[i]] = tonumber(ARGV[i + 1]) end
for _, hex in ipairs(redis.call('SMEMBERS', ns .. 'w:' .. holder)) do
  if want[hex] == nil then update(holder, hex, 0, 'set', now); removed[#removed + 1] = hex end
end
for hex, bits in pairs(want) do
  local old = update(holder, hex, bits, 'set', now)
  if old == 0 then added[#added + 1] = hex end
end
emit(holder, 'removed', '*', removed, ARGV[3], ARGV[4])
emit(holder, 'stored', '*', added, ARGV[3], ARGV[4])
return {#added, #removed}
"""

# ARGV: ns, ttl_ms, hash... -> flat [holder, matched_blocks, ...]; touches the matched blocks' lru.
_LOOKUP = PRELUDE + """
local now = now_ms()
local cutoff, n = now - tonumber(ARGV[2]), #ARGV - 2
local active, counts, depth = {}, {}, 0
if n > 0 then
  local fields = redis.call('HGETALL', ns .. 'b:' .. ARGV[3])
  for j = 1, #fields, 2 do
    local w, live = fields[j], string.sub(fields[j], 1, 1) == '@'
    if not live then
      local s = redis.call('ZSCORE', ns .. 'hb', w)
      live = s and tonumber(s) >= cutoff
    end
    if live then active[#active + 1] = w end
  end
end
-- Calls cost far more than the elements they touch. Few candidate holders: ask each holder's set about
-- the whole chain (one call per holder per 1,000 blocks). Many (a shared system prompt): walk the chain,
-- one call per block for the holders still matching.
if #active > 0 and #active <= 16 and #active < n then
  for _, w in ipairs(active) do
    local c, lo = 0, 3
    while lo <= #ARGV do
      local flags = redis.call('SMISMEMBER', ns .. 'w:' .. w, unpack(ARGV, lo, math.min(#ARGV, lo + 999)))
      local k = 1
      while k <= #flags and flags[k] == 1 do k = k + 1 end
      c, lo = c + k - 1, lo + 1000
      if k <= #flags then break end
    end
    counts[w] = c
    depth = math.max(depth, c)
  end
else
  if #active > 0 then depth = 1 end
  for i = 4, #ARGV do
    if #active == 0 then break end
    local got, kept = redis.call('HMGET', ns .. 'b:' .. ARGV[i], unpack(active)), {}
    for j = 1, #active do
      if got[j] then kept[#kept + 1] = active[j] else counts[active[j]] = depth end
    end
    active = kept
    if #active > 0 then depth = depth + 1 end
  end
  for _, w in ipairs(active) do counts[w] = depth end
end
for lo = 1, depth, 1000 do  -- last access has one-second resolution, so a hot chain's touch is a no-op
  local touch = {}
  for i = lo, math.min(depth, lo + 999) do touch[#touch + 1] = math.floor(now / 1000); touch[#touch + 1] = ARGV[i + 2] end
  redis.call('ZADD', ns .. 'lru', 'XX', unpack(touch))
end
local out = {}
for w, c in pairs(counts) do out[#out + 1] = w; out[#out + 1] = c end
return out
"""

# ARGV: ns, worker -> 1 when the worker was not registered (first beat, or Redis lost it).
_HEARTBEAT = PRELUDE + """
local old = redis.call('ZSCORE', ns .. 'hb', ARGV[2])
redis.call('ZADD', ns .. 'hb', now_ms(), ARGV[2])
redis.call('SADD', ns .. 'workers', ARGV[2])
if old then return 0 end
return 1
"""

# ARGV: ns, ttl_ms, maxlen, epoch, [worker...]: drops the named workers, or every one past the TTL.
_DROP = PRELUDE + """
local dead = {}
for i = 5, #ARGV do dead[#dead + 1] = ARGV[i] end
if #dead == 0 then
  dead = redis.call('ZRANGEBYSCORE', ns .. 'hb', '-inf', '(' .. (now_ms() - tonumber(ARGV[2])))
end
for _, w in ipairs(dead) do
  for _, hex in ipairs(redis.call('SMEMBERS', ns .. 'w:' .. w)) do update(w, hex, 0, 'set', 0) end
  redis.call('ZREM', ns .. 'hb', w)
  redis.call('SREM', ns .. 'workers', w)
  emit(w, 'drop', '*', {}, ARGV[3], ARGV[4])
end
return dead
"""

# ARGV: ns -> [now_ms, holder, seq, heartbeat_ms (-1: none), ...] for every registered holder.
_CENSUS = PRELUDE + """
local out = {now_ms()}
for _, w in ipairs(redis.call('SMEMBERS', ns .. 'workers')) do
  out[#out + 1] = w
  out[#out + 1] = redis.call('GET', ns .. 'seq:' .. w) or '0'
  out[#out + 1] = redis.call('ZSCORE', ns .. 'hb', w) or '-1'
end
return out
"""


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
