-- _store.lua: the slots a script reads and changes, and the one write that ends it.
--
-- Per sub-filter n, sub(n) holds its slots in one flat table (slot j of bucket i at i*b + j,
-- j from 0), filled a bucket at a time by one GETRANGE of the bytes that hold it, decoded with
-- string.byte (one BITFIELD GET costs about half a GETRANGE; a bucket is 4 of them). A slot's
-- first value is logged when it first changes; flush() writes only the slots whose value
-- differs from it, with the item count, in one BITFIELD per sub-filter. Nothing reaches Redis
-- before flush(), so a failed kick chain (put back from its own log) is never half-applied.
-- Only GETRANGE reads: count.lua, which runs on read-only replicas, uses the same store.

-- L.sf[n]: sub-filter n's state, made on first use (most calls touch one); L.removed and
-- L.missed: the delete counters, written with sub-filter 0 (both made in _common.lua).

local function sub(n)
  local s = L.sf[n]
  if s then return s end
  local m, f = geometry(L, n)
  s = {
    key = KEYS[n + 1], m = m, f = f, b = L.b, ftype = 'u' .. f,
    t = {},      -- slot index -> value (nil: its bucket not read yet)
    first = {},  -- slot index -> its value before this call changed it
    delta = 0,   -- items added minus removed
    gdiv = 2 ^ (32 - f),      -- an item's fingerprint is floor(g / gdiv)
    pdiv = 2 ^ (f - L.f0),    -- a stored fingerprint's prefix is floor(fp / pdiv)
  }
  L.sf[n] = s
  return s
end

-- Reads bucket i of sub-filter s into s.t: one GETRANGE of the bytes holding its b slots
-- (the table starts at byte HEADER_BYTES; offsets go as strings: Redis would format a Lua
-- number with %.17g).
local function load(s, i)
  local b, f, t, byte, fmt = s.b, s.f, s.t, string.byte, string.format
  local k0 = i * b
  if f == 16 then
    local at = HEADER_BYTES + k0 * 2
    local raw = redis.call('GETRANGE', s.key, fmt('%d', at), fmt('%d', at + 2 * b - 1))
    if b == 4 then
      local a1, a2, a3, a4, a5, a6, a7, a8 = byte(raw, 1, 8)
      t[k0], t[k0 + 1], t[k0 + 2], t[k0 + 3] = a1 * 256 + a2, a3 * 256 + a4, a5 * 256 + a6,
        a7 * 256 + a8
    else
      local c = {byte(raw, 1, 2 * b)}
      for j = 0, b - 1 do t[k0 + j] = c[2 * j + 1] * 256 + c[2 * j + 2] end
    end
  else
    -- Any width: the bucket's bits start `lead` bits into its first byte; each slot is read
    -- from the (at most 5) bytes that hold it, a big-endian integer below 2^40.
    local floor = math.floor
    local start = k0 * f
    local q0 = floor(start / 8)
    local raw = redis.call('GETRANGE', s.key, fmt('%d', HEADER_BYTES + q0),
      fmt('%d', HEADER_BYTES + floor((start + b * f - 1) / 8)))
    local c = {byte(raw, 1, -1)}
    local lead = start - 8 * q0
    for j = 0, b - 1 do
      local o = lead + j * f
      local p, last = floor(o / 8), floor((o + f - 1) / 8)
      local v = 0
      for q = p + 1, last + 1 do v = v * 256 + c[q] end
      t[k0 + j] = floor(v / 2 ^ (8 * (last - p + 1) - (o - 8 * p) - f)) % 2 ^ f
    end
  end
end

-- The first slot of bucket i holding v (its index in s.t), or nil; reads the bucket if needed.
local function find(s, i, v)
  local t, k = s.t, i * s.b
  if t[k] == nil then load(s, i) end
  for j = k, k + s.b - 1 do
    if t[j] == v then return j end
  end
  return nil
end

local function set(s, k, v)
  local t = s.t
  if s.first[k] == nil then s.first[k] = t[k] end
  t[k] = v
end

-- Writes every changed slot and counter: one BITFIELD per sub-filter touched (in pieces of
-- 1500 sub-commands for a long batch: unpack() is capped below 8000 values), none when
-- nothing changed. Bit offsets: the table's at HEADER_BYTES * 8, the counters' at their
-- byte offsets times 8.
local function flush()
  local fmt = string.format
  for n = 0, L.nsub - 1 do
    local s = L.sf[n]
    local counters = n == 0 and (L.removed > 0 or L.missed > 0)
    if s or counters then
      local args, ops = {'BITFIELD', KEYS[n + 1]}, 0
      if s then
        local ftype, f, t = s.ftype, s.f, s.t
        for k, v0 in pairs(s.first) do
          local v = t[k]
          if v ~= v0 then
            local a = ops * 4
            args[a + 3], args[a + 4], args[a + 5], args[a + 6] =
              'SET', ftype, fmt('%d', HEADER_BYTES * 8 + k * f), fmt('%d', v)
            ops = ops + 1
            if ops >= 1500 then
              redis.call(unpack(args)); args = {'BITFIELD', KEYS[n + 1]}; ops = 0
            end
          end
        end
        s.first = {}
        if s.delta ~= 0 then
          local a = #args
          args[a + 1], args[a + 2], args[a + 3], args[a + 4] =
            'INCRBY', 'i64', ITEMS_AT * 8, fmt('%d', s.delta)
          s.delta = 0
          ops = ops + 1
        end
      end
      if L.removed > 0 and n == 0 then
        local a = #args
        args[a + 1], args[a + 2], args[a + 3], args[a + 4] =
          'INCRBY', 'i64', DELETES_AT * 8, fmt('%d', L.removed)
        L.removed = 0
        ops = ops + 1
      end
      if L.missed > 0 and n == 0 then
        local a = #args
        args[a + 1], args[a + 2], args[a + 3], args[a + 4] =
          'INCRBY', 'i64', MISSED_DELETES_AT * 8, fmt('%d', L.missed)
        L.missed = 0
        ops = ops + 1
      end
      if ops > 0 then redis.call(unpack(args)) end
    end
  end
end

-- What the scripts call last: every change written back.
local finish = flush
