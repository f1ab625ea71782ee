-- ARGV: ns, maxlen, epoch, max_bytes, hash... -> blocks evicted. The same pipeline SET the bytes just
-- before (natively: no copies through Lua), with a TTL in case this commit never runs; here they count.
redis.call('SADD', ns .. 'workers', holder)
local now, stored, evicted = now_ms(), {}, {}
for i = 5, #ARGV do
  local hex, key = ARGV[i], ns .. 'p:' .. ARGV[i]
  local size = redis.call('STRLEN', key)
  if size > 0 then
    redis.call('PERSIST', key)
    local old_size = tonumber(redis.call('HGET', ns .. 'psize', hex) or '0')
    redis.call('HSET', ns .. 'psize', hex, size)
    redis.call('INCRBY', ns .. 'pbytes', size - old_size)
    redis.call('ZADD', ns .. 'plru', redis.call('INCR', ns .. 'pclock'), hex)
    local old = update(holder, hex, tierbit, 'stored', now)
    if old == 0 then stored[#stored + 1] = hex end
  end
end
while tonumber(redis.call('GET', ns .. 'pbytes') or '0') > tonumber(ARGV[4]) do
  local coldest = redis.call('ZRANGE', ns .. 'plru', 0, 0)
  if #coldest == 0 then break end
  drop_payload(coldest[1], now, evicted)
end
emit(holder, 'stored', 'redis', stored, ARGV[2], ARGV[3])
emit(holder, 'removed', 'redis', evicted, ARGV[2], ARGV[3])
return #evicted
