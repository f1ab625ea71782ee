-- ARGV: ns, holder, op (stored|removed), bits, tier name, maxlen, epoch, hash...
local holder, op, bits, tier = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
redis.call('SADD', ns .. 'workers', holder)
local now, changed = now_ms(), {}
for i = 8, #ARGV do
  local old, new = update(holder, ARGV[i], bits, op, now)
  if (old == 0) ~= (new == 0) then changed[#changed + 1] = ARGV[i] end
end
emit(holder, op, tier, changed, ARGV[6], ARGV[7])
return #changed
