-- ratewall: renew one concurrency lease while its request is in flight.
-- KEYS[1]  the rule's lease set for one identity: "<prefix>:{<identity-hash>}:<rule>"
-- ARGV[1]  the lease id; ARGV[2] how long it lives from now, µs
-- Returns 1 if the lease was live and is renewed, 0 if it had expired or was removed (an
-- admin reset): a lease that is gone is not brought back.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now then return 0 end
local expires = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], 'XX', string.format('%d', expires), ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(last[2]) - now) / 1000))
return 1
