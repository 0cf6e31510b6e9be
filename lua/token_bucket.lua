-- Token bucket: the twin of src/limiter/token_bucket.rs.
-- Parameters: unit (units in a token), per_us (units dripping in per µs),
--             cap (burst * unit), need (cost * unit),
--             slack (max_delay * per_us: how far below what may be borrowed waiting
--             requests may reserve), borrow (max_debt * unit: how far below empty a
--             request may take the bucket and still pass at once).
-- State: "t:<level after the last charge>:<its time, µs>:<unit>"; gone when full again.
-- The level is below zero while tokens are reserved for requests waiting on them, or
-- borrowed, or owed for costs reported above their reservations. Its time never moves
-- back: before it (Redis' clock stepped back), the bucket is judged as it stood then, and
-- every wait is counted from now.

-- The bucket's level at `at`, in units.
local function tb_level(raw, at, unit, per_us, cap)
  if not (raw and sub(raw, 1, 2) == 't:') then
    if raw and not ours(raw) then return nil, 'not a ratewall state' end
    return cap
  end
  local l, last, u = match(raw, '^t:(%-?%d+):(%d+):(%d+)$')
  l, last, u = tonumber(l), tonumber(last), tonumber(u)
  if not (l and last and u and u > 0) then return nil, 'corrupt token bucket state' end
  -- A changed quota carries whole tokens over (a reserved debt rounds away from zero).
  if u ~= unit then l = idiv(l, u) * unit end
  if l > cap then l = cap end
  if l < cap - MAX_LEVEL then l = cap - MAX_LEVEL end
  local elapsed = at - last
  if elapsed < 0 then elapsed = 0 end
  if elapsed >= cdiv(cap - l, per_us) then return cap end
  return l + elapsed * per_us
end

-- The time a bucket is judged at: now, or its last charge's if the clock stepped back.
local function tb_at(raw, now)
  if raw and sub(raw, 1, 2) == 't:' then
    local last = tonumber(match(raw, '^t:%-?%d+:(%d+):'))
    if last and last > now then return last end
  end
  return now
end

-- Time for `units` more to drip in.
local function tb_drip(units, per_us)
  if units <= 0 then return 0 end
  return cdiv(units, per_us)
end

-- Whole tokens in a level.
local function tb_whole(l, unit)
  if l <= 0 then return 0 end
  return idiv(l, unit)
end

ALGORITHMS[1] = function(raw, now, unit, per_us, cap, need, slack, borrow)
  local at = tb_at(raw, now)
  local skew = at - now
  local level, err = tb_level(raw, at, unit, per_us, cap)
  if not level then return nil, err end
  local after = level - need
  local allowed = after >= -slack - borrow
  local retry, value = 0, false
  if allowed then
    value = format('t:%d:%d:%d', after, at, unit)
  else
    retry = skew + tb_drip(-slack - borrow - after, per_us)
  end
  local full = skew + tb_drip(cap - after, per_us)
  -- An allowed request below what may be borrowed waits until the bucket is back there.
  local wait = 0
  if after < -borrow then wait = skew + tb_drip(-borrow - after, per_us) end
  return allowed, value, full,
    tb_whole(after, unit), wait, full,
    tb_whole(level, unit), retry, skew + tb_drip(cap - level, per_us), 0
end

-- Settle a charge made earlier (the twin of token_bucket::settle): delta more cost units
-- taken, in full, however far below empty (but MAX_LEVEL below full, past which the rest
-- is forgiven), or given back, exactly, up to full. Returns the state and its TTL (false
-- when full again), and the cost units forgiven.
SETTLE[1] = function(raw, now, unit, per_us, cap, need, slack, borrow, delta, window)
  local at = tb_at(raw, now)
  local level, err = tb_level(raw, at, unit, per_us, cap)
  if not level then return nil, err end
  local floor_ = cap - MAX_LEVEL
  -- A delta past what any level holds is clamped first: its product stays exact.
  local most = MAX_LEVEL + cap
  local d = delta
  local over = 0
  if d > 0 and d * unit > most then
    over = d - idiv(most, unit)
    d = idiv(most, unit)
  elseif d < 0 and -d * unit > most then
    d = -idiv(most, unit)
  end
  local wanted = level - d * unit
  local forgiven = 0
  if wanted < floor_ then
    forgiven = cdiv(floor_ - wanted, unit) + over
    wanted = floor_
  elseif over > 0 then
    forgiven = over
  end
  if wanted >= cap then return false, 0, forgiven end
  return format('t:%d:%d:%d', wanted, at, unit), (at - now) + cdiv(cap - wanted, per_us), forgiven
end
