-- KEYS: members, drain requests
-- ARGV: poller id, who asks ("cli", "signal": [A-Za-z0-9._@-] only, so no quoting)
-- Records a drain request for a live member: poller id -> {"since_ms": <now>, "by": ...}
-- (Redis clock). Returns 1 (requested), 0 (a request already stands: kept, with its
-- time) or -1 (not a live member: nothing written, so no request outlives its poller).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) < now then
  return -1
end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return 0
end
local request = string.format('{"since_ms":%.0f,"by":"%s"}', now, ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], request)
return 1
