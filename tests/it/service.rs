//! The decision API (issue 44, `src/service/`) against the real binary, on the memory
//! store and a real redis-server, from raw sockets, hyper and Python's `requests`.
//! Every rule refills at 1/h (or counts per hour): nothing comes back during a test but
//! what a settlement or a refund gives back, so every count is exact.
//!
//! - malformed calls, by raw sockets: every malformed body is 400 problem+json whose
//!   `detail` names the field (a batch's with its index, and nothing of it charged); a
//!   missing or wrong token 401 with its challenge, then 429 past 10 failures of a peer;
//!   no token configured 403; a body past `max_body` 413; unknown paths 404, wrong
//!   methods 405.
//! - Python's `requests` (`tests/service/decide_client.py`): decide, settle, refund.
//! - each of the four algorithms, on each store: a burst of N lets exactly N pass, a
//!   refund gives exactly one back (once), a settlement at k charges exactly k, three dry
//!   runs charge nothing, and of 100 concurrent calls for one key exactly 10 pass.
//! - leases: 10 workers on 4 slots never hold more than 4; a holder that renews keeps its
//!   slot past the TTL, one that crashed loses it after the TTL.
//! - a key limited through the proxy and through the API shares one bucket, a `proxied =
//!   false` rule never limits the proxy, and `ratewall_decisions_total{frontend}` counts
//!   each front-end's decisions apart.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    exact_rule, free_port, until_scrape, Gateway, HttpClient, RedisServer, Reply, Store, Upstream,
    ALGORITHMS,
};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `[decide] token` of every gateway here.
const TOKEN: &str = "svt-decide-token-7f3a9c01d2e4";

/// What a rule of the exactness tests lets pass.
const N: u64 = 5;

/// A gateway with the decision service on a port of its own.
struct Service {
    gw: Gateway,
    port: u16,
    client: HttpClient,
    _upstream: Upstream,
}

impl Service {
    /// `rules` on `store`, with `[decide]` (`decide`: its keys besides `listen`) on a
    /// free port; on another where that one was taken meanwhile.
    async fn start(store: &Store, rules: &str, decide: &str) -> Service {
        Self::start_with(store, rules, decide, &[]).await
    }

    /// [`Service::start`], the gateway run with `env` besides.
    async fn start_with(store: &Store, rules: &str, decide: &str, env: &[(&str, &str)]) -> Service {
        let upstream = Upstream::start().await;
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port();
            let body = format!(
                "{}\n{rules}\n[decide]\nlisten = \"127.0.0.1:{port}\"\n{decide}",
                common::upstream_and_store(&upstream.url(), store)
            );
            match Gateway::try_start_with(&body, "2s", &[], env) {
                Ok(gw) => {
                    return Service {
                        gw,
                        port,
                        client: HttpClient::new(),
                        _upstream: upstream,
                    }
                }
                Err(logs) if logs.contains("Address already in use") => last = logs,
                Err(logs) => panic!("ratewall did not start:\n{logs}"),
            }
        }
        panic!("ratewall did not start (ports taken):\n{last}");
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// `method path` with the token and `body` as JSON.
    async fn call(&self, method: &str, path: &str, body: &Value) -> Reply {
        let auth = format!("Bearer {TOKEN}");
        let headers = [
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
        ];
        let body = Bytes::from(body.to_string());
        self.client
            .send(method, &self.url(path), &headers, body)
            .await
    }

    /// `method path`, which must be answered `status` with JSON.
    async fn json(&self, method: &str, path: &str, body: &Value, status: u16) -> Value {
        let r = self.call(method, path, body).await;
        assert_eq!(
            r.status.as_u16(),
            status,
            "{method} {path} {body}: {}",
            String::from_utf8_lossy(&r.body)
        );
        r.json()
    }

    /// One decision (always 200).
    async fn decide(&self, ask: Value) -> Value {
        let a = self.json("POST", "/v1/decide", &ask, 200).await;
        assert_eq!(
            a["dry_run"],
            ask.get("dry_run").cloned().unwrap_or(json!(false))
        );
        a
    }

    /// Settle `reservation` (`cost`, or a refund where `None`): the status.
    async fn settle(&self, reservation: &Value, cost: Option<u64>) -> u16 {
        let body = match cost {
            Some(c) => json!({"reservation": reservation, "cost": c}),
            None => json!({"reservation": reservation, "refund": true}),
        };
        let r = self.call("POST", "/v1/settle", &body).await;
        if r.status.as_u16() == 200 {
            assert_eq!(r.json()["settled"], true, "{body}");
        }
        r.status.as_u16()
    }
}

/// `remaining` of the answer's one rule, `rule`.
fn remaining(a: &Value, rule: &str) -> u64 {
    let rules = a["rules"].as_array().expect("rules");
    assert_eq!(rules.len(), 1, "{a}");
    assert_eq!(rules[0]["rule"], rule, "{a}");
    assert_eq!(rules[0]["shadow"], false, "{a}");
    rules[0]["remaining"].as_u64().expect("remaining")
}

fn allowed(a: &Value) -> bool {
    a["allowed"].as_bool().expect("allowed")
}

/// A reservation's name: 32 hex digits.
fn reservation(a: &Value) -> Value {
    let r = a["reservation"]
        .as_str()
        .unwrap_or_else(|| panic!("no reservation: {a}"));
    assert!(
        r.len() == 32 && r.bytes().all(|b| b.is_ascii_hexdigit()),
        "reservation {r:?}"
    );
    json!(r)
}

/// A denial, as the decision API answers it: 200, not allowed, the proxy's 429.
fn assert_denied(a: &Value, rule: &str, what: &str) {
    assert!(!allowed(a), "{what}: {a}");
    assert_eq!(a["status"], 429, "{what}: {a}");
    assert!(
        a["retry_after"].as_u64().is_some_and(|s| s >= 1),
        "{what}: {a}"
    );
    assert_eq!(remaining(a, rule), 0, "{what}: {a}");
    assert_eq!(a["rules"][0]["allowed"], false, "{what}: {a}");
    assert!(
        a.get("reservation").is_none(),
        "{what}: a denial reserves nothing: {a}"
    );
}

