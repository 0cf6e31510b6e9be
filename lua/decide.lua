-- Decide one request against every key: read all, judge all, then write all or none.
-- ARGV[2] = "peek" only looks: nothing is written and the answers are what a request
-- would be told now without being charged (the admin API's inspect). ARGV[2] = "refund"
-- gives back one charge per key, then answers like "peek".
-- A key that cannot be read as a state (wrong type, corrupt) fails the call with the error
-- code RATEWALL and the key's name: one key's problem, which the gateway tells apart from
-- the store being down.
local mode = ARGV[2]
local peek = mode == 'peek' or mode == 'refund'
local n = #KEYS
local results = {}
local all = true
for i = 1, n do
  local a = 3 + 5 * (i - 1)
  local algorithm = ALGORITHMS[tonumber(ARGV[a])]
  if not algorithm then
    return redis.error_reply('RATEWALL unknown algorithm ' .. tostring(ARGV[a]))
  end
  local ok, raw = pcall(redis.call, 'GET', KEYS[i])
  if not ok then
    local why = type(raw) == 'table' and raw.err or tostring(raw)
    return redis.error_reply('RATEWALL ' .. KEYS[i] .. ': ' .. tostring(why))
  end
  if not raw then raw = nil end
  local p1, p2, p3, p4 = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  if mode == 'refund' then
    local value, ttl = REFUNDS[tonumber(ARGV[a])](raw, now, p1, p2, p3, p4)
    if value == nil then
      return redis.error_reply('RATEWALL ' .. KEYS[i] .. ': ' .. tostring(ttl))
    elseif value then
      redis.call('SET', KEYS[i], value, 'PX', cdiv(ttl, 1000))
      raw = value
    else
      redis.call('DEL', KEYS[i])
      raw = nil
    end
  end
  local r, err = algorithm(raw, now, p1, p2, p3, p4)
  if not r then
    return redis.error_reply('RATEWALL ' .. KEYS[i] .. ': ' .. err)
  end
  results[i] = r
  if not r.allowed then all = false end
end

local out = {}
for i = 1, n do
  local r = results[i]
  local d = r.uncharged
  if all and not peek then
    redis.call('SET', KEYS[i], r.value, 'PX', cdiv(r.ttl, 1000))
    d = r.charged
  end
  local o = 4 * (i - 1)
  out[o + 1] = r.allowed and 1 or 0
  out[o + 2] = d[1]
  out[o + 3] = d[2]
  out[o + 4] = d[3]
end
return out
