//! Fixed window as a pure step function. Its Redis twin is `lua/fixed_window.lua`.
//!
//! A window opens at the first request of a key and lasts one period; it admits the rate's
//! N (in cost units) and then denies until it ends. The state is the window's start and its
//! count, and the key's TTL is the window's end, set in the same atomic step as the count.
//!
//! A window's start is the latest time its state knows: a request timed before it (a clock
//! stepped back) is decided at it, so a step back never opens a fresh window.
//!
//! A calendar rate (`"N/month"`, `"N/week"`, `"N/day"`; [`super::calendar`]) cuts the
//! windows at its calendar's edges instead: the window is the period containing the
//! decision's time, whenever the key's first request came, and the state's start is that
//! period's start. A state whose start is not the period's (one the plain fixed window
//! left, or an ended period's) is none. Redis' twin gets the edges from the gateway
//! (algorithm code 6 in `lua/fixed_window.lua`).
//!
//! The boundary effect: N requests at the end of one window and N at the start of the next
//! pass within moments of each other — up to 2N in a short interval. Choose it for coarse
//! quotas (per day, per month), where the simplicity and the tiny state matter more.

use super::settle::{charged, same_window, Adjust, Settled};
use super::{Decision, Outcome, Quota};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    pub start_us: u64,
    pub count: u64,
}

/// The window a request at `now_us` is decided in: its start, its end and what `state`
/// has counted in it (0 for a fresh one).
///
/// A window never moves backwards: a request timed before the state's start (the clock
/// stepped back — a Redis failover, an NTP step) is decided at the start, inside the
/// window, not as the first request of a fresh one. Its waits are then counted from
/// `now_us`, so the end is never below it.
fn window(q: &Quota, state: Option<&State>, now_us: u64) -> (u64, u64, u64) {
    let at = state.map_or(now_us, |s| now_us.max(s.start_us));
    match q.calendar {
        Some(cal) => {
            let (start, end) = cal.window(at);
            let count = state.filter(|s| s.start_us == start).map_or(0, |s| s.count);
            (start, end, count)
        }
        None => {
            let period = q.period_us();
            match state.filter(|s| at < s.start_us.saturating_add(period)) {
                Some(s) => (s.start_us, s.start_us + period, s.count),
                None => (at, at + period, 0),
            }
        }
    }
}

