//! Rate-limit decisions: the algorithms as pure integer step functions
//! ([`token_bucket`], [`gcra`], [`sliding_window`], [`fixed_window`]) and the stores that
//! run them ([`memory`], [`redis`]).
//!
//! Every algorithm has one shape: `decide(quota, state, now) -> Outcome`, pure, in
//! integers, with time injected. The outcome says what to answer whether or not the
//! request is finally charged, and what to store if it is.
//!
//! The store boundary is one call per request, [`Store::decide`]: every rule that applies
//! to the request is checked together, and either all of them are charged or none is, so a
//! request that one rule denies consumes nothing from the others.

pub mod concurrency;
pub mod deny_cache;
pub mod fixed_window;
pub mod gcra;
pub mod guard;
pub mod lease;
pub mod memory;
#[cfg(test)]
mod properties;
pub mod redis;
pub mod sliding_window;
pub mod token_bucket;

use std::fmt;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Instant;

use serde::Deserialize;

use crate::config::Rate;

/// Largest level a bucket may hold, in its units. Redis runs Lua 5.1, whose numbers are
/// IEEE doubles: every integer the script computes must stay below 2^53 to be exact.
pub const MAX_LEVEL: u64 = 1 << 52;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    #[default]
    TokenBucket,
    Gcra,
    SlidingWindow,
    FixedWindow,
    /// Not a rate: at most N requests in flight per identity (`max_in_flight`, not an
    /// `algorithm` value in the file).
    #[serde(skip_deserializing)]
    Concurrency,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// Whether `burst` means anything: the windows admit the rate's N per window.
    pub fn has_burst(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::Gcra)
    }

    /// Whether a request may wait for its tokens (`max_delay`): the buckets can reserve
    /// tokens ahead; a window cannot.
    pub fn can_delay(self) -> bool {
        self.has_burst()
    }

    /// The algorithm's number in the Redis script's arguments (`lua/decide.lua`).
    pub fn code(self) -> u8 {
        match self {
            Algorithm::TokenBucket => 1,
            Algorithm::Gcra => 2,
            Algorithm::FixedWindow => 3,
            Algorithm::SlidingWindow => 4,
            Algorithm::Concurrency => 5,
        }
    }
}

/// A rule's limit, in the exact integer form the step functions use.
///
/// A token bucket (or GCRA) holding `burst` tokens and refilling `rate.count` tokens per
/// `rate.period` is kept in *units*: one token is `unit` units and `per_us` units drip in
/// every microsecond. `unit / per_us` is the period divided by the count, reduced by their
/// greatest common divisor, so no refill is ever rounded. The windows count requests
/// against `rate.count` per `rate.period`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub algorithm: Algorithm,
    pub rate: Rate,
    pub burst: u64,
    pub cost: u64,
    pub unit: u64,
    pub per_us: u64,
    /// How long a request may wait for its tokens instead of being denied, in µs (0: never
    /// waits). Token bucket and GCRA only.
    pub max_delay_us: u64,
    /// Concurrency only: how long a lease in a shared store lives without renewal, in µs.
    pub lease_us: u64,
}

/// Why a quota cannot be, and which of its settings to blame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct QuotaError {
    pub field: QuotaField,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaField {
    Rate,
    Burst,
    Cost,
    MaxDelay,
}

impl QuotaField {
    pub fn name(self) -> &'static str {
        match self {
            QuotaField::Rate => "rate",
            QuotaField::Burst => "burst",
            QuotaField::Cost => "cost",
            QuotaField::MaxDelay => "max_delay",
        }
    }
}

