-- KEYS: endpoints, stats, failure, lease[, schema]   ARGV: endpoint id
-- Returns {seconds, microseconds, registry json or "", stats, failure, lease or "",
--          schema version or ""}.
local t = redis.call('TIME')
return {t[1], t[2], redis.call('HGET', KEYS[1], ARGV[1]) or '',
        redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3]),
        redis.call('GET', KEYS[4]) or '', KEYS[5] and redis.call('GET', KEYS[5]) or ''}
