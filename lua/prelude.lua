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
-- ARGV[1 + 2i] for KEYS[i]: its quota, "<algorithm code>:<five parameters>" joined by ':'
--          (see each file; a concurrency limit's third is its lease id; a calendar
--          window, code 6, sends its limit, cost and the gateway's three period edges).
--          A batch repeats one rule's quota for every request: it is parsed once per call.
-- ARGV[2 + 2i] for KEYS[i]: flags, "0" to "3": 1 = shadow (decided and counted, never
--          denies the request); 2 = this key starts another request of a batch (decide
--          mode only; see decide.lua). In settle mode instead "<delta>:<left>:<debt>": the
--          cost units to take (negative: give back), the µs until the window the charge fell
--          in ends ("-": the one open now; windows only), how many cost units below empty a
--          charge may go (max_debt).
-- Returns 4 integers per key: allowed (1/0), remaining, retry-after µs (for an allowed
-- request: how long it waits for reserved tokens), reset µs.
--
-- Each algorithm is a function of the key's state (nil when none), now and the quota's
-- five parameters. It returns, flat (no table per key): allowed, the state to write if the
-- request is charged, that state's TTL in µs, then the answer if charged (remaining,
-- retry µs, reset µs) and if not (the same three); or nil and why the state is unusable.
-- Each algorithm's SETTLE function takes the state, now, the five parameters, then delta,
-- left (nil: now) and debt, and returns the state to write and its TTL, false to delete
-- the key (whole again), true to leave it as it is, or nil and why.
--
-- Lua 5.1 numbers are doubles: the gateway keeps every value below 2^52 at load, so all
-- the arithmetic here is exact integer arithmetic, like the Rust twins'.
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

-- A window's count after a settlement charges `add` (> 0) more: at most `most` (N plus
-- max_debt), and a count already past it is never lowered (the twin of
-- settle::charged).
local function charged(count, add, most)
  if add > most then add = most end
  local top = most
  if count > top then top = count end
  count = count + add
  if count > top then count = top end
  return count
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

