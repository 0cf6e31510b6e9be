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

use super::settle::{carried, Adjust, Settled};
use super::{Decision, Quota, Ruling, MAX_LEVEL};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    pub start_us: u64,
    pub count: u64,
}

/// The window a request at `now_us` is decided in: its start, its end, what `state`
/// counts in it.
///
/// A window never moves backwards: a request timed before the state's start (the clock
/// stepped back — a Redis failover, an NTP step) is placed at the start, inside the
/// window, not as the first request of a fresh one. Its waits are then counted from
/// `now_us`, so the end is never below it.
///
/// A fresh window starts with what the last one counted past N (a debt: costs reported
/// above their reservations, or what `max_debt` let a request borrow), less N for every
/// whole window that passed unused in between: a debt is paid by the windows after it,
/// never dropped. While a debt is carried, those windows run back to back from the
/// state's end (so a denial's retry names the instant the debt shrinks); once it is paid,
/// a window opens at a first request again. A calendar window carries into the period
/// right after the state's a debt of at most one period ([`calendar_most`]), and into a
/// later one that less N.
fn window(q: &Quota, state: Option<&State>, now_us: u64) -> Window {
    let n = q.rate.count;
    let at = state.map_or(now_us, |s| now_us.max(s.start_us));
    let (start, end, count) = match q.calendar {
        Some(cal) => {
            let (start, end) = cal.window(at);
            let count = match state {
                Some(s) if s.start_us == start => s.count,
                Some(s) if s.start_us < start => {
                    // The period right before: nearer than one and a half of this one
                    // (periods differ in length by less than a third: 23 to 25 hours, 28
                    // to 31 days); else at least one whole period passed unused.
                    let right_before =
                        (start - s.start_us).saturating_mul(2) < (end - start).saturating_mul(3);
                    carried(s.count, n, if right_before { 1 } else { 2 })
                }
                _ => 0,
            };
            (start, end, count)
        }
        None => {
            let period = q.period_us();
            match state {
                Some(s) if at < s.start_us.saturating_add(period) => {
                    (s.start_us, s.start_us + period, s.count)
                }
                Some(s) => {
                    // The windows after a debt run back to back from the state's end
                    // until it is paid; then a window opens at a first request again.
                    let ended = s.start_us + period;
                    let idle = (at - ended) / period;
                    match carried(s.count, n, idle.saturating_add(1)) {
                        0 => (at, at + period, 0),
                        debt => {
                            let start = ended + idle * period;
                            (start, start + period, debt)
                        }
                    }
                }
                None => (at, at + period, 0),
            }
        }
    };
    Window { start, end, count }
}

/// The window a request is decided in: `[start, end)`, holding `count`.
struct Window {
    start: u64,
    end: u64,
    count: u64,
}

/// The most a calendar window's count may hold after a settlement: one whole period past
/// N and the borrowing. Lua has no zone database to count the periods a long debt would
/// span; what a settlement would add past this is forgiven (and counted).
fn calendar_most(q: &Quota) -> u64 {
    2 * q.rate.count + q.max_debt
}

/// How long a window's state matters: to its end, and past it while its count carries a
/// debt into the windows after (a calendar period's length taken at twice the current's,
/// longer than any next period). At most [`MAX_LEVEL`] µs.
fn ttl(q: &Quota, w: &Window, count: u64, now_us: u64) -> u64 {
    let debt = count.saturating_sub(q.rate.count);
    let windows = debt.div_ceil(q.rate.count);
    let each = match q.calendar {
        Some(_) => (w.end - w.start).saturating_mul(2),
        None => q.period_us(),
    };
    let past = windows.saturating_mul(each);
    (w.end - now_us).saturating_add(past).min(MAX_LEVEL)
}

