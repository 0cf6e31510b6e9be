//! The token bucket as a pure, exact step function. Its Redis twin is
//! `lua/token_bucket.lua`; the two must agree on every decision (tests/it/stores_agree.rs).
//!
//! A bucket holds up to `burst` tokens and refills at `rate`. It is stored as its level in
//! [`Quota`] units at the time it was last charged; tokens dripped in since then are added
//! on read. A missing bucket is full, so a bucket is dropped (its TTL ends) at the moment it
//! refills completely: the time to full refill is exactly how long its state matters.

use super::settle::Settled;
use super::{Decision, Quota, Ruling, MAX_LEVEL};

/// A bucket's state after its last charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    /// Level in units, after the charge. Below zero when requests wait for tokens already
    /// taken ahead for them (`max_delay`).
    pub level: i64,
    /// When the charge happened, in µs.
    pub last_us: u64,
    /// The quota unit the level is counted in; a changed quota rescales whole tokens.
    pub unit: u64,
}

/// The bucket's level at `now_us`, before any charge: at most the capacity, and below zero
/// only while tokens are taken ahead for waiting requests.
pub fn level_at(q: &Quota, state: Option<&State>, now_us: u64) -> i64 {
    // Capacities are validated below 2^52 at load: the casts are exact.
    let cap = q.capacity() as i64;
    let Some(s) = state else { return cap };
    let level = if s.unit == q.unit {
        s.level
    } else {
        // The quota changed (reload, plan): carry whole tokens over, drop the fraction
        // (rounding down, so a debt taken ahead is never forgiven).
        s.level
            .div_euclid(s.unit.max(1) as i64)
            .saturating_mul(q.unit as i64)
    }
    // A debt deeper than Lua's numbers hold exactly was never written: clamped as
    // settling clamps it.
    .clamp(cap - MAX_LEVEL as i64, cap);
    let elapsed = now_us.saturating_sub(s.last_us);
    let dripped = i128::from(elapsed) * i128::from(q.per_us);
    (i128::from(level) + dripped).min(i128::from(cap)) as i64
}

/// Judge one request of `q.cost` against the bucket at `now_us`. With `max_delay`, a
/// request whose tokens drip in within it is allowed and told to wait that long; its
/// tokens are taken now, so requests waiting behind it wait longer: they pass in order.
/// With `max_debt` (a rule that settles by a reported cost), a request passes while it
/// leaves the bucket at most that far below empty: it borrows ahead, and waits only
/// beyond that.
///
/// A clock stepped back (a Redis failover, an NTP step) never moves the state's time
/// back: the bucket is judged as it stood at its last charge, and every wait is counted
/// from `now_us`, so the stretch stepped over is never refilled twice.
pub fn decide(q: &Quota, state: Option<&State>, now_us: u64) -> Ruling<State> {
    let cap = q.capacity() as i64;
    let need = q.need() as i64;
    let slack = q.slack() as i64;
    let borrow = q.borrow() as i64;
    let at = at(state, now_us);
    let skew = at - now_us;
    let level = level_at(q, state, at);
    let after = level - need;
    let allowed = after >= -slack - borrow;
    // Time for `units` more to drip in, counted from now.
    let drip = |units: i64| skew + (units.max(0) as u64).div_ceil(q.per_us);
    let until_full = |level: i64| drip(cap - level);
    let whole = |level: i64| level.max(0) as u64 / q.unit;
    Ruling {
        allowed,
        charged: Decision {
            allowed,
            remaining: whole(after),
            // Waiting until the bucket is back at what may be borrowed: the tokens are
            // then there.
            retry_after_us: if after >= -borrow {
                0
            } else {
                drip(-borrow - after)
            },
            reset_us: until_full(after),
            window: 0,
        },
        uncharged: Decision {
            allowed,
            remaining: whole(level),
            retry_after_us: if allowed {
                0
            } else {
                drip(-slack - borrow - after)
            },
            reset_us: until_full(level),
            window: 0,
        },
        next: State {
            level: after,
            last_us: at,
            unit: q.unit,
        },
        // A missing bucket is full: the state matters until the bucket refills.
        ttl_us: until_full(after),
    }
}

