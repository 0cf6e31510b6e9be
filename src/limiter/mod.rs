//! Rate-limit decisions: the algorithms as pure integer step functions
//! ([`token_bucket`], [`gcra`], [`sliding_window`], [`fixed_window`]) and the stores that
//! run them ([`memory`], [`redis`]).
//!
//! Every algorithm has one shape: `decide(quota, state, now) -> Ruling`, pure, in
//! integers, with time injected. The outcome says what to answer whether or not the
//! request is finally charged, and what to store if it is.
//!
//! The store boundary is the [`Store`] trait, one call per request ([`Store::decide`]):
//! every rule that applies to the request is checked together, and either all of them
//! are charged or none is, so a request that one rule denies consumes nothing from the
//! others. [`breaker::Limiter`] is what the gateway calls: the store behind a circuit
//! breaker, a deny cache and the `on_error` policy.

pub mod breaker;
pub mod calendar;
pub mod concurrency;
pub mod deny_cache;
pub mod fixed_window;
pub mod gcra;
pub mod heartbeat;
pub mod lease;
pub mod memory;
pub mod metrics;
#[cfg(test)]
pub(crate) mod properties;
pub mod quota;
pub mod redis;
pub mod settle;
pub mod sliding_window;
pub mod store;
pub mod token_bucket;

use std::sync::Arc;
use std::time::Instant;

use crate::identity::IdentityDigest;

pub use quota::{Algorithm, LocalShare, Quota, QuotaError, QuotaField, Rate, Share, MAX_LEVEL};
pub use settle::{settle, Adjust, Settled};
pub use store::{Backend, OnError, Receipt, Replication, Store};

/// What one rule said about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Decision {
    pub allowed: bool,
    /// Whole requests (of cost 1) still allowed now, after this request if it was charged.
    pub remaining: u64,
    /// When denied: microseconds until this request would pass. When allowed: how long it
    /// waits for the tokens it took ahead before it is forwarded (`max_delay`), usually 0.
    pub retry_after_us: u64,
    /// Microseconds until the full quota is available again.
    pub reset_us: u64,
    /// Windows only: the window the request was decided in, as the store names it (a
    /// fixed window's start in µs, a sliding window's index; 0 for the buckets). A
    /// settlement's refund goes only into the window its charge fell in
    /// ([`settle::Adjust::window`]).
    pub window: u64,
}

/// One rule's ruling on one request, as its algorithm steps: before anything is
/// written. A request passes only if every rule allows it; then each rule's `next` state
/// is stored (for `ttl_us`) and `charged` is reported, else nothing is stored and
/// `uncharged` is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ruling<S> {
    pub allowed: bool,
    pub charged: Decision,
    pub uncharged: Decision,
    pub next: S,
    /// How long `next` matters: past it, no state means the same as this state.
    pub ttl_us: u64,
}

/// One key's state, whichever algorithm keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    TokenBucket(token_bucket::State),
    Gcra(gcra::State),
    FixedWindow(fixed_window::State),
    SlidingWindow(sliding_window::State),
    Concurrency(concurrency::State),
}

/// Run `q`'s algorithm on `state`. State kept by another algorithm (the rule changed on
/// reload) counts as none.
pub fn decide(q: &Quota, state: Option<&State>, now_us: u64) -> Ruling<State> {
    fn wrap<S>(o: Ruling<S>, f: impl FnOnce(S) -> State) -> Ruling<State> {
        Ruling {
            allowed: o.allowed,
            charged: o.charged,
            uncharged: o.uncharged,
            next: f(o.next),
            ttl_us: o.ttl_us,
        }
    }
    fn pick<S: TryFrom<State>>(state: Option<&State>) -> Option<S> {
        state.and_then(|s| S::try_from(*s).ok())
    }
    match q.algorithm {
        Algorithm::TokenBucket => wrap(
            token_bucket::decide(q, pick(state).as_ref(), now_us),
            State::TokenBucket,
        ),
        Algorithm::Gcra => wrap(gcra::decide(q, pick(state).as_ref(), now_us), State::Gcra),
        Algorithm::FixedWindow => wrap(
            fixed_window::decide(q, pick(state).as_ref(), now_us),
            State::FixedWindow,
        ),
        Algorithm::SlidingWindow => wrap(
            sliding_window::decide(q, pick(state).as_ref(), now_us),
            State::SlidingWindow,
        ),
        Algorithm::Concurrency => wrap(
            concurrency::decide(q, pick(state).as_ref(), now_us),
            State::Concurrency,
        ),
    }
}

/// One identity under one rule: what a store needs to find and judge its state.
#[derive(Debug, Clone)]
pub struct Check<'a> {
    /// The hashed identity (never the raw key).
    pub identity: &'a IdentityDigest,
    /// The rule's name, the last part of the Redis key.
    pub rule: &'a str,
    pub quota: &'a Quota,
    /// Decided and counted, but never denies the request (`mode = "shadow"`, or an
    /// identity outside `enforce_percent`). It is charged only when it allows and the
    /// enforcing checks let the request through, as if it had been enforced.
    pub shadow: bool,
    /// Concurrency only: this request's lease number, unique within the process.
    pub lease: u64,
}

impl<'a> Check<'a> {
    /// An enforcing check.
    pub fn new(identity: &'a IdentityDigest, rule: &'a str, quota: &'a Quota) -> Self {
        Check {
            identity,
            rule,
            quota,
            shadow: false,
            lease: 0,
        }
    }
}

