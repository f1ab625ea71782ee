-- ARGV: ns, worker -> 1 when the worker was not registered (first beat, or Redis lost it).
local old = redis.call('ZSCORE', ns .. 'hb', ARGV[2])
redis.call('ZADD', ns .. 'hb', now_ms(), ARGV[2])
redis.call('SADD', ns .. 'workers', ARGV[2])
if old then return 0 end
return 1
