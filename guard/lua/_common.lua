-- _common.lua: constants, layout check and hashing, prepended to every guard script.
--
-- KEYS[n + 1] is sub-filter n's string (KEYS[1] holds the header that counts).
-- ARGV[1..9] is the caller's view of the layout: bucket_size, fp_bits, fp_step, expansion,
-- subfilters, max_kicks, buckets0, seed, and the tag's 48-bit digest of them. The first thing
-- a script does is prove that view against the stored headers, lengths and tags
-- (check_layout); a different layout returns {STALE} and writes nothing, damage an error.
--
-- Numbers: Lua 5.1 holds integers below 2^53 exactly in doubles, so every product below is
-- kept under 2^53 (no `bit`: fakeredis has none). `a % m` (a - floor(a / m) * m) is exact for
-- integers |a| < 2^53: the quotient's rounding error is below 1/m, too little to cross an
-- integer, and the product and difference are exact.
--
-- Cost: all of this runs again on every call (Redis keeps nothing between calls), and making
-- a function costs about 0.05 us per outer local it captures. So functions capture few
-- locals: they share one table (L), take what else they need as arguments, use Redis's
-- globals (redis, string, math) where a call is rare, and write the format's constants as
-- numbers (named in a comment; the named locals below are for the scripts' main chunks and
-- the docs). The common case, a valid filter laid out as the caller says, is checked with
-- arithmetic on the bytes of two GETRANGEs; only a call that fails that test runs the full
-- check (full_check), which says what is wrong.

local MAGIC, VERSION, TRAILER = 1129006916, 3, 165  -- "CKGD"
local TAG_BYTES = 8  -- each string ends in a tag whose last byte is TRAILER (docs/format.md)
-- The header (guard/layout.py names the same offsets): byte offsets of its fields. Growth
-- copies sub-filter 0's first COMMON_BYTES into a new sub-filter; the bytes after them
-- (applied, source, reserved) are sub-filter 0's alone, 0 elsewhere.
local HEADER_BYTES = 128
local SUBFILTERS_AT, INDEX_AT, ITEMS_AT, DELETES_AT, MISSED_AT = 9, 10, 32, 40, 48
local ERROR_RATE_AT, COMMON_BYTES = 56, 64
local APPLIED_AT, SOURCE_AT, RESERVED_AT = 64, 72, 80
local MAX_CHANGE_ID = 2 ^ 53 - 1  -- change ids are added and compared as doubles
local MAX_SUBFILTERS = 32
local MAX_STRING_BYTES = 536870912
local P31 = 2147483647
local OK, STALE, FULL, NEEDKEYS, GAP, SOURCE = 0, 1, 2, 3, 4, 5

-- The caller's layout, and the per-call state the functions share (_store.lua), all made in
-- one constructor (a field added later makes Lua grow the table). top: g below it has its
-- top f0 bits all zero (fixed_g); drop.lua and reserve.lua carry no layout.
local tonumber = tonumber  -- one global lookup, not ten
local f0 = tonumber(ARGV[2])
local L = {
  b = tonumber(ARGV[1]), f0 = f0, fstep = tonumber(ARGV[3]),
  exp = tonumber(ARGV[4]), nsub = tonumber(ARGV[5]), kicks = tonumber(ARGV[6]),
  m0 = tonumber(ARGV[7]), seed = tonumber(ARGV[8]), digest = tonumber(ARGV[9]),
  top = 2 ^ (32 - (f0 or 0)),
  sf = {},  -- sub-filter n -> its slots and changes (_store.lua: sub)
  removed = 0, missed = 0,  -- the delete counters, written with sub-filter 0
}

-- Sub-filter n under layout L: buckets, fingerprint bits, string length in bytes.
local function geometry(L, n)
  local m = L.exp == 0 and L.m0 or L.m0 * L.exp ^ n
  local f = L.f0 + L.fstep * n
  if f > 32 then f = 32 end
  return m, f, 128 + math.ceil(m * L.b * f / 8) + 8  -- HEADER_BYTES + table + TAG_BYTES
end

local function guard_error(code, msg)
  return redis.error_reply('GUARD_' .. code .. ' ' .. msg)
end

-- Big-endian unsigned integer of `size` bytes at byte offset `at` of string s. Above 2^53 a
-- double rounds, which the range checks never need to tell apart.
local function field(s, at, size)
  local v = 0
  for i = at + 1, at + size do v = v * 256 + string.byte(s, i) end
  return v
end