/// Decide `rule`/`key` until one is denied (at most `n` + 2 calls): exactly the first
/// `n` must pass, counting `remaining` down to 0.
async fn exactly(svc: &Service, rule: &str, key: &str, n: u64, what: &str) {
    for i in 0..n {
        let a = svc.decide(json!({"rule": rule, "key": key})).await;
        assert!(
            allowed(&a),
            "{what}: call {} of {n} should pass: {a}",
            i + 1
        );
        assert_eq!(remaining(&a, rule), n - 1 - i, "{what}: {a}");
    }
    for _ in 0..2 {
        let a = svc.decide(json!({"rule": rule, "key": key})).await;
        assert_denied(&a, rule, &format!("{what}: past {n}"));
    }
}

// ---------------------------------------------------------------------------------------
// Raw sockets

/// What came back for one raw request: status, head, body as JSON (null if it is not).
struct Raw {
    status: u16,
    head: String,
    body: Value,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    fn detail(&self) -> &str {
        self.body["detail"].as_str().unwrap_or("")
    }
}

/// `method path` with `auth` (an `Authorization` value) and `body`, on a new connection
/// from `from` (127.0.0.1 unless another loopback address), read until the server
/// closes it (`Connection: close`).
async fn raw_from(
    from: [u8; 4],
    port: u16,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: &[u8],
) -> Raw {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n");
    if let Some(a) = auth {
        req.push_str(&format!("Authorization: {a}\r\n"));
    }
    req.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    raw_bytes(from, port, &bytes).await
}

