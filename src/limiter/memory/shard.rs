//! One shard of the memory store: its slots (a key, its state's tag and held flag, the
//! state's fields, its expiry), the index that finds them, the three recency lists
//! through them (free, held, pinned), and how room is made for a new key (the order
//! [`super`] describes). A shard knows nothing of requests: the store locks the shards a
//! request's checks fall in and decides across them.

use hashbrown::HashTable;

use super::{Pressure, SWEEP_GAP};
use crate::limiter::{concurrency, fixed_window, gcra, sliding_window, token_bucket, State};

/// The low bits of a slot's first word that say which algorithm's state it holds.
pub(super) const TAG_BITS: u32 = 3;
pub(super) const TAG_MASK: u64 = (1 << TAG_BITS) - 1;
/// The bit after the tag: the entry is held (its identity is being denied).
pub(super) const HELD: u64 = 1 << TAG_BITS;
/// The bits that tell keys apart.
pub(super) const KEY_MASK: u64 = !(TAG_MASK | HELD);

/// No slot: the end of the recency list.
pub(super) const NIL: u32 = u32::MAX;

/// An entry's key: the identity digest folded with the rule name (128 bits), reduced to 60
/// bits here; the shard comes from a keyed hash of all 128, so 60 to 66 bits tell keys
/// apart. The low 4 bits are always zero: a slot keeps its state's tag and its held
/// flag there.
///
/// Two keys that agree on all those bits share one entry. For uniformly distributed
/// digests (SHA-256) the chance that any two of `n` live keys in one shard do is about
/// `n² / 2^61`: 2·10⁻⁸ at a million keys in 64 shards. Under rules of the same algorithm
/// the two identities then share one limit (stricter, never looser); under rules of
/// different algorithms each reads the other's state as none, as after a reload that
/// changed the rule's algorithm.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) struct Key(pub(super) u64);

impl Key {
    /// Where the key's position lives in a shard's index. The key is already uniformly
    /// distributed; the shift only fills the flag bits, which hashbrown would otherwise
    /// use to pick a bucket.
    pub(super) fn hash(self) -> u64 {
        self.0 ^ (self.0 >> 4)
    }
}

/// One tracked key: its key, state's tag and held flag, the state's fields, its expiry,
/// and its neighbours in the shard's recency list. 48 bytes: the state's enum
/// discriminant and the flag live in the key's low bits.
#[derive(Clone, Copy, Debug)]
pub(super) struct Slot {
    pub(super) key_tag: u64,
    pub(super) words: [u64; 3],
    /// Past this moment (µs, the store's clock) the entry means the same as no entry; a
    /// concurrency entry never expires (`u64::MAX`), it is removed when its count is 0.
    pub(super) expires_us: u64,
    /// The next more recently used slot, or [`NIL`].
    pub(super) newer: u32,
    /// The next less recently used slot, or [`NIL`].
    pub(super) older: u32,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 48);

pub(super) const TOKEN_BUCKET: u64 = 1;
pub(super) const GCRA: u64 = 2;
pub(super) const FIXED_WINDOW: u64 = 3;
pub(super) const SLIDING_WINDOW: u64 = 4;
pub(super) const CONCURRENCY: u64 = 5;

impl Slot {
    pub(super) fn new(key: Key, state: State, expires_us: u64, held: bool) -> Slot {
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
            key_tag: key.0 | tag | if held { HELD } else { 0 },
            words,
            expires_us,
            newer: NIL,
            older: NIL,
        }
    }

    pub(super) fn key(&self) -> Key {
        Key(self.key_tag & KEY_MASK)
    }

    pub(super) fn live(&self, now_us: u64) -> bool {
        self.expires_us > now_us
    }

    pub(super) fn held(&self) -> bool {
        self.key_tag & HELD != 0
    }

    /// The recency list the slot is on, by its flags.
    pub(super) fn list(&self) -> List {
        if self.key_tag & TAG_MASK == CONCURRENCY {
            List::Pinned
        } else if self.held() {
            List::Held
        } else {
            List::Free
        }
    }

    pub(super) fn state(&self) -> Option<State> {
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

/// Why a full shard took no new key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoRoom {
    /// Nothing left but requests in flight and the request's own entries: [`Full`].
    Full,
    /// Every entry that could go is held: the key is refused, until `until_us` at the
    /// soonest (when a held entry could be whole again).
    Held { until_us: u64 },
}

