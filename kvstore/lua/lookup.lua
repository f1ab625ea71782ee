-- ARGV: ns, ttl_ms, hash... -> flat [holder, matched_blocks, ...]; touches the matched blocks' lru.
local now = now_ms()
local cutoff, n = now - tonumber(ARGV[2]), #ARGV - 2
local active, counts, depth = {}, {}, 0
if n > 0 then
  local fields = redis.call('HGETALL', ns .. 'b:' .. ARGV[3])
  for j = 1, #fields, 2 do
    local w, live = fields[j], string.sub(fields[j], 1, 1) == '@'
    if not live then
      local s = redis.call('ZSCORE', ns .. 'hb', w)
      live = s and tonumber(s) >= cutoff
    end
    if live then active[#active + 1] = w end
  end
end
-- Calls cost far more than the elements they touch. Few candidate holders: ask each holder's set about
-- the whole chain (one call per holder per 1,000 blocks). Many (a shared system prompt): walk the chain,
-- one call per block for the holders still matching.
if #active > 0 and #active <= 16 and #active < n then
  for _, w in ipairs(active) do
    local c, lo = 0, 3
    while lo <= #ARGV do
      local flags = redis.call('SMISMEMBER', ns .. 'w:' .. w, unpack(ARGV, lo, math.min(#ARGV, lo + 999)))
      local k = 1
      while k <= #flags and flags[k] == 1 do k = k + 1 end
      c, lo = c + k - 1, lo + 1000
      if k <= #flags then break end
    end
    counts[w] = c
    depth = math.max(depth, c)
  end
else
  if #active > 0 then depth = 1 end
  for i = 4, #ARGV do
    if #active == 0 then break end
    local got, kept = redis.call('HMGET', ns .. 'b:' .. ARGV[i], unpack(active)), {}
    for j = 1, #active do
      if got[j] then kept[#kept + 1] = active[j] else counts[active[j]] = depth end
    end
    active = kept
    if #active > 0 then depth = depth + 1 end
  end
  for _, w in ipairs(active) do counts[w] = depth end
end
for lo = 1, depth, 1000 do  -- last access has one-second resolution, so a hot chain's touch is a no-op
  local touch = {}
  for i = lo, math.min(depth, lo + 999) do touch[#touch + 1] = math.floor(now / 1000); touch[#touch + 1] = ARGV[i + 2] end
  redis.call('ZADD', ns .. 'lru', 'XX', unpack(touch))
end
local out = {}
for w, c in pairs(counts) do out[#out + 1] = w; out[#out + 1] = c end
return out
