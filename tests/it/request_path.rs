//! The request path in process: the gateway's own [`Gateway::admit`] (screen, rules,
//! identity, store, verdict, answer) on the memory store with a clock moved by hand. No
//! socket and no sleep: every limit is checked to the microsecond. What only a real
//! process can show (framing, connections, Redis, the upstream hop) is tested end to end
//! in the other files.

use crate::common;

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use ratewall::config::Config;
use ratewall::identity::ClientCert;
use ratewall::limiter::ManualClock;
use ratewall::proxy::{Admission, Context, Gateway, Live, Metrics, RequestCtx};
use ratewall::upstream::ClientPeer;

const UPSTREAM: &str =
    "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n";

/// A gateway on the memory store, its clock at `clock`.
struct InProcess {
    gw: Gateway,
    clock: Arc<ManualClock>,
}

/// What a request got: the answer's status and headers (for a forwarded request, the
/// headers the gateway adds to the upstream's answer), and for a forwarded one, its pass.
struct Seen<'l> {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
    pass: Option<RequestCtx<'l>>,
    decision: &'static str,
}

impl Seen<'_> {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("an ASCII header"))
            .unwrap_or_else(|| panic!("no {name} in {:?}", self.headers))
    }

    fn wait(&self) -> Duration {
        self.pass.as_ref().map_or(Duration::ZERO, RequestCtx::wait)
    }
}

/// `"…", r=N, …`: the `r` of `rule` in a `RateLimit` (or `RateLimit-Shadow`) value.
fn remaining(value: &str, rule: &str) -> u64 {
    let item = value
        .split(", ")
        .find(|i| i.starts_with(&format!("\"{rule}\"")))
        .unwrap_or_else(|| panic!("no {rule} in {value:?}"));
    item.split(';')
        .find_map(|p| p.strip_prefix("r="))
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no r= in {item:?}"))
}

impl InProcess {
    fn new(rules: &str) -> InProcess {
        let text = format!("{UPSTREAM}{rules}");
        let config = Config::load_text(&text, Path::new("inprocess.toml")).expect("a valid config");
        let metrics = Arc::new(Metrics::new());
        let clock = ManualClock::new(1_000_000_000);
        let live =
            Live::build_with_clock(config, None, &metrics, clock.clone()).expect("a memory store");
        InProcess {
            gw: Gateway::new(live, None, metrics),
            clock,
        }
    }

    fn advance(&self, d: Duration) {
        self.clock.advance(d.as_micros() as u64);
    }

    async fn send<'l>(
        &self,
        live: &'l Live,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        peer: &str,
    ) -> Seen<'l> {
        let mut req = Request::builder()
            .method(Method::from_bytes(method.as_bytes()).unwrap())
            .uri(path)
            .header("host", "app.test");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let parts = req.body(()).unwrap().into_parts().0;
        let peer: IpAddr = peer.parse().unwrap();
        let ctx = Context::new(ClientPeer::new(SocketAddr::new(peer, 40_000)), 0);
        self.admit(live, &parts, &ctx).await
    }

    /// What `parts` got, admitted in `ctx`.
    async fn admit<'l>(&self, live: &'l Live, parts: &Parts, ctx: &Context) -> Seen<'l> {
        match self.gw.admit(live, parts, ctx).await {
            Admission::Answer(resp, note) => {
                let (head, body) = resp.into_parts();
                let body = body.collect().await.expect("a body").to_bytes();
                Seen {
                    status: head.status,
                    headers: head.headers,
                    body: String::from_utf8_lossy(&body).into_owned(),
                    pass: None,
                    decision: note.decided.disposition.decision(),
                }
            }
            Admission::Forward(pass) => {
                let mut headers = HeaderMap::new();
                pass.decorate(&mut headers);
                Seen {
                    status: StatusCode::OK,
                    headers,
                    body: String::new(),
                    decision: pass.decided.disposition.decision(),
                    pass: Some(pass),
                }
            }
        }
    }

    async fn get<'l>(&self, live: &'l Live, path: &str, key: Option<&str>) -> Seen<'l> {
        let headers: Vec<(&str, &str)> = key.map(|k| ("x-api-key", k)).into_iter().collect();
        self.send(live, "GET", path, &headers, "203.0.113.7").await
    }
}

