-- _remove.lua: removing one item, shared by the scripts that remove (delete, apply, undo).
-- Everything goes through the slot store (_store.lua); finish() writes it all back.

-- Removes one copy of the item (h, g): 1 removed, 0 nothing found (counted as a missed delete:
-- deleting what was never inserted is how a cuckoo filter loses keys).
local function remove(h, g)
  local hp = mix(math.floor(g / L.top))
  -- Newest sub-filter first. Sizes divide one another and fingerprints are prefixes of one
  -- another, so an item colliding with ours in a newer sub-filter collides in every older one:
  -- removing its copy there leaves ours to answer for it (docs/format.md has the argument).
  for n = L.nsub - 1, 0, -1 do
    local s = sub(n)
    local fp, i1 = math.floor(g / s.gdiv), h % s.m
    local k = find(s, i1, fp) or find(s, alt_index(i1, hp, s.m), fp)
    if k then
      set(s, k, 0)
      s.delta = s.delta - 1
      L.removed = L.removed + 1
      return 1
    end
  end
  L.missed = L.missed + 1
  return 0
end
