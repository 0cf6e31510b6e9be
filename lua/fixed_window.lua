-- Fixed window: the twin of src/limiter/fixed_window.rs.
-- Parameters: period (µs), limit (the rate's N), cost, debt (max_debt: how far past N a
-- request may still be admitted).
-- State: "f:<window start, µs>:<count>"; its TTL is the window's end (and past it while
-- the count carries a debt), set with the count. A request timed before the window's
-- start (a clock stepped back) is decided at the start.
--
-- A window's count past N (costs reported above their reservations, or what debt let a
-- request borrow) is carried into the windows after it, N paid by each: a fresh window
-- starts with the last one's excess, less N for every whole window that passed unused.
-- While a debt is carried those windows run back to back from the state's end; once it
-- is paid, a window opens at a first request again.
--
-- Calendar window (code 6; a fixed_window rule whose rate is "N/month", "N/week" or
-- "N/day"): parameters limit, cost, debt, e0, e1, e2 — the calendar period open at the
-- gateway's time when it sent the call, [e0, e1), and the next one's end, e2. Lua has no
-- zone database: the gateway cuts the edges (src/limiter/calendar.rs) and the script
-- picks the period containing Redis' now, so every gateway counts on Redis' clock:
--   now < e1         [e0, e1)  (before e0, a gateway ahead of Redis: counted in the
--                               gateway's period, which then opens early for this key)
--   e1 <= now < e2   [e1, e2)  (a gateway behind Redis: Redis' period)
--   e2 <= now        periods of e2 - e1 on from e2 (a clock more than a period apart:
--                               the next period's length, repeated)
-- The state is the fixed window's: a state whose start is the period's start is counted
-- in it; an earlier one carries its debt (the period right before: its excess; an older
-- one: that less N); any other (the plain fixed window's, started later) is none. A
-- settlement holds at most one whole period of debt (2N + debt), the rest forgiven.

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

-- The window a request at now is decided in: its start, its end and the count in it (the
-- last window's debt carried into a fresh one); or nil and why. A window never moves
-- backwards: before the state's start, the request is placed at it.
local function fw_window(raw, now, period, limit)
  local s, c = fw_state(raw)
  if s == false then return nil, c end
  if not s then return now, now + period, 0 end
  local at = now
  if at < s then at = s end
  if at < s + period then return s, s + period, c end
  -- The windows after a debt run back to back from the state's end until it is paid;
  -- then a window opens at a first request again.
  local ended = s + period
  local idle = idiv(at - ended, period)
  local debt = carried(c, limit, idle + 1)
  if debt == 0 then return at, at + period, 0 end
  local start = ended + idle * period
  return start, start + period, debt
end

-- The calendar period containing at, from the gateway's edges (see the top).
local function cal_period(at, e0, e1, e2)
  if at < e1 then return e0, e1 end
  if at < e2 then return e1, e2 end
  local len = e2 - e1
  local k = idiv(at - e2, len)
  return e2 + k * len, e2 + (k + 1) * len
end

local function cal_window(raw, now, limit, e0, e1, e2)
  if not (e0 < e1 and e1 < e2) then return nil, 'bad calendar edges' end
  local s, c = fw_state(raw)
  if s == false then return nil, c end
  local at = now
  if s and at < s then at = s end
  local start, ends = cal_period(at, e0, e1, e2)
  if not s or s > start then
    c = 0
  elseif s < start then
    -- The period right before: nearer than one and a half of this one (periods differ
    -- in length by less than a third); else at least one whole period passed unused.
    local k = 2
    if 2 * (start - s) < 3 * (ends - start) then k = 1 end
    c = carried(c, limit, k)
  end
  return start, ends, c
end

-- How long a window's state matters: to its end, and past it while its count carries a
-- debt, `each` µs per window it is carried into. At most MAX_LEVEL.
local function fw_ttl(ends, count, now, limit, each)
  local windows = cdiv(count - limit, limit)
  if windows < 0 then windows = 0 end
  local ttl = ends - now
  if windows > 0 then
    if windows > idiv(MAX_LEVEL, each) then return MAX_LEVEL end
    ttl = ttl + windows * each
  end
  if ttl > MAX_LEVEL then ttl = MAX_LEVEL end
  return ttl
end

-- One request in the window [start, ends) holding count (both fixed windows); `each`: a
-- window's length for the state's TTL, `next_len` the next window's for a retry.
local function fw_judge(start, ends, count, now, limit, cost, debt, each, next_len)
  -- Waits count from now: the window ends on the state's clock.
  local ends_in = ends - now
  local allowed = count + cost <= limit + debt
  local after = count + cost
  local left = limit - after
  if left < 0 then left = 0 end
  local shown = count
  if shown > limit then shown = limit end
  local retry, reset, value, ttl = 0, ends_in, false, 0
  if allowed then
    value = format('f:%d:%d', start, after)
    ttl = fw_ttl(ends, after, now, limit, each)
  else
    -- The first window whose carried count leaves room, N paid by each after this one.
    local excess = count - limit
    if excess < 0 then excess = 0 end
    local short = excess + cost - limit - debt
    local windows = 0
    if short > 0 then windows = cdiv(short, limit) end
    retry = ends_in
    if windows > 0 then
      if windows > idiv(MAX_LEVEL, next_len) then
        retry = MAX_LEVEL
      else
        retry = retry + windows * next_len
      end
    end
    if retry > MAX_LEVEL then retry = MAX_LEVEL end
  end
  if count == 0 then reset = 0 end
  return allowed, value, ttl,
    left, 0, ends_in,
    limit - shown, retry, reset, start
end

ALGORITHMS[3] = function(raw, now, period, limit, cost, debt)
  local start, ends, count = fw_window(raw, now, period, limit)
  if not start then return nil, ends end
  return fw_judge(start, ends, count, now, limit, cost, debt, period, period)
end

ALGORITHMS[6] = function(raw, now, limit, cost, debt, e0, e1, e2)
  local start, ends, count = cal_window(raw, now, limit, e0, e1, e2)
  if not start then return nil, ends end
  -- The next period's length: [e1, e2)'s (the one after [e0, e1); beyond, the same).
  return fw_judge(start, ends, count, now, limit, cost, debt, 2 * (ends - start), e2 - e1)
end

-- Settle a charge made earlier (the twin of fixed_window::settle): a refund goes back into
-- the window the charge fell in (window: its start, as the decision named it) while it is
-- open, else the charge stands (true: keep the key as it is); a charge counts in full in
-- the window open now (a fresh one if none is), up to `most`, the rest forgiven. Returns
-- the state and its TTL, or false / true, then the cost units forgiven.
local function fw_settle(start, ends, count, now, limit, delta, window, most, each)
  local forgiven = 0
  if delta < 0 then
    if count == 0 or start ~= window then return true, 0, 0 end
    count = count + delta
    if count < 0 then count = 0 end
  else
    if most < count then most = count end
    count = count + delta
    if count > most then
      forgiven = count - most
      count = most
    end
  end
  if count == 0 then return false, 0, forgiven end
  return format('f:%d:%d', start, count), fw_ttl(ends, count, now, limit, each), forgiven
end

SETTLE[3] = function(raw, now, period, limit, cost, debt, p5, p6, delta, window)
  local start, ends, count = fw_window(raw, now, period, limit)
  if not start then return nil, ends end
  return fw_settle(start, ends, count, now, limit, delta, window, MAX_LEVEL, period)
end

-- The calendar window's twin of fixed_window::settle: the same, in the period containing
-- Redis' now (a calendar period's length is its own: a 23-hour day, a 28-day month),
-- holding at most one whole period of debt.
SETTLE[6] = function(raw, now, limit, cost, debt, e0, e1, e2, delta, window)
  local start, ends, count = cal_window(raw, now, limit, e0, e1, e2)
  if not start then return nil, ends end
  return fw_settle(start, ends, count, now, limit, delta, window, 2 * limit + debt, 2 * (ends - start))
end