#[tokio::test]
async fn remaining_counts_down_exactly_and_refills_with_the_clock() {
    let _watch = common::watchdog();
    let t = InProcess::new(
        "[[rules]]\nname = \"api\"\nkey = \"api_key\"\nalgorithm = \"token_bucket\"\nrate = \"100/10s\"\n",
    );
    let live = t.gw.live();
    for left in (95..100).rev() {
        let seen = t.get(&live, "/v1/x", Some("k1")).await;
        assert_eq!(seen.status, StatusCode::OK);
        assert_eq!(remaining(seen.header("ratelimit"), "api"), left);
        assert_eq!(seen.header("ratelimit-policy"), "\"api\";q=100;w=10");
    }
    // One token drips in every 100 ms.
    t.advance(Duration::from_millis(250));
    let seen = t.get(&live, "/v1/x", Some("k1")).await;
    assert_eq!(remaining(seen.header("ratelimit"), "api"), 96);
    // Another key has its own bucket.
    let other = t.get(&live, "/v1/x", Some("k2")).await;
    assert_eq!(remaining(other.header("ratelimit"), "api"), 99);
}

#[tokio::test]
async fn a_denial_says_when_to_come_back_to_the_second() {
    let _watch = common::watchdog();
    let t = InProcess::new(
        "[[rules]]\nname = \"login\"\nkey = \"client_ip\"\nalgorithm = \"fixed_window\"\nrate = \"3/m\"\n",
    );
    let live = t.gw.live();
    for _ in 0..3 {
        assert_eq!(t.get(&live, "/login", None).await.status, StatusCode::OK);
    }
    t.advance(Duration::from_secs(20));
    let denied = t.get(&live, "/login", None).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.decision, "denied");
    // The window opened 20 s ago: 40 s left, to the second.
    assert_eq!(denied.header("retry-after"), "40");
    assert_eq!(remaining(denied.header("ratelimit"), "login"), 0);
    assert!(
        denied.body.contains("\"violated-policies\":[\"login\"]")
            && denied.body.contains("\"retry_after\":40"),
        "{}",
        denied.body
    );
    t.advance(Duration::from_secs(40));
    assert_eq!(t.get(&live, "/login", None).await.status, StatusCode::OK);
}

#[tokio::test]
async fn a_request_denied_by_one_rule_takes_nothing_from_the_others() {
    let _watch = common::watchdog();
    let t = InProcess::new(concat!(
        "[[rules]]\nname = \"wide\"\nkey = \"api_key\"\nrate = \"10/s\"\n",
        "[[rules]]\nname = \"narrow\"\nkey = \"api_key\"\nrate = \"2/s\"\nmatch = { path_prefix = \"/narrow/\" }\n",
    ));
    let live = t.gw.live();
    for _ in 0..2 {
        assert_eq!(
            t.get(&live, "/narrow/x", Some("k")).await.status,
            StatusCode::OK
        );
    }
    for _ in 0..3 {
        let seen = t.get(&live, "/narrow/x", Some("k")).await;
        assert_eq!(seen.status, StatusCode::TOO_MANY_REQUESTS);
        // All or nothing: the wide rule still shows the two admitted requests only.
        assert_eq!(remaining(seen.header("ratelimit"), "wide"), 8);
    }
    let wide = t.get(&live, "/other", Some("k")).await;
    assert_eq!(remaining(wide.header("ratelimit"), "wide"), 7);
}

