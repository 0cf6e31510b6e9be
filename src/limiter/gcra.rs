//! GCRA (the generic cell rate algorithm) as a pure, exact step function. Its Redis twin is
//! `lua/gcra.lua`.
//!
//! The state is one number per key: the theoretical arrival time (TAT), the moment the
//! limit would be fully available again. A request of cost `c` passes if, after pushing the
//! TAT forward by `c` emission intervals, it is no further than `burst` intervals ahead of
//! now. In the units of [`Quota`] an emission interval is `unit / per_us` µs, which need not
//! be whole: the TAT is kept as whole µs plus a remainder in `1/per_us` µs, so nothing is
//! rounded. For the same rate and burst, GCRA admits exactly the requests a token bucket
//! admits (a property test holds them side by side); it stores one number instead of two.

use super::settle::Settled;
use super::{Decision, Quota, Ruling, MAX_LEVEL};

/// The theoretical arrival time: `tat_us + frac / per_us` µs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    pub tat_us: u64,
    /// Below the quota's `per_us` (a larger one, left by a changed quota, is clamped).
    pub frac: u64,
}

/// How far ahead of `now` the TAT is, in units. Not capped at the bucket's size: a TAT
/// left by a larger quota (a reload shrank the burst or the max_delay while tokens were
/// taken ahead) is honoured, so a denial's retry is when the request will really pass, as
/// with the token bucket's level. Capped only where Lua's doubles stop being exact.
fn debt(q: &Quota, state: Option<&State>, now_us: u64) -> u64 {
    let Some(s) = state else { return 0 };
    let frac = s.frac.min(q.per_us - 1);
    let ahead = if s.tat_us >= now_us {
        u128::from(s.tat_us - now_us) * u128::from(q.per_us) + u128::from(frac)
    } else {
        0
    };
    ahead.min(u128::from(MAX_LEVEL)) as u64
}

/// Judge one request. With `max_delay`, a request that would conform within it is allowed
/// and told to wait until it does (the TAT moves for it now, so later ones wait longer).
/// With `max_debt`, a request passes at once while its TAT stays within that much past a
/// full burst (it borrows ahead), as the token bucket's level may go below empty.
pub fn decide(q: &Quota, state: Option<&State>, now_us: u64) -> Ruling<State> {
    let cap = q.capacity();
    let need = q.need();
    let borrow = q.borrow();
    let debt = debt(q, state, now_us);
    let after = debt + need;
    let allowed = after <= cap + borrow + q.slack();
    let next = State {
        tat_us: now_us + after / q.per_us,
        frac: after % q.per_us,
    };
    let drip = |d: u64| d.div_ceil(q.per_us);
    let uncharged = Decision {
        allowed,
        remaining: cap.saturating_sub(debt) / q.unit,
        retry_after_us: if allowed {
            0
        } else {
            drip(after - cap - borrow - q.slack())
        },
        reset_us: drip(debt),
        window: 0,
    };
    let charged = Decision {
        allowed,
        remaining: cap.saturating_sub(after) / q.unit,
        retry_after_us: drip(after.saturating_sub(cap + borrow)),
        reset_us: drip(after),
        window: 0,
    };
    Ruling {
        allowed,
        charged,
        uncharged,
        next,
        ttl_us: drip(after),
    }
}

