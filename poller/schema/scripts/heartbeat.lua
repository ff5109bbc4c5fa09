-- KEYS: members, schema, epoch[, members info[, drain requests[, duplicates]]]
-- ARGV: poller id ("" = only read), member ttl ms, schema version, a fresh random epoch
--       [, this poller's info JSON (version, member_ttl_ms, instance, host, pid) for the
--       members info hash[, this process's instance token, how long a duplicate record
--       lives (ms), this process's duplicate record JSON (instance, host, pid)]]
-- Adds/refreshes us (score = Redis-clock expiry), prunes expired members (and their info,
-- drain requests and duplicate records), claims the schema version and a data epoch if
-- Redis has none (a restart that lost everything gets a new epoch: pollers notice within
-- a heartbeat, even when the registry revision repeats) and returns {now, schema version
-- found, epoch, member, member, ...}: the live members. With the drain requests key, our
-- info says "draining":true while a drain of us is requested, and the reply goes on with
-- "" and then the live members a drain is requested for.
-- With the duplicates key, the id is checked and claimed in this one step: when a live
-- member under our id has info naming another instance (or none), another process holds
-- the id. Then nothing is written but our duplicate record (duplicates: id -> the record
-- with "at_ms" and "expires_ms" added) and the reply is {now, schema version found,
-- epoch, "", the holder's expiry, the holder's info JSON or ""}: "" where a member would
-- be (ids are never empty, and a claim puts us among the live members).
local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))

local schema = redis.call('GET', KEYS[2])
local epoch = redis.call('GET', KEYS[3])
if ARGV[1] ~= '' and KEYS[6] and ARGV[6] then
  -- WITHSCORES over the live members, not ZSCORE: the commands of the poller's ACL user
  -- (deploy/redis/users.acl)
  local scored = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf', 'WITHSCORES')
  for i = 1, #scored, 2 do
    if scored[i] == ARGV[1] then
      local info = redis.call('HGET', KEYS[4], ARGV[1])
      local holder = nil
      if info then
        local ok, value = pcall(cjson.decode, info)
        if ok and type(value) == 'table' then holder = value['instance'] end
      end
      if holder ~= ARGV[6] then
        local expires = string.format('%.0f', tonumber(now) + tonumber(ARGV[7]))
        local record = string.sub(ARGV[8], 1, -2) .. ',"at_ms":' .. now
          .. ',"expires_ms":' .. expires .. '}'
        redis.call('HSET', KEYS[6], ARGV[1], record)
        return {now, schema or '', epoch or '', '', scored[i + 1], info or ''}
      end
    end
  end
end
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
    local info = ARGV[5]
    if KEYS[5] and redis.call('HEXISTS', KEYS[5], ARGV[1]) == 1 then
      -- the info is a JSON object we built: close it with one more field
      info = string.sub(info, 1, -2) .. ',"draining":true}'
    end
    redis.call('HSET', KEYS[4], ARGV[1], info)
    for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)) do
      redis.call('HDEL', KEYS[4], gone)
      if KEYS[5] then redis.call('HDEL', KEYS[5], gone) end
      if KEYS[6] then redis.call('HDEL', KEYS[6], gone) end
    end
  end
  if KEYS[6] then
    -- duplicate records past their expiry (or unreadable) go too
    local flat = redis.call('HGETALL', KEYS[6])
    for i = 1, #flat, 2 do
      local ok, value = pcall(cjson.decode, flat[i + 1])
      local expires = ok and type(value) == 'table' and tonumber(value['expires_ms'])
      if not expires or expires < tonumber(now) then redis.call('HDEL', KEYS[6], flat[i]) end
    end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
end
local out = {now, schema or '', epoch or ''}
local live = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
for _, m in ipairs(live) do out[#out + 1] = m end
if KEYS[5] then
  -- HGETALL, not HMGET: the poller's ACL user (deploy/redis/users.acl) has no HMGET,
  -- and the hash holds a few entries at most
  out[#out + 1] = ''
  local requested = {}
  local flat = redis.call('HGETALL', KEYS[5])
  for i = 1, #flat, 2 do requested[flat[i]] = true end
  for _, m in ipairs(live) do
    if requested[m] then out[#out + 1] = m end
  end
end
return out