#[tokio::test]
async fn who_a_request_is_decides_whether_it_is_refused() {
    let _watch = common::watchdog();
    let t = InProcess::new(concat!(
        "[keys]\nunknown = \"reject\"\n[keys.plans]\n\"gold-key\" = \"gold\"\n",
        "[[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"5/s\"\nmatch = { path_prefix = \"/api/\" }\n",
        "[rules.plans.gold]\nrate = \"50/s\"\n",
        "[[rules]]\nname = \"tenant\"\nkey = \"header:x-tenant\"\nrate = \"5/s\"\nmissing_key = \"client_ip\"\nmatch = { path_prefix = \"/t/\" }\n",
    ));
    let live = t.gw.live();
    let missing = t.get(&live, "/api/x", None).await;
    assert_eq!(
        (missing.status, missing.decision),
        (StatusCode::UNAUTHORIZED, "unauthorized")
    );
    let unknown = t.get(&live, "/api/x", Some("who-knows")).await;
    assert_eq!(unknown.status, StatusCode::UNAUTHORIZED);
    assert!(
        unknown.body.contains("the API key is not known"),
        "{}",
        unknown.body
    );
    let twice = t
        .send(
            &live,
            "GET",
            "/api/x",
            &[("x-api-key", "a"), ("x-api-key", "b")],
            "203.0.113.7",
        )
        .await;
    assert_eq!(
        (twice.status, twice.decision),
        (StatusCode::BAD_REQUEST, "bad_key")
    );
    // A listed key gets its plan's quota.
    let gold = t.get(&live, "/api/x", Some("gold-key")).await;
    assert_eq!(gold.header("ratelimit-policy"), "\"api\";q=50;w=1");
    assert_eq!(remaining(gold.header("ratelimit"), "api"), 49);
    // Without the header it counts by, the rule counts the client's address instead: the
    // same bucket for every request from it, apart from any tenant's.
    let by_ip = t.send(&live, "GET", "/t/x", &[], "198.51.100.9").await;
    assert_eq!(remaining(by_ip.header("ratelimit"), "tenant"), 4);
    let by_ip = t.send(&live, "GET", "/t/x", &[], "198.51.100.9").await;
    assert_eq!(remaining(by_ip.header("ratelimit"), "tenant"), 3);
    let tenant = t
        .send(
            &live,
            "GET",
            "/t/x",
            &[("x-tenant", "acme")],
            "198.51.100.9",
        )
        .await;
    assert_eq!(remaining(tenant.header("ratelimit"), "tenant"), 4);
}

#[tokio::test]
async fn a_shadow_rule_reports_what_it_would_deny_and_denies_nothing() {
    let _watch = common::watchdog();
    let t = InProcess::new(concat!(
        "[[rules]]\nname = \"watch\"\nkey = \"api_key\"\nrate = \"1/m\"\nmode = \"shadow\"\n",
        "[[rules]]\nname = \"real\"\nkey = \"api_key\"\nrate = \"100/m\"\n",
    ));
    let live = t.gw.live();
    let first = t.get(&live, "/x", Some("k")).await;
    assert_eq!(first.header("ratelimit-shadow"), "\"watch\";r=0;t=60");
    let second = t.get(&live, "/x", Some("k")).await;
    assert_eq!(second.status, StatusCode::OK);
    assert_eq!(
        second.header("ratelimit-shadow"),
        "\"watch\";r=0;t=60;denied"
    );
    // The enforcing rule is the client's limit, and only it.
    assert_eq!(second.header("ratelimit-policy"), "\"real\";q=100;w=60");
    assert_eq!(
        second.pass.as_ref().map(|p| p.decided.shadow_denied),
        Some(Some("watch"))
    );
}

#[tokio::test]
async fn a_request_waits_for_reserved_tokens_up_to_max_delay_and_the_queue_is_bounded() {
    let _watch = common::watchdog();
    let t = InProcess::new(
        "[[rules]]\nname = \"smooth\"\nkey = \"global\"\nrate = \"10/s\"\nburst = 1\nmax_delay = \"1s\"\nmax_waiting = 2\n",
    );
    let live = t.gw.live();
    let first = t.get(&live, "/x", None).await;
    assert_eq!((first.decision, first.wait()), ("allowed", Duration::ZERO));
    // The next tokens are reserved 100 ms apart; the waiting requests hold their places.
    let second = t.get(&live, "/x", None).await;
    assert_eq!(
        (second.decision, second.wait()),
        ("delayed", Duration::from_millis(100))
    );
    let third = t.get(&live, "/x", None).await;
    assert_eq!(third.wait(), Duration::from_millis(200));
    // The queue (max_waiting = 2) is full: decided without waiting, so denied.
    let fourth = t.get(&live, "/x", None).await;
    assert_eq!(fourth.status, StatusCode::TOO_MANY_REQUESTS);
    // A waiting request that is done gives its place back.
    drop(second);
    let fifth = t.get(&live, "/x", None).await;
    assert_eq!(fifth.wait(), Duration::from_millis(300));
    drop(third);
}

