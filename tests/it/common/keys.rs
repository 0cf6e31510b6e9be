//! The Redis key layout, derived here from CONTRACT.md and not from the crate.
//!
//! CONTRACT.md: keys look like `<prefix>:{<identity-hash>}:<rule>`, and the raw API key
//! never appears in Redis. The identity hash is the first 16 bytes of SHA-256 over a
//! domain tag and the identity, written as 32 lower-case hex digits (README, "How it
//! decides": SHA-256, domain-separated; the tags are `ratewall/key\0` + the API key and
//! `ratewall/global` for the global key). It is computed with `sha2` directly, so a
//! change to the crate's digest function shows up as a test failure instead of moving the
//! expectation along with it.

use sha2::{Digest, Sha256};

/// The prefix every test config uses (`Store::toml`, `RedisCluster::store_toml`).
pub const PREFIX: &str = "rwtest";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of `bytes`, 64 lower-case hex digits.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn identity_hash(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    hex(&h.finalize()[..16])
}

/// The identity hash of API key `key` (32 hex digits).
pub fn api_key_hash(key: &str) -> String {
    identity_hash(&[b"ratewall/key\0", key.as_bytes()])
}

/// The identity hash of `key = "global"`.
pub fn global_hash() -> String {
    identity_hash(&[b"ratewall/global"])
}

/// The Redis key of API key `key` under `rule`, with the tests' prefix.
pub fn redis_key(key: &str, rule: &str) -> String {
    format!("{PREFIX}:{{{}}}:{rule}", api_key_hash(key))
}

/// Whether `key` is `<prefix>:{<32 lower-case hex>}:<rule>`.
pub fn is_hash_tagged(key: &str, rule: &str) -> bool {
    key.strip_prefix(&format!("{PREFIX}:{{"))
        .and_then(|rest| rest.strip_suffix(&format!("}}:{rule}")))
        .is_some_and(|h| {
            h.len() == 32
                && h.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        })
}

/// `sha256:<64 lower-case hex>` of `raw`, as a keys file lists a key without holding it.
pub fn digest_entry(raw: &str) -> String {
    format!("sha256:{}", sha256_hex(raw.as_bytes()))
}
