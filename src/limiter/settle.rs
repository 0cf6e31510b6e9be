//! Settling a charge after the fact (issue 27): an admitted request's charge is a
//! reservation, taken on arrival like any charge (so concurrent requests cannot overshoot
//! while it is held), then committed as it is, refunded, or adjusted to the cost the
//! backend reported. [`settle`] is the pure step; its Redis twins are the `SETTLE`
//! functions beside each algorithm in `lua/`, run by `lua/decide.lua` in `settle` mode.
//!
//! What a settlement means, per algorithm (docs/algorithms.md says it for users):
//! - **token bucket, GCRA**: the units go back (or are taken) exactly, in the quota's
//!   integer units: a refund never rounds and never fills a bucket past its burst. A
//!   reported cost is charged in full, however far below empty it takes the bucket; the
//!   identity's next admission waits until the bucket has dripped back.
//! - **fixed and sliding window**: a refund goes back into the window the charge fell in
//!   — identified by what the store said when it charged ([`Decision::window`]), never by
//!   arithmetic on elapsed time — and only while that window is still the open one; once
//!   it has closed, the charge stands (taking from the new window would give back what
//!   another request paid). A charge counts in full in the window open when it is
//!   settled; what passes N is carried into the windows after, N paid by each.
//! - on every algorithm, a settlement never moves a key's time backwards, however the
//!   store's clock stepped between the charge and the settlement.
//!
//! Nothing is forgiven but where Lua's numbers stop being exact ([`super::MAX_LEVEL`])
//! and, on a calendar window, past one whole period of debt; what is, the store reports
//! and the gateway counts (`ratewall_settle_forgiven_total`).

use super::{fixed_window, gcra, sliding_window, token_bucket, Algorithm, Decision, Quota, State};

/// One charge's settlement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adjust {
    /// Cost units to take beyond what was reserved (negative: to give back).
    pub delta: i64,
    /// Windows only: the window the charge fell in, as the store named it when it charged
    /// ([`Decision::window`]); a refund goes only there.
    pub window: u64,
}

impl Adjust {
    /// Give back a whole charge of `cost`, decided as `charged`.
    pub fn refund(cost: u64, charged: &Decision) -> Adjust {
        Adjust {
            delta: -(cost.min(i64::MAX as u64) as i64),
            window: charged.window,
        }
    }
}

/// What a window that counted `count` leaves `k` windows on: its excess over `n`, less
/// `n` for each window after it (`k = 0`: the count itself). A window's debt is paid this
/// way, never dropped (`carried` in `lua/prelude.lua`).
pub(crate) fn carried(count: u64, n: u64, k: u64) -> u64 {
    if k >= count.div_ceil(n) {
        0
    } else {
        count - k * n
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

/// Settle one charge on `state` at `now_us`, by `q`'s algorithm: what it leaves, and the
/// cost units it could not charge (forgiven; see the module's comment). A state kept by
/// another algorithm counts as none (as in [`super::decide`]). A concurrency limit has
/// nothing to settle: its slot is given back when the request ends.
pub fn settle(q: &Quota, state: Option<&State>, now_us: u64, adj: Adjust) -> (Settled<State>, u64) {
    fn pick<S: TryFrom<State>>(state: Option<&State>) -> Option<S> {
        state.and_then(|s| S::try_from(*s).ok())
    }
    fn wrap<S>(
        (s, forgiven): (Settled<S>, u64),
        f: impl FnOnce(S) -> State,
    ) -> (Settled<State>, u64) {
        (s.map(f), forgiven)
    }
    if adj.delta == 0 {
        return (Settled::Keep, 0);
    }
    match q.algorithm {
        Algorithm::TokenBucket => wrap(
            token_bucket::settle(q, pick(state).as_ref(), now_us, adj.delta),
            State::TokenBucket,
        ),
        Algorithm::Gcra => wrap(
            gcra::settle(q, pick(state).as_ref(), now_us, adj.delta),
            State::Gcra,
        ),
        Algorithm::FixedWindow => wrap(
            fixed_window::settle(q, pick(state).as_ref(), now_us, adj),
            State::FixedWindow,
        ),
        Algorithm::SlidingWindow => wrap(
            sliding_window::settle(q, pick(state).as_ref(), now_us, adj),
            State::SlidingWindow,
        ),
        Algorithm::Concurrency => (Settled::Keep, 0),
    }
}