/// A batch at once against 10/s, a burst of 1 and `max_delay = "500ms"`, for both
/// algorithms that delay: the first passes at once, the next five wait for their reserved
/// tokens, 100 ms apart and never past max_delay, and the rest are refused without
/// waiting (denied with Retry-After, no pass). (tests/it/features.rs shows the real binary
/// sleeps these waits; the exact waits are here.)
#[tokio::test]
async fn delayed_requests_wait_at_most_max_delay_and_the_rest_are_refused_at_once() {
    let _watch = common::watchdog();
    for algorithm in ["token_bucket", "gcra"] {
        let t = InProcess::new(&format!(
            "[[rules]]\nname = \"api\"\nkey = \"global\"\nalgorithm = \"{algorithm}\"\nrate = \"10/s\"\nburst = 1\nmax_delay = \"500ms\"\n"
        ));
        let live = t.gw.live();
        let mut seen = Vec::new();
        for _ in 0..12 {
            seen.push(t.get(&live, "/d", None).await);
        }
        let waits: Vec<Option<u64>> = seen
            .iter()
            .map(|s| s.pass.as_ref().map(|p| p.wait().as_millis() as u64))
            .collect();
        let none: Option<u64> = None;
        assert_eq!(
            waits,
            [
                Some(0),
                Some(100),
                Some(200),
                Some(300),
                Some(400),
                Some(500),
                none,
                none,
                none,
                none,
                none,
                none
            ],
            "{algorithm}"
        );
        for refused in &seen[6..] {
            assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{algorithm}");
            assert!(refused.headers.contains_key("retry-after"), "{algorithm}");
        }
    }
}

#[tokio::test]
async fn concurrency_slots_are_held_until_the_request_is_done() {
    let _watch = common::watchdog();
    let t = InProcess::new("[[rules]]\nname = \"slots\"\nkey = \"api_key\"\nmax_in_flight = 2\n");
    let live = t.gw.live();
    let a = t.get(&live, "/x", Some("k")).await;
    let b = t.get(&live, "/x", Some("k")).await;
    assert_eq!(remaining(b.header("ratelimit"), "slots"), 0);
    assert_eq!(
        b.header("ratelimit-policy"),
        "\"slots\";q=2;qu=\"concurrent-requests\""
    );
    let c = t.get(&live, "/x", Some("k")).await;
    assert_eq!(c.status, StatusCode::TOO_MANY_REQUESTS);
    // A request that never reached the upstream (its pass dropped) gives its slot back.
    drop(a);
    let d = t.get(&live, "/x", Some("k")).await;
    assert_eq!(d.status, StatusCode::OK);
    drop((b, d));
}

/// The good-client SLO under a concurrency limit: demand is what is in flight, so a
/// request is within its plan exactly when the rule's own decision allowed it; a shadow
/// rule counts nothing, though it would deny. Near the limit: 0 of 2 slots left.
#[tokio::test]
async fn a_concurrency_rule_judges_the_slo_by_its_own_decision_and_a_shadow_rule_not_at_all() {
    let _watch = common::watchdog();
    let t = InProcess::new(
        "[[rules]]\nname = \"slots\"\nkey = \"api_key\"\nmax_in_flight = 2\n\
         [[rules]]\nname = \"watch\"\nkey = \"api_key\"\nrate = \"1/h\"\nmode = \"shadow\"\n",
    );
    let live = t.gw.live();
    let a = t.get(&live, "/x", Some("k")).await;
    let b = t.get(&live, "/x", Some("k")).await;
    let c = t.get(&live, "/x", Some("k")).await;
    assert_eq!(
        (a.status, b.status, c.status),
        (
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        )
    );
    drop(a);
    let d = t.get(&live, "/x", Some("k")).await;
    assert_eq!(d.status, StatusCode::OK);
    let text = t.gw.metrics().encode();
    for line in [
        "ratewall_plan_requests_total{rule=\"slots\",outcome=\"served\"} 3",
        "ratewall_plan_requests_total{rule=\"slots\",outcome=\"limited\"} 0",
        "ratewall_plan_requests_total{rule=\"watch\",outcome=\"served\"} 0",
        "ratewall_plan_requests_total{rule=\"watch\",outcome=\"limited\"} 0",
        "ratewall_near_limit_total{rule=\"slots\"} 2",
        "ratewall_near_limit_total{rule=\"watch\"} 0",
        "ratewall_denials_total{rule=\"slots\",plan=\"default\"} 1",
        // It would have denied all but the first.
        "ratewall_requests_total{rule=\"watch\",decision=\"shadow_denied\"} 3",
    ] {
        assert!(text.contains(line), "no {line} in:\n{text}");
    }
    drop((b, d));
}

