-- ratewall: the Redis twins of src/limiter/*.rs, one file per algorithm.
--
-- The gateway sends one script: this prelude, token_bucket.lua, gcra.lua,
-- fixed_window.lua, sliding_window.lua, then decide.lua, concatenated. One script lets a
-- request's rules be decided in one atomic call and one round trip, all or nothing, even
-- when they use different algorithms.
--
-- KEYS[i]  one rule's state for one identity: "<prefix>:{<identity-hash>}:<rule>"
-- ARGV[1]  now in microseconds, or "" to read Redis TIME (production always does)
-- ARGV[2]  "" to decide, "peek" to only look (write nothing), "settle" to settle charges
--          decided earlier: give back what a decision took (a Redis Cluster request denied
--          by a rule on another identity; an answer its rule does not charge for), or take
--          the difference the backend reported (issue 27)
-- ARGV[1 + 2i] for KEYS[i]: its quota, "<algorithm code>:<parameters>" joined by ':'
--          (see each file for its parameters and their number; a concurrency limit's third
--          is its lease id; a calendar window, code 6, sends the gateway's period edges).
--          A batch repeats one rule's quota for every request: it is parsed once per call.
-- ARGV[2 + 2i] for KEYS[i]: flags, "0" to "3": 1 = shadow (decided and counted, never
--          denies the request); 2 = this key starts another request of a batch (decide
--          mode only; see decide.lua). In settle mode instead "<delta>:<window>": the cost
--          units to take (negative: give back) and, for a window, the window the charge
--          fell in as this script named it when it charged (the fifth answer below).
-- Returns 5 integers per key: allowed (1/0), remaining, retry-after µs (for an allowed
-- request: how long it waits for reserved tokens), reset µs, and in decide and peek mode
-- the window decided in (a fixed window's start µs, a sliding window's index, else 0), in
-- settle mode the cost units the settlement could not charge (forgiven).
--
-- Each algorithm is a function of the key's state (nil when none), now and the quota's
-- parameters. It returns, flat (no table per key): allowed, the state to write if the
-- request is charged, that state's TTL in µs, then the answer if charged (remaining,
-- retry µs, reset µs) and if not (the same three), then the window; or nil and why the
-- state is unusable. Each algorithm's SETTLE function takes the state, now, six
-- parameter places, then delta and window, and returns the state to write and its TTL
-- (false to delete the key: whole again; true to leave it as it is), then the cost units
-- forgiven; or nil and why.
--
-- Lua 5.1 numbers are doubles: the gateway keeps every value below 2^52 at load, and the
-- settlements clamp there, so all the arithmetic here is exact integer arithmetic, like
-- the Rust twins'.
--
-- A settlement never moves a key's time backwards: a bucket is judged at its last
-- charge's time when Redis' clock stepped back before it, and a window never opens
-- before the state's.
--
-- Each state is a string tagged by its algorithm ("t:", "g:", "f:", "s:"). A state left by
-- another algorithm (the rule changed) counts as none; anything else is an error, which
-- the gateway handles by its on_error policy. A concurrency limit (code 5) keeps a sorted
-- set of leases instead (see decide.lua).

local ALGORITHMS = {}
local SETTLE = {}

-- The library functions every key uses, looked up once per call rather than per use.
local floor, format, match, sub = math.floor, string.format, string.match, string.sub

-- floor(a / b) for |a| < 2^53, 0 < b, exactly. (Every a here is whole: a unit of 1,
-- the common quota, skips the division.)
local function idiv(a, b)
  if b == 1 then return a end
  local q = floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end

local function cdiv(a, b)
  return idiv(a + b - 1, b)
end

-- A TTL in µs as the whole milliseconds PX and PEXPIRE take, already a string: Redis
-- formats a number argument of redis.call with printf's %.17g, about 900 instructions
-- more a call than Lua's integer %d (issue 29).
local function ms(us)
  return format('%d', cdiv(us, 1000))
end

-- The most any level, count or debt holds: beyond 2^52 doubles stop being exact
-- (MAX_LEVEL in src/limiter/quota.rs).
local MAX_LEVEL = 4503599627370496

-- What a window that counted `count` leaves `k` windows on: its excess over n, less n for
-- each window after it (k = 0: the count itself). The twin of `carried` in
-- src/limiter/fixed_window.rs and sliding_window.rs.
local function carried(count, n, k)
  if k >= cdiv(count, n) then return 0 end
  return count - k * n
end

-- A state some ratewall algorithm wrote (maybe not the one asking).
local function ours(raw)
  return match(raw, '^[tgfs]:') ~= nil
end

local now = tonumber(ARGV[1])
if not now then
  -- Redis < 5 replicates scripts verbatim; TIME then needs effects replication.
  if redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

