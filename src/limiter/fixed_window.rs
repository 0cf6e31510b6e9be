//! Fixed window as a pure step function. Its Redis twin is `lua/fixed_window.lua`.
//!
//! A window opens at the first request of a key and lasts one period; it admits the rate's
//! N (in cost units) and then denies until it ends. The state is the window's start and its
//! count, and the key's TTL is the window's end, set in the same atomic step as the count.
//!
//! A window's start is the latest time its state knows: a request timed before it (a clock
//! stepped back) is decided at it, so a step back never opens a fresh window.
//!
//! The boundary effect: N requests at the end of one window and N at the start of the next
//! pass within moments of each other — up to 2N in a short interval. Choose it for coarse
//! quotas (per day, per month), where the simplicity and the tiny state matter more.

use super::settle::{same_window, Adjust, Settled};
use super::{Decision, Outcome, Quota};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    pub start_us: u64,
    pub count: u64,
}

pub fn decide(q: &Quota, state: Option<&State>, now_us: u64) -> Outcome<State> {
    let period = q.period_us();
    let limit = q.rate.count;
    // A window never moves backwards: a request timed before its start (the clock stepped
    // back — a Redis failover, an NTP step) is decided at the start, inside the window,
    // not as the first request of a fresh one. Its waits are then counted from `now_us`.
    let at = state.map_or(now_us, |s| now_us.max(s.start_us));
    let live = state.filter(|s| at < s.start_us.saturating_add(period));
    let (start_us, count) = live.map_or((at, 0), |s| (s.start_us, s.count));
    // Never below `now_us`: a fresh window starts at it, a live one at or after it.
    let ends_in = start_us + period - now_us;
    let allowed = count + q.cost <= limit;
    let next = State {
        start_us,
        count: count + q.cost,
    };
    Outcome {
        allowed,
        charged: Decision {
            allowed,
            remaining: limit.saturating_sub(next.count),
            retry_after_us: 0,
            reset_us: ends_in,
        },
        uncharged: Decision {
            allowed,
            remaining: limit - count.min(limit),
            retry_after_us: if allowed { 0 } else { ends_in },
            reset_us: if count == 0 { 0 } else { ends_in },
        },
        next,
        ttl_us: ends_in,
    }
}

/// Settle a charge made earlier (`lua/fixed_window.lua`'s `SETTLE`). A refund goes back
/// into the window the charge fell in while it is open (else the charge stands); a charge
/// counts in the window open now (a fresh one if none is), up to `max_debt` past N.
pub fn settle(q: &Quota, state: Option<&State>, now_us: u64, adj: Adjust) -> Settled<State> {
    let period = q.period_us();
    let at = state.map_or(now_us, |s| now_us.max(s.start_us));
    let live = state.filter(|s| at < s.start_us.saturating_add(period));
    let (start_us, count) = live.map_or((at, 0), |s| (s.start_us, s.count));
    let ends_in = start_us + period - now_us;
    let count = if adj.delta < 0 {
        let charged_here = adj
            .left_us
            .is_none_or(|left| same_window(start_us + period, now_us, left, period));
        if count == 0 || !charged_here {
            return Settled::Keep;
        }
        count.saturating_sub(adj.delta.unsigned_abs())
    } else {
        let most = q.rate.count + q.max_debt;
        (count + adj.delta.unsigned_abs().min(most)).min(count.max(most))
    };
    if count == 0 {
        return Settled::Clear;
    }
    Settled::Write {
        next: State { start_us, count },
        ttl_us: ends_in,
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
    use crate::limiter::Algorithm::FixedWindow;

    #[test]
    fn window_starts_at_the_first_request() {
        let q = quota(FixedWindow, "3/10s", None, 1);
        let mut st = None;
        assert!(run(&q, &mut st, 7_000_000).allowed);
        assert_eq!(
            st,
            Some(State {
                start_us: 7_000_000,
                count: 1
            })
        );
        assert!(run(&q, &mut st, 9_000_000).allowed);
        let d = run(&q, &mut st, 16_999_999);
        assert!(d.allowed);
        assert_eq!((d.remaining, d.reset_us), (0, 1));
        let d = run(&q, &mut st, 16_999_999);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_us, 1);
        // The window ends at 17 s exactly; a new one opens with that request.
        let d = run(&q, &mut st, 17_000_000);
        assert!(d.allowed);
        assert_eq!((d.remaining, d.reset_us), (2, 10_000_000));
    }

    #[test]
    fn boundary_lets_two_windows_pass_back_to_back() {
        let q = quota(FixedWindow, "5/s", None, 1);
        let mut st = None;
        assert!(run(&q, &mut st, 0).allowed);
        let mut passed = 0;
        for t in [
            999_999, 999_999, 999_999, 999_999, 1_000_000, 1_000_000, 1_000_000, 1_000_000,
            1_000_000, 1_000_000,
        ] {
            passed += u32::from(run(&q, &mut st, t).allowed);
        }
        assert_eq!(
            passed, 9,
            "4 at the end of one window and 5 at the start of the next, 1 µs apart"
        );
    }

    #[test]
    fn cost_counts_units_and_denials_count_nothing() {
        let q = quota(FixedWindow, "10/m", None, 4);
        let mut st = None;
        assert_eq!(run(&q, &mut st, 0).remaining, 6);
        assert_eq!(run(&q, &mut st, 1).remaining, 2);
        let d = run(&q, &mut st, 2);
        assert!(!d.allowed);
        assert_eq!((d.remaining, d.retry_after_us), (2, 59_999_998));
        assert_eq!(st.map(|s| s.count), Some(8));
    }

    #[test]
    fn ttl_is_the_window_end() {
        let q = quota(FixedWindow, "100/h", None, 1);
        let o = decide(&q, None, 5);
        assert_eq!(o.ttl_us, 3_600_000_000);
        let o2 = decide(&q, Some(&o.next), 1_800_000_005);
        assert_eq!(o2.ttl_us, 1_800_000_000);
    }

    #[test]
    fn an_untouched_window_reports_a_full_quota() {
        let q = quota(FixedWindow, "100/h", None, 1);
        let o = decide(&q, None, 5);
        assert_eq!((o.uncharged.remaining, o.uncharged.reset_us), (100, 0));
    }
}