-- The 8 bytes sub-filter n's string must end in under L (guard/layout.py: Layout.tag): the
-- count (sub-filter 0) or 128 + n, the 6-byte digest, TRAILER.
local function expected_tag(L, n)
  local d, floor = L.digest, math.floor
  return string.char(n == 0 and L.nsub or 128 + n, floor(d / 2 ^ 40), floor(d / 2 ^ 32) % 256,
    floor(d / 2 ^ 24) % 256, floor(d / 2 ^ 16) % 256, floor(d / 256) % 256, d % 256, 165)
end

-- The full check, field by field, that names what is wrong (docs/format.md, "Valid values").
-- check_layout runs it only when its fast test does not pass.
local function full_check(L, base)
  local MAGIC, VERSION, HEADER_BYTES, TAG_BYTES = 1129006916, 3, 128, 8
  local SUBFILTERS_AT, INDEX_AT, ITEMS_AT, DELETES_AT, MISSED_AT = 9, 10, 32, 40, 48
  local ERROR_RATE_AT, COMMON_BYTES, APPLIED_AT, RESERVED_AT = 56, 64, 64, 80
  local ZEROS = string.rep('\0', HEADER_BYTES)
  local fmt = string.format
  -- {name, byte offset, size, lowest, highest}: every header field with a range of its own;
  -- guard/layout.py:_RANGES is the same list. The version is checked first, on its own:
  -- another version is not damage but another format.
  local RANGES = {
    {'bucket_size', 5, 1, 1, 8}, {'fp_bits', 6, 1, 4, 32},
    {'fp_step', 7, 1, 0, 1}, {'expansion', 8, 1, 0, 16},
    {'subfilters', SUBFILTERS_AT, 1, 1, 32}, {'index', INDEX_AT, 1, 0, 0},
    {'flags', 11, 1, 0, 0}, {'buckets0', 12, 4, 1, 2 ^ 32 - 1},
    {'max_kicks', 16, 2, 0, 4000}, {'shards', 18, 2, 0, 1024}, {'capacity', 24, 8, 1, 2 ^ 40},
    {'deletes', DELETES_AT, 8, 0, 2 ^ 63 - 1}, {'missed_deletes', MISSED_AT, 8, 0, 2 ^ 63 - 1},
    {'error_rate', ERROR_RATE_AT, 8, 0, 10 ^ 12 - 1}, {'applied', APPLIED_AT, 8, 0, 2 ^ 53 - 1},
  }
  local BUCKET_SIZES = {[1] = true, [2] = true, [4] = true, [8] = true}

  -- What is wrong with sub-filter 0's header h on its own, or nil.
  local function header_problem(h)
    if #h < 5 or field(h, 0, 4) ~= MAGIC then return 'bad magic' end
    local version = field(h, 4, 1)
    if version ~= VERSION then
      -- guard/layout.py:version_problem says the same.
      return fmt('unsupported format version %d (this library reads version %d; '
        .. 're-create the filter: docs/format.md, Upgrading)', version, VERSION)
    end
    if #h < HEADER_BYTES then
      return fmt('truncated: %d bytes long, shorter than a header', #h)
    end
    if h:sub(RESERVED_AT + 1) ~= ZEROS:sub(RESERVED_AT + 1) then
      return fmt('reserved bytes %d-%d are not zero', RESERVED_AT, HEADER_BYTES - 1)
    end
    for _, r in ipairs(RANGES) do
      local v = field(h, r[2], r[3])
      if v < r[4] or v > r[5] then
        return fmt('%s %.0f is out of range %.0f-%.0f', r[1], v, r[4], r[5])
      end
    end
    if not BUCKET_SIZES[field(h, 5, 1)] then return 'bucket_size is not one of 1, 2, 4, 8' end
    return nil
  end

  -- What is wrong with sub-filter n's header h (n >= 1), or nil: sub-filter 0's header h0 as
  -- growth copied it, with its own index and item count and its other counters zero.
  local function subfilter_problem(h, h0, n)
    if #h < HEADER_BYTES or field(h, 0, 4) ~= MAGIC then return 'bad magic' end
    if field(h, SUBFILTERS_AT, 1) ~= n or field(h, INDEX_AT, 1) ~= n then
      return 'holds the index of another sub-filter'
    end
    -- Byte ranges below are 1-based: (a, b] in offsets is h:sub(a + 1, b).
    if h:sub(1, SUBFILTERS_AT) ~= h0:sub(1, SUBFILTERS_AT)
      or h:sub(INDEX_AT + 2, ITEMS_AT) ~= h0:sub(INDEX_AT + 2, ITEMS_AT)
      or h:sub(ERROR_RATE_AT + 1, COMMON_BYTES) ~= h0:sub(ERROR_RATE_AT + 1, COMMON_BYTES)
      or h:sub(DELETES_AT + 1, ERROR_RATE_AT) ~= ZEROS:sub(DELETES_AT + 1, ERROR_RATE_AT)
      or h:sub(COMMON_BYTES + 1) ~= ZEROS:sub(COMMON_BYTES + 1) then
      return "header disagrees with sub-filter 0's"
    end
    return nil
  end

  -- What is wrong with the rest of sub-filter n (items, length, tag) under L, or nil.
  local function string_problem(key, h, n)
    local m, _, bytes = geometry(L, n)
    local items = field(h, ITEMS_AT, 8)  -- a negative (signed) count reads above 2^63 here
    if items > m * L.b then
      return fmt('items %.0f is out of range 0-%.0f', items, m * L.b)
    end
    local len = redis.call('STRLEN', key)
    if len ~= bytes then
      return fmt('%s: %d bytes long, its header says %d',
        len < bytes and 'truncated' or 'extended', len, bytes)
    end
    if redis.call('GETRANGE', key, len - TAG_BYTES, len - 1) ~= expected_tag(L, n) then
      return 'bad tag (it disagrees with the header)'
    end
    return nil
  end

  -- Sub-filter n's header ('' when the key is missing); a key of another type is damage.
  local function read_header(key)
    local h = redis.pcall('GETRANGE', key, 0, HEADER_BYTES - 1)
    if type(h) == 'table' then return nil, guard_error('CORRUPT', key .. ' holds another type') end
    return h, nil
  end

  local key0 = KEYS[base + 1]
  local h0, err = read_header(key0)
  if err then return err end
  if h0 == '' and redis.call('EXISTS', key0) == 0 then
    -- What is left of a filter is no filter, but never "absent".
    if KEYS[base + 2] and redis.call('EXISTS', KEYS[base + 2]) == 1 then
      return guard_error('CORRUPT', key0 .. ' is missing')
    end
    return guard_error('NOTFOUND', 'no such filter')
  end
  local problem = header_problem(h0)
  if problem then return guard_error('CORRUPT', key0 .. ': ' .. problem) end
  local stored = {field(h0, 5, 1), field(h0, 6, 1), field(h0, 7, 1), field(h0, 8, 1),
    field(h0, SUBFILTERS_AT, 1), field(h0, 16, 2), field(h0, 12, 4), field(h0, 20, 4)}
  local mine = {L.b, L.f0, L.fstep, L.exp, L.nsub, L.kicks, L.m0, L.seed}
  for k = 1, 8 do
    if stored[k] ~= mine[k] or #KEYS < base + L.nsub then return {1} end  -- STALE
  end
  for n = 0, L.nsub - 1 do
    local key = KEYS[base + n + 1]
    local h = h0
    if n > 0 then
      h, err = read_header(key)
      if err then return err end
    end
    problem = (n > 0 and subfilter_problem(h, h0, n)) or string_problem(key, h, n)
    if problem then return guard_error('CORRUPT', key .. ': ' .. problem) end
  end
  return nil, h0
end

-- The one check of the stored bytes every script runs first (docs/format.md, "Valid values"),
-- on the filter whose sub-filter n is KEYS[base + n + 1]. Returns nil when every sub-filter is
-- valid and laid out as L says, {STALE} when sub-filter 0's header is valid but holds another
-- layout (the client then reads and verifies it: guard/layout.py:verify_stored), or an error;
-- and, when it returns nil, sub-filter 0's header as a second value (applied, source).
-- Only read-only commands: the check runs as well on a read-only replica.
--
-- The fast test passes only when every check full_check makes passes and the stored layout
-- is L: sub-filter 0's header (one GETRANGE) field by field, then one GETRANGE from where L
-- puts the tag to one byte past it, which equals the tag only when the string has exactly
-- the length L gives it and ends in the right tag; each other sub-filter likewise against
-- sub-filter 0's header. Anything else (stale, missing, damaged) goes to full_check.
local function check_layout(base)
  base = base or 0
  local b, nsub, byte, fmt = L.b, L.nsub, string.byte, string.format
  -- L itself within the ranges, so that a stored field equal to it is in range too.
  if not (b == 1 or b == 2 or b == 4 or b == 8) or L.f0 < 4 or L.f0 > 32 or L.fstep > 1
    or L.exp > 16 or nsub < 1 or nsub > 32 or L.kicks > 4000 or L.m0 < 1
    or L.m0 > 2 ^ 32 - 1 or L.seed > 2 ^ 32 - 1 or #KEYS < base + nsub
    or (L.exp == 0 and nsub ~= 1) then
    return full_check(L, base)
  end
  local key0 = KEYS[base + 1]
  local h0 = redis.pcall('GETRANGE', key0, 0, 127)  -- the header: HEADER_BYTES
  if type(h0) ~= 'string' or #h0 ~= 128 then return full_check(L, base) end
  local c1, c2, c3, c4, v, hb, hf, hs, he, hn, ix, fl, m1, m2, m3, m4, k1, k2, s1, s2, d1, d2,
    d3, d4 = byte(h0, 1, 24)
  -- Bytes 0-23: magic "CKGD", version 3, the layout, index and flags 0, shards <= 1024.
  if c1 ~= 67 or c2 ~= 75 or c3 ~= 71 or c4 ~= 68 or v ~= 3 or hb ~= b or hf ~= L.f0
    or hs ~= L.fstep or he ~= L.exp or hn ~= nsub or ix ~= 0 or fl ~= 0
    or ((m1 * 256 + m2) * 256 + m3) * 256 + m4 ~= L.m0 or k1 * 256 + k2 ~= L.kicks
    or ((d1 * 256 + d2) * 256 + d3) * 256 + d4 ~= L.seed or s1 * 256 + s2 > 1024 then
    return full_check(L, base)
  end
  -- Bytes 24-79: capacity 1..2^40, items (below), deletes and missed_deletes not negative
  -- (signed: top bit clear), error_rate < 10^12, applied < 2^53; bytes 80-127 zero.
  local a1, a2, a3, a4, a5, a6, a7, a8 = byte(h0, 25, 32)
  local capacity = ((((((a1 * 256 + a2) * 256 + a3) * 256 + a4) * 256 + a5) * 256 + a6) * 256
    + a7) * 256 + a8
  local e1, e2, e3, e4, e5, e6, e7, e8 = byte(h0, 57, 64)
  local x1, x2 = byte(h0, 65, 66)
  if capacity < 1 or capacity > 2 ^ 40 or byte(h0, 41) > 127 or byte(h0, 49) > 127
    or ((((((e1 * 256 + e2) * 256 + e3) * 256 + e4) * 256 + e5) * 256 + e6) * 256 + e7) * 256
      + e8 > 10 ^ 12 - 1
    or x1 ~= 0 or x2 > 31 or h0:sub(81) ~= '\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0' then
    return full_check(L, base)
  end
  local h = h0
  for n = 0, nsub - 1 do
    local key = KEYS[base + n + 1]
    if n > 0 then
      h = redis.pcall('GETRANGE', key, 0, 127)
      -- As growth copied sub-filter 0's: bytes 0-8, 11-31, 56-63 equal, 9 and 10 (count and
      -- index) n, deletes and missed 0, bytes 64-127 0.
      if type(h) ~= 'string' or #h ~= 128 or byte(h, 10) ~= n or byte(h, 11) ~= n
        or h:sub(1, 9) ~= h0:sub(1, 9) or h:sub(12, 32) ~= h0:sub(12, 32)
        or h:sub(57, 64) ~= h0:sub(57, 64) or h:sub(41, 56) ~= string.rep('\0', 16)
        or h:sub(65) ~= string.rep('\0', 64) then
        return full_check(L, base)
      end
    end
    local m, _, bytes = geometry(L, n)
    local i1, i2, i3, i4, i5, i6, i7, i8 = byte(h, 33, 40)  -- items <= the slot count
    -- The tag (expected_tag): count or 128 + n, the 48-bit digest, TRAILER; and no 9th byte.
    local t1, t2, t3, t4, t5, t6, t7, t8, t9 = byte(redis.call('GETRANGE', key,
      fmt('%d', bytes - 8), fmt('%d', bytes)), 1, 9)
    if ((((((i1 * 256 + i2) * 256 + i3) * 256 + i4) * 256 + i5) * 256 + i6) * 256 + i7) * 256
      + i8 > m * b
      or t9 ~= nil or t8 ~= 165 or t1 ~= (n == 0 and nsub or 128 + n)
      or ((((t2 * 256 + t3) * 256 + t4) * 256 + t5) * 256 + t6) * 256 + t7 ~= L.digest then
      return full_check(L, base)
    end
  end
  return nil, h0
end

-- A non-linear hash of a fingerprint prefix p < 2^32; guard/hashing.py:mix is the same
-- arithmetic. Every product stays below 2^53 (P31 = 2^31 - 1).
local function mix(p)
  local x = p % 2147483647
  x = (x * 1103515 + 12345) % 2147483647
  x = (x * (x % 65521 + 1)) % 2147483647
  return (x * 1664525 + 1013904223) % 2147483647
end

-- (H(fp) - i) mod m is its own inverse for any m, so no power-of-two table is needed.
local function alt_index(i, hp, m)
  return (hp - i) % m
end

-- g with its top f0 bits (its fingerprint prefix, g / L.top) never all zero.
local function fixed_g(g)
  if g < L.top then g = g + L.top end
  return g
end
