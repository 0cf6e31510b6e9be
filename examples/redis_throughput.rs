//! How many decisions one Redis makes per second, and per second of Redis CPU: the
//! figure to size Redis by (docs/scaling.md).
//!
//!     cargo run --release --example redis_throughput -- redis://127.0.0.1:6379 [seconds] [concurrency]
//!
//! Runs `concurrency` tasks, each deciding one request after another for distinct API
//! keys (one rule, token bucket), over one multiplexed connection, like one gateway.
//! Redis' CPU comes from `INFO cpu` before and after. Writes keys under the prefix
//! `ratewall-throughput`; they expire by themselves within a second.

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratewall::identity::digest_api_key;
use ratewall::limiter::redis::{DecideAt, RedisStore};
use ratewall::limiter::{Algorithm, Check, Quota, Rate};

async fn redis_cpu(conn: &mut redis::aio::MultiplexedConnection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .expect("INFO cpu");
    info.lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| *k == "used_cpu_sys" || *k == "used_cpu_user")
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .sum()
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let secs: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(10);
    let concurrency: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(64);

    let store = Arc::new(
        RedisStore::new(&url, "ratewall-throughput", Duration::from_secs(2)).expect("redis url"),
    );
    let quota = Quota::new(
        Algorithm::TokenBucket,
        Rate::parse("1000/s").expect("rate"),
        NonZeroU64::new(1000),
        NonZeroU64::MIN,
    )
    .expect("quota");
    let mut conn = redis::Client::open(url.as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");

    // Warm up (loads the script).
    let d = digest_api_key(b"warm-up");
    store
        .decide_at(&[Check::new(&d, "api", &quota)], None)
        .await
        .expect("decide");

    let done = Arc::new(AtomicU64::new(0));
    let cpu0 = redis_cpu(&mut conn).await;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let (store, done) = (store.clone(), done.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < deadline {
                    let key = format!("key-{t}-{i}");
                    let d = digest_api_key(key.as_bytes());
                    if store
                        .decide_at(&[Check::new(&d, "api", &quota)], None)
                        .await
                        .is_ok()
                    {
                        done.fetch_add(1, Relaxed);
                    }
                    i += 1;
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu = redis_cpu(&mut conn).await - cpu0;
    let n = done.load(Relaxed) as f64;
    println!("decisions            {n:.0} in {wall:.1} s, {concurrency} concurrent, one multiplexed connection");
    println!("decisions/s          {:.0}", n / wall);
    println!(
        "Redis CPU            {cpu:.2} s ({:.0}% of one core)",
        100.0 * cpu / wall
    );
    println!(
        "decisions/CPU-second {:.0}  (what one Redis core sustains)",
        n / cpu.max(1e-9)
    );
}