pub fn decide(q: &Quota, state: Option<&State>, now_us: u64) -> Outcome<State> {
    let limit = q.rate.count;
    let (start_us, end_us, count) = window(q, state, now_us);
    let ends_in = end_us - now_us;
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
    let (start_us, end_us, count) = window(q, state, now_us);
    let ends_in = end_us - now_us;
    let count = if adj.delta < 0 {
        // A calendar window's length is its own (a 23-hour day, a 28-day month).
        let charged_here = adj
            .left_us
            .is_none_or(|left| same_window(end_us, now_us, left, end_us - start_us));
        if count == 0 || !charged_here {
            return Settled::Keep;
        }
        count.saturating_sub(adj.delta.unsigned_abs())
    } else {
        charged(count, adj.delta.unsigned_abs(), q.rate.count + q.max_debt)
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
    use crate::limiter::{Adjust, Decision, Settled};

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

    /// A calendar quota in Berlin: `rate` ("N/month", ...), months from `anchor_day`.
    fn berlin(rate: &str, anchor_day: u8) -> Quota {
        let zone = crate::limiter::calendar::zone("Europe/Berlin").unwrap();
        quota(FixedWindow, rate, None, 1).in_zone(zone, anchor_day)
    }

    /// µs since the epoch of a Berlin wall-clock time (an unambiguous one).
    fn local(m: i8, d: i8, h: i8, min: i8) -> u64 {
        let zone = crate::limiter::calendar::zone("Europe/Berlin").unwrap();
        let dt = jiff::civil::date(2026, m, d).at(h, min, 0, 0);
        let ts = zone.to_ambiguous_timestamp(dt).unambiguous().unwrap();
        ts.as_microsecond() as u64
    }

    const HOUR: u64 = 3_600_000_000;

    #[test]
    fn a_calendar_month_in_berlin_ends_at_local_midnight_across_the_dst_change() {
        let q = berlin("3/month", 1);
        let mut st = None;
        // 10 March, before the spring change: the window is March, whenever it began.
        let d = run(&q, &mut st, local(3, 10, 9, 0));
        assert!(d.allowed);
        let april = local(4, 1, 0, 0);
        assert_eq!(d.reset_us, april - local(3, 10, 9, 0));
        assert_eq!(st.unwrap().start_us, local(3, 1, 0, 0));
        // After the change (29 March), the month's end is 1 April 00:00 CEST, 22:00 UTC.
        assert!(run(&q, &mut st, local(3, 30, 12, 0)).allowed);
        let d = run(&q, &mut st, april - 1);
        assert!(d.allowed);
        assert_eq!((d.remaining, d.reset_us), (0, 1));
        let d = run(&q, &mut st, april - 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_us, 1);
        // April opens exactly at local midnight: a fresh count, to 1 May.
        let d = run(&q, &mut st, april);
        assert!(d.allowed);
        assert_eq!((d.remaining, d.reset_us), (2, local(5, 1, 0, 0) - april));
        assert_eq!(d.reset_us, 30 * 24 * HOUR);
        let o = decide(&q, st.as_ref(), april);
        assert_eq!(o.ttl_us, 30 * 24 * HOUR);
    }

    #[test]
    fn a_calendar_day_across_the_autumn_change_is_25_hours() {
        let q = berlin("2/day", 1);
        let mut st = None;
        let morning = local(10, 25, 1, 0);
        let d = run(&q, &mut st, morning);
        // 01:00 CEST to midnight CET: 24 hours, the clocks having gone back one.
        assert_eq!(d.reset_us, local(10, 26, 0, 0) - morning);
        assert_eq!(d.reset_us, 24 * HOUR);
        assert!(run(&q, &mut st, local(10, 25, 23, 59)).allowed);
        assert!(!run(&q, &mut st, local(10, 25, 23, 59)).allowed);
        let next = run(&q, &mut st, local(10, 26, 0, 0));
        assert!(next.allowed);
        assert_eq!(next.reset_us, 24 * HOUR);
    }

    #[test]
    fn a_calendar_state_from_an_ended_period_or_a_plain_window_is_none() {
        let q = berlin("5/month", 1);
        let ended = State {
            start_us: local(2, 1, 0, 0),
            count: 5,
        };
        let o = decide(&q, Some(&ended), local(3, 2, 0, 0));
        assert!(o.allowed);
        assert_eq!(o.next.start_us, local(3, 1, 0, 0));
        assert_eq!(o.next.count, 1);
        // The plain fixed window's state starts at a first request, not at the period's.
        let plain = State {
            start_us: local(3, 1, 10, 0),
            count: 5,
        };
        assert_eq!(decide(&q, Some(&plain), local(3, 2, 0, 0)).next.count, 1);
        // A clock stepped back behind the state's start decides in the state's window.
        let live = State {
            start_us: local(4, 1, 0, 0),
            count: 5,
        };
        let now = local(3, 31, 23, 0);
        let o = decide(&q, Some(&live), now);
        assert!(!o.allowed);
        assert_eq!(o.uncharged.retry_after_us, local(5, 1, 0, 0) - now);
    }

    #[test]
    fn an_anchored_month_refunds_only_into_the_window_charged() {
        let q = berlin("5/month", 15);
        let mut st = None;
        let at = local(3, 14, 23, 0);
        let charged = run(&q, &mut st, at);
        assert_eq!(st.unwrap().start_us, local(2, 15, 0, 0));
        let state = st.map(Into::into);
        // While the window is open: the refund goes back.
        let adj = Adjust {
            delta: -1,
            left_us: Some(charged.reset_us - HOUR / 2),
        };
        let later = at + HOUR / 2;
        assert_eq!(
            crate::limiter::settle(&q, state.as_ref(), later, adj),
            Settled::Clear
        );
        // Once the 15th has begun, the charge stands.
        let adj = Adjust {
            delta: -1,
            left_us: Some(0),
        };
        let after = local(3, 15, 0, 30);
        assert_eq!(
            crate::limiter::settle(&q, state.as_ref(), after, adj),
            Settled::Keep
        );
    }

    #[test]
    fn an_untouched_window_reports_a_full_quota() {
        let q = quota(FixedWindow, "100/h", None, 1);
        let o = decide(&q, None, 5);
        assert_eq!((o.uncharged.remaining, o.uncharged.reset_us), (100, 0));
    }
}
