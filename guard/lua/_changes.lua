-- _changes.lua: the change-feed watermark in sub-filter 0's header (docs/format.md, "Change
-- feed"): `applied`, the id of the last database change applied, and `source`, the change log
-- followed, as 8 big-endian bytes each. Used by apply.lua and undo.lua.

-- 8 big-endian bytes of an integer below 2^53 (exact in a double, so floor and fmod are too).
local function u64_bytes(v)
  local out = {}
  for k = 8, 1, -1 do
    out[k] = string.char(fmod(v, 256))
    v = floor(v / 256)
  end
  return table.concat(out)
end

-- The stored watermark of header h0: applied (a number) and source (8 bytes); or, when the
-- filter follows another change log than `source`, the reply that says so.
local function watermark(h0, source)
  local stored = h0:sub(SOURCE_AT + 1, SOURCE_AT + 8)
  if stored ~= ZEROS:sub(1, 8) and stored ~= source then
    return nil, nil, {SOURCE, L.nsub, stored}
  end
  return field(h0, APPLIED_AT, 8), stored, nil
end

-- Moves `applied` (and records `source` in a filter that follows no change log yet).
local function set_watermark(applied, stored, source)
  if stored == source then
    redis.call('SETRANGE', KEYS[1], APPLIED_AT, u64_bytes(applied))
  else
    redis.call('SETRANGE', KEYS[1], APPLIED_AT, u64_bytes(applied) .. source)
  end
end
