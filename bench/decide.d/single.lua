-- wrk: POST /v1/decide, one decision a call, {"rule":"r","key":"key-N"}, rotating over
-- 100,000 keys, with the bearer token. The key also goes in X-Api-Key, which ratewall's
-- decision API does not read and the nginx peer keys its limit_req by: every server under
-- test gets the same bytes.
local counter = 0
request = function()
  counter = counter + 1
  local key = "key-" .. (counter % 100000)
  return wrk.format("POST", "/v1/decide", {
    ["authorization"] = "Bearer bench-decide-token-0123456789",
    ["content-type"] = "application/json",
    ["x-api-key"] = key,
  }, '{"rule":"r","key":"' .. key .. '"}')
end
