-- _place.lua: adding and removing one item, shared by the scripts that write (insert, delete,
-- apply, undo). Everything goes through the bucket store; finish() writes it all back.

local removed, missed = 0, 0

local function present(h, g)
  for n = L.nsub - 1, 0, -1 do
    local fp, i1, i2 = item_at(h, g, n)
    load(n, {i1, i2})
    if find(cache[n][i1], fp) or find(cache[n][i2], fp) then return true end
  end
  return false
end

-- A free slot in either bucket of any sub-filter, newest first (older ones reuse deleted slots).
local function place_direct(h, g)
  for n = L.nsub - 1, 0, -1 do
    local fp, i1, i2 = item_at(h, g, n)
    load(n, {i1, i2})
    for _, i in ipairs({i1, i2}) do
      local s = find(cache[n][i], 0)
      if s then
        put(n, i, s, fp)
        item_delta[n] = item_delta[n] + 1
        return true
      end
    end
  end
  return false
end

-- Cuckoo kicks in the newest sub-filter. Every change is logged and undone if the chain runs
-- out: a kicked-out fingerprint that found no home would otherwise be a false negative.
local function place_kicking(h, g)
  local n = L.nsub - 1
  local fp, i1, i2 = item_at(h, g, n)
  local m = sf_buckets(n)
  -- Victims come from a generator seeded by the item's own hash: reproducible (tests/reference.py
  -- replays it bit for bit) yet not the fixed rotation that loops between copies of one print.
  local st = fmod(h + g, P31 - 1) + 1
  st = fmod(st * 48271, P31)
  local i = (fmod(st, 2) == 0) and i1 or i2
  local undo = {}
  for _ = 1, L.kicks do
    st = fmod(st * 48271, P31)
    local s = fmod(st, L.b) + 1
    local bkt = bucket(n, i)
    undo[#undo + 1] = {i, s, bkt[s], dirty[n][i]}
    bkt[s], fp = fp, bkt[s]
    dirty[n][i] = true
    i = alt_index(i, mix(prefix_of(fp, n)), m)
    local free = find(bucket(n, i), 0)
    if free then
      put(n, i, free, fp)
      item_delta[n] = item_delta[n] + 1
      return true
    end
  end
  for k = #undo, 1, -1 do
    local u = undo[k]
    cache[n][u[1]][u[2]] = u[3]
    dirty[n][u[1]] = u[4]
  end
  return false
end

-- Adds sub-filter `subfilters`, expansion times the previous one, created at full size at once.
local function grow()
  local n = L.nsub
  if L.exp == 0 or n >= MAX_SUBFILTERS then return FULL end
  -- Past 32 bits a growing filter could not keep tightening, and its error bound would break.
  if L.fstep > 0 and L.f0 + L.fstep * n > 32 then return FULL end
  if sf_bytes(n) > MAX_STRING_BYTES then return FULL end
  if #KEYS < n + 1 then return NEEDKEYS end
  local key = KEYS[n + 1]
  redis.call('DEL', key)
  -- The new tag: this sub-filter's index (top bit set), then the geometry digest copied from
  -- sub-filter 0's tag, whose first byte (the sub-filter count) changes below.
  local tag0 = sf_bytes(0) - TAG_BYTES
  local digest = redis.call('GETRANGE', KEYS[1], tag0 + 1, tag0 + 6)
  redis.call('SETRANGE', key, sf_bytes(n) - TAG_BYTES,
    string.char(128 + n) .. digest .. string.char(TRAILER))
  -- The header bytes every sub-filter shares; the rest (applied, source) stays 0 here.
  redis.call('SETRANGE', key, 0, redis.call('GETRANGE', KEYS[1], 0, COMMON_BYTES - 1))
  redis.call('BITFIELD', key, 'SET', 'u8', INDEX_AT * 8, n, 'SET', 'i64', ITEMS_AT * 8, 0,
    'SET', 'i64', DELETES_AT * 8, 0, 'SET', 'i64', MISSED_AT * 8, 0)
  redis.call('BITFIELD', KEYS[1], 'SET', 'u8', SUBFILTERS_AT * 8, n + 1, 'SET', 'u8', tag0 * 8, n + 1)
  L.nsub = n + 1
  return OK
end

-- Adds one copy of the item (h, g): 1 added, 0 already present (only when `unique`); or nil
-- and the status that stopped it (FULL, NEEDKEYS), having changed nothing.
local function add(h, g, unique)
  if unique and present(h, g) then return 0 end
  if not (place_direct(h, g) or (L.kicks > 0 and place_kicking(h, g))) then
    local status = grow()
    if status ~= OK then return nil, status end
    place_direct(h, g)
  end
  return 1
end

-- Removes one copy of the item (h, g): 1 removed, 0 nothing found (counted as a missed delete:
-- deleting what was never inserted is how a cuckoo filter loses keys).
local function remove(h, g)
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
      removed = removed + 1
      return 1
    end
  end
  missed = missed + 1
  return 0
end

-- Writes every change back: the buckets, the item counts, the delete counters.
local function finish()
  flush()
  if removed > 0 or missed > 0 then
    redis.call('BITFIELD', KEYS[1], 'INCRBY', 'i64', DELETES_AT * 8, removed,
      'INCRBY', 'i64', MISSED_AT * 8, missed)
    removed, missed = 0, 0
  end
end
