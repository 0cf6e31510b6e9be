-- Fixed window: the twin of src/limiter/fixed_window.rs.
-- Parameters: period (µs), limit (the rate's N), cost.
-- State: "f:<window start, µs>:<count>"; its TTL is the window's end, set with the count.
-- A request timed before the window's start (a clock stepped back) is decided at the start.
--
-- Calendar window (code 6; a fixed_window rule whose rate is "N/month", "N/week" or
-- "N/day"): parameters limit, cost, e0, e1, e2 — the calendar period open at the
-- gateway's time when it sent the call, [e0, e1), and the next one's end, e2. Lua has no
-- zone database: the gateway cuts the edges (src/limiter/calendar.rs) and the script
-- picks the period containing Redis' now, so every gateway counts on Redis' clock:
--   now < e1         [e0, e1)  (before e0, a gateway ahead of Redis: counted in the
--                               gateway's period, which then opens early for this key)
--   e1 <= now < e2   [e1, e2)  (a gateway behind Redis: Redis' period)
--   e2 <= now        periods of e2 - e1 on from e2 (a clock more than a period apart:
--                               the next period's length, repeated)
-- The state is the fixed window's: a state whose start is the period's start is counted
-- in it; any other (an ended period, the plain fixed window's) is none. Switching a rule
-- between the two keeps the count only where the window is the same.

-- The live window's start and count at now (a fresh window if none is live), and the time
-- the request is decided at: now, or the window's start if now is before it (the clock
-- stepped back: a window never moves backwards).
-- The state's start and count (nil, nil: none), or false and why it is unusable.
local function fw_state(raw)
  if not (raw and sub(raw, 1, 2) == 'f:') then
    if raw and not ours(raw) then return false, 'not a ratewall state' end
    return nil, nil
  end
  local s, c = match(raw, '^f:(%d+):(%d+)$')
  s, c = tonumber(s), tonumber(c)
  if not (s and c) then return false, 'corrupt fixed window state' end
  return s, c
end

-- The window a request at now is decided in: its start, its end and the state's count in
-- it; or nil and why. The time it is placed at is now, or the state's start if now is
-- before it (the clock stepped back: a window never moves backwards).
local function fw_window(raw, now, period)
  local s, c = fw_state(raw)
  if s == false then return nil, c end
  if not s then return now, now + period, 0 end
  local at = now
  if at < s then at = s end
  if at < s + period then return s, s + period, c end
  return at, at + period, 0
end

-- The calendar period containing at, from the gateway's edges (see the top).
local function cal_period(at, e0, e1, e2)
  if at < e1 then return e0, e1 end
  if at < e2 then return e1, e2 end
  local len = e2 - e1
  local k = idiv(at - e2, len)
  return e2 + k * len, e2 + (k + 1) * len
end

local function cal_window(raw, now, e0, e1, e2)
  if not (e0 < e1 and e1 < e2) then return nil, 'bad calendar edges' end
  local s, c = fw_state(raw)
  if s == false then return nil, c end
  local at = now
  if s and at < s then at = s end
  local start, ends = cal_period(at, e0, e1, e2)
  if s ~= start then c = 0 end
  return start, ends, c
end

-- One request in the window [start, ends) holding count (both fixed windows).
local function fw_judge(start, ends, count, now, limit, cost)
  -- Waits count from now: the window ends on the state's clock.
  local ends_in = ends - now
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

ALGORITHMS[3] = function(raw, now, period, limit, cost)
  local start, ends, count = fw_window(raw, now, period)
  if not start then return nil, ends end
  return fw_judge(start, ends, count, now, limit, cost)
end

ALGORITHMS[6] = function(raw, now, limit, cost, e0, e1, e2)
  local start, ends, count = cal_window(raw, now, e0, e1, e2)
  if not start then return nil, ends end
  return fw_judge(start, ends, count, now, limit, cost)
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
local function fw_settle(start, ends, count, now, limit, delta, left, debt)
  if delta < 0 then
    if count == 0 or (left and not same_window(ends, now, left, ends - start)) then
      return true
    end
    count = count + delta
    if count < 0 then count = 0 end
  else
    count = charged(count, delta, limit + debt)
  end
  if count == 0 then return false end
  return format('f:%d:%d', start, count), ends - now
end

SETTLE[3] = function(raw, now, period, limit, cost, p4, p5, delta, left, debt)
  local start, ends, count = fw_window(raw, now, period)
  if not start then return nil, ends end
  return fw_settle(start, ends, count, now, limit, delta, left, debt)
end

-- The calendar window's twin of fixed_window::settle: the same, in the period containing
-- Redis' now (a calendar period's length is its own: a 23-hour day, a 28-day month).
SETTLE[6] = function(raw, now, limit, cost, e0, e1, e2, delta, left, debt)
  local start, ends, count = cal_window(raw, now, e0, e1, e2)
  if not start then return nil, ends end
  return fw_settle(start, ends, count, now, limit, delta, left, debt)
end
