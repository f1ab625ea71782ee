-- ARGV: ns, hash...: the blocks a pipeline just read count as most recently used.
for i = 2, #ARGV do
  redis.call('ZADD', ns .. 'plru', 'XX', redis.call('INCR', ns .. 'pclock'), ARGV[i])
end
