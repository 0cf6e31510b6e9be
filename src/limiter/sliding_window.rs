//! Sliding window (the two-window weighted counter) as a pure, exact step function. Its
//! Redis twin is `lua/sliding_window.lua`.
//!
//! Time is cut into windows of one period (aligned to the clock's zero). A request at `e`
//! µs into window `w` sees an estimate of the last period's traffic:
//!
//! ```text
//! estimate = prev * (P - e) / P + cur
//! ```
//!
//! — the previous window's count weighted by how much of it still overlaps the last
//! period, plus the current window's count. It passes if `estimate + cost <= N`. The
//! comparison is done multiplied through by `P`, in integers, so it is exact.
//!
//! Error bound: the estimate assumes the previous window's requests were spread evenly.
//! Whatever their spread, in any interval of length `d <= P` at most `N + N·d/P` (plus
//! one request's cost) pass, and never more than `2N` in any period: there is no burst
//! of 2N at a boundary, unlike a fixed window, where 2N can pass within a microsecond.

use super::settle::{carried, Adjust, Settled};
use super::{Decision, Quota, Ruling, MAX_LEVEL};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    /// The index of the window `cur` counts (`now / P`).
    pub window: u64,
    pub cur: u64,
    pub prev: u64,
}

/// The counts of window `w` as `state` leaves them: `(prev, cur)`. A window's count past
/// N (a debt: costs reported above their reservations, or what `max_debt` let a request
/// borrow) is carried into the windows after it, N paid by each: the next window sees N
/// as its previous one's count and the rest as its own, and so on. A debt is never
/// dropped.
fn counts(q: &Quota, state: Option<&State>, w: u64) -> (u64, u64) {
    let n = q.rate.count;
    match state {
        Some(s) if s.window == w => (s.prev.min(n), s.cur),
        Some(s) if s.window < w => {
            let k = w - s.window;
            (carried(s.cur, n, k - 1).min(n), carried(s.cur, n, k))
        }
        _ => (0, 0),
    }
}

/// µs from `now_us` to the start of window `w` (at most [`MAX_LEVEL`]).
fn until(w: u64, p: u64, now_us: u64) -> u64 {
    w.saturating_mul(p).saturating_sub(now_us).min(MAX_LEVEL)
}

/// The window in which a state of `cur` in window `w` (and `prev` before it) no longer
/// weighs anything: its debt paid and its last N slid out.
fn clear_after(w: u64, n: u64, cur: u64, prev: u64) -> Option<u64> {
    if cur > 0 {
        Some(w.saturating_add(cur.div_ceil(n)).saturating_add(1))
    } else if prev > 0 {
        Some(w + 1)
    } else {
        None
    }
}

pub fn decide(q: &Quota, state: Option<&State>, now_us: u64) -> Ruling<State> {
    let p = q.period_us();
    let n = q.rate.count;
    // What may be counted at once: N, and what `max_debt` lets a request borrow.
    let most = n + q.max_debt;
    let cost = q.cost;
    // The windows never move backwards: a request timed before the state's window (the
    // clock stepped back across a window start — a Redis failover, an NTP step) is decided
    // at that window's start, where its counts still weigh, not in an earlier window that
    // knows none of them. Its waits are then counted from `now_us`.
    let at = state.map_or(now_us, |s| now_us.max(s.window.saturating_mul(p)));
    let skew = at - now_us;
    let (w, e) = (at / p, at % p);
    let (prev, cur) = counts(q, state, w);
    let budget = n * p;
    let weighted_prev = prev * (p - e);
    // Past `most` a count denies whatever its size: clamped, the products stay exact.
    let used = |cur: u64| weighted_prev + cur.min(most) * p;
    let allowed = used(cur) + cost * p <= most * p;
    // Whole requests of cost 1 that would still pass now, within N.
    let remaining = |cur: u64| budget.saturating_sub(used(cur)) / p;
    // Until the estimate is back to zero: `cur` must age through the windows after it.
    let reset = |cur: u64| clear_after(w, n, cur, prev).map_or(0, |c| until(c, p, now_us));
    let retry = if allowed {
        0
    } else if cur + cost <= most {
        // Within this window, once enough of `prev` has slid out: the first e' with
        // prev * (P - e') <= (most - cur - cost) * P.
        let e_pass = p - ((most - cur - cost) * p) / prev;
        e_pass - e + skew
    } else {
        // In the first window on whose carried count the request fits, once enough of
        // that window's previous count has slid out.
        let k = (cur + cost - most).div_ceil(n).max(1);
        let (prev_k, cur_k) = (carried(cur, n, k - 1).min(n), carried(cur, n, k));
        let e_pass = match prev_k {
            0 => 0,
            // Positive: the window before k did not fit the request, so prev_k does not.
            _ => p.saturating_sub(((most - cur_k - cost) * p) / prev_k),
        };
        until(w.saturating_add(k), p, now_us)
            .saturating_add(e_pass)
            .min(MAX_LEVEL)
    };
    let next = State {
        window: w,
        cur: cur + cost,
        prev,
    };
    Ruling {
        allowed,
        charged: Decision {
            allowed,
            remaining: remaining(next.cur),
            retry_after_us: 0,
            reset_us: reset(next.cur),
            window: w,
        },
        uncharged: Decision {
            allowed,
            remaining: remaining(cur),
            retry_after_us: retry,
            reset_us: reset(cur),
            window: w,
        },
        next,
        ttl_us: ttl(w, p, n, next.cur, now_us),
    }
}

