//! The embedded store: bucket states in a sharded in-process map, for one instance.
//!
//! Bounded: an entry is kept only while its bucket is below full (its TTL, exactly as in
//! Redis); [`MemoryStore::sweep`] drops the rest, and a read treats an expired entry as
//! absent, so a flood of distinct keys costs memory for at most one refill time.
//!
//! Small: one tracked key costs a 40-byte slot in a dense array (at most an eighth of it
//! spare) plus a 4-byte position and a control byte in a hash table over it (44% to 87.5%
//! full): 50 to 60 bytes per key from a few thousand keys up (`examples/measure_memory.rs`),
//! where a `HashMap` of 56-byte entries took 65 to 130. Below that, the 64 empty shards'
//! 4 KiB dominate.

use std::sync::{Arc, Mutex, MutexGuard};

use hashbrown::HashTable;

use super::{concurrency, fixed_window, gcra, sliding_window, token_bucket};
use super::{Check, Clock, Decision, State};

const SHARDS: usize = 64;

/// The low bits of a slot's first word that say which algorithm's state it holds.
const TAG_BITS: u32 = 3;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;

/// An entry's key: the identity digest folded with the rule name (128 bits), reduced to 61
/// bits here plus the 6 bits that pick the shard, so 67 bits tell keys apart. The low
/// [`TAG_BITS`] are always zero: a slot keeps its state's tag there.
///
/// Two keys that agree on all 67 bits share one entry. For uniformly distributed digests
/// (SHA-256) the chance that any two of `n` live keys do is about `n² / 2^68`: 3·10⁻⁹ at a
/// million keys. Under rules of the same algorithm the two identities then share one limit
/// (stricter, never looser); under rules of different algorithms each reads the other's
/// state as none, as after a reload that changed the rule's algorithm.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key(u64);

impl Key {
    /// Where the key's position lives in a shard's index. The key is already uniformly
    /// distributed; the shift only fills the tag's zero bits, which hashbrown would
    /// otherwise use to pick a bucket.
    fn hash(self) -> u64 {
        self.0 ^ (self.0 >> TAG_BITS)
    }
}

/// One tracked key: its key and state's tag, the state's fields, and its expiry.
/// 40 bytes, where `(Key, State, u64)` takes 48: the state's enum discriminant lives in
/// the key's low bits.
#[derive(Clone, Copy, Debug)]
struct Slot {
    key_tag: u64,
    words: [u64; 3],
    /// Past this moment (µs, the store's clock) the entry means the same as no entry; a
    /// concurrency entry never expires (`u64::MAX`), it is removed when its count is 0.
    expires_us: u64,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 40);

const TOKEN_BUCKET: u64 = 1;
const GCRA: u64 = 2;
const FIXED_WINDOW: u64 = 3;
const SLIDING_WINDOW: u64 = 4;
const CONCURRENCY: u64 = 5;

impl Slot {
    fn new(key: Key, state: State, expires_us: u64) -> Slot {
        // Every field is named, so a field added to a state fails to compile here rather
        // than being dropped.
        let (tag, words) = match state {
            State::TokenBucket(token_bucket::State {
                level,
                last_us,
                unit,
            }) => (TOKEN_BUCKET, [level as u64, last_us, unit]),
            State::Gcra(gcra::State { tat_us, frac }) => (GCRA, [tat_us, frac, 0]),
            State::FixedWindow(fixed_window::State { start_us, count }) => {
                (FIXED_WINDOW, [start_us, count, 0])
            }
            State::SlidingWindow(sliding_window::State { window, cur, prev }) => {
                (SLIDING_WINDOW, [window, cur, prev])
            }
            State::Concurrency(concurrency::State { in_flight }) => {
                (CONCURRENCY, [in_flight, 0, 0])
            }
        };
        Slot {
            key_tag: key.0 | tag,
            words,
            expires_us,
        }
    }

    fn key(&self) -> Key {
        Key(self.key_tag & !TAG_MASK)
    }

    fn live(&self, now_us: u64) -> bool {
        self.expires_us > now_us
    }

    fn state(&self) -> Option<State> {
        let [a, b, c] = self.words;
        Some(match self.key_tag & TAG_MASK {
            TOKEN_BUCKET => State::TokenBucket(token_bucket::State {
                level: a as i64,
                last_us: b,
                unit: c,
            }),
            GCRA => State::Gcra(gcra::State { tat_us: a, frac: b }),
            FIXED_WINDOW => State::FixedWindow(fixed_window::State {
                start_us: a,
                count: b,
            }),
            SLIDING_WINDOW => State::SlidingWindow(sliding_window::State {
                window: a,
                cur: b,
                prev: c,
            }),
            CONCURRENCY => State::Concurrency(concurrency::State { in_flight: a }),
            _ => return None,
        })
    }
}

