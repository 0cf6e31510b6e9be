-- ratewall: the Redis twins of src/limiter/*.rs, one file per algorithm.
--
-- The gateway sends one script: this prelude, token_bucket.lua, gcra.lua,
-- fixed_window.lua, sliding_window.lua, then decide.lua, concatenated. One script lets a
-- request's rules be decided in one atomic call and one round trip, all or nothing, even
-- when they use different algorithms.
--
-- KEYS[i]  one rule's state for one identity: "<prefix>:{<identity-hash>}:<rule>"
-- ARGV[1]  now in microseconds, or "" to read Redis TIME (production always does)
-- ARGV[2]  "" to decide, "peek" to only look (write nothing), "refund" to give back what a
--          decision took (a Redis Cluster request denied by a rule on another identity)
-- ARGV[3 + 7(i-1) ..] for KEYS[i]: algorithm code, five parameters (see each file), then
--          flags: 1 = shadow (decided and counted, never denies the request); 2 = this key
--          starts another request of a batch (decide mode only; see decide.lua)
-- Returns 4 integers per key: allowed (1/0), remaining, retry-after µs (for an allowed
-- request: how long it waits for reserved tokens), reset µs.
--
-- Lua 5.1 numbers are doubles: the gateway keeps every value below 2^52 at load, so all
-- the arithmetic here is exact integer arithmetic, like the Rust twins'.
--
-- Each state is a string tagged by its algorithm ("t:", "g:", "f:", "s:"). A state left by
-- another algorithm (the rule changed) counts as none; anything else is an error, which
-- the gateway handles by its on_error policy. A concurrency limit (code 5) keeps a sorted
-- set of leases instead (see decide.lua).

local ALGORITHMS = {}
local REFUNDS = {}

-- floor(a / b) for |a| < 2^53, 0 < b, exactly.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end

local function cdiv(a, b)
  return idiv(a + b - 1, b)
end

-- A state some ratewall algorithm wrote (maybe not the one asking).
local function ours(raw)
  return string.match(raw, '^[tgfs]:') ~= nil
end

local now = tonumber(ARGV[1])
if not now then
  -- Redis < 5 replicates scripts verbatim; TIME then needs effects replication.
  if redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

