-- floor.lua: the floor the guard's mutation scripts are measured against (bench/mutations.py).
--
-- What it is: the least a cuckoo filter in one Redis string can do per mutation from Lua, with
-- the guard's geometry (b = 4 slots of f = 16 bits, m buckets, any m) and nothing else: no
-- header, no layout or damage check, no counters, no growth, no undo log beyond the Lua table.
-- Per item: ONE read of both buckets (one BITFIELD of 8 GETs), the placement or the kick chain
-- in a Lua table (a bucket the walk reaches is read once, with one BITFIELD of 4 GETs), and
-- per call ONE write of the changed slots (one BITFIELD of SETs). Written the way a first Lua
-- filter is written, not tuned: numbers go to redis.call as Lua numbers.
--
-- Why it is the floor: every guard mutation must at least read the item's two buckets, find a
-- slot (or kick), and write it back atomically in a script; anything the guard spends beyond
-- this is what its layout checks, counters and format cost. The ratio guard / floor, measured
-- in the same run on the same server at the same load, is what issue 15 bounds (<= 1.3x).
--
-- KEYS[1]: the table (2 * m * 4 bytes, slot s of bucket i at bit offset (4 i + s) * 16).
-- ARGV: op ('i' insert | 'd' delete), m, max_kicks, then per item: i1 (its first bucket,
--   < m), fp (1..65535). The client hashes (bench/mutations.py: floor_args).
-- Reply: one integer per item: 1 done, 0 not (a full table, or nothing to delete).
local B, F = 4, 16
local op, m, kicks = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local key = KEYS[1]
local cache, orig = {}, {}

local function alt(i, fp)
  local j = math.fmod(math.fmod(fp * 2654435761, 2147483647) - i, m)
  if j < 0 then j = j + m end
  return j
end

local function read(list)
  local args = {'BITFIELD', key}
  for _, i in ipairs(list) do
    for s = 0, B - 1 do
      args[#args + 1] = 'GET'; args[#args + 1] = 'u16'; args[#args + 1] = (i * B + s) * F
    end
  end
  local r = redis.call(unpack(args))
  for k, i in ipairs(list) do
    local bkt, copy = {}, {}
    for s = 1, B do bkt[s] = r[(k - 1) * B + s]; copy[s] = bkt[s] end
    cache[i], orig[i] = bkt, copy
  end
end

local function bucket(i)
  if not cache[i] then read({i}) end
  return cache[i]
end

local function find(bkt, v)
  for s = 1, B do if bkt[s] == v then return s end end
  return nil
end

local function insert(i1, fp)
  local i2 = alt(i1, fp)
  for _, i in ipairs({i1, i2}) do
    local s = find(cache[i], 0)
    if s then cache[i][s] = fp; return 1 end
  end
  -- Kicks on the table; on failure the logged slots are put back, nothing reaches Redis.
  local undo, i, st = {}, i1, fp
  for _ = 1, kicks do
    st = math.fmod(st * 48271, 2147483647)
    local s = math.fmod(st, B) + 1
    local bkt = bucket(i)
    undo[#undo + 1] = {bkt, s, bkt[s]}
    bkt[s], fp = fp, bkt[s]
    i = alt(i, fp)
    local free = find(bucket(i), 0)
    if free then cache[i][free] = fp; return 1 end
  end
  for k = #undo, 1, -1 do undo[k][1][undo[k][2]] = undo[k][3] end
  return 0
end

local function delete(i1, fp)
  for _, i in ipairs({i1, alt(i1, fp)}) do
    local s = find(cache[i], fp)
    if s then cache[i][s] = 0; return 1 end
  end
  return 0
end

local reply = {}
for k = 4, #ARGV, 2 do
  local i1, fp = tonumber(ARGV[k]), tonumber(ARGV[k + 1])
  local i2 = alt(i1, fp)
  local want = {}
  if not cache[i1] then want[#want + 1] = i1 end
  if i2 ~= i1 and not cache[i2] then want[#want + 1] = i2 end
  if #want > 0 then read(want) end
  reply[#reply + 1] = (op == 'i') and insert(i1, fp) or delete(i1, fp)
end

local args = {'BITFIELD', key}
for i, bkt in pairs(cache) do
  for s = 1, B do
    if bkt[s] ~= orig[i][s] then
      args[#args + 1] = 'SET'; args[#args + 1] = 'u16'
      args[#args + 1] = (i * B + s - 1) * F; args[#args + 1] = bkt[s]
      -- unpack() is capped below 8000 values: a long batch of kicks goes in pieces.
      if #args > 6000 then redis.call(unpack(args)); args = {'BITFIELD', key} end
    end
  end
end
if #args > 2 then redis.call(unpack(args)) end
return reply
