-- promote.lua: atomically replace a live filter by its staging copy (used by rebuilds).
-- KEYS: the live filter's MAX_SUBFILTERS keys, then the staging copy's MAX_SUBFILTERS keys.
-- ARGV: the staging copy's layout (9), as its handle verified it; then only_if_new (0|1):
--   a bulk build that creates the filter never replaces one made meanwhile.
-- Reply: 1; {STALE} when the staging copy holds another layout or has no sub-filter 0 (the
--   client's probe then says not found or damaged); GUARD_EXISTS when only_if_new and the live
--   filter exists; GUARD_CORRUPT when the staging copy is damaged (in each, the live filter is
--   left as it was).
local half = #KEYS / 2
if ARGV[10] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  return guard_error('EXISTS', 'filter exists')
end
local err = check_layout(half)
if err then return err end
redis.call('DEL', unpack(KEYS, 1, half))
for n = 1, half do
  if redis.call('EXISTS', KEYS[half + n]) == 1 then redis.call('RENAME', KEYS[half + n], KEYS[n]) end
end
return 1