/// Which recency list a slot is on. Room is made from the least recently used end of
/// `Free` (after expired entries of `Free` or `Held`); live `Held` slots (identities
/// being denied) and `Pinned` ones (concurrency counts: requests in flight hold them) are
/// never dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum List {
    Free = 0,
    Held = 1,
    Pinned = 2,
}

/// A recency list's two ends ([`NIL`] when it is empty).
#[derive(Debug, Clone, Copy)]
pub(super) struct Ends {
    pub(super) newest: u32,
    pub(super) oldest: u32,
}

pub(super) const EMPTY: Ends = Ends {
    newest: NIL,
    oldest: NIL,
};

/// One shard's entries: dense in `slots` (no holes: a removal moves the last slot into the
/// hole), found through `index`, a hash table of positions in `slots` hashed by their
/// slot's key, and ordered by recency through the slots' `newer`/`older` links, one list
/// per [`List`]. Every position in `index` is in bounds, every slot has exactly one
/// position in `index`, and every slot is on exactly one list, the one its flags name;
/// only the methods below change them.
pub(super) struct Shard {
    pub(super) slots: Vec<Slot>,
    pub(super) index: HashTable<u32>,
    pub(super) lists: [Ends; 3],
    /// The most entries this shard holds.
    pub(super) cap: usize,
    /// No entry expires before this (a lower bound, exact after a sweep).
    pub(super) next_expiry: u64,
    /// When a full shard last swept itself.
    pub(super) swept_at: Option<u64>,
}

impl Shard {
    pub(super) fn new(cap: usize) -> Shard {
        Shard {
            slots: Vec::new(),
            index: HashTable::new(),
            lists: [EMPTY; 3],
            cap: cap.max(1),
            next_expiry: u64::MAX,
            swept_at: None,
        }
    }

    /// Where `key`'s slot is, expired or not.
    pub(super) fn find(&self, key: Key) -> Option<usize> {
        let slots = &self.slots;
        self.index
            .find(key.hash(), |&i| {
                slots.get(i as usize).is_some_and(|s| s.key() == key)
            })
            .map(|&i| i as usize)
    }

    /// The state in the slot at `at`, unless it has expired at `now_us`.
    pub(super) fn state_at(&self, at: Option<usize>, now_us: u64) -> Option<State> {
        self.slots
            .get(at?)
            .filter(|s| s.live(now_us))
            .and_then(Slot::state)
    }

    /// `at`, if that is where `key`'s slot is (a position [`Shard::find`] gave, with no
    /// removal since), else wherever its slot is.
    pub(super) fn locate(&self, key: Key, at: Option<usize>) -> Option<usize> {
        match at {
            Some(i) if self.slots.get(i).is_some_and(|s| s.key() == key) => Some(i),
            _ => self.find(key),
        }
    }

    // --- the recency lists ---------------------------------------------------------------

    pub(super) fn link(&mut self, i: u32) -> Option<&mut Slot> {
        if i == NIL {
            None
        } else {
            self.slots.get_mut(i as usize)
        }
    }

    /// Take slot `i` off its list (the one its flags name now).
    pub(super) fn unlink(&mut self, i: usize) {
        let Some(&s) = self.slots.get(i) else {
            return;
        };
        let l = s.list() as usize;
        match self.link(s.newer) {
            Some(n) => n.older = s.older,
            None => self.lists[l].newest = s.older,
        }
        match self.link(s.older) {
            Some(o) => o.newer = s.newer,
            None => self.lists[l].oldest = s.newer,
        }
    }

    /// Put slot `i` (off every list) at the most recent end of the list its flags name.
    pub(super) fn push_newest(&mut self, i: usize) {
        let Some(l) = self.slots.get(i).map(|s| s.list() as usize) else {
            return;
        };
        let old_newest = self.lists[l].newest;
        // Positions fit in u32: `insert` never grows a shard past it.
        let at = i as u32;
        if let Some(s) = self.slots.get_mut(i) {
            s.newer = NIL;
            s.older = old_newest;
        }
        match self.link(old_newest) {
            Some(n) => n.newer = at,
            None => self.lists[l].oldest = at,
        }
        self.lists[l].newest = at;
    }

    /// Slot `i` was just used: make it the most recent on its list.
    pub(super) fn touch(&mut self, i: usize) {
        let l = match self.slots.get(i) {
            Some(s) => s.list() as usize,
            None => return,
        };
        if self.lists[l].newest != i as u32 {
            self.unlink(i);
            self.push_newest(i);
        }
    }

