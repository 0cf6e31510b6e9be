-- wrk: GET /api/items through the proxy, every request with another API key out of
-- 100,000 (X-Api-Key), as bench/keys.lua but on the path the /api rule matches.
local counter = 0
request = function()
  counter = counter + 1
  return wrk.format("GET", "/api/items", { ["x-api-key"] = "key-" .. (counter % 100000) }, nil)
end
