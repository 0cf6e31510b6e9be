//! The embedded store: bucket states in a sharded in-process map, for one instance.
//!
//! # Bounded twice
//!
//! By time: an entry is kept only while its state differs from no state (a bucket below
//! full, a window not yet over: its TTL, exactly as in Redis); [`MemoryStore::sweep`]
//! drops the rest every second, and a read treats an expired entry as absent.
//!
//! By count: at most `max_keys` entries (`[store] max_keys`), split evenly over the
//! shards (a key's shard is picked by a hash keyed afresh in each process, so no client
//! can aim its keys at one shard). A shard that is full makes room for a new key by
//! dropping, in this order:
//! 1. an entry that has expired — equivalent to no entry, so dropping it changes nothing
//!    (the least recently used ends are looked at first, then the whole shard is swept, at
//!    most once per [`SWEEP_GAP`]);
//! 2. the least recently used entry that is not *held*. An entry is held while its
//!    identity is being denied: from a denial, or from a charge that left it unable to
//!    pay for its next request, until a charge leaves it able to again, or until it is
//!    whole again (expired).
//!
//! A held entry is never dropped: that would hand the identity being limited a fresh
//! burst, and the very client the limit is for could buy one by flooding new keys (keys
//! that are themselves denied fill a shard with held entries as surely as any). When every
//! entry of a full shard is held, a new key is *refused* instead: nothing is stored for
//! it, and its request is denied like any other (429), told to come back when the
//! soonest held entry could be whole again (a bound each shard keeps: exact after a
//! sweep, else sooner), and counted (`ratewall_store_refused_keys_total`). Identities the store
//! already tracks are decided as ever; new ones wait until the flood's own states expire.
//!
//! Concurrency entries are never dropped either (requests in flight hold them); a request
//! that finds nothing but those fails with [`Full`] (the gateway's `on_error`).
//!
//! Recency is exact within a shard: three linked lists through the slots (free, held,
//! pinned), most recent first, so every step above is O(1). Keys hash evenly over the
//! shards, so a full store evicts close to its globally least recently used keys.
//!
//! The worst case: a client rotating API keys fills the store only as fast as its
//! requests are admitted; a `client_ip` rule bounds that (docs/operations.md works the
//! numbers).
//!
//! # Small
//!
//! One tracked key costs a 48-byte slot in a dense array (at most a sixteenth of it spare)
//! plus a 4-byte position and a control byte in a hash table over it (44% to 87.5% full).
//! `examples/measure_memory.rs` measures the bytes per key; docs/performance.md has the
//! figures.

use std::sync::{Arc, Mutex, MutexGuard};

use prometheus_client::metrics::counter::Counter;

use super::metrics::{EvictionLabels, LimiterMetrics};
use super::store::{Call, Kind, Receipt, Settlement, Store};
use super::{Check, Clock, Decision, Fnv1a, State, StoreError};
use smallvec::SmallVec;

/// A request's per-check scratch, inline for the few rules a request meets (no
/// allocation on the request path), on the heap past that.
type Small<T> = SmallVec<[T; 4]>;

mod shard;
use shard::{Key, NoRoom, Shard, Slot, KEY_MASK};

/// Shards at most; a small store has fewer (one per [`KEYS_PER_SHARD`]), so that the
/// per-shard bound is the whole store's and eviction order is exact.
const MAX_SHARDS: usize = 64;
const KEYS_PER_SHARD: usize = 16_384;

/// A full shard sweeps itself for expired entries at most this often (µs): a sweep is a
/// pass over the shard, and in a flood of short-lived keys the least recently used end
/// expires first anyway.
pub const SWEEP_GAP: u64 = 10_000;

/// The default of `[store] max_keys`.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// The memory store's shard is full of entries counting requests in flight (concurrency
/// limits): the new key is not stored, and its request gets the store's `on_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the memory store is full (max_keys) of requests in flight")]
pub struct Full;

/// What a full in-process store did for a new key: dropped an entry to make room
/// (`ratewall_store_evictions_total`, by reason), or refused the key
/// (`ratewall_store_refused_keys_total`).
#[derive(Clone, Default)]
pub struct Pressure {
    /// Expired entries (equivalent to none) dropped before the sweep would have.
    pub expired: Counter,
    /// Live entries that were not held, least recently used first.
    pub lru: Counter,
    /// New keys not stored, their requests denied: every entry of their shard was held.
    pub refused: Counter,
}

impl Pressure {
    /// The counters of the in-process store `store` (`memory`, or `local`: the
    /// `on_error = "local"` fallback).
    pub fn of(metrics: &LimiterMetrics, store: &'static str) -> Pressure {
        let counter = |reason| {
            metrics
                .memory_evictions
                .get_or_create(&EvictionLabels { store, reason })
                .clone()
        };
        Pressure {
            expired: counter("expired"),
            lru: counter("lru"),
            refused: metrics.refused_keys(store),
        }
    }
}

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    clock: Arc<dyn Clock>,
    pressure: Pressure,
    /// Picks a key's shard: keyed afresh in every process, so that no client can choose
    /// API keys that all land in one shard (and fill it with states it holds).
    shard_seed: [u64; 3],
}

