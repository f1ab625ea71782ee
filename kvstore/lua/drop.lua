-- ARGV: ns, ttl_ms, maxlen, epoch, [worker...]: drops the named workers, or every one past the TTL.
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
