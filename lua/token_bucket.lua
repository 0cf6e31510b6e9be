-- Token bucket: the twin of src/limiter/token_bucket.rs.
-- Parameters: unit (units in a token), per_us (units dripping in per µs),
--             cap (burst * unit), need (cost * unit),
--             slack (max_delay * per_us: how far below empty waiting requests may reserve).
-- State: "t:<level after the last charge>:<its time, µs>:<unit>"; gone when full again.
-- The level is below zero while tokens are reserved for requests waiting on them.

-- The bucket's level at now, in units.
local function tb_level(raw, now, unit, per_us, cap)
  if not (raw and string.sub(raw, 1, 2) == 't:') then
    if raw and not ours(raw) then return nil, 'not a ratewall state' end
    return cap
  end
  local l, last, u = string.match(raw, '^t:(%-?%d+):(%d+):(%d+)$')
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

ALGORITHMS[1] = function(raw, now, unit, per_us, cap, need, slack)
  local level, err = tb_level(raw, now, unit, per_us, cap)
  if not level then return nil, err end
  local after = level - need
  local allowed = after >= -slack
  -- Time for `units` more to drip in.
  local function drip(units)
    if units <= 0 then return 0 end
    return cdiv(units, per_us)
  end
  local function whole(l)
    if l <= 0 then return 0 end
    return idiv(l, unit)
  end
  local retry = 0
  if not allowed then retry = drip(-slack - after) end
  return {
    allowed = allowed,
    -- An allowed request below empty waits until the bucket is back at zero.
    charged = { whole(after), drip(-after), drip(cap - after) },
    uncharged = { whole(level), retry, drip(cap - level) },
    value = string.format('t:%d:%d:%d', after, now, unit),
    ttl = drip(cap - after),
  }
end

-- Give back what a charge took. Returns the state and its TTL, or false when full again.
REFUNDS[1] = function(raw, now, unit, per_us, cap, need)
  local level, err = tb_level(raw, now, unit, per_us, cap)
  if not level then return nil, err end
  level = level + need
  if level >= cap then return false end
  return string.format('t:%d:%d:%d', level, now, unit), cdiv(cap - level, per_us)
end
