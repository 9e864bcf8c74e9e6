-- promote.lua: atomically replace a live filter by its staging copy (used by rebuilds).
-- KEYS: the live filter's MAX_SUBFILTERS keys, then the staging copy's MAX_SUBFILTERS keys.
-- ARGV: the staging copy's layout (9), as its handle verified it.
-- Reply: 1; {STALE} when the staging copy holds another layout; GUARD_NOTFOUND when there is
--   no staging copy, GUARD_CORRUPT when it is damaged (the live filter is left as it was).
local half = #KEYS / 2
local err = check_layout(half)
if err then return err end
redis.call('DEL', unpack(KEYS, 1, half))
for n = 1, half do
  if redis.call('EXISTS', KEYS[half + n]) == 1 then redis.call('RENAME', KEYS[half + n], KEYS[n]) end
end
return 1