impl Quota {
    pub fn new(
        algorithm: Algorithm,
        rate: Rate,
        burst: Option<NonZeroU64>,
        cost: NonZeroU64,
    ) -> Result<Quota, QuotaError> {
        let fail = |field, message| QuotaError { field, message };
        let cost = cost.get();
        let period_us = u64::try_from(rate.period.as_micros())
            .ok()
            .filter(|&p| p <= MAX_LEVEL)
            .ok_or_else(|| {
                fail(
                    QuotaField::Rate,
                    format!("rate {rate}: the period is too long"),
                )
            })?;
        let burst = if algorithm.has_burst() {
            burst.map_or(rate.count, NonZeroU64::get)
        } else if let Some(b) = burst {
            return Err(fail(
                QuotaField::Burst,
                format!(
                    "burst = {b} does not apply to {}: a window admits the rate's N ({}) per window",
                    algorithm.name(),
                    rate.count
                ),
            ));
        } else {
            rate.count
        };
        if cost > burst {
            let what = if algorithm.has_burst() {
                "burst"
            } else {
                "the rate's N"
            };
            return Err(fail(
                QuotaField::Cost,
                format!("cost {cost} is more than {what} {burst}: no request could ever pass"),
            ));
        }
        let g = gcd(rate.count, period_us);
        let (unit, per_us) = (period_us / g, rate.count / g);
        // The largest product each algorithm computes must stay exact in Lua's doubles.
        let largest = match algorithm {
            Algorithm::TokenBucket | Algorithm::Gcra => burst.checked_mul(unit),
            // prev·(P-e) + cur·P + cost·P, each term at most N·P.
            Algorithm::SlidingWindow => rate
                .count
                .checked_mul(period_us)
                .and_then(|v| v.checked_mul(3)),
            Algorithm::FixedWindow | Algorithm::Concurrency => Some(rate.count),
        };
        if largest.is_none_or(|v| v > MAX_LEVEL) {
            let field = if algorithm.has_burst() {
                QuotaField::Burst
            } else {
                QuotaField::Rate
            };
            return Err(fail(
                field,
                format!(
                    "rate {rate} with burst {burst} needs more precision than Redis' Lua numbers hold (2^52); lower the burst or use a rounder rate"
                ),
            ));
        }
        Ok(Quota {
            algorithm,
            rate,
            burst,
            cost,
            unit,
            per_us,
            max_delay_us: 0,
            lease_us: 0,
        })
    }

    /// A limit of `max` requests in flight; leases in a shared store live `lease` unless
    /// renewed.
    pub fn concurrency(max: NonZeroU64, lease: std::time::Duration) -> Quota {
        let max = max.get().min(MAX_LEVEL);
        Quota {
            algorithm: Algorithm::Concurrency,
            // q= in RateLimit-Policy; the period is not used.
            rate: Rate {
                count: max,
                period: std::time::Duration::from_secs(1),
            },
            burst: max,
            cost: 1,
            unit: 1,
            per_us: 1,
            max_delay_us: 0,
            lease_us: u64::try_from(lease.as_micros())
                .unwrap_or(u64::MAX)
                .min(MAX_LEVEL),
        }
    }

    /// The same limit, letting a request wait up to `max_delay` for its tokens.
    pub fn with_max_delay(self, max_delay: std::time::Duration) -> Result<Quota, QuotaError> {
        let fail = |message| QuotaError {
            field: QuotaField::MaxDelay,
            message,
        };
        if !self.algorithm.can_delay() {
            return Err(fail(format!(
                "max_delay applies to token_bucket and gcra, not {}",
                self.algorithm.name()
            )));
        }
        let us = u64::try_from(max_delay.as_micros()).unwrap_or(u64::MAX);
        let q = Quota {
            max_delay_us: us,
            ..self
        };
        let fits = us
            .checked_mul(q.per_us)
            .and_then(|s| s.checked_add(q.capacity()))
            .is_some_and(|v| v <= MAX_LEVEL);
        if !fits {
            return Err(fail(format!(
                "max_delay {} with rate {} needs more precision than Redis' Lua numbers hold (2^52); lower it",
                humantime::format_duration(max_delay),
                q.rate
            )));
        }
        Ok(q)
    }

    /// How far below empty a bucket may go for requests waiting on their tokens, in units.
    pub fn slack(&self) -> u64 {
        self.max_delay_us * self.per_us
    }

    /// The period in µs (validated to fit at load).
    pub fn period_us(&self) -> u64 {
        self.rate.period.as_micros() as u64
    }

    /// The bucket's size, in units.
    pub fn capacity(&self) -> u64 {
        self.burst * self.unit
    }

    /// What one request takes, in units.
    pub fn need(&self) -> u64 {
        self.cost * self.unit
    }
}

