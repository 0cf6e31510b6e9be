-- wrk: as keys.lua, every request with another API key, and `Connection: close`: one
-- request per connection, so over TLS every request is a full handshake (wrk resumes no
-- session).
local counter = 0
request = function()
  counter = counter + 1
  return wrk.format("GET", "/", { ["x-api-key"] = "key-" .. (counter % 100000), ["connection"] = "close" }, nil)
end