/// How long a state of `cur` in window `w` matters: through the next window at least,
/// and through every window its debt is carried into.
fn ttl(w: u64, p: u64, n: u64, cur: u64, now_us: u64) -> u64 {
    let clear = clear_after(w, n, cur, 0).unwrap_or(w).max(w + 2);
    until(clear, p, now_us)
}

/// Settle a charge made earlier (`lua/sliding_window.lua`'s `SETTLE`). A refund goes back
/// into the window the charge fell in — the one the store said when it charged,
/// `adj.window` — while it is the current one, else the charge stands (it only weighs as
/// the previous window's count now). A charge counts, in full, in the current window; its
/// excess over N is carried into the windows after. The second value: cost units
/// forgiven (only past [`MAX_LEVEL`]).
pub fn settle(q: &Quota, state: Option<&State>, now_us: u64, adj: Adjust) -> (Settled<State>, u64) {
    let p = q.period_us();
    let n = q.rate.count;
    let at = state.map_or(now_us, |s| now_us.max(s.window.saturating_mul(p)));
    let w = at / p;
    if adj.delta < 0 {
        let Some(s) = state.filter(|s| s.window == w && w == adj.window) else {
            return (Settled::Keep, 0);
        };
        if s.cur == 0 {
            return (Settled::Keep, 0);
        }
        let cur = s.cur.saturating_sub(adj.delta.unsigned_abs());
        if cur == 0 && s.prev == 0 {
            return (Settled::Clear, 0);
        }
        let settled = Settled::Write {
            next: State { cur, ..*s },
            ttl_us: ttl(w, p, n, cur, now_us),
        };
        return (settled, 0);
    }
    let (prev, cur) = counts(q, state, w);
    let wanted = cur.saturating_add(adj.delta.unsigned_abs());
    let forgiven = wanted.saturating_sub(MAX_LEVEL);
    let cur = wanted.min(MAX_LEVEL);
    let settled = Settled::Write {
        next: State {
            window: w,
            cur,
            prev,
        },
        ttl_us: ttl(w, p, n, cur, now_us),
    };
    (settled, forgiven)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::tests::{quota, run};
    use crate::limiter::Algorithm::SlidingWindow;

    #[test]
    fn previous_window_is_weighted_by_its_overlap() {
        let q = quota(SlidingWindow, "10/s", None, 1);
        let mut st: Option<State> = None;
        for _ in 0..10 {
            assert!(run(&q, &mut st, 500_000).allowed);
        }
        assert!(!run(&q, &mut st, 999_999).allowed);
        // At 1.25 s the previous window (10) still counts 75%: 7.5, so 2 more fit.
        let d = run(&q, &mut st, 1_250_000);
        assert!(d.allowed);
        assert_eq!(d.remaining, 1);
        assert!(run(&q, &mut st, 1_250_000).allowed);
        let d = run(&q, &mut st, 1_250_000);
        assert!(!d.allowed);
        // 7.5 + 2 + 1 > 10 until prev weighs 7: at 1.3 s.
        assert_eq!(d.retry_after_us, 50_000);
        assert!(!run(&q, &mut st, 1_299_999).allowed);
        assert!(run(&q, &mut st, 1_300_000).allowed);
    }

    #[test]
    fn no_burst_of_two_n_at_a_boundary() {
        let q = quota(SlidingWindow, "5/s", None, 1);
        let mut st: Option<State> = None;
        let mut passed = 0;
        for t in [999_990; 5].into_iter().chain([1_000_000; 5]) {
            passed += u32::from(run(&q, &mut st, t).allowed);
        }
        assert_eq!(passed, 5, "a fixed window would pass 10 here");
    }

    #[test]
    fn a_full_current_window_waits_for_the_next() {
        let q = quota(SlidingWindow, "4/s", None, 2);
        let mut st: Option<State> = None;
        assert!(run(&q, &mut st, 0).allowed);
        assert!(run(&q, &mut st, 0).allowed);
        let d = run(&q, &mut st, 100_000);
        assert!(!d.allowed);
        // Next window: prev = 4 must weigh <= 2: half of it slid out, at 1.5 s.
        assert_eq!(d.retry_after_us, 900_000 + 500_000);
        assert!(!run(&q, &mut st, 1_499_999).allowed);
        assert!(run(&q, &mut st, 1_500_000).allowed);
    }

    #[test]
    fn idle_windows_forget_and_ttl_covers_the_next_window() {
        let q = quota(SlidingWindow, "10/m", None, 1);
        let o = decide(&q, None, 90_000_000);
        assert_eq!(o.ttl_us, 120_000_000 - 30_000_000);
        assert_eq!(o.charged.reset_us, o.ttl_us);
        // Two windows later nothing is left.
        assert_eq!(
            decide(&q, Some(&o.next), 180_000_000),
            decide(&q, None, 180_000_000)
        );
    }

    #[test]
    fn clock_at_the_window_edge() {
        let q = quota(SlidingWindow, "2/s", None, 1);
        let mut st: Option<State> = None;
        assert!(run(&q, &mut st, 999_999).allowed);
        assert!(run(&q, &mut st, 999_999).allowed);
        // At exactly 1 s the previous window weighs fully: still 2.
        let d = run(&q, &mut st, 1_000_000);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_us, 500_000);
    }
}
