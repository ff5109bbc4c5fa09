-- KEYS: gateways in-flight hash, gateways updates shard channel [, gateways placements
--       stream]
-- ARGV: this gateway replica's id, ttl ms, its record ("" = write nothing, "-" = delete
--       its field: nothing in flight), [4] "1" = publish the write on the channel ("0":
--       a user without the channel's right); with the stream: [5] its placements to add
--       ("" = none), [6] the last entry id it read ("" = none yet: the newest entries),
--       [7] the stream's MAXLEN, [8] how long placements are kept (ms), [9] entries to
--       read at most
-- Writes our field as "<Redis-clock expiry ms> <record>" (and the hash's own expiry, so
-- an abandoned namespace empties itself) and publishes the write on the channel as
-- "<expiry ms> <record or -> <id>", drops every field past its expiry, and returns
-- {TIME seconds, TIME microseconds, the channel's receivers (-1: nothing published),
-- id, value, id, value, ...}: the other live replicas' fields (ours left out). With
-- the stream, our placements are added as one entry {"@" = our id, "p" = them}
-- (trimmed to MAXLEN and to the age, the key expiring with the age), and the reply
-- has, after the receivers, {the last entry id read, id, placements, ...}: the other
-- replicas' entries since ARGV[6].
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local expiry = string.format('%.0f', now + ttl)
local receivers = -1
if ARGV[3] == '-' then
  redis.call('HDEL', KEYS[1], ARGV[1])
elseif ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], expiry .. ' ' .. ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ttl * 4)
end
if ARGV[3] ~= '' and ARGV[4] == '1' then
  receivers = redis.call('SPUBLISH', KEYS[2], expiry .. ' ' .. ARGV[3] .. ' ' .. ARGV[1])
end
local out = {t[1], t[2], receivers}
if KEYS[3] then
  local keep = tonumber(ARGV[8])
  if ARGV[5] ~= '' then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*', '@', ARGV[1], 'p', ARGV[5])
    redis.call('XTRIM', KEYS[3], 'MINID', '~', string.format('%.0f', now - keep))
    redis.call('PEXPIRE', KEYS[3], keep)
  end
  local got
  if ARGV[6] == '' then
    got = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', ARGV[9])
    local n = #got
    for i = 1, math.floor(n / 2) do
      got[i], got[n - i + 1] = got[n - i + 1], got[i]
    end
  else
    got = redis.call('XRANGE', KEYS[3], '(' .. ARGV[6], '+', 'COUNT', ARGV[9])
  end
  local part = {ARGV[6]}
  if #got > 0 then
    part[1] = got[#got][1]
  elseif ARGV[6] == '' then
    part[1] = '0-0'
  end
  for _, entry in ipairs(got) do
    local fields = entry[2]
    if fields[1] == '@' and fields[3] == 'p' and fields[4] and fields[2] ~= ARGV[1] then
      part[#part + 1] = entry[1]
      part[#part + 1] = fields[4]
    end
  end
  out[4] = part
end
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
