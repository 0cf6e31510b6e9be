-- GCRA: the twin of src/limiter/gcra.rs.
-- Parameters: as the token bucket's (unit, per_us, cap, need, slack, borrow).
-- State: the theoretical arrival time "g:<µs>" or "g:<µs>:<remainder in 1/per_us µs>".

-- How far the TAT is ahead of now, in units. Not capped at the bucket's size: a TAT left
-- by a larger quota is honoured, so a denial's retry is when the request really passes.
-- Capped only at MAX_LEVEL (2^52), where doubles stop being exact.
local function gcra_debt(raw, now, per_us, cap)
  if not (raw and sub(raw, 1, 2) == 'g:') then
    if raw and not ours(raw) then return nil, 'not a ratewall state' end
    return 0
  end
  local tat, frac = match(raw, '^g:(%d+):(%d+)$')
  if not tat then
    tat, frac = match(raw, '^g:(%d+)$'), '0'
  end
  tat, frac = tonumber(tat), tonumber(frac)
  if not (tat and frac) then return nil, 'corrupt gcra state' end
  if frac > per_us - 1 then frac = per_us - 1 end
  if tat < now then return 0 end
  local ahead = tat - now
  if ahead >= cdiv(cap, per_us) then return cap end
  local debt = ahead * per_us + frac
  if debt > cap then debt = cap end
  return debt
end

-- The state for a TAT `debt` units after now.
local function gcra_value(now, per_us, debt)
  local us = idiv(debt, per_us)
  local frac = debt - us * per_us
  if frac == 0 then return format('g:%d', now + us) end
  return format('g:%d:%d', now + us, frac)
end

ALGORITHMS[2] = function(raw, now, unit, per_us, cap, need, slack, borrow)
  local debt, err = gcra_debt(raw, now, per_us, MAX_LEVEL)
  if not debt then return nil, err end
  local after = debt + need
  local allowed = after <= cap + borrow + slack
  local retry, value = 0, false
  if allowed then
    value = gcra_value(now, per_us, after)
  else
    retry = cdiv(after - cap - borrow - slack, per_us)
  end
  -- An allowed request past the burst and what it may borrow waits until it conforms.
  local wait = 0
  if after > cap + borrow then wait = cdiv(after - cap - borrow, per_us) end
  local left = cap - after
  if left < 0 then left = 0 end
  local avail = cap - debt
  if avail < 0 then avail = 0 end
  local ttl = cdiv(after, per_us)
  return allowed, value, ttl,
    idiv(left, unit), wait, ttl,
    idiv(avail, unit), retry, cdiv(debt, per_us), 0
end

-- Settle a charge made earlier (the twin of gcra::settle): delta more cost units push the
-- TAT on, in full (but MAX_LEVEL units ahead, past which the rest is forgiven); given
-- back, they pull it in, exactly, to now at the latest (then no state). Returns the state
-- and its TTL (false when none is left), and the cost units forgiven.
SETTLE[2] = function(raw, now, unit, per_us, cap, need, slack, borrow, delta, window)
  local ahead, err = gcra_debt(raw, now, per_us, MAX_LEVEL)
  if not ahead then return nil, err end
  local forgiven = 0
  if delta < 0 then
    if -delta >= cdiv(ahead, unit) then
      ahead = 0
    else
      ahead = ahead + delta * unit
    end
  else
    -- Past MAX_LEVEL ahead the rest is forgiven: ceil((delta·unit - room) / unit), which
    -- is delta - floor(room / unit), computed without the product.
    local room = MAX_LEVEL - ahead
    local fits = idiv(room, unit)
    if delta > fits then
      forgiven = delta - fits
      ahead = MAX_LEVEL
    else
      ahead = ahead + delta * unit
    end
  end
  if ahead == 0 then return false, 0, forgiven end
  return gcra_value(now, per_us, ahead), cdiv(ahead, per_us), forgiven
end
