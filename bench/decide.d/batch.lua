-- wrk: POST /v1/decide, a batch of 10 decisions a call ([{"rule":"r","key":"key-N"}, ...]),
-- ten consecutive keys out of 100,000 each call, with the bearer token.
local counter = 0
request = function()
  local asks = {}
  for i = 1, 10 do
    counter = counter + 1
    asks[i] = '{"rule":"r","key":"key-' .. (counter % 100000) .. '"}'
  end
  return wrk.format("POST", "/v1/decide", {
    ["authorization"] = "Bearer bench-decide-token-0123456789",
    ["content-type"] = "application/json",
  }, "[" .. table.concat(asks, ",") .. "]")
end
