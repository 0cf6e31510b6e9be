//! The Redis store batches: the requests one event loop decides while it goes round once
//! go to Redis in one script call, decided one after another. Each must still be exactly
//! what it would be alone: all or nothing, every charge seen by the next request, a bad key
//! failing its own request only. These tests start many decisions at once on one event
//! loop against a real redis-server, and check both that they were batched (fewer script
//! calls than requests) and that every answer is exact.

use crate::common;

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use common::{evalsha_calls, RedisServer};
use ratewall::identity::digest_api_key;
use ratewall::limiter::redis::{DecideAt, RedisStore};
use ratewall::limiter::{Algorithm, Check, Decision, Quota, Rate, Store, StoreError};

const PREFIX: &str = "rwbatch";

fn bucket(rate: &str, burst: u64) -> Quota {
    Quota::new(
        Algorithm::TokenBucket,
        Rate::parse(rate).expect("rate"),
        NonZeroU64::new(burst),
        NonZeroU64::MIN,
    )
    .expect("quota")
}

async fn store(redis: &RedisServer) -> Arc<RedisStore> {
    let store = RedisStore::new(&redis.url(), PREFIX, Duration::from_secs(10)).expect("store");
    store.warm().await.expect("warm");
    Arc::new(store)
}

/// One request: `rules` as (API key, rule name, quota), decided at Redis' time.
type Rules = Vec<(String, &'static str, Quota)>;

/// Start every request at once on this event loop; their answers, in order.
async fn decide_all(
    store: &Arc<RedisStore>,
    requests: Vec<Rules>,
) -> Vec<Result<Vec<Decision>, StoreError>> {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|rules| {
            let store = store.clone();
            tokio::spawn(async move {
                let ids: Vec<_> = rules
                    .iter()
                    .map(|(k, _, _)| digest_api_key(k.as_bytes()))
                    .collect();
                let checks: Vec<Check<'_>> = rules
                    .iter()
                    .zip(&ids)
                    .map(|((_, rule, q), id)| Check::new(id, rule, q))
                    .collect();
                store.decide_at(&checks, None).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

#[tokio::test]
async fn a_batch_charges_one_key_exactly_as_requests_one_by_one_would() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let before = evalsha_calls(&redis);
    // 200 requests on one key with 50 tokens and no refill to speak of.
    let q = bucket("1/h", 50);
    let answers = decide_all(
        &store,
        (0..200)
            .map(|_| vec![("one-key".to_string(), "api", q)])
            .collect(),
    )
    .await;
    let calls = evalsha_calls(&redis) - before;
    assert!(
        calls < 50,
        "{calls} script calls for 200 requests: not batched"
    );

    let decisions: Vec<Decision> = answers
        .into_iter()
        .map(|a| a.expect("decided")[0])
        .collect();
    let allowed: Vec<&Decision> = decisions.iter().filter(|d| d.allowed).collect();
    assert_eq!(allowed.len(), 50, "exactly the burst is let through");
    // Each allowed request saw the one before it: remaining 49, 48, ... 0, once each.
    let mut remaining: Vec<u64> = allowed.iter().map(|d| d.remaining).collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..50).collect::<Vec<u64>>());
    for d in decisions.iter().filter(|d| !d.allowed) {
        assert_eq!(d.remaining, 0);
        // One token an hour: the honest wait is an hour, less the moments since the batch.
        assert!(
            (3_590_000_000..=3_600_000_000).contains(&d.retry_after_us),
            "retry after {} µs",
            d.retry_after_us
        );
    }
}

#[tokio::test]
async fn a_request_denied_inside_a_batch_takes_nothing() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let per_key = bucket("1/h", 100);
    let shared = bucket("1/h", 10);
    // 30 requests, each with its own key and the one shared limit of 10.
    let requests: Vec<Rules> = (0..30)
        .map(|i| {
            vec![
                (format!("key-{i}"), "per-key", per_key),
                ("everyone".to_string(), "shared", shared),
            ]
        })
        .collect();
    let before = evalsha_calls(&redis);
    let answers = decide_all(&store, requests).await;
    assert!(evalsha_calls(&redis) - before < 30, "not batched");

    let mut passed = 0;
    for (i, a) in answers.iter().enumerate() {
        let d = a.as_ref().expect("decided");
        let allowed = d[0].allowed && d[1].allowed;
        passed += usize::from(allowed);
        // What the request's own key holds now: 99 after a pass, untouched (no state at
        // all: a full bucket) after a denial.
        let key = store.key(&Check::new(
            &digest_api_key(format!("key-{i}").as_bytes()),
            "per-key",
            &per_key,
        ));
        let exists: bool = redis::cmd("EXISTS")
            .arg(&key)
            .query(&mut redis.conn())
            .expect("EXISTS");
        assert_eq!(
            exists, allowed,
            "request {i}: its own key was charged only if it passed"
        );
    }
    assert_eq!(passed, 10, "the shared limit lets exactly 10 through");
}

#[tokio::test]
async fn a_bad_key_fails_its_own_request_not_the_batch() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let q = bucket("10/s", 10);
    let bad = store.key(&Check::new(&digest_api_key(b"bad"), "api", &q));
    let _: () = redis::cmd("HSET")
        .arg(&bad)
        .arg("f")
        .arg("v")
        .query(&mut redis.conn())
        .expect("HSET");
    let requests: Vec<Rules> = (0..20)
        .map(|i| {
            let key = if i == 7 {
                "bad".to_string()
            } else {
                format!("k{i}")
            };
            vec![(key, "api", q)]
        })
        .collect();
    let before = evalsha_calls(&redis);
    let answers = decide_all(&store, requests).await;
    assert!(evalsha_calls(&redis) - before < 20, "not batched");
    for (i, a) in answers.iter().enumerate() {
        match a {
            Err(e) if i == 7 => assert!(e.is_data_error(), "{e}"),
            Err(e) => panic!("request {i} failed with the bad key's error: {e}"),
            Ok(_) if i == 7 => panic!("the request on a hash was decided"),
            Ok(d) => assert!(d[0].allowed && d[0].remaining == 9, "request {i}: {d:?}"),
        }
    }
    // The bad key is left as it was.
    let kind: String = redis::cmd("TYPE")
        .arg(&bad)
        .query(&mut redis.conn())
        .expect("TYPE");
    assert_eq!(kind, "hash");
}

