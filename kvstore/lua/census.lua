-- ARGV: ns -> [now_ms, holder, seq, heartbeat_ms (-1: none), ...] for every registered holder.
local out = {now_ms()}
for _, w in ipairs(redis.call('SMEMBERS', ns .. 'workers')) do
  out[#out + 1] = w
  out[#out + 1] = redis.call('GET', ns .. 'seq:' .. w) or '0'
  out[#out + 1] = redis.call('ZSCORE', ns .. 'hb', w) or '-1'
end
return out
