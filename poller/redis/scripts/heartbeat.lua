-- KEYS: members, schema, epoch[, members info]
-- ARGV: poller id ("" = only read), member ttl ms, schema version, a fresh random epoch
--       [, this poller's info JSON (version, member_ttl_ms) for the members info hash]
-- Adds/refreshes us (score = Redis-clock expiry), prunes expired members, claims the schema
-- version and a data epoch if Redis has none (a restart that lost everything gets a new
-- epoch: pollers notice within a heartbeat, even when the registry revision repeats) and
-- returns {now, schema version found, epoch, member, member, ...}: the live members.
local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))

local schema = redis.call('GET', KEYS[2])
local epoch = redis.call('GET', KEYS[3])
if ARGV[1] ~= '' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  if not schema then
    redis.call('SET', KEYS[2], ARGV[3])
    schema = ARGV[3]
  end
  if not epoch then
    redis.call('SET', KEYS[3], ARGV[4])
    epoch = ARGV[4]
  end
  if KEYS[4] and ARGV[5] then
    redis.call('HSET', KEYS[4], ARGV[1], ARGV[5])
    for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)) do
      redis.call('HDEL', KEYS[4], gone)
    end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
end
local out = {now, schema or '', epoch or ''}
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do out[#out + 1] = m end
return out