/// FNV-1a, 128 bits: a cheap, stable hash of a few bytes (a rule's name, a quota's
/// numbers) to fold into an identity digest, which is already uniform. Not keyed: its
/// input is the operator's config, not anything a client chooses.
pub(crate) struct Fnv1a(u128);

impl Fnv1a {
    pub(crate) fn new() -> Self {
        Fnv1a(0x6c62272e07bb014262b821756295c58d)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u128::from(b);
            self.0 = self.0.wrapping_mul(0x0000000001000000000000000000013B);
        }
    }

    /// A whole word folded in one step (not FNV's byte by byte: for in-process keys, where
    /// only this process' own values meet).
    pub(crate) fn write_u64(&mut self, n: u64) {
        self.0 ^= u128::from(n);
        self.0 = self.0.wrapping_mul(0x0000000001000000000000000000013B);
    }

    pub(crate) fn finish(&self) -> u128 {
        self.0
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store timed out after {0:?}")]
    Timeout(std::time::Duration),
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    #[error("store answered unexpectedly: {0}")]
    Protocol(String),
    /// One key's state could not be used (a request of a batch; `lua/decide.lua`).
    #[error("redis: {0}")]
    Data(String),
    #[error("circuit breaker open: the store is not tried")]
    CircuitOpen,
    /// A write fewer replicas confirmed within its `WAIT` than `[store] replication` asks:
    /// its admissions are not answered as such, since a failover could lose them.
    #[error("{acked} of {wanted} replicas confirmed the write in time")]
    Unreplicated { acked: u64, wanted: u32 },
    /// The memory store has no room for a key the request would add.
    #[error(transparent)]
    Full(#[from] memory::Full),
}

impl StoreError {
    /// A problem with one key's data (wrong type, corrupt state), not with the store: the
    /// store answered, so it says nothing about the store's health. The script reports
    /// these with the error code `RATEWALL` and the key (`lua/decide.lua`).
    pub fn is_data_error(&self) -> bool {
        match self {
            StoreError::Redis(e) => matches!(e.code(), Some("RATEWALL" | "WRONGTYPE")),
            StoreError::Data(_) => true,
            _ => false,
        }
    }
}

/// Microseconds on a clock the limiter math may trust to never go backwards much.
pub trait Clock: Send + Sync + 'static {
    fn now_us(&self) -> u64;
}

/// The production clock of the memory store: µs since the UNIX epoch as it was read once,
/// when the clock was made, plus the monotonic time since. Calendar windows need UNIX
/// time; the limits need a clock that never steps back, which this one never does (a
/// wall clock stepped later by NTP is not followed: the drift is the step's).
pub struct MonotonicClock {
    started: Instant,
    started_unix_us: u64,
}

impl MonotonicClock {
    pub fn new() -> Self {
        MonotonicClock {
            started: Instant::now(),
            started_unix_us: unix_now_us(),
        }
    }
}

/// The system clock, µs since the UNIX epoch (0 for a clock set before 1970).
pub fn unix_now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros().min(u128::from(u64::MAX)) as u64)
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_us(&self) -> u64 {
        // A year is 3.2e13 µs; u64 holds half a million years.
        let elapsed = self.started.elapsed().as_micros() as u64;
        self.started_unix_us.saturating_add(elapsed)
    }
}

/// A clock that moves only when told: tests drive timelines with it.
#[derive(Default)]
pub struct ManualClock(std::sync::atomic::AtomicU64);

impl ManualClock {
    pub fn new(start_us: u64) -> Arc<Self> {
        Arc::new(ManualClock(start_us.into()))
    }
    pub fn set(&self, us: u64) {
        self.0.store(us, std::sync::atomic::Ordering::SeqCst);
    }
    pub fn advance(&self, us: u64) {
        self.0.fetch_add(us, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::num::NonZeroU64;

    /// A validated quota, for the algorithms' tests.
    pub(crate) fn quota(algorithm: Algorithm, rate: &str, burst: Option<u64>, cost: u64) -> Quota {
        Quota::new(
            algorithm,
            Rate::parse(rate).unwrap(),
            burst.and_then(NonZeroU64::new),
            NonZeroU64::new(cost).unwrap(),
        )
        .unwrap()
    }

    /// One request at `now` against one key, committed when allowed, like a store does.
    pub(crate) fn run<S: Copy + Into<State> + TryFrom<State>>(
        q: &Quota,
        st: &mut Option<S>,
        now: u64,
    ) -> Decision {
        let state = st.map(Into::into);
        let o = decide(q, state.as_ref(), now);
        if o.allowed {
            *st = S::try_from(o.next).ok();
            o.charged
        } else {
            o.uncharged
        }
    }
}

macro_rules! state_conversions {
    ($($variant:ident => $module:ident),*) => {$(
        impl From<$module::State> for State {
            fn from(s: $module::State) -> State {
                State::$variant(s)
            }
        }
        impl TryFrom<State> for $module::State {
            type Error = State;
            fn try_from(s: State) -> Result<Self, State> {
                match s {
                    State::$variant(s) => Ok(s),
                    other => Err(other),
                }
            }
        }
    )*};
}

state_conversions!(
    TokenBucket => token_bucket,
    Gcra => gcra,
    FixedWindow => fixed_window,
    SlidingWindow => sliding_window,
    Concurrency => concurrency
);
