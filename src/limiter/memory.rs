//! The embedded store: bucket states in a sharded in-process map, for one instance.
//!
//! Bounded: an entry is kept only while its bucket is below full (its TTL, exactly as in
//! Redis); [`MemoryStore::sweep`] drops the rest, and a read treats an expired entry as
//! absent, so a flood of distinct keys costs memory for at most one refill time.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Check, Clock, Decision, State};

const SHARDS: usize = 64;

/// An entry's key: the identity digest folded with the rule name, 128 bits. Two `u64`s
/// rather than a `u128`: 8-byte alignment keeps a map slot at 56 bytes, not 64.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key(u64, u64);

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Both halves are already uniformly distributed: no need to rehash.
        state.write_u64(self.0 ^ self.1);
    }
}

/// Passes a key's precomputed hash through.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `Key`s are hashed here, through write_u64; this path is a fallback.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, k: u64) {
        self.0 = k;
    }
}

#[derive(Clone, Copy)]
struct Entry {
    state: State,
    expires_us: u64,
}

type Shard = HashMap<Key, Entry, BuildHasherDefault<KeyHasher>>;

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    clock: Arc<dyn Clock>,
}

impl MemoryStore {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            clock,
        }
    }

    fn key(check: &Check<'_>) -> Key {
        let id = u128::from_le_bytes(check.identity.0);
        // FNV-1a of the rule name, spread over 128 bits.
        let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
        for b in check.rule.bytes() {
            h ^= u128::from(b);
            h = h.wrapping_mul(0x0000000001000000000000000000013B);
        }
        let k = id ^ h;
        Key(k as u64, (k >> 64) as u64)
    }

    fn shard_of(key: Key) -> usize {
        (key.1 >> 56) as usize % SHARDS
    }

    fn lock(&self, i: usize) -> MutexGuard<'_, Shard> {
        // A panic while holding a shard cannot leave an entry half-written (entries are
        // plain values), so a poisoned lock is still safe to use.
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decide all `checks` at the store's clock, all or nothing.
    pub fn decide(&self, checks: &[Check<'_>]) -> Vec<Decision> {
        self.run(checks, true)
    }

    /// What `checks` would be told now, without charging anything.
    pub fn peek(&self, checks: &[Check<'_>]) -> Vec<Decision> {
        self.run(checks, false)
    }

    /// Forget one identity's state under one rule.
    pub fn reset(&self, check: &Check<'_>) {
        let key = Self::key(check);
        self.lock(Self::shard_of(key)).remove(&key);
    }

    fn run(&self, checks: &[Check<'_>], commit: bool) -> Vec<Decision> {
        let now = self.clock.now_us();
        let keys: Vec<Key> = checks.iter().map(Self::key).collect();
        // Lock every shard involved, in index order so two requests never deadlock.
        let mut shard_ids: Vec<usize> = keys.iter().map(|&k| Self::shard_of(k)).collect();
        shard_ids.sort_unstable();
        shard_ids.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            shard_ids.iter().map(|&i| (i, self.lock(i))).collect();
        // Which of `guards` holds `key`'s shard.
        let shard = |guards: &[(usize, MutexGuard<'_, Shard>)], key: Key| -> usize {
            let i = Self::shard_of(key);
            guards.iter().position(|(j, _)| *j == i).unwrap_or(0)
        };

        let mut outcomes = Vec::with_capacity(checks.len());
        for (check, &key) in checks.iter().zip(&keys) {
            let g = shard(&guards, key);
            let state = guards[g]
                .1
                .get(&key)
                .filter(|e| e.expires_us > now)
                .map(|e| e.state);
            outcomes.push(super::decide(check.quota, state.as_ref(), now));
        }
        // The enforcing checks decide for the request; a shadow check is charged only when
        // it allows too, as if it had been enforced.
        let all = commit
            && outcomes
                .iter()
                .zip(checks)
                .all(|(o, c)| o.allowed || c.shadow);
        let charged = |o: &super::Outcome<State>| all && o.allowed;
        for (o, &key) in outcomes.iter().zip(&keys) {
            if charged(o) {
                let g = shard(&guards, key);
                guards[g].1.insert(
                    key,
                    Entry {
                        state: o.next,
                        expires_us: now.saturating_add(o.ttl_us),
                    },
                );
            }
        }
        outcomes
            .iter()
            .map(|o| if charged(o) { o.charged } else { o.uncharged })
            .collect()
    }

    /// A request counted by a concurrency check has ended: give its slot back.
    pub fn release(&self, check: &Check<'_>) {
        let key = Self::key(check);
        let mut shard = self.lock(Self::shard_of(key));
        let held = match shard.get(&key).map(|e| e.state) {
            Some(State::Concurrency(s)) => Some(s),
            // Another algorithm's state now (the rule changed on reload): nothing to give.
            _ => return,
        };
        match super::concurrency::release(held.as_ref()) {
            Some(s) => {
                shard.insert(
                    key,
                    Entry {
                        state: State::Concurrency(s),
                        expires_us: u64::MAX,
                    },
                );
            }
            None => {
                shard.remove(&key);
            }
        }
    }

    /// Drop every entry whose bucket has refilled. Returns how many remain.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_us();
        let mut left = 0;
        for i in 0..self.shards.len() {
            let mut shard = self.lock(i);
            shard.retain(|_, e| e.expires_us > now);
            if shard.capacity() > 64 && shard.len() < shard.capacity() / 4 {
                shard.shrink_to_fit();
            }
            left += shard.len();
        }
        left
    }

    /// How many entries are held now (expired ones included until the next sweep).
    pub fn len(&self) -> usize {
        (0..self.shards.len()).map(|i| self.lock(i).len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Rate;
    use crate::limiter::{Algorithm, IdentityDigest, ManualClock, Quota};
    use std::num::NonZeroU64;
    use std::time::Duration;

    fn quota(count: u64, burst: u64) -> Quota {
        Quota::new(
            Algorithm::TokenBucket,
            Rate {
                count,
                period: Duration::from_secs(1),
            },
            NonZeroU64::new(burst),
            NonZeroU64::MIN,
        )
        .unwrap()
    }

    fn id(n: u32) -> IdentityDigest {
        let mut d = [0u8; 16];
        d[..4].copy_from_slice(&n.to_le_bytes());
        d[15] = n as u8;
        IdentityDigest(d)
    }

    #[test]
    fn keys_and_rules_have_separate_buckets() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new(clock.clone());
        let q = quota(1, 2);
        let (a, b) = (id(1), id(2));
        let check = |d, rule| Check::new(d, rule, &q);
        assert!(store.decide(&[check(&a, "r1")])[0].allowed);
        assert!(store.decide(&[check(&a, "r1")])[0].allowed);
        assert!(!store.decide(&[check(&a, "r1")])[0].allowed);
        assert!(
            store.decide(&[check(&b, "r1")])[0].allowed,
            "other key unaffected"
        );
        assert!(
            store.decide(&[check(&a, "r2")])[0].allowed,
            "other rule unaffected"
        );
    }

    #[test]
    fn a_denied_request_charges_no_rule() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new(clock.clone());
        let (wide, tight) = (quota(10, 10), quota(1, 1));
        let a = id(7);
        let both = [
            Check::new(&a, "wide", &wide),
            Check::new(&a, "tight", &tight),
        ];
        let d = store.decide(&both);
        assert!(d[0].allowed && d[1].allowed);
        assert_eq!(d[0].remaining, 9);
        let d = store.decide(&both);
        assert!(!d[1].allowed);
        assert_eq!(d[0].remaining, 9, "the wide rule was not charged");
        let d = store.decide(&both[..1]);
        assert_eq!(d[0].remaining, 8);
    }

    #[test]
    fn a_shadow_check_never_denies_and_is_charged_only_when_it_allows() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new(clock.clone());
        let (wide, tight) = (quota(10, 10), quota(1, 1));
        let a = id(3);
        let both = [
            Check::new(&a, "wide", &wide),
            Check {
                shadow: true,
                ..Check::new(&a, "watch", &tight)
            },
        ];
        let d = store.decide(&both);
        assert!(d[0].allowed && d[1].allowed);
        assert_eq!((d[0].remaining, d[1].remaining), (9, 0), "both charged");
        let d = store.decide(&both);
        assert!(d[0].allowed, "the shadow denial blocks nothing");
        assert!(!d[1].allowed, "but is reported");
        assert_eq!(d[0].remaining, 8, "the enforcing rule was charged");
        // An enforcing denial charges no shadow rule either.
        let strict = quota(1, 1);
        let watch = quota(10, 10);
        let b = id(4);
        let deny_then_watch = [
            Check::new(&b, "strict", &strict),
            Check {
                shadow: true,
                ..Check::new(&b, "watch2", &watch)
            },
        ];
        store.decide(&deny_then_watch);
        let d = store.decide(&deny_then_watch);
        assert!(!d[0].allowed);
        assert_eq!(
            d[1].remaining, 9,
            "one charge, from the request that passed"
        );
    }

    #[test]
    fn concurrency_slots_are_taken_and_given_back() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new(clock.clone());
        let q = Quota::concurrency(NonZeroU64::new(2).unwrap(), Duration::from_secs(10));
        let a = id(9);
        let c = [Check::new(&a, "conc", &q)];
        assert!(store.decide(&c)[0].allowed);
        assert!(store.decide(&c)[0].allowed);
        assert!(!store.decide(&c)[0].allowed);
        // Time frees nothing, and a sweep keeps slots in use.
        clock.advance(3_600_000_000);
        store.sweep();
        assert!(!store.decide(&c)[0].allowed);
        store.release(&c[0]);
        assert_eq!(store.decide(&c)[0].remaining, 0, "one freed, taken again");
        store.release(&c[0]);
        store.release(&c[0]);
        assert!(store.is_empty(), "no entry once none is in flight");
        store.release(&c[0]);
        assert!(
            store.decide(&c)[0].allowed,
            "an extra release frees nothing twice"
        );
        assert_eq!(store.decide(&c)[0].remaining, 0);
    }

    #[test]
    fn idle_keys_are_evicted() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new(clock.clone());
        let q = quota(10, 10);
        for n in 0..10_000 {
            let d = id(n);
            store.decide(&[Check::new(&d, "r", &q)]);
        }
        assert_eq!(store.sweep(), 10_000);
        // One token at 10/s refills in 100 ms: past that every bucket is full again.
        clock.advance(99_999);
        assert_eq!(store.sweep(), 10_000);
        clock.advance(1);
        assert_eq!(store.sweep(), 0);
        assert!(store.is_empty());
    }

    #[test]
    fn an_expired_entry_reads_as_full() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new(clock.clone());
        let q = quota(1, 3);
        let a = id(3);
        let c = [Check::new(&a, "r", &q)];
        store.decide(&c);
        clock.advance(5_000_000);
        assert_eq!(store.decide(&c)[0].remaining, 2);
    }
}
