-- Fixed window: the twin of src/limiter/fixed_window.rs.
-- Parameters: period (µs), limit (the rate's N), cost.
-- State: "f:<window start, µs>:<count>"; its TTL is the window's end, set with the count.
-- A request timed before the window's start (a clock stepped back) is decided at the start.

-- The live window's start and count at now (a fresh window if none is live), and the time
-- the request is decided at: now, or the window's start if now is before it (the clock
-- stepped back: a window never moves backwards).
local function fw_window(raw, now, period)
  if not (raw and sub(raw, 1, 2) == 'f:') then
    if raw and not ours(raw) then return nil, 'not a ratewall state' end
    return now, 0, now
  end
  local s, c = match(raw, '^f:(%d+):(%d+)$')
  s, c = tonumber(s), tonumber(c)
  if not (s and c) then return nil, 'corrupt fixed window state' end
  local at = now
  if at < s then at = s end
  if at < s + period then return s, c, at end
  return at, 0, at
end

ALGORITHMS[3] = function(raw, now, period, limit, cost)
  local start, count = fw_window(raw, now, period)
  if not start then return nil, count end
  -- Waits count from now: the window ends at start + period on the state's clock.
  local ends_in = start + period - now
  local allowed = count + cost <= limit
  local after = count + cost
  local left = limit - after
  if left < 0 then left = 0 end
  local shown = count
  if shown > limit then shown = limit end
  local retry, reset, value = 0, ends_in, false
  if allowed then
    value = format('f:%d:%d', start, after)
  else
    retry = ends_in
  end
  if count == 0 then reset = 0 end
  return allowed, value, ends_in,
    left, 0, ends_in,
    limit - shown, retry, reset
end

REFUNDS[3] = function(raw, now, period, limit, cost)
  local start, count = fw_window(raw, now, period)
  if not start then return nil, count end
  count = count - cost
  if count <= 0 then return false end
  return format('f:%d:%d', start, count), start + period - now
end