#[tokio::test]
async fn unlimited_requests_and_malformed_ones_never_reach_the_store() {
    let _watch = common::watchdog();
    let t = InProcess::new(
        "[[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"1/m\"\nmatch = { path_prefix = \"/api/\", methods = [\"GET\"] }\n",
    );
    let live = t.gw.live();
    let free = t.get(&live, "/public", Some("k")).await;
    assert_eq!((free.status, free.decision), (StatusCode::OK, "unlimited"));
    assert!(free.headers.get("ratelimit").is_none());
    let lower = t
        .send(&live, "get", "/api/x", &[("x-api-key", "k")], "203.0.113.7")
        .await;
    assert_eq!(
        (lower.status, lower.decision),
        (StatusCode::BAD_REQUEST, "bad_request")
    );
    assert_eq!(lower.header("connection"), "close");
    // HEAD runs the GET handler: counted by the GET rule, and an encoded slash routes the
    // same way.
    let head = t
        .send(
            &live,
            "HEAD",
            "/api/x",
            &[("x-api-key", "k")],
            "203.0.113.7",
        )
        .await;
    assert_eq!(remaining(head.header("ratelimit"), "api"), 0);
    let encoded = t.get(&live, "/api%2Fx", Some("k")).await;
    assert_eq!(encoded.status, StatusCode::TOO_MANY_REQUESTS);
}

// ---------------------------------------------------------------------------------------
// Keyed clients by key, anonymous clients by IP (match on what a request carries; plans
// exempt from a rule).

/// A per-IP ceiling of 300 a minute on every path, and a per-key limit under `/api/` that
/// lets a pro key send 400 at once. `ip_extra` is added to the per-IP rule.
fn policy(unknown: &str, ip_extra: &str) -> String {
    format!(
        "[keys]\nunknown = \"{unknown}\"\n[keys.plans]\n\"pro-key\" = \"pro\"\n\"free-key\" = \"free\"\n\
         [[rules]]\nname = \"per-ip\"\nkey = \"client_ip\"\nalgorithm = \"sliding_window\"\nrate = \"300/m\"\n{ip_extra}\n\
         [[rules]]\nname = \"per-key\"\nkey = \"api_key\"\nmatch = {{ path_prefix = \"/api/\", api_key = \"present\" }}\n\
         rate = \"10/s\"\nburst = 20\n[rules.plans.pro]\nrate = \"100/s\"\nburst = 400\n[rules.plans.free]\n"
    )
}

const PEER: &str = "203.0.113.7";

/// How many of `n` requests to `path` with `headers` from `peer` got each status, in
/// order of first appearance; and the 429s' violated policies.
async fn tally(
    t: &InProcess,
    live: &Live,
    n: usize,
    path: &str,
    headers: &[(&str, &str)],
    peer: &str,
) -> (Vec<(u16, usize)>, Vec<String>) {
    let mut counts: Vec<(u16, usize)> = Vec::new();
    let mut violated = Vec::new();
    for _ in 0..n {
        let seen = t.send(live, "GET", path, headers, peer).await;
        let code = seen.status.as_u16();
        match counts.iter_mut().find(|(c, _)| *c == code) {
            Some((_, k)) => *k += 1,
            None => counts.push((code, 1)),
        }
        if code == 429 {
            let v = seen
                .body
                .split("\"violated-policies\":")
                .nth(1)
                .unwrap_or("");
            let v = v.split(']').next().unwrap_or("").to_string() + "]";
            if !violated.contains(&v) {
                violated.push(v);
            }
        }
    }
    (counts, violated)
}

