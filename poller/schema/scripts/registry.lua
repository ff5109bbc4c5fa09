-- KEYS: endpoints, rev, events, view stats, view failures, updates, then (stats, failure,
--       lease) of each removed id
-- ARGV: expected rev ("" = any), n removed, removed ids..., then id/json pairs to set
-- Compare-and-set on the revision, so concurrent syncs converge instead of interleaving.
-- Publishes "endpoints <rev>" on events and on the shard channel updates (P:updates).
-- Returns the new revision, or -1 when the revision moved (caller re-reads and retries).
local rev = redis.call('GET', KEYS[2]) or '0'
if ARGV[1] ~= '' and ARGV[1] ~= rev then return -1 end
local n = tonumber(ARGV[2])
for i = 1, n do
  redis.call('HDEL', KEYS[1], ARGV[2 + i])
  redis.call('HDEL', KEYS[4], ARGV[2 + i])
  redis.call('HDEL', KEYS[5], ARGV[2 + i])
  redis.call('DEL', KEYS[6 + 3 * i - 2], KEYS[6 + 3 * i - 1], KEYS[6 + 3 * i])
end
for i = 3 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
local new = redis.call('INCR', KEYS[2])
redis.call('PUBLISH', KEYS[3], 'endpoints ' .. new)
redis.call('SPUBLISH', KEYS[6], 'endpoints ' .. new)
return new
