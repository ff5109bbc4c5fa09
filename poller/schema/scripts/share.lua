-- KEYS: [1] gateways in-flight hash, [2] gateways updates shard channel, [3] gateways
--       load hash, [4] gateways changed zset, [5] gateways alive zset [, [6] gateways
--       placements stream]
-- ARGV: [1] this gateway replica's id, [2] ttl ms, [3] its record ("" = unchanged, "-" =
--       nothing in flight, "." = leaving: nothing in flight and no longer alive, else
--       {endpoint: [now, at its page's scrape, scraped_ms]}),
--       [4] "1" = publish the changes on the channel, [5] the change number of the
--       caller's last read ("" = none: every endpoint's total), [6] the publish window
--       in ms with 64 live replicas or more (fewer: that much less); with the stream: [7] its placements to add ("" = none), [8]
--       the last entry id it read ("" = none yet: the newest entries), [9] the stream's
--       MAXLEN, [10] how long placements are kept (ms), [11] entries to read at most
-- Writes the caller's field "<expiry ms> <record>" in the in-flight hash, and keeps the
-- load hash (endpoint -> the gateways' requests in flight, every live replica's summed;
-- "@<id>" -> that replica's record as the totals hold it) by the difference between
-- the caller's record and the one it added before. A replica whose alive entry expired
-- is taken out of the totals alike. Each endpoint whose total moved is marked in the
-- changed zset with the change number: one more than the last (the load hash's "#"
-- holds where this run of numbers started, the Redis us it began). Changes are
-- published at most once per window (ARGV[6] x live replicas / 64, at most ARGV[6]
-- ms), all of those made since the last publish in
-- one message: "<number> <Redis ms> <endpoint>:<total> ..." (the load hash's "^" holds
-- "<number> <ms>" of the last). Returns {TIME seconds, TIME microseconds, the other
-- live replicas, the change number now, 1 when the caller's record is not in the totals
-- (write it whole) else 0, 1 when every total follows else 0, 1 when this call's
-- changes wait for the next publish else 0, endpoint, total, endpoint, total, ...}:
-- the totals that moved after ARGV[5], all of them when ARGV[5] is not of this run.
-- With the stream, our placements are added as one entry {"@" = our id, "p" = them}
-- (trimmed to MAXLEN and to the age, the key expiring with the age), and the reply has,
-- after the three flags, {the last entry id read, id, placements, ...}: the other
-- replicas' entries since ARGV[8].
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local id = ARGV[1]

-- A record's requests in flight now, per endpoint ({} when none is readable).
local function counts(json)
  local out = {}
  if not json then
    return out
  end
  local ok, record = pcall(cjson.decode, json)
  if not ok or type(record) ~= 'table' then
    return out
  end
  for endpoint, triple in pairs(record) do
    if type(endpoint) == 'string' and type(triple) == 'table' and #endpoint <= 200
      and string.find(endpoint, '^%w[%w._:@/-]*$') then
      local n = tonumber(triple[1])
      if n and n > 0 and n < 2147483648 then
        out[endpoint] = math.floor(n)
      end
    end
  end
  return out
end

-- The totals of some endpoints, as {endpoint, total, ...} appended to out.
local function totals(endpoints, out)
  for i = 1, #endpoints, 1000 do
    local chunk = {}
    for j = i, math.min(i + 999, #endpoints) do
      chunk[#chunk + 1] = endpoints[j]
    end
    local got = redis.call('HMGET', KEYS[3], unpack(chunk))
    for j, endpoint in ipairs(chunk) do
      out[#out + 1] = endpoint
      out[#out + 1] = got[j] or '0'
    end
  end
  return out
end

local start = tonumber(redis.call('HGET', KEYS[3], '#'))
if not start then  -- a new run of numbers (Redis lost them, or the first call ever)
  start = tonumber(t[1]) * 1000000 + tonumber(t[2])
  redis.call('HSET', KEYS[3], '#', string.format('%.0f', start))
end
local top = redis.call('ZREVRANGE', KEYS[4], 0, 0, 'WITHSCORES')
local before = math.max(start, tonumber(top[2]) or start)
local number = before + 1
local moved = false

-- Moves the totals from a replica's share (its record as last added, the load hash's
-- field "@<id>") to its new record's counts.
local function move(replica, record)
  local share = '@' .. replica
  local was = counts(redis.call('HGET', KEYS[3], share))
  local after = counts(record)
  if record then
    redis.call('HSET', KEYS[3], share, record)
  else
    redis.call('HDEL', KEYS[3], share)
  end
  local function add(endpoint, difference)
    if redis.call('HINCRBY', KEYS[3], endpoint, difference) <= 0 then
      redis.call('HDEL', KEYS[3], endpoint)
    end
    redis.call('ZADD', KEYS[4], number, endpoint)
    moved = true
  end
  for endpoint, n in pairs(after) do
    if n ~= (was[endpoint] or 0) then
      add(endpoint, n - (was[endpoint] or 0))
    end
  end
  for endpoint, n in pairs(was) do
    if after[endpoint] == nil then
      add(endpoint, -n)
    end
  end
end

-- This replica's record: in the in-flight hash (as its readers expect) and as its
-- share of the totals.
local again = 0
if ARGV[3] == '-' or ARGV[3] == '.' then
  redis.call('HDEL', KEYS[1], id)
  move(id, nil)
elseif ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], id, string.format('%.0f', now + ttl) .. ' ' .. ARGV[3])
  move(id, ARGV[3])
elseif redis.call('HEXISTS', KEYS[3], '@' .. id) == 0 then
  again = 1  -- taken out as gone (or Redis lost it): the caller writes its record whole
end
if ARGV[3] == '.' then
  redis.call('ZREM', KEYS[5], id)
else
  redis.call('ZADD', KEYS[5], now + ttl, id)
end

-- The replicas that stopped calling: their requests leave the totals.
local gone = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', '(' .. now, 'LIMIT', 0, 16)
for _, replica in ipairs(gone) do
  move(replica, nil)
  redis.call('HDEL', KEYS[1], replica)
  redis.call('ZREM', KEYS[5], replica)
end
if not moved then
  number = before
end

-- The changes since the last publish, in one message once the window allows.
local held = 0
local last_publish = redis.call('HGET', KEYS[3], '^')
local published, published_ms = start, -1e15
if last_publish then
  local space = string.find(last_publish, ' ', 1, true)
  published = tonumber(string.sub(last_publish, 1, space - 1)) or start
  published_ms = tonumber(string.sub(last_publish, space + 1)) or -1e15
end
if number > published and ARGV[4] == '1' then
  local live = redis.call('ZCARD', KEYS[5])
  if now - published_ms >= tonumber(ARGV[6]) * math.min(1, live / 64) then
    local since = redis.call('ZRANGEBYSCORE', KEYS[4], string.format('(%.0f', published), '+inf')
    local since_totals = totals(since, {})
    local parts = {}
    for i = 1, #since_totals, 2 do
      parts[#parts + 1] = since_totals[i] .. ':' .. since_totals[i + 1]
    end
    redis.call('SPUBLISH', KEYS[2],
      string.format('%.0f %.0f ', number, now) .. table.concat(parts, ' '))
    redis.call('HSET', KEYS[3], '^', string.format('%.0f %.0f', number, now))
  elseif moved then
    held = 1
  end
end
for k = 1, 5 do
  if k ~= 2 then
    redis.call('PEXPIRE', KEYS[k], ttl * 4)
  end
end

local last = tonumber(ARGV[5])
local full = (not last or last < start or last > number) and 1 or 0
local others = redis.call('ZCARD', KEYS[5]) - (ARGV[3] == '.' and 0 or 1)
local out = {t[1], t[2], others, number, again, full, held}
if KEYS[6] then
  local keep = tonumber(ARGV[10])
  if ARGV[7] ~= '' then
    redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[9], '*', '@', id, 'p', ARGV[7])
    redis.call('XTRIM', KEYS[6], 'MINID', '~', string.format('%.0f', now - keep))
    redis.call('PEXPIRE', KEYS[6], keep)
  end
  local got
  if ARGV[8] == '' then
    got = redis.call('XREVRANGE', KEYS[6], '+', '-', 'COUNT', ARGV[11])
    local n = #got
    for i = 1, math.floor(n / 2) do
      got[i], got[n - i + 1] = got[n - i + 1], got[i]
    end
  else
    got = redis.call('XRANGE', KEYS[6], '(' .. ARGV[8], '+', 'COUNT', ARGV[11])
  end
  local part = {ARGV[8]}
  if #got > 0 then
    part[1] = got[#got][1]
  elseif ARGV[8] == '' then
    part[1] = '0-0'
  end
  for _, entry in ipairs(got) do
    local fields = entry[2]
    if fields[1] == '@' and fields[3] == 'p' and fields[4] and fields[2] ~= id then
      part[#part + 1] = entry[1]
      part[#part + 1] = fields[4]
    end
  end
  out[8] = part
end

-- The totals that moved since the caller's last read (every total when it is not of
-- this run); the load hash's own fields ("#", "^", "@<id>") are not endpoints.
local endpoints
if full == 1 then
  endpoints = {}
  for _, name in ipairs(redis.call('HKEYS', KEYS[3])) do
    if string.find(name, '^%w') then
      endpoints[#endpoints + 1] = name
    end
  end
else
  endpoints = redis.call('ZRANGEBYSCORE', KEYS[4], string.format('(%.0f', last), '+inf')
end
return totals(endpoints, out)
