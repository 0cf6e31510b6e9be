//! Settling a charge after the fact (issue 27): an admitted request's charge is a
//! reservation, taken on arrival like any charge (so concurrent requests cannot overshoot
//! while it is held), then committed as it is, refunded, or adjusted to the cost the
//! backend reported. [`settle`] is the pure step; its Redis twins are the `SETTLE`
//! functions beside each algorithm in `lua/`, run by `lua/decide.lua` in `settle` mode.
//!
//! What a settlement means, per algorithm (docs/algorithms.md says it for users):
//! - **token bucket, GCRA**: the units go back (or are taken) exactly, in the quota's
//!   integer units: a refund never rounds and never fills a bucket past its burst. A
//!   charge may take the bucket below empty, down to `max_debt` cost units; the next
//!   admission then waits until the bucket has dripped back.
//! - **fixed and sliding window**: a refund goes back into the window the charge fell in,
//!   and only while that window is still the open one; once it has closed, the charge
//!   stands (a closed window's count no longer decides anything a refund could undo, and
//!   taking from the new window would give back what another request paid). A charge
//!   counts in the window open when it is settled, up to `max_debt` past the rate's N;
//!   a debt never outlives its window.

use super::{fixed_window, gcra, sliding_window, token_bucket, Algorithm, Quota, State};

/// One charge's settlement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adjust {
    /// Cost units to take beyond what was reserved (negative: to give back).
    pub delta: i64,
    /// Windows only: µs from now until the window the charge fell in ends, as the store's
    /// clock has it (the charged decision's reset, less the time since); `None`: the
    /// window open now (a refund made at once, in the same call's time frame).
    pub left_us: Option<u64>,
}

impl Adjust {
    /// Give back a whole charge of `cost`, made just now.
    pub fn refund_now(cost: u64) -> Adjust {
        Adjust {
            delta: -(cost.min(i64::MAX as u64) as i64),
            left_us: None,
        }
    }
}

/// What a settlement leaves of one key's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled<S> {
    /// Nothing to change (a refund for a window that has closed).
    Keep,
    /// The state is whole again: drop it.
    Clear,
    /// Store `next` for `ttl_us`.
    Write { next: S, ttl_us: u64 },
}

impl<S> Settled<S> {
    fn map<T>(self, f: impl FnOnce(S) -> T) -> Settled<T> {
        match self {
            Settled::Keep => Settled::Keep,
            Settled::Clear => Settled::Clear,
            Settled::Write { next, ttl_us } => Settled::Write {
                next: f(next),
                ttl_us,
            },
        }
    }
}

/// Settle one charge on `state` at `now_us`, by `q`'s algorithm. A state kept by another
/// algorithm counts as none (as in [`super::decide`]). A concurrency limit has nothing to
/// settle: its slot is given back when the request ends.
pub fn settle(q: &Quota, state: Option<&State>, now_us: u64, adj: Adjust) -> Settled<State> {
    fn pick<S: TryFrom<State>>(state: Option<&State>) -> Option<S> {
        state.and_then(|s| S::try_from(*s).ok())
    }
    if adj.delta == 0 {
        return Settled::Keep;
    }
    match q.algorithm {
        Algorithm::TokenBucket => {
            token_bucket::settle(q, pick(state).as_ref(), now_us, adj.delta).map(State::TokenBucket)
        }
        Algorithm::Gcra => {
            gcra::settle(q, pick(state).as_ref(), now_us, adj.delta).map(State::Gcra)
        }
        Algorithm::FixedWindow => {
            fixed_window::settle(q, pick(state).as_ref(), now_us, adj).map(State::FixedWindow)
        }
        Algorithm::SlidingWindow => {
            sliding_window::settle(q, pick(state).as_ref(), now_us, adj).map(State::SlidingWindow)
        }
        Algorithm::Concurrency => Settled::Keep,
    }
}

/// A window's count after a settlement charges `add` more: at most `most` (N plus
/// `max_debt`), and a count already past it is never lowered (`charged` in
/// `lua/prelude.lua`).
pub(crate) fn charged(count: u64, add: u64, most: u64) -> u64 {
    (count + add.min(most)).min(count.max(most))
}

/// Whether a window ending at `ends_us` is the one a charge fell in, told `left_us` from
/// `now_us`. Windows' ends are at least a period apart and the estimate is off by no more
/// than the store's latency, so the nearest end within half a period is the charge's.
pub(crate) fn same_window(ends_us: u64, now_us: u64, left_us: u64, period_us: u64) -> bool {
    let told = u128::from(now_us) + u128::from(left_us);
    u128::from(ends_us).abs_diff(told) * 2 < u128::from(period_us)
}
