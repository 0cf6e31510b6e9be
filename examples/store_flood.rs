//! A flood of distinct keys into the memory store alone, on the process's clock: decisions
//! a second and nanoseconds per decision into an empty store, into one full of states that
//! can make room (least recently used, not being denied), and into one full of states being
//! denied (every new key refused), issue 42, item 10. One thread, no gateway: where a full
//! store's time goes, without the request path around it.
//!
//!     cargo run --release --example store_flood [-- MAX_KEYS FLOOD]
//!
//! Defaults: `max_keys` 100,000 (bench/soak's flood), a flood of 1,000,000 keys. Each
//! flood runs three times on a fresh store; the best is printed.

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Instant;

use ratewall::identity::{digest_api_key, IdentityDigest};
use ratewall::limiter::memory::{MemoryStore, Pressure};
use ratewall::limiter::{Algorithm, Check, MonotonicClock, Quota, Rate};

fn quota(algorithm: Algorithm, rate: &str, burst: Option<u64>) -> Quota {
    Quota::new(
        algorithm,
        Rate::parse(rate).expect("rate"),
        burst.and_then(NonZeroU64::new),
        NonZeroU64::MIN,
    )
    .expect("quota")
}

/// Decide one check for each of `keys`: how long it took, and how many were allowed.
fn flood(store: &MemoryStore, q: &Quota, keys: &[IdentityDigest]) -> (f64, usize) {
    let started = Instant::now();
    let mut allowed = 0;
    for d in keys {
        let answer = store.decide(&[Check::new(d, "flood", q)]);
        allowed += answer.is_ok_and(|d| d.first().is_some_and(|d| d.allowed)) as usize;
    }
    (started.elapsed().as_secs_f64(), allowed)
}

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let max_keys = args.next().and_then(Result::ok).unwrap_or(100_000);
    let n = args.next().and_then(Result::ok).unwrap_or(1_000_000);
    let digests: Vec<IdentityDigest> = (0..(max_keys + n) as u64)
        .map(|i| digest_api_key(&i.to_le_bytes()))
        .collect();
    let (fill, keys) = digests.split_at(max_keys);
    // bench/soak's flood: states that live a day, so only max_keys bounds them; and a burst
    // of 1, so that every state is being denied after its first request.
    let daily = quota(Algorithm::FixedWindow, "1000/d", None);
    let once = quota(Algorithm::TokenBucket, "1/m", Some(1));
    println!("memory store, max_keys {max_keys}, a flood of {n} distinct keys (best of 3)");
    println!(
        "{:<44} {:>12} {:>10} {:>10}",
        "store before the flood", "decisions/s", "ns each", "allowed"
    );
    type Setup = fn(&MemoryStore, &Quota, &Quota, &[IdentityDigest]);
    let runs: [(&str, &Quota, Setup); 3] = [
        ("empty (max_keys above the flood)", &daily, |_, _, _, _| {}),
        (
            "full of states not being denied (lru)",
            &daily,
            |s, d, _, fill| {
                flood(s, d, fill);
            },
        ),
        (
            "full of states being denied (refused)",
            &once,
            |s, _, o, fill| {
                flood(s, o, fill);
            },
        ),
    ];
    for (name, q, setup) in runs {
        let mut best: Option<(f64, usize)> = None;
        for _ in 0..3 {
            let bound = if name.starts_with("empty") {
                n + max_keys
            } else {
                max_keys
            };
            let store =
                MemoryStore::bounded(Arc::new(MonotonicClock::new()), bound, Pressure::default());
            setup(&store, &daily, &once, fill);
            let run = flood(&store, q, keys);
            if best.is_none_or(|b| run.0 < b.0) {
                best = Some(run);
            }
        }
        if let Some((secs, allowed)) = best {
            println!(
                "{name:<44} {:>12.0} {:>10.0} {:>10}",
                n as f64 / secs,
                secs * 1e9 / n as f64,
                allowed
            );
        }
    }
}
