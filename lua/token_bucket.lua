-- ratewall token bucket: the Redis twin of src/limiter/token_bucket.rs.
-- Decides one request against every bucket in KEYS, all or nothing: when any bucket
-- denies, none is charged.
--
-- KEYS[i]  one bucket: "<prefix>:{<identity-hash>}:<rule>", a string "level:last:unit"
-- ARGV[1]  now in microseconds, or "" to read Redis TIME (production always does)
-- ARGV[2 + 4(i-1) ..] for KEYS[i]: unit, per_us, capacity, need
--            unit      units in one token
--            per_us    units that drip in per microsecond
--            capacity  burst * unit
--            need      cost * unit
-- Returns 4 integers per key: allowed (1/0), remaining tokens, retry-after µs, reset µs.
--
-- Lua 5.1 numbers are doubles: the gateway keeps every value below 2^52 so that all the
-- arithmetic here is exact integer arithmetic, like the Rust twin's.

local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end

local function cdiv(a, b)
  return idiv(a + b - 1, b)
end

local now = tonumber(ARGV[1])
if not now then
  -- Redis < 5 replicates scripts verbatim; TIME then needs effects replication.
  if redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local n = #KEYS
local levels = {}
local all = true
for i = 1, n do
  local a = 2 + 4 * (i - 1)
  local unit, per_us = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local cap, need = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local raw = redis.call('GET', KEYS[i])
  local level = cap
  if raw then
    local l, last, u = string.match(raw, '^(%d+):(%d+):(%d+)$')
    l, last, u = tonumber(l), tonumber(last), tonumber(u)
    if not (l and last and u and u > 0) then
      return redis.error_reply('ratewall: corrupt token bucket state at ' .. KEYS[i])
    end
    if u ~= unit then
      l = idiv(l, u) * unit
    end
    if l > cap then l = cap end
    local elapsed = now - last
    if elapsed < 0 then elapsed = 0 end
    if elapsed >= cdiv(cap - l, per_us) then
      level = cap
    else
      level = l + elapsed * per_us
    end
  end
  levels[i] = level
  if level < need then all = false end
end

local out = {}
for i = 1, n do
  local a = 2 + 4 * (i - 1)
  local unit, per_us = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local cap, need = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local level = levels[i]
  local allowed = level >= need
  local retry = 0
  if not allowed then retry = cdiv(need - level, per_us) end
  if all then
    level = level - need
    local ttl_us = cdiv(cap - level, per_us)
    redis.call('SET', KEYS[i], string.format('%d:%d:%d', level, now, unit),
      'PX', cdiv(ttl_us, 1000))
  end
  local o = 4 * (i - 1)
  out[o + 1] = allowed and 1 or 0
  out[o + 2] = idiv(level, unit)
  out[o + 3] = retry
  out[o + 4] = cdiv(cap - level, per_us)
end
return out
