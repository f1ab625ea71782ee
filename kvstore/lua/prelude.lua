-- The start of every script (kvstore.pool.lua_script puts it first): the namespace, which is ARGV[1] of
-- every script, and the helpers the writes share.
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
