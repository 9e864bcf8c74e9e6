-- _common.lua: constants, layout check and hashing, prepended to every guard script.
--
-- KEYS[n + 1] is sub-filter n's string (KEYS[1] holds the header that counts).
-- ARGV[1..9] is the caller's view of the layout: bucket_size, fp_bits, fp_step, expansion,
-- subfilters, max_kicks, buckets0, seed, and the tag's 48-bit digest of them. The first thing
-- a script does is prove that view against the stored headers, lengths and tags
-- (check_layout); a different layout returns {STALE} and writes nothing, damage an error.
--
-- The format's numbers are Python's: every UPPER_CASE name below that no line here defines
-- (HEADER_BYTES, ITEMS_AT, MAX_SHARDS, HEADER_RANGES, ...) is written in as a literal by
-- guard/scripts.py (CONSTANTS) from guard/layout.py, the one place they are written. A
-- header field's offset is its name upper-cased with _AT (ITEMS_AT), the ends of its range
-- MIN_ and MAX_ before it (MAX_ERROR_RATE, MAX_MAX_KICKS).
--
-- Numbers: Lua 5.1 holds integers below 2^53 exactly in doubles, so every product below is
-- kept under 2^53 (no `bit`: fakeredis has none). `a % m` (a - floor(a / m) * m) is exact for
-- integers |a| < 2^53: the quotient's rounding error is below 1/m, too little to cross an
-- integer, and the product and difference are exact.
--
-- Cost: all of this runs again on every call (Redis keeps nothing between calls), and making
-- a function costs about 0.025 us per outer local it captures. So functions capture few
-- locals: they share one table (L), take what else they need as arguments, and use Redis's
-- globals (redis, string, math) where a call is rare; the constants, being literals, cost
-- nothing. The common case, a valid filter laid out as the caller says, is checked with
-- arithmetic on the bytes of two GETRANGEs; only a call that fails that test runs the full
-- check (full_check), which says what is wrong.

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
  if f > MAX_FP_BITS then f = MAX_FP_BITS end
  return m, f, HEADER_BYTES + math.ceil(m * L.b * f / 8) + TAG_BYTES
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
-- count (sub-filter 0) or TAG_INDEX_FLAG + n, the DIGEST_BYTES-byte digest, TRAILER.
local function expected_tag(L, n)
  local tag, d = {n == 0 and L.nsub or TAG_INDEX_FLAG + n}, L.digest
  for k = DIGEST_BYTES, 1, -1 do
    tag[k + 1] = d % 256
    d = math.floor(d / 256)
  end
  tag[DIGEST_BYTES + 2] = TRAILER
  return string.char(unpack(tag))
end

