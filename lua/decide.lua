-- Decide one request against every key: read all, judge all, then write all or none. A
-- gateway may send several requests in one call (a batch: flag 2 marks where each starts).
-- The enforcing keys decide for the request; a shadow key (flag 1) is judged and, when it
-- allows and the request passes, charged as if it were enforced, but never denies.
-- ARGV[2] = "peek" only looks: nothing is written and the answers are what a request
-- would be told now without being charged (the admin API's inspect). ARGV[2] = "settle"
-- settles one charge per key (its argument in place of the flags), then answers like
-- "peek": what the next request would be told.
-- A key that cannot be read as a state (wrong type, corrupt) fails the call with the error
-- code RATEWALL and the key's name: one key's problem, which the gateway tells apart from
-- the store being down.
--
-- Concurrency (code 5; parameters max, lease µs, lease id): the key is a sorted set of
-- the leases of requests in flight, scored by the µs they expire at. Live leases are
-- counted; a request let through adds its own and pushes the key's TTL to the latest
-- lease. The gateway renews a lease while its request is in flight (lua/lease.lua) and
-- removes it when the response ends; a gateway that dies leaves leases that expire.
local mode = ARGV[2]
local settling = mode == 'settle'
local peek = mode == 'peek' or settling
local n = #KEYS

-- What a concurrency check writes when charged, in place of a state: its lease (and, for
-- REPLACE, first the rate rule's state it replaces).
local LEASE, REPLACE = {}, {}

-- The key's type, as TYPE names it ('string', 'zset', 'none', ...).
local function key_type(key)
  local t = redis.call('TYPE', key)
  return type(t) == 'table' and t.ok or t
end

-- How many parameters each algorithm code takes (see each algorithm's file).
local ARITY = { 6, 6, 4, 4, 3, 6 }

-- A quota argument as { code, p1, ..., pk }, parsed once per call however many keys share
-- it; nil if it is not one. Every parameter is a whole number but a concurrency limit's
-- third, its lease id, which stays a string.
local QUOTAS = {}
local function quota(s)
  if type(s) ~= 'string' then return nil end
  local q = QUOTAS[s]
  if q then return q end
  if match(s, '::') or match(s, '^:') or match(s, ':$') then return nil end
  q = {}
  for part in string.gmatch(s, '[^:]+') do q[#q + 1] = part end
  local code = tonumber(q[1])
  if not (code and ARITY[code] and #q == ARITY[code] + 1) then return nil end
  for k = 1, #q do
    if not (code == 5 and k == 4) then
      if not match(q[k], '^%d+$') then return nil end
      q[k] = tonumber(q[k])
    end
  end
  QUOTAS[s] = q
  return q
end

-- A key's settle argument: delta and window; nil if it is not one.
local function settlement(s)
  if type(s) ~= 'string' then return nil end
  local delta, window = match(s, '^(%-?%d+):(%d+)$')
  delta, window = tonumber(delta), tonumber(window)
  if not (delta and window) then return nil end
  return delta, window
end

local function concurrency(i, key, max, member)
  local delta = settling and settlement(ARGV[2 + 2 * i])
  if delta and delta < 0 then
    -- Best effort: a key that is no longer a lease set holds no lease to give back.
    pcall(redis.call, 'ZREM', key, member)
  end
  local ok, count = pcall(redis.call, 'ZCOUNT', key, format('(%d', now), '+inf')
  local replace = false
  if not ok then
    -- A rate rule's state (the rule became a concurrency limit on reload) counts as none.
    local raw = key_type(key) == 'string' and redis.call('GET', key)
    if not (raw and ours(raw)) then return nil, type(count) == 'table' and count.err or count end
    count, replace = 0, true
  end
  if count > max then count = max end
  local allowed = count < max
  local retry = 0
  if not allowed then retry = 1000000 end
  local after = count + 1
  if after > max then after = max end
  return allowed, replace and REPLACE or LEASE, 0,
    max - after, 0, 0,
    max - count, retry, 0, 0
end

-- Judge KEYS[i], writing nothing (but a settlement): what its algorithm returns (see
-- prelude.lua), then in settle mode the cost units forgiven; or nil and why.
local function judge(i)
  local key, q = KEYS[i], quota(ARGV[1 + 2 * i])
  if not q then return nil, 'bad quota argument ' .. tostring(ARGV[1 + 2 * i]) end
  local code = q[1]
  if code == 5 then return concurrency(i, key, q[2], q[4]) end
  local algorithm = ALGORITHMS[code]
  if not algorithm then return nil, 'unknown algorithm ' .. tostring(code) end
  local ok, raw = pcall(redis.call, 'GET', key)
  if not ok then
    -- A concurrency rule's lease set (the rule became a rate limit on reload) counts
    -- as none; SET replaces it. Anything else is not ours: an error.
    if key_type(key) ~= 'zset' then
      return nil, tostring(type(raw) == 'table' and raw.err or raw)
    end
    raw = false
  end
  if not raw then raw = nil end
  local forgiven = 0
  if settling then
    local delta, window = settlement(ARGV[2 + 2 * i])
    if not delta then return nil, 'bad settle argument ' .. tostring(ARGV[2 + 2 * i]) end
    local value, ttl = true, 0
    if delta ~= 0 then
      value, ttl, forgiven = SETTLE[code](raw, now, q[2], q[3], q[4], q[5], q[6], q[7], delta, window)
    end
    if value == nil then
      return nil, tostring(ttl)
    elseif value == false then
      redis.call('DEL', key)
      raw = nil
    elseif value ~= true then
      redis.call('SET', key, value, 'PX', ms(ttl))
      raw = value
    end
  end
  local allowed, value, ttl, c1, c2, c3, u1, u2, u3, w =
    algorithm(raw, now, q[2], q[3], q[4], q[5], q[6], q[7])
  return allowed, value, ttl, c1, c2, c3, u1, u2, u3, w, forgiven
end

-- Write what a charged check leaves: its state for its TTL, or its lease.
local function charge(i, value, ttl)
  local key = KEYS[i]
  if value ~= LEASE and value ~= REPLACE then
    redis.call('SET', key, value, 'PX', ms(ttl))
    return
  end
  local q = quota(ARGV[1 + 2 * i])
  -- Scores are µs near 2^51: formatted whole, never in Lua's %.14g.
  if value == REPLACE then redis.call('DEL', key) end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', format('%d', now))
  redis.call('ZADD', key, format('%d', now + q[3]), q[4])
  local last_lease = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', key, ms(tonumber(last_lease[2]) - now))
end

-- Each key's judgement while its request is decided, 11 values a key (see judge), flat.
local R = {}
local W = 11

-- Decide keys first..last: one request, all or nothing. Its answers (5 numbers per key,
-- one string a key) go into `reply` from position `at`; returns the position after them,
-- or nil and the failing key's error (nothing written).
local function decide(first, last, reply, at)
  local all = true
  for i = first, last do
    local allowed, value, ttl, c1, c2, c3, u1, u2, u3, w, forgiven = judge(i)
    if allowed == nil then return nil, KEYS[i] .. ': ' .. tostring(value) end
    local b = W * (i - first)
    R[b + 1], R[b + 2], R[b + 3] = allowed, value, ttl
    R[b + 4], R[b + 5], R[b + 6] = c1, c2, c3
    R[b + 7], R[b + 8], R[b + 9] = u1, u2, u3
    R[b + 10], R[b + 11] = w or 0, forgiven or 0
    if not allowed then
      local flags = ARGV[2 + 2 * i]
      if flags ~= '1' and flags ~= '3' then all = false end
    end
  end
  for i = first, last do
    local b = W * (i - first)
    local allowed, fifth = R[b + 1], R[b + 10]
    if settling then fifth = R[b + 11] end
    if all and not peek and allowed then
      charge(i, R[b + 2], R[b + 3])
    else
      b = b + 3
    end
    -- Whole numbers, as %d writes them (never %.14g: a window's start is µs near 2^51).
    reply[at] = format('%d %d %d %d %d', allowed and 1 or 0, R[b + 4], R[b + 5], R[b + 6], fifth)
    at = at + 1
  end
  return at
end

-- Where each request starts: key 1, and every key flagged 2 (a batch of requests from one
-- gateway, decided one after another; each sees what the ones before it wrote).
local starts = { 1 }
for i = 2, n do
  local flags = ARGV[2 + 2 * i]
  if flags == '2' or flags == '3' then starts[#starts + 1] = i end
end

-- The reply: { every key's five numbers as one string, space-separated, in key order },
-- then, in a batch, for each request that failed on a key's state: its number (from 1)
-- and the error. One string, not a number each: the gateway reads it in one pass.
local reply = {}
if #starts == 1 then
  local ok, err = decide(1, n, reply, 1)
  if not ok then return redis.error_reply('RATEWALL ' .. err) end
  return { table.concat(reply, ' ') }
end

-- A batch: one request's key error fails that request only. Its keys answer zeros, and
-- its number and error follow the numbers.
local failed = {}
local at = 1
for s = 1, #starts do
  local first = starts[s]
  local last = (starts[s + 1] or (n + 1)) - 1
  local next_at, err = decide(first, last, reply, at)
  if not next_at then
    for k = at, at + last - first do reply[k] = '0 0 0 0 0' end
    failed[#failed + 1] = format('%d', s)
    failed[#failed + 1] = 'RATEWALL ' .. err
    next_at = at + last - first + 1
  end
  at = next_at
end
table.insert(failed, 1, table.concat(reply, ' '))
return failed
