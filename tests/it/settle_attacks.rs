//! The settlement accounting cannot be gamed: what a client (or a backend it talks
//! through) can do to pay less than it used, each tried against the real binary, with
//! real clients, raw sockets, redis-server and Python backends. Rules refill at 1/h, so
//! nothing refills during a test but where a test says so; charges are read exactly, from
//! `/admin/state` (tokens left, nothing charged), the next request's `RateLimit` `r`, the
//! backend's own count of the heads it read, and Redis' own value.
//!
//! 1. Leaving early is not a refund: a client that closes (FIN, RST), cancels its HTTP/2
//!    stream, cuts, breaks or stalls its body once its request reached the backend keeps
//!    its charge; what never reached a backend (502, an overload shed, a client that left
//!    the overload queue) is given back. And the attack as a figure: a loop of early
//!    leavers for 15 s against 10/m.
//! 2. A refund by status needs a ceiling (`attempts`): refused at load without one; failed
//!    attempts stop at it; a WebSocket's 101 is always charged.
//! 3. The token bill cannot be dodged: every way of hiding `max_tokens` from the gateway
//!    reserves the stated max or `default_reserve`; `on_unreadable = "reject"` refuses
//!    such bodies; `total_tokens` reserves the prompt too; a usage that comes after the
//!    client left is read (`settle_drain`) and charged; and the attack as a figure.
//! 4. Compressed answers are counted.
//! 5. Cost names never leak (head, trailers, HTTP/1.1 and h2), and a client's own cost
//!    field never reaches the backend nor lowers its charge.
//! 6. On Redis, a trailer's cost is settled before the body's last byte.
//! 7. On Redis, no remembered denial outlives the refunds of a settling rule.
//!
//! The new config keys the tests are written against are in the constants below
//! (`ATTEMPTS`, `DEFAULT_RESERVE`, `DRAIN`, `on_unreadable`).

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::early::{leave_early, H2Canceller, Leave};
use common::gzip_backend::GzipBackend;
use common::llm::{stream_get, Http, LlmBackend, COST_HEADER};
use common::witness::Witness;
use common::{
    raw_exchange, redis_key, remaining, send_raw, serial, try_remaining, until_quiet, ws_handshake,
    EchoServer, Gateway, HttpClient, RedisServer, Reply, Scrape, Store, WAIT,
};
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

/// The admin token of every gateway here (`/admin/state` needs one).
const ADMIN_TOKEN: &str = "attacks-admin-token-0123456789";

/// NEW: the ceiling on attempts a rule that refunds by status must have, in a
/// `charge = { statuses = [...] ATTEMPTS }` table: large enough not to matter where a
/// test is about the rule's own bucket.
const ATTEMPTS: &str = r#", attempts = { rate = "1/h", burst = 100 }"#;

/// NEW: what an unreadable body reserves, required with `reserve = "max_tokens"`.
const DEFAULT_RESERVE: &str = "default_reserve = 500\n";

/// NEW: how long the gateway reads on after the client left, to settle.
const DRAIN: &str = "settle_drain = { bytes = \"10MiB\", time = \"60s\" }\n";

/// The `RateLimit` burst of the LLM rules: tokens, refilled at 1/h.
const TOKENS: i64 = 10_000;

/// A config: `server` (keys of the `[server]` table, each line ending in `\n`), an
/// `[upstream]` on `url`, the store, an admin token, then `rules` (and any other table).
fn config(server: &str, url: &str, store: &Store, rules: &str) -> String {
    format!(
        "{server}\n[upstream]\nurl = \"{url}\"\nconnect_timeout = \"1s\"\ntimeout = \"10s\"\n{}\n[admin]\ntoken = \"{ADMIN_TOKEN}\"\n\n{rules}",
        store.toml()
    )
}

/// A rule `name` per API key, at 1/h with `burst`, and `extra` lines.
fn rule(name: &str, burst: i64, extra: &str) -> String {
    format!(
        "[[rules]]\nname = \"{name}\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = {burst}\n{extra}\n"
    )
}

/// The tokens API key `key` has left under `rule`, from `/admin/state` (which charges
/// nothing): exact, in units of 1.
async fn left(gw: &Gateway, rule: &str, key: &str) -> i64 {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let r = HttpClient::new()
        .get(
            &gw.admin_url(&format!("/admin/state?rule={rule}&key={key}")),
            &[("authorization", &auth)],
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "/admin/state: {:?}",
        String::from_utf8_lossy(&r.body)
    );
    r.json()["remaining"]
        .as_i64()
        .unwrap_or_else(|| panic!("no remaining in {:?}", r.json()))
}

