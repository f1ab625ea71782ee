-- Payload keys: p:{hash} the bytes, psize HASH hash -> bytes, plru ZSET hash -> access clock, pbytes total.
-- `holder` and `tierbit` (the Redis tier's holder name and bit) are bound by kvstore/payload.py.
-- A block just read counts as most recently used (XX: one dropped meanwhile is not brought back).
local function mark_used(hex)
  redis.call('ZADD', ns .. 'plru', 'XX', redis.call('INCR', ns .. 'pclock'), hex)
end
local function drop_payload(hex, now, removed)
  local size = redis.call('HGET', ns .. 'psize', hex)
  if not size then return end
  redis.call('DEL', ns .. 'p:' .. hex)
  redis.call('HDEL', ns .. 'psize', hex)
  redis.call('ZREM', ns .. 'plru', hex)
  redis.call('DECRBY', ns .. 'pbytes', size)
  local old, new = update(holder, hex, tierbit, 'removed', now)
  if old ~= 0 and new == 0 then removed[#removed + 1] = hex end
end
