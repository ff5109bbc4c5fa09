-- KEYS: endpoints, view stats, view failures[, schema]   ARGV: endpoint id
-- Returns {seconds, microseconds, registry json or "", stats record or "",
--          failure record or "", schema version or ""}: one endpoint as a snapshot
--          would show it (the schema version only with the schema key).
local t = redis.call('TIME')
return {t[1], t[2], redis.call('HGET', KEYS[1], ARGV[1]) or '',
        redis.call('HGET', KEYS[2], ARGV[1]) or '', redis.call('HGET', KEYS[3], ARGV[1]) or '',
        KEYS[4] and redis.call('GET', KEYS[4]) or ''}