/// Poll [`left`] until it is `want` (at most `within`): the last value read.
async fn left_becomes(gw: &Gateway, rule: &str, key: &str, want: i64, within: Duration) -> i64 {
    let end = Instant::now() + within;
    loop {
        let now = left(gw, rule, key).await;
        if now == want || Instant::now() >= end {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A GET with API key `key`.
async fn get(c: &HttpClient, gw: &Gateway, path: &str, key: &str) -> Reply {
    c.get(&gw.url(path), &[("x-api-key", key)]).await
}

/// `r` of `rule`, or a word for its absence, for failure messages.
fn r_or_none(r: &Reply, rule: &str) -> String {
    try_remaining(r, rule).map_or_else(|| "none".into(), |v| v.to_string())
}

/// How a raw request carries its body.
enum Sent<'a> {
    /// No body and no length field.
    Nothing,
    /// `Content-Length` and the bytes.
    Length(&'a [u8]),
    /// `Transfer-Encoding: chunked`, the bytes in one chunk.
    Chunked(&'a [u8]),
}

/// A case of raw requests: its name, fields, body, and what it should come to.
type Case<'a, W> = (&'a str, Vec<(&'a str, &'a str)>, Sent<'a>, W);

/// A raw HTTP/1.1 request (ending the connection after its answer).
fn raw_request(
    method: &str,
    path: &str,
    key: &str,
    fields: &[(&str, &str)],
    body: Sent,
) -> Vec<u8> {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: attacks.test\r\nx-api-key: {key}\r\nConnection: close\r\n"
    );
    for (n, v) in fields {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    match body {
        Sent::Nothing => {
            head.push_str("\r\n");
            head.into_bytes()
        }
        Sent::Length(b) => {
            head.push_str(&format!("content-length: {}\r\n\r\n", b.len()));
            let mut out = head.into_bytes();
            out.extend_from_slice(b);
            out
        }
        Sent::Chunked(b) => {
            head.push_str("transfer-encoding: chunked\r\n\r\n");
            let mut out = head.into_bytes();
            out.extend(format!("{:x}\r\n", b.len()).into_bytes());
            out.extend_from_slice(b);
            out.extend_from_slice(b"\r\n0\r\n\r\n");
            out
        }
    }
}

// ---------------------------------------------------------------------------------------
// 1. Leaving early is not a refund.

/// Every way of leaving once the request reached the backend keeps the charge: after
/// `B` of them the next proper request is 429, and the backend read exactly `B` heads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_early_is_not_a_refund() {
    let _watch = common::watchdog();
    const B: usize = 10;
    let backend = Arc::new(Witness::start().await);
    let rules = rule(
        "api",
        B as i64,
        &format!("charge = {{ statuses = [\"2xx\"]{ATTEMPTS} }}"),
    );
    let gw = Gateway::start(&config(
        "body_timeout = \"1s\"\n",
        &backend.url(),
        &Store::Memory,
        &rules,
    ));
    let port = gw.port;
    // The backend holds each answer 2 s: every client leaves before the head.
    let path = "/work?hold=2000";
    let mut answered = Vec::new();
    for how in [Leave::Fin, Leave::Rst, Leave::ShortBody, Leave::BadChunk] {
        let key = how.name();
        for i in 0..B {
            let reached = backend.wait_heads_of(key, i + 1, WAIT);
            if let Some(s) = leave_early(port, path, key, how, reached).await {
                answered.push(format!("{key} #{i}: {s}"));
            }
        }
    }
    // Stalled bodies, all at once: each waits out the 1 s body_timeout.
    let mut stalls = JoinSet::new();
    for _ in 0..B {
        let backend = backend.clone();
        stalls.spawn(async move {
            let reached = backend.wait_heads_of("stall", B, WAIT);
            leave_early(port, path, "stall", Leave::Stall, reached).await
        });
    }
    // HTTP/2 streams cancelled (RST_STREAM) on one connection that stays open.
    let mut h2 = H2Canceller::connect(port).await;
    for i in 0..B {
        h2.cancel(
            path,
            "h2-cancel",
            backend.wait_heads_of("h2-cancel", i + 1, WAIT),
        )
        .await;
    }
    while let Some(s) = stalls.join_next().await {
        if let Some(s) = s.expect("a stalled client") {
            answered.push(format!("stall: {s}"));
        }
    }
    // Until the gateway has seen every departure: only the HTTP/2 connection is open, and
    // no request is in flight (a cancelled stream's is dropped).
    until_quiet(&gw, 1.0).await;

    let c = HttpClient::new();
    let mut rows = Vec::new();
    let mut wrong = false;
    for key in [
        "fin",
        "rst",
        "h2-cancel",
        "short-body",
        "bad-chunk",
        "stall",
    ] {
        let heads = backend.heads_of(key);
        let r = get(&c, &gw, "/work", key).await;
        let then = backend.heads_of(key);
        wrong |= heads != B || r.status != StatusCode::TOO_MANY_REQUESTS || then != heads;
        rows.push(format!(
            "{key:<11} heads at the backend {heads:>3}, then a proper request: {} (r={}, \
             {} at the backend), tokens left {}",
            r.status.as_u16(),
            r_or_none(&r, "api"),
            if then == heads { "not" } else { "also" },
            left(&gw, "api", key).await
        ));
    }
    assert!(
        !wrong,
        "after {B} requests that reached the backend and whose client left, the next must be \
         429 (and never reach the backend):\n{}\n(the gateway's answers to the clients that \
         waited: {answered:?})",
        rows.join("\n")
    );
    drop(h2);
}

/// What never reached a backend is given back: the backend unreachable (502), an
/// overload shed (503), a request whose client left while it waited in the overload
/// queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_never_reached_a_backend_is_refunded() {
    let _watch = common::watchdog();
    const B: i64 = 10;
    let backend = Arc::new(Witness::start().await);
    let w = backend.url();
    let refusing = common::RefusingPort::new();
    let body = format!(
        r#"[upstream]
connect_timeout = "1s"
timeout = "20s"
retries = 0
max_fails = 0

[[upstreams]]
name = "default"
servers = ["{w}"]

[[upstreams]]
name = "dead"
servers = ["{}"]

[[upstreams]]
name = "busy"
servers = ["{w}"]
overload = {{ max_concurrency = 1, max_queue = 0 }}

[[upstreams]]
name = "queued"
servers = ["{w}"]
overload = {{ max_concurrency = 1, max_queue = 4, max_wait = "20s" }}

[[routes]]
name = "dead"
match = {{ path_prefix = "/dead/" }}
upstream = "dead"

[[routes]]
name = "busy"
match = {{ path_prefix = "/busy/" }}
upstream = "busy"

[[routes]]
name = "queued"
match = {{ path_prefix = "/queued/" }}
upstream = "queued"

{}
[admin]
token = "{ADMIN_TOKEN}"

{}"#,
        refusing.url(),
        Store::Memory.toml(),
        rule(
            "api",
            B,
            &format!("charge = {{ statuses = [\"2xx\"]{ATTEMPTS} }}")
        ),
    );
    let gw = Arc::new(Gateway::start(&body));
    let c = HttpClient::new();

    // The backend unreachable: 502, given back.
    for i in 0..15 {
        let r = get(&c, &gw, "/dead/x", "dead").await;
        assert_eq!(r.status.as_u16(), 502, "dead #{i}");
        assert_eq!(remaining(&r, "api"), B, "dead #{i}: given back");
    }

    // Shed at once (no queue): 503, given back.
    let occupy = |path: &'static str, key: &'static str| {
        let (c, gw) = (c.clone(), gw.clone());
        tokio::spawn(async move { get(&c, &gw, path, key).await.status })
    };
    let busy = occupy("/busy/x?hold=gate", "occupier");
    assert!(backend.wait_heads_of("occupier", 1, WAIT).await);
    for i in 0..15 {
        let r = get(&c, &gw, "/busy/x", "shed").await;
        assert_eq!(r.status.as_u16(), 503, "shed #{i}");
        assert_eq!(remaining(&r, "api"), B, "shed #{i}: given back");
    }

    // Queued, and its client left while it waited.
    let queued = occupy("/queued/x?hold=gate", "occupier-q");
    assert!(backend.wait_heads_of("occupier-q", 1, WAIT).await);
    let mut waiter = common::connect(gw.port).await;
    waiter
        .write_all(b"GET /queued/x HTTP/1.1\r\nHost: attacks.test\r\nx-api-key: waiter\r\n\r\n")
        .await
        .expect("send the waiter");
    let queue = || async {
        Scrape::take(&HttpClient::new(), &gw)
            .await
            .sum("ratewall_overload_queue_length", &[("upstream", "queued")])
    };
    let end = Instant::now() + WAIT;
    while queue().await < 1.0 {
        assert!(Instant::now() < end, "the waiter never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(waiter);
    let end = Instant::now() + WAIT;
    while queue().await > 0.0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    backend.open();
    assert_eq!(busy.await.expect("occupier").as_u16(), 200);
    assert_eq!(queued.await.expect("occupier-q").as_u16(), 200);

    // Each is charged its one 200 now, and nothing before it.
    for key in ["dead", "shed", "waiter"] {
        let r = get(&c, &gw, "/x", key).await;
        assert_eq!(r.status.as_u16(), 200, "{key}");
        assert_eq!(
            remaining(&r, "api"),
            B - 1,
            "{key}: what never reached the backend was given back"
        );
        assert_eq!(backend.heads_of(key), 1, "{key}: only the probe reached it");
    }
}

/// The attack as a figure: one key, 10/m burst 10 charged for 2xx only, a loop of
/// clients that leave before the answer for 15 s. The backend must see no more than the
/// burst and the rate's worth of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_leavers_get_no_more_than_the_limit() {
    let _watch = common::watchdog();
    const B: f64 = 10.0;
    const RATE_PER_MIN: f64 = 10.0;
    const RUN: Duration = Duration::from_secs(15);
    const WORKERS: usize = 8;
    let _serial = serial().await;
    let backend = Arc::new(Witness::start().await);
    let rules = "[[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"10/m\"\nburst = 10\n\
                 charge = { statuses = [\"2xx\"], attempts = { rate = \"1/h\", burst = 1000 } }\n";
    let gw = Gateway::start(&config("", &backend.url(), &Store::Memory, rules));
    let port = gw.port;
    let started = Instant::now();
    let mut workers = JoinSet::new();
    for w in 0..WORKERS {
        workers.spawn(async move {
            let mut sent = 0u64;
            let mut denied = 0u64;
            while started.elapsed() < RUN {
                let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                    continue;
                };
                let _ = s.set_nodelay(true);
                let req = "GET /work?hold=300 HTTP/1.1\r\nHost: attacks.test\r\nx-api-key: leaver\r\n\r\n";
                if s.write_all(req.as_bytes()).await.is_err() {
                    continue;
                }
                sent += 1;
                // Leave 50 ms later, before the backend's answer (300 ms): a 429 comes sooner.
                let mut buf = [0u8; 512];
                if let Ok(Ok(n)) =
                    tokio::time::timeout(Duration::from_millis(50), s.read(&mut buf)).await
                {
                    denied += u64::from(buf[..n].starts_with(b"HTTP/1.1 429"));
                }
                if (sent + w as u64).is_multiple_of(2) {
                    let _ = s.set_zero_linger();
                }
                drop(s);
            }
            (sent, denied)
        });
    }
    let (mut sent, mut denied) = (0, 0);
    while let Some(r) = workers.join_next().await {
        let (s, d) = r.expect("a worker");
        sent += s;
        denied += d;
    }
    let secs = started.elapsed().as_secs_f64();
    // Until every client is seen gone and nothing is in flight: no more heads can come.
    until_quiet(&gw, 0.0).await;
    let hits = backend.heads_of("leaver");
    let most = (B + RATE_PER_MIN * secs / 60.0).floor() as usize;
    assert!(
        hits <= most,
        "early leavers for {secs:.1} s against 10/m burst 10: {hits} reached the backend \
         ({:.0}/min; {sent} sent, {denied} seen denied), at most {most} may",
        hits as f64 * 60.0 / secs
    );
}

// ---------------------------------------------------------------------------------------
// 2. A refund by status needs a ceiling.

/// `charge = { statuses }` without `attempts` is refused at load, by `ratewall check` and
/// at start, naming `attempts`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_by_status_without_attempts_are_refused_at_load() {
    let _watch = common::watchdog();
    let rules = rule("api", 10, "charge = { statuses = [\"2xx\"] }");
    let body = config("", "http://127.0.0.1:9", &Store::Memory, &rules);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("limits.toml");
    std::fs::write(
        &file,
        format!(
            "[server]\nlisten = \"127.0.0.1:{}\"\n{body}",
            common::free_port()
        ),
    )
    .expect("write the config");
    let out = std::process::Command::new(common::binary())
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .expect("run ratewall check");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "ratewall check must refuse statuses without attempts; it said:\n{said}"
    );
    assert!(
        said.contains("attempts") && (said.contains("rules[0]") || said.contains("\"api\"")),
        "the refusal names the rule and `attempts`:\n{said}"
    );
    match Gateway::try_start(&body) {
        Ok(_) => panic!("the gateway started with statuses and no attempts"),
        Err(logs) => assert!(logs.contains("attempts"), "start: {logs}"),
    }
}

