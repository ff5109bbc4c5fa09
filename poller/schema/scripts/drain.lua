-- KEYS: members, drain requests
-- ARGV: poller id, who asks ("cli", "signal": [A-Za-z0-9._@-] only, so no quoting)
-- Records a drain request for a live member: poller id -> {"since_ms": <now>, "by": ...}
-- (Redis clock). Returns 1 (requested), 0 (a request already stands: kept, with its
-- time) or -1 (not a live member: nothing written, so no request outlives its poller).
local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
-- ZRANGEBYSCORE, not ZSCORE: the commands of the poller's ACL user (deploy/redis/users.acl)
local live = false
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  if m == ARGV[1] then live = true end
end
if not live then
  return -1
end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return 0
end
local request = '{"since_ms":' .. now .. ',"by":"' .. ARGV[2] .. '"}'
redis.call('HSET', KEYS[2], ARGV[1], request)
return 1
