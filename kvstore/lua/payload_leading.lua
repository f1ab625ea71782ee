-- ARGV: ns, hash...: how many of the hashes, from the first, have their bytes here; those count as most
-- recently used (the caller reads them next). A prompt whose first block is missing costs one call.
for i = 2, #ARGV do
  if redis.call('EXISTS', ns .. 'p:' .. ARGV[i]) == 0 then return i - 2 end
  mark_used(ARGV[i])
end
return #ARGV - 1