    /// The slot now at `to` came from `from`: point its neighbours (and the index) at `to`.
    pub(super) fn relocated(&mut self, from: usize, to: usize) {
        let Some(&s) = self.slots.get(to) else {
            return;
        };
        let (t, l) = (to as u32, s.list() as usize);
        match self.link(s.newer) {
            Some(n) => n.older = t,
            None => self.lists[l].newest = t,
        }
        match self.link(s.older) {
            Some(o) => o.newer = t,
            None => self.lists[l].oldest = t,
        }
        let pos = self.index.find_mut(s.key().hash(), |&p| p as usize == from);
        debug_assert!(pos.is_some(), "every slot has a position in the index");
        if let Some(pos) = pos {
            *pos = t;
        }
    }

    // --- changes -------------------------------------------------------------------------

    /// Write `slot` over its key's slot at `at` (or wherever it is): the state, flags and
    /// expiry change; its place in recency does not, unless its flags move it to another
    /// list (then it is the most recent there). False if the key has no slot.
    pub(super) fn update(&mut self, slot: Slot, at: Option<usize>) -> bool {
        let Some(i) = self.locate(slot.key(), at) else {
            return false;
        };
        let moves = self.slots.get(i).is_some_and(|s| s.list() != slot.list());
        if moves {
            self.unlink(i);
        }
        if let Some(s) = self.slots.get_mut(i) {
            s.key_tag = slot.key_tag;
            s.words = slot.words;
            s.expires_us = slot.expires_us;
        }
        if moves {
            self.push_newest(i);
        }
        self.next_expiry = self.next_expiry.min(slot.expires_us);
        true
    }

    /// Mark the slot at `i` held: its identity is being denied. (A pinned slot stays as it
    /// is: it is never dropped anyway.)
    pub(super) fn hold(&mut self, i: usize) {
        if self.slots.get(i).is_some_and(|s| s.list() == List::Free) {
            self.unlink(i);
            if let Some(s) = self.slots.get_mut(i) {
                s.key_tag |= HELD;
            }
            self.push_newest(i);
        }
    }

    /// Store `slot` for a key that has none, as the most recent on its list. The caller
    /// has made room ([`Shard::make_room`]); past 2^32 entries (170 GB) nothing more is
    /// stored.
    pub(super) fn insert(&mut self, slot: Slot) {
        let key = slot.key();
        let Shard { slots, index, .. } = self;
        let Ok(next) = u32::try_from(slots.len()) else {
            return;
        };
        if next == NIL {
            return;
        }
        index.insert_unique(key.hash(), next, |&i| {
            slots.get(i as usize).map_or(0, |s| s.key().hash())
        });
        if slots.len() == slots.capacity() {
            // Grow by a sixteenth, not double: at most 6.25% of the slots are spare — and
            // never past the shard's bound.
            let room = self.cap.saturating_sub(slots.len()).max(1);
            slots.reserve_exact((slots.len() / 16).max(4).min(room));
        }
        slots.push(Slot {
            newer: NIL,
            older: NIL,
            ..slot
        });
        self.next_expiry = self.next_expiry.min(slot.expires_us);
        self.push_newest(next as usize);
    }

    /// Forget the slot at `i`.
    pub(super) fn remove_at(&mut self, i: usize) {
        let Some(key) = self.slots.get(i).map(Slot::key) else {
            return;
        };
        self.unlink(i);
        if let Ok(found) = self.index.find_entry(key.hash(), |&p| p as usize == i) {
            found.remove();
        }
        self.slots.swap_remove(i);
        // The last slot, if it was not the one removed, is at `i` now.
        let last = self.slots.len();
        if i < last {
            self.relocated(last, i);
        }
    }

    /// Forget `key`.
    pub(super) fn remove(&mut self, key: Key) {
        if let Some(i) = self.find(key) {
            self.remove_at(i);
        }
    }

