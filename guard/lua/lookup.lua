-- lookup.lua: is each item (probably) in the filter?
-- KEYS: sub-filters 0..subfilters-1.  ARGV: layout (8), then h1, g1, h2, g2, ...
-- Reply: {OK, subfilters, r1, r2, ...} with r = 1 maybe present, 0 definitely absent;
--   or {STALE, layout...}.
-- The hot path of the guard: each sub-filter is validated and read in the same BITFIELD call
-- (header fields, trailer, then the two buckets of every item still unanswered).
if not layout_known() then return check_layout() end

local hs, gs, found, count = {}, {}, {}, 0
for k = 9, #ARGV, 2 do
  count = count + 1
  hs[count] = tonumber(ARGV[k]); gs[count] = fixed_g(tonumber(ARGV[k + 1])); found[count] = 0
end

local per_call = floor((MAX_OPS - 11) / (2 * L.b))
for n = 0, L.nsub - 1 do
  local pending = {}
  for k = 1, count do if found[k] == 0 then pending[#pending + 1] = k end end
  -- Every sub-filter is read at least for its header, even when all items are answered:
  -- a missing or truncated one is reported, not skipped.
  local ftype, validated = 'u' .. sf_bits(n), false
  local start = 1
  repeat
    local args, skip = {'BITFIELD', KEYS[n + 1]}, 0
    if not validated then skip = header_gets(n, args) end
    local last = math.min(#pending, start + per_call - 1)
    local fps = {}
    for idx = start, last do
      local fp, i1, i2 = item_at(hs[pending[idx]], gs[pending[idx]], n)
      fps[#fps + 1] = fp
      for s = 0, L.b - 1 do
        args[#args + 1] = 'GET'; args[#args + 1] = ftype; args[#args + 1] = slot_offset(n, i1, s)
      end
      for s = 0, L.b - 1 do
        args[#args + 1] = 'GET'; args[#args + 1] = ftype; args[#args + 1] = slot_offset(n, i2, s)
      end
    end
    local r = redis.call(unpack(args))
    if not validated then
      local err = verify_header(n, r)
      if err then return err end
      validated = true
    end
    local pos = skip
    for j, fp in ipairs(fps) do
      for s = 1, 2 * L.b do
        if r[pos + s] == fp then found[pending[start + j - 1]] = 1; break end
      end
      pos = pos + 2 * L.b
    end
    start = last + 1
  until start > #pending
end

local reply = {OK, L.nsub}
for k = 1, count do reply[k + 2] = found[k] end
return reply
