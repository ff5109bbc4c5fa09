-- KEYS: fence, lease...   ARGV: poller id, lease ttl ms
-- Returns, per lease: {1, token} newly acquired, {2, token} already ours (renewed),
-- {0, "<holder> <token>"} held by someone else.
local out = {}
for i = 2, #KEYS do
  local cur = redis.call('GET', KEYS[i])
  if not cur then
    local token = redis.call('INCR', KEYS[1])
    redis.call('SET', KEYS[i], ARGV[1] .. ' ' .. token, 'PX', ARGV[2])
    out[#out + 1] = {1, token}
  else
    local sp = string.find(cur, ' ', 1, true)
    if sp and string.sub(cur, 1, sp - 1) == ARGV[1] then
      redis.call('PEXPIRE', KEYS[i], ARGV[2])
      out[#out + 1] = {2, tonumber(string.sub(cur, sp + 1))}
    else
      out[#out + 1] = {0, cur}
    end
  end
end
return out