/// One shard's entries: dense in `slots` (no holes: a removal moves the last slot into the
/// hole), found through `index`, a hash table of positions in `slots` hashed by their
/// slot's key. Every position in `index` is in bounds and every slot has exactly one
/// position in `index`; only the methods below change either.
#[derive(Default)]
struct Shard {
    slots: Vec<Slot>,
    index: HashTable<u32>,
}

impl Shard {
    /// Where `key`'s slot is, expired or not.
    fn find(&self, key: Key) -> Option<usize> {
        let slots = &self.slots;
        self.index
            .find(key.hash(), |&i| {
                slots.get(i as usize).is_some_and(|s| s.key() == key)
            })
            .map(|&i| i as usize)
    }

    /// The state in the slot at `at`, unless it has expired at `now_us`.
    fn state_at(&self, at: Option<usize>, now_us: u64) -> Option<State> {
        self.slots
            .get(at?)
            .filter(|s| s.live(now_us))
            .and_then(Slot::state)
    }

    /// Store `slot` at `at` if that is where its key is (a position [`find`] gave, with no
    /// removal since), else wherever its key is, else in a new slot.
    ///
    /// [`find`]: Shard::find
    fn put(&mut self, slot: Slot, at: Option<usize>) {
        let key = slot.key();
        if let Some(s) = at
            .and_then(|i| self.slots.get_mut(i))
            .filter(|s| s.key() == key)
        {
            *s = slot;
            return;
        }
        let Shard { slots, index } = self;
        let Ok(next) = u32::try_from(slots.len()) else {
            // 2^32 entries in one shard (170 GB): not stored, the key reads as new. Memory
            // runs out long before.
            return;
        };
        let entry = index.entry(
            key.hash(),
            |&i| slots.get(i as usize).is_some_and(|s| s.key() == key),
            |&i| slots.get(i as usize).map_or(0, |s| s.key().hash()),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(o) => {
                if let Some(s) = slots.get_mut(*o.get() as usize) {
                    *s = slot;
                }
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(next);
                if slots.len() == slots.capacity() {
                    // Grow by an eighth, not double: at most 12.5% of the slots are spare.
                    slots.reserve_exact((slots.len() / 8).max(4));
                }
                slots.push(slot);
            }
        }
    }

    /// Forget `key`.
    fn remove(&mut self, key: Key) {
        let Shard { slots, index } = self;
        let Ok(found) = index.find_entry(key.hash(), |&i| {
            slots.get(i as usize).is_some_and(|s| s.key() == key)
        }) else {
            return;
        };
        let (i, _) = found.remove();
        let i = i as usize;
        if i >= slots.len() {
            return;
        }
        slots.swap_remove(i);
        // The last slot, if it was not the one removed, is at `i` now.
        if let Some(moved) = slots.get(i) {
            Self::moved(index, moved.key(), slots.len(), i);
        }
    }

    /// The slot of `key` moved from position `from` to `to`: point the index at `to`.
    fn moved(index: &mut HashTable<u32>, key: Key, from: usize, to: usize) {
        let pos = index.find_mut(key.hash(), |&i| i as usize == from);
        debug_assert!(pos.is_some(), "every slot has a position in the index");
        if let Some(pos) = pos {
            // `to` < `from`, which fits in a u32.
            *pos = to as u32;
        }
    }

    /// Drop every slot expired at `now_us`, keeping the live ones at the front, then give
    /// memory back: the spare slots past an eighth, the index when under 40% full, all of
    /// it when the shard is empty.
    ///
    /// One pass over the slots, in order; the index is touched only for the expired slots
    /// and the live ones moved into their places.
    fn sweep(&mut self, now_us: u64) {
        let Shard { slots, index } = self;
        let live = |s: Option<&Slot>| s.is_some_and(|s| s.live(now_us));
        // Forget the position of the (expired) slot at `at`.
        let unindex = |index: &mut HashTable<u32>, at: usize, slot: Option<&Slot>| {
            if let Some(slot) = slot {
                let found = index.find_entry(slot.key().hash(), |&i| i as usize == at);
                debug_assert!(found.is_ok(), "every slot has a position in the index");
                if let Ok(found) = found {
                    found.remove();
                }
            }
        };
        // [0, hole) is live and indexed; [end, len) is expired or moved, and unindexed.
        let (mut hole, mut end) = (0, slots.len());
        loop {
            while hole < end && live(slots.get(hole)) {
                hole += 1;
            }
            if hole == end {
                break;
            }
            // slots[hole] has expired: fill it with the last live slot, if any is left.
            unindex(index, hole, slots.get(hole));
            while end > hole + 1 && !live(slots.get(end - 1)) {
                unindex(index, end - 1, slots.get(end - 1));
                end -= 1;
            }
            if end == hole + 1 {
                end = hole;
                break;
            }
            slots.swap(hole, end - 1);
            if let Some(moved) = slots.get(hole) {
                Self::moved(index, moved.key(), end - 1, hole);
            }
            hole += 1;
            end -= 1;
        }
        slots.truncate(end);
        let len = slots.len();
        if len == 0 {
            *slots = Vec::new();
            *index = HashTable::new();
            return;
        }
        if slots.capacity() > len + len / 8 + 4 {
            slots.shrink_to(len + len / 16);
        }
        if index.capacity() > 32 && index.len() * 5 < index.capacity() * 2 {
            index.shrink_to(len, |&i| {
                slots.get(i as usize).map_or(0, |s| s.key().hash())
            });
        }
    }

