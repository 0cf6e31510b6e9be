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

-- Whether a window ending at `ends` is the one a charge fell in, told `left` µs from now:
-- ends are at least a period apart, the estimate is off by the store's latency at most.
local function same_window(ends, now, left, period)
  local d = ends - (now + left)
  if d < 0 then d = -d end
  return d * 2 < period
end

-- Settle a charge made earlier (the twin of fixed_window::settle): a refund goes back into
-- the window the charge fell in while it is open (left: µs until that window ends, or nil
-- for the one open now), else the charge stands (true: keep the key as it is); a charge
-- counts in the window open now (a fresh one if none is), up to debt past the limit.
SETTLE[3] = function(raw, now, period, limit, cost, p4, p5, delta, left, debt)
  local start, count = fw_window(raw, now, period)
  if not start then return nil, count end
  if delta < 0 then
    if count == 0 or (left and not same_window(start + period, now, left, period)) then
      return true
    end
    count = count + delta
    if count < 0 then count = 0 end
  else
    local most = limit + debt
    local add = delta
    if add > most then add = most end
    local top = most
    if count > top then top = count end
    count = count + add
    if count > top then count = top end
  end
  if count == 0 then return false end
  return format('f:%d:%d', start, count), start + period - now
end
