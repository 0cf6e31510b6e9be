-- wrk: as keys.lua (every request with another API key, over 100,000), to a path only the
-- last of bench/bench.py's 20 routes matches.
local counter = 0
request = function()
  counter = counter + 1
  return wrk.format("GET", "/svc20/orders", { ["x-api-key"] = "key-" .. (counter % 100000) }, nil)
end