#[tokio::test]
async fn a_per_ip_ceiling_caps_a_pro_key_unless_the_rule_leaves_keyed_requests_out() {
    let _watch = common::watchdog();
    // Today's policy: the per-IP rule counts every request, so a pro key behind one
    // address gets 300 of its 320.
    let t = InProcess::new(&policy("reject", ""));
    let live = t.gw.live();
    let pro = [("x-api-key", "pro-key")];
    let (counts, violated) = tally(&t, &live, 320, "/api/x", &pro, PEER).await;
    assert_eq!(counts, [(200, 300), (429, 20)]);
    assert_eq!(violated, ["[\"per-ip\"]"]);

    // Keyed clients by key, anonymous clients by IP.
    for ip_extra in [
        "match = { api_key = \"absent\" }",
        "[rules.plans.pro]\nexempt = true",
    ] {
        let t = InProcess::new(&policy("reject", ip_extra));
        let live = t.gw.live();
        let (counts, _) = tally(&t, &live, 320, "/api/x", &pro, PEER).await;
        assert_eq!(counts, [(200, 320)], "{ip_extra}");
        let seen = t.send(&live, "GET", "/api/x", &pro, PEER).await;
        assert_eq!(
            seen.header("ratelimit-policy"),
            // The pro plan's bucket: 400 at once, refilled at 100/s in 4 s.
            "\"per-key\";q=400;w=4",
            "{ip_extra}: the per-IP rule does not apply to the pro key at all"
        );
        // The pro key's 321 took nothing from its address: anonymous requests from it
        // still get exactly the ceiling.
        let (counts, violated) = tally(&t, &live, 310, "/public", &[], PEER).await;
        assert_eq!(counts, [(200, 300), (429, 10)], "{ip_extra}");
        assert_eq!(violated, ["[\"per-ip\"]"], "{ip_extra}");
        // And so do anonymous requests under /api/: the per-key rule leaves them out.
        let (counts, _) = tally(&t, &live, 1, "/api/x", &[], PEER).await;
        assert_eq!(counts, [(429, 1)], "{ip_extra}");
        let (counts, _) = tally(&t, &live, 301, "/api/x", &[], "198.51.100.1").await;
        assert_eq!(counts, [(200, 300), (429, 1)], "{ip_extra}");
    }
}

#[tokio::test]
async fn an_absent_key_is_only_one_no_key_rule_would_refuse() {
    let _watch = common::watchdog();
    let t = InProcess::new(&policy("reject", "match = { api_key = \"absent\" }"));
    let live = t.gw.live();
    // The per-IP rule alone applies to /public; it reads the key as the per-key rule
    // would, so a bad key is refused there too instead of passing as "present".
    let (counts, _) = tally(&t, &live, 1, "/public", &[("x-api-key", "made-up")], PEER).await;
    assert_eq!(counts, [(401, 1)], "an unknown key, unknown = \"reject\"");
    let twice = [("x-api-key", "pro-key"), ("x-api-key", "pro-key")];
    let seen = t.send(&live, "GET", "/public", &twice, PEER).await;
    assert_eq!(
        (seen.status, seen.decision),
        (StatusCode::BAD_REQUEST, "bad_key")
    );
    // An empty key is no key: counted by IP.
    let seen = t
        .send(&live, "GET", "/public", &[("x-api-key", " ")], PEER)
        .await;
    assert_eq!(seen.header("ratelimit-policy"), "\"per-ip\";q=300;w=60");
    // A listed key skips the per-IP rule: on /public no rule applies.
    let seen = t.get(&live, "/public", Some("free-key")).await;
    assert_eq!((seen.status, seen.decision), (StatusCode::OK, "unlimited"));
    let free = [("x-api-key", "free-key")];
    let (counts, _) = tally(&t, &live, 25, "/api/x", &free, PEER).await;
    assert_eq!(counts, [(200, 20), (429, 5)], "the free key's own burst");

    // With unknown = "allow" a made-up key is a key like any other: "absent" lets it past
    // the per-IP rule. An exempt plan does not: only listed keys have one.
    let t = InProcess::new(&policy("allow", "match = { api_key = \"absent\" }"));
    let live = t.gw.live();
    let seen = t.get(&live, "/public", Some("made-up")).await;
    assert_eq!(seen.decision, "unlimited");
    let t = InProcess::new(&policy("allow", "[rules.plans.pro]\nexempt = true"));
    let live = t.gw.live();
    let (counts, _) = tally(&t, &live, 301, "/public", &[("x-api-key", "made-up")], PEER).await;
    assert_eq!(counts, [(200, 300), (429, 1)]);
    let (counts, _) = tally(&t, &live, 301, "/public", &[("x-api-key", "pro-key")], PEER).await;
    assert_eq!(counts, [(200, 301)]);
}

