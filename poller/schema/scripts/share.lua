-- KEYS: gateways in-flight hash
-- ARGV: this gateway replica's id, ttl ms, its record ("" = write nothing, "-" = delete
--       its field: nothing in flight)
-- Writes our field as "<Redis-clock expiry ms> <record>" (and the hash's own expiry, so
-- an abandoned namespace empties itself), drops every field past its expiry, and returns
-- {TIME seconds, TIME microseconds, id, value, id, value, ...}: the other live replicas'
-- fields (ours left out). One call per share period, whatever the request rate.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
if ARGV[3] == '-' then
  redis.call('HDEL', KEYS[1], ARGV[1])
elseif ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', now + ttl) .. ' ' .. ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ttl * 4)
end
local out = {t[1], t[2]}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local expires = tonumber(string.match(all[i + 1], '^%d+'))
  if expires == nil or expires < now then
    redis.call('HDEL', KEYS[1], all[i])
  elseif all[i] ~= ARGV[1] then
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
