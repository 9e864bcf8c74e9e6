-- delete.lua: remove one copy of each item's fingerprint.
-- KEYS: sub-filters 0..subfilters-1.  ARGV: layout (9), then h1, g1, h2, g2, ...
-- Reply: {OK, subfilters, r1, r2, ...} with r = 1 removed, 0 nothing found (counted as a
--   missed delete: deleting what was never inserted is how a cuckoo filter loses keys).
--   Or {STALE, layout...}.
local err = check_layout()
if err then return err end

local reply = {OK, L.nsub}
for k = 10, #ARGV, 2 do
  reply[#reply + 1] = remove(tonumber(ARGV[k]), fixed_g(tonumber(ARGV[k + 1])))
end
finish()
return reply