    fn len(&self) -> usize {
        self.slots.len()
    }
}

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

    /// Which shard holds `check`'s entry, and its key there.
    fn key(check: &Check<'_>) -> (usize, Key) {
        let id = u128::from_le_bytes(check.identity.0);
        // FNV-1a of the rule name, spread over 128 bits.
        let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
        for b in check.rule.bytes() {
            h ^= u128::from(b);
            h = h.wrapping_mul(0x0000000001000000000000000000013B);
        }
        let k = id ^ h;
        let (lo, hi) = (k as u64, (k >> 64) as u64);
        // The shard from the top bits of one half; the key from all 128 bits, the low half
        // multiplied through so that digests differing only in their low bits (test
        // identities) still differ in the 61 bits kept.
        let shard = (hi >> 58) as usize % SHARDS;
        let folded = lo.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ hi;
        (shard, Key(folded & !TAG_MASK))
    }

    fn lock(&self, i: usize) -> MutexGuard<'_, Shard> {
        // Nothing panics while a shard is being changed: the algorithms run before any
        // write, and the writes index nothing unchecked (an allocation failure aborts).
        // So a poisoned lock still guards a consistent shard, and is used.
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
        let (shard, key) = Self::key(check);
        self.lock(shard).remove(key);
    }

    fn run(&self, checks: &[Check<'_>], commit: bool) -> Vec<Decision> {
        let now = self.clock.now_us();
        let keys: Vec<(usize, Key)> = checks.iter().map(Self::key).collect();
        // Lock every shard involved, in index order so two requests never deadlock.
        let mut shard_ids: Vec<usize> = keys.iter().map(|&(s, _)| s).collect();
        shard_ids.sort_unstable();
        shard_ids.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            shard_ids.iter().map(|&i| (i, self.lock(i))).collect();
        // Which of `guards` holds shard `i` (every check's shard is locked above).
        let held = |guards: &[(usize, MutexGuard<'_, Shard>)], i: usize| -> Option<usize> {
            guards.iter().position(|(j, _)| *j == i)
        };

        // Each check's outcome, and where its slot was if it has one: nothing is removed
        // before the writes below, so the position still holds then.
        let mut outcomes = Vec::with_capacity(checks.len());
        for (check, &(s, key)) in checks.iter().zip(&keys) {
            let shard = held(&guards, s).and_then(|g| guards.get(g));
            let at = shard.and_then(|(_, shard)| shard.find(key));
            let state = shard.and_then(|(_, shard)| shard.state_at(at, now));
            outcomes.push((super::decide(check.quota, state.as_ref(), now), at));
        }
        // The enforcing checks decide for the request; a shadow check is charged only when
        // it allows too, as if it had been enforced.
        let all = commit
            && outcomes
                .iter()
                .zip(checks)
                .all(|((o, _), c)| o.allowed || c.shadow);
        let charged = |o: &super::Outcome<State>| all && o.allowed;
        for ((o, at), &(s, key)) in outcomes.iter().zip(&keys) {
            if charged(o) {
                let slot = Slot::new(key, o.next, now.saturating_add(o.ttl_us));
                if let Some((_, shard)) = held(&guards, s).and_then(|g| guards.get_mut(g)) {
                    shard.put(slot, *at);
                }
            }
        }
        outcomes
            .iter()
            .map(|(o, _)| if charged(o) { o.charged } else { o.uncharged })
            .collect()
    }

    /// A request counted by a concurrency check has ended: give its slot back.
    pub fn release(&self, check: &Check<'_>) {
        let (shard, key) = Self::key(check);
        let mut shard = self.lock(shard);
        let at = shard.find(key);
        // Never expired: a concurrency entry lives until its count is 0.
        let held = match at.and_then(|i| shard.slots.get(i)).and_then(Slot::state) {
            Some(State::Concurrency(s)) => Some(s),
            // Another algorithm's state now (the rule changed on reload): nothing to give.
            _ => return,
        };
        match super::concurrency::release(held.as_ref()) {
            Some(s) => shard.put(Slot::new(key, State::Concurrency(s), u64::MAX), at),
            None => shard.remove(key),
        }
    }

    /// Drop every entry whose bucket has refilled, and give back the memory they held.
    /// Returns how many remain.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_us();
        let mut left = 0;
        for i in 0..self.shards.len() {
            let mut shard = self.lock(i);
            shard.sweep(now);
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
    fn a_slot_holds_every_state_exactly() {
        let key = Key(0xdead_beef_0bad_f00d & !TAG_MASK);
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
            let slot = Slot::new(key, state, 42);
            assert_eq!(slot.key(), key);
            assert_eq!(slot.state(), Some(state));
        }
    }

    #[test]
    fn structured_identities_get_distinct_keys() {
        let mut seen = std::collections::HashSet::new();
        let q = quota(1, 1);
        for rule in ["a", "b", "api"] {
            for n in 0..100_000 {
                let d = id(n);
                assert!(seen.insert(MemoryStore::key(&Check::new(&d, rule, &q))));
            }
            for b in 1..=255u8 {
                let d = IdentityDigest([b; 16]);
                assert!(seen.insert(MemoryStore::key(&Check::new(&d, rule, &q))));
            }
        }
    }

    /// A shard against a `HashMap` under random puts, removals and sweeps: same contents,
    /// and every slot has exactly one position in the index.
    #[test]
    fn a_shard_agrees_with_a_map() {
        use std::collections::HashMap;
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut shard = Shard::default();
        let mut model: HashMap<Key, (State, u64)> = HashMap::new();
        let mut now = 0;
        for step in 0..200_000u32 {
            // Few distinct keys, so the same ones come back; the size swings up and down.
            let span = if (step / 20_000) % 2 == 0 { 5_000 } else { 300 };
            let key = Key((next() % span).wrapping_mul(0x9E37_79B9_7F4A_7C15) & !TAG_MASK);
            match next() % 16 {
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
                    shard.put(Slot::new(key, state, expires), at);
                    model.insert(key, (state, expires));
                }
                10..=12 => {
                    shard.remove(key);
                    model.remove(&key);
                }
                13 => {
                    now += next() % 200;
                    shard.sweep(now);
                    model.retain(|_, (_, e)| *e > now);
                }
                _ => now += 1,
            }
            if step % 997 == 0 || step % 20_000 < 3 {
                assert_eq!(shard.len(), model.len());
                assert_eq!(shard.index.len(), shard.slots.len());
                let mut positions: Vec<u32> = shard.index.iter().copied().collect();
                positions.sort_unstable();
                assert!(positions.iter().enumerate().all(|(i, &p)| p as usize == i));
                for (&k, &(state, expires)) in &model {
                    let at = shard.find(k).expect("every key is found");
                    let slot = shard.slots[at];
                    assert_eq!((slot.state(), slot.expires_us), (Some(state), expires));
                }
            }
        }
    }

    #[test]
    fn memory_is_given_back_after_a_flood() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new(clock.clone());
        let (short, long) = (quota(1000, 1), quota(1, 1));
        for n in 0..100_000 {
            let d = id(n);
            let q = if n % 100 == 0 { &long } else { &short };
            store.decide(&[Check::new(&d, "r", q)]);
        }
        let spare = |store: &MemoryStore| {
            (0..SHARDS)
                .map(|i| {
                    let s = store.lock(i);
                    (s.slots.capacity(), s.index.capacity())
                })
                .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
        };
        let (slots, index) = spare(&store);
        assert!((100_000..=100_000 + 100_000 / 8 + 4 * SHARDS).contains(&slots));
        assert!(index >= 100_000);
        // The short buckets refill in 1 ms, the long ones in 1 s.
        clock.advance(1_000);
        assert_eq!(store.sweep(), 1_000);
        let (slots, index) = spare(&store);
        assert!(slots <= 1_000 + 1_000 / 8 + 4 * SHARDS, "{slots} slots");
        assert!(index <= 4 * 1_000 + 32 * SHARDS, "{index} positions");
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
        store.decide(&c);
        clock.advance(5_000_000);
        assert_eq!(store.decide(&c)[0].remaining, 2);
    }
}