#[tokio::test]
async fn concurrency_leases_in_one_batch_stop_at_the_limit() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let q = Quota::concurrency(NonZeroU64::new(3).expect("3"), Duration::from_secs(30));
    let tasks: Vec<_> = (1..=10u64)
        .map(|lease| {
            let store = store.clone();
            tokio::spawn(async move {
                let id = digest_api_key(b"busy");
                let check = Check {
                    lease,
                    ..Check::new(&id, "slots", &q)
                };
                store.decide_at(&[check], None).await
            })
        })
        .collect();
    let mut allowed = 0;
    for t in tasks {
        let d = t.await.expect("task").expect("decided");
        allowed += usize::from(d[0].allowed);
    }
    assert_eq!(allowed, 3);
    let key = store.key(&Check::new(&digest_api_key(b"busy"), "slots", &q));
    let leases: u64 = redis::cmd("ZCARD")
        .arg(&key)
        .query(&mut redis.conn())
        .expect("ZCARD");
    assert_eq!(
        leases, 3,
        "one lease per request let through, none for the others"
    );
}

#[tokio::test]
async fn a_shadow_rule_first_in_a_request_never_denies_inside_a_batch() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let shared = bucket("1/h", 10);
    let per_key = bucket("1/h", 100);
    // 30 requests, each a shadow rule shared by all (its first key: in a batch, the flag
    // that starts a request and the shadow flag together), then an enforcing one of its own.
    let before = evalsha_calls(&redis);
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let (everyone, own) = (
                    digest_api_key(b"everyone"),
                    digest_api_key(format!("key-{i}").as_bytes()),
                );
                let checks = [
                    Check {
                        shadow: true,
                        ..Check::new(&everyone, "watch", &shared)
                    },
                    Check::new(&own, "per-key", &per_key),
                ];
                store.decide_at(&checks, None).await
            })
        })
        .collect();
    let mut would_deny = 0;
    for t in tasks {
        let d = t.await.expect("task").expect("decided");
        assert!(
            d[1].allowed,
            "the enforcing rule lets every request through"
        );
        assert_eq!(d[1].remaining, 99, "and charges each its own key: {d:?}");
        would_deny += usize::from(!d[0].allowed);
    }
    assert!(evalsha_calls(&redis) - before < 30, "not batched");
    assert_eq!(
        would_deny, 20,
        "the shadow rule would have denied all past its 10"
    );
    // Charged as if enforced: exactly its 10, none for the requests it would have denied.
    let shadow_key = store.key(&Check::new(&digest_api_key(b"everyone"), "watch", &shared));
    let value: String = redis::cmd("GET")
        .arg(&shadow_key)
        .query(&mut redis.conn())
        .expect("GET");
    assert!(
        value.starts_with("t:0:"),
        "the shadow bucket is empty: {value}"
    );
}
