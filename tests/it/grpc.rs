//! gRPC end to end: grpcio's own client, through the real binary, to grpcio's own server,
//! behind an `h2c` pool (cleartext, prior knowledge) and an `h2` pool (TLS, ALPN, the
//! server's certificate made here and its CA the pool's `ca`). Outcomes are read in the
//! client's own words (`grpc.StatusCode`, its metadata), never from the wire by hand.
//!
//! What is pinned, through both pools: calls of the four kinds carry every message
//! unchanged and in order; the call past a burst of 3 is RESOURCE_EXHAUSTED with its
//! pushback and RateLimit fields, and never reaches the backend; a store outage under
//! `on_error = "deny"` is UNAVAILABLE; the backend's codes, messages and trailing
//! metadata arrive as it wrote them (with and without messages before them); a 64 MiB
//! client stream arrives whole while the gateway's memory stays bounded; statuses are
//! counted by code and source and logged; a dead backend is UNAVAILABLE, and one slower
//! than the pool's `timeout` DEADLINE_EXCEEDED. And `ratewall check --path` names the rule
//! a method matches, as the running gateway then applies it.

use std::process::Command;
use std::time::Duration;

use crate::common::grpc::{grpc_calls, pack, Call, GrpcBackend, GrpcClient, Outcome};
use crate::common::metrics::Scrape;
use crate::common::redis_server::RedisServer;
use crate::common::tls_upstream::{write_pem, Ca};
use crate::common::{self, toml_path, Gateway, HttpClient, Store};

/// What the gateway speaks to the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pool {
    H2c,
    H2,
}

/// A gRPC backend and the gateway in front of it: one pool `default` of that one server.
struct Bench {
    // The gateway first: it goes before its backend.
    gw: Gateway,
    backend: GrpcBackend,
    _certs: Option<tempfile::TempDir>,
}

impl Bench {
    /// The pool's `timeout` is `timeout`; `rest` is the config after the pool (a memory
    /// store unless it has a `[store]`); `args` the gateway's command line.
    fn start(pool: Pool, timeout: &str, rest: &str, args: &[&str]) -> Bench {
        let (backend, certs, scheme, tls) = match pool {
            Pool::H2c => (GrpcBackend::start(), None, "http", String::new()),
            Pool::H2 => {
                let dir = tempfile::tempdir().expect("tempdir");
                let ca = Ca::new("grpc test CA");
                let leaf = ca.leaf(&["127.0.0.1"]);
                let cert = write_pem(dir.path(), "backend.pem", &leaf.cert);
                let key = write_pem(dir.path(), "backend-key.pem", &leaf.key);
                let ca_pem = write_pem(dir.path(), "ca.pem", &ca.pem());
                let tls = format!("ca = \"{}\"\n", toml_path(&ca_pem));
                (GrpcBackend::start_tls(&cert, &key), Some(dir), "https", tls)
            }
        };
        let protocol = match pool {
            Pool::H2c => "h2c",
            Pool::H2 => "h2",
        };
        let store = match rest.contains("[store]") {
            true => String::new(),
            false => Store::Memory.toml(),
        };
        let config = format!(
            "workers = 2\n\
             [[upstreams]]\nname = \"default\"\nservers = [\"{scheme}://127.0.0.1:{}\"]\n\
             protocol = \"{protocol}\"\nconnect_timeout = \"2s\"\ntimeout = \"{timeout}\"\n\
             retries = 0\n{tls}\n{store}{rest}",
            backend.port
        );
        let gw = Gateway::start_with(&config, args, &[]);
        Bench {
            gw,
            backend,
            _certs: certs,
        }
    }

    fn plain(pool: Pool, rest: &str) -> Bench {
        Self::start(pool, "20s", rest, &[])
    }

    async fn calls(&self, calls: &[Call]) -> Vec<Outcome> {
        grpc_calls(self.gw.port, calls).await
    }
}

/// `n` bytes that differ from call to call (`seed`) and from place to place.
fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// The messages that arrived are those sent, in order (told apart without printing
/// megabytes).
fn assert_same(got: &[Vec<u8>], sent: &[Vec<u8>], what: &str) {
    let lens = |v: &[Vec<u8>]| v.iter().map(Vec::len).collect::<Vec<_>>();
    assert_eq!(lens(got), lens(sent), "{what}: message sizes");
    for (i, (g, s)) in got.iter().zip(sent).enumerate() {
        assert!(g == s, "{what}: message {i} changed on the way");
    }
}

