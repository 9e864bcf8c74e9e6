-- promote.lua: atomically replace a live filter by its staging copy (used by rebuilds).
-- KEYS: the live filter's MAX_SUBFILTERS keys, then the staging copy's MAX_SUBFILTERS keys.
-- ARGV: the staging copy's layout (9), as its handle verified it; then only_if_new (0|1):
--   a bulk build that creates the filter never replaces one made meanwhile; then
--   unless_behind (0|1): a rebuild's copy never replaces a live filter that follows the same
--   change feed and has applied more of it (a follower moved it on meanwhile).
-- Reply: 1; {STALE} when the staging copy holds another layout; {GAP, live applied} when
--   unless_behind refuses; GUARD_EXISTS when only_if_new and the live filter exists;
--   GUARD_NOTFOUND when there is no staging copy, GUARD_CORRUPT when it is damaged (in each,
--   the live filter is left as it was).
local half = #KEYS / 2
if ARGV[10] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  return guard_error('EXISTS', 'filter exists')
end
local err, h0 = check_layout(half)
if err then return err end
if ARGV[11] == '1' then
  -- Only a live header that is a version-3 filter of the same feed is believed (a damaged
  -- one is what a rebuild replaces).
  local live = redis.pcall('GETRANGE', KEYS[1], 0, 79)
  if type(live) == 'string' and #live == 80 and live:sub(1, 5) == 'CKGD\3'
    and live:sub(73, 80) == h0:sub(73, 80) and live:sub(73, 80) ~= string.rep('\0', 8) then
    local applied = field(live, APPLIED_AT, 8)
    if applied > field(h0, APPLIED_AT, 8) and applied <= MAX_CHANGE_ID then
      return {GAP, applied}
    end
  end
end
redis.call('DEL', unpack(KEYS, 1, half))
for n = 1, half do
  if redis.call('EXISTS', KEYS[half + n]) == 1 then redis.call('RENAME', KEYS[half + n], KEYS[n]) end
end
return 1
