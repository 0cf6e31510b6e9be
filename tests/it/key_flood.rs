//! A flood of keys that are themselves denied, against a tiny memory store (issue 42, item
//! 11): the real binary, a real upstream. A store full of identities being denied
//! refuses new keys (429, counted in `ratewall_store_refused_keys_total`) rather than
//! dropping one of them, so flooding buys the abuser nothing; the `on_error = "local"`
//! fallback, the same store, alike.

use crate::common;

use common::{series, upstream_and_store, Gateway, HttpClient, Store, Upstream};
use http::StatusCode;

/// `max_keys = 20` under a rule of burst 1: each flood key is allowed once and is then
/// being denied (held), so after 20 keys the store holds nothing else. The abuser, denied
/// first and then quiet (its state the one held longest ago), is still denied after 100
/// flood keys; the flood keys past the bound get 429 on
/// their first request, with a Retry-After no later than the soonest held state is whole
/// again (the rule's 60 s), and each is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_denied_keys_does_not_free_the_abuser() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}max_keys = 20\n\
         [[rules]]\nname = \"login\"\nkey = \"api_key\"\nrate = \"1/m\"\nburst = 1\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let client = HttpClient::new();
    let abuser = [("x-api-key", "sk_abuser_0000000000")];
    assert_eq!(
        client.get(&gw.url("/x"), &abuser).await.status,
        StatusCode::OK
    );
    assert_eq!(
        client.get(&gw.url("/x"), &abuser).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // 19 keys fill the store (the abuser's is the 20th); every one is denied afterwards.
    let (mut admitted, mut refused) = (0, 0);
    for n in 0..100 {
        let key = [("x-api-key", format!("sk_flood_{n:06}"))];
        let key = [(key[0].0, key[0].1.as_str())];
        let first = client.get(&gw.url("/x"), &key).await;
        match first.status {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                refused += 1;
                let wait: u64 = first
                    .header("retry-after")
                    .and_then(|v| v.parse().ok())
                    .expect("a refused key is told when to come back");
                assert!((1..=60).contains(&wait), "Retry-After: {wait}");
            }
            s => panic!("flood key {n}: {s}"),
        }
        let again = client.get(&gw.url("/x"), &key).await;
        assert_eq!(
            again.status,
            StatusCode::TOO_MANY_REQUESTS,
            "flood key {n} denied itself"
        );
    }
    // The abuser waited quietly through the flood: its state is the one held longest ago.
    assert_eq!(
        client.get(&gw.url("/x"), &abuser).await.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the flood freed the abuser"
    );
    assert_eq!(
        (admitted, refused),
        (19, 81),
        "the store took keys until full"
    );
    let counted = series(
        &gw,
        "ratewall_store_refused_keys_total",
        &[("store", "memory")],
    )
    .await;
    // Each refused key was refused twice (its first request and its second).
    assert_eq!(counted, Some(2.0 * 81.0), "refused keys counted");
    let held = series(
        &gw,
        "ratewall_store_evictions_total",
        &[("store", "memory"), ("reason", "held")],
    )
    .await;
    assert_eq!(held, None, "no held state is ever evicted");
}

/// The `on_error = "local"` fallback is a memory store too, bounded by the same `max_keys`:
/// while Redis is down, once it is full of identities being denied it refuses new keys
/// (429), counted as `store="local"`, and keeps every state it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_fallback_refuses_new_keys_when_full_of_denied_ones() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    // Nothing listens there: every call fails, and the fallback decides.
    let refusing = common::RefusingPort::new();
    let store = Store::Redis {
        url: format!("redis://127.0.0.1:{}", refusing.port),
        on_error: "local",
        timeout: "250ms",
    };
    let gw = Gateway::start(&format!(
        "{}max_keys = 5\n\
         [[rules]]\nname = \"login\"\nkey = \"api_key\"\nrate = \"1/m\"\nburst = 1\n",
        upstream_and_store(&upstream.url(), &store)
    ));
    let client = HttpClient::new();
    for n in 0..10 {
        let key = format!("sk_local_{n:06}");
        let r = client.get(&gw.url("/x"), &[("x-api-key", &key)]).await;
        let want = if n < 5 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(r.status, want, "new key {n}");
    }
    let first = [("x-api-key", "sk_local_000000")];
    assert_eq!(
        client.get(&gw.url("/x"), &first).await.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the first key kept its state"
    );
    let refused = "ratewall_store_refused_keys_total";
    assert_eq!(series(&gw, refused, &[("store", "local")]).await, Some(5.0));
    assert_eq!(
        series(&gw, refused, &[("store", "memory")]).await,
        Some(0.0)
    );
}