/// The time a bucket is judged at: `now_us`, or its last charge's if the clock stepped
/// back before it.
fn at(state: Option<&State>, now_us: u64) -> u64 {
    state.map_or(now_us, |s| now_us.max(s.last_us))
}

/// Settle a charge made earlier (`lua/token_bucket.lua`'s `SETTLE`): `delta` more cost
/// units taken, in full, however far below empty that takes the bucket (the identity's
/// next request waits until it has dripped back), or given back, exactly, up to full (a
/// full bucket is no state). Only past [`super::MAX_LEVEL`] units below a full bucket,
/// where Lua's numbers stop being exact, is the rest forgiven: the second value, in cost
/// units (rounded up). Never moves the state's time back.
pub fn settle(q: &Quota, state: Option<&State>, now_us: u64, delta: i64) -> (Settled<State>, u64) {
    let cap = q.capacity() as i64;
    let at = at(state, now_us);
    let skew = at - now_us;
    let level = level_at(q, state, at);
    let floor = cap - MAX_LEVEL as i64;
    let units = i128::from(delta) * i128::from(q.unit);
    let wanted = i128::from(level) - units;
    let level = wanted.clamp(i128::from(floor), i128::from(cap)) as i64;
    let forgiven = if wanted < i128::from(floor) {
        ((i128::from(floor) - wanted) as u128).div_ceil(u128::from(q.unit)) as u64
    } else {
        0
    };
    if level >= cap {
        return (Settled::Clear, forgiven);
    }
    let settled = Settled::Write {
        next: State {
            level,
            last_us: at,
            unit: q.unit,
        },
        ttl_us: skew + ((cap - level) as u64).div_ceil(q.per_us),
    };
    (settled, forgiven)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm::TokenBucket;

    fn quota(count: u64, secs: u64, burst: u64, cost: u64) -> Quota {
        crate::limiter::tests::quota(TokenBucket, &format!("{count}/{secs}s"), Some(burst), cost)
    }

    /// Runs one request at `now` and commits it when allowed, like a store does.
    fn hit(q: &Quota, state: &mut Option<State>, now: u64) -> Decision {
        crate::limiter::tests::run(q, state, now)
    }

    #[test]
    fn burst_passes_at_once_then_denies() {
        let q = quota(10, 1, 5, 1);
        let mut st = None;
        for left in (0..5).rev() {
            let d = hit(&q, &mut st, 0);
            assert!(d.allowed);
            assert_eq!(d.remaining, left);
        }
        let d = hit(&q, &mut st, 0);
        assert!(!d.allowed);
        assert_eq!(d.remaining, 0);
        // One token every 100 ms.
        assert_eq!(d.retry_after_us, 100_000);
        assert_eq!(d.reset_us, 500_000);
    }

    #[test]
    fn refill_is_exact_for_rates_that_do_not_divide_a_second() {
        // 3/s: a token every 333_333.33 µs. Float arithmetic drifts; units do not.
        let q = quota(3, 1, 2, 1);
        let mut st = None;
        assert!(hit(&q, &mut st, 0).allowed);
        assert!(hit(&q, &mut st, 0).allowed);
        let d = hit(&q, &mut st, 333_333);
        assert!(!d.allowed, "a token is not whole before 333_333.33 µs");
        assert_eq!(d.retry_after_us, 1);
        // For 3_000 s, ask at the exact µs each token completes: every one passes, and a
        // second request at the same instant never does.
        for k in 1..=9_000u64 {
            let t = (k * 1_000_000).div_ceil(3);
            assert!(hit(&q, &mut st, t).allowed, "token {k} at {t} µs");
            assert!(!hit(&q, &mut st, t).allowed, "no extra token at {t} µs");
        }
    }

    #[test]
    fn idle_bucket_refills_to_burst_and_no_more() {
        let q = quota(1, 1, 3, 1);
        let mut st = None;
        for _ in 0..3 {
            assert!(hit(&q, &mut st, 0).allowed);
        }
        let d = hit(&q, &mut st, 3_600_000_000);
        assert!(d.allowed);
        assert_eq!(d.remaining, 2, "an hour idle still caps at burst");
    }

    #[test]
    fn ttl_is_time_to_full_refill() {
        let q = quota(2, 1, 4, 1);
        let o = decide(&q, None, 10);
        let (state, ttl) = (o.next, o.ttl_us);
        assert_eq!(ttl, 500_000, "one token at 2/s refills in 0.5 s");
        assert_eq!(level_at(&q, Some(&state), 10 + ttl), q.capacity() as i64);
        assert!(level_at(&q, Some(&state), 10 + ttl - 1) < q.capacity() as i64);
    }

    #[test]
    fn cost_above_one_takes_several_tokens() {
        let q = quota(10, 1, 10, 4);
        let mut st = None;
        assert_eq!(hit(&q, &mut st, 0).remaining, 6);
        assert_eq!(hit(&q, &mut st, 0).remaining, 2);
        let d = hit(&q, &mut st, 0);
        assert!(!d.allowed);
        assert_eq!(d.remaining, 2, "a denied request takes nothing");
        assert_eq!(d.retry_after_us, 200_000, "two more tokens at 10/s");
    }

    #[test]
    fn clock_going_back_refills_nothing() {
        let q = quota(1, 1, 1, 1);
        let mut st = None;
        assert!(hit(&q, &mut st, 5_000_000).allowed);
        assert!(!hit(&q, &mut st, 1_000_000).allowed);
    }

    #[test]
    fn changed_quota_carries_whole_tokens() {
        let old = quota(1, 1, 10, 1);
        let new = quota(1, 2, 10, 1);
        assert_ne!(old.unit, new.unit);
        let st = State {
            level: (4 * old.unit + old.unit / 2) as i64,
            last_us: 0,
            unit: old.unit,
        };
        assert_eq!(level_at(&new, Some(&st), 0), (4 * new.unit) as i64);
    }

    #[test]
    fn max_delay_takes_tokens_ahead_in_order_then_denies() {
        // 10/s, burst 1, max_delay 500 ms: one now, then five that wait 100..500 ms.
        let q = quota(10, 1, 1, 1)
            .with_max_delay(std::time::Duration::from_millis(500))
            .unwrap();
        let mut st = None;
        let d = hit(&q, &mut st, 0);
        assert!(d.allowed && d.retry_after_us == 0);
        for k in 1..=5u64 {
            let d = hit(&q, &mut st, 0);
            assert!(d.allowed, "request {k} waits");
            assert_eq!(
                d.retry_after_us,
                k * 100_000,
                "served in order, 100 ms apart"
            );
            assert_eq!(d.remaining, 0);
        }
        let d = hit(&q, &mut st, 0);
        assert!(!d.allowed, "past max_delay: denied");
        assert_eq!(
            d.retry_after_us, 100_000,
            "until a wait of 500 ms is enough again"
        );
        // 100 ms later the queue has moved by one: one more may wait 500 ms.
        let d = hit(&q, &mut st, 100_000);
        assert!(d.allowed);
        assert_eq!(d.retry_after_us, 500_000);
        assert!(!hit(&q, &mut st, 100_000).allowed);
        // The debt taken ahead drains at the rate: back at zero 600 ms after the start.
        assert_eq!(st.map(|s| s.level), Some(-5 * q.unit as i64));
        assert_eq!(level_at(&q, st.as_ref(), 600_000), 0);
        assert_eq!(level_at(&q, st.as_ref(), 700_000), q.unit as i64);
    }

    #[test]
    fn a_debt_taken_ahead_survives_a_unit_change() {
        let old = quota(1, 1, 10, 1);
        let new = quota(1, 2, 10, 1);
        let st = State {
            level: -(old.unit as i64) - 1,
            last_us: 0,
            unit: old.unit,
        };
        // -1.000001 tokens rounds down to -2: a debt is never forgiven.
        assert_eq!(level_at(&new, Some(&st), 0), -2 * new.unit as i64);
    }

    #[test]
    fn denied_with_uncharged_rules_reports_their_untouched_level() {
        let q = quota(1, 60, 5, 1);
        let d = decide(&q, None, 0).uncharged;
        assert!(d.allowed);
        assert_eq!(d.remaining, 5);
        assert_eq!(d.reset_us, 0);
    }
}
