-- KEYS: lease, failure, events, view failures, updates
-- ARGV: lease value, lease ttl ms, failure ttl ms, endpoint id, reason, detail, missing
-- Fenced like write_stats. Keeps since_ms and counts while the reason stays the same;
-- leaves the last good stats alone; mirrors the failure as one record in the view hash.
-- Publishes "failure <id> <reason>" on events, and the record as
-- "failure <id> <count> <view record>" on the shard channel updates (as write_stats).
-- Returns {1, count} accepted, or {0, current lease value or ""} rejected.
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or ''} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])

local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))

local since = now
local count = 1
if redis.call('HGET', KEYS[2], 'reason') == ARGV[5] then
  since = redis.call('HGET', KEYS[2], 'since_ms') or now
  count = (tonumber(redis.call('HGET', KEYS[2], 'count')) or 0) + 1
else
  redis.call('DEL', KEYS[2])
end
local sp = string.find(ARGV[1], ' ', 1, true)
local poller, token = string.sub(ARGV[1], 1, sp - 1), string.sub(ARGV[1], sp + 1)
redis.call('HSET', KEYS[2], 'reason', ARGV[5], 'detail', ARGV[6], 'missing', ARGV[7],
           'since_ms', since, 'at_ms', now, 'count', count, 'poller', poller, 'token', token)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
local record = {reason = ARGV[5], detail = ARGV[6], missing = ARGV[7], since_ms = since,
                at_ms = now, count = tostring(count), poller = poller, token = token}
local expires = string.format('%.0f', tonumber(now) + tonumber(ARGV[3]))
local view = now .. ' ' .. expires .. ' ' .. poller .. ' ' .. token .. '|' .. cjson.encode(record)
redis.call('HSET', KEYS[4], ARGV[4], view)
redis.call('PUBLISH', KEYS[3], 'failure ' .. ARGV[4] .. ' ' .. ARGV[5])
redis.call('SPUBLISH', KEYS[5],
           'failure ' .. ARGV[4] .. ' ' .. count .. ' ' .. view)
return {1, count}
