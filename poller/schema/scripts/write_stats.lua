-- KEYS: lease, stats, failure, events, view stats, view failures, updates
-- ARGV: lease value, lease ttl ms, stats ttl ms, endpoint id, then field/value pairs
-- Fenced: only if the lease still holds our value. Renews the lease, replaces the stats
-- hash (so fields the engine stopped publishing disappear), stamps scraped_at_ms from
-- TIME, bumps seq, sets the TTL, clears the failure, mirrors the stats as one record in
-- the view hash and publishes "stats <id> <seq>" on events, and the record itself as
-- "stats <id> <seq> <view record>" on the shard channel updates (P:updates).
-- Returns {1, seq} accepted, or {0, current lease value or ""} rejected.
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or ''} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])

local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))

local seq = (tonumber(redis.call('HGET', KEYS[2], 'seq')) or 0) + 1
local sp = string.find(ARGV[1], ' ', 1, true)
redis.call('DEL', KEYS[2])
local poller, token = string.sub(ARGV[1], 1, sp - 1), string.sub(ARGV[1], sp + 1)
local fields = {'seq', seq, 'scraped_at_ms', now, 'poller', poller, 'token', token}
local record = {seq = tostring(seq), scraped_at_ms = now, poller = poller, token = token}
for i = 5, #ARGV, 2 do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
  record[ARGV[i]] = ARGV[i + 1]
end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[3])
local expires = string.format('%.0f', tonumber(now) + tonumber(ARGV[3]))
local view = now .. ' ' .. (record['interval_ms'] or '0') .. ' ' .. expires .. ' ' .. poller ..
             ' ' .. token .. '|' .. cjson.encode(record)
redis.call('HSET', KEYS[5], ARGV[4], view)
redis.call('HDEL', KEYS[6], ARGV[4])
redis.call('PUBLISH', KEYS[4], 'stats ' .. ARGV[4] .. ' ' .. seq)
redis.call('SPUBLISH', KEYS[7],
           'stats ' .. ARGV[4] .. ' ' .. seq .. ' ' .. view)
return {1, seq}