impl fmt::Display for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.algorithm == Algorithm::Concurrency {
            return write!(f, "{} in flight", self.burst);
        }
        write!(f, "{}", self.rate)?;
        if self.algorithm.has_burst() {
            write!(f, " burst {}", self.burst)?;
        }
        if self.cost != 1 {
            write!(f, " cost {}", self.cost)?;
        }
        if self.max_delay_us > 0 {
            let d = std::time::Duration::from_micros(self.max_delay_us);
            write!(f, " max_delay {}", humantime::format_duration(d))?;
        }
        Ok(())
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// What one rule said about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// Whole requests (of cost 1) still allowed now, after this request if it was charged.
    pub remaining: u64,
    /// When denied: microseconds until this request would pass. When allowed: how long it
    /// waits for its reserved tokens before it is forwarded (`max_delay`), usually 0.
    pub retry_after_us: u64,
    /// Microseconds until the full quota is available again.
    pub reset_us: u64,
}

/// One rule's verdict on one request, before anything is written. A request passes only
/// if every rule allows it; then each rule's `next` state is stored (for `ttl_us`) and
/// `charged` is reported, else nothing is stored and `uncharged` is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome<S> {
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
pub fn decide(q: &Quota, state: Option<&State>, now_us: u64) -> Outcome<State> {
    fn wrap<S>(o: Outcome<S>, f: impl FnOnce(S) -> State) -> Outcome<State> {
        Outcome {
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

/// A 128-bit digest of an identity. Rendered as hex in Redis key names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdentityDigest(pub [u8; 16]);

impl IdentityDigest {
    /// The first 8 hex digits, as logs and the status page show an identity; no allocation.
    pub fn short_hex(&self) -> ShortHex {
        let mut s = [0u8; 8];
        for (i, b) in self.0[..4].iter().enumerate() {
            s[2 * i] = b"0123456789abcdef"[usize::from(b >> 4)];
            s[2 * i + 1] = b"0123456789abcdef"[usize::from(b & 0xf)];
        }
        ShortHex(s)
    }

    pub fn hex(&self) -> String {
        let mut s = String::with_capacity(32);
        self.push_hex(&mut s);
        s
    }

    /// Append the 32 lowercase hex digits to `out`.
    pub fn push_hex(&self, out: &mut String) {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        for b in self.0 {
            out.push(char::from(DIGITS[usize::from(b >> 4)]));
            out.push(char::from(DIGITS[usize::from(b & 0xf)]));
        }
    }
}

/// 8 lowercase hex digits of an identity digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShortHex([u8; 8]);

impl ShortHex {
    pub fn as_str(&self) -> &str {
        // Hex digits are ASCII.
        std::str::from_utf8(&self.0).unwrap_or("????????")
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

/// The production clock of the memory store: monotonic, from process start.
pub struct MonotonicClock(Instant);

impl MonotonicClock {
    pub fn new() -> Self {
        MonotonicClock(Instant::now())
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_us(&self) -> u64 {
        // A year is 3.2e13 µs; u64 holds half a million years.
        self.0.elapsed().as_micros() as u64
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

/// The one store a gateway runs: embedded memory, or Redis (one, or a cluster) shared by
/// many gateways.
pub enum Store {
    Memory(memory::MemoryStore),
    Redis(redis::RedisStore),
    RedisCluster(Box<redis::RedisClusterStore>),
}

impl Store {
    /// Decide one request against every rule in `checks`, all or nothing.
    /// The answer has one [`Decision`] per check, in order.
    pub async fn decide(&self, checks: &[Check<'_>]) -> Result<Vec<Decision>, StoreError> {
        match self {
            Store::Memory(m) => Ok(m.decide(checks)?),
            Store::Redis(r) => r.decide(checks, None).await,
            Store::RedisCluster(c) => c.decide(checks, None).await,
        }
    }

    /// What `checks` would be told now, charging nothing (the admin API's inspect).
    pub async fn peek(&self, checks: &[Check<'_>]) -> Result<Vec<Decision>, StoreError> {
        match self {
            Store::Memory(m) => Ok(m.peek(checks)),
            Store::Redis(r) => r.peek(checks, None).await,
            Store::RedisCluster(c) => c.peek(checks, None).await,
        }
    }

    /// Forget one identity's state under one rule (the admin API's reset).
    pub async fn reset(&self, check: &Check<'_>) -> Result<(), StoreError> {
        match self {
            Store::Memory(m) => {
                m.reset(check);
                Ok(())
            }
            Store::Redis(r) => r.reset(check).await,
            Store::RedisCluster(c) => c.reset(check).await,
        }
    }

    /// Give back the slot of a concurrency check whose request ended.
    pub async fn release(&self, check: &Check<'_>) -> Result<(), StoreError> {
        match self {
            Store::Memory(m) => {
                m.release(check);
                Ok(())
            }
            Store::Redis(r) => r.release(check).await,
            Store::RedisCluster(c) => c.release(check).await,
        }
    }

    /// Keep a concurrency lease alive while its request is in flight (shared stores; the
    /// memory store's slots live as long as the process). `false`: the lease was gone.
    pub async fn renew(&self, check: &Check<'_>) -> Result<bool, StoreError> {
        match self {
            Store::Memory(_) => Ok(true),
            Store::Redis(r) => r.renew(check).await,
            Store::RedisCluster(c) => c.renew(check).await,
        }
    }

    /// Connect and load scripts ahead of the first request (shared stores).
    pub async fn warm(&self) -> Result<(), StoreError> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::Redis(r) => r.warm().await,
            Store::RedisCluster(c) => c.warm().await,
        }
    }

    /// Whether gateways share this store (and its leases must outlive none of them).
    pub fn is_shared(&self) -> bool {
        !matches!(self, Store::Memory(_))
    }

    /// Whether the store answers now (for /readyz).
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::Redis(r) => r.ping().await,
            Store::RedisCluster(c) => c.ping().await,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

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

    fn rate(count: u64, secs: u64) -> Rate {
        Rate {
            count,
            period: Duration::from_secs(secs),
        }
    }

    #[test]
    fn quota_units_are_reduced_exactly() {
        let q = Quota::new(Algorithm::TokenBucket, rate(3, 1), None, NonZeroU64::MIN).unwrap();
        // 3 tokens per 1_000_000 µs: a token is 1_000_000 units, 3 drip in per µs.
        assert_eq!((q.unit, q.per_us, q.burst), (1_000_000, 3, 3));
        let q = Quota::new(
            Algorithm::TokenBucket,
            rate(1_000_000, 86_400),
            None,
            NonZeroU64::MIN,
        )
        .unwrap();
        assert_eq!((q.unit, q.per_us), (86_400, 1));
        assert_eq!(q.capacity(), 86_400_000_000);
    }

    #[test]
    fn quota_rejects_cost_above_burst_and_overflow() {
        let c3 = NonZeroU64::new(3).unwrap();
        assert!(Quota::new(Algorithm::TokenBucket, rate(10, 1), NonZeroU64::new(2), c3).is_err());
        assert!(Quota::new(Algorithm::FixedWindow, rate(2, 1), None, c3).is_err());
        assert!(Quota::new(Algorithm::SlidingWindow, rate(3, 1), None, c3).is_ok());
        let burst_on_window = Quota::new(
            Algorithm::SlidingWindow,
            rate(3, 1),
            NonZeroU64::new(3),
            NonZeroU64::MIN,
        );
        assert!(burst_on_window
            .unwrap_err()
            .message
            .contains("does not apply"));
        // 2^52 / 86_400_000_000 µs is about 52_000 per day for a sliding window.
        assert!(Quota::new(
            Algorithm::SlidingWindow,
            rate(60_000, 86_400),
            None,
            NonZeroU64::MIN
        )
        .is_err());
        assert!(Quota::new(
            Algorithm::FixedWindow,
            rate(60_000, 86_400),
            None,
            NonZeroU64::MIN
        )
        .is_ok());
        assert!(Quota::new(
            Algorithm::TokenBucket,
            rate(7, 86_400),
            NonZeroU64::new(u64::MAX / 2),
            NonZeroU64::MIN
        )
        .is_err());
    }

    #[test]
    fn digest_hex_is_32_lowercase_chars() {
        let d = IdentityDigest([0xab; 16]);
        assert_eq!(d.hex(), "ab".repeat(16));
        let mut b = [0u8; 16];
        b[..4].copy_from_slice(&[0x01, 0x9f, 0xe0, 0x7c]);
        let d = IdentityDigest(b);
        assert_eq!(d.short_hex().as_str(), &d.hex()[..8]);
        assert_eq!(d.short_hex().as_str(), "019fe07c");
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
