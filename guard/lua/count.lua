-- count.lua: how many copies of each item's fingerprint the filter holds.
-- KEYS: sub-filters 0..subfilters-1.  ARGV: layout (9), then h1, g1, h2, g2, ...
-- Reply: {OK, subfilters, c1, c2, ...}; or {STALE, layout...}.
-- Reads with GETRANGE only, so it runs on a read-only replica (as EVALSHA_RO).
local err = check_layout()
if err then return err end

local function matches(s, i, fp)
  local t, c, k = s.t, 0, i * s.b
  if t[k] == nil then load(s, i) end
  for j = k, k + s.b - 1 do if t[j] == fp then c = c + 1 end end
  return c
end

local reply = {OK, L.nsub}
for k = 10, #ARGV, 2 do
  local h, g = tonumber(ARGV[k]), fixed_g(tonumber(ARGV[k + 1]))
  local hp = mix(math.floor(g / L.top))
  local c = 0
  for n = 0, L.nsub - 1 do
    local s = sub(n)
    local i1 = h % s.m
    local fp, i2 = math.floor(g / s.gdiv), alt_index(i1, hp, s.m)
    c = c + matches(s, i1, fp)
    if i2 ~= i1 then c = c + matches(s, i2, fp) end
  end
  reply[#reply + 1] = c
end
return reply
