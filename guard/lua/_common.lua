-- _common.lua: constants, layout check and hashing, prepended to every guard script.
--
-- KEYS[n + 1] is sub-filter n's string (KEYS[1] holds the header that counts).
-- ARGV[1..9] is the caller's view of the layout: bucket_size, fp_bits, fp_step, expansion,
-- subfilters, max_kicks, buckets0, seed, and the tag's 48-bit digest of them. The first thing
-- a script does is prove that view against the stored header and tags; a mismatch returns
-- {STALE, <stored layout>} and writes nothing.
--
-- Numbers: Lua 5.1 holds integers below 2^53 exactly in doubles, and math.fmod is exact,
-- so every product below is kept under 2^53 and reduced with fmod (no `bit`: fakeredis has none).

local MAGIC, VERSION, TRAILER = 1129006916, 2, 165  -- "CKGD"
local TAG_BYTES = 8  -- each string ends in a tag whose last byte is TRAILER (docs/format.md)
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
  m0 = tonumber(ARGV[7]), seed = tonumber(ARGV[8]), digest = tonumber(ARGV[9]),
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
  return 64 + math.ceil(sf_buckets(n) * L.b * sf_bits(n) / 8) + TAG_BYTES
end

local function guard_error(code, msg)
  return redis.error_reply('GUARD_' .. code .. ' ' .. msg)
end

-- Appends to a BITFIELD argument list the reads that validate sub-filter n's header; the
-- caller may append slot reads after them, so one call both validates and reads (atomically).
local function header_gets(n, args)
  if n == 0 then
    local gets = {{'u32', 0}, {'u8', 40}, {'u8', 48}, {'u8', 56}, {'u8', 64}, {'u8', 72},
      {'u16', 128}, {'u32', 96}, {'u32', 160}, {'u8', 32}}
    for _, g in ipairs(gets) do
      args[#args + 1] = 'GET'; args[#args + 1] = g[1]; args[#args + 1] = g[2]
    end
  else
    args[#args + 1] = 'GET'; args[#args + 1] = 'u32'; args[#args + 1] = 0
    args[#args + 1] = 'GET'; args[#args + 1] = 'u8'; args[#args + 1] = 80
  end
  -- The tag in two u32 words: a double holds 32 bits exactly, not 64.
  local tag = (sf_bytes(n) - TAG_BYTES) * 8
  args[#args + 1] = 'GET'; args[#args + 1] = 'u32'; args[#args + 1] = tag
  args[#args + 1] = 'GET'; args[#args + 1] = 'u32'; args[#args + 1] = tag + 32
  return n == 0 and 12 or 4
end

local function layout_known()
  return L.m0 > 0 and L.nsub >= 1 and #KEYS >= L.nsub
end

-- Sub-filter n's tag words against the tag L predicts (docs/format.md): nil, or the error.
local function verify_tag(n, w1, w2)
  if fmod(w2, 256) ~= TRAILER then return guard_error('CORRUPT', 'truncated: ' .. KEYS[n + 1]) end
  local first = n == 0 and L.nsub or 128 + n
  if w1 ~= first * 2 ^ 24 + floor(L.digest / 2 ^ 24) or w2 ~= fmod(L.digest, 2 ^ 24) * 256 + TRAILER then
    return guard_error('CORRUPT', 'bad tag in ' .. KEYS[n + 1])
  end
  return nil
end

-- Checks the values header_gets() read. Returns nil when they match L, else the reply the
-- script must return: {STALE, <stored layout>} or an error.
local function verify_header(n, r)
  if n > 0 then
    if r[1] ~= MAGIC or r[2] ~= n then return guard_error('CORRUPT', 'bad sub-filter ' .. KEYS[n + 1]) end
    return verify_tag(n, r[3], r[4])
  end
  if r[1] ~= MAGIC then
    if redis.call('EXISTS', KEYS[1]) == 0 then return guard_error('NOTFOUND', 'no such filter') end
    return guard_error('CORRUPT', 'bad magic in ' .. KEYS[1])
  end
  if r[10] ~= VERSION then return guard_error('CORRUPT', 'unsupported format version') end
  local mine = {L.b, L.f0, L.fstep, L.exp, L.nsub, L.kicks, L.m0, L.seed}
  for k = 1, 8 do
    if r[k + 1] ~= mine[k] then
      return {STALE, r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9]}
    end
  end
  return verify_tag(0, r[11], r[12])
end

-- Validates every sub-filter's header, one call each. With no known layout (a new handle) it
-- only reads sub-filter 0's header, to answer STALE with it.
local function check_layout()
  if not layout_known() then
    local r = redis.call('BITFIELD', KEYS[1], 'GET', 'u32', 0, 'GET', 'u8', 40, 'GET', 'u8', 48,
      'GET', 'u8', 56, 'GET', 'u8', 64, 'GET', 'u8', 72, 'GET', 'u16', 128, 'GET', 'u32', 96,
      'GET', 'u32', 160, 'GET', 'u8', 32)
    local err = verify_header(0, r)  -- STALE: no layout matches an unknown one
    if err then return err end
    return {STALE, r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9]}
  end
  for n = 0, L.nsub - 1 do
    local args = {'BITFIELD', KEYS[n + 1]}
    header_gets(n, args)
    local err = verify_header(n, redis.call(unpack(args)))
    if err then return err end
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

local function slot_offset(n, i, s)
  return HEADER_BITS + (i * L.b + s) * sf_bits(n)
end

local function fixed_g(g)
  if floor(g / 2 ^ (32 - L.f0)) == 0 then g = g + 2 ^ (32 - L.f0) end
  return g
end

