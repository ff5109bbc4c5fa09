-- KEYS: endpoints, members, endpoints rev, view stats, view failures[, epoch[, schema]]
-- ARGV: [the registry revision and the epoch the caller holds]
-- Returns {seconds, microseconds, rev, {id, json, ...} or 0, {member, expiry, ...},
--          {id, stats record, ...}, {id, failure record, ...}, epoch, schema version or
--          ""}: a handful of reads,
-- whatever the number of endpoints (reading each endpoint's hashes costs Redis ~15 ms per
-- 1,000). The registry is 0 when the caller already holds it: same epoch (never empty)
-- and same revision, which every registry write bumps (registry.lua).
local t = redis.call('TIME')
local rev = redis.call('GET', KEYS[3]) or '0'
local epoch = KEYS[6] and redis.call('GET', KEYS[6]) or ''
local schema = KEYS[7] and redis.call('GET', KEYS[7]) or ''
local registry = 0
if epoch == '' or ARGV[1] ~= rev or ARGV[2] ~= epoch then
  registry = redis.call('HGETALL', KEYS[1])
end
return {t[1], t[2], rev, registry, redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES'),
        redis.call('HGETALL', KEYS[4]), redis.call('HGETALL', KEYS[5]), epoch, schema}
