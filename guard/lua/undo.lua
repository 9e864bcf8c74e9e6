-- undo.lua: take back the last change applied, when it is the one given (the service's own
-- write whose database transaction failed after the filter applied it).
-- KEYS: as insert.lua.  ARGV: layout (9); source (8 bytes, as apply.lua); the change's id;
--   its op ('i' | 'd'), h, g.
-- When the stored `applied` is that id: removes the item (an insert undone) or adds it back
-- (a delete undone) and sets applied to id - 1, in this one script. Else changes nothing.
-- Reply: {status, subfilters, 1 undone | 0 not the last change applied}; status OK, or
--   FULL / NEEDKEYS when adding the item back needs room it cannot get (nothing changed);
--   or {SOURCE, subfilters, stored source}; or {STALE, layout...}.
local err, h0 = check_layout()
if err then return err end
local source, id = ARGV[10], tonumber(ARGV[11])
local applied, stored, other = watermark(h0, source)
if other then return other end
if applied ~= id then return {OK, L.nsub, 0} end

local h, g = tonumber(ARGV[13]), fixed_g(tonumber(ARGV[14]))
if ARGV[12] == 'i' then
  remove(h, g)
else
  local r, _, stopped = add(h, g, false)
  if not r then return {stopped, L.nsub, 0} end
end
set_watermark(id - 1, stored, source)
finish()
return {OK, L.nsub, 1}
