-- promote.lua: atomically replace a live filter by its staging copy (used by rebuilds).
-- KEYS: the live filter's MAX_SUBFILTERS keys, then the staging copy's MAX_SUBFILTERS keys.
-- ARGV: the staging copy's layout (9), as its handle verified it; then only_if_new (0|1):
--   a bulk build that creates the filter never replaces one made meanwhile; then
--   unless_behind (0|1): a rebuild's copy never replaces a live filter that follows the same
--   change feed and has applied more of it (a follower moved it on meanwhile).
-- Reply: 1; {STALE} when the staging copy holds another layout or has no sub-filter 0 (the
--   client's probe then says not found or damaged); {GAP, live applied} when unless_behind
--   refuses; GUARD_EXISTS when only_if_new and the live filter exists; GUARD_CORRUPT when the
--   staging copy is damaged (in each, the live filter is left as it was).
local half = #KEYS / 2
if ARGV[10] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  return guard_error('EXISTS', 'filter exists')
end
local err, h0 = check_layout(half)
if err then return err end
if ARGV[11] == '1' then
  -- Only a live header that is a filter of this version following the same feed is believed
  -- (a damaged one is what a rebuild replaces).
  local live = redis.pcall('GETRANGE', KEYS[1], 0, RESERVED_AT - 1)
  local source = h0:sub(SOURCE_AT + 1, SOURCE_AT + 8)
  if type(live) == 'string' and #live == RESERVED_AT
    and field(live, MAGIC_AT, VERSION_AT - MAGIC_AT) == MAGIC
    and field(live, VERSION_AT, 1) == VERSION
    and live:sub(SOURCE_AT + 1, SOURCE_AT + 8) == source and source ~= string.rep('\0', 8) then
    local applied = field(live, APPLIED_AT, 8)
    if applied > field(h0, APPLIED_AT, 8) and applied <= MAX_APPLIED then
      return {GAP, applied}
    end
  end
end
redis.call('DEL', unpack(KEYS, 1, half))
for n = 1, half do
  if redis.call('EXISTS', KEYS[half + n]) == 1 then redis.call('RENAME', KEYS[half + n], KEYS[n]) end
end
return 1
