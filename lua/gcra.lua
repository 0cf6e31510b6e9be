-- GCRA: the twin of src/limiter/gcra.rs.
-- Parameters: as the token bucket's (unit, per_us, cap, need).
-- State: the theoretical arrival time "g:<µs>" or "g:<µs>:<remainder in 1/per_us µs>".
ALGORITHMS[2] = function(raw, now, unit, per_us, cap, need)
  local debt = 0
  if raw and string.sub(raw, 1, 2) == 'g:' then
    local tat, frac = string.match(raw, '^g:(%d+):(%d+)$')
    if not tat then
      tat, frac = string.match(raw, '^g:(%d+)$'), '0'
    end
    tat, frac = tonumber(tat), tonumber(frac)
    if not (tat and frac) then return nil, 'corrupt gcra state' end
    if frac > per_us - 1 then frac = per_us - 1 end
    if tat >= now then
      local ahead = tat - now
      if ahead >= cdiv(cap, per_us) then
        debt = cap
      else
        debt = ahead * per_us + frac
        if debt > cap then debt = cap end
      end
    end
  elseif raw and not ours(raw) then
    return nil, 'not a ratewall state'
  end
  local after = debt + need
  local allowed = after <= cap
  local retry = 0
  if not allowed then retry = cdiv(after - cap, per_us) end
  local left = cap - after
  if left < 0 then left = 0 end
  local tat_us = idiv(after, per_us)
  local frac = after - tat_us * per_us
  local value
  if frac == 0 then
    value = string.format('g:%d', now + tat_us)
  else
    value = string.format('g:%d:%d', now + tat_us, frac)
  end
  return {
    allowed = allowed,
    charged = { idiv(left, unit), 0, cdiv(after, per_us) },
    uncharged = { idiv(cap - debt, unit), retry, cdiv(debt, per_us) },
    value = value,
    ttl = cdiv(after, per_us),
  }
end

