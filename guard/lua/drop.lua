-- drop.lua: delete a filter and all its sub-filters.
-- KEYS: every possible sub-filter key (0..MAX_SUBFILTERS-1), so a stale caller drops them all.
-- Reply: 1 when the filter existed, else 0.
local existed = redis.call('EXISTS', KEYS[1])
redis.call('DEL', unpack(KEYS))
return existed