async fn raw_bytes(from: [u8; 4], port: u16, bytes: &[u8]) -> Raw {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind((std::net::Ipv4Addr::from(from), 0).into())
        .expect("bind a loopback address");
    let mut s = tokio::time::timeout(common::WAIT, socket.connect(([127, 0, 0, 1], port).into()))
        .await
        .expect("connect within the wait")
        .expect("connect");
    // The server may answer (413) and close before it read everything.
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    let read = tokio::time::timeout(common::WAIT, async {
        let mut buf = [0u8; 8192];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let text = String::from_utf8_lossy(&out).into_owned();
    assert!(
        read.is_ok() || text.contains("\r\n\r\n"),
        "no answer: {text:?}"
    );
    let status = common::status_of(&out);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Raw {
        status,
        head: head.to_string(),
        body: serde_json::from_str(body).unwrap_or(Value::Null),
    }
}

async fn raw(port: u16, method: &str, path: &str, body: &[u8]) -> Raw {
    let auth = format!("Bearer {TOKEN}");
    raw_from([127, 0, 0, 1], port, method, path, Some(&auth), body).await
}

/// `r` must be `status` problem+json whose detail starts with `detail`.
fn assert_problem(r: &Raw, status: u16, detail: &str, what: &str) {
    if let Err(e) = check_problem(r, status, detail, what) {
        panic!("{e}");
    }
}

fn check_problem(r: &Raw, status: u16, detail: &str, what: &str) -> Result<(), String> {
    if r.status != status || r.body["status"] != status {
        return Err(format!("{what}: {} (want {status}): {}", r.status, r.body));
    }
    if r.header("content-type") != Some("application/problem+json") {
        return Err(format!("{what}: not problem+json: {}", r.head));
    }
    if !r.detail().starts_with(detail) {
        return Err(format!(
            "{what}: the detail should start with {detail:?}: {:?}",
            r.detail()
        ));
    }
    Ok(())
}

/// The rules of the malformed-calls test.
const SHAPES: &str = "[[rules]]\nname = \"orgs\"\nmatch = { proxied = false }\nkey = \"header:x-org\"\nrate = \"1/h\"\nburst = 5\n\
[[rules]]\nname = \"by-ip\"\nmatch = { proxied = false }\nkey = \"client_ip\"\nrate = \"1/h\"\nburst = 5\n\
[[rules]]\nname = \"slots\"\nmatch = { proxied = false }\nkey = \"header:x-org\"\nmax_in_flight = 2\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_calls_are_refused_naming_the_field() {
    let _watch = common::watchdog();
    let decide = format!("token = \"{TOKEN}\"\nmax_batch = 3\nmax_body = \"1KiB\"\n");
    let svc = Service::start(&Store::Memory, SHAPES, &decide).await;
    let port = svc.port;
    let zeros = "0".repeat(32);
    let rules_named = "rule: no rule is named \"nope\"; the rules are orgs, by-ip, slots";

    // POST /v1/decide: each malformed body, and the start of the detail naming its field.
    let decide_cases: &[(&str, u16, &str)] = &[
        ("not json", 400, "the body is not a call"),
        ("", 400, "the body is not a call"),
        ("{\"rule\":\"orgs\",\"key\":\"a\"", 400, "the body is not a call"),
        ("\"orgs\"", 400, "the body is not a call"),
        // Wrong types.
        ("{\"rule\":5,\"key\":\"a\"}", 400, "rule: invalid type"),
        ("{\"rule\":\"orgs\",\"key\":7}", 400, "key: invalid type"),
        ("{\"rule\":\"orgs\",\"key\":\"a\",\"cost\":\"2\"}", 400, "cost: invalid type"),
        ("{\"rule\":\"orgs\",\"key\":\"a\",\"cost\":-1}", 400, "cost: invalid value"),
        ("{\"rule\":\"orgs\",\"key\":\"a\",\"cost\":1.5}", 400, "cost: invalid type"),
        ("{\"rule\":\"orgs\",\"key\":\"a\",\"dry_run\":\"yes\"}", 400, "dry_run: invalid type"),
        ("{\"request\":{\"path\":5}}", 400, "request.path: invalid type"),
        ("{\"request\":\"/api\"}", 400, "request: invalid type"),
        ("{\"request\":{\"path\":\"/\",\"client_ip\":\"nope\"}}", 400, "request.client_ip: invalid"),
        ("{\"request\":{\"path\":\"/\",\"headers\":{\"x-a\":5}}}", 400, "request.headers"),
        // Unknown fields, at the top and within request.
        ("{\"rule\":\"orgs\",\"key\":\"a\",\"colour\":1}", 400, "colour: unknown field `colour`"),
        ("{\"request\":{\"path\":\"/\",\"verb\":\"GET\"}}", 400, "request.verb: unknown field `verb`"),
        // Both forms, or neither.
        ("{\"rule\":\"orgs\",\"key\":\"a\",\"request\":{\"path\":\"/\"}}", 400, "rule: give a rule (and its key) or a request, not both"),
        ("{}", 400, "rule: give a rule (and its key) or a request"),
        ("{\"dry_run\":true}", 400, "rule: give a rule (and its key) or a request"),
        ("{\"key\":\"a\"}", 400, "rule: a key needs the rule"),
        // Costs no quota takes.
        ("{\"rule\":\"orgs\",\"key\":\"a\",\"cost\":0}", 400, "cost: at least 1"),
        (
            "{\"request\":{\"path\":\"/\"},\"cost\":2}",
            400,
            "cost: for a rule and its key",
        ),
        ("{\"rule\":\"orgs\",\"key\":\"a\",\"cost\":6}", 400, "cost: 6 is more than rule \"orgs\" ever allows"),
        // Keys the rule cannot count by.
        ("{\"rule\":\"by-ip\",\"key\":\"not-an-ip\"}", 400, "key: \"not-an-ip\" is not an IP address"),
        ("{\"rule\":\"by-ip\"}", 400, "key: rule \"by-ip\" counts by a client address"),
        ("{\"rule\":\"orgs\"}", 400, "key: rule \"orgs\" counts by a header's value"),
        ("{\"rule\":\"orgs\",\"key\":\"a\\u0001b\"}", 400, "key: not a valid header value"),
        // A described request that is no request.
        ("{\"request\":{\"path\":\"/\",\"headers\":{\"bad name\":\"v\"}}}", 400, "request.headers.bad name: not a header name"),
        ("{\"request\":{\"path\":\"/\",\"headers\":{\"x-a\":\"a\\nb\"}}}", 400, "request.headers.x-a: not a valid header value"),
        ("{\"request\":{\"method\":\"G ET\",\"path\":\"/\"}}", 400, "request.method: \"G ET\" is not an HTTP method"),
        ("{\"request\":{\"path\":\"api\"}}", 400, "request.path: starts with /"),
        ("{\"request\":{\"path\":\"/\",\"host\":\"a\\u0000b\"}}", 400, "request.host: not a valid host"),
        // An unknown rule: the rules there are.
        ("{\"rule\":\"nope\",\"key\":\"a\"}", 400, rules_named),
        // Batches: past max_batch, and an item at fault named by its index.
        (
            "[{\"rule\":\"orgs\",\"key\":\"a\"},{\"rule\":\"orgs\",\"key\":\"a\"},{\"rule\":\"orgs\",\"key\":\"a\"},{\"rule\":\"orgs\",\"key\":\"a\"}]",
            400,
            "a batch is at most [decide] max_batch (3) decisions; this one has 4",
        ),
        ("[{\"rule\":\"orgs\",\"key\":\"a\"},{\"rule\":5}]", 400, "[1].rule: invalid type"),
        ("[{\"rule\":\"orgs\",\"key\":\"a\"},{\"rule\":\"nope\"}]", 400, "[1].rule: no rule is named \"nope\"; the rules are orgs, by-ip, slots"),
        ("[{\"rule\":\"orgs\",\"key\":\"a\"},{\"rule\":\"orgs\",\"key\":\"a\",\"cost\":0}]", 400, "[1].cost: at least 1"),
        ("[{\"rule\":\"orgs\",\"key\":\"a\"},{}]", 400, "[1].rule: give a rule"),
        ("[1]", 400, "[0]: invalid type"),
    ];
    let mut wrong = Vec::new();
    for (body, status, detail) in decide_cases {
        let r = raw(port, "POST", "/v1/decide", body.as_bytes()).await;
        if let Err(e) = check_problem(&r, *status, detail, &format!("POST /v1/decide {body}")) {
            wrong.push(e);
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Every refused call charged nothing: key "a" (named by each, valid or not) is whole.
    let a = svc
        .decide(json!({"rule": "orgs", "key": "a", "dry_run": true}))
        .await;
    assert_eq!(
        remaining(&a, "orgs"),
        N,
        "refused calls charged nothing: {a}"
    );

    // A batch with an item at fault fails whole, and charges none of it, even where the
    // fault is found only in its key, its cost or its described request.
    for (i, bad) in [
        json!({"rule": "by-ip", "key": "not-an-ip"}),
        json!({"rule": "orgs", "key": "batch", "cost": 6}),
        json!({"rule": "orgs"}),
        json!({"request": {"path": "/", "headers": {"bad name": "v"}}}),
    ]
    .into_iter()
    .enumerate()
    {
        let body = json!([{"rule": "orgs", "key": "batch"}, bad]);
        let r = raw(port, "POST", "/v1/decide", body.to_string().as_bytes()).await;
        assert_eq!(r.status, 400, "batch {i} {body}: {}", r.body);
        assert!(r.detail().starts_with("[1]."), "batch {i}: {}", r.body);
        let a = svc
            .decide(json!({"rule": "orgs", "key": "batch", "dry_run": true}))
            .await;
        assert_eq!(
            remaining(&a, "orgs"),
            N,
            "batch {i} {body} was refused, yet its first item was charged: {a}"
        );
    }

    // A well-formed batch: answered as a list, in order.
    let batch = svc
        .json(
            "POST",
            "/v1/decide",
            &json!([
                {"rule": "orgs", "key": "b0", "cost": 1},
                {"rule": "orgs", "key": "b1", "cost": 2},
                {"rule": "by-ip", "key": "203.0.113.7", "cost": 3},
            ]),
            200,
        )
        .await;
    // (`limit` and `remaining` count requests of the call's cost: of 5, 5 - 2 = 3 left is
    // one call of 2; 5 - 3 = 2 left, no call of 3.)
    let rem: Vec<(String, u64, u64)> = batch
        .as_array()
        .expect("a list")
        .iter()
        .map(|a| {
            assert!(allowed(a), "{a}");
            let rule = a["rules"][0]["rule"].as_str().expect("rule").to_string();
            let limit = a["rules"][0]["limit"].as_u64().expect("limit");
            let r = remaining(a, &rule);
            (rule, limit, r)
        })
        .collect();
    assert_eq!(
        rem,
        [
            ("orgs".into(), 5, 4),
            ("orgs".into(), 2, 1),
            ("by-ip".into(), 1, 0)
        ],
        "{batch}"
    );
    for (key, left) in [("b0", 4), ("b1", 3)] {
        let a = svc
            .decide(json!({"rule": "orgs", "key": key, "dry_run": true}))
            .await;
        assert_eq!(remaining(&a, "orgs"), left, "{key}: {a}");
    }

    // POST /v1/settle.
    let settle_cases: Vec<(String, u16, &str)> = vec![
        ("nope".into(), 400, "the body is not a call"),
        (
            "{\"reservation\":\"xyz\",\"cost\":1}".to_string(),
            400,
            "reservation: 32 hex digits",
        ),
        (
            format!("{{\"reservation\":\"{}\",\"cost\":1}}", "g".repeat(32)),
            400,
            "reservation: 32 hex digits",
        ),
        (
            "{\"reservation\":7,\"cost\":1}".to_string(),
            400,
            "reservation: invalid type",
        ),
        (
            "{\"cost\":1}".to_string(),
            400,
            "the body is not a call: missing field `reservation`",
        ),
        (
            format!("{{\"reservation\":\"{zeros}\"}}"),
            400,
            "cost: give the real cost, or refund = true",
        ),
        (
            format!("{{\"reservation\":\"{zeros}\",\"cost\":1,\"refund\":true}}"),
            400,
            "cost: give a cost or refund = true, not both",
        ),
        (
            format!("{{\"reservation\":\"{zeros}\",\"cost\":-2}}"),
            400,
            "cost: invalid value",
        ),
        (
            format!("{{\"reservation\":\"{zeros}\",\"refund\":\"yes\"}}"),
            400,
            "refund: invalid type",
        ),
        (
            format!("{{\"reservation\":\"{zeros}\",\"cost\":1,\"tip\":1}}"),
            400,
            "tip: unknown field `tip`",
        ),
        (
            format!("{{\"reservation\":\"{zeros}\",\"cost\":1}}"),
            404,
            "no such reservation",
        ),
        (
            format!("{{\"reservation\":\"{zeros}\",\"refund\":true}}"),
            404,
            "no such reservation",
        ),
    ];
    for (body, status, detail) in &settle_cases {
        let r = raw(port, "POST", "/v1/settle", body.as_bytes()).await;
        assert_problem(&r, *status, detail, &format!("POST /v1/settle {body}"));
    }

    // POST /v1/leases, PUT and DELETE /v1/leases/<id>.
    let lease_cases: &[(&str, u16, &str)] = &[
        (
            "{\"rule\":\"orgs\",\"key\":\"a\"}",
            400,
            "rule: rule \"orgs\" is not a concurrency limit",
        ),
        ("{\"rule\":\"nope\",\"key\":\"a\"}", 400, rules_named),
        (
            "{\"rule\":\"slots\"}",
            400,
            "key: rule \"slots\" counts by a header's value",
        ),
        (
            "{\"key\":\"a\"}",
            400,
            "the body is not a call: missing field `rule`",
        ),
        (
            "{\"rule\":\"slots\",\"key\":\"a\",\"ttl\":5}",
            400,
            "ttl: unknown field `ttl`",
        ),
        ("[]", 400, "the body is not a call"),
    ];
    for (body, status, detail) in lease_cases {
        let r = raw(port, "POST", "/v1/leases", body.as_bytes()).await;
        assert_problem(&r, *status, detail, &format!("POST /v1/leases {body}"));
    }
    for method in ["PUT", "DELETE"] {
        for id in [zeros.as_str(), "xyz", ""] {
            let path = format!("/v1/leases/{id}");
            let r = raw(port, method, &path, b"").await;
            assert_problem(&r, 404, "no such lease", &format!("{method} {path}"));
        }
    }

    // Unknown paths: 404; known ones with another method: 405.
    for (method, path) in [
        ("POST", "/v1/decidex"),
        ("POST", "/v2/decide"),
        ("GET", "/"),
        ("POST", "/v1/settle/x"),
        ("GET", "/metrics"),
    ] {
        let r = raw(port, method, path, b"{}").await;
        assert_problem(&r, 404, "no such call", &format!("{method} {path}"));
    }
    for (method, path) in [
        ("GET", "/v1/decide"),
        ("DELETE", "/v1/decide"),
        ("PUT", "/v1/settle"),
        ("GET", "/v1/leases"),
        ("PATCH", "/v1/leases"),
    ] {
        let r = raw(port, method, path, b"").await;
        assert_problem(
            &r,
            405,
            &format!("{path} takes POST"),
            &format!("{method} {path}"),
        );
    }

    // A body past max_body (1 KiB): 413, by its length or as it arrives in chunks.
    let big = format!("{{\"rule\":\"orgs\",\"key\":\"{}\"}}", "k".repeat(2_000));
    for path in ["/v1/decide", "/v1/settle", "/v1/leases"] {
        let r = raw(port, "POST", path, big.as_bytes()).await;
        assert_problem(
            &r,
            413,
            "the body is over [decide] max_body (1024 bytes)",
            path,
        );
    }
    let mut chunked = format!(
        "POST /v1/decide HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    .into_bytes();
    for _ in 0..3 {
        chunked.extend_from_slice(format!("200\r\n{}\r\n", "x".repeat(0x200)).as_bytes());
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let r = raw_bytes([127, 0, 0, 1], port, &chunked).await;
    assert_problem(&r, 413, "the body is over [decide] max_body", "chunked");
    // Just under it is read (and is then only a wrong key).
    let under = format!("{{\"rule\":\"by-ip\",\"key\":\"{}\"}}", "k".repeat(990));
    assert!(under.len() <= 1024);
    let r = raw(port, "POST", "/v1/decide", under.as_bytes()).await;
    assert_problem(&r, 400, "key: ", "a body under max_body");

    // The token: missing, wrong, another scheme: 401 with the challenge, whatever the call.
    let ok = b"{\"rule\":\"orgs\",\"key\":\"a\"}";
    for (auth, detail) in [
        (None, "Authorization: Bearer <[decide] token> is required"),
        (
            Some("Bearer not-the-decide-token"),
            "the bearer token is not the decision service's",
        ),
        (
            Some(format!("Basic {TOKEN}")).as_deref(),
            "Authorization: Bearer <[decide] token> is required",
        ),
    ] {
        let r = raw_from([127, 0, 0, 1], port, "POST", "/v1/decide", auth, ok).await;
        assert_problem(&r, 401, detail, &format!("token {auth:?}"));
        assert_eq!(
            r.header("www-authenticate"),
            Some("Bearer realm=\"ratewall decide\""),
            "{}",
            r.head
        );
    }
    // A guesser (another address) is slowed: 10 failures, then 429 with Retry-After;
    // 127.0.0.1 is not.
    let guesser = [127, 0, 0, 23];
    for i in 0..10 {
        let r = raw_from(
            guesser,
            port,
            "POST",
            "/v1/decide",
            Some("Bearer guess-0000000000"),
            ok,
        )
        .await;
        assert_eq!(r.status, 401, "guess {i}: {}", r.body);
    }
    let mut throttled = None;
    for _ in 0..10 {
        let r = raw_from(
            guesser,
            port,
            "POST",
            "/v1/decide",
            Some("Bearer guess-1111111111"),
            ok,
        )
        .await;
        if r.status == 429 {
            throttled = Some(r);
            break;
        }
        assert_eq!(r.status, 401, "{}", r.body);
    }
    let r = throttled.expect("a peer's failures past 10 are answered 429");
    assert!(r.header("retry-after").is_some(), "{}", r.head);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let a = svc
        .decide(json!({"rule": "orgs", "key": "after-guesses"}))
        .await;
    assert!(
        allowed(&a),
        "another peer is not slowed by the guesser: {a}"
    );
    assert_eq!(remaining(&a, "orgs"), N - 1);

    // No token configured (and no client certificates): 403 for every call, whatever the
    // token sent.
    let untokened = Service::start(&Store::Memory, SHAPES, "").await;
    for (method, path) in [
        ("POST", "/v1/decide"),
        ("POST", "/v1/settle"),
        ("POST", "/v1/leases"),
        ("GET", "/"),
    ] {
        for auth in [None, Some(format!("Bearer {TOKEN}"))] {
            let r = raw_from(
                [127, 0, 0, 1],
                untokened.port,
                method,
                path,
                auth.as_deref(),
                ok,
            )
            .await;
            assert_problem(
                &r,
                403,
                "the decision service needs [decide] token",
                &format!("{method} {path}"),
            );
        }
    }
    drop(untokened);

    // RATEWALL_DECIDE_TOKEN wins over the file's token.
    let by_env = Service::start_with(
        &Store::Memory,
        SHAPES,
        "token = \"the-file-token-0123456789\"\n",
        &[("RATEWALL_DECIDE_TOKEN", TOKEN)],
    )
    .await;
    let a = by_env.decide(json!({"rule": "orgs", "key": "env"})).await;
    assert!(allowed(&a), "{a}");
    let r = raw_from(
        [127, 0, 0, 1],
        by_env.port,
        "POST",
        "/v1/decide",
        Some("Bearer the-file-token-0123456789"),
        ok,
    )
    .await;
    assert_problem(
        &r,
        401,
        "the bearer token is not the decision service's",
        "the file's token",
    );
    drop(svc);
}

// ---------------------------------------------------------------------------------------
// Python's requests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_decides_settles_and_refunds() {
    let _watch = common::watchdog();
    let rules = format!(
        "{}match = {{ proxied = false }}\ncost_header = \"x-cost\"\n",
        exact_rule("imports", "header:x-org", "token_bucket", N)
    );
    let svc = Service::start(&Store::Memory, &rules, &format!("token = \"{TOKEN}\"\n")).await;
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/service/decide_client.py");
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new("python3")
            .arg(&script)
            .arg(svc.url(""))
            .arg(TOKEN)
            .arg("imports")
            .arg("org:42")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("decide_client.py within 60 s")
    .expect("run python3 tests/service/decide_client.py (requests: tests/requirements.txt)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.lines().last() == Some("ok"),
        "decide_client.py: {}\n{stdout}\n{stderr}",
        out.status
    );
    // What it did is what the gateway holds: 5, less 3 settled and 2 taken.
    let a = svc
        .decide(json!({"rule": "imports", "key": "org:42", "dry_run": true}))
        .await;
    assert!(!allowed(&a), "{a}");
    assert_eq!(remaining(&a, "imports"), 0, "{a}");
}

// ---------------------------------------------------------------------------------------
// Exact counts on every algorithm and store

/// For each algorithm: `<algorithm>` (N, settling by a reported cost) and
/// `<algorithm>-10` (10, no settlement), keyed by `x-org`, for the API only.
fn algorithm_rules() -> String {
    let mut rules = String::new();
    for alg in ALGORITHMS {
        rules.push_str(&exact_rule(alg, "header:x-org", alg, N));
        rules.push_str("match = { proxied = false }\ncost_header = \"x-cost\"\n");
        rules.push_str(&exact_rule(&format!("{alg}-10"), "header:x-org", alg, 10));
        rules.push_str("match = { proxied = false }\n");
    }
    rules
}

async fn exact_counts(store: Store, name: &str) {
    let svc = Service::start(
        &store,
        &algorithm_rules(),
        &format!("token = \"{TOKEN}\"\n"),
    )
    .await;
    for alg in ALGORITHMS {
        let what = |s: &str| format!("{name}/{alg}: {s}");
        let rule = alg;

        // A burst of N: exactly N pass, each with a reservation (the rule settles).
        let mut held = Vec::new();
        for i in 0..N {
            let a = svc.decide(json!({"rule": rule, "key": "burst"})).await;
            assert!(allowed(&a), "{}", what(&format!("call {i}: {a}")));
            assert_eq!(a["status"], 200, "{a}");
            assert_eq!(a["retry_after"], Value::Null, "{a}");
            assert_eq!(remaining(&a, rule), N - 1 - i, "{}", what("burst"));
            assert_eq!(a["rules"][0]["limit"], N, "{a}");
            assert!(
                a["ratelimit"].as_str().is_some_and(|s| s.contains(rule)),
                "{a}"
            );
            assert!(
                a["ratelimit_policy"]
                    .as_str()
                    .is_some_and(|s| s.contains(rule)),
                "{a}"
            );
            held.push(reservation(&a));
        }
        for _ in 0..2 {
            let a = svc.decide(json!({"rule": rule, "key": "burst"})).await;
            assert_denied(&a, rule, &what("past the burst"));
        }

        // A refund gives exactly one back, once: of 8 refunds at once, one is taken.
        let refunds = (0..8).map(|_| svc.settle(&held[0], None));
        let mut statuses = futures_util::future::join_all(refunds).await;
        statuses.sort_unstable();
        assert_eq!(
            statuses,
            [200, 404, 404, 404, 404, 404, 404, 404],
            "{}",
            what("8 refunds of one")
        );
        assert_eq!(
            svc.settle(&held[0], Some(1)).await,
            404,
            "{}",
            what("a settlement after the refund")
        );
        exactly(&svc, rule, "burst", 1, &what("after a refund")).await;
        // Settled at its own cost: nothing changes.
        assert_eq!(
            svc.settle(&held[1], Some(1)).await,
            200,
            "{}",
            what("settle at 1")
        );
        let a = svc.decide(json!({"rule": rule, "key": "burst"})).await;
        assert_denied(&a, rule, &what("settled at its cost"));

        // A settlement at k charges k: reserved 1, settled at 3, then N - 3 pass.
        let a = svc.decide(json!({"rule": rule, "key": "up"})).await;
        assert_eq!(remaining(&a, rule), N - 1, "{a}");
        assert_eq!(svc.settle(&reservation(&a), Some(3)).await, 200);
        exactly(&svc, rule, "up", N - 3, &what("settled at 3")).await;
        // Reserved 4, settled at 1: N - 1 pass.
        // (`limit` and `remaining` count requests of the call's cost: 5 / 4 and 1 / 4.)
        let a = svc
            .decide(json!({"rule": rule, "key": "down", "cost": 4}))
            .await;
        assert!(allowed(&a), "{a}");
        assert_eq!(
            (a["rules"][0]["limit"].as_u64(), remaining(&a, rule)),
            (Some(1), 0),
            "{a}"
        );
        assert_eq!(svc.settle(&reservation(&a), Some(1)).await, 200);
        exactly(&svc, rule, "down", N - 1, &what("reserved 4, settled at 1")).await;
        // A cost past what is left is denied and charges nothing.
        let a = svc
            .decide(json!({"rule": rule, "key": "cost", "cost": 3}))
            .await;
        assert!(allowed(&a), "{a}");
        let a = svc
            .decide(json!({"rule": rule, "key": "cost", "cost": 3}))
            .await;
        assert!(!allowed(&a), "{}", what(&format!("3 of 2 left: {a}")));
        exactly(&svc, rule, "cost", N - 3, &what("a denied cost of 3")).await;

        // Dry runs charge nothing: 3 of them, then exactly N.
        for _ in 0..3 {
            let a = svc
                .decide(json!({"rule": rule, "key": "dry", "dry_run": true}))
                .await;
            assert!(allowed(&a), "{a}");
            assert_eq!(
                remaining(&a, rule),
                N,
                "{}",
                what(&format!("a dry run: {a}"))
            );
            assert!(
                a.get("reservation").is_none(),
                "a dry run holds nothing: {a}"
            );
        }
        exactly(&svc, rule, "dry", N, &what("after 3 dry runs")).await;
        let a = svc
            .decide(json!({"rule": rule, "key": "dry", "dry_run": true}))
            .await;
        assert!(!allowed(&a), "a dry run says what would happen: {a}");

        // 100 concurrent calls for one key of a burst of 10: exactly 10 pass.
        let rule10 = format!("{alg}-10");
        let calls: Vec<_> = (0..100)
            .map(|_| {
                let client = svc.client.clone();
                let url = svc.url("/v1/decide");
                let body = Bytes::from(json!({"rule": rule10, "key": "herd"}).to_string());
                tokio::spawn(async move {
                    let auth = format!("Bearer {TOKEN}");
                    client
                        .send("POST", &url, &[("authorization", &auth)], body)
                        .await
                })
            })
            .collect();
        let mut passed = 0;
        for c in calls {
            let r = c.await.expect("a call");
            assert_eq!(r.status, 200, "{:?}", r.body);
            let a = r.json();
            assert!(
                a.get("reservation").is_none(),
                "{rule10} does not settle: {a}"
            );
            passed += usize::from(allowed(&a));
        }
        assert_eq!(passed, 10, "{}", what("100 concurrent calls, burst 10"));
        let a = svc
            .decide(json!({"rule": rule10, "key": "herd", "dry_run": true}))
            .await;
        assert_eq!(remaining(&a, &rule10), 0, "{a}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decide_settle_refund_exact_on_every_algorithm_memory() {
    let _watch = common::watchdog();
    exact_counts(Store::Memory, "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decide_settle_refund_exact_on_every_algorithm_redis() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    exact_counts(Store::redis_roomy(&redis), "redis").await;
}

// ---------------------------------------------------------------------------------------
// Leases

/// `slots`: 4 in flight per `x-org`; `crash`: 1, its leases living 2 s unrenewed.
const LEASE_RULES: &str = "[[rules]]\nname = \"slots\"\nmatch = { proxied = false }\nkey = \"header:x-org\"\nmax_in_flight = 4\n\
[[rules]]\nname = \"crash\"\nmatch = { proxied = false }\nkey = \"header:x-org\"\nmax_in_flight = 1\nlease_ttl = \"2s\"\n";

/// Take a lease of `rule` for `key`: its id where one was given.
async fn take(svc: &Service, rule: &str, key: &str) -> Option<String> {
    let a = svc
        .json(
            "POST",
            "/v1/leases",
            &json!({"rule": rule, "key": key}),
            200,
        )
        .await;
    if !allowed(&a) {
        assert!(a.get("lease").is_none(), "{a}");
        assert_eq!(a["status"], 429, "{a}");
        return None;
    }
    let id = a["lease"]
        .as_str()
        .unwrap_or_else(|| panic!("no lease: {a}"));
    assert!(
        id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{a}"
    );
    assert!(a["ttl"].as_u64().is_some_and(|t| t >= 1), "{a}");
    Some(id.to_string())
}

async fn give_back(svc: &Service, id: &str) {
    let r = svc
        .json("DELETE", &format!("/v1/leases/{id}"), &json!(null), 200)
        .await;
    assert_eq!(r["held"], false, "{r}");
}

async fn leases(store: Store, name: &str) {
    let svc =
        Arc::new(Service::start(&store, LEASE_RULES, &format!("token = \"{TOKEN}\"\n")).await);

    // Exactly 4: a fifth is refused until one is given back; given back twice is 404.
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(
            take(&svc, "slots", "exact")
                .await
                .unwrap_or_else(|| panic!("{name}: slot {i}")),
        );
    }
    assert!(
        take(&svc, "slots", "exact").await.is_none(),
        "{name}: a fifth slot"
    );
    assert!(
        take(&svc, "slots", "other-org").await.is_some(),
        "{name}: another key's slots"
    );
    give_back(&svc, &ids[0]).await;
    let r = svc
        .call("DELETE", &format!("/v1/leases/{}", ids[0]), &json!(null))
        .await;
    assert_eq!(r.status, 404, "{name}: given back twice");
    let r = svc
        .call("PUT", &format!("/v1/leases/{}", ids[0]), &json!(null))
        .await;
    assert_eq!(r.status, 404, "{name}: renewing one given back");
    ids[0] = take(&svc, "slots", "exact")
        .await
        .expect("the slot given back");
    assert!(
        take(&svc, "slots", "exact").await.is_none(),
        "{name}: 4 again"
    );
    for id in &ids {
        give_back(&svc, id).await;
    }

    // 10 workers, each taking 3 leases in turn, holding each a moment: never more than 4
    // held at once. The count goes up once a lease is given and down before it is given
    // back, so it never counts more than the gateway holds.
    let held = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs(25);
    let workers: Vec<_> = (0..10)
        .map(|_| {
            let (svc, held, most, refused) =
                (svc.clone(), held.clone(), most.clone(), refused.clone());
            tokio::spawn(async move {
                let mut taken = 0;
                while taken < 3 {
                    assert!(Instant::now() < deadline, "the workers took too long");
                    let Some(id) = take(&svc, "slots", "workers").await else {
                        refused.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    };
                    let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    held.fetch_sub(1, Ordering::SeqCst);
                    give_back(&svc, &id).await;
                    taken += 1;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("a worker");
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 4, "{name}: {most} leases held at once of 4 slots");
    assert!(most >= 2, "{name}: the workers never overlapped ({most})");
    assert!(
        refused.load(Ordering::SeqCst) > 0,
        "{name}: 10 workers on 4 slots were never refused"
    );
    // All given back: the 4 slots are free.
    let ids: Vec<String> = {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(
                take(&svc, "slots", "workers")
                    .await
                    .expect("a slot once all are back"),
            );
        }
        v
    };
    assert!(take(&svc, "slots", "workers").await.is_none());
    for id in &ids {
        give_back(&svc, id).await;
    }

    // A holder that renews keeps its slot past the TTL (2 s): renewed every 300 ms for
    // 3 s, nobody else gets it.
    let kept = take(&svc, "crash", "renewer")
        .await
        .expect("the renewer's slot");
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = svc
            .json("PUT", &format!("/v1/leases/{kept}"), &json!(null), 200)
            .await;
        assert_eq!(r["held"], true, "{r}");
        assert_eq!(r["ttl"], 2, "{r}");
        assert!(
            take(&svc, "crash", "renewer").await.is_none(),
            "{name}: a renewed slot taken"
        );
    }
    give_back(&svc, &kept).await;

    // A holder that crashed (takes a lease, never renews nor gives it back): its slot is
    // back after the TTL, not before.
    let t0 = Instant::now();
    let crashed = take(&svc, "crash", "crasher")
        .await
        .expect("the crasher's slot");
    assert!(
        take(&svc, "crash", "crasher").await.is_none(),
        "{name}: the slot is held"
    );
    let end = t0 + Duration::from_secs(15);
    let back = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if let Some(id) = take(&svc, "crash", "crasher").await {
            break (t0.elapsed(), id);
        }
        assert!(
            Instant::now() < end,
            "{name}: a crashed holder's slot not back within 15 s (TTL 2 s)"
        );
    };
    assert!(
        back.0 >= Duration::from_millis(1_900),
        "{name}: back after {:?}, before its TTL",
        back.0
    );
    // The crashed lease is gone: renewing or giving it back is 404.
    let r = svc
        .call("PUT", &format!("/v1/leases/{crashed}"), &json!(null))
        .await;
    assert_eq!(
        r.status, 404,
        "{name}: a lapsed lease renewed: {:?}",
        r.body
    );
    let r = svc
        .call("DELETE", &format!("/v1/leases/{crashed}"), &json!(null))
        .await;
    assert_eq!(r.status, 404, "{name}: a lapsed lease given back");
    give_back(&svc, &back.1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_never_exceed_their_slots_and_lapse_unrenewed_memory() {
    let _watch = common::watchdog();
    leases(Store::Memory, "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_never_exceed_their_slots_and_lapse_unrenewed_redis() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    leases(Store::redis_roomy(&redis), "redis").await;
}

// ---------------------------------------------------------------------------------------
// The proxy and the API: one bucket, counted apart

/// `api`: 5 per API key on `/api`, for the proxy and the API alike; `api-only`: 1 per
/// API key, asked for by name only (never a proxied request's).
const SHARED_RULES: &str = "[[rules]]\nname = \"api\"\nmatch = { path_prefix = \"/api\" }\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 5\n\
[[rules]]\nname = \"api-only\"\nmatch = { proxied = false }\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 1\n";

async fn proxy_status(svc: &Service, key: &str) -> u16 {
    svc.client
        .get(&svc.gw.url("/api/items"), &[("x-api-key", key)])
        .await
        .status
        .as_u16()
}

async fn shared_bucket(store: Store, name: &str) {
    let svc = Service::start(&store, SHARED_RULES, &format!("token = \"{TOKEN}\"\n")).await;

    // 3 through the proxy (api-only never limits them: its burst is 1), then the API
    // has exactly 2 left, then the proxy is refused.
    for i in 0..3 {
        assert_eq!(proxy_status(&svc, "k1").await, 200, "{name}: proxied {i}");
    }
    let a = svc
        .decide(json!({"rule": "api", "key": "k1", "dry_run": true}))
        .await;
    assert_eq!(remaining(&a, "api"), 2, "{name}: after 3 proxied: {a}");
    exactly(
        &svc,
        "api",
        "k1",
        2,
        &format!("{name}: the API after 3 proxied"),
    )
    .await;
    assert_eq!(
        proxy_status(&svc, "k1").await,
        429,
        "{name}: the proxy after the API"
    );
    // And the other way: 2 through the API, then exactly 3 through the proxy.
    for _ in 0..2 {
        assert!(allowed(
            &svc.decide(json!({"rule": "api", "key": "k2"})).await
        ));
    }
    let statuses = [
        proxy_status(&svc, "k2").await,
        proxy_status(&svc, "k2").await,
        proxy_status(&svc, "k2").await,
        proxy_status(&svc, "k2").await,
    ];
    assert_eq!(
        statuses,
        [200, 200, 200, 429],
        "{name}: the proxy after 2 through the API"
    );
    // The API-only rule is the API's: 1 per key.
    exactly(&svc, "api-only", "k1", 1, &format!("{name}: api-only")).await;

    // Counted apart: proxy 6 allowed and 2 denied; decide 2 + 2 + 1 allowed, 2 + 2 denied
    // (dry runs are not decisions).
    let want = [
        ("proxy", "allowed", 6.0),
        ("proxy", "denied", 2.0),
        ("decide", "allowed", 5.0),
        ("decide", "denied", 4.0),
    ];
    let holds = |m: &common::Scrape| {
        want.iter().all(|(f, d, v)| {
            m.find(
                "ratewall_decisions_total",
                &[("frontend", f), ("decision", d)],
            ) == Some(*v)
        })
    };
    let m = until_scrape(&svc.gw, "ratewall_decisions_total by frontend", holds).await;
    for (f, d, v) in want {
        assert_eq!(
            m.find(
                "ratewall_decisions_total",
                &[("frontend", f), ("decision", d)]
            ),
            Some(v),
            "{name}: {f}/{d}"
        );
    }
    for f in ["proxy", "decide", "rls", "forward_auth"] {
        for d in ["refused", "error"] {
            assert_eq!(
                m.find(
                    "ratewall_decisions_total",
                    &[("frontend", f), ("decision", d)]
                )
                .unwrap_or(0.0),
                0.0,
                "{name}: {f}/{d}"
            );
        }
    }
    for d in ["allowed", "denied"] {
        for f in ["rls", "forward_auth"] {
            assert_eq!(
                m.find(
                    "ratewall_decisions_total",
                    &[("frontend", f), ("decision", d)]
                )
                .unwrap_or(0.0),
                0.0,
                "{name}: {f}/{d}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_and_api_share_a_bucket_and_are_counted_apart_memory() {
    let _watch = common::watchdog();
    shared_bucket(Store::Memory, "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_and_api_share_a_bucket_and_are_counted_apart_redis() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    shared_bucket(Store::redis_roomy(&redis), "redis").await;
}
