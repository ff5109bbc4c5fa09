-- KEYS: gateways in-flight hash [, gateways placements stream]
-- ARGV: this gateway replica's id, ttl ms, its record ("" = write nothing, "-" = delete
--       its field: nothing in flight); with the stream: [4] its placements to add ("" =
--       none), [5] the last entry id it read ("" = none yet: the newest entries),
--       [6] the stream's MAXLEN, [7] how long placements are kept (ms), [8] entries
--       to read at most
-- Writes our field as "<Redis-clock expiry ms> <record>" (and the hash's own expiry, so
-- an abandoned namespace empties itself), drops every field past its expiry, and returns
-- {TIME seconds, TIME microseconds, id, value, id, value, ...}: the other live replicas'
-- fields (ours left out). With the stream, our placements are added as one entry
-- {"@" = our id, "p" = them} (trimmed to MAXLEN and to the age, the key expiring with
-- the age), and the reply has, after TIME, {the last entry id read, id, placements, ...}:
-- the other replicas' entries since ARGV[5]. One call per share period, whatever the
-- request rate.
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
if KEYS[2] then
  local keep = tonumber(ARGV[7])
  if ARGV[4] ~= '' then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', '@', ARGV[1], 'p', ARGV[4])
    redis.call('XTRIM', KEYS[2], 'MINID', '~', string.format('%.0f', now - keep))
    redis.call('PEXPIRE', KEYS[2], keep)
  end
  local got
  if ARGV[5] == '' then
    got = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', ARGV[8])
    local n = #got
    for i = 1, math.floor(n / 2) do
      got[i], got[n - i + 1] = got[n - i + 1], got[i]
    end
  else
    got = redis.call('XRANGE', KEYS[2], '(' .. ARGV[5], '+', 'COUNT', ARGV[8])
  end
  local part = {ARGV[5]}
  if #got > 0 then
    part[1] = got[#got][1]
  elseif ARGV[5] == '' then
    part[1] = '0-0'
  end
  for _, entry in ipairs(got) do
    local fields = entry[2]
    if fields[1] == '@' and fields[3] == 'p' and fields[4] and fields[2] ~= ARGV[1] then
      part[#part + 1] = entry[1]
      part[#part + 1] = fields[4]
    end
  end
  out[3] = part
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
