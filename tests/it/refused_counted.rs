//! Issue 42, item 1: a refused request is counted, and a forger pays before its
//! signature is looked at. The real binary, a real upstream, tokens signed in the test
//! with RSA-2048 keys (RS256, the costly check), all from one address (127.0.0.1):
//!
//! - 200 forged tokens, each new: the per-IP rule (60 an hour) is charged for every one;
//!   the first 20 are checked and refused 401, the next 40 refused 429 unchecked (the
//!   address's `[jwt] failures`, burst 20), the last 140 denied 429 by the per-IP rule
//!   before their tokens are read. 20 signature checks in all (nginx's `limit_req` before
//!   its auth step: 61 × 401, then 139 × 429). Then a good token from the same address
//!   is denied by the per-IP rule, unchecked.
//! - Requests without a token are charged to the per-IP rule: its burst of 401s, then 429.
//! - Unknown API keys: 5 refused 401, then every key from that address (a listed one too)
//!   refused 429 unlooked-up, each charged to the per-IP rule (another address is not
//!   slowed: `src/identity/failure_tests.rs`).

use http::StatusCode;

use crate::common::jwt::{claims, unix_now, SigningKey};
use crate::common::{self, Gateway, HttpClient, Scrape, Upstream};

const ISS: &str = "https://issuer.test";
const AUD: &str = "api";