/// One check's place in the store while a request is decided.
struct Place {
    shard: usize,
    key: Key,
    /// Its slot's position when the request was looked up.
    at: Option<usize>,
}

/// Which of `guards` holds shard `i` (every check's shard is locked).
fn held(guards: &[(usize, MutexGuard<'_, Shard>)], i: usize) -> Option<usize> {
    guards.iter().position(|(j, _)| *j == i)
}

impl MemoryStore {
    /// A store of at most [`DEFAULT_MAX_KEYS`] keys.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::bounded(clock, DEFAULT_MAX_KEYS, Pressure::default())
    }

    /// A store of at most `max_keys` keys (at least one per shard), counting what it drops
    /// to make room, and the keys it refuses, in `pressure`.
    pub fn bounded(clock: Arc<dyn Clock>, max_keys: usize, pressure: Pressure) -> Self {
        let shards = (max_keys / KEYS_PER_SHARD)
            .next_power_of_two()
            .clamp(1, MAX_SHARDS);
        let cap = (max_keys / shards).max(1);
        MemoryStore {
            shards: (0..shards).map(|_| Mutex::new(Shard::new(cap))).collect(),
            clock,
            pressure,
            shard_seed: {
                // Random keys, from the standard library's per-process random hasher keys.
                use std::hash::BuildHasher;
                let random = std::collections::hash_map::RandomState::new();
                [
                    random.hash_one(1u8),
                    random.hash_one(2u8),
                    random.hash_one(3u8) | 1,
                ]
            },
        }
    }

    /// Which shard holds `check`'s entry, and its key there.
    fn key(&self, check: &Check<'_>) -> (usize, Key) {
        let mut rule = Fnv1a::new();
        rule.write(check.rule.as_bytes());
        let k = u128::from_le_bytes(check.identity.0) ^ rule.finish();
        let (lo, hi) = (k as u64, (k >> 64) as u64);
        // The key from all 128 bits, the low half multiplied through so that digests
        // differing only in their low bits (test identities) still differ in the 60 bits
        // kept; the shard from a keyed hash of all 128.
        let shard = match self.shards.len() {
            1 => 0,
            n => {
                // A keyed multiply-fold (as seeded hashers such as foldhash do): without the
                // process's keys, which shard a digest lands in cannot be worked out.
                let [a, b, m] = self.shard_seed;
                let x = ((lo ^ a) as u128 * ((hi ^ b) | 1) as u128) as u64;
                let x = x.wrapping_mul(m) ^ (x >> 29);
                ((x >> 32) % n as u64) as usize
            }
        };
        let folded = lo.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ hi;
        (shard, Key(folded & KEY_MASK))
    }

    fn lock(&self, i: usize) -> MutexGuard<'_, Shard> {
        // Nothing panics while a shard is being changed: the algorithms run before any
        // write, and the writes index nothing unchecked (an allocation failure aborts).
        // So a poisoned lock still guards a consistent shard, and is used.
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decide all `checks` at the store's clock, all or nothing. `Err(Full)`: a key the
    /// request would add found no room (nothing was charged).
    pub fn decide(&self, checks: &[Check<'_>]) -> Result<Vec<Decision>, Full> {
        self.run(checks, true)
    }

    /// What `checks` would be told now, without charging anything.
    pub fn peek(&self, checks: &[Check<'_>]) -> Vec<Decision> {
        // Nothing is written: there is never a lack of room.
        self.run(checks, false).unwrap_or_default()
    }

    /// Forget one identity's state under one rule.
    pub fn reset(&self, check: &Check<'_>) {
        let (shard, key) = self.key(check);
        self.lock(shard).remove(key);
    }

    fn run(&self, checks: &[Check<'_>], commit: bool) -> Result<Vec<Decision>, Full> {
        let now = self.clock.now_us();
        let mut places: Small<Place> = checks
            .iter()
            .map(|c| {
                let (shard, key) = self.key(c);
                Place {
                    shard,
                    key,
                    at: None,
                }
            })
            .collect();
        let mut guards = self.lock_shards(&places);
        // Each check's outcome, and where its slot was if it has one.
        let mut outcomes: Small<_> = SmallVec::with_capacity(checks.len());
        for (check, place) in checks.iter().zip(&mut places) {
            let shard = held(&guards, place.shard).and_then(|g| guards.get(g));
            place.at = shard.and_then(|(_, shard)| shard.find(place.key));
            let state = shard.and_then(|(_, shard)| shard.state_at(place.at, now));
            outcomes.push(super::decide(check.quota, state.as_ref(), now));
        }
        // The enforcing checks decide for the request; a shadow check is charged only when
        // it allows too, as if it had been enforced.
        let all = outcomes
            .iter()
            .zip(checks)
            .all(|(o, c)| o.allowed || c.shadow);
        let refused = match commit {
            true => match self.write(now, checks, &places, &outcomes, all, &mut guards) {
                Ok(()) => None,
                Err((_, NoRoom::Full)) => return Err(Full),
                Err((k, NoRoom::Held { until_us })) => Some((k, until_us)),
            },
            false => None,
        };
        let Some((k, until_us)) = refused else {
            return Ok(outcomes
                .iter()
                .map(|o| match commit && all && o.allowed {
                    true => o.charged,
                    false => o.uncharged,
                })
                .collect());
        };
        // A key refused for lack of room (every entry in its way held): nothing was
        // charged, and its rule denies the request until a held entry could be whole.
        self.pressure.refused.inc();
        let wait_us = until_us.saturating_sub(now).max(1);
        Ok(outcomes
            .iter()
            .enumerate()
            .map(|(j, o)| match j == k {
                true => Decision {
                    allowed: false,
                    remaining: 0,
                    retry_after_us: wait_us,
                    reset_us: wait_us,
                    ..o.uncharged
                },
                false => o.uncharged,
            })
            .collect())
    }

    /// Lock every shard `places` are in, in index order so two requests never deadlock.
    fn lock_shards(&self, places: &[Place]) -> Small<(usize, MutexGuard<'_, Shard>)> {
        let mut ids: Small<usize> = places.iter().map(|p| p.shard).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter().map(|i| (i, self.lock(i))).collect()
    }

    /// Store a decided request's outcomes (`all`: whether the request passed, so that
    /// the checks that allowed are charged). Room first, for every key the request adds
    /// (however many in one shard), so that it is charged all or not at all; the request's
    /// own entries are used now (most recent) and never make room. Without room, nothing
    /// is charged, and the error names the check (its position) whose key found none.
    fn write(
        &self,
        now: u64,
        checks: &[Check<'_>],
        places: &[Place],
        outcomes: &[super::Ruling<State>],
        all: bool,
        guards: &mut [(usize, MutexGuard<'_, Shard>)],
    ) -> Result<(), (usize, NoRoom)> {
        let own = |key: Key| places.iter().any(|p| p.key == key);
        let mut reserved: Small<usize> = smallvec::smallvec![0; guards.len()];
        for (k, (place, o)) in places.iter().zip(outcomes).enumerate() {
            let Some(g) = held(guards, place.shard) else {
                continue;
            };
            let Some((_, shard)) = guards.get_mut(g) else {
                continue;
            };
            if let Some(i) = shard.locate(place.key, place.at) {
                shard.touch(i);
            } else if all && o.allowed {
                shard
                    .make_room(now, reserved[g], &own, &self.pressure)
                    .map_err(|no| (k, no))?;
                reserved[g] += 1;
            }
        }
        for ((o, place), check) in outcomes.iter().zip(places).zip(checks) {
            let Some((_, shard)) = held(guards, place.shard).and_then(|g| guards.get_mut(g)) else {
                continue;
            };
            if all && o.allowed {
                // Held when the charge left an enforcing rule unable to pay for the
                // identity's next request now (a shadow rule denies nobody).
                let next_denied = !check.shadow && o.charged.remaining < check.quota.cost;
                let slot = Slot::new(place.key, o.next, now.saturating_add(o.ttl_us), next_denied);
                if !shard.update(slot, place.at) {
                    shard.insert(slot);
                }
            } else if !o.allowed && !check.shadow {
                // Denied: held until a charge clears it or it expires.
                if let Some(i) = shard.locate(place.key, place.at) {
                    shard.hold(i);
                }
            }
        }
        Ok(())
    }

    /// Settle charges decided earlier, each on its own, at the store's clock; the answers
    /// are what each rule would tell the next request now. A settlement that would add a
    /// key finding no room is dropped (the shard is full of requests in flight, or of
    /// identities being denied).
    pub fn settle(&self, items: &[Settlement<'_>]) -> Vec<Receipt> {
        let now = self.clock.now_us();
        items
            .iter()
            .map(|item| {
                let check = &item.check;
                let (shard, key) = self.key(check);
                let mut shard = self.lock(shard);
                let at = shard.find(key);
                let state = shard.state_at(at, now);
                let (settled, mut forgiven) =
                    super::settle(check.quota, state.as_ref(), now, item.adjust);
                let state = match settled {
                    super::Settled::Keep => state,
                    super::Settled::Clear => {
                        if at.is_some() {
                            shard.remove(key);
                        }
                        None
                    }
                    super::Settled::Write { next, ttl_us } => {
                        let o = super::decide(check.quota, Some(&next), now);
                        let held = !check.shadow && o.uncharged.remaining < check.quota.cost;
                        let slot = Slot::new(key, next, now.saturating_add(ttl_us), held);
                        let own = |k: Key| k == key;
                        if shard.update(slot, at) {
                            Some(next)
                        } else if shard.make_room(now, 0, &own, &self.pressure).is_ok() {
                            shard.insert(slot);
                            Some(next)
                        } else {
                            // No room (the shard full of requests in flight, or of
                            // identities being denied; no key is refused here): a charge is
                            // not kept, and is counted as forgiven; a refund not made is
                            // stricter.
                            forgiven = forgiven
                                .saturating_add(u64::try_from(item.adjust.delta).unwrap_or(0));
                            state
                        }
                    }
                };
                Receipt::new(
                    super::decide(check.quota, state.as_ref(), now).uncharged,
                    forgiven,
                )
            })
            .collect()
    }

    /// A request counted by a concurrency check has ended: give its slot back.
    pub fn release(&self, check: &Check<'_>) {
        let (shard, key) = self.key(check);
        let mut shard = self.lock(shard);
        let at = shard.find(key);
        // Never expired: a concurrency entry lives until its count is 0.
        let held = match at.and_then(|i| shard.slots.get(i)).and_then(Slot::state) {
            Some(State::Concurrency(s)) => Some(s),
            // Another algorithm's state now (the rule changed on reload): nothing to give.
            _ => return,
        };
        match super::concurrency::release(held.as_ref()) {
            Some(s) => {
                shard.update(Slot::new(key, State::Concurrency(s), u64::MAX, false), at);
            }
            None => shard.remove(key),
        }
    }

    /// Drop every entry whose state is whole again, and give back the memory they held.
    /// Returns how many remain.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_us();
        let mut left = 0;
        for i in 0..self.shards.len() {
            let mut shard = self.lock(i);
            shard.sweep(now, &|_| false);
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

    /// The most entries the store holds.
    pub fn capacity(&self) -> usize {
        self.shards.len() * self.lock(0).cap
    }
}

impl Store for MemoryStore {
    fn kind(&self) -> Kind {
        Kind::Memory
    }

    fn decide<'a>(&'a self, checks: &'a [Check<'a>]) -> Call<'a, Vec<Decision>> {
        Call::Ready(MemoryStore::decide(self, checks).map_err(StoreError::from))
    }

    fn peek<'a>(&'a self, checks: &'a [Check<'a>]) -> Call<'a, Vec<Decision>> {
        Call::Ready(Ok(MemoryStore::peek(self, checks)))
    }

    fn reset<'a>(&'a self, check: &'a Check<'a>) -> Call<'a, ()> {
        MemoryStore::reset(self, check);
        Call::Ready(Ok(()))
    }

    fn settle<'a>(&'a self, items: &'a [Settlement<'a>]) -> Call<'a, Vec<Receipt>> {
        Call::Ready(Ok(MemoryStore::settle(self, items)))
    }

    fn release<'a>(&'a self, check: &'a Check<'a>) -> Call<'a, ()> {
        MemoryStore::release(self, check);
        Call::Ready(Ok(()))
    }

    fn renew<'a>(&'a self, _check: &'a Check<'a>) -> Call<'a, bool> {
        // A slot in process lives until its request gives it back.
        Call::Ready(Ok(true))
    }

    fn ping(&self) -> Call<'_, ()> {
        Call::Ready(Ok(()))
    }

    fn sweep(&self) -> Option<usize> {
        Some(MemoryStore::sweep(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::IdentityDigest;
    use crate::limiter::{concurrency, fixed_window, gcra, sliding_window, token_bucket};
    use crate::limiter::{Algorithm, ManualClock, Quota, Rate};
    use shard::{List, NIL};
    use std::num::NonZeroU64;
    use std::time::Duration;

    fn quota(count: u64, burst: u64) -> Quota {
        Quota::new(
            Algorithm::TokenBucket,
            Rate::every(count, Duration::from_secs(1)),
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
        assert!(store.decide(&[check(&a, "r1")]).unwrap()[0].allowed);
        assert!(store.decide(&[check(&a, "r1")]).unwrap()[0].allowed);
        assert!(!store.decide(&[check(&a, "r1")]).unwrap()[0].allowed);
        assert!(
            store.decide(&[check(&b, "r1")]).unwrap()[0].allowed,
            "other key unaffected"
        );
        assert!(
            store.decide(&[check(&a, "r2")]).unwrap()[0].allowed,
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
        let d = store.decide(&both).unwrap();
        assert!(d[0].allowed && d[1].allowed);
        assert_eq!(d[0].remaining, 9);
        let d = store.decide(&both).unwrap();
        assert!(!d[1].allowed);
        assert_eq!(d[0].remaining, 9, "the wide rule was not charged");
        let d = store.decide(&both[..1]).unwrap();
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
        let d = store.decide(&both).unwrap();
        assert!(d[0].allowed && d[1].allowed);
        assert_eq!((d[0].remaining, d[1].remaining), (9, 0), "both charged");
        let d = store.decide(&both).unwrap();
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
        store.decide(&deny_then_watch).unwrap();
        let d = store.decide(&deny_then_watch).unwrap();
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
        assert!(store.decide(&c).unwrap()[0].allowed);
        assert!(store.decide(&c).unwrap()[0].allowed);
        assert!(!store.decide(&c).unwrap()[0].allowed);
        // Time frees nothing, and a sweep keeps slots in use.
        clock.advance(3_600_000_000);
        store.sweep();
        assert!(!store.decide(&c).unwrap()[0].allowed);
        store.release(&c[0]);
        assert_eq!(
            store.decide(&c).unwrap()[0].remaining,
            0,
            "one freed, taken again"
        );
        store.release(&c[0]);
        store.release(&c[0]);
        assert!(store.is_empty(), "no entry once none is in flight");
        store.release(&c[0]);
        assert!(
            store.decide(&c).unwrap()[0].allowed,
            "an extra release frees nothing twice"
        );
        assert_eq!(store.decide(&c).unwrap()[0].remaining, 0);
    }

    #[test]
    fn idle_keys_are_evicted() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new(clock.clone());
        let q = quota(10, 10);
        for n in 0..10_000 {
            let d = id(n);
            store.decide(&[Check::new(&d, "r", &q)]).unwrap();
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
    fn a_slot_holds_every_state_exactly() {
        let key = Key(0xdead_beef_0bad_f00d & KEY_MASK);
        let states = [
            State::TokenBucket(token_bucket::State {
                level: i64::MIN,
                last_us: u64::MAX,
                unit: 1 << 52,
            }),
            State::TokenBucket(token_bucket::State {
                level: -1,
                last_us: 0,
                unit: 7,
            }),
            State::Gcra(gcra::State {
                tat_us: u64::MAX,
                frac: u64::MAX - 1,
            }),
            State::FixedWindow(fixed_window::State {
                start_us: 3,
                count: u64::MAX,
            }),
            State::SlidingWindow(sliding_window::State {
                window: u64::MAX,
                cur: 1,
                prev: u64::MAX - 2,
            }),
            State::Concurrency(concurrency::State {
                in_flight: u64::MAX,
            }),
        ];
        for state in states {
            let slot = Slot::new(key, state, 42, false);
            assert_eq!(slot.key(), key);
            assert_eq!(slot.state(), Some(state));
        }
    }

    #[test]
    fn structured_identities_get_distinct_keys() {
        let probe = MemoryStore::new(ManualClock::new(0));
        let mut seen = std::collections::HashSet::new();
        let q = quota(1, 1);
        for rule in ["a", "b", "api"] {
            for n in 0..100_000 {
                let d = id(n);
                assert!(seen.insert(probe.key(&Check::new(&d, rule, &q))));
            }
            for b in 1..=255u8 {
                let d = IdentityDigest([b; 16]);
                assert!(seen.insert(probe.key(&Check::new(&d, rule, &q))));
            }
        }
    }

    /// A shard against a `HashMap` and a recency list under random writes, uses, removals
    /// and sweeps: same contents, every slot has exactly one position in the index, and
    /// the recency list holds every slot once, in the model's order.
    #[test]
    fn a_shard_agrees_with_a_map() {
        use std::collections::{HashMap, VecDeque};
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut shard = Shard::new(usize::MAX);
        let mut model: HashMap<Key, (State, u64, List)> = HashMap::new();
        // Per list, most recently used first.
        let mut recency: [VecDeque<Key>; 3] = Default::default();
        let forget = |recency: &mut [VecDeque<Key>; 3], key: Key| {
            for r in recency.iter_mut() {
                r.retain(|k| *k != key);
            }
        };
        let mut now = 0;
        for step in 0..200_000u32 {
            // Few distinct keys, so the same ones come back; the size swings up and down.
            let span = if (step / 20_000) % 2 == 0 { 5_000 } else { 300 };
            let key = Key((next() % span).wrapping_mul(0x9E37_79B9_7F4A_7C15) & KEY_MASK);
            match next() % 17 {
                0..=9 => {
                    let state = if next() % 4 == 0 {
                        State::Concurrency(concurrency::State { in_flight: next() })
                    } else {
                        State::Gcra(gcra::State {
                            tat_us: next(),
                            frac: next(),
                        })
                    };
                    let expires = if matches!(state, State::Concurrency(_)) {
                        u64::MAX
                    } else {
                        now + next() % 1_000
                    };
                    // Sometimes the right position, sometimes none, sometimes a wrong one.
                    let at = match next() % 3 {
                        0 => shard.find(key),
                        1 => None,
                        _ => Some((next() % 6_000) as usize),
                    };
                    let slot = Slot::new(key, state, expires, next() % 2 == 0);
                    if !shard.update(slot, at) {
                        shard.insert(slot);
                    }
                    let i = shard.find(key).expect("just written");
                    shard.touch(i);
                    model.insert(key, (state, expires, slot.list()));
                    forget(&mut recency, key);
                    recency[slot.list() as usize].push_front(key);
                }
                10 => {
                    // A denial: held, and the most recent of the held.
                    if let Some(i) = shard.find(key) {
                        shard.hold(i);
                        let m = model.get_mut(&key).expect("in the model");
                        let was = m.2;
                        if was == List::Free {
                            m.2 = List::Held;
                            forget(&mut recency, key);
                            recency[List::Held as usize].push_front(key);
                        }
                    }
                }
                11..=13 => {
                    shard.remove(key);
                    model.remove(&key);
                    forget(&mut recency, key);
                }
                14 => {
                    now += next() % 200;
                    shard.sweep(now, &|_| false);
                    model.retain(|_, (_, e, _)| *e > now);
                    for r in recency.iter_mut() {
                        r.retain(|k| model.contains_key(k));
                    }
                }
                _ => now += 1,
            }
            if step % 997 == 0 || step % 20_000 < 3 {
                assert_eq!(shard.len(), model.len());
                assert_eq!(shard.index.len(), shard.slots.len());
                let mut positions: Vec<u32> = shard.index.iter().copied().collect();
                positions.sort_unstable();
                assert!(positions.iter().enumerate().all(|(i, &p)| p as usize == i));
                for (&k, &(state, expires, list)) in &model {
                    let at = shard.find(k).expect("every key is found");
                    let slot = shard.slots[at];
                    assert_eq!((slot.state(), slot.expires_us), (Some(state), expires));
                    assert_eq!(slot.list(), list);
                }
                for (l, r) in recency.iter().enumerate() {
                    let mut listed = Vec::new();
                    let mut i = shard.lists[l].newest;
                    while i != NIL {
                        let s = shard.slots[i as usize];
                        listed.push(s.key());
                        assert!(listed.len() <= shard.len(), "a recency list loops");
                        assert_eq!(
                            s.list() as usize,
                            l,
                            "a slot on another list than its flags"
                        );
                        if s.older != NIL {
                            assert_eq!(shard.slots[s.older as usize].newer, i, "links agree");
                        } else {
                            assert_eq!(shard.lists[l].oldest, i);
                        }
                        i = s.older;
                    }
                    assert_eq!(listed, Vec::from(r.clone()), "list {l}, step {step}");
                }
            }
        }
    }

    /// A store of `max_keys` on a manual clock, with its eviction counters.
    fn bounded(max_keys: usize) -> (Arc<ManualClock>, MemoryStore) {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::bounded(clock.clone(), max_keys, Pressure::default());
        (clock, store)
    }

    /// What making room did so far: (expired and lru evictions, keys refused).
    fn evicted(store: &MemoryStore) -> (u64, u64, u64) {
        let p = &store.pressure;
        (p.expired.get(), p.lru.get(), p.refused.get())
    }

    #[test]
    fn a_small_store_is_one_shard_of_exactly_max_keys() {
        assert_eq!(bounded(3).1.shards.len(), 1);
        assert_eq!(bounded(3).1.capacity(), 3);
        let (_, big) = bounded(1_000_000);
        assert_eq!(big.shards.len(), 64);
        assert!(big.capacity() <= 1_000_000 && big.capacity() > 999_900);
    }

    #[test]
    fn a_full_store_drops_an_expired_entry_first() {
        let (clock, store) = bounded(3);
        let (long, short) = (quota(1, 10), quota(1_000, 10));
        let (a, b, c, d) = (id(1), id(2), id(3), id(4));
        store.decide(&[Check::new(&a, "r", &long)]).unwrap();
        store.decide(&[Check::new(&b, "r", &short)]).unwrap();
        store.decide(&[Check::new(&c, "r", &long)]).unwrap();
        // b's bucket refills in 1 ms: then it is the same as no entry, though the most
        // recent but one; a is the least recently used.
        clock.advance(1_000);
        store.decide(&[Check::new(&d, "r", &long)]).unwrap();
        assert_eq!(
            evicted(&store),
            (1, 0, 0),
            "one expired entry dropped, nothing live"
        );
        assert_eq!(store.len(), 3);
        for (who, left) in [(&a, 8), (&c, 8), (&d, 8)] {
            let p = store.peek(&[Check::new(who, "r", &long)]);
            assert_eq!(p[0].remaining, left + 1, "{who:?} kept its charge");
        }
    }

    #[test]
    fn then_the_least_recently_used_entry_that_is_not_denied() {
        let (_, store) = bounded(3);
        let q = quota(1, 10);
        let (a, b, c, d) = (id(1), id(2), id(3), id(4));
        for who in [&a, &b, &c] {
            store.decide(&[Check::new(who, "r", &q)]).unwrap();
        }
        // a used again: b is now the least recently used.
        store.decide(&[Check::new(&a, "r", &q)]).unwrap();
        store.decide(&[Check::new(&d, "r", &q)]).unwrap();
        assert_eq!(evicted(&store), (0, 1, 0));
        let left = |who| store.peek(&[Check::new(who, "r", &q)])[0].remaining;
        assert_eq!(
            (left(&a), left(&b), left(&c), left(&d)),
            (8, 10, 9, 9),
            "b was dropped (whole again), the others kept their counts"
        );
    }

    #[test]
    fn a_denied_identity_keeps_its_state_until_it_is_whole_again() {
        let (clock, store) = bounded(2);
        let q = quota(1, 2);
        let (x, y, z, w) = (id(1), id(2), id(3), id(4));
        let at = |who| [Check::new(who, "r", &q)];
        // x drains its bucket and is denied; it is the least recently used.
        store.decide(&at(&x)).unwrap();
        store.decide(&at(&x)).unwrap();
        assert!(!store.decide(&at(&x)).unwrap()[0].allowed);
        store.decide(&at(&y)).unwrap();
        // Two new keys: y and then z make room, never x.
        store.decide(&at(&z)).unwrap();
        store.decide(&at(&w)).unwrap();
        assert_eq!(evicted(&store), (0, 2, 0));
        assert!(!store.peek(&at(&x))[0].allowed, "x is still denied");
        // A bucket drained without a denial is held too: w is at 1 of 2; drain it.
        store.decide(&at(&w)).unwrap();
        // x is whole again 2 s after it was drained (1 token a second): until then it keeps
        // its state; then it is dropped as expired, the least recently used of the two.
        clock.advance(2_000_000 - 1);
        assert_eq!(
            store.peek(&at(&x))[0].remaining,
            1,
            "x's state is kept, not whole yet"
        );
        clock.advance(1);
        let v = id(5);
        assert!(store.decide(&at(&v)).unwrap()[0].allowed);
        assert_eq!(evicted(&store), (1, 2, 0));
        assert_eq!(store.peek(&at(&v))[0].remaining, 1);
    }

    /// A store that holds nothing but states being denied drops none of them for a new
    /// key: the new key is refused (denied, nothing stored), told to come back when the
    /// soonest of them is whole again, and counted. A flood of keys that are themselves
    /// denied frees no abuser, however quiet the abuser has been meanwhile.
    #[test]
    fn a_store_full_of_denied_identities_refuses_a_new_key() {
        let (clock, store) = bounded(3);
        let q = quota(1, 1);
        let at = |who| [Check::new(who, "r", &q)];
        let (a, b, c) = (id(1), id(2), id(3));
        // a is drained first, then b and c 200 ms later; a is the one denied longest ago.
        assert!(store.decide(&at(&a)).unwrap()[0].allowed);
        assert!(!store.decide(&at(&a)).unwrap()[0].allowed);
        clock.advance(200_000);
        for who in [&b, &c] {
            assert!(store.decide(&at(who)).unwrap()[0].allowed);
            assert!(!store.decide(&at(who)).unwrap()[0].allowed);
        }
        clock.advance(300_000);
        for n in 10..110 {
            let flood = id(n);
            let d = store.decide(&[Check::new(&flood, "r", &q)]).unwrap();
            assert!(!d[0].allowed, "flood key {n} refused");
            // a is whole again 1 s after it was drained: 500 ms from now.
            assert_eq!((d[0].remaining, d[0].retry_after_us), (0, 500_000));
        }
        assert_eq!(evicted(&store), (0, 0, 100), "nothing dropped, 100 refused");
        assert_eq!(store.len(), 3);
        for who in [&a, &b, &c] {
            assert!(!store.peek(&at(who))[0].allowed, "{who:?} kept its state");
        }
        let refused = id(10);
        assert!(
            store.peek(&[Check::new(&refused, "r", &q)])[0].allowed,
            "nothing was stored for a refused key"
        );
        // Once a is whole again its entry is as good as none: it makes room.
        clock.advance(500_000);
        let d = id(4);
        assert!(store.decide(&at(&d)).unwrap()[0].allowed);
        assert_eq!(evicted(&store), (1, 0, 100));
        for who in [&b, &c, &d] {
            assert!(!store.peek(&at(who))[0].allowed, "{who:?} is being denied");
        }
    }

    /// A key the store already tracks is decided as ever in a store full of held
    /// entries; a request that would add a key is refused whole: its other rules are not
    /// charged, and the refusing rule is the one whose key found no room.
    #[test]
    fn a_refused_key_charges_none_of_its_requests_rules() {
        let (_, store) = bounded(2);
        let (tight, wide) = (quota(1, 1), quota(1, 10));
        let (a, b) = (id(1), id(2));
        assert!(store.decide(&[Check::new(&a, "wide", &wide)]).unwrap()[0].allowed);
        assert!(store.decide(&[Check::new(&b, "tight", &tight)]).unwrap()[0].allowed);
        // b is held (drained); a's wide bucket, 9 of 10 left, is not: drain it.
        for _ in 0..9 {
            assert!(store.decide(&[Check::new(&a, "wide", &wide)]).unwrap()[0].allowed);
        }
        assert!(!store.decide(&[Check::new(&a, "wide", &wide)]).unwrap()[0].allowed);
        let both = [
            Check::new(&b, "tight", &tight),
            Check::new(&a, "tight", &tight),
        ];
        // b is denied by its own bucket: the request is denied, a's new key not stored,
        // nothing refused.
        let d = store.decide(&both).unwrap();
        assert!(!d[0].allowed && d[1].allowed);
        assert_eq!(evicted(&store).2, 0);
        let c = id(3);
        let wide_and_new = [
            Check::new(&c, "wide", &wide),
            Check::new(&c, "tight", &tight),
        ];
        let d = store.decide(&wide_and_new).unwrap();
        assert!(!d[0].allowed, "the first key that found no room refuses");
        assert!(d[1].allowed, "the other rule would have allowed");
        assert_eq!(d[1].remaining, 1, "and was not charged");
        assert_eq!(evicted(&store), (0, 0, 1));
        assert_eq!(store.len(), 2);
    }

    /// Requests in flight and held entries: a new key is refused (a denial, as for held
    /// entries), not failed as [`Full`] (`on_error`), since held entries will expire.
    #[test]
    fn held_entries_beside_requests_in_flight_refuse_rather_than_fail() {
        let (_, store) = bounded(2);
        let conc = Quota::concurrency(NonZeroU64::new(2).unwrap(), Duration::from_secs(10));
        let q = quota(1, 1);
        let (x, y, z) = (id(1), id(2), id(3));
        assert!(store.decide(&[Check::new(&x, "conc", &conc)]).unwrap()[0].allowed);
        assert!(store.decide(&[Check::new(&y, "r", &q)]).unwrap()[0].allowed);
        let d = store.decide(&[Check::new(&z, "r", &q)]).unwrap();
        assert!(!d[0].allowed);
        assert_eq!(d[0].retry_after_us, 1_000_000);
        assert_eq!(evicted(&store), (0, 0, 1));
    }

    #[test]
    fn a_request_that_finds_no_room_charges_nothing() {
        // Room only for one key, taken by a request in flight (a concurrency slot is never
        // dropped): a request that needs a new key in two rules is refused whole.
        let (_, store) = bounded(1);
        let conc = Quota::concurrency(NonZeroU64::new(2).unwrap(), Duration::from_secs(10));
        let (q, x, y) = (quota(1, 5), id(1), id(2));
        assert!(store.decide(&[Check::new(&x, "conc", &conc)]).unwrap()[0].allowed);
        let both = [Check::new(&x, "conc", &conc), Check::new(&y, "wide", &q)];
        assert_eq!(store.decide(&both), Err(Full));
        assert_eq!(store.peek(&both)[0].remaining, 1, "the lease was not taken");
        assert_eq!(store.peek(&both)[1].remaining, 5, "nothing charged");
    }

    /// A request adding several keys to one shard makes room for each: the bound holds.
    #[test]
    fn a_request_adding_several_keys_keeps_the_bound() {
        let (_, store) = bounded(3);
        let q = quota(1, 5);
        let rules = ["r1", "r2", "r3"];
        for n in 0..20 {
            let who = id(n);
            let checks: Vec<Check<'_>> = rules.iter().map(|r| Check::new(&who, r, &q)).collect();
            assert!(store.decide(&checks).unwrap().iter().all(|d| d.allowed));
            assert!(store.len() <= 3, "{} keys after request {n}", store.len());
        }
        assert_eq!(store.len(), 3);
    }

    /// Which shard a key lands in is keyed per process: the same identities spread
    /// differently in two stores, so nobody can pick keys that all share one shard.
    #[test]
    fn shards_are_picked_by_a_keyed_hash() {
        let (_, a) = bounded(1_000_000);
        let (_, b) = bounded(1_000_000);
        let q = quota(1, 1);
        let ids: Vec<IdentityDigest> = (0..200).map(id).collect();
        let differ = ids
            .iter()
            .filter(|d| a.key(&Check::new(d, "r", &q)).0 != b.key(&Check::new(d, "r", &q)).0)
            .count();
        assert!(
            differ > 150,
            "{differ} of 200 keys change shard between two stores"
        );
    }

    #[test]
    fn a_flood_of_new_keys_never_passes_max_keys() {
        let (_, store) = bounded(1_000);
        let q = quota(1, 20);
        let hot = id(u32::MAX);
        for n in 0..50_000 {
            let d = id(n);
            store.decide(&[Check::new(&d, "r", &q)]).unwrap();
            if n % 100 == 0 {
                store.decide(&[Check::new(&hot, "r", &q)]).unwrap();
                assert!(store.len() <= 1_000);
            }
        }
        assert_eq!(store.len(), 1_000);
        assert_eq!(evicted(&store), (0, 49_000 + 1, 0));
        // The hot key, used every hundred requests (500 times: its 20, then denials), kept
        // its state: dropped, it would have its whole burst again.
        let p = store.peek(&[Check::new(&hot, "r", &q)]);
        assert!(!p[0].allowed && p[0].remaining == 0, "{p:?}");
    }

    #[test]
    fn memory_is_given_back_after_a_flood() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new(clock.clone());
        let (short, long) = (quota(1000, 1), quota(1, 1));
        for n in 0..100_000 {
            let d = id(n);
            let q = if n % 100 == 0 { &long } else { &short };
            store.decide(&[Check::new(&d, "r", q)]).unwrap();
        }
        let spare = |store: &MemoryStore| {
            (0..store.shards.len())
                .map(|i| {
                    let s = store.lock(i);
                    (s.slots.capacity(), s.index.capacity())
                })
                .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
        };
        let (slots, index) = spare(&store);
        assert!((100_000..=100_000 + 100_000 / 8 + 4 * store.shards.len()).contains(&slots));
        assert!(index >= 100_000);
        // The short buckets refill in 1 ms, the long ones in 1 s.
        clock.advance(1_000);
        assert_eq!(store.sweep(), 1_000);
        let (slots, index) = spare(&store);
        assert!(
            slots <= 1_000 + 1_000 / 8 + 4 * store.shards.len(),
            "{slots} slots"
        );
        assert!(
            index <= 4 * 1_000 + 32 * store.shards.len(),
            "{index} positions"
        );
        for n in (0..100_000).step_by(100) {
            let d = id(n);
            let c = [Check::new(&d, "r", &long)];
            assert!(
                !store.peek(&c)[0].allowed,
                "the long buckets are still empty"
            );
        }
        clock.advance(1_000_000);
        assert_eq!(store.sweep(), 0);
        assert_eq!(spare(&store), (0, 0));
    }

    #[test]
    fn an_expired_entry_reads_as_full() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new(clock.clone());
        let q = quota(1, 3);
        let a = id(3);
        let c = [Check::new(&a, "r", &q)];
        store.decide(&c).unwrap();
        clock.advance(5_000_000);
        assert_eq!(store.decide(&c).unwrap()[0].remaining, 2);
    }
}
