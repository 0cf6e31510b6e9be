-- Sliding window (two-window weighted counter): the twin of src/limiter/sliding_window.rs.
-- Parameters: p (period, µs), n (the rate's N), cost.
-- State: "s:<window index now/p>:<its count>:<the previous window's count>".

-- The stored window, count and previous count, as written (nil window when none).
local function sw_state(raw)
  if not (raw and sub(raw, 1, 2) == 's:') then
    if raw and not ours(raw) then return nil, 'not a ratewall state' end
    return false
  end
  local sw, sc, sp = match(raw, '^s:(%d+):(%d+):(%d+)$')
  sw, sc, sp = tonumber(sw), tonumber(sc), tonumber(sp)
  if not (sw and sc and sp) then return nil, 'corrupt sliding window state' end
  return sw, sc, sp
end

-- Requests left with `c` in the current window: what the weighted count leaves of N·p.
local function sw_remaining(budget, wprev, c, p)
  local left = budget - (wprev + c * p)
  if left < 0 then left = 0 end
  return idiv(left, p)
end

-- When a count of `c` in the current window (and `prev` before it) has slid out.
local function sw_reset(c, prev, p, e, skew)
  if c > 0 then return 2 * p - e + skew elseif prev > 0 then return p - e + skew else return 0 end
end

ALGORITHMS[4] = function(raw, now, p, n, cost)
  local sw, sc, sp = sw_state(raw)
  if sw == nil then return nil, sc end
  -- The windows never move backwards: before the state's window (a clock stepped back),
  -- decide at its start; waits still count from now.
  local at = now
  if sw and at < sw * p then at = sw * p end
  local skew = at - now
  local w = idiv(at, p)
  local e = at - w * p
  local prev, cur = 0, 0
  if sw == w then
    prev, cur = sp, sc
  elseif sw and sw + 1 == w then
    prev, cur = sc, 0
  end
  if prev > n then prev = n end
  if cur > n then cur = n end
  local budget = n * p
  local wprev = prev * (p - e)
  local allowed = wprev + cur * p + cost * p <= budget
  local retry, value = 0, false
  if allowed then
    value = format('s:%d:%d:%d', w, cur + cost, prev)
  elseif cur + cost <= n then
    retry = (p - idiv((n - cur - cost) * p, prev)) - e + skew
  else
    retry = (p - e) + (p - idiv((n - cost) * p, cur)) + skew
  end
  return allowed, value, 2 * p - e + skew,
    sw_remaining(budget, wprev, cur + cost, p), 0, sw_reset(cur + cost, prev, p, e, skew),
    sw_remaining(budget, wprev, cur, p), retry, sw_reset(cur, prev, p, e, skew)
end

-- Settle a charge made earlier (the twin of sliding_window::settle): a refund goes back
-- into the window the charge fell in while it is the current one (left: µs until the end
-- of the window after it, the charged decision's reset; nil: the state's window, while it
-- still weighs), else the charge stands (true: keep); a charge counts in the current
-- window, up to debt past N.
SETTLE[4] = function(raw, now, p, n, cost, p4, p5, delta, left, debt)
  local sw, sc, sp = sw_state(raw)
  if sw == nil then return nil, sc end
  local at = now
  if sw and at < sw * p then at = sw * p end
  local w = idiv(at, p)
  if delta < 0 then
    if not sw then return true end
    local open
    if left then
      open = sw == w and same_window((sw + 2) * p, now, left, p)
    else
      open = sw + 1 >= w
    end
    if not open or sc == 0 then return true end
    sc = sc + delta
    if sc < 0 then sc = 0 end
    if sc == 0 and sp == 0 then return false end
    return format('s:%d:%d:%d', sw, sc, sp), (sw + 2) * p - now
  end
  local prev, cur = 0, 0
  if sw == w then
    prev, cur = sp, sc
  elseif sw and sw + 1 == w then
    prev, cur = sc, 0
  end
  cur = charged(cur, delta, n + debt)
  return format('s:%d:%d:%d', w, cur, prev), (w + 2) * p - now
end