/// Failed attempts (404s, refunded from the rule's bucket) stop at the attempts ceiling:
/// 5 reach the backend, the 6th is 429, the rule's own bucket stays full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_attempts_stop_at_the_attempts_ceiling() {
    let _watch = common::watchdog();
    const B: i64 = 10;
    const ATTEMPTS_BURST: usize = 5;
    let backend = Witness::start().await;
    let rules = rule(
        "api",
        B,
        &format!(
            "charge = {{ statuses = [\"2xx\"], attempts = {{ rate = \"1/h\", burst = {ATTEMPTS_BURST} }} }}"
        ),
    );
    let gw = Gateway::start(&config("", &backend.url(), &Store::Memory, &rules));
    let c = HttpClient::new();
    let mut seen = Vec::new();
    for _ in 0..ATTEMPTS_BURST + 5 {
        let r = get(&c, &gw, "/login?status=404", "guesser").await;
        seen.push((r.status.as_u16(), r_or_none(&r, "api")));
    }
    let hits = backend.heads_of("guesser");
    let want: Vec<(u16, String)> = (0..ATTEMPTS_BURST + 5)
        .map(|i| match i < ATTEMPTS_BURST {
            true => (404, B.to_string()),
            false => (429, "0".to_string()),
        })
        .collect();
    assert!(
        hits == ATTEMPTS_BURST && seen[..ATTEMPTS_BURST] == want[..ATTEMPTS_BURST]
            && seen[ATTEMPTS_BURST..].iter().all(|(s, _)| *s == 429),
        "{} requests answered 404 by the backend: {hits} reached it (at most {ATTEMPTS_BURST} may), \
         (status, r of api) each: {seen:?}",
        ATTEMPTS_BURST + 5
    );
}

