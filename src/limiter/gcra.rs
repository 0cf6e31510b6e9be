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

use super::{Decision, Outcome, Quota};

/// The theoretical arrival time: `tat_us + frac / per_us` µs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    pub tat_us: u64,
    /// Below the quota's `per_us` (a larger one, left by a changed quota, is clamped).
    pub frac: u64,
}

/// How far ahead of `now` the TAT is, in units, capped at the bucket's size.
fn debt(q: &Quota, state: Option<&State>, now_us: u64) -> u64 {
    let Some(s) = state else { return 0 };
    let frac = s.frac.min(q.per_us - 1);
    let ahead = if s.tat_us >= now_us {
        u128::from(s.tat_us - now_us) * u128::from(q.per_us) + u128::from(frac)
    } else {
        0
    };
    ahead.min(u128::from(q.capacity())) as u64
}

pub fn decide(q: &Quota, state: Option<&State>, now_us: u64) -> Outcome<State> {
    let cap = q.capacity();
    let need = q.need();
    let debt = debt(q, state, now_us);
    let allowed = debt + need <= cap;
    let after = debt + need;
    let next = State {
        tat_us: now_us + after / q.per_us,
        frac: after % q.per_us,
    };
    let reset = |d: u64| d.div_ceil(q.per_us);
    let uncharged = Decision {
        allowed,
        remaining: (cap - debt) / q.unit,
        retry_after_us: if allowed {
            0
        } else {
            (after - cap).div_ceil(q.per_us)
        },
        reset_us: reset(debt),
    };
    let charged = Decision {
        allowed,
        remaining: cap.saturating_sub(after) / q.unit,
        retry_after_us: 0,
        reset_us: reset(after),
    };
    Outcome {
        allowed,
        charged,
        uncharged,
        next,
        ttl_us: reset(after),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::tests::quota;
    use crate::limiter::Decision;

    fn run(q: &Quota, st: &mut Option<State>, now: u64) -> Decision {
        crate::limiter::tests::run(q, st, now)
    }
    use crate::limiter::Algorithm::Gcra;

    #[test]
    fn burst_passes_at_once_then_one_per_interval() {
        let q = quota(Gcra, "10/s", Some(3), 1);
        let mut st = None;
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
        let mut st = None;
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
        let mut st = None;
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
    fn a_tat_beyond_a_shrunk_burst_is_capped() {
        let q = quota(Gcra, "1/s", Some(2), 1);
        let far = State {
            tat_us: 1_000_000_000,
            frac: 0,
        };
        let o = decide(&q, Some(&far), 0);
        assert!(!o.allowed);
        assert_eq!(o.uncharged.remaining, 0);
        assert_eq!(o.uncharged.retry_after_us, 1_000_000);
    }
}
