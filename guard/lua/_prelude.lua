-- _prelude.lua: shared by every guard script (scripts.py prepends it to each operation).
--
-- KEYS[n + 1] is sub-filter n's string (KEYS[1] holds the header that counts).
-- ARGV[1..8] is the caller's view of the layout: bucket_size, fp_bits, fp_step, expansion,
-- subfilters, max_kicks, buckets0, seed. The first thing a script does is prove that view
-- against the stored header; a mismatch returns {STALE, <stored layout>} and writes nothing.
--
-- Numbers: Lua 5.1 holds integers below 2^53 exactly in doubles, and math.fmod is exact,
-- so every product below is kept under 2^53 and reduced with fmod (no `bit`: fakeredis has none).

local MAGIC, VERSION, TRAILER = 1129006916, 1, 165  -- "CKGD"
local HEADER_BITS = 512
local MAX_SUBFILTERS = 32
local MAX_STRING_BYTES = 536870912
local P31 = 2147483647
local OK, STALE, FULL, NEEDKEYS = 0, 1, 2, 3
-- A BITFIELD call is built with unpack(), which the Lua C stack caps below 8000 values:
-- 1500 sub-commands of up to 4 values each, plus the command and key, stay under it.
local MAX_OPS = 1500

local fmod, floor = math.fmod, math.floor

local L = {
  b = tonumber(ARGV[1]), f0 = tonumber(ARGV[2]), fstep = tonumber(ARGV[3]),
  exp = tonumber(ARGV[4]), nsub = tonumber(ARGV[5]), kicks = tonumber(ARGV[6]),
  m0 = tonumber(ARGV[7]), seed = tonumber(ARGV[8]),
}

local function sf_buckets(n)
  if L.exp == 0 then return L.m0 end
  return L.m0 * L.exp ^ n
end

local function sf_bits(n)
  local f = L.f0 + L.fstep * n
  if f > 32 then f = 32 end
  return f
end

local function sf_bytes(n)
  return 64 + math.ceil(sf_buckets(n) * L.b * sf_bits(n) / 8) + 1
end

local function guard_error(code, msg)
  return redis.error_reply('GUARD_' .. code .. ' ' .. msg)
end

-- Returns nil when the stored header matches L, else the reply the script must return.
local function check_layout()
  local known = L.m0 > 0 and L.nsub >= 1 and #KEYS >= L.nsub
  local args = {'BITFIELD', KEYS[1],
    'GET', 'u32', 0, 'GET', 'u8', 40, 'GET', 'u8', 48, 'GET', 'u8', 56, 'GET', 'u8', 64,
    'GET', 'u8', 72, 'GET', 'u16', 128, 'GET', 'u32', 96, 'GET', 'u32', 160, 'GET', 'u8', 32}
  if known then
    table.insert(args, 'GET'); table.insert(args, 'u8'); table.insert(args, (sf_bytes(0) - 1) * 8)
  end
  local r = redis.call(unpack(args))
  if r[1] ~= MAGIC then
    if redis.call('EXISTS', KEYS[1]) == 0 then return guard_error('NOTFOUND', 'no such filter') end
    return guard_error('CORRUPT', 'bad magic in ' .. KEYS[1])
  end
  if r[10] ~= VERSION then return guard_error('CORRUPT', 'unsupported format version') end
  local stored = {r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9]}
  local mine = {L.b, L.f0, L.fstep, L.exp, L.nsub, L.kicks, L.m0, L.seed}
  for k = 1, 8 do
    if stored[k] ~= mine[k] or not known then
      local reply = {STALE}
      for j = 1, 8 do reply[j + 1] = stored[j] end
      return reply
    end
  end
  if r[11] ~= TRAILER then return guard_error('CORRUPT', 'truncated: ' .. KEYS[1]) end
  for n = 1, L.nsub - 1 do
    local s = redis.call('BITFIELD', KEYS[n + 1], 'GET', 'u32', 0, 'GET', 'u8', 80,
      'GET', 'u8', (sf_bytes(n) - 1) * 8)
    if s[1] ~= MAGIC or s[2] ~= n then return guard_error('CORRUPT', 'bad sub-filter ' .. KEYS[n + 1]) end
    if s[3] ~= TRAILER then return guard_error('CORRUPT', 'truncated: ' .. KEYS[n + 1]) end
  end
  return nil
end

-- A non-linear hash of a fingerprint prefix; guard/hashing.py:mix is the same arithmetic.
local function mix(p)
  local x = fmod(p, P31)
  x = fmod(x * 1103515 + 12345, P31)
  x = fmod(x * (fmod(x, 65521) + 1), P31)
  x = fmod(x * 1664525 + 1013904223, P31)
  return x
