-- KEYS: discovery lease, discovery status hash
-- ARGV: lease value, lease ttl ms, status ttl ms, source name, answered ("1"/"0"),
--       failure reason ("" = none), status JSON (targets, answer, failure detail, ...)
-- Fenced like the endpoint writes: only while the lease holds our value. Renews it,
-- stamps at_ms (and resolved_at_ms when answered) from TIME, keeps failure_since_ms while
-- the reason stays the same, sets expires_ms, prunes other sources' expired records.
-- Returns {1, now ms} accepted, or {0, current lease value or ""} rejected.
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or ''} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local nows = string.format('%.0f', now)

local prev = {}
local raw = redis.call('HGET', KEYS[2], ARGV[4])
if raw then prev = cjson.decode(raw) end
local record = cjson.decode(ARGV[7])
local sp = string.find(ARGV[1], ' ', 1, true)
record.owner = string.sub(ARGV[1], 1, sp - 1)
record.token = string.sub(ARGV[1], sp + 1)
record.at_ms = nows
record.expires_ms = string.format('%.0f', now + tonumber(ARGV[3]))
record.resolved_at_ms = prev.resolved_at_ms or ''
if ARGV[5] == '1' then record.resolved_at_ms = nows end
record.failure = ARGV[6]
record.failure_since_ms = ''
if ARGV[6] ~= '' then
  if prev.failure == ARGV[6] and prev.failure_since_ms then
    record.failure_since_ms = prev.failure_since_ms
  else
    record.failure_since_ms = nows
  end
end
redis.call('HSET', KEYS[2], ARGV[4], cjson.encode(record))

local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local ok, other = pcall(cjson.decode, all[i + 1])
  if not ok or type(other) ~= 'table' or (tonumber(other.expires_ms) or 0) < now then
    redis.call('HDEL', KEYS[2], all[i])
  end
end
return {1, nows}
