-- wrk: every request with another API key, rotating over 100,000 keys (distinct keys).
local counter = 0
request = function()
  counter = counter + 1
  return wrk.format("GET", "/", { ["x-api-key"] = "key-" .. (counter % 100000) }, nil)
end
