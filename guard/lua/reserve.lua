-- reserve.lua: create a filter's first sub-filter.
-- KEYS[1]: sub-filter 0.  ARGV[1]: the header, HEADER_BYTES long (built by guard/layout.py).
-- ARGV[2]: the string's full length in bytes.  ARGV[3]: its 8-byte tag (guard/layout.py).
-- Reply: 1, or a GUARD_EXISTS error.
local header, total, tag = ARGV[1], tonumber(ARGV[2]), ARGV[3]
if redis.call('EXISTS', KEYS[1]) == 1 then return guard_error('EXISTS', 'filter exists') end
-- SETRANGE past the end of a missing key allocates the exact length in one step; growing a
-- string piece by piece would let Redis over-allocate it by up to 2x.
redis.call('SETRANGE', KEYS[1], total - TAG_BYTES, tag)
redis.call('SETRANGE', KEYS[1], 0, header)
return 1
