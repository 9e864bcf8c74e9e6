-- promote.lua: atomically replace a live filter by its staging copy (used by rebuilds).
-- KEYS: the live filter's MAX_SUBFILTERS keys, then the staging copy's MAX_SUBFILTERS keys.
-- Reply: 1; GUARD_NOTFOUND when there is no staging copy, GUARD_CORRUPT when it is not a filter.
local half = #KEYS / 2
local magic = redis.call('BITFIELD', KEYS[half + 1], 'GET', 'u32', 0)[1]
if magic ~= MAGIC then
  if redis.call('EXISTS', KEYS[half + 1]) == 0 then return guard_error('NOTFOUND', 'no staging copy') end
  return guard_error('CORRUPT', 'staging copy is not a filter')
end
redis.call('DEL', unpack(KEYS, 1, half))
for n = 1, half do
  if redis.call('EXISTS', KEYS[half + n]) == 1 then redis.call('RENAME', KEYS[half + n], KEYS[n]) end
end
return 1
