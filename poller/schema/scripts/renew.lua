-- KEYS: lease...   ARGV: lease ttl ms, expected value per lease
-- Returns, per lease: 1 renewed, 0 lost (missing or another token).
local out = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i + 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
