-- _store.lua: the bucket cache used by scripts that write (and count).
-- Bucket store: a read-through cache of buckets, changed in place, written back by flush().
-- Nothing reaches Redis before flush(), so a failed kick chain is dropped, never half-applied.
-- Per sub-filter tables are made on first use: most calls touch one sub-filter, and building
-- them all up front was a measurable share of a lookup's cost.
local cache, orig, dirty, item_delta = {}, {}, {}, {}
-- The command load() reads buckets with: count.lua, which only reads, switches to BITFIELD_RO
-- so that it runs on a read-only replica (BITFIELD is a write command even when it only GETs).
local READ = 'BITFIELD'

local function touch(n)
  if not cache[n] then cache[n] = {}; orig[n] = {}; dirty[n] = {}; item_delta[n] = 0 end
end

-- Reads buckets (list of indexes) of sub-filter n that are not cached, in one BITFIELD call.
local function load(n, list)
  touch(n)
  local args, want, seen = {READ, KEYS[n + 1]}, {}, {}
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
      args[#args + 1] = 'INCRBY'; args[#args + 1] = 'i64'; args[#args + 1] = ITEMS_AT * 8
      args[#args + 1] = item_delta[n]
      item_delta[n] = 0
      ops = ops + 1
    end
    if ops > 0 then redis.call(unpack(args)) end
  end
end
