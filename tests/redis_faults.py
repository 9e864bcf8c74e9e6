"""Faults a test injects into a real Redis."""

# Holds a server for 2 s of its time, writing nothing: commands sent meanwhile queue behind it.
HOLD_SERVER_2S = """
local t = redis.call('TIME')
local start = t[1] * 1e6 + t[2]
while true do
  local n = redis.call('TIME')
  if n[1] * 1e6 + n[2] - start > 2e6 then return 1 end
end
"""
