//! Rate-limit decisions: the algorithms as pure integer step functions
//! ([`token_bucket`]) and the stores that run them ([`memory`], [`redis`]).
//!
//! The store boundary is one call per request, [`Store::decide`]: every rule that applies
//! to the request is checked together, and either all of them are charged or none is, so a
//! request that one rule denies consumes nothing from the others.

pub mod memory;
pub mod redis;
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
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::FixedWindow => "fixed_window",
        }
    }

    /// Whether this build runs the algorithm (the others are rejected at load).
    pub fn is_available(self) -> bool {
        matches!(self, Algorithm::TokenBucket)
    }
}

/// A rule's limit, in the exact integer form the step functions use.
///
/// A token bucket holding `burst` tokens and refilling `rate.count` tokens per
/// `rate.period` is kept in *units*: one token is `unit` units and `per_us` units drip in
/// every microsecond. `unit / per_us` is the period divided by the count, reduced by their
/// greatest common divisor, so no refill is ever rounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub algorithm: Algorithm,
    pub rate: Rate,
    pub burst: u64,
    pub cost: u64,
    pub unit: u64,
    pub per_us: u64,
}

impl Quota {
    pub fn new(
        algorithm: Algorithm,
        rate: Rate,
        burst: Option<NonZeroU64>,
        cost: NonZeroU64,
    ) -> Result<Quota, String> {
        let burst = burst.map_or(rate.count, NonZeroU64::get);
        let cost = cost.get();
        if cost > burst {
            return Err(format!(
                "cost {cost} is more than burst {burst}: no request could ever pass"
            ));
        }
        let period_us = u64::try_from(rate.period.as_micros())
            .map_err(|_| format!("rate {rate}: the period is too long"))?;
        let g = gcd(rate.count, period_us);
        let (unit, per_us) = (period_us / g, rate.count / g);
        let capacity = burst.checked_mul(unit).filter(|&c| c <= MAX_LEVEL);
        if capacity.is_none() {
            return Err(format!(
                "rate {rate} with burst {burst} needs more precision than Redis' Lua numbers hold (2^52); lower the burst or use a rounder rate"
            ));
        }
        Ok(Quota {
            algorithm,
            rate,
            burst,
            cost,
            unit,
            per_us,
        })
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
        write!(f, "{} burst {}", self.rate, self.burst)?;
        if self.cost != 1 {
            write!(f, " cost {}", self.cost)?;
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
    /// When denied: microseconds until this request would pass. 0 when allowed.
    pub retry_after_us: u64,
    /// Microseconds until the full quota is available again.
    pub reset_us: u64,
}

/// One identity under one rule: what a store needs to find and judge its state.
#[derive(Debug, Clone)]
pub struct Check<'a> {
    /// The hashed identity (never the raw key).
    pub identity: &'a IdentityDigest,
    /// The rule's name, the last part of the Redis key.
    pub rule: &'a str,
    pub quota: &'a Quota,
}

/// A 128-bit digest of an identity. Rendered as hex in Redis key names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdentityDigest(pub [u8; 16]);

impl IdentityDigest {
    pub fn hex(&self) -> String {
        let mut s = String::with_capacity(32);
        for b in self.0 {
            s.push(char::from_digit((b >> 4) as u32, 16).unwrap_or('0'));
            s.push(char::from_digit((b & 0xf) as u32, 16).unwrap_or('0'));
        }
        s
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store timed out after {0:?}")]
    Timeout(std::time::Duration),
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    #[error("store answered unexpectedly: {0}")]
    Protocol(String),
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

/// The one store a gateway runs: embedded memory, or Redis shared by many gateways.
pub enum Store {
    Memory(memory::MemoryStore),
    Redis(redis::RedisStore),
}

impl Store {
    /// Decide one request against every rule in `checks`, all or nothing.
    /// The answer has one [`Decision`] per check, in order.
    pub async fn decide(&self, checks: &[Check<'_>]) -> Result<Vec<Decision>, StoreError> {
        match self {
            Store::Memory(m) => Ok(m.decide(checks)),
            Store::Redis(r) => r.decide(checks, None).await,
        }
    }

    /// Whether the store answers now (for /readyz).
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::Redis(r) => r.ping().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
    }
}
