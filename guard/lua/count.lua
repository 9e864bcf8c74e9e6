-- count.lua: how many copies of each item's fingerprint the filter holds.
-- KEYS: sub-filters 0..subfilters-1.  ARGV: layout (9), then h1, g1, h2, g2, ...
-- Reply: {OK, subfilters, c1, c2, ...}; or {STALE, layout...}.
local err = check_layout()
if err then return err end
-- fakeredis has no BITFIELD_RO; there, BITFIELD with only GETs reads the same.
local probe = redis.pcall('BITFIELD_RO', KEYS[1], 'GET', 'u8', 0)
if not (type(probe) == 'table' and probe.err) then READ = 'BITFIELD_RO' end

local function matches(bkt, fp)
  local c = 0
  for s = 1, L.b do if bkt[s] == fp then c = c + 1 end end
  return c
end

local reply = {OK, L.nsub}
for k = 10, #ARGV, 2 do
  local h, g = tonumber(ARGV[k]), fixed_g(tonumber(ARGV[k + 1]))
  local c = 0
  for n = 0, L.nsub - 1 do
    local fp, i1, i2 = item_at(h, g, n)
    load(n, {i1, i2})
    c = c + matches(cache[n][i1], fp)
    if i2 ~= i1 then c = c + matches(cache[n][i2], fp) end
  end
  reply[#reply + 1] = c
end
return reply
