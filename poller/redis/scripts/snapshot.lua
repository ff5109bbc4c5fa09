-- KEYS: endpoints, members, endpoints rev, view stats, view failures
-- Returns {seconds, microseconds, rev, {id, json, ...}, {member, expiry, ...},
--          {id, stats record, ...}, {id, failure record, ...}}: five reads, whatever the
-- number of endpoints (reading each endpoint's hashes costs Redis ~15 ms per 1,000).
local t = redis.call('TIME')
return {t[1], t[2], redis.call('GET', KEYS[3]) or '0', redis.call('HGETALL', KEYS[1]),
        redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES'), redis.call('HGETALL', KEYS[4]),
        redis.call('HGETALL', KEYS[5])}
