-- insert.lua: add items (the filter is a multiset), kicking and growing as needed.
-- KEYS: sub-filters 0..subfilters-1, then spare keys growth may create (subfilters, ...).
-- ARGV: layout (9), unique (0|1), then h1, g1, h2, g2, ...
-- Reply: {status, subfilters, r1, r2, ...}, one r per item handled (1 added; 0 already
--   present, only when unique). status OK: handled from the first item on, all of them or as
--   many as one call's work limit allowed (_add.lua; the caller sends the rest again); FULL:
--   a fixed-size filter (or one at its growth limit) could not place the next item; NEEDKEYS:
--   growth needs a key not passed. Both stop at that item with everything before it written.
--   Or {STALE, layout...}.
local err = check_layout()
if err then return err end
local unique = ARGV[10] == '1'

-- This call's work so far, and what the next item may add (_add.lua).
local work, reserve = 0, math.min(L.kicks, RESERVE_MAX) + ITEM_WORK
local reply, status = {0, 0}, OK
for k = 11, #ARGV, 2 do
  if k > 11 and work + reserve > KICK_BUDGET then break end
  local r, steps, stopped = add(tonumber(ARGV[k]), fixed_g(tonumber(ARGV[k + 1])), unique)
  work = work + steps + ITEM_WORK
  if not r then
    status = stopped
    break
  end
  reply[#reply + 1] = r
end
finish()
reply[1], reply[2] = status, L.nsub
return reply