end

-- (H(fp) - i) mod m is its own inverse for any m, so no power-of-two table is needed.
local function alt_index(i, hp, m)
  local j = fmod(hp - i, m)
  if j < 0 then j = j + m end
  return j
end

-- H of a stored fingerprint uses its first f0 bits only: the same value in every sub-filter.
local function prefix_of(fp, n)
  return floor(fp / 2 ^ (sf_bits(n) - L.f0))
end

-- Per-item hash parts: h picks buckets, g (top f0 bits forced non-zero) gives fingerprints.
local function item_at(h, g, n)
  local m = sf_buckets(n)
  local fp = floor(g / 2 ^ (32 - sf_bits(n)))
  local i1 = fmod(h, m)
  return fp, i1, alt_index(i1, mix(floor(g / 2 ^ (32 - L.f0))), m)
end

local function fixed_g(g)
  if floor(g / 2 ^ (32 - L.f0)) == 0 then g = g + 2 ^ (32 - L.f0) end
  return g
end

-- Bucket store: a read-through cache of buckets, changed in place, written back by flush().
-- Nothing reaches Redis before flush(), so a failed kick chain is dropped, never half-applied.
-- Per sub-filter tables are made on first use: most calls touch one sub-filter, and building
-- them all up front was a measurable share of a lookup's cost.
local cache, orig, dirty, item_delta = {}, {}, {}, {}
local function touch(n)
  if not cache[n] then cache[n] = {}; orig[n] = {}; dirty[n] = {}; item_delta[n] = 0 end
end

local function slot_offset(n, i, s)
  return HEADER_BITS + (i * L.b + s) * sf_bits(n)
end

-- Reads buckets (list of indexes) of sub-filter n that are not cached, in one BITFIELD call.
local function load(n, list)
  touch(n)
  local args, want, seen = {'BITFIELD', KEYS[n + 1]}, {}, {}
  local ftype = 'u' .. sf_bits(n)
  for _, i in ipairs(list) do
    if not cache[n][i] and not seen[i] then
      seen[i] = true
      want[#want + 1] = i
      for s = 0, L.b - 1 do
        args[#args + 1] = 'GET'; args[#args + 1] = ftype; args[#args + 1] = slot_offset(n, i, s)
      end
    end
  end
  if #want == 0 then return end
  local r = redis.call(unpack(args))
  for k, i in ipairs(want) do
    local bucket, copy = {}, {}
    for s = 1, L.b do
      bucket[s] = r[(k - 1) * L.b + s]; copy[s] = bucket[s]
    end
    cache[n][i] = bucket; orig[n][i] = copy
  end
end

-- Loads the buckets of many items at once, in calls of at most MAX_OPS reads.
local function load_many(n, list)
  local per_call = floor(MAX_OPS / L.b)
  for start = 1, #list, per_call do
    local part = {}
    for k = start, math.min(#list, start + per_call - 1) do part[#part + 1] = list[k] end
    load(n, part)
  end
end

local function bucket(n, i)
  if not (cache[n] and cache[n][i]) then load(n, {i}) end
  return cache[n][i]
end

local function find(bkt, fp)
  for s = 1, L.b do if bkt[s] == fp then return s end end
  return nil
end

local function put(n, i, s, fp)
  bucket(n, i)[s] = fp
  dirty[n][i] = true
end

local function flush()
  for n = 0, L.nsub - 1 do
    touch(n)
    local args, ops = {'BITFIELD', KEYS[n + 1]}, 0
    local ftype = 'u' .. sf_bits(n)
    for i, _ in pairs(dirty[n]) do
      for s = 1, L.b do
        if cache[n][i][s] ~= orig[n][i][s] then
          args[#args + 1] = 'SET'; args[#args + 1] = ftype
          args[#args + 1] = slot_offset(n, i, s - 1); args[#args + 1] = cache[n][i][s]
          orig[n][i][s] = cache[n][i][s]
          ops = ops + 1
          if ops >= MAX_OPS then
            redis.call(unpack(args)); args = {'BITFIELD', KEYS[n + 1]}; ops = 0
          end
        end
      end
    end
    dirty[n] = {}
    if item_delta[n] ~= 0 then
      args[#args + 1] = 'INCRBY'; args[#args + 1] = 'i64'; args[#args + 1] = 256
      args[#args + 1] = item_delta[n]
      item_delta[n] = 0
      ops = ops + 1
    end
    if ops > 0 then redis.call(unpack(args)) end
  end
end
