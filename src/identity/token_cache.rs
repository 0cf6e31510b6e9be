//! The token caches: a token accepted once is accepted again, until its `exp` (leeway
//! included), and one refused is refused again for a while, at the cost of a SHA-256 and
//! one map lookup under one shard's lock — and only while the key set that judged it is
//! the current one (its generation). Bounded: at most `max` tokens; a full shard first
//! drops its expired tokens, then any one (a dropped token is judged again when it comes
//! back: only CPU is lost).

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::sync::{Arc, Mutex};

use super::jwt::{TokenError, Verified};

/// Shards, each with a lock of its own: the workers verifying tokens rarely meet.
const SHARDS: usize = 16;

/// What a cache holds of a token: until when (Unix seconds) it stands.
pub(super) trait Judged: Clone {
    fn until(&self) -> u64;
}

impl Judged for Arc<Verified> {
    fn until(&self) -> u64 {
        self.until
    }
}

/// A token refused, and until when that stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Refused {
    pub error: TokenError,
    pub until: u64,
}

impl Judged for Refused {
    fn until(&self) -> u64 {
        self.until
    }
}

/// One shard: tokens by their SHA-256, with the generation of the key set that judged
/// them.
type Shard<V, S> = Mutex<HashMap<[u8; 32], (V, u64), S>>;

/// The accepted tokens' hasher: a key is a SHA-256 already, so 8 of its bytes are as good
/// a hash as any (bytes 8 to 16: byte 0 picks the shard). Only tokens that verified are
/// ever inserted there, so no client chooses where an entry lands. The refused tokens' map
/// is one any client fills, with tokens it may grind for a hash: it hashes with a random
/// key ([`RandomState`]).
#[derive(Default)]
pub(super) struct Prehashed(u64);

impl Hasher for Prehashed {
    fn write(&mut self, bytes: &[u8]) {
        match bytes.get(8..16) {
            Some(b) => {
                let mut word = [0u8; 8];
                word.copy_from_slice(b);
                self.0 = u64::from_le_bytes(word);
            }
            // Not a digest (never, here): fold it in all the same.
            None => {
                for b in bytes {
                    self.0 = self.0.rotate_left(8) ^ u64::from(*b);
                }
            }
        }
    }

    /// The length an array's hash starts with: the same for every key.
    fn write_usize(&mut self, _: usize) {}

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The accepted tokens.
pub(super) type Accepted = TokenCache<Arc<Verified>, BuildHasherDefault<Prehashed>>;
/// The refused tokens.
pub(super) type Rejected = TokenCache<Refused, RandomState>;

pub(super) struct TokenCache<V, S> {
    shards: Box<[Shard<V, S>]>,
    /// Tokens per shard at most.
    per_shard: usize,
}

impl<V: Judged, S: BuildHasher + Default> TokenCache<V, S> {
    pub(super) fn new(max: usize) -> TokenCache<V, S> {
        TokenCache {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
            per_shard: max.div_ceil(SHARDS).max(1),
        }
    }

    fn shard(&self, hash: &[u8; 32]) -> &Shard<V, S> {
        &self.shards[usize::from(hash[0]) % SHARDS]
    }

    /// The token of SHA-256 `hash`, if it was judged by the key set of `generation` and
    /// that still stands at `now`.
    pub(super) fn get(&self, hash: &[u8; 32], now: u64, generation: u64) -> Option<V> {
        let mut shard = self.shard(hash).lock().unwrap_or_else(|p| p.into_inner());
        match shard.get(hash) {
            Some((v, g)) if now < v.until() && *g == generation => Some(v.clone()),
            Some(_) => {
                shard.remove(hash);
                None
            }
            None => None,
        }
    }

    pub(super) fn insert(&self, hash: [u8; 32], judged: V, now: u64, generation: u64) {
        let mut shard = self.shard(&hash).lock().unwrap_or_else(|p| p.into_inner());
        if shard.len() >= self.per_shard && !shard.contains_key(&hash) {
            shard.retain(|_, (v, _)| now < v.until());
            if shard.len() >= self.per_shard {
                if let Some(any) = shard.keys().next().copied() {
                    shard.remove(&any);
                }
            }
        }
        shard.insert(hash, (judged, generation));
    }

    pub(super) fn clear(&self) {
        for s in self.shards.iter() {
            s.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    pub(super) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }
}
