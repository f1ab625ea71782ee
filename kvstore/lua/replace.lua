-- ARGV: ns, holder, maxlen, epoch, then (hash, bits) pairs: the holder's whole state, replacing the old.
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
