//! The verified-token cache: a token accepted once is accepted again, until its `exp`
//! (leeway included), at the cost of a SHA-256 and one map lookup under one shard's lock,
//! and only while the key set it was verified with is the current one (its generation).
//! Bounded: at most `max` tokens; a full shard first drops its expired tokens, then any
//! one (a dropped token is verified again when it comes back: only CPU is lost).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex};

use super::jwt::Verified;

/// Shards, each with a lock of its own: the workers verifying tokens rarely meet.
const SHARDS: usize = 16;

/// One shard: tokens by their SHA-256, with the generation of the key set that verified
/// them.
type Shard = Mutex<HashMap<[u8; 32], (Arc<Verified>, u64), BuildHasherDefault<Prehashed>>>;

/// The map's hasher: a key is a SHA-256 already, so 8 of its bytes are as good a hash as
/// any (bytes 8 to 16: byte 0 picks the shard). Only tokens that verified are ever
/// inserted, so no client chooses where an entry lands.
#[derive(Default)]
struct Prehashed(u64);

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

pub(super) struct TokenCache {
    shards: Box<[Shard]>,
    /// Tokens per shard at most.
    per_shard: usize,
}

impl TokenCache {
    pub(super) fn new(max: usize) -> TokenCache {
        TokenCache {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
            per_shard: max.div_ceil(SHARDS).max(1),
        }
    }

    fn shard(&self, hash: &[u8; 32]) -> &Shard {
        &self.shards[usize::from(hash[0]) % SHARDS]
    }

    /// The token of SHA-256 `hash`, if it was accepted by the key set of `generation`
    /// and is still valid at `now`.
    pub(super) fn get(&self, hash: &[u8; 32], now: u64, generation: u64) -> Option<Arc<Verified>> {
        let mut shard = self.shard(hash).lock().unwrap_or_else(|p| p.into_inner());
        match shard.get(hash) {
            Some((v, g)) if now < v.until && *g == generation => Some(v.clone()),
            Some(_) => {
                shard.remove(hash);
                None
            }
            None => None,
        }
    }

    pub(super) fn insert(
        &self,
        hash: [u8; 32],
        verified: Arc<Verified>,
        now: u64,
        generation: u64,
    ) {
        let mut shard = self.shard(&hash).lock().unwrap_or_else(|p| p.into_inner());
        if shard.len() >= self.per_shard && !shard.contains_key(&hash) {
            shard.retain(|_, (v, _)| now < v.until);
            if shard.len() >= self.per_shard {
                if let Some(any) = shard.keys().next().copied() {
                    shard.remove(&any);
                }
            }
        }
        shard.insert(hash, (verified, generation));
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
