-- The nginx + Lua + Redis peer of bench/run: a token bucket per API key kept in Redis, the
-- way a limit is commonly shared between nginx instances (OpenResty's lua-resty-redis, one
-- script call per request over the cosocket connection pool). Not part of ratewall.
--
--   init_by_lua_block   { require("redis_bucket").setup("127.0.0.1:16379") }
--   access_by_lua_block { require("redis_bucket").limit("per-key", 1000000, 100000) }
--
-- Each request: a connection from the worker's pool, ONE EVALSHA of SCRIPT (EVAL when Redis
-- answers NOSCRIPT, which also loads it), the connection back to the pool; 429 when the
-- bucket is empty, 503 when Redis fails (ratewall's on_error = "deny"), else the request
-- goes on to proxy_pass.

local redis = require "resty.redis"

local byte, format, find = string.byte, string.format, string.find

-- The bucket, run by Redis. KEYS[1]: the bucket of one key under one rule.
-- ARGV[1]: rate in tokens a second; ARGV[2]: burst (the bucket's size) in tokens.
-- Integer arithmetic in µs: a token is 1,000,000 units and `rate` units drip in per µs, so
-- the level stays exact (every value is far below 2^53). The state is the string
-- "<level in units>:<its time in µs, Redis TIME>", written only when a token is taken, with
-- a TTL of the time the bucket takes to fill up again (a full bucket is no key at all).
-- Returns { allowed (1/0), whole tokens left, µs until a token is back (denied only) }.
local SCRIPT = [[
local floor = math.floor
local function idiv(a, b)
  local q = floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function cdiv(a, b) return idiv(a + b - 1, b) end
local TOKEN = 1000000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local per_us = tonumber(ARGV[1])
local cap = tonumber(ARGV[2]) * TOKEN
local level = cap
local raw = redis.call('GET', KEYS[1])
if raw then
  local l, last = string.match(raw, '^(%d+):(%d+)$')
  l, last = tonumber(l), tonumber(last)
  if l and last and l < cap then
    local elapsed = now - last
    if elapsed < 0 then elapsed = 0 end
    if elapsed < cdiv(cap - l, per_us) then level = l + elapsed * per_us end
  end
end
if level < TOKEN then
  return { 0, 0, cdiv(TOKEN - level, per_us) }
end
level = level - TOKEN
redis.call('SET', KEYS[1], string.format('%d:%d', level, now), 'PX', cdiv(cdiv(cap - level, per_us), 1000))
return { 1, idiv(level, TOKEN), 0 }
]]

local function sha1_hex(s)
  local bin = ngx.sha1_bin(s)
  local hex = {}
  for i = 1, #bin do hex[i] = format("%02x", byte(bin, i)) end
  return table.concat(hex)
end

local M = { host = "127.0.0.1", port = 16379, SCRIPT = SCRIPT }
local SHA = sha1_hex(SCRIPT)
M.SHA = SHA

-- Where Redis listens, "<host>:<port>" (once, from init_by_lua).
function M.setup(addr)
  local host, port = string.match(addr, "^(.+):(%d+)$")
  M.host, M.port = host, tonumber(port)
end

-- Decide the request against `rule`'s bucket for its X-Api-Key (access phase). Like
-- ratewall's api_key rules, a request without the header is not limited by the rule.
function M.limit(rule, rate, burst)
  local api_key = ngx.var.http_x_api_key
  if not api_key then return end
  local red = redis:new()
  red:set_timeouts(500, 500, 500) -- ratewall's bench rules: store timeout 500ms
  local ok, err = red:connect(M.host, M.port)
  if not ok then
    ngx.log(ngx.ERR, "redis connect: ", err)
    return ngx.exit(503)
  end
  local key = "nginx-lua:{" .. api_key .. "}:" .. rule
  local res
  res, err = red:evalsha(SHA, 1, key, rate, burst)
  if not res and err and find(err, "NOSCRIPT", 1, true) then
    res, err = red:eval(SCRIPT, 1, key, rate, burst)
  end
  if not res then
    ngx.log(ngx.ERR, "redis script: ", err)
    red:close()
    return ngx.exit(503)
  end
  -- Back to this worker's pool: idle up to 60 s, at most 256 idle connections.
  red:set_keepalive(60000, 256)
  if res[1] == 0 then
    ngx.header["Retry-After"] = math.ceil(res[3] / 1000000)
    return ngx.exit(429)
  end
end

return M