/// A WebSocket upgrade answered 101 is always charged, whatever `statuses` lists: with a
/// burst of 3 the 4th socket is 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_answered_101_is_charged() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let rules = rule(
        "api",
        3,
        &format!("charge = {{ statuses = [\"2xx\", \"3xx\"]{ATTEMPTS} }}"),
    );
    let gw = Gateway::start(&config("", &echo.url(), &Store::Memory, &rules));
    let mut sockets = Vec::new();
    let mut heads = Vec::new();
    for i in 0..4 {
        let mut s = send_raw(
            gw.port,
            &ws_handshake(&format!("/socket/{i}"), "X-Api-Key: sockets\r\n"),
        )
        .await;
        let head = s.head().await;
        heads.push(head.lines().next().unwrap_or_default().to_string());
        sockets.push(s);
    }
    assert_eq!(
        heads,
        [
            "HTTP/1.1 101 Switching Protocols",
            "HTTP/1.1 101 Switching Protocols",
            "HTTP/1.1 101 Switching Protocols",
            "HTTP/1.1 429 Too Many Requests"
        ],
        "four WebSocket upgrades against a burst of 3"
    );
}

// ---------------------------------------------------------------------------------------
// 3. The token bill cannot be dodged.

/// The LLM rule of the dodge tests: completion tokens, `max_tokens` reserved.
fn llm_rule(extra: &str) -> String {
    rule(
        "llm",
        TOKENS,
        &format!(
            "cost_from = \"openai_usage\"\nusage = \"completion_tokens\"\nreserve = \"max_tokens\"\n{DEFAULT_RESERVE}{extra}"
        ),
    )
}

