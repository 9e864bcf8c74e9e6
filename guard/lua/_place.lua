-- _place.lua: adding and removing one item, shared by the scripts that write (insert, delete,
-- apply, undo). Everything goes through the slot store; finish() writes it all back.

-- One call's work limit: kick steps, plus ITEM_WORK per item for what an item costs besides
-- its kicks (guard/scripts.py puts both constants before the script, from guard/ops.py). A call
-- takes its next item only while that item's worst case (max_kicks steps) fits; the caller
-- sends what is left again. So no call holds Redis much longer than KICK_BUDGET steps take,
-- however full the filter, while calls at a low load still take whole batches.
local work = 0
local function spend(steps) work = work + steps + ITEM_WORK end
local function work_left() return work + L.kicks + ITEM_WORK <= KICK_BUDGET end

-- The item (h, g) in sub-filter s: its fingerprint and two buckets. hp = mix(the item's
-- fingerprint prefix), the same in every sub-filter.
local function item_in(s, h, g, hp)
  local i1 = fmod(h, s.m)
  return floor(g / s.gdiv), i1, alt_index(i1, hp, s.m)
end

local function prefix_hash(g)
  return mix(floor(g / 2 ^ (32 - L.f0)))
end

local function present(h, g, hp)
  for n = L.nsub - 1, 0, -1 do
    local s = sub(n)
    local fp, i1, i2 = item_in(s, h, g, hp)
    if find(s, i1, fp) or find(s, i2, fp) then return true end
  end
  return false
end

-- A free slot in either bucket of any sub-filter, newest first (older ones reuse deleted slots).
local function place_direct(h, g, hp)
  for n = L.nsub - 1, 0, -1 do
    local s = sub(n)
    local fp, i1, i2 = item_in(s, h, g, hp)
    local k = find(s, i1, 0) or find(s, i2, 0)
    if k then
      set(s, k, fp)
      s.delta = s.delta + 1
      return true
    end
  end
  return false
end

-- Cuckoo kicks in the newest sub-filter, on the slot table. Each step's slot and old value
-- are logged and put back if the chain runs out: a kicked-out fingerprint that found no home
-- would otherwise be a false negative. Returns true when placed, and the steps taken.
local function place_kicking(h, g, hp)
  local s = sub(L.nsub - 1)
  local b, m, t, pdiv = L.b, s.m, s.t, s.pdiv
  local fp, i1, i2 = item_in(s, h, g, hp)
  -- Victims come from a generator seeded by the item's own hash: reproducible (tests/reference.py
  -- replays it bit for bit) yet not the fixed rotation that loops between copies of one print.
  local st = fmod(h + g, P31 - 1) + 1
  st = fmod(st * 48271, P31)
  local i = (st % 2 == 0) and i1 or i2
  local log = {}
  for step = 1, L.kicks do
    st = (st * 48271) % P31
    if st < 0 then st = st + P31 end
    local k = i * b + st % b  -- bucket i is in the table: the chain came from it or found it
    log[2 * step - 1], log[2 * step] = k, t[k]
    if s.first[k] == nil then s.first[k] = t[k] end
    t[k], fp = fp, t[k]
    i = alt_index(i, mix(floor(fp / pdiv)), m)
    local free = find(s, i, 0)
    if free then
      set(s, free, fp)
      s.delta = s.delta + 1
      return true, step
    end
  end
  for j = #log - 1, 1, -2 do t[log[j]] = log[j + 1] end
  return false, L.kicks
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
    char(128 + n) .. digest .. char(TRAILER))
  -- The header bytes every sub-filter shares; the rest (applied, source) stays 0 here.
  redis.call('SETRANGE', key, 0, redis.call('GETRANGE', KEYS[1], 0, COMMON_BYTES - 1))
  redis.call('BITFIELD', key, 'SET', 'u8', INDEX_AT * 8, n, 'SET', 'i64', ITEMS_AT * 8, 0,
    'SET', 'i64', DELETES_AT * 8, 0, 'SET', 'i64', MISSED_AT * 8, 0)
  redis.call('BITFIELD', KEYS[1], 'SET', 'u8', SUBFILTERS_AT * 8, n + 1, 'SET', 'u8', tag0 * 8, n + 1)
  L.nsub = n + 1
  return OK
end

-- Adds one copy of the item (h, g): 1 added, 0 already present (only when `unique`); or nil
-- and the status that stopped it (FULL, NEEDKEYS), having changed nothing. Second value: the
-- kick steps it took.
local function add(h, g, unique)
  local hp = prefix_hash(g)
  if unique and present(h, g, hp) then return 0, 0 end
  if place_direct(h, g, hp) then return 1, 0 end
  local placed, steps = false, 0
  if L.kicks > 0 then placed, steps = place_kicking(h, g, hp) end
  if not placed then
    local status = grow()
    if status ~= OK then return nil, steps, status end
    place_direct(h, g, hp)
  end
  return 1, steps
end

-- Removes one copy of the item (h, g): 1 removed, 0 nothing found (counted as a missed delete:
-- deleting what was never inserted is how a cuckoo filter loses keys).
local function remove(h, g)
  local hp = prefix_hash(g)
  -- Newest sub-filter first. Sizes divide one another and fingerprints are prefixes of one
  -- another, so an item colliding with ours in a newer sub-filter collides in every older one:
  -- removing its copy there leaves ours to answer for it (docs/format.md has the argument).
  for n = L.nsub - 1, 0, -1 do
    local s = sub(n)
    local fp, i1, i2 = item_in(s, h, g, hp)
    local k = find(s, i1, fp) or find(s, i2, fp)
    if k then
      set(s, k, 0)
      s.delta = s.delta - 1
      removed = removed + 1
      return 1
    end
  end
  missed = missed + 1
  return 0
end

-- Writes every change back: the slots, the item counts, the delete counters.
local function finish()
  flush()
end