-- The full check, field by field, that names what is wrong (docs/format.md, "Valid values"):
-- guard/layout.py:verify_stored's checks, in the same order with the same ranges.
-- check_layout runs it only when its fast test does not pass.
local function full_check(L, base)
  local ZEROS = string.rep('\0', HEADER_BYTES)
  local fmt = string.format
  -- Whether b is one of BUCKET_SIZES: bit b of BUCKET_SIZE_BITS (their set, as the sum of
  -- 2^size) is set; exact for every integer b (check_layout has the same test inline).
  local function bucket_size_ok(b)
    return b >= 1 and (BUCKET_SIZE_BITS / 2 ^ b) % 2 >= 1
  end

  -- What is wrong with sub-filter 0's header h on its own, or nil (layout.py:_header_problem).
  local function header_problem(h)
    if #h <= VERSION_AT or field(h, MAGIC_AT, VERSION_AT - MAGIC_AT) ~= MAGIC then
      return 'bad magic'
    end
    local version = field(h, VERSION_AT, 1)
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
    -- {name, byte offset, size, lowest, highest}: guard/layout.py's range of each field.
    for _, r in ipairs(HEADER_RANGES) do
      local v = field(h, r[2], r[3])
      if v < r[4] or v > r[5] then
        return fmt('%s %.0f is out of range %.0f-%.0f', r[1], v, r[4], r[5])
      end
    end
    if not bucket_size_ok(field(h, BUCKET_SIZE_AT, 1)) then
      return fmt('bucket_size %d is not a power of two', field(h, BUCKET_SIZE_AT, 1))
    end
    local exp, fstep, f0 = field(h, EXPANSION_AT, 1), field(h, FP_STEP_AT, 1), field(h, FP_BITS_AT, 1)
    local last = field(h, SUBFILTERS_AT, 1) - 1
    if last > 0 and exp == 0 then
      return fmt('subfilters %d in a filter of fixed size (expansion 0)', last + 1)
    end
    if fstep > 0 and f0 + last > MAX_FP_BITS then
      return fmt('subfilters %d would need fingerprints over %d bits', last + 1, MAX_FP_BITS)
    end
    local m0, b = field(h, BUCKETS0_AT, 4), field(h, BUCKET_SIZE_AT, 1)
    local _, _, bytes = geometry({b = b, f0 = f0, fstep = fstep, exp = exp, m0 = m0}, last)
    if bytes > MAX_STRING_BYTES then
      return fmt('buckets0 %d makes sub-filter %d larger than a Redis string', m0, last)
    end
    return nil
  end

  -- What is wrong with sub-filter n's header h (n >= 1), or nil: sub-filter 0's header h0 as
  -- growth copied it, with its own index and item count and its other counters zero.
  local function subfilter_problem(h, h0, n)
    if #h < HEADER_BYTES or field(h, MAGIC_AT, VERSION_AT - MAGIC_AT) ~= MAGIC then
      return 'bad magic'
    end
    if field(h, SUBFILTERS_AT, 1) ~= n or field(h, INDEX_AT, 1) ~= n then
      return 'holds the index of another sub-filter'
    end
    -- Byte ranges below are 1-based: (a, b] in offsets is h:sub(a + 1, b).
    if h:sub(1, SUBFILTERS_AT) ~= h0:sub(1, SUBFILTERS_AT)
      or h:sub(FLAGS_AT + 1, ITEMS_AT) ~= h0:sub(FLAGS_AT + 1, ITEMS_AT)
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
  -- No sub-filter 0: gone, or damaged if another of its keys is left. Only the client can
  -- tell which (a script sees only the keys it was given): STALE sends it to its probe.
  if h0 == '' and redis.call('EXISTS', key0) == 0 then return {STALE} end
  local problem = header_problem(h0)
  if problem then return guard_error('CORRUPT', key0 .. ': ' .. problem) end
  local stored = {}
  for k, at in ipairs({BUCKET_SIZE_AT, FP_BITS_AT, FP_STEP_AT, EXPANSION_AT, SUBFILTERS_AT}) do
    stored[k] = field(h0, at, 1)
  end
  stored[6], stored[7], stored[8] =
    field(h0, MAX_KICKS_AT, 2), field(h0, BUCKETS0_AT, 4), field(h0, SEED_AT, 4)
  local mine = {L.b, L.f0, L.fstep, L.exp, L.nsub, L.kicks, L.m0, L.seed}
  for k = 1, 8 do
    if stored[k] ~= mine[k] or #KEYS < base + L.nsub then return {STALE} end
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
-- layout or is missing (the client then reads and verifies the filter: guard/filter.py's
-- probe, which also tells a filter gone from one with keys left), or an error; and, when it
-- returns nil, sub-filter 0's header as a second value (applied, source).
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
  -- L's layout fields within their ranges, so that a stored field equal to one is in range
  -- too (a field L gets wrong in its type or width can equal no stored byte). b is one of
  -- BUCKET_SIZES when bit b of BUCKET_SIZE_BITS is set (arithmetic: a set made on every call
  -- would cost as much as the rest of this test).
  if b < 1 or (BUCKET_SIZE_BITS / 2 ^ b) % 2 < 1 or L.f0 < MIN_FP_BITS or L.f0 > MAX_FP_BITS
    or L.fstep > MAX_FP_STEP or L.exp > MAX_EXPANSION or nsub < MIN_SUBFILTERS
    or nsub > MAX_SUBFILTERS or L.kicks > MAX_MAX_KICKS or L.m0 < MIN_BUCKETS0
    or #KEYS < base + nsub or (L.exp == 0 and nsub ~= 1)
    or L.f0 + L.fstep * (nsub - 1) > MAX_FP_BITS then
    return full_check(L, base)
  end
  local key0 = KEYS[base + 1]
  local h0 = redis.pcall('GETRANGE', key0, 0, HEADER_BYTES - 1)
  if type(h0) ~= 'string' or #h0 ~= HEADER_BYTES then return full_check(L, base) end
  -- Bytes up to the capacity, in guard/layout.py's field order: magic, version, the layout,
  -- index and flags 0, shards in range.
  local c1, c2, c3, c4, v, hb, hf, hs, he, hn, ix, fl, m1, m2, m3, m4, k1, k2, s1, s2, d1, d2,
    d3, d4 = byte(h0, 1, CAPACITY_AT)
  if ((c1 * 256 + c2) * 256 + c3) * 256 + c4 ~= MAGIC or v ~= VERSION or hb ~= b
    or hf ~= L.f0 or hs ~= L.fstep or he ~= L.exp or hn ~= nsub or ix ~= 0 or fl ~= 0
    or ((m1 * 256 + m2) * 256 + m3) * 256 + m4 ~= L.m0 or k1 * 256 + k2 ~= L.kicks
    or ((d1 * 256 + d2) * 256 + d3) * 256 + d4 ~= L.seed or s1 * 256 + s2 > MAX_SHARDS then
    return full_check(L, base)
  end
  -- Then capacity, items (below), deletes and missed_deletes not negative (signed: top bit
  -- clear), error_rate and applied in range; the reserved bytes zero.
  local a1, a2, a3, a4, a5, a6, a7, a8 = byte(h0, CAPACITY_AT + 1, CAPACITY_AT + 8)
  local capacity = ((((((a1 * 256 + a2) * 256 + a3) * 256 + a4) * 256 + a5) * 256 + a6) * 256
    + a7) * 256 + a8
  local e1, e2, e3, e4, e5, e6, e7, e8 = byte(h0, ERROR_RATE_AT + 1, ERROR_RATE_AT + 8)
  local x1, x2, x3, x4, x5, x6, x7, x8 = byte(h0, APPLIED_AT + 1, APPLIED_AT + 8)
  if capacity < MIN_CAPACITY or capacity > MAX_CAPACITY or byte(h0, DELETES_AT + 1) > 127
    or byte(h0, MISSED_DELETES_AT + 1) > 127
    or ((((((e1 * 256 + e2) * 256 + e3) * 256 + e4) * 256 + e5) * 256 + e6) * 256 + e7) * 256
      + e8 > MAX_ERROR_RATE
    or ((((((x1 * 256 + x2) * 256 + x3) * 256 + x4) * 256 + x5) * 256 + x6) * 256 + x7) * 256
      + x8 > MAX_APPLIED
    or h0:sub(RESERVED_AT + 1) ~= RESERVED_ZEROS then
    return full_check(L, base)
  end
  local h = h0
  for n = 0, nsub - 1 do
    local key = KEYS[base + n + 1]
    if n > 0 then
      h = redis.pcall('GETRANGE', key, 0, HEADER_BYTES - 1)
      -- As growth copied sub-filter 0's: equal up to the count and from the flags to the
      -- items, and error_rate; count and index n, deletes and missed_deletes 0, the bytes
      -- from COMMON_BYTES on 0.
      if type(h) ~= 'string' or #h ~= HEADER_BYTES or byte(h, SUBFILTERS_AT + 1) ~= n
        or byte(h, INDEX_AT + 1) ~= n or h:sub(1, SUBFILTERS_AT) ~= h0:sub(1, SUBFILTERS_AT)
        or h:sub(FLAGS_AT + 1, ITEMS_AT) ~= h0:sub(FLAGS_AT + 1, ITEMS_AT)
        or h:sub(ERROR_RATE_AT + 1, COMMON_BYTES) ~= h0:sub(ERROR_RATE_AT + 1, COMMON_BYTES)
        or h:sub(DELETES_AT + 1, ERROR_RATE_AT) ~= string.rep('\0', ERROR_RATE_AT - DELETES_AT)
        or h:sub(COMMON_BYTES + 1) ~= string.rep('\0', HEADER_BYTES - COMMON_BYTES) then
        return full_check(L, base)
      end
    end
    local m, _, bytes = geometry(L, n)
    local i1, i2, i3, i4, i5, i6, i7, i8 = byte(h, ITEMS_AT + 1, ITEMS_AT + 8)  -- <= slots
    -- The tag (expected_tag): count or TAG_INDEX_FLAG + n, the 48-bit digest, TRAILER; and
    -- no byte after it.
    local t1, t2, t3, t4, t5, t6, t7, t8, t9 = byte(redis.call('GETRANGE', key,
      fmt('%d', bytes - TAG_BYTES), fmt('%d', bytes)), 1, TAG_BYTES + 1)
    if ((((((i1 * 256 + i2) * 256 + i3) * 256 + i4) * 256 + i5) * 256 + i6) * 256 + i7) * 256
      + i8 > m * b
      or t9 ~= nil or t8 ~= TRAILER or t1 ~= (n == 0 and nsub or TAG_INDEX_FLAG + n)
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
