-- insert.lua: add items (the filter is a multiset), kicking and growing as needed.
-- KEYS: sub-filters 0..subfilters-1, then spare keys growth may create (subfilters, ...).
-- ARGV: layout (9), unique (0|1), then h1, g1, h2, g2, ...
-- Reply: {status, subfilters, r1, r2, ...}, one r per item handled (1 added; 0 already
--   present, only when unique). status OK: all handled; FULL: a fixed-size filter (or one at
--   its growth limit) could not place the next item; NEEDKEYS: growth needs a key not passed.
--   Both stop at that item with everything before it written. Or {STALE, layout...}.
local err = check_layout()
if err then return err end
local unique = ARGV[10] == '1'

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
  redis.call('SETRANGE', key, 0, redis.call('GETRANGE', KEYS[1], 0, 63))
  redis.call('BITFIELD', key, 'SET', 'u8', 80, n, 'SET', 'i64', 256, 0,
    'SET', 'i64', 320, 0, 'SET', 'i64', 384, 0)
  redis.call('BITFIELD', KEYS[1], 'SET', 'u8', 72, n + 1, 'SET', 'u8', tag0 * 8, n + 1)
  L.nsub = n + 1
  return OK
end

local reply, status = {0, 0}, OK
for k = 11, #ARGV, 2 do
  local h, g = tonumber(ARGV[k]), fixed_g(tonumber(ARGV[k + 1]))
  if unique and present(h, g) then
    reply[#reply + 1] = 0
  else
    if not (place_direct(h, g) or (L.kicks > 0 and place_kicking(h, g))) then
      status = grow()
      if status ~= OK then break end
      place_direct(h, g)
    end
    reply[#reply + 1] = 1
  end
end
flush()
reply[1], reply[2] = status, L.nsub
return reply
