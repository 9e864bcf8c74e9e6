-- _store.lua: the slots a script reads and changes, and the one write that ends it.
--
-- Per sub-filter n, sub(n) holds its slots in one flat table (slot s of bucket i at i*b + s,
-- s from 0), filled a bucket at a time by one GETRANGE of the bytes that hold it, decoded with
-- string.byte (a BITFIELD sub-command costs about as much as a whole GETRANGE). A slot's first
-- value is logged when it first changes; flush() writes only the slots whose value differs
-- from it, with the item count, in one BITFIELD per sub-filter. Nothing reaches Redis before
-- flush(), so a failed kick chain (put back from its own log) is never half-applied.
-- Only GETRANGE reads: count.lua, which runs on read-only replicas, uses the same store.

local SF = {}  -- sub-filter n -> its state, made on first use (most calls touch one)
-- Bit offsets of the counters BITFIELD changes: ITEMS_AT, DELETES_AT, MISSED_AT times 8.
local ITEMS_BIT, DELETES_BIT, MISSED_BIT = '256', '320', '384'
local removed, missed = 0, 0  -- delete counters, written with sub-filter 0

local function sub(n)
  local s = SF[n]
  if s then return s end
  local f = sf_bits(n)
  s = {
    key = KEYS[n + 1], n = n, m = sf_buckets(n), f = f,
    t = {},      -- slot index -> value
    loaded = {}, -- bucket index -> true once its slots are in t
    first = {},  -- slot index -> its value before this call changed it
    delta = 0,   -- items added minus removed
    gdiv = 2 ^ (32 - f),      -- fp = floor(g / gdiv)
    pdiv = 2 ^ (f - L.f0),    -- a stored fingerprint's prefix is floor(fp / pdiv)
  }
  SF[n] = s
  return s
end

-- Reads bucket i of sub-filter s into s.t: one GETRANGE of the bytes holding its b slots.
local function load(s, i)
  local b, f, t = L.b, s.f, s.t
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
  s.loaded[i] = true
end

-- The first slot of bucket i holding v (a slot index), or nil; reads the bucket if needed.
local function find(s, i, v)
  if not s.loaded[i] then load(s, i) end
  local t, k = s.t, i * L.b
  for j = k, k + L.b - 1 do
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
-- MAX_OPS sub-commands for a long batch), none when nothing changed.
local function flush()
  for n = 0, L.nsub - 1 do
    local s = SF[n]
    local counters = n == 0 and (removed > 0 or missed > 0)
    if s or counters then
      local args, ops = {'BITFIELD', KEYS[n + 1]}, 0
      if s then
        local ftype, f, t = 'u' .. s.f, s.f, s.t
        for k, v0 in pairs(s.first) do
          local v = t[k]
          if v ~= v0 then
            args[ops * 4 + 3], args[ops * 4 + 4] = 'SET', ftype
            args[ops * 4 + 5], args[ops * 4 + 6] = fmt('%d', HEADER_BYTES * 8 + k * f), fmt('%d', v)
            ops = ops + 1
            if ops >= MAX_OPS then
              redis.call(unpack(args)); args = {'BITFIELD', KEYS[n + 1]}; ops = 0
            end
          end
        end
        s.first = {}
        if s.delta ~= 0 then
          args[#args + 1] = 'INCRBY'; args[#args + 1] = 'i64'; args[#args + 1] = ITEMS_BIT
          args[#args + 1] = fmt('%d', s.delta)
          s.delta = 0
          ops = ops + 1
        end
      end
      if counters then
        args[#args + 1] = 'INCRBY'; args[#args + 1] = 'i64'; args[#args + 1] = DELETES_BIT
        args[#args + 1] = fmt('%d', removed)
        args[#args + 1] = 'INCRBY'; args[#args + 1] = 'i64'; args[#args + 1] = MISSED_BIT
        args[#args + 1] = fmt('%d', missed)
        removed, missed = 0, 0
        ops = ops + 1
      end
      if ops > 0 then redis.call(unpack(args)) end
    end
  end
end
