-- Sliding window (two-window weighted counter): the twin of src/limiter/sliding_window.rs.
-- Parameters: p (period, µs), n (the rate's N), cost, debt (max_debt: how far past N a
-- request may still be admitted).
-- State: "s:<window index now/p>:<its count>:<the previous window's count>".
-- A window's count past N (costs reported above their reservations, or what debt let a
-- request borrow) is carried into the windows after it, N paid by each: the next window
-- sees N as its previous one's count and the rest as its own, and so on.

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

-- The counts of window w as the state leaves them: prev, cur (debts carried on).
local function sw_counts(sw, sc, sp, w, n)
  if sw == w then
    if sp > n then sp = n end
    return sp, sc
  elseif sw and sw < w then
    local k = w - sw
    local prev = carried(sc, n, k - 1)
    if prev > n then prev = n end
    return prev, carried(sc, n, k)
  end
  return 0, 0
end

-- µs from now to the start of window x, at most MAX_LEVEL.
local function sw_until(x, p, now)
  if x > idiv(now + MAX_LEVEL, p) then return MAX_LEVEL end
  local t = x * p - now
  if t < 0 then return 0 end
  if t > MAX_LEVEL then return MAX_LEVEL end
  return t
end

-- The window in which a count of c in window w (and prev before it) weighs nothing.
local function sw_clear(w, n, c, prev)
  if c > 0 then return w + cdiv(c, n) + 1 end
  if prev > 0 then return w + 1 end
  return nil
end

-- How long a state of c in window w matters: through the next window at least.
local function sw_ttl(w, p, n, c, now)
  local clear = sw_clear(w, n, c, 0) or w
  if clear < w + 2 then clear = w + 2 end
  return sw_until(clear, p, now)
end

ALGORITHMS[4] = function(raw, now, p, n, cost, debt)
  local sw, sc, sp = sw_state(raw)
  if sw == nil then return nil, sc end
  -- The windows never move backwards: before the state's window (a clock stepped back),
  -- decide at its start; waits still count from now.
  local at = now
  if sw and at < sw * p then at = sw * p end
  local skew = at - now
  local w = idiv(at, p)
  local e = at - w * p
  local prev, cur = sw_counts(sw, sc, sp, w, n)
  local most = n + debt
  local budget = n * p
  local wprev = prev * (p - e)
  -- Past `most` a count denies whatever its size: clamped, the products stay exact.
  local function used(c)
    if c > most then c = most end
    return wprev + c * p
  end
  local function remaining(c)
    local left = budget - used(c)
    if left < 0 then return 0 end
    return idiv(left, p)
  end
  local function reset(c)
    local clear = sw_clear(w, n, c, prev)
    if not clear then return 0 end
    return sw_until(clear, p, now)
  end
  local allowed = used(cur) + cost * p <= most * p
  local retry, value, ttl = 0, false, 0
  if allowed then
    value = format('s:%d:%d:%d', w, cur + cost, prev)
    ttl = sw_ttl(w, p, n, cur + cost, now)
  elseif cur + cost <= most then
    -- Within this window, once enough of prev has slid out.
    retry = (p - idiv((most - cur - cost) * p, prev)) - e + skew
  else
    -- In the first window on whose carried count the request fits.
    local k = cdiv(cur + cost - most, n)
    if k < 1 then k = 1 end
    local prev_k = carried(cur, n, k - 1)
    if prev_k > n then prev_k = n end
    local cur_k = carried(cur, n, k)
    local e_pass = 0
    if prev_k > 0 then
      e_pass = p - idiv((most - cur_k - cost) * p, prev_k)
      if e_pass < 0 then e_pass = 0 end
    end
    retry = sw_until(w + k, p, now) + e_pass
    if retry > MAX_LEVEL then retry = MAX_LEVEL end
  end
  return allowed, value, ttl,
    remaining(cur + cost), 0, reset(cur + cost),
    remaining(cur), retry, reset(cur), w
end

-- Settle a charge made earlier (the twin of sliding_window::settle): a refund goes back
-- into the window the charge fell in (window: its index, as the decision named it) while
-- it is the current one, else the charge stands (true: keep); a charge counts in full in
-- the current window (up to MAX_LEVEL, the rest forgiven). Returns the state and its TTL,
-- or false / true, then the cost units forgiven.
SETTLE[4] = function(raw, now, p, n, cost, debt, p5, p6, delta, window)
  local sw, sc, sp = sw_state(raw)
  if sw == nil then return nil, sc end
  local at = now
  if sw and at < sw * p then at = sw * p end
  local w = idiv(at, p)
  if delta < 0 then
    if not (sw and sw == w and w == window) or sc == 0 then return true, 0, 0 end
    sc = sc + delta
    if sc < 0 then sc = 0 end
    if sc == 0 and sp == 0 then return false, 0, 0 end
    return format('s:%d:%d:%d', sw, sc, sp), sw_ttl(w, p, n, sc, now), 0
  end
  local prev, cur = sw_counts(sw, sc, sp, w, n)
  cur = cur + delta
  local forgiven = 0
  if cur > MAX_LEVEL then
    forgiven = cur - MAX_LEVEL
    cur = MAX_LEVEL
  end
  return format('s:%d:%d:%d', w, cur, prev), sw_ttl(w, p, n, cur, now), forgiven
end
