-- drop.lua: delete a filter and all its sub-filters.
-- KEYS: every possible sub-filter key (0..MAX_SUBFILTERS-1), so a stale caller drops them all.
-- Reply: 1 when any of them existed (a filter, or what is left of one), else 0.
return redis.call('DEL', unpack(KEYS)) > 0 and 1 or 0
