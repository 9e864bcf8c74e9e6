-- lookup.lua: is each item (probably) in the filter?
-- KEYS: sub-filters 0..subfilters-1.  ARGV: layout (8), then h1, g1, h2, g2, ...
-- Reply: {OK, subfilters, r1, r2, ...} with r = 1 maybe present, 0 definitely absent;
--   or {STALE, layout...}.  Reads only the two buckets of each item in each sub-filter.
local err = check_layout()
if err then return err end

local items = {}
for k = 9, #ARGV, 2 do
  items[#items + 1] = {h = tonumber(ARGV[k]), g = fixed_g(tonumber(ARGV[k + 1])), found = 0}
end
for n = L.nsub - 1, 0, -1 do
  local want = {}
  for _, it in ipairs(items) do
    if it.found == 0 then
      it.fp, it.i1, it.i2 = item_at(it.h, it.g, n)
      want[#want + 1] = it.i1; want[#want + 1] = it.i2
    end
  end
  if #want == 0 then break end
  load_many(n, want)
  for _, it in ipairs(items) do
    if it.found == 0 and (find(cache[n][it.i1], it.fp) or find(cache[n][it.i2], it.fp)) then
      it.found = 1
    end
  end
end
local reply = {OK, L.nsub}
for k, it in ipairs(items) do reply[k + 2] = it.found end
return reply
