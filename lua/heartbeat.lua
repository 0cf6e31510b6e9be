-- ratewall: one gateway's heartbeat, and how many gateways wrote theirs lately.
-- KEYS[1]  the set of gateways: "<prefix>:gateways" (a sorted set; member: a gateway's
--          instance id, 16 hex digits; score: when it last wrote, ms of Redis' clock)
-- ARGV[1]  this gateway's instance id; ARGV[2] the window, ms: a gateway not heard from
--          for that long is no longer counted (and its member is removed)
-- Returns the number of gateways within the window, this one included. The set expires
-- a window after the last heartbeat: gateways gone leave nothing behind.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], string.format('%d', now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now - window))
redis.call('PEXPIRE', KEYS[1], window)
return redis.call('ZCARD', KEYS[1])
