-- KEYS: events, updates, lease...   ARGV: (expected value, endpoint id) per lease
-- Deletes each lease that still holds the expected value and publishes "released <id>"
-- on events and on the shard channel updates (P:updates).
-- Returns the number released.
local n = 0
for i = 3, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[2 * i - 5] then
    redis.call('DEL', KEYS[i])
    redis.call('PUBLISH', KEYS[1], 'released ' .. ARGV[2 * i - 4])
    redis.call('SPUBLISH', KEYS[2], 'released ' .. ARGV[2 * i - 4])
    n = n + 1
  end
end
return n
