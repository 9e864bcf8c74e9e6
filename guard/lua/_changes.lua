-- _changes.lua: the change-feed watermark in sub-filter 0's header (docs/format.md, "Change
-- feed"): `applied`, the id of the last database change applied, and `source`, the change log
-- followed, as 8 big-endian bytes each at APPLIED_AT and SOURCE_AT. Used by apply.lua and
-- undo.lua.

-- The stored watermark of header h0: applied (a number) and source (8 bytes); or, when the
-- filter follows another change log than `source`, the reply that says so (SOURCE, 5).
local function watermark(h0, source)
  local stored = h0:sub(SOURCE_AT + 1, SOURCE_AT + 8)
  if stored ~= string.rep('\0', 8) and stored ~= source then
    return nil, nil, {5, L.nsub, stored}
  end
  return field(h0, APPLIED_AT, 8), stored, nil
end

-- Moves `applied` (and records `source` in a filter that follows no change log yet).
local function set_watermark(applied, stored, source)
  -- 8 big-endian bytes of an integer below 2^53 (exact in a double, so floor and % are too).
  local out, v = {}, applied
  for k = 8, 1, -1 do
    out[k] = v % 256
    v = math.floor(v / 256)
  end
  local bytes = string.char(unpack(out))
  if stored ~= source then bytes = bytes .. source end
  redis.call('SETRANGE', KEYS[1], APPLIED_AT, bytes)
end
