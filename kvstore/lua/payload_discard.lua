-- ARGV: ns, maxlen, epoch, hash... -> number of blocks removed.
local now, removed = now_ms(), {}
for i = 4, #ARGV do drop_payload(ARGV[i], now, removed) end
emit(holder, 'removed', 'redis', removed, ARGV[2], ARGV[3])
return #removed
