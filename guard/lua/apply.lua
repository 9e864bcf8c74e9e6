-- apply.lua: apply database changes exactly once, moving the filter's watermark with them.
-- KEYS: sub-filters 0..subfilters-1, then spare keys growth may create (as insert.lua).
-- ARGV: layout (9); source, the change log's identity (8 bytes, big-endian, not zero); the
--   first change's id (< 2^53); then per change op ('i' insert, 'd' delete), h, g. Ids run
--   first, first + 1, ... (the client checks they are gapless).
-- Changes up to the stored `applied` are skipped: they were applied by an earlier call (a
-- replay after a crash, an overlapping batch). The first change not skipped must be applied
-- + 1, else nothing is written. `applied` moves to the last change handled in this very
-- script, so a change and its id are written together or not at all.
-- Reply: {status, subfilters, applied (after the call), skipped, r1, r2, ...}, one r per
--   change handled, the skipped ones first (1 for those; else 1 added or removed, 0 a delete
--   that found nothing, counted as a missed delete). status OK: handled from the first on,
--   all or as many as one call's work limit allowed (as insert.lua); GAP: the first
--   change not skipped is not applied + 1 (nothing handled); FULL, NEEDKEYS: as insert.lua,
--   stopping at that change. Or {SOURCE, subfilters, stored source}: the filter follows
--   another change log. Or {STALE, layout...}.
local err, h0 = check_layout()
if err then return err end
local source, first = ARGV[10], tonumber(ARGV[11])
local applied, stored, other = watermark(h0, source)
if other then return other end

local count = (#ARGV - 11) / 3
local skip = math.min(count, math.max(0, applied - first + 1))
if skip < count and first + skip ~= applied + 1 then
  return {GAP, L.nsub, applied, 0}
end
-- This call's work so far, and what the next item may add (_add.lua).
local work, reserve = 0, math.min(L.kicks, RESERVE_MAX) + ITEM_WORK
local reply, status = {OK, L.nsub, applied, skip}, OK
for _ = 1, skip do reply[#reply + 1] = 1 end
for k = 12 + 3 * skip, #ARGV, 3 do
  if k > 12 + 3 * skip and work + reserve > KICK_BUDGET then break end
  local h, g = tonumber(ARGV[k + 1]), fixed_g(tonumber(ARGV[k + 2]))
  local r, steps, stopped = 0, 0, nil
  if ARGV[k] == 'i' then r, steps, stopped = add(h, g, false) else r = remove(h, g) end
  work = work + steps + ITEM_WORK
  if not r then
    status = stopped
    break
  end
  reply[#reply + 1] = r
end
local handled = #reply - 4
if handled > skip or stored ~= source then
  applied = math.max(applied, first + handled - 1)
  set_watermark(applied, stored, source)
end
finish()
reply[1], reply[2], reply[3] = status, L.nsub, applied
return reply
