-- delete.lua: remove one copy of each item's fingerprint.
-- KEYS: sub-filters 0..subfilters-1.  ARGV: layout (9), then h1, g1, h2, g2, ...
-- Reply: {OK, subfilters, r1, r2, ...} with r = 1 removed, 0 nothing found (counted as a
--   missed delete: deleting what was never inserted is how a cuckoo filter loses keys).
--   Or {STALE, layout...}.
local err = check_layout()
if err then return err end

local reply, removed, missed = {OK, L.nsub}, 0, 0
for k = 10, #ARGV, 2 do
  local h, g = tonumber(ARGV[k]), fixed_g(tonumber(ARGV[k + 1]))
  local hit = 0
  -- Newest sub-filter first. Sizes divide one another and fingerprints are prefixes of one
  -- another, so an item colliding with ours in a newer sub-filter collides in every older one:
  -- removing its copy there leaves ours to answer for it (docs/format.md has the argument).
  for n = L.nsub - 1, 0, -1 do
    local fp, i1, i2 = item_at(h, g, n)
    load(n, {i1, i2})
    local i, s = i1, find(cache[n][i1], fp)
    if not s then i, s = i2, find(cache[n][i2], fp) end
    if s then
      put(n, i, s, 0)
      item_delta[n] = item_delta[n] - 1
      hit = 1
      break
    end
  end
  if hit == 1 then removed = removed + 1 else missed = missed + 1 end
  reply[#reply + 1] = hit
end
flush()
redis.call('BITFIELD', KEYS[1], 'INCRBY', 'i64', 320, removed, 'INCRBY', 'i64', 384, missed)
return reply