/// Each status a run of requests got, in order, compressed: `[(401, 20), (429, 180)]`.
fn runs(statuses: &[u16]) -> Vec<(u16, usize)> {
    let mut out: Vec<(u16, usize)> = Vec::new();
    for &s in statuses {
        match out.last_mut() {
            Some((last, n)) if *last == s => *n += 1,
            _ => out.push((s, 1)),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_tokens_pay_the_per_ip_rule_and_are_throttled_before_any_signature_check() {
    let _watch = common::watchdog();
    let dir = tempfile::tempdir().unwrap();
    let issuer = SigningKey::rsa(dir.path());
    let forger = SigningKey::rsa(dir.path());
    let upstream = Upstream::start().await;
    // Rates of an hour: nothing refills while the test runs.
    let gw = Gateway::start(&format!(
        "[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n\
         [jwt]\nalgorithms = [\"RS256\"]\nkeys = [\"{}\"]\nissuer = \"{ISS}\"\naudience = \"{AUD}\"\n\
         failures = {{ rate = \"10/h\", burst = 20 }}\n\
         [[rules]]\nname = \"per-ip\"\nkey = \"client_ip\"\nrate = \"60/h\"\nburst = 60\n\
         [[rules]]\nname = \"per-user\"\nkey = \"jwt:sub\"\nrate = \"1000/h\"\nburst = 1000\n",
        upstream.url(),
        common::toml_path(&issuer.public_file(dir.path(), "issuer.pem")),
    ));
    let client = HttpClient::new();
    let url = gw.url("/api/x");
    let now = unix_now();
    let mut statuses = Vec::new();
    let mut throttled_retry = Vec::new();
    for i in 0..200 {
        let mut c = claims(&format!("user-{i}"), ISS, AUD);
        c["exp"] = (now + 600).into();
        let token = forger.sign(&c, None);
        let r = client
            .get(&url, &[("authorization", &format!("Bearer {token}"))])
            .await;
        if r.status == StatusCode::TOO_MANY_REQUESTS && r.header("ratelimit-policy").is_none() {
            throttled_retry.push(r.header("retry-after").map(str::to_string));
        }
        statuses.push(r.status.as_u16());
    }
    assert_eq!(
        runs(&statuses),
        [(401, 20), (429, 180)],
        "20 checked and refused, then 429s"
    );
    assert_eq!(
        throttled_retry.len(),
        40,
        "the 40 after the failures' burst are the throttle's (no RateLimit-Policy)"
    );
    assert!(
        throttled_retry
            .iter()
            .all(|r| r.as_deref().and_then(|s| s.parse::<u64>().ok()) >= Some(1)),
        "each with a Retry-After: {throttled_retry:?}"
    );
    let m = Scrape::take(&client, &gw).await;
    let refusals = |reason| m.get("ratewall_refusals_total", &[("reason", reason)]);
    assert_eq!(refusals("invalid_token"), 20.0);
    assert_eq!(refusals("throttled"), 40.0);
    let checks = |result| m.get("ratewall_token_checks_total", &[("result", result)]);
    assert_eq!(checks("refused"), 20.0, "20 signatures checked, no more");
    assert_eq!(checks("accepted"), 0.0);
    let per_ip = |decision| {
        m.get(
            "ratewall_requests_total",
            &[("rule", "per-ip"), ("decision", decision)],
        )
    };
    assert_eq!(per_ip("refused_by_other"), 60.0, "each refusal charged");
    assert_eq!(per_ip("denied"), 140.0);
    assert_eq!(upstream.arrived(), 0, "none forwarded");

    // A good token from the same address: denied by the per-IP rule, never checked.
    let good = issuer.sign(&claims("alice", ISS, AUD), None);
    let r = client
        .get(&url, &[("authorization", &format!("Bearer {good}"))])
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        r.header("ratelimit-policy")
            .is_some_and(|p| p.contains("per-ip")),
        "{:?}",
        r.header("ratelimit-policy")
    );
    let m = Scrape::take(&client, &gw).await;
    assert_eq!(
        m.get("ratewall_token_checks_total", &[("result", "accepted")]),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_credentials_and_unknown_keys_are_charged_then_throttled() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n\
         [keys]\nunknown = \"reject\"\nfailures = {{ rate = \"10/h\", burst = 5 }}\n\
         [keys.plans]\n\"sk_live_listed_key_0001\" = \"pro\"\n\
         [[rules]]\nname = \"per-ip\"\nkey = \"client_ip\"\nrate = \"30/h\"\nburst = 30\n\
         [[rules]]\nname = \"per-key\"\nkey = \"api_key\"\nrate = \"1000/h\"\nburst = 1000\n\
         [rules.plans.pro]\nrate = \"1000/h\"\n",
        upstream.url(),
    ));
    let client = HttpClient::new();
    let url = gw.url("/api/x");
    let get = |key: Option<String>| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let headers: Vec<(&str, &str)> = match &key {
                Some(k) => vec![("x-api-key", k.as_str())],
                None => Vec::new(),
            };
            client.get(&url, &headers).await
        }
    };
    // No key: 401, each charged to the per-IP rule.
    let mut statuses = Vec::new();
    for _ in 0..10 {
        statuses.push(get(None).await.status.as_u16());
    }
    assert_eq!(runs(&statuses), [(401, 10)]);
    // Unknown keys: 5 refused, then 429 unlooked-up; the listed key too.
    let mut statuses = Vec::new();
    for i in 0..10 {
        statuses.push(
            get(Some(format!("sk_live_guess_{i:08}")))
                .await
                .status
                .as_u16(),
        );
    }
    assert_eq!(runs(&statuses), [(401, 5), (429, 5)]);
    let listed = get(Some("sk_live_listed_key_0001".into())).await;
    assert_eq!(listed.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(listed.header("retry-after").is_some());
    assert_eq!(upstream.arrived(), 0);
    let m = Scrape::take(&client, &gw).await;
    assert_eq!(
        m.get(
            "ratewall_requests_total",
            &[("rule", "per-ip"), ("decision", "refused_by_other")]
        ),
        21.0,
        "every refusal charged to the per-IP rule"
    );
    assert_eq!(
        m.get("ratewall_refusals_total", &[("reason", "unknown_key")]),
        5.0
    );
    assert_eq!(
        m.get("ratewall_refusals_total", &[("reason", "throttled")]),
        6.0
    );
    // The per-IP rule has 9 left of 30: 9 more refusals, then its own 429.
    let mut statuses = Vec::new();
    for _ in 0..12 {
        statuses.push(get(None).await.status.as_u16());
    }
    assert_eq!(runs(&statuses), [(401, 9), (429, 3)]);
}