fn assert_ok(o: &Outcome, gw: &Gateway) {
    assert_eq!(o.code, "OK", "{o:?}\n{}", gw.logs());
}

const SAY: &str = "/pkg.Echo/Say";

/// Exactly 3 calls of `pkg.Echo` pass in a test (nothing refills within an hour).
const ECHO_BURST_3: &str = "[[rules]]\nname = \"echo\"\nmatch = { path_prefix = \"/pkg.Echo/\" }\n\
     key = \"client_ip\"\nrate = \"1/h\"\nburst = 3\n";

// ---------------------------------------------------------------------------------------
// 1. Every kind of call, every message unchanged and in order.

async fn every_kind_of_call(pool: Pool) {
    let b = Bench::plain(pool, "");
    let unary = [Vec::new(), (0..=255u8).collect(), noise(1, 100_000)];
    let items = vec![
        b"first".to_vec(),
        Vec::new(),
        (0..=255u8).rev().collect(),
        noise(2, 200_000),
        b"last".to_vec(),
    ];
    let upload: Vec<Vec<u8>> = (0..40).map(|i| noise(10 + i, i as usize * 997)).collect();
    let chat: Vec<Vec<u8>> = (0..12)
        .map(|i| [format!("turn {i}:").into_bytes(), noise(100 + i, 3000)].concat())
        .collect();
    let mut calls: Vec<Call> = unary.iter().map(|m| Call::unary(SAY, m)).collect();
    calls.push(Call::server_stream("/pkg.Echo/Expand", &pack(&items)));
    calls.push(Call::client_stream("/pkg.Echo/Collect", upload.clone()));
    // A ping-pong: it deadlocks unless each answer comes while the request is open.
    calls.push(Call::bidi("/pkg.Echo/Chat", chat.clone()).timeout(15.0));
    let out = b.calls(&calls).await;
    for o in &out {
        assert_ok(o, &b.gw);
    }
    for (i, m) in unary.iter().enumerate() {
        assert_same(&out[i].responses, std::slice::from_ref(m), "unary");
    }
    assert_same(&out[3].responses, &items, "server streaming");
    assert_same(&out[4].responses, &[pack(&upload)], "client streaming");
    assert_same(&out[5].responses, &chat, "bidirectional");
    assert_eq!(
        b.backend.seen(),
        [
            SAY,
            SAY,
            SAY,
            "/pkg.Echo/Expand",
            "/pkg.Echo/Collect",
            "/pkg.Echo/Chat"
        ],
        "each call reached the backend once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_call_arrives_whole_and_in_order_through_an_h2c_pool() {
    let _watch = common::watchdog();
    every_kind_of_call(Pool::H2c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_call_arrives_whole_and_in_order_through_an_h2_pool() {
    let _watch = common::watchdog();
    every_kind_of_call(Pool::H2).await;
}

// ---------------------------------------------------------------------------------------
// 2. A denial is RESOURCE_EXHAUSTED, with its pushback and RateLimit fields.

async fn the_call_past_the_burst(pool: Pool) {
    let b = Bench::plain(pool, ECHO_BURST_3);
    let calls: Vec<Call> = (1..=4)
        .map(|i| Call::unary(SAY, format!("call {i}").as_bytes()))
        .collect();
    let out = b.calls(&calls).await;
    for (i, o) in out[..3].iter().enumerate() {
        assert_ok(o, &b.gw);
        assert_eq!(o.responses, [format!("call {}", i + 1).into_bytes()]);
        // Allowed: the RateLimit fields come with the backend's own headers.
        let ratelimit = o.header("ratelimit").unwrap_or_else(|| panic!("{o:?}"));
        assert_eq!(ratelimit.split(';').nth(1), Some(&*format!("r={}", 2 - i)));
        assert_eq!(o.header("x-echo-initial"), Some("hello"), "{o:?}");
    }
    let denied = &out[3];
    assert_eq!(denied.code, "RESOURCE_EXHAUSTED", "{denied:?}");
    assert_eq!(denied.code_number, 8);
    assert_eq!(
        denied.details.as_deref(),
        Some("Too Many Requests: rate limited by echo")
    );
    let pushback: u64 = denied
        .trailer("grpc-retry-pushback-ms")
        .unwrap_or_else(|| panic!("no grpc-retry-pushback-ms: {denied:?}"))
        .parse()
        .expect("milliseconds");
    // The next token of 1/h comes within the hour.
    assert!((1..=3_600_000).contains(&pushback), "{pushback}");
    let retry_after: u64 = denied
        .trailer("retry-after")
        .unwrap_or_else(|| panic!("{denied:?}"))
        .parse()
        .expect("seconds");
    assert_eq!(retry_after, pushback.div_ceil(1000), "{denied:?}");
    let ratelimit = denied
        .trailer("ratelimit")
        .unwrap_or_else(|| panic!("{denied:?}"));
    assert!(ratelimit.starts_with("\"echo\";r=0;"), "{ratelimit}");
    let policy = denied
        .trailer("ratelimit-policy")
        .unwrap_or_else(|| panic!("{denied:?}"));
    assert!(policy.starts_with("\"echo\";"), "{policy}");
    assert_eq!(b.backend.calls(SAY), 3, "the denied call never reached it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_call_past_a_burst_of_three_is_resource_exhausted_through_an_h2c_pool() {
    let _watch = common::watchdog();
    the_call_past_the_burst(Pool::H2c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_call_past_a_burst_of_three_is_resource_exhausted_through_an_h2_pool() {
    let _watch = common::watchdog();
    the_call_past_the_burst(Pool::H2).await;
}

// ---------------------------------------------------------------------------------------
// 3. A store outage under `on_error = "deny"` is UNAVAILABLE.

async fn a_store_outage(pool: Pool) {
    let mut redis = RedisServer::start();
    let rest = format!(
        "{}[[rules]]\nname = \"echo\"\nmatch = {{ path_prefix = \"/pkg.Echo/\" }}\n\
         key = \"client_ip\"\nrate = \"100/s\"\n",
        Store::redis(&redis).toml()
    );
    let b = Bench::plain(pool, &rest);
    let before = b.calls(&[Call::unary(SAY, b"before")]).await;
    assert_ok(&before[0], &b.gw);
    redis.kill();
    let during = &b.calls(&[Call::unary(SAY, b"during")]).await[0];
    assert_eq!(during.code, "UNAVAILABLE", "{during:?}\n{}", b.gw.logs());
    assert_eq!(during.code_number, 14);
    assert_eq!(
        during.details.as_deref(),
        Some("the rate-limit store is unavailable"),
        "the gateway's words, not a transport failure"
    );
    assert_eq!(during.trailer("grpc-retry-pushback-ms"), Some("1000"));
    assert_eq!(b.backend.calls(SAY), 1, "the refused call never reached it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_under_deny_is_unavailable_through_an_h2c_pool() {
    let _watch = common::watchdog();
    a_store_outage(Pool::H2c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_under_deny_is_unavailable_through_an_h2_pool() {
    let _watch = common::watchdog();
    a_store_outage(Pool::H2).await;
}

// ---------------------------------------------------------------------------------------
// 4. The backend's status, message and trailing metadata arrive as it wrote them.

async fn the_backends_trailers(pool: Pool) {
    let b = Bench::plain(pool, "");
    let items = vec![b"one".to_vec(), noise(7, 70_000)];
    let out = b
        .calls(&[
            Call::unary("/pkg.Echo/Fail", "é 100% gone".as_bytes()),
            Call::server_stream("/pkg.Echo/ExpandThenFail", &pack(&items)),
            Call::unary(SAY, b"fine"),
        ])
        .await;
    let trailers = [
        ("x-detail".to_string(), "missing".to_string()),
        ("x-detail-bin".to_string(), "00ff10".to_string()),
    ];
    // A Trailers-Only answer's one block is its headers too, and the gateway adds `Date`
    // to every answer's headers, as a proxy with a clock does (RFC 9110 §6.6.1): the
    // backend's metadata is the rest, exactly.
    let backends = |o: &Outcome| -> Vec<(String, String)> {
        o.trailing
            .iter()
            .filter(|(k, _)| k != "date")
            .cloned()
            .collect()
    };
    let (failed, streamed, fine) = (&out[0], &out[1], &out[2]);
    // No message before the status (grpcio's server answers Trailers-Only).
    assert_eq!(failed.code, "NOT_FOUND", "{failed:?}\n{}", b.gw.logs());
    assert_eq!(failed.code_number, 5);
    assert_eq!(failed.details.as_deref(), Some("no such echo: é 100% gone"));
    assert_eq!(backends(failed), trailers, "{failed:?}");
    assert!(failed.responses.is_empty());
    // Messages, then the status in the trailers.
    assert_eq!(streamed.code, "NOT_FOUND", "{streamed:?}");
    assert_eq!(
        streamed.details.as_deref(),
        Some("no such echo: after the stream")
    );
    assert_same(&streamed.responses, &items, "before the failure");
    assert_eq!(streamed.trailing, trailers, "{streamed:?}");
    // An OK call's own metadata, both blocks.
    assert_ok(fine, &b.gw);
    assert_eq!(fine.responses, [b"fine".to_vec()]);
    assert_eq!(fine.header("x-echo-initial"), Some("hello"), "{fine:?}");
    assert_eq!(
        fine.trailing,
        [("x-echo-trailer".to_string(), "said".to_string())],
        "{fine:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backends_code_message_and_trailers_arrive_through_an_h2c_pool() {
    let _watch = common::watchdog();
    the_backends_trailers(Pool::H2c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backends_code_message_and_trailers_arrive_through_an_h2_pool() {
    let _watch = common::watchdog();
    the_backends_trailers(Pool::H2).await;
}

// ---------------------------------------------------------------------------------------
// 5. A 64 MiB client stream arrives whole, in bounded memory.

async fn a_64_mib_stream(pool: Pool) {
    const COUNT: usize = 1024;
    const SIZE: usize = 64 << 10;
    let b = Bench::plain(pool, "");
    assert_ok(&b.calls(&[Call::unary(SAY, b"warm")]).await[0], &b.gw);
    let before = b.gw.rss_kib();
    let mut client = GrpcClient::spawn(
        b.gw.port,
        &[Call::generated("/pkg.Echo/Count", COUNT, SIZE).timeout(120.0)],
    )
    .await;
    let mut peak = before;
    let mut readings = 0;
    while client.running() {
        peak = peak.max(b.gw.rss_kib());
        readings += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let out = client.finish(Duration::from_secs(120)).await;
    peak = peak.max(b.gw.rss_kib());
    let o = &out[0];
    assert_ok(o, &b.gw);
    let sent = o.generated.as_ref().expect("what the client generated");
    assert_eq!(
        (sent.messages, sent.bytes),
        (COUNT as u64, (COUNT * SIZE) as u64)
    );
    let counted: serde_json::Value =
        serde_json::from_slice(&o.responses[0]).expect("the backend's count");
    assert_eq!(counted["messages"], COUNT as u64, "{counted}");
    assert_eq!(counted["bytes"], (COUNT * SIZE) as u64, "{counted}");
    assert_eq!(
        counted["sha256"], sent.sha256,
        "the bytes arrived unchanged"
    );
    let grew = peak.saturating_sub(before);
    assert!(
        grew < 24 * 1024,
        "the gateway's RSS grew {grew} KiB (from {before} KiB, {readings} readings) for a 64 MiB stream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_client_stream_arrives_whole_in_bounded_memory_through_an_h2c_pool() {
    let _watch = common::watchdog();
    a_64_mib_stream(Pool::H2c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_client_stream_arrives_whole_in_bounded_memory_through_an_h2_pool() {
    let _watch = common::watchdog();
    a_64_mib_stream(Pool::H2).await;
}

// ---------------------------------------------------------------------------------------
// 6. `ratewall check --path` names the rule a method matches, as the gateway applies it.

/// `ratewall check` on `config` for a gRPC call of `path`: what it says of the sample.
fn check(config: &std::path::Path, path: &str) -> String {
    let out = Command::new(common::binary())
        .arg("check")
        .arg("--config")
        .arg(config)
        .args(["--path", path, "--method", "POST"])
        .args(["--header", "content-type: application/grpc"])
        .output()
        .expect("run ratewall check");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .split_once("sample request:")
        .map(|(_, s)| s.to_string())
        .unwrap_or_else(|| panic!("no sample request in:\n{stdout}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_the_rule_a_grpc_method_matches_and_the_gateway_applies_just_that() {
    let _watch = common::watchdog();
    let b = Bench::plain(Pool::H2c, ECHO_BURST_3);
    let echo = check(&b.gw.config, SAY);
    assert!(echo.starts_with(" POST /pkg.Echo/Say\n"), "{echo}");
    assert!(echo.contains("1 rule(s) apply"), "{echo}");
    assert!(
        echo.contains("  - echo: 1/h burst 3, token_bucket; counted per client IP"),
        "{echo}"
    );
    let other = check(&b.gw.config, "/pkg.Other/Say");
    assert!(other.contains("no rule applies"), "{other}");
    assert!(
        other.contains("echo: the path does not start with /pkg.Echo/"),
        "{other}"
    );
    assert!(!other.contains("rule(s) apply"), "{other}");
    // As said: five calls of pkg.Other all pass, the fourth of pkg.Echo does not.
    let mut calls = vec![Call::unary("/pkg.Other/Say", b"x"); 5];
    calls.extend(vec![Call::unary(SAY, b"y"); 4]);
    let out = b.calls(&calls).await;
    let codes: Vec<&str> = out.iter().map(|o| o.code.as_str()).collect();
    let mut expected = vec!["OK"; 8];
    expected.push("RESOURCE_EXHAUSTED");
    assert_eq!(codes, expected, "{out:?}");
    assert_eq!(b.backend.calls("/pkg.Other/Say"), 5);
    assert_eq!(b.backend.calls(SAY), 3);
}

// ---------------------------------------------------------------------------------------
// 7. gRPC statuses counted by code and source, and logged.

fn access_lines(logs: &str) -> Vec<serde_json::Value> {
    logs.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "ratewall::access")
        .map(|v| v["fields"].clone())
        .collect()
}

async fn statuses_counted_and_logged(pool: Pool) {
    let rule = format!(
        "[[rules]]\nname = \"say\"\nmatch = {{ path = \"{SAY}\" }}\n\
         key = \"client_ip\"\nrate = \"1/h\"\nburst = 2\n"
    );
    let b = Bench::start(pool, "20s", &rule, &["--log-format", "json"]);
    let before = Scrape::take(&HttpClient::new(), &b.gw).await;
    assert!(
        before
            .nonzero2("ratewall_grpc_responses_total", "code", "source")
            .is_empty(),
        "{}",
        before.text
    );
    assert_eq!(
        before.find(
            "ratewall_grpc_responses_total",
            &[("code", "8"), ("source", "gateway")]
        ),
        Some(0.0),
        "series exist at zero"
    );
    let out = b
        .calls(&[
            Call::unary(SAY, b"1"),
            Call::unary(SAY, b"2"),
            Call::unary(SAY, b"3"),
            Call::unary("/pkg.Echo/Fail", b"x"),
            Call::server_stream("/pkg.Echo/ExpandThenFail", &pack(&[b"a".to_vec()])),
            Call::server_stream("/pkg.Echo/Expand", &pack(&[b"b".to_vec()])),
        ])
        .await;
    let codes: Vec<u8> = out.iter().map(|o| o.code_number).collect();
    assert_eq!(codes, [0, 0, 8, 5, 5, 0], "{out:?}");
    // A status read from the trailers is counted and logged when the body ends.
    assert!(
        b.gw.wait_for_log(
            "\"target\":\"ratewall::access\"",
            6,
            Duration::from_secs(15)
        ),
        "{}",
        b.gw.logs()
    );
    let after = Scrape::take(&HttpClient::new(), &b.gw).await;
    let counted = after.nonzero2("ratewall_grpc_responses_total", "code", "source");
    let expected: std::collections::BTreeMap<(String, String), u64> = [
        (("0", "upstream"), 3),
        (("5", "upstream"), 2),
        (("8", "gateway"), 1),
    ]
    .into_iter()
    .map(|((c, s), n)| ((c.to_string(), s.to_string()), n))
    .collect();
    assert_eq!(counted, expected, "{}", after.text);
    let logs = b.gw.logs();
    let lines = access_lines(&logs);
    let logged: Vec<(String, Option<u64>, String)> = lines
        .iter()
        .map(|l| {
            (
                l["path"].as_str().unwrap_or("?").to_string(),
                l["grpc_status"].as_u64(),
                l["decision"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect();
    let line = |path: &str, status: u64, decision: &str| {
        (path.to_string(), Some(status), decision.to_string())
    };
    let mut want = vec![
        line(SAY, 0, "allowed"),
        line(SAY, 0, "allowed"),
        line(SAY, 8, "denied"),
        line("/pkg.Echo/Fail", 5, "unlimited"),
        line("/pkg.Echo/ExpandThenFail", 5, "unlimited"),
        line("/pkg.Echo/Expand", 0, "unlimited"),
    ];
    let mut got = logged.clone();
    want.sort();
    got.sort();
    assert_eq!(got, want, "{logs}");
    assert!(
        lines.iter().all(|l| l["status"] == 200),
        "every gRPC answer is an HTTP 200:\n{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_statuses_are_counted_by_code_and_source_and_logged_through_an_h2c_pool() {
    let _watch = common::watchdog();
    statuses_counted_and_logged(Pool::H2c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_statuses_are_counted_by_code_and_source_and_logged_through_an_h2_pool() {
    let _watch = common::watchdog();
    statuses_counted_and_logged(Pool::H2).await;
}

// ---------------------------------------------------------------------------------------
// 8. A dead backend is UNAVAILABLE; one slower than the pool's `timeout`,
//    DEADLINE_EXCEEDED.

async fn a_dead_backend(pool: Pool) {
    let mut b = Bench::plain(pool, "");
    assert_ok(&b.calls(&[Call::unary(SAY, b"alive")]).await[0], &b.gw);
    b.backend.kill();
    let dead = &b.calls(&[Call::unary(SAY, b"dead")]).await[0];
    assert_eq!(dead.code, "UNAVAILABLE", "{dead:?}\n{}", b.gw.logs());
    assert_eq!(dead.code_number, 14);
    assert_eq!(
        dead.details.as_deref(),
        Some("the upstream could not be reached"),
        "the gateway's words, not a transport failure: {dead:?}"
    );
    let counted = common::metrics::metric(
        &b.gw,
        "ratewall_grpc_responses_total",
        &[("code", "14"), ("source", "gateway")],
    )
    .await;
    assert_eq!(counted, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_backend_behind_an_h2c_pool_is_unavailable() {
    let _watch = common::watchdog();
    a_dead_backend(Pool::H2c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_backend_behind_an_h2_pool_is_unavailable() {
    let _watch = common::watchdog();
    a_dead_backend(Pool::H2).await;
}

async fn a_slow_backend(pool: Pool) {
    // The backend answers /pkg.Echo/Slow after 5 s; the pool waits 1 s, the call 30 s.
    let b = Bench::start(pool, "1s", "", &[]);
    let slow = &b
        .calls(&[Call::unary("/pkg.Echo/Slow", b"late").timeout(30.0)])
        .await[0];
    assert_eq!(slow.code, "DEADLINE_EXCEEDED", "{slow:?}\n{}", b.gw.logs());
    assert_eq!(slow.code_number, 4);
    assert_eq!(
        slow.details.as_deref(),
        Some("the upstream did not answer in time"),
        "the gateway's words, not the client's own deadline: {slow:?}"
    );
    // Not before the pool's timeout; that it was the timeout's answer, not the backend's,
    // is in the details above and the gateway's count below (no clock needed).
    assert!(
        slow.elapsed >= Duration::from_millis(900),
        "answered before the pool's timeout: {:?}",
        slow.elapsed
    );
    assert_eq!(b.backend.calls("/pkg.Echo/Slow"), 1);
    let counted = common::metrics::metric(
        &b.gw,
        "ratewall_grpc_responses_total",
        &[("code", "4"), ("source", "gateway")],
    )
    .await;
    assert_eq!(counted, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_slower_than_the_pools_timeout_is_deadline_exceeded_through_an_h2c_pool() {
    let _watch = common::watchdog();
    a_slow_backend(Pool::H2c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_slower_than_the_pools_timeout_is_deadline_exceeded_through_an_h2_pool() {
    let _watch = common::watchdog();
    a_slow_backend(Pool::H2).await;
}