    /// Make room for one more entry, `reserved` being already promised to this request:
    /// drop one if the shard would be full, in the order the module describes, never one
    /// of the request's own keys (`kept`) nor a live held one. Counts what it drops in
    /// `pressure`. [`NoRoom::Held`] when only held entries could have gone,
    /// [`NoRoom::Full`] when nothing but pinned slots and the request's own are left.
    pub(super) fn make_room(
        &mut self,
        now_us: u64,
        reserved: usize,
        kept: &dyn Fn(Key) -> bool,
        pressure: &Pressure,
    ) -> Result<(), NoRoom> {
        if self.slots.len() + reserved < self.cap {
            return Ok(());
        }
        // 1. An expired entry: the least recently used of either list, if it has expired;
        // else any, by a sweep.
        for l in [List::Free, List::Held] {
            let oldest = self.lists[l as usize].oldest as usize;
            if self
                .slots
                .get(oldest)
                .is_some_and(|s| !s.live(now_us) && !kept(s.key()))
            {
                self.remove_at(oldest);
                pressure.expired.inc();
                return Ok(());
            }
        }
        let may_sweep = self
            .swept_at
            .is_none_or(|t| now_us >= t.saturating_add(SWEEP_GAP));
        if now_us >= self.next_expiry && may_sweep {
            self.swept_at = Some(now_us);
            let dropped = self.sweep(now_us, kept);
            if dropped > 0 {
                pressure.expired.inc_by(dropped as u64);
                return Ok(());
            }
        }
        // 2. The least recently used entry not being denied.
        let mut i = self.lists[List::Free as usize].oldest;
        while let Some(s) = self.slots.get(i as usize).copied() {
            if !kept(s.key()) {
                self.remove_at(i as usize);
                pressure.lru.inc();
                return Ok(());
            }
            i = s.newer;
        }
        // 3. Held entries only (besides the request's own): none goes.
        let mut i = self.lists[List::Held as usize].oldest;
        while let Some(s) = self.slots.get(i as usize).copied() {
            if !kept(s.key()) {
                return Err(NoRoom::Held {
                    until_us: self.next_expiry,
                });
            }
            i = s.newer;
        }
        Err(NoRoom::Full)
    }

    /// Drop every slot expired at `now_us` (but `kept` ones), then give memory back: the
    /// spare slots past a sixteenth, the index when under 40% full, all of it when the
    /// shard is empty. Returns how many it dropped.
    ///
    /// A few are removed one by one; when many are, the survivors are laid out afresh,
    /// list by list in recency order, and the index rebuilt, one pass each.
    pub(super) fn sweep(&mut self, now_us: u64, kept: &dyn Fn(Key) -> bool) -> usize {
        let goes = |s: &Slot| !s.live(now_us) && !kept(s.key());
        let dropped = self.slots.iter().filter(|s| goes(s)).count();
        if dropped > 0 && dropped * 4 < self.slots.len() {
            let mut i = 0;
            while let Some(s) = self.slots.get(i) {
                if goes(s) {
                    // The last slot comes to `i`: look at `i` again.
                    self.remove_at(i);
                } else {
                    i += 1;
                }
            }
        } else if dropped > 0 {
            let mut fresh = Vec::with_capacity(self.slots.len() - dropped);
            let mut lists = [EMPTY; 3];
            for (l, ends) in lists.iter_mut().enumerate() {
                let first = fresh.len() as u32;
                let mut at = self.lists[l].newest;
                while let Some(&s) = self.slots.get(at as usize) {
                    at = s.older;
                    if goes(&s) {
                        continue;
                    }
                    let n = fresh.len() as u32;
                    fresh.push(Slot {
                        newer: if n == first { NIL } else { n - 1 },
                        older: n + 1,
                        ..s
                    });
                }
                if fresh.len() as u32 > first {
                    let last = fresh.len() - 1;
                    fresh[last].older = NIL;
                    *ends = Ends {
                        newest: first,
                        oldest: last as u32,
                    };
                }
            }
            self.lists = lists;
            self.index.clear();
            for (i, s) in fresh.iter().enumerate() {
                self.index.insert_unique(s.key().hash(), i as u32, |&p| {
                    fresh.get(p as usize).map_or(0, |s| s.key().hash())
                });
            }
            self.slots = fresh;
        }
        self.next_expiry = self
            .slots
            .iter()
            .map(|s| s.expires_us)
            .min()
            .unwrap_or(u64::MAX);
        let len = self.slots.len();
        if len == 0 {
            self.slots = Vec::new();
            self.index = HashTable::new();
            return dropped;
        }
        if self.slots.capacity() > len + len / 8 + 4 {
            self.slots.shrink_to(len + len / 16);
        }
        let Shard { slots, index, .. } = self;
        if index.capacity() > 32 && index.len() * 5 < index.capacity() * 2 {
            index.shrink_to(len, |&i| {
                slots.get(i as usize).map_or(0, |s| s.key().hash())
            });
        }
        dropped
    }

    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }
}
