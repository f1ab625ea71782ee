-- ARGV: ns, hash...: the blocks a pipeline just read count as most recently used.
for i = 2, #ARGV do
  mark_used(ARGV[i])
end
