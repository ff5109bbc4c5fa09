-- KEYS: discovery lease   ARGV: expected value
-- Deletes the lease if it still holds our value (so the next owner takes the source at
-- once, not a TTL later). Returns 1 released, 0 not ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
