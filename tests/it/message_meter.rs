//! WebSocket message and byte meters against a real redis-server: the sockets of one
//! identity share one bucket through the store (as gateways do), each charging it a batch
//! per store call (a byte meter: what a payload lacks, in whole batches).

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{scan, RedisServer};
use ratewall::identity::digest_ip;
use ratewall::limiter::breaker::Limiter;
use ratewall::limiter::metrics::LimiterMetrics;
use ratewall::limiter::redis::RedisStore;
use ratewall::limiter::store::{Backend, Settings};
use ratewall::limiter::{OnError, Rate};
use ratewall::rules::{Bytes, Messages};
use ratewall::telemetry::stats::Stats;
use ratewall::websocket::{Meter, Refill};

const PREFIX: &str = "rwmeter";

/// A limiter on `server`, as one gateway has it.
fn gateway_limiter(server: &RedisServer) -> Arc<Limiter> {
    let settings = Settings {
        backend: Backend::Redis { url: server.url() },
        prefix: PREFIX.into(),
        timeout: Duration::from_secs(2),
        ..Settings::default()
    };
    let store = RedisStore::new(&server.url(), PREFIX, settings.timeout).expect("RedisStore::new");
    let metrics = LimiterMetrics::register(&mut prometheus_client::registry::Registry::default());
    Limiter::new(Box::new(store), &settings, metrics, Arc::new(Stats::new()))
}

/// Frames `meter` passes before the bucket makes it wait, and the store calls it made.
async fn drain(meter: &mut Meter) -> (u64, u64) {
    drain_by(meter, 1).await
}

/// What `meter` passes, asking for `need` at a time, before the bucket makes it wait, and
/// the store calls it made.
async fn drain_by(meter: &mut Meter, need: u64) -> (u64, u64) {
    let (mut frames, mut calls) = (0, 0);
    loop {
        calls += 1;
        match meter.refill(need).await {
            Refill::Granted => {
                frames += meter.tokens();
                meter.spend(meter.tokens());
            }
            Refill::Wait(_) => return (frames, calls),
            Refill::Unavailable => panic!("the store failed"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_meters_of_one_identity_share_one_bucket_in_redis() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    // Two gateways, each with its own limiter and connection, on one Redis.
    let (one, two) = (gateway_limiter(&server), gateway_limiter(&server));
    let messages = Messages {
        rate: Rate::parse("50/s").expect("a rate"),
        burst: 1_000,
        max_bytes: None,
    };
    let client = digest_ip("192.0.2.10".parse().expect("an address"));
    let started = Instant::now();
    let mut a = Meter::messages(one.clone(), client, "chat", &messages, OnError::Deny);
    let mut b = Meter::messages(two, client, "chat", &messages, OnError::Deny);
    assert_eq!(a.batch(), 5);

    let (a_frames, a_calls) = drain(&mut a).await;
    let (b_frames, _) = drain(&mut b).await;
    let elapsed = started.elapsed();
    // The bucket's 1,000 went to `a`, 5 a store call; `b` only got what dripped in
    // since (50/s), not a bucket of its own.
    assert!(a_frames >= 1_000, "a passed {a_frames}");
    assert!(
        a_calls <= a_frames / 5 + 1,
        "{a_calls} store calls for {a_frames} frames"
    );
    let dripped = (elapsed.as_millis() as u64 * 50).div_ceil(1_000) + 5;
    assert!(
        a_frames + b_frames <= 1_000 + dripped,
        "a {a_frames} + b {b_frames} frames in {elapsed:?}: more than one bucket"
    );
    // The check above tells one bucket from two while what dripped is less than a bucket
    // (a run under 20 s): a bound on meaning, not on speed.
    assert!(
        dripped < 1_000,
        "too slow to tell one bucket from two: {elapsed:?}"
    );

    // Another identity has its own bucket.
    let other = digest_ip("192.0.2.11".parse().expect("an address"));
    let mut c = Meter::messages(one, other, "chat", &messages, OnError::Deny);
    assert!(drain(&mut c).await.0 >= 1_000);

    // One key per identity, under the rule "<rule>:messages".
    let mut keys = scan(&mut server.conn(), &format!("{PREFIX}:*"));
    keys.sort();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(
        keys.iter().all(|k| k.ends_with(":chat:messages")),
        "{keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_byte_meters_of_one_identity_share_one_bucket_in_redis() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let (one, two) = (gateway_limiter(&server), gateway_limiter(&server));
    // 100 KiB/s, burst 1 MiB: batches of 10,240 bytes.
    let bytes = Bytes {
        rate: Rate::every(100 << 10, Duration::from_secs(1)),
        burst: 1 << 20,
    };
    let client = digest_ip("192.0.2.20".parse().expect("an address"));
    let started = Instant::now();
    let mut a = Meter::bytes(one, client, "chat", &bytes, OnError::Deny);
    let mut b = Meter::bytes(two, client, "chat", &bytes, OnError::Deny);
    assert_eq!(a.batch(), 10_240);

    // Payloads of 64 KiB: each refill asks for one payload's worth, in whole batches
    // (7 of them), one store call a payload.
    let (a_bytes, a_calls) = drain_by(&mut a, 64 << 10).await;
    let (b_bytes, _) = drain_by(&mut b, 64 << 10).await;
    let elapsed = started.elapsed();
    assert!(a_bytes >= 900 << 10, "a took {a_bytes}");
    assert!(
        a_calls <= a_bytes / (64 << 10) + 2,
        "{a_calls} store calls for {a_bytes} bytes"
    );
    let dripped = (elapsed.as_millis() as u64 * (100 << 10)).div_ceil(1_000) + (70 << 10);
    assert!(
        a_bytes + b_bytes <= (1 << 20) + dripped,
        "a {a_bytes} + b {b_bytes} bytes in {elapsed:?}: more than one bucket"
    );
    assert!(
        elapsed < Duration::from_secs(5),
        "too slow to tell: {elapsed:?}"
    );
    // One key, under the rule "<rule>:bytes".
    let keys = scan(&mut server.conn(), &format!("{PREFIX}:*"));
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].ends_with(":chat:bytes"), "{keys:?}");
}