/// Every way of hiding `max_tokens` from the gateway reserves the stated max (3000), or
/// `default_reserve` (500) when the body states none the gateway can use. The backend
/// reports no usage, so the reservation is the charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_bill_cannot_be_dodged() {
    let _watch = common::watchdog();
    let backend = Witness::start().await;
    let rules = llm_rule("on_unreadable = \"reserve\"\n");
    let gw = Gateway::start(&config("", &backend.url(), &Store::Memory, &rules));
    const JSON: (&str, &str) = ("content-type", "application/json");
    let stated = br#"{"model":"m","max_tokens":3000,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut bom = "\u{feff}".as_bytes().to_vec();
    bom.extend_from_slice(stated);
    let mut big = br#"{"model":"m","max_tokens":3000,"pad":""#.to_vec();
    big.extend(std::iter::repeat_n(b'x', (1 << 20) + 4096));
    big.extend_from_slice(br#""}"#);
    let with = |v: &str| format!(r#"{{"model":"m","max_tokens":{v},"messages":[]}}"#);
    let (zero, minus, e9, string, half, null) = (
        with("0"),
        with("-1"),
        with("1e9"),
        with("\"500\""),
        with("1.5"),
        with("null"),
    );
    #[rustfmt::skip]
    let dodges: Vec<Case<i64>> = vec![
        ("chunked", vec![JSON], Sent::Chunked(stated), 3000),
        ("text/plain", vec![("content-type", "text/plain")], Sent::Length(stated), 3000),
        ("text/json", vec![("content-type", "text/json")], Sent::Length(stated), 3000),
        ("no content-type", vec![], Sent::Length(stated), 3000),
        ("a BOM first", vec![JSON], Sent::Length(&bom), 3000),
        ("max_tokens twice", vec![JSON], Sent::Length(br#"{"max_tokens":1,"max_tokens":3000}"#), 3000),
        ("max_output_tokens", vec![JSON], Sent::Length(br#"{"model":"m","max_output_tokens":3000}"#), 3000),
        ("max_completion_tokens too", vec![JSON], Sent::Length(br#"{"max_tokens":1,"max_completion_tokens":3000}"#), 3000),
        ("no max_tokens", vec![JSON], Sent::Length(br#"{"model":"m","messages":[]}"#), 500),
        ("max_tokens 0", vec![JSON], Sent::Length(zero.as_bytes()), 500),
        ("max_tokens -1", vec![JSON], Sent::Length(minus.as_bytes()), 500),
        ("max_tokens 1e9", vec![JSON], Sent::Length(e9.as_bytes()), 500),
        ("max_tokens \"500\"", vec![JSON], Sent::Length(string.as_bytes()), 500),
        ("max_tokens 1.5", vec![JSON], Sent::Length(half.as_bytes()), 500),
        ("max_tokens null", vec![JSON], Sent::Length(null.as_bytes()), 500),
        ("no body", vec![], Sent::Nothing, 500),
        ("over 1 MiB", vec![JSON], Sent::Length(&big), 500),
    ];
    let c = HttpClient::new();
    let mut rows = Vec::new();
    let mut wrong = false;
    for (i, (name, fields, body, want)) in dodges.into_iter().enumerate() {
        let key = format!("dodge-{i}");
        let a = raw_exchange(
            gw.port,
            &raw_request("POST", "/v1/chat/completions", &key, &fields, body),
        )
        .await;
        let charged = TOKENS - left(&gw, "llm", &key).await;
        // The next request (reserving 1) sees the same through its `r`.
        let probe = c
            .send(
                "POST",
                &gw.url("/v1/chat/completions"),
                &[("x-api-key", &key), JSON],
                Bytes::from_static(br#"{"max_tokens":1}"#),
            )
            .await;
        let r = r_or_none(&probe, "llm");
        let r_ok = r == (TOKENS - want - 1).to_string();
        wrong |= a.status != 200 || charged != want || !r_ok;
        rows.push(format!(
            "{name:<26} answered {}, charged {charged:>4} (want {want}), the next request's r {r}{}",
            a.status,
            if r_ok { "" } else { " (wrong)" }
        ));
    }
    assert!(!wrong, "each dodge's charge:\n{}", rows.join("\n"));
}

/// `on_unreadable = "reject"`: a body the gateway cannot read for its `max_tokens` is
/// refused (411 none, 413 over 1 MiB, 400 unusable) and never reaches the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_bodies_are_refused_when_the_rule_says_so() {
    let _watch = common::watchdog();
    let backend = Witness::start().await;
    let gw = Gateway::start(&config(
        "",
        &backend.url(),
        &Store::Memory,
        &llm_rule("on_unreadable = \"reject\"\n"),
    ));
    const JSON: (&str, &str) = ("content-type", "application/json");
    let mut big = br#"{"max_tokens":3000,"pad":""#.to_vec();
    big.extend(std::iter::repeat_n(b'x', (1 << 20) + 4096));
    big.extend_from_slice(br#""}"#);
    let cases: Vec<Case<u16>> = vec![
        ("no body", vec![], Sent::Nothing, 411),
        ("over 1 MiB", vec![JSON], Sent::Length(&big), 413),
        (
            "not JSON",
            vec![JSON],
            Sent::Length(b"max_tokens=3000"),
            400,
        ),
    ];
    let mut rows = Vec::new();
    let mut wrong = false;
    for (i, (name, fields, body, want)) in cases.into_iter().enumerate() {
        let key = format!("reject-{i}");
        let a = raw_exchange(
            gw.port,
            &raw_request("POST", "/v1/chat/completions", &key, &fields, body),
        )
        .await;
        let heads = backend.heads_of(&key);
        wrong |= a.status != want || heads != 0;
        rows.push(format!(
            "{name:<10} answered {} (want {want}), heads at the backend {heads} (want 0)",
            a.status
        ));
    }
    assert!(!wrong, "on_unreadable = \"reject\":\n{}", rows.join("\n"));
}

/// `usage = "total_tokens"`: the reservation adds the prompt, estimated at a token per 4
/// bytes of the body (rounded up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn total_tokens_reserve_the_prompt_too() {
    let _watch = common::watchdog();
    let backend = Witness::start().await;
    let rules = rule(
        "llm",
        TOKENS,
        &format!(
            "cost_from = \"openai_usage\"\nusage = \"total_tokens\"\nreserve = \"max_tokens\"\n{DEFAULT_RESERVE}"
        ),
    );
    let gw = Gateway::start(&config("", &backend.url(), &Store::Memory, &rules));
    let head = r#"{"model":"m","max_tokens":3000,"messages":[{"role":"user","content":""#;
    let tail = r#""}]}"#;
    let body = format!("{head}{}{tail}", "w".repeat(1001 - head.len() - tail.len()));
    assert_eq!(body.len(), 1001);
    let r = HttpClient::new()
        .send(
            "POST",
            &gw.url("/v1/chat/completions"),
            &[
                ("x-api-key", "prompt"),
                ("content-type", "application/json"),
            ],
            Bytes::from(body),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let charged = TOKENS - left(&gw, "llm", "prompt").await;
    assert_eq!(
        charged,
        3000 + 251,
        "max_tokens 3000 and a body of 1001 bytes: 3000 + ceil(1001 / 4) reserved"
    );
}

/// A stream whose usage comes 300 ms after its last content event, its client gone right
/// after that event: the gateway reads on (`settle_drain`) and charges the usage (7000),
/// not the reservation (100). A stream cut before any usage keeps its reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usage_after_the_client_left_is_still_charged() {
    let _watch = common::watchdog();
    let backend = LlmBackend::start().await;
    let gw = Gateway::start(&config(
        "",
        &backend.url(),
        &Store::Memory,
        &llm_rule(DRAIN),
    ));
    let ask = br#"{"model":"m","max_tokens":100,"stream":true,"messages":[]}"#;
    let mut outcomes = Vec::new();
    for (key, target, leave_after, want) in [
        (
            "drained",
            "/v1/chat?usage=sse&prompt=10&completion=7000&chunks=3&gap=300",
            "token 2 ",
            TOKENS - 7000,
        ),
        (
            "cut",
            "/v1/chat?usage=sse_none&chunks=3&gap=300",
            "token 0 ",
            TOKENS - 100,
        ),
    ] {
        let mut s = common::connect(gw.port).await;
        let req = raw_request(
            "POST",
            target,
            key,
            &[("content-type", "application/json")],
            Sent::Length(ask),
        );
        s.write_all(&req).await.expect("send");
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let read = async {
            while !String::from_utf8_lossy(&got).contains(leave_after) {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        };
        tokio::time::timeout(WAIT, read)
            .await
            .expect("the stream's events");
        assert!(
            String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"),
            "{key}: {}",
            String::from_utf8_lossy(&got)
        );
        drop(s);
        // The rest of the stream takes 300-600 ms more at the backend.
        let now = left_becomes(&gw, "llm", key, want, Duration::from_secs(4)).await;
        outcomes.push((key, TOKENS - now, TOKENS - want));
    }
    assert!(
        outcomes.iter().all(|(_, got, want)| got == want),
        "(stream, charged, want): {outcomes:?}"
    );
}

/// The attack as a figure: an LLM client that hides its `max_tokens` (in turn: text/plain,
/// a chunked body, a BOM, a string, twice) and leaves each stream before its usage, for
/// 15 s against 1000 tokens a minute (burst 1000). The backend generates 1000 tokens a
/// request; at most a burst and a minute's limit of them may pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_dodgers_get_no_more_than_the_limit() {
    let _watch = common::watchdog();
    const RUN: Duration = Duration::from_secs(15);
    const WORKERS: usize = 6;
    const PER_REQUEST: u64 = 1000;
    let _serial = serial().await;
    let backend = Arc::new(LlmBackend::start().await);
    let rules = format!(
        "[[rules]]\nname = \"llm\"\nkey = \"api_key\"\nrate = \"1000/m\"\nburst = 1000\n\
         cost_from = \"openai_usage\"\nusage = \"completion_tokens\"\nreserve = \"max_tokens\"\n{DEFAULT_RESERVE}{DRAIN}"
    );
    let gw = Gateway::start(&config("", &backend.url(), &Store::Memory, &rules));
    let port = gw.port;
    let started = Instant::now();
    let mut workers = JoinSet::new();
    for w in 0..WORKERS {
        workers.spawn(async move {
            let target = "/v1/chat?usage=sse&prompt=10&completion=1000&chunks=2&gap=100";
            let stated = br#"{"model":"m","max_tokens":1000,"stream":true}"#;
            let mut bom = "\u{feff}".as_bytes().to_vec();
            bom.extend_from_slice(stated);
            let (mut sent, mut denied) = (0u64, 0u64);
            while started.elapsed() < RUN {
                let req = match (sent as usize + w) % 5 {
                    0 => raw_request(
                        "POST",
                        target,
                        "dodger",
                        &[("content-type", "text/plain")],
                        Sent::Length(stated),
                    ),
                    1 => raw_request(
                        "POST",
                        target,
                        "dodger",
                        &[("content-type", "application/json")],
                        Sent::Chunked(stated),
                    ),
                    2 => raw_request(
                        "POST",
                        target,
                        "dodger",
                        &[("content-type", "application/json")],
                        Sent::Length(&bom),
                    ),
                    3 => raw_request(
                        "POST",
                        target,
                        "dodger",
                        &[("content-type", "application/json")],
                        Sent::Length(br#"{"max_tokens":"1000","stream":true}"#),
                    ),
                    _ => raw_request(
                        "POST",
                        target,
                        "dodger",
                        &[("content-type", "application/json")],
                        Sent::Length(br#"{"max_tokens":1,"max_tokens":1000,"stream":true}"#),
                    ),
                };
                let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                    continue;
                };
                let _ = s.set_nodelay(true);
                if s.write_all(&req).await.is_err() {
                    continue;
                }
                sent += 1;
                // Read until the last content event (or a refusal), then leave.
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                let read = async {
                    loop {
                        let text = String::from_utf8_lossy(&got);
                        if text.contains("token 1 ")
                            || (text.starts_with("HTTP/1.1 ") && !text.starts_with("HTTP/1.1 200"))
                        {
                            break;
                        }
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(5), read).await;
                denied += u64::from(got.starts_with(b"HTTP/1.1 429"));
                drop(s);
            }
            (sent, denied)
        });
    }
    let (mut sent, mut denied) = (0, 0);
    while let Some(r) = workers.join_next().await {
        let (s, d) = r.expect("a worker");
        sent += s;
        denied += d;
    }
    let secs = started.elapsed().as_secs_f64();
    let passed = backend.arrived() as u64 * PER_REQUEST;
    // A burst and one minute's limit.
    let most = 1000 + 1000;
    assert!(
        passed <= most,
        "an LLM client dodging for {secs:.1} s against 1000 tokens/m burst 1000: {passed} tokens \
         generated ({:.0}/min; {sent} requests sent, {denied} denied), at most {most} may",
        passed as f64 * 60.0 / secs
    );
}

// ---------------------------------------------------------------------------------------
// 4. Compressed answers are counted.

/// A backend that gzips its JSON answer when the request allows it, and one that gzips
/// always: a client sending `Accept-Encoding: gzip` is charged the usage reported in both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_answers_are_counted() {
    let _watch = common::watchdog();
    let backend = GzipBackend::start().await;
    let rules = rule(
        "llm",
        TOKENS,
        "cost_from = \"openai_usage\"\nusage = \"completion_tokens\"\n",
    );
    let gw = Gateway::start(&config("", &backend.url(), &Store::Memory, &rules));
    let c = HttpClient::new();
    let mut rows = Vec::new();
    let mut wrong = false;
    for (key, path, completion) in [
        ("when-asked", "/accept/chat?prompt=10&completion=4000", 4000),
        ("always", "/always/chat?prompt=10&completion=3000", 3000),
    ] {
        let r = c
            .get(
                &gw.url(path),
                &[("x-api-key", key), ("accept-encoding", "gzip")],
            )
            .await;
        let said = backend.answered(path).await;
        let charged = TOKENS - left(&gw, "llm", key).await;
        wrong |= r.status != StatusCode::OK || charged != completion;
        rows.push(format!(
            "{key:<10} {}: the backend gzipped: {}, the client got content-encoding {:?}; \
             charged {charged} (want {completion})",
            r.status.as_u16(),
            said["gzipped"],
            r.header("content-encoding")
        ));
    }
    assert!(!wrong, "gzipped answers:\n{}", rows.join("\n"));
}

// ---------------------------------------------------------------------------------------
// 5. Cost names never leak.

/// No configured cost field reaches a client, as a field or a trailer, over HTTP/1.1 or
/// h2: where the head already settled (the cost sent as a field and a trailer), where
/// another rule's name settles, where no rule settles at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_names_never_leak() {
    let _watch = common::watchdog();
    const OTHER: &str = "x-tokens-used";
    let backend = Witness::start().await;
    let rules = format!(
        "{}{}",
        rule(
            "api",
            1000,
            &format!("match = {{ path_prefix = \"/settled/\" }}\ncost_header = \"{COST_HEADER}\"")
        ),
        rule(
            "tokens",
            1000,
            &format!("match = {{ path_prefix = \"/other/\" }}\ncost_header = \"{OTHER}\"")
        ),
    );
    let gw = Gateway::start(&config("", &backend.url(), &Store::Memory, &rules));
    let both = format!(
        "hdr={COST_HEADER}:5&hdr={OTHER}:6&trl={COST_HEADER}:5&trl={OTHER}:6&trl=x-other:kept"
    );
    let mut leaks = Vec::new();
    for http in [Http::One, Http::Two] {
        for (key, path) in [
            ("head-settled", format!("/settled/x?{both}")),
            (
                "other-rule",
                format!("/other/x?trl={COST_HEADER}:5&trl={OTHER}:7&trl=x-other:kept"),
            ),
            ("unlimited", format!("/free/x?{both}")),
        ] {
            let s = stream_get(
                gw.port,
                &path,
                &[("x-api-key", key), ("te", "trailers")],
                http,
            )
            .await;
            assert_eq!(s.status, StatusCode::OK, "{http:?} {key}");
            let trailers = s.trailers.clone().unwrap_or_default();
            for name in [COST_HEADER, OTHER] {
                if s.headers.contains_key(name) {
                    leaks.push(format!("{http:?} {key}: field {name}"));
                }
                if trailers.contains_key(name) {
                    leaks.push(format!("{http:?} {key}: trailer {name}"));
                }
                let declared = s.headers.get_all("trailer").iter().any(|v| {
                    v.to_str()
                        .unwrap_or_default()
                        .to_ascii_lowercase()
                        .contains(name)
                });
                if declared {
                    leaks.push(format!("{http:?} {key}: Trailer declares {name}"));
                }
            }
            if http == Http::Two && trailers.get("x-other").is_none() {
                leaks.push(format!(
                    "{http:?} {key}: the other trailer did not pass, so the absence of the cost says nothing: {s:?}"
                ));
            }
        }
    }
    assert!(
        leaks.is_empty(),
        "cost names that reached a client:\n{}",
        leaks.join("\n")
    );
}

/// A client's own `x-ratelimit-cost: 0`, as a request field or a request trailer, never
/// reaches the backend — here one that echoes what it is sent back as fields and
/// trailers of its answer — and never lowers the charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_own_cost_field_is_dropped() {
    let _watch = common::watchdog();
    let backend = Witness::start().await;
    let rules = rule("api", 1000, &format!("cost_header = \"{COST_HEADER}\""));
    let gw = Gateway::start(&config("", &backend.url(), &Store::Memory, &rules));
    let mut rows = Vec::new();
    let mut wrong = false;
    for (key, trailer) in [("as-field", false), ("as-trailer", true)] {
        let target = format!("/echo?reflect=1&key={key}");
        let mut req = format!(
            "POST {target} HTTP/1.1\r\nHost: attacks.test\r\nx-api-key: {key}\r\nConnection: close\r\n"
        );
        if trailer {
            req.push_str(&format!(
                "transfer-encoding: chunked\r\ntrailer: {COST_HEADER}\r\nte: trailers\r\n\r\n5\r\nhello\r\n0\r\n{COST_HEADER}: 0\r\n\r\n"
            ));
        } else {
            req.push_str(&format!(
                "{COST_HEADER}: 0\r\ncontent-length: 5\r\n\r\nhello"
            ));
        }
        let a = raw_exchange(gw.port, req.as_bytes()).await;
        let seen = backend
            .seen()
            .into_iter()
            .find(|w| w.target == target)
            .unwrap_or_else(|| panic!("{key}: the backend never saw it"));
        let charged = 1000 - left(&gw, "api", key).await;
        let reached = seen.carried(COST_HEADER);
        wrong |= a.status != 200 || reached || charged != 1;
        rows.push(format!(
            "{key:<10} answered {}, the backend got the client's {COST_HEADER}: {reached}, charged {charged} (want 1)",
            a.status
        ));
    }
    assert!(!wrong, "a client's own cost field:\n{}", rows.join("\n"));
}

// ---------------------------------------------------------------------------------------
// 6. Settlement before the last byte.

/// On Redis: a trailer's cost is written to the store before the body's last byte goes
/// out. Redis' writes are paused (`CLIENT PAUSE 400 WRITE`) just before the backend's
/// last chunk; the instant the client has the whole body, Redis already holds the cost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trailers_cost_is_in_redis_before_the_last_byte() {
    let _watch = common::watchdog();
    const B: i64 = 100;
    const COST: i64 = 40;
    let redis = RedisServer::start();
    let backend = Arc::new(Witness::start().await);
    let rules = rule("api", B, &format!("cost_header = \"{COST_HEADER}\""));
    let gw = Gateway::start(&config(
        "",
        &backend.url(),
        &Store::redis_roomy(&redis),
        &rules,
    ));
    let port = gw.port;
    let last = {
        let backend = backend.clone();
        tokio::spawn(async move { backend.before_last().await })
    };
    let client = tokio::spawn(async move {
        let s = stream_get(
            port,
            &format!("/t?trl={COST_HEADER}:{COST}&gate=last"),
            &[("x-api-key", "trailer"), ("te", "trailers")],
            Http::One,
        )
        .await;
        (s, Instant::now())
    });
    tokio::time::timeout(WAIT, last)
        .await
        .expect("the backend reached its last chunk")
        .expect("the backend's signal");
    let mut conn = redis.conn();
    let paused = Instant::now();
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(400)
        .arg("WRITE")
        .query(&mut conn)
        .expect("CLIENT PAUSE 400 WRITE");
    backend.open();
    let (s, done) = client.await.expect("the client");
    let value = common::get(&mut conn, &redis_key("trailer", "api"));
    let after = done.duration_since(paused);
    assert_eq!(s.status, StatusCode::OK);
    let tokens = value.as_deref().and_then(|v| {
        let f: Vec<&str> = v.strip_prefix("t:")?.split(':').collect();
        let (level, unit): (f64, f64) = (f[0].parse().ok()?, f[2].parse().ok()?);
        Some((level / unit).floor() as i64)
    });
    assert_eq!(
        tokens,
        Some(B - COST),
        "Redis held {value:?} the instant the client had the whole body ({after:?} after \
         Redis' writes were paused for 400 ms): the trailer's cost {COST} must be in it"
    );
}

// ---------------------------------------------------------------------------------------
// 7. No remembered denial with settling rules.

/// On Redis, a rule that refunds by status: two slow requests take the bucket (burst 2),
/// a third is denied, the two are answered 500 and refunded: the very next request passes
/// (a remembered denial would answer it 429).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_remembered_denial_outlives_a_refund_on_redis() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let backend = Witness::start().await;
    let rules = rule(
        "api",
        2,
        &format!("charge = {{ statuses = [\"2xx\"]{ATTEMPTS} }}"),
    );
    let gw = Arc::new(Gateway::start(&config(
        "",
        &backend.url(),
        &Store::redis_roomy(&redis),
        &rules,
    )));
    let c = HttpClient::new();
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let (c, gw) = (c.clone(), gw.clone());
            tokio::spawn(async move { get(&c, &gw, "/x?hold=gate&status=500", "k").await.status })
        })
        .collect();
    assert!(backend.wait_heads_of("k", 2, WAIT).await);
    let third = get(&c, &gw, "/x", "k").await;
    assert_eq!(third.status.as_u16(), 429, "the bucket is taken");
    backend.open();
    for s in slow {
        assert_eq!(s.await.expect("slow").as_u16(), 500);
    }
    let next = get(&c, &gw, "/x", "k").await;
    assert_eq!(
        (next.status.as_u16(), r_or_none(&next, "api")),
        (200, "1".to_string()),
        "after both were refunded, the next request passes"
    );
}
