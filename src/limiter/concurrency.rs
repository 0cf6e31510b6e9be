//! The concurrency limit (`max_in_flight`) as a pure step function: not a rate, a count
//! of requests in flight per identity. A request takes one slot when it is let through
//! and gives it back when its response ends (the gateway's lease guard, [`super::lease`]).
//!
//! In memory the state is the count. In Redis it is a sorted set of leases scored by their
//! expiry (`lua/decide.lua`): a gateway that dies cannot give its slots back, so each lease
//! lives `lease_ttl` unless the gateway renews it while the request is in flight.

use super::{Decision, Quota, Ruling};

/// Requests in flight for one identity under one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    pub in_flight: u64,
}

/// How long a denied request is told to wait: a slot frees whenever a response ends, which
/// no clock predicts; one second is the smallest `Retry-After` there is.
pub const RETRY_US: u64 = 1_000_000;

/// Judge one more request against `q.burst` in flight.
pub fn decide(q: &Quota, state: Option<&State>, _now_us: u64) -> Ruling<State> {
    let max = q.burst;
    let count = state.map_or(0, |s| s.in_flight).min(max);
    let allowed = count < max;
    let after = (count + 1).min(max);
    Ruling {
        allowed,
        charged: Decision {
            allowed,
            remaining: max - after,
            retry_after_us: 0,
            reset_us: 0,
            window: 0,
        },
        uncharged: Decision {
            allowed,
            remaining: max - count,
            retry_after_us: if allowed { 0 } else { RETRY_US },
            reset_us: 0,
            window: 0,
        },
        next: State { in_flight: after },
        // Held until released: no time makes a slot free.
        ttl_us: u64::MAX,
    }
}

/// The state once one request in flight has ended; `None` when none is left.
pub fn release(state: Option<&State>) -> Option<State> {
    match state {
        Some(s) if s.in_flight > 1 => Some(State {
            in_flight: s.in_flight - 1,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;
    use std::time::Duration;

    #[test]
    fn admits_up_to_max_then_denies_until_released() {
        let q = Quota::concurrency(NonZeroU64::new(2).unwrap(), Duration::from_secs(10));
        let mut st = None;
        for left in [1, 0] {
            let o = decide(&q, st.as_ref(), 0);
            assert!(o.allowed);
            assert_eq!(o.charged.remaining, left);
            st = Some(o.next);
        }
        let o = decide(&q, st.as_ref(), 0);
        assert!(!o.allowed);
        assert_eq!(
            (o.uncharged.remaining, o.uncharged.retry_after_us),
            (0, RETRY_US)
        );
        st = release(st.as_ref());
        assert_eq!(st, Some(State { in_flight: 1 }));
        assert!(decide(&q, st.as_ref(), 0).allowed);
        assert_eq!(release(Some(&State { in_flight: 1 })), None);
        assert_eq!(release(None), None);
    }
}
