-- info.lua: counters of the filter.
-- KEYS: sub-filters 0..subfilters-1.  ARGV: layout (9).
-- Reply: {OK, subfilters, capacity, deletes, missed_deletes, error_rate_ppt, items_0, ...};
--   or {STALE, layout...}.
local err = check_layout()
if err then return err end
local h = redis.call('BITFIELD', KEYS[1], 'GET', 'i64', 192, 'GET', 'i64', 320,
  'GET', 'i64', 384, 'GET', 'i64', 448)
local reply = {OK, L.nsub, h[1], h[2], h[3], h[4]}
for n = 0, L.nsub - 1 do
  reply[#reply + 1] = redis.call('BITFIELD', KEYS[n + 1], 'GET', 'i64', 256)[1]
end
return reply
