//! What the decision service hands out and holds until its holder comes back: a
//! reservation (the charges of a decision whose rules settle, until `POST /v1/settle`
//! or its rule's `settle_within`, when it stands as charged) and a lease (a concurrency
//! slot, until `DELETE` or its TTL passes unrenewed, when it is given back).
//!
//! Each is named by 128 random bits from the OS (the name is the capability: whoever
//! holds it may settle or give back, and nobody can guess one), taken at most once (a
//! reservation settled twice is settled once: the second call finds nothing), and held
//! in this process. Their number is bounded: past [`MAX_HELD`] of a kind, a call that
//! would hold one more is answered 503.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::limiter::lease::Leases;
use crate::settle::Settling;

/// The most reservations, and apart the most leases, held at once.
pub const MAX_HELD: usize = 100_000;

/// How often lapsed grants are looked for.
const SWEEP_EVERY: Duration = Duration::from_millis(250);

/// A lease held for a caller of the decision service.
pub struct HeldLease {
    pub leases: Leases,
    pub ttl: Duration,
    deadline: Instant,
}

#[derive(Default)]
pub struct Grants {
    reservations: Mutex<HashMap<u128, (Settling, Instant)>>,
    leases: Mutex<HashMap<u128, HeldLease>>,
}

/// Past [`MAX_HELD`] (or with no random name to give): nothing more is held until some
/// are settled or lapse.
#[derive(Debug)]
pub struct Full;

impl Grants {
    /// An empty table, and its sweeper on the current runtime (it ends once the table
    /// is dropped).
    pub fn start() -> Arc<Grants> {
        let grants = Arc::new(Grants::default());
        let weak = Arc::downgrade(&grants);
        tokio::spawn(sweep(weak));
        grants
    }

    /// Hold `settling` until `within` has passed; its name.
    pub fn reserve(&self, settling: Settling, within: Duration) -> Result<u128, Full> {
        let mut held = lock(&self.reservations);
        if held.len() >= MAX_HELD {
            return Err(Full);
        }
        let id = fresh_id().ok_or(Full)?;
        held.insert(id, (settling, Instant::now() + within));
        Ok(id)
    }

    /// The reservation named `id`, taken out (once).
    pub fn take_reservation(&self, id: u128) -> Option<Settling> {
        lock(&self.reservations).remove(&id).map(|(s, _)| s)
    }

    /// Hold `leases` for `ttl` unless renewed; its name.
    pub fn lease(&self, leases: Leases, ttl: Duration) -> Result<u128, Full> {
        let mut held = lock(&self.leases);
        if held.len() >= MAX_HELD {
            return Err(Full);
        }
        let id = fresh_id().ok_or(Full)?;
        let deadline = Instant::now() + ttl;
        held.insert(
            id,
            HeldLease {
                leases,
                ttl,
                deadline,
            },
        );
        Ok(id)
    }

    /// The lease named `id`, taken out (to give back, or to renew and put back).
    pub fn take_lease(&self, id: u128) -> Option<HeldLease> {
        lock(&self.leases).remove(&id)
    }

    /// Put a renewed lease back, for another `ttl` from now.
    pub fn put_back(&self, id: u128, mut lease: HeldLease) {
        lease.deadline = Instant::now() + lease.ttl;
        lock(&self.leases).insert(id, lease);
    }

    /// Drop what has lapsed: reservations stand as charged, leases are given back (their
    /// `Drop` releases them).
    fn lapse(&self, now: Instant) {
        for (_, (settling, _)) in lock(&self.reservations).extract_if(|_, (_, d)| *d <= now) {
            // Standing as charged: nothing is sent.
            settling.stand();
        }
        lock(&self.leases).retain(|_, l| l.deadline > now);
    }

    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        (lock(&self.reservations).len(), lock(&self.leases).len())
    }
}

async fn sweep(grants: Weak<Grants>) {
    let mut every = tokio::time::interval(SWEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(g) = grants.upgrade() else { return };
        g.lapse(Instant::now());
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the table leaves it as it was between two whole steps.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// 128 bits from the OS's generator; none where it fails (it does not on Linux), and
/// then nothing is held.
fn fresh_id() -> Option<u128> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new().fill(&mut bytes).ok()?;
    Some(u128::from_le_bytes(bytes))
}

/// A grant's name as callers see it: 32 hex digits.
pub fn name(id: u128) -> String {
    format!("{id:032x}")
}

/// The grant a name names, if it is one.
pub fn parse(name: &str) -> Option<u128> {
    if name.len() != 32 {
        return None;
    }
    u128::from_str_radix(name, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_refused() {
        let id = fresh_id().expect("the OS's generator");
        assert_eq!(parse(&name(id)), Some(id));
        assert_eq!(parse("xyz"), None);
        assert_eq!(parse(&"g".repeat(32)), None);
        assert_ne!(fresh_id(), fresh_id());
    }

    #[tokio::test]
    async fn a_table_is_empty_at_first() {
        let g = Grants::start();
        assert_eq!(g.counts(), (0, 0));
        assert!(g.take_reservation(1).is_none());
        assert!(g.take_lease(1).is_none());
    }
}
