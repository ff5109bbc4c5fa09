-- KEYS: events, lease...   ARGV: (expected value, endpoint id) per lease
-- Deletes each lease that still holds the expected value and publishes "released <id>"
-- on events and on the shard channel P:updates (the events key, "updates" for "events").
-- Returns the number released.
local n = 0
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[2 * i - 3] then
    redis.call('DEL', KEYS[i])
    redis.call('PUBLISH', KEYS[1], 'released ' .. ARGV[2 * i - 2])
    redis.call('SPUBLISH', string.sub(KEYS[1], 1, -7) .. 'updates', 'released ' .. ARGV[2 * i - 2])
    n = n + 1
  end
end
return n
