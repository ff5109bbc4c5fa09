-- KEYS: endpoints, rev   Returns {rev, {id, json, ...}}: one consistent read, also on
-- Cluster (whose redis-py MULTI pipelines run on a private event loop in a thread).
return {redis.call('GET', KEYS[2]) or '0', redis.call('HGETALL', KEYS[1])}
