-- Decide one request against every key: read all, judge all, then write all or none. A
-- gateway may send several requests in one call (a batch: flag 2 marks where each starts).
-- The enforcing keys decide for the request; a shadow key (flag 1) is judged and, when it
-- allows and the request passes, charged as if it were enforced, but never denies.
-- ARGV[2] = "peek" only looks: nothing is written and the answers are what a request
-- would be told now without being charged (the admin API's inspect). ARGV[2] = "refund"
-- gives back one charge per key, then answers like "peek".
-- A key that cannot be read as a state (wrong type, corrupt) fails the call with the error
-- code RATEWALL and the key's name: one key's problem, which the gateway tells apart from
-- the store being down.
--
-- Concurrency (code 5; parameters max, lease µs, lease id): the key is a sorted set of
-- the leases of requests in flight, scored by the µs they expire at. Live leases are
-- counted; a request let through adds its own and pushes the key's TTL to the latest
-- lease. The gateway renews a lease while its request is in flight (lua/lease.lua) and
-- removes it when the response ends; a gateway that dies leaves leases that expire.
local STRIDE = 7
local mode = ARGV[2]
local peek = mode == 'peek' or mode == 'refund'
local n = #KEYS

-- The key's type, as TYPE names it ('string', 'zset', 'none', ...).
local function key_type(key)
  local t = redis.call('TYPE', key)
  return type(t) == 'table' and t.ok or t
end

local function concurrency(key, max, member)
  if mode == 'refund' then
    -- Best effort: a key that is no longer a lease set holds no lease to give back.
    pcall(redis.call, 'ZREM', key, member)
  end
  local ok, count = pcall(redis.call, 'ZCOUNT', key, string.format('(%d', now), '+inf')
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
  return {
    allowed = allowed,
    charged = { max - after, 0, 0 },
    uncharged = { max - count, retry, 0 },
    lease = true,
    replace = replace,
  }
end

-- Decide keys first..last: one request, all or nothing. Returns its answers (4 numbers
-- per key), or nil and the failing key's error (nothing written).
local function decide(first, last)
  local results = {}
  local all = true
  for i = first, last do
    local a = 3 + STRIDE * (i - 1)
    local code = tonumber(ARGV[a])
    local p1, p2, p3, p4, p5 = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
    local shadow = (tonumber(ARGV[a + 6]) or 0) % 2 == 1
    local r, err
    if code == 5 then
      r, err = concurrency(KEYS[i], p1, ARGV[a + 3])
    else
      local algorithm = ALGORITHMS[code]
      if not algorithm then return nil, 'unknown algorithm ' .. tostring(ARGV[a]) end
      local ok, raw = pcall(redis.call, 'GET', KEYS[i])
      if not ok then
        -- A concurrency rule's lease set (the rule became a rate limit on reload) counts
        -- as none; SET replaces it. Anything else is not ours: an error.
        if key_type(KEYS[i]) ~= 'zset' then
          return nil, KEYS[i] .. ': ' .. tostring(type(raw) == 'table' and raw.err or raw)
        end
        raw = false
      end
      if not raw then raw = nil end
      if mode == 'refund' then
        local value, ttl = REFUNDS[code](raw, now, p1, p2, p3, p4, p5)
        if value == nil then
          return nil, KEYS[i] .. ': ' .. tostring(ttl)
        elseif value then
          redis.call('SET', KEYS[i], value, 'PX', cdiv(ttl, 1000))
          raw = value
        else
          redis.call('DEL', KEYS[i])
          raw = nil
        end
      end
      r, err = algorithm(raw, now, p1, p2, p3, p4, p5)
    end
    if not r then return nil, KEYS[i] .. ': ' .. tostring(err) end
    results[i] = r
    if not r.allowed and not shadow then all = false end
  end

  local out = {}
  for i = first, last do
    local r = results[i]
    local d = r.uncharged
    if all and not peek and r.allowed then
      if r.lease then
        local a = 3 + STRIDE * (i - 1)
        local lease_us = tonumber(ARGV[a + 2])
        -- Scores are µs near 2^51: formatted whole, never in Lua's %.14g.
        if r.replace then redis.call('DEL', KEYS[i]) end
        redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', string.format('%d', now))
        redis.call('ZADD', KEYS[i], string.format('%d', now + lease_us), ARGV[a + 3])
        local last_lease = redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')
        redis.call('PEXPIRE', KEYS[i], cdiv(tonumber(last_lease[2]) - now, 1000))
      else
        redis.call('SET', KEYS[i], r.value, 'PX', cdiv(r.ttl, 1000))
      end
      d = r.charged
    end
    out[#out + 1] = r.allowed and 1 or 0
    out[#out + 1] = d[1]
    out[#out + 1] = d[2]
    out[#out + 1] = d[3]
  end
  return out
end

-- Where each request starts: key 1, and every key flagged 2 (a batch of requests from one
-- gateway, decided one after another; each sees what the ones before it wrote).
local starts = { 1 }
for i = 2, n do
  if math.floor((tonumber(ARGV[3 + STRIDE * (i - 1) + 6]) or 0) / 2) % 2 == 1 then
    starts[#starts + 1] = i
  end
end

if #starts == 1 then
  local out, err = decide(1, n)
  if not out then return redis.error_reply('RATEWALL ' .. err) end
  return out
end

-- A batch: one request's key error fails that request only. Its answers are the error
-- message, then zeros, in the place of its first key's four numbers and the rest.
local reply = {}
for s = 1, #starts do
  local first = starts[s]
  local last = (starts[s + 1] or (n + 1)) - 1
  local out, err = decide(first, last)
  if not out then
    out = {}
    for k = 1, 4 * (last - first + 1) do out[k] = 0 end
    out[1] = 'RATEWALL ' .. err
  end
  for k = 1, #out do reply[#reply + 1] = out[k] end
end
return reply
