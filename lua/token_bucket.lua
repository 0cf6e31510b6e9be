-- Token bucket: the twin of src/limiter/token_bucket.rs.
-- Parameters: unit (units in a token), per_us (units dripping in per µs),
--             cap (burst * unit), need (cost * unit),
--             slack (max_delay * per_us: how far below empty waiting requests may reserve).
-- State: "t:<level after the last charge>:<its time, µs>:<unit>"; gone when full again.
-- The level is below zero while tokens are reserved for requests waiting on them.

-- The bucket's level at now, in units.
local function tb_level(raw, now, unit, per_us, cap)
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
  local elapsed = now - last
  if elapsed < 0 then elapsed = 0 end
  if elapsed >= cdiv(cap - l, per_us) then return cap end
  return l + elapsed * per_us
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

ALGORITHMS[1] = function(raw, now, unit, per_us, cap, need, slack)
  local level, err = tb_level(raw, now, unit, per_us, cap)
  if not level then return nil, err end
  local after = level - need
  local allowed = after >= -slack
  local retry, value = 0, false
  if allowed then
    value = format('t:%d:%d:%d', after, now, unit)
  else
    retry = tb_drip(-slack - after, per_us)
  end
  local full = tb_drip(cap - after, per_us)
  -- An allowed request below empty waits until the bucket is back at zero.
  return allowed, value, full,
    tb_whole(after, unit), tb_drip(-after, per_us), full,
    tb_whole(level, unit), retry, tb_drip(cap - level, per_us)
end

-- Settle a charge made earlier (the twin of token_bucket::settle): delta more cost units
-- taken, down to debt cost units below empty (never raising the level), or given back,
-- exactly, up to full. Returns the state and its TTL, false when full again.
SETTLE[1] = function(raw, now, unit, per_us, cap, need, slack, delta, left, debt)
  local level, err = tb_level(raw, now, unit, per_us, cap)
  if not level then return nil, err end
  local most = cap + debt * unit
  local units = delta * unit
  if units > most then units = most elseif units < -most then units = -most end
  if units < 0 then
    level = level - units
  else
    local floor_ = -debt * unit
    if level < floor_ then floor_ = level end
    level = level - units
    if level < floor_ then level = floor_ end
  end
  if level >= cap then return false end
  return format('t:%d:%d:%d', level, now, unit), cdiv(cap - level, per_us)
end
