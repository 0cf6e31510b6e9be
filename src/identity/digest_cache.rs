//! The digests of the API keys a worker thread saw last, so that a client sending the same
//! key again is not hashed again (a SHA-256 is most of what identifying a request costs
//! where the CPU has no SHA extensions).
//!
//! A fixed table per thread ([`SLOTS`] slots, keys up to [`MAX_CACHED`] bytes; longer keys
//! are hashed every time): it never grows, whatever clients send. A key's slot is chosen
//! by a hash keyed with this thread's own random keys (`RandomState`, SipHash), so a client
//! cannot aim its keys at another's slot; a new key simply takes its slot's place. A slot
//! is used only where it holds the very key asked for, compared in full and in constant
//! time (no early exit telling how much of another client's key matched). The digest is a
//! pure function of the key, so a slot never goes stale. Keys stay in this table, in
//! memory only: nothing here is logged, counted or shown.

use std::cell::RefCell;
use std::hash::{BuildHasher, RandomState};

use super::IdentityDigest;

/// Slots per thread.
pub const SLOTS: usize = 256;
/// The longest key a slot holds; a longer one is hashed each time.
pub const MAX_CACHED: usize = 96;

struct Slot {
    /// Bytes of `key` in use; `None`: empty.
    len: Option<u8>,
    key: [u8; MAX_CACHED],
    digest: IdentityDigest,
}

impl Slot {
    const EMPTY: Slot = Slot {
        len: None,
        key: [0; MAX_CACHED],
        digest: IdentityDigest([0; 16]),
    };

    /// Whether this slot holds `key`: every byte compared, whichever differs.
    fn holds(&self, key: &[u8]) -> bool {
        if self.len.map(usize::from) != Some(key.len()) {
            return false;
        }
        let diff = self
            .key
            .iter()
            .zip(key)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    fn set(&mut self, key: &[u8], digest: IdentityDigest) {
        // Only keys that fit are set (see `digest`): u8 holds MAX_CACHED.
        if let (Some(room), Ok(len)) = (self.key.get_mut(..key.len()), u8::try_from(key.len())) {
            room.copy_from_slice(key);
            self.len = Some(len);
            self.digest = digest;
        }
    }
}

struct Table {
    hasher: RandomState,
    slots: Box<[Slot]>,
}

impl Table {
    fn new() -> Table {
        Table {
            hasher: RandomState::new(),
            slots: (0..SLOTS).map(|_| Slot::EMPTY).collect(),
        }
    }
}

thread_local! {
    static TABLE: RefCell<Option<Table>> = const { RefCell::new(None) };
}

/// `compute(key)`, from this thread's table where it holds `key`.
pub fn digest(key: &[u8], compute: fn(&[u8]) -> IdentityDigest) -> IdentityDigest {
    if key.len() > MAX_CACHED {
        return compute(key);
    }
    let cached = TABLE.try_with(|table| {
        let mut table = table.try_borrow_mut().ok()?;
        let table = table.get_or_insert_with(Table::new);
        // The slot is the hash modulo SLOTS (a power of two).
        let at = (table.hasher.hash_one(key) as usize) & (SLOTS - 1);
        let slot = table.slots.get_mut(at)?;
        if slot.holds(key) {
            return Some(slot.digest);
        }
        let digest = compute(key);
        slot.set(key, digest);
        Some(digest)
    });
    cached.ok().flatten().unwrap_or_else(|| compute(key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::digest_api_key;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static COMPUTED: AtomicUsize = AtomicUsize::new(0);

    fn counted(key: &[u8]) -> IdentityDigest {
        COMPUTED.fetch_add(1, Ordering::Relaxed);
        digest_api_key(key)
    }

    const _: () = assert!(SLOTS.is_power_of_two() && MAX_CACHED <= u8::MAX as usize);

    /// Whatever the table holds or evicts, the digest is the key's own; a key seen again
    /// is not hashed again, one too long is hashed every time.
    #[test]
    fn the_table_answers_what_hashing_would() {
        // Tests run on threads of their own: this thread's table is this test's.
        let before = COMPUTED.load(Ordering::Relaxed);
        assert_eq!(digest(b"key-a", counted), digest_api_key(b"key-a"));
        assert_eq!(digest(b"key-a", counted), digest_api_key(b"key-a"));
        assert_eq!(COMPUTED.load(Ordering::Relaxed) - before, 1, "hashed once");
        // Keys that differ in one byte, in length, or are empty are told apart.
        for key in [&b"key-b"[..], b"key-", b"key-aa", b"", b"KEY-A"] {
            assert_eq!(digest(key, counted), digest_api_key(key));
        }
        let long = vec![b'x'; MAX_CACHED + 1];
        let before = COMPUTED.load(Ordering::Relaxed);
        assert_eq!(digest(&long, counted), digest_api_key(&long));
        assert_eq!(digest(&long, counted), digest_api_key(&long));
        assert_eq!(COMPUTED.load(Ordering::Relaxed) - before, 2, "never cached");
        let fits = vec![b'y'; MAX_CACHED];
        assert_eq!(digest(&fits, counted), digest_api_key(&fits));
        // Many more keys than slots: every answer still right, the table no larger.
        for i in 0..(SLOTS * 8) {
            let key = format!("k{i}");
            assert_eq!(
                digest(key.as_bytes(), counted),
                digest_api_key(key.as_bytes())
            );
        }
        for i in (0..(SLOTS * 8)).rev() {
            let key = format!("k{i}");
            assert_eq!(
                digest(key.as_bytes(), counted),
                digest_api_key(key.as_bytes())
            );
        }
        TABLE.with(|t| assert_eq!(t.borrow().as_ref().map(|t| t.slots.len()), Some(SLOTS)));
    }
}
