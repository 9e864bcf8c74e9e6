-- _add.lua: adding one item, shared by the scripts that add (insert, apply, undo). Everything
-- goes through the slot store (_store.lua); finish() writes it all back.
--
-- One call's work is limited (guard/ops.py: KICK_BUDGET, written in by guard/scripts.py
-- with RESERVE_MAX and ITEM_WORK): the scripts that add take their next item
-- only while `work + reserve` fits in KICK_BUDGET, `work` counting each item's kick steps plus
-- ITEM_WORK for the rest of its cost, `reserve` the next item's worst case (ITEM_WORK plus
-- max_kicks, or RESERVE_MAX if less); they answer for the items they took, and the caller
-- sends the rest again. So no call holds Redis much longer than KICK_BUDGET steps (or one
-- chain more than RESERVE_MAX) take, however full the filter, while a call at a low load
-- still takes a whole batch.

-- Whether the item (h, g) is in any sub-filter. hp = mix(its fingerprint prefix), the same
-- in every sub-filter.
local function present(h, g, hp)
  for n = L.nsub - 1, 0, -1 do
    local s = sub(n)
    local fp, i1 = math.floor(g / s.gdiv), h % s.m
    if find(s, i1, fp) or find(s, alt_index(i1, hp, s.m), fp) then return true end
  end
  return false
end

-- A free slot in either bucket of any sub-filter, newest first (older ones reuse deleted slots).
local function place_direct(h, g, hp)
  for n = L.nsub - 1, 0, -1 do
    local s = sub(n)
    local i1 = h % s.m
    local k = find(s, i1, 0) or find(s, alt_index(i1, hp, s.m), 0)
    if k then
      set(s, k, math.floor(g / s.gdiv))
      s.delta = s.delta + 1
      return true
    end
  end
  return false
end

-- Cuckoo kicks in the newest sub-filter, on the slot table. Each step's slot and old value
-- are logged and put back if the chain runs out: a kicked-out fingerprint that found no home
-- would otherwise be a false negative. Returns whether it placed the item, and the steps.
local function place_kicking(h, g, hp)
  local s = sub(L.nsub - 1)
  local b, m, t, first, pdiv, floor = L.b, s.m, s.t, s.first, s.pdiv, math.floor
  local fp, i1 = floor(g / s.gdiv), h % s.m
  -- Victims come from a generator seeded by the item's own hash: reproducible (tests/reference.py
  -- replays it bit for bit) yet not the fixed rotation that loops between copies of one print.
  -- P31 = 2147483647; products stay below 2^47.
  local st = (h + g) % 2147483646 + 1
  st = (st * 48271) % 2147483647
  local i = (st % 2 == 0) and i1 or alt_index(i1, hp, m)
  local log = {}
  for step = 1, L.kicks do
    st = (st * 48271) % 2147483647
    local k = i * b + st % b  -- bucket i is loaded: the chain found no room in it
    local old = t[k]
    log[2 * step - 1], log[2 * step] = k, old
    if first[k] == nil then first[k] = old end
    t[k] = fp
    fp = old
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

-- Adds sub-filter `subfilters`, expansion times the previous one, created at full size at
-- once. Returns OK (0), FULL (2) or NEEDKEYS (3).
local function grow()
  local n = L.nsub
  if L.exp == 0 or n >= MAX_SUBFILTERS then return 2 end
  -- Past 32 bits a growing filter could not keep tightening, and its error bound would break.
  if L.fstep > 0 and L.f0 + L.fstep * n > MAX_FP_BITS then return 2 end
  local _, _, bytes = geometry(L, n)
  if bytes > MAX_STRING_BYTES then return 2 end
  if #KEYS < n + 1 then return 3 end
  local key = KEYS[n + 1]
  redis.call('DEL', key)
  -- The new tag: this sub-filter's index (TAG_INDEX_FLAG set), then the geometry digest
  -- copied from sub-filter 0's tag, whose first byte (the sub-filter count) changes below.
  local _, _, bytes0 = geometry(L, 0)
  local tag0 = bytes0 - TAG_BYTES
  local digest = redis.call('GETRANGE', KEYS[1], tag0 + 1, tag0 + DIGEST_BYTES)
  redis.call('SETRANGE', key, bytes - TAG_BYTES,
    string.char(TAG_INDEX_FLAG + n) .. digest .. string.char(TRAILER))
  -- The header bytes every sub-filter shares (with the count n); the rest (applied, source)
  -- stays 0 here. Then its own index, and its counters 0.
  redis.call('SETRANGE', key, 0, redis.call('GETRANGE', KEYS[1], 0, COMMON_BYTES - 1))
  redis.call('BITFIELD', key, 'SET', 'u8', INDEX_AT * 8, n, 'SET', 'i64', ITEMS_AT * 8, 0,
    'SET', 'i64', DELETES_AT * 8, 0, 'SET', 'i64', MISSED_DELETES_AT * 8, 0)
  redis.call('BITFIELD', KEYS[1], 'SET', 'u8', SUBFILTERS_AT * 8, n + 1,
    'SET', 'u8', tag0 * 8, n + 1)
  L.nsub = n + 1
  return 0
end

-- Adds one copy of the item (h, g): 1 added, 0 already present (only when `unique`); or nil
-- and the status that stopped it (FULL, NEEDKEYS), having changed nothing. Second value: the
-- kick steps it took.
local function add(h, g, unique)
  local hp = mix(math.floor(g / L.top))
  if unique and present(h, g, hp) then return 0, 0 end
  if place_direct(h, g, hp) then return 1, 0 end
  local placed, steps = false, 0
  if L.kicks > 0 then placed, steps = place_kicking(h, g, hp) end
  if not placed then
    local status = grow()
    if status ~= 0 then return nil, steps, status end
    place_direct(h, g, hp)
  end
  return 1, steps
end