pub fn decide(q: &Quota, state: Option<&State>, now_us: u64) -> Ruling<State> {
    let n = q.rate.count;
    let w = window(q, state, now_us);
    let ends_in = w.end - now_us;
    let count = w.count;
    let allowed = count + q.cost <= n + q.max_debt;
    let next = State {
        start_us: w.start,
        count: count + q.cost,
    };
    // Denied: the first window whose carried count leaves room, the windows after this
    // one paying N each (a calendar period's next one taken as long as the one after it
    // the gateway knows).
    let retry = if allowed {
        0
    } else {
        let short = (count.saturating_sub(n) + q.cost).saturating_sub(n + q.max_debt);
        let windows = short.div_ceil(n);
        let each = match q.calendar {
            Some(cal) => {
                let (s, e) = cal.window(w.end);
                e - s
            }
            None => q.period_us(),
        };
        ends_in
            .saturating_add(windows.saturating_mul(each))
            .min(MAX_LEVEL)
    };
    Ruling {
        allowed,
        charged: Decision {
            allowed,
            remaining: n.saturating_sub(next.count),
            retry_after_us: 0,
            reset_us: ends_in,
            window: w.start,
        },
        uncharged: Decision {
            allowed,
            remaining: n.saturating_sub(count),
            retry_after_us: retry,
            reset_us: if count == 0 { 0 } else { ends_in },
            window: w.start,
        },
        next,
        ttl_us: ttl(q, &w, next.count, now_us),
    }
}

/// Settle a charge made earlier (`lua/fixed_window.lua`'s `SETTLE`). A refund goes back
/// into the window the charge fell in — the one the store said when it charged,
/// `adj.window` — while it is open, else the charge stands. A charge counts, in full, in
/// the window open now (a fresh one if none is, carrying the last one's debt); its excess
/// over N is carried into the windows after. The second value: cost units forgiven (a
/// calendar window past [`calendar_most`], any window past [`MAX_LEVEL`]).
pub fn settle(q: &Quota, state: Option<&State>, now_us: u64, adj: Adjust) -> (Settled<State>, u64) {
    let w = window(q, state, now_us);
    let mut forgiven = 0;
    let count = if adj.delta < 0 {
        if w.count == 0 || w.start != adj.window {
            return (Settled::Keep, 0);
        }
        w.count.saturating_sub(adj.delta.unsigned_abs())
    } else {
        let most = match q.calendar {
            Some(_) => calendar_most(q).max(w.count),
            None => MAX_LEVEL,
        };
        let wanted = w.count.saturating_add(adj.delta.unsigned_abs());
        forgiven = wanted.saturating_sub(most);
        wanted.min(most)
    };
    if count == 0 {
        return (Settled::Clear, forgiven);
    }
    let settled = Settled::Write {
        next: State {
            start_us: w.start,
            count,
        },
        ttl_us: ttl(q, &w, count, now_us),
    };
    (settled, forgiven)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::tests::{quota, run};
    use crate::limiter::Algorithm::FixedWindow;
    use crate::limiter::{Adjust, Settled};

    #[test]
    fn window_starts_at_the_first_request() {
        let q = quota(FixedWindow, "3/10s", None, 1);
        let mut st: Option<State> = None;
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
        let mut st: Option<State> = None;
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
        let mut st: Option<State> = None;
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
        let mut st: Option<State> = None;
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
        let mut st: Option<State> = None;
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
        let mut st: Option<State> = None;
        let at = local(3, 14, 23, 0);
        let charged = run(&q, &mut st, at);
        assert_eq!(st.unwrap().start_us, local(2, 15, 0, 0));
        assert_eq!(charged.window, local(2, 15, 0, 0));
        let state = st.map(Into::into);
        // While the window is open: the refund goes back.
        let adj = Adjust::refund(1, &charged);
        let later = at + HOUR / 2;
        assert_eq!(
            crate::limiter::settle(&q, state.as_ref(), later, adj),
            (Settled::Clear, 0)
        );
        // Once the 15th has begun, the charge stands.
        let after = local(3, 15, 0, 30);
        assert_eq!(
            crate::limiter::settle(&q, state.as_ref(), after, adj),
            (Settled::Keep, 0)
        );
    }

    #[test]
    fn an_untouched_window_reports_a_full_quota() {
        let q = quota(FixedWindow, "100/h", None, 1);
        let o = decide(&q, None, 5);
        assert_eq!((o.uncharged.remaining, o.uncharged.reset_us), (100, 0));
    }
}
