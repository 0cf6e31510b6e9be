//! Measures what one tracked key costs, per algorithm: in the memory store (heap bytes,
//! counted by a wrapping allocator; also the worst over every size from 10,000 to 1,000,000
//! keys, and what is left once a sweep has dropped them) and, given a Redis URL, in Redis
//! (`MEMORY USAGE`).
//!
//!     cargo run --release --example measure_memory [-- redis://127.0.0.1:6379]
//!
//! The Redis run writes keys under the prefix `ratewall-measure` and deletes them after.

use std::alloc::{GlobalAlloc, Layout, System};
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use ratewall::identity::digest_api_key;
use ratewall::limiter::memory::{MemoryStore, Pressure};
use ratewall::limiter::redis::{DecideAt, RedisStore};
use ratewall::limiter::{Algorithm, Check, ManualClock, Quota, Rate};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Relaxed);
        LIVE.fetch_add(new_size, Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::TokenBucket,
    Algorithm::Gcra,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
];

fn quota(algorithm: Algorithm) -> Quota {
    let burst = algorithm.has_burst().then(|| NonZeroU64::new(20)).flatten();
    Quota::new(
        algorithm,
        Rate::parse("10/s").expect("rate"),
        burst,
        NonZeroU64::MIN,
    )
    .expect("quota")
}

/// A memory store whose `max_keys` is well above the million keys measured (its shards
/// hold an even share each, and keys do not hash perfectly evenly): nothing is evicted.
fn unbounded(clock: std::sync::Arc<ManualClock>) -> MemoryStore {
    MemoryStore::bounded(clock, 4_000_000, Pressure::default())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let redis_url = std::env::args().nth(1);
    println!("memory store: heap bytes per tracked key (all keys live, after N distinct keys)");
    println!(
        "{:<16} {:>12} {:>12} {:>12}",
        "algorithm", "10,000", "100,000", "1,000,000"
    );
    let digests: Vec<_> = (0..1_000_000u32)
        .map(|i| digest_api_key(&i.to_le_bytes()))
        .collect();
    for alg in ALGORITHMS {
        let q = quota(alg);
        let mut row = format!("{:<16}", alg.name());
        for n in [10_000usize, 100_000, 1_000_000] {
            let clock = ManualClock::new(1);
            let before = LIVE.load(Relaxed);
            let store = unbounded(clock);
            for d in &digests[..n] {
                store
                    .decide(&[Check::new(d, "api", &q)])
                    .expect("room: the bound is above the keys measured");
            }
            let bytes = LIVE.load(Relaxed) - before;
            assert_eq!(store.len(), n);
            row.push_str(&format!(" {:>12.1}", bytes as f64 / n as f64));
        }
        println!("{row}");
    }

    // Not only at three sizes: the bytes per key after every key from 10,000 to 1,000,000,
    // whose worst is just after a resize. One algorithm: every state takes the same slot.
    let q = quota(Algorithm::TokenBucket);
    let clock = ManualClock::new(1);
    let before = LIVE.load(Relaxed);
    let store = unbounded(clock.clone());
    let (mut worst, mut at) = (0.0, 0);
    for (i, d) in digests.iter().enumerate() {
        store
            .decide(&[Check::new(d, "api", &q)])
            .expect("room: the bound is above the keys measured");
        let n = i + 1;
        let per_key = (LIVE.load(Relaxed) - before) as f64 / n as f64;
        if n >= 10_000 && per_key > worst {
            (worst, at) = (per_key, n);
        }
    }
    println!("worst from 10,000 to 1,000,000 keys: {worst:.1} bytes/key (at {at} keys)");
    // Then every bucket refills and a sweep drops them all.
    clock.advance(60_000_000);
    assert_eq!(store.sweep(), 0);
    println!(
        "after a sweep that drops all 1,000,000: {} bytes held",
        LIVE.load(Relaxed) - before
    );

    let Some(url) = redis_url else {
        println!("\n(give a Redis URL to measure MEMORY USAGE per key in Redis)");
        return;
    };
    let store = RedisStore::new(&url, "ratewall-measure", std::time::Duration::from_secs(2))
        .expect("redis url");
    let client = redis::Client::open(url.as_str()).expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to Redis");
    println!("\nRedis: MEMORY USAGE of one key, bytes (key name <prefix>:{{<32 hex>}}:api, prefix \"ratewall-measure\")");
    let now = 1_700_000_000_000_000u64;
    for alg in ALGORITHMS {
        let q = quota(alg);
        let d = digest_api_key(b"measure");
        let check = Check::new(&d, "api", &q);
        // Two requests 1 ms apart, so every state holds non-trivial numbers.
        store
            .decide_at(std::slice::from_ref(&check), Some(now))
            .await
            .expect("decide");
        store
            .decide_at(std::slice::from_ref(&check), Some(now + 1_000))
            .await
            .expect("decide");
        let key = store.key(&check);
        let usage: i64 = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("MEMORY USAGE");
        let value: String = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("GET");
        println!(
            "{:<16} {:>5}   value {:?} ({} bytes)",
            alg.name(),
            usage,
            value,
            value.len()
        );
        let _: i64 = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("DEL");
    }
}