#[tokio::test]
async fn a_header_condition_asks_only_whether_the_header_is_there() {
    let _watch = common::watchdog();
    let t = InProcess::new(concat!(
        "[[rules]]\nname = \"anon\"\nkey = \"client_ip\"\nrate = \"1/h\"\nburst = 2\nmatch = { \"header:authorization\" = \"absent\" }\n",
        "[[rules]]\nname = \"users\"\nkey = \"header:authorization\"\nrate = \"1/h\"\nburst = 3\nmatch = { \"header:Authorization\" = \"present\", methods = [\"POST\"] }\n",
    ));
    let live = t.gw.live();
    let long = format!("Bearer {}", "x".repeat(2000));
    let auth = [("authorization", long.as_str())];
    let seen = t.send(&live, "GET", "/", &auth, PEER).await;
    assert_eq!(
        seen.decision, "unlimited",
        "a long token is present, not refused"
    );
    let seen = t.send(&live, "POST", "/", &auth, PEER).await;
    assert_eq!(
        (seen.status, seen.decision),
        (StatusCode::BAD_REQUEST, "bad_key"),
        "the rule counting by it refuses a value over 1 KiB"
    );
    let (counts, _) = tally(&t, &live, 3, "/", &[("authorization", "")], PEER).await;
    assert_eq!(counts, [(200, 2), (429, 1)], "an empty header is absent");
}

/// A `client_cert` rule counts the certificate in the request's context, which only the
/// TLS handshake fills: each certificate has its own budget, and a request without one is
/// refused, whatever its headers say.
#[tokio::test]
async fn a_client_cert_rule_counts_the_certificate_in_the_requests_context() {
    let _watch = common::watchdog();
    let dir = tempfile::tempdir().expect("a temporary folder");
    let cert = rcgen::generate_simple_self_signed(vec!["app.test".to_string()]).expect("a cert");
    let (pem, key) = (dir.path().join("gw.pem"), dir.path().join("gw-key.pem"));
    std::fs::write(&pem, cert.cert.pem()).expect("written");
    std::fs::write(&key, cert.signing_key.serialize_pem()).expect("written");
    let t = InProcess::new(&format!(
        concat!(
            "[server.tls]\nlisten = \"127.0.0.1:3\"\n",
            "certificates = [{{ cert = \"{pem}\", key = \"{key}\" }}]\nclient_ca = \"{pem}\"\n",
            "[[rules]]\nname = \"per-cert\"\nkey = \"client_cert\"\nrate = \"2/m\"\n",
        ),
        pem = pem.display(),
        key = key.display(),
    ));
    let live = t.gw.live();
    let parts = Request::get("/x")
        .header("host", "app.test")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    let in_ctx = |cert: Option<[u8; 32]>| Context {
        client_cert: cert.map(ClientCert),
        ..Context::new(ClientPeer::new("203.0.113.7:40000".parse().unwrap()), 0)
    };
    let (alice, bob) = (in_ctx(Some([1; 32])), in_ctx(Some([2; 32])));
    for _ in 0..2 {
        assert_eq!(t.admit(&live, &parts, &alice).await.status, StatusCode::OK);
    }
    let denied = t.admit(&live, &parts, &alice).await;
    assert_eq!(
        (denied.status, denied.decision),
        (StatusCode::TOO_MANY_REQUESTS, "denied")
    );
    assert_eq!(t.admit(&live, &parts, &bob).await.status, StatusCode::OK);
    let none = t.admit(&live, &parts, &in_ctx(None)).await;
    assert_eq!(none.status, StatusCode::UNAUTHORIZED, "{}", none.body);
}