/// Settle a charge made earlier (`lua/gcra.lua`'s `SETTLE`), the token bucket's twin in
/// TAT terms: `delta` more cost units push the TAT on, in full, however far past a full
/// burst (the identity's next request waits until it conforms again); given back, they
/// pull it in, exactly, to now at the latest (then no state). Only past
/// [`super::MAX_LEVEL`] units ahead, where Lua's numbers stop being exact, is the rest
/// forgiven: the second value, in cost units (rounded up).
pub fn settle(q: &Quota, state: Option<&State>, now_us: u64, delta: i64) -> (Settled<State>, u64) {
    let ahead = debt(q, state, now_us);
    let units = u128::from(delta.unsigned_abs()) * u128::from(q.unit);
    let (ahead, forgiven) = if delta < 0 {
        (
            ahead.saturating_sub(units.min(u128::from(u64::MAX)) as u64),
            0,
        )
    } else {
        let wanted = u128::from(ahead) + units;
        let most = u128::from(MAX_LEVEL);
        let over = wanted.saturating_sub(most);
        (
            wanted.min(most) as u64,
            over.div_ceil(u128::from(q.unit)) as u64,
        )
    };
    if ahead == 0 {
        return (Settled::Clear, forgiven);
    }
    let settled = Settled::Write {
        next: State {
            tat_us: now_us + ahead / q.per_us,
            frac: ahead % q.per_us,
        },
        ttl_us: ahead.div_ceil(q.per_us),
    };
    (settled, forgiven)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::tests::{quota, run};
    use crate::limiter::Algorithm::Gcra;

    #[test]
    fn burst_passes_at_once_then_one_per_interval() {
        let q = quota(Gcra, "10/s", Some(3), 1);
        let mut st: Option<State> = None;
        for left in [2, 1, 0] {
            assert_eq!(run(&q, &mut st, 0).remaining, left);
        }
        let d = run(&q, &mut st, 0);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_us, 100_000);
        assert!(!run(&q, &mut st, 99_999).allowed);
        assert!(run(&q, &mut st, 100_000).allowed);
    }

    #[test]
    fn fractional_intervals_are_exact() {
        // 3/s: an interval of 333_333.33 µs, kept as µs plus thirds.
        let q = quota(Gcra, "3/s", Some(1), 1);
        let mut st: Option<State> = None;
        assert!(run(&q, &mut st, 0).allowed);
        assert_eq!(
            st,
            Some(State {
                tat_us: 333_333,
                frac: 1
            })
        );
        assert!(!run(&q, &mut st, 333_333).allowed, "a third of a µs short");
        assert!(run(&q, &mut st, 333_334).allowed);
        // TAT = max(TAT, now) + T = 333_334 + 333_333⅓.
        assert_eq!(
            st,
            Some(State {
                tat_us: 666_667,
                frac: 1
            })
        );
    }

    #[test]
    fn cost_takes_several_intervals_and_a_denial_takes_none() {
        let q = quota(Gcra, "10/s", Some(10), 4);
        let mut st: Option<State> = None;
        assert_eq!(run(&q, &mut st, 0).remaining, 6);
        assert_eq!(run(&q, &mut st, 0).remaining, 2);
        let before = st;
        let d = run(&q, &mut st, 0);
        assert!(!d.allowed);
        assert_eq!((d.remaining, d.retry_after_us), (2, 200_000));
        assert_eq!(st, before);
    }

    #[test]
    fn idle_key_is_full_and_ttl_ends_at_the_tat() {
        let q = quota(Gcra, "2/s", Some(4), 1);
        let o = decide(&q, None, 1_000);
        assert_eq!(o.ttl_us, 500_000);
        assert_eq!(
            o.next,
            State {
                tat_us: 501_000,
                frac: 0
            }
        );
        // Past the TAT the state no longer matters: same as no state.
        assert_eq!(
            decide(&q, Some(&o.next), 501_000),
            decide(&q, None, 501_000)
        );
    }

    #[test]
    fn max_delay_moves_the_tat_ahead_for_waiting_requests() {
        let q = quota(Gcra, "4/s", Some(2), 1)
            .with_max_delay(std::time::Duration::from_secs(1))
            .unwrap();
        let mut st: Option<State> = None;
        let waits: Vec<u64> = (0..7)
            .map(|_| run(&q, &mut st, 0))
            .map(|d| {
                if d.allowed {
                    d.retry_after_us
                } else {
                    u64::MAX
                }
            })
            .collect();
        // Two at once, then four waiting 250 ms apart, then a denial.
        assert_eq!(
            waits,
            [0, 0, 250_000, 500_000, 750_000, 1_000_000, u64::MAX]
        );
        let d = run(&q, &mut st, 0);
        assert_eq!(d.retry_after_us, 250_000);
        assert_eq!(st.map(|s| s.tat_us), Some(1_500_000));
    }

    #[test]
    fn a_tat_beyond_a_shrunk_burst_is_honoured() {
        // Left by a larger quota: 1_000 s ahead. Under 1/s burst 2 a request passes once
        // the TAT is within 1 s of now: at 999 s, and the denial says so.
        let q = quota(Gcra, "1/s", Some(2), 1);
        let far = State {
            tat_us: 1_000_000_000,
            frac: 0,
        };
        let o = decide(&q, Some(&far), 0);
        assert!(!o.allowed);
        assert_eq!(o.uncharged.remaining, 0);
        assert_eq!(o.uncharged.retry_after_us, 999_000_000);
        assert_eq!(o.uncharged.reset_us, 1_000_000_000);
        assert!(!decide(&q, Some(&far), 998_999_999).allowed);
        assert!(decide(&q, Some(&far), 999_000_000).allowed);
    }
}
