//! WebSocket and other upgrades, end to end: the real `ratewall` binary between a real
//! WebSocket client and echo backend (Python's `websockets`, [`common::WsClient`] and
//! [`common::EchoServer`]), raw sockets for what no library sends, a raw upgrade backend
//! for protocols other than WebSocket, and hyper's HTTP/2 client for RFC 8441.
//!
//! What is pinned (docs/configuration.md, "WebSocket and upgrades", "WebSocket messages"):
//! - frames pass unchanged: text, binary, a 1 MiB message in 64 KiB fragments, ping and
//!   pong, permessage-deflate, a subprotocol; the closing handshake, started by either
//!   side, carries its code and reason to the other; an upgrade goes HTTP/1.1 to a pool
//!   that speaks h2c;
//! - an upgrade passes the rules once: past a rule's burst the upgrade is a 429 before any
//!   `101` (over HTTP/2 too); `max_in_flight` bounds the open sockets of a key, WebSocket
//!   over HTTP/2 included (a 429 with `Retry-After: 1`), until one closes; a declined
//!   upgrade, and one with a body, are ordinary requests;
//! - `messages = { rate, burst }` with `max_delay`: a flooding client is held back (fewer
//!   frames reach the backend than it sent) and closed with 1008 to both ends, while a
//!   polite client of the same rule under another key is untouched; one key's sockets
//!   share one bucket; control frames are never counted; a store outage under
//!   `on_error = "deny"` is a 1011 to both ends;
//! - `upgrade_idle_timeout` closes an idle socket with 1001 to both ends; an active one
//!   lives on;
//! - SIGTERM: open sockets keep working for `shutdown_grace`, then get 1001, both ends;
//! - an upgrade that is not WebSocket tunnels raw bytes both ways (the backend's bytes
//!   right behind its 101 first) and ends as soon as either side closes;
//! - attackers: `h2c` never reaches the backend; an unmasked client frame is a 1002 to
//!   both ends; a `101` to a protocol the client did not offer is a 502;
//! - HTTP/2 extended CONNECT on the cleartext listener: `200`, then frames both ways to an
//!   HTTP/1.1 WebSocket backend; idle and shutdown close its stream with 1001 too;
//! - `ratewall_upgraded_connections`, `ratewall_upgraded_bytes_total` (to the byte) and
//!   `ratewall_upgraded_closed_total{reason}`; the access line's `upgrade`; data after a
//!   close, `max_bytes` and `bytes`: [`past_limits`].
//!
//! Tests whose bounds are timed (message rates, the idle clock, the shutdown grace) hold
//! [`common::serial`].

use crate::common;
mod past_limits;

use std::time::{Duration, Instant};

use common::{
    close_payload, frame, h2_websocket, send_raw, serial, ws_handshake, Answer, EchoServer,
    Gateway, RawBackend, Reader, WsClient, BINARY, CLOSE, GREETING, SAMPLE_ACCEPT, TEXT,
};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

/// The longest a test waits for any one thing to happen.
const WAIT: Duration = Duration::from_secs(10);

/// The masking key of the frames written here by hand.
const MASK: Option<[u8; 4]> = Some([0x37, 0xfa, 0x21, 0x3d]);

// ---------------------------------------------------------------------------------------
// Config and helpers

/// `[upstream]` on `url` and the memory store, after `rules` (whose first lines may still
/// be `[server]` keys).
fn config(url: &str, rules: &str) -> String {
    format!(
        "{rules}\n[upstream]\nurl = \"{url}\"\nconnect_timeout = \"2s\"\ntimeout = \"10s\"\n\
         [store]\nbackend = \"memory\"\n"
    )
}

fn ws_url(gw: &Gateway, path: &str) -> String {
    format!("ws://127.0.0.1:{}{path}", gw.port)
}

/// Poll `metric` (the sum of its series with `labels`) until it is `want`, at most
/// [`WAIT`]: its last value.
async fn until_metric(gw: &Gateway, metric: &str, labels: &[(&str, &str)], want: f64) -> f64 {
    let end = Instant::now() + WAIT;
    loop {
        let v = common::metric(gw, metric, labels).await;
        if v == want || Instant::now() >= end {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `ratewall_upgraded_closed_total{reason}`, once it reaches `want`.
async fn closed_for(gw: &Gateway, reason: &str, want: f64) -> f64 {
    until_metric(
        gw,
        "ratewall_upgraded_closed_total",
        &[("reason", reason)],
        want,
    )
    .await
}

/// The access lines that contain `needle`, once there is one (at most [`WAIT`]).
async fn access_lines(gw: &Gateway, needle: &str) -> Vec<String> {
    let end = Instant::now() + WAIT;
    loop {
        let lines: Vec<String> = gw
            .logs()
            .lines()
            .filter(|l| l.contains("ratewall::access") && l.contains(needle))
            .map(str::to_string)
            .collect();
        if !lines.is_empty() || Instant::now() >= end {
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The status of an HTTP/1 head.
fn status(head: &str) -> u16 {
    common::status_of(head.as_bytes())
}

fn number(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

// ---------------------------------------------------------------------------------------
// 1. Echo

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_binary_a_fragmented_mebibyte_and_pings_pass_unchanged() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let gw = Gateway::start(&config(&echo.url(), ""));
    let mut c = WsClient::open(&ws_url(&gw, "/echo"), &[]).await;
    c.echo("héllo, wörld ✓").await;

    let sent = c
        .call(json!({ "send_binary": 4096, "seed": 1 }), WAIT)
        .await;
    assert_eq!(sent["sent"], true, "{sent}");
    let back = c.recv(WAIT).await;
    assert_eq!(back, json!({ "binary": 4096, "sha256": sent["sha256"] }));

    // One message of 1 MiB in sixteen 64 KiB fragments: the backend gets it whole (and
    // echoes it as one frame, which comes back whole too).
    let sent = c
        .call(
            json!({ "send_fragments": 1 << 20, "fragment": 64 << 10, "seed": 2 }),
            WAIT,
        )
        .await;
    assert_eq!(sent["sent"], true, "{sent}");
    let back = c.recv(WAIT).await;
    assert_eq!(back, json!({ "binary": 1 << 20, "sha256": sent["sha256"] }));

    // A ping is answered (by the backend, through the gateway), and the socket goes on.
    let pong = c.call(json!({ "ping": "are you there" }), WAIT).await;
    assert_eq!(pong, json!({ "pong": true }));
    c.echo("after the ping").await;

    // permessage-deflate and a subprotocol are negotiated end to end (the handshake's
    // fields pass both ways), and compressed frames (RSV1 set) pass too.
    let flags = [
        "--deflate",
        "--subprotocol",
        "chat.v1",
        "--subprotocol",
        "chat.v2",
    ];
    let mut deflated = WsClient::try_open(&ws_url(&gw, "/deflate"), &[], &flags)
        .await
        .unwrap_or_else(|refused| panic!("did not open: {refused}"));
    let extension = deflated.hello["extensions"][0].as_str().unwrap_or_default();
    assert!(
        extension.starts_with("permessage-deflate"),
        "{}",
        deflated.hello
    );
    assert_eq!(deflated.hello["subprotocol"], "chat.v2");
    assert!(c.hello["subprotocol"].is_null() && c.hello["extensions"] == json!([]));
    deflated.echo(&"compressible ".repeat(200)).await;

    let opened = echo.opened(2).await;
    assert_eq!(opened.len(), 2, "{opened:?}");
    assert!(opened.iter().all(|o| o["key"] == true), "{opened:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_closing_handshake_carries_its_code_and_reason_whichever_side_starts_it() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let gw = Gateway::start(&config(&echo.url(), ""));

    // The client starts it: the backend gets its code and reason, and answers with them.
    let mut c = WsClient::open(&ws_url(&gw, "/by-client"), &[]).await;
    c.echo("one").await;
    let closed = c.close(4001, "client done").await;
    assert_eq!(
        closed,
        json!({ "code": 4001, "reason": "client done", "sent_code": 4001 })
    );
    let seen = echo.wait_closed("/by-client").await;
    assert_eq!(
        (&seen["code"], &seen["reason"]),
        (&json!(4001), &json!("client done"))
    );
    assert_eq!(seen["received"], 1);

    // The backend starts it (after echoing the first message): the client gets its
    // code and reason.
    let path = "/close/4002/server%20done";
    let mut s = WsClient::open(&ws_url(&gw, path), &[]).await;
    s.echo("last words").await;
    let end = s.wait_closed(WAIT).await;
    assert_eq!(
        end["closed"],
        json!({ "code": 4002, "reason": "server done", "sent_code": 4002 }),
        "{end}"
    );
    let seen = echo.wait_closed(path).await;
    assert_eq!(
        seen["code"], 4002,
        "the client's answer reached the backend: {seen}"
    );
}

// ---------------------------------------------------------------------------------------
// 2-3. Upgrades pass the rules

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_past_the_burst_is_a_429_before_any_101() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let rule = "[[rules]]\nname = \"sockets\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 2\n";
    let gw = Gateway::start(&config(&echo.url(), rule));
    let k1 = [("x-api-key", "k1")];
    let mut a = WsClient::open(&ws_url(&gw, "/a"), &k1).await;
    let mut b = WsClient::open(&ws_url(&gw, "/b"), &k1).await;

    let mut third = send_raw(gw.port, &ws_handshake("/c", "X-Api-Key: k1\r\n")).await;
    let head = third.head().await;
    assert_eq!(status(&head), 429, "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("\r\nretry-after: "), "{head}");
    // The 429 is the first thing that came: no 101 before it.
    assert!(!lower.contains("sec-websocket-accept"), "{head}");

    // Over HTTP/2 too: the extended CONNECT is refused with the 429.
    let (h2_status, h2_headers) = h2_websocket(gw.port, "/c2", &k1)
        .await
        .err()
        .expect("refused");
    assert_eq!(h2_status, http::StatusCode::TOO_MANY_REQUESTS);
    assert!(h2_headers.contains_key("retry-after"), "{h2_headers:?}");

    // Counted per key: another key opens, and the two open sockets still work.
    let mut other = WsClient::open(&ws_url(&gw, "/other"), &[("x-api-key", "k2")]).await;
    other.echo("k2").await;
    a.echo("a").await;
    b.echo("b").await;
    let paths: Vec<Value> = echo
        .opened(3)
        .await
        .iter()
        .map(|o| o["opened"].clone())
        .collect();
    assert_eq!(
        paths.len(),
        3,
        "the denied upgrade never reached the backend: {paths:?}"
    );
    assert!(
        !paths.contains(&json!("/c")) && !paths.contains(&json!("/c2")),
        "{paths:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_bounds_the_open_sockets_of_a_key_until_one_closes() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let rule = "[[rules]]\nname = \"sockets\"\nkey = \"api_key\"\nmax_in_flight = 2\n";
    let gw = Gateway::start(&config(&echo.url(), rule));
    let key = [("x-api-key", "k1")];
    let mut a = WsClient::open(&ws_url(&gw, "/a"), &key).await;
    let mut b = WsClient::open(&ws_url(&gw, "/b"), &key).await;
    a.echo("a").await;

    // The docs: a concurrency denial is a 429 with `Retry-After: 1`, at once.
    let denied = || async {
        let mut r = send_raw(gw.port, &ws_handshake("/denied", "X-Api-Key: k1\r\n")).await;
        r.head().await
    };
    let head = denied().await;
    assert_eq!(status(&head), 429, "{head}");
    assert!(
        head.to_ascii_lowercase().contains("\r\nretry-after: 1\r\n"),
        "{head}"
    );
    let open = "ratewall_upgraded_connections";
    assert_eq!(until_metric(&gw, open, &[], 2.0).await, 2.0);

    // One closes: its slot is given back as its tunnel ends, and a new socket opens.
    let closed = a.close(1000, "done").await;
    assert_eq!(closed["code"], 1000, "{closed}");
    assert_eq!(until_metric(&gw, open, &[], 1.0).await, 1.0);
    let mut c = WsClient::open(&ws_url(&gw, "/c"), &key).await;
    c.echo("c").await;
    b.echo("b").await;
    // Two open again: the bound holds.
    let head = denied().await;
    assert_eq!(status(&head), 429, "{head}");

    // A WebSocket over HTTP/2 holds a slot the same way.
    let closed = b.close(1000, "done").await;
    assert_eq!(closed["code"], 1000, "{closed}");
    assert_eq!(until_metric(&gw, open, &[], 1.0).await, 1.0);
    let mut h2 = h2_websocket(gw.port, "/h2", &key).await.expect("a 200");
    h2.stream
        .io
        .write_all(&frame(TEXT, b"h2", MASK))
        .await
        .expect("send");
    assert_eq!(h2.stream.frame().await.expect("the echo").payload, b"h2");
    let head = denied().await;
    assert_eq!(status(&head), 429, "{head}");
    let paths: Vec<Value> = echo
        .opened(4)
        .await
        .iter()
        .map(|o| o["opened"].clone())
        .collect();
    assert_eq!(
        paths,
        vec![json!("/a"), json!("/b"), json!("/c"), json!("/h2")]
    );
}

// ---------------------------------------------------------------------------------------
// 4. Message limits

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_client_is_held_back_then_closed_1008_and_a_polite_one_is_untouched() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let echo = EchoServer::start().await;
    // The README's shape: the sockets a key may hold open, and the rate rule that carries
    // the message limit and the `max_delay` it may be held back for.
    let rules = "[[rules]]\nname = \"chat-sockets\"\nkey = \"api_key\"\nmax_in_flight = 4\n\
                 [[rules]]\nname = \"chat\"\nkey = \"api_key\"\nrate = \"60/m\"\n\
                 messages = { rate = \"50/s\", burst = 100 }\nmax_delay = \"1s\"\n";
    let gw = Gateway::start(&config(&echo.url(), rules));
    let mut flood = WsClient::open(&ws_url(&gw, "/flood"), &[("x-api-key", "flood")]).await;
    let mut polite = WsClient::open(&ws_url(&gw, "/polite"), &[("x-api-key", "polite")]).await;

    let (f, p) = tokio::join!(flood.pace(500, 4.0), polite.pace(10, 3.0));

    // The flood: 100 frames at once, then 50 a second, and behind for longer than
    // `max_delay`: closed with 1008 and the reason, long before its 4 s were up.
    assert_eq!(
        (&f["closed"]["code"], &f["closed"]["reason"]),
        (&json!(1008), &json!("message rate limit exceeded")),
        "{f}"
    );
    let (sent, elapsed_ms) = (number(&f["sent"]), number(&f["elapsed_ms"]));
    assert!(elapsed_ms < 3_500, "closed only after {elapsed_ms} ms: {f}");
    let seen = echo.wait_closed("/flood").await;
    assert_eq!(
        (&seen["code"], &seen["reason"]),
        (&json!(1008), &json!("message rate limit exceeded")),
        "the backend is told too: {seen}"
    );
    let received = number(&seen["received"]);
    assert!(received >= 100, "the burst passes: {received} of {sent}");
    assert!(
        received < sent,
        "held back: {received} of {sent} reached the backend"
    );
    // At most the burst, the rate for as long as the socket was open (a second more for
    // the open and the close), and one batch of 5.
    let most = 100 + 50 * (elapsed_ms + 1_000) / 1_000 + 5;
    assert!(
        received <= most,
        "{received} frames passed, at most {most} may"
    );
    assert!(number(&f["echoed"]) <= received, "{f}");

    // The polite client (another key, 10 a second) was never held back nor closed.
    assert!(p["closed"].is_null(), "{p}");
    let polite_sent = number(&p["sent"]);
    assert!(polite_sent >= 20, "{p}");
    assert_eq!(p["echoed"], polite_sent, "{p}");
    polite.echo("still here").await;
    assert_eq!(polite.close(1000, "bye").await["code"], 1000);
    let seen = echo.wait_closed("/polite").await;
    assert_eq!(seen["code"], 1000, "{seen}");
    assert_eq!(number(&seen["received"]), polite_sent + 1);

    assert_eq!(closed_for(&gw, "message_limit", 1.0).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_frames_are_never_counted_against_messages() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let rule = "[[rules]]\nname = \"chat\"\nkey = \"client_ip\"\nrate = \"60/m\"\n\
                messages = { rate = \"1/m\", burst = 2 }\n";
    let gw = Gateway::start(&config(&echo.url(), rule));
    let mut c = WsClient::open(&ws_url(&gw, "/pings"), &[]).await;
    // Far more pings than the 2 data frames the bucket holds: every one is answered.
    for n in 0..20 {
        let pong = c.call(json!({ "ping": format!("ping {n}") }), WAIT).await;
        assert_eq!(pong, json!({ "pong": true }), "ping {n}");
    }
    // The bucket is still whole: its two data frames pass.
    c.echo("one").await;
    c.echo("two").await;
    // And that was all of it: no `max_delay`, so the third closes the socket at once.
    assert_eq!(c.send("three").await["sent"], true);
    let end = c.wait_closed(WAIT).await;
    assert_eq!(end["closed"]["code"], 1008, "{end}");
    assert_eq!(echo.wait_closed("/pings").await["received"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sockets_of_one_key_share_one_message_bucket() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    // A batch of 1 (a tenth of a second of 1/m, at least 1): no socket holds tokens
    // another could use.
    let rule = "[[rules]]\nname = \"chat\"\nkey = \"api_key\"\nrate = \"60/m\"\n\
                messages = { rate = \"1/m\", burst = 3 }\n";
    let gw = Gateway::start(&config(&echo.url(), rule));
    let k1 = [("x-api-key", "k1")];
    let mut a = WsClient::open(&ws_url(&gw, "/a"), &k1).await;
    let mut b = WsClient::open(&ws_url(&gw, "/b"), &k1).await;
    let mut other = WsClient::open(&ws_url(&gw, "/other"), &[("x-api-key", "k2")]).await;
    a.echo("a1").await;
    a.echo("a2").await;
    b.echo("b1").await;
    // The key's 3 frames are spent, whichever socket spent them.
    assert_eq!(b.send("b2").await["sent"], true);
    let end = b.wait_closed(WAIT).await;
    assert_eq!(end["closed"]["code"], 1008, "{end}");
    // Another key has a bucket of its own.
    for n in 0..3 {
        other.echo(&format!("other {n}")).await;
    }
    assert_eq!(echo.wait_closed("/b").await["received"], 1);
}

// ---------------------------------------------------------------------------------------
// 5-6. The clocks: idle, shutdown

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_socket_is_closed_1001_after_upgrade_idle_timeout_and_an_active_one_lives() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let echo = EchoServer::start().await;
    let gw = Gateway::start(&config(&echo.url(), "upgrade_idle_timeout = \"2s\"\n"));
    let before = Instant::now();
    let mut idle = WsClient::open(&ws_url(&gw, "/idle"), &[]).await;
    let mut active = WsClient::open(&ws_url(&gw, "/active"), &[]).await;

    // The active socket sends 5 frames a second for 5 s, more than twice the timeout.
    let waiting = before.elapsed();
    let (i, a) = tokio::join!(idle.wait_closed(WAIT), active.pace(5, 5.0));

    // The docs: a WebSocket idle for the timeout gets a close frame 1001, both ends.
    assert_eq!(
        i["closed"],
        json!({ "code": 1001, "reason": "idle for upgrade_idle_timeout", "sent_code": 1001 }),
        "{i}"
    );
    // Not before its 2 s of silence (counted from before it opened); by that clock, as its
    // reason says and the count below (no upper bound in time: within WAIT it closed).
    let after = Duration::from_millis(number(&i["after_ms"]));
    assert!(
        waiting + after >= Duration::from_millis(1_800),
        "closed {:?} after it opened, with a 2 s timeout",
        waiting + after
    );
    let seen = echo.wait_closed("/idle").await;
    assert_eq!(seen["code"], 1001, "{seen}");

    assert!(a["closed"].is_null(), "{a}");
    assert!(number(&a["sent"]) >= 10, "{a}");
    assert_eq!(a["echoed"], a["sent"], "{a}");
    active.echo("still here").await;
    assert_eq!(closed_for(&gw, "idle_timeout", 1.0).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sigterm_sockets_work_through_the_grace_then_get_1001_at_both_ends() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let echo = EchoServer::start().await;
    let mut gw = Gateway::try_start_with_grace(&config(&echo.url(), ""), "3s")
        .expect("ratewall did not start");
    let mut c = WsClient::open(&ws_url(&gw, "/term"), &[]).await;
    c.echo("before").await;

    let term = Instant::now();
    gw.signal("TERM");
    // The grace is the socket's: messages go both ways for a while yet.
    let during = c.pace(4, 1.5).await;
    assert!(during["closed"].is_null(), "{during}");
    assert!(number(&during["sent"]) >= 3, "{during}");
    assert_eq!(during["echoed"], during["sent"], "{during}");

    let end = c.wait_closed(WAIT).await;
    let at = term.elapsed();
    assert_eq!(
        end["closed"],
        json!({ "code": 1001, "reason": "the gateway is shutting down", "sent_code": 1001 }),
        "{end}"
    );
    // Not before the grace ran out; closed by it, as its reason says (within WAIT).
    assert!(
        at >= Duration::from_millis(2_500),
        "closed {at:?} after SIGTERM, with a 3 s grace"
    );
    let seen = echo.wait_closed("/term").await;
    assert_eq!(
        (&seen["code"], &seen["reason"]),
        (&json!(1001), &json!("the gateway is shutting down")),
        "{seen}"
    );
    let exit = tokio::task::block_in_place(|| gw.wait_exit(WAIT));
    assert!(
        exit.is_some_and(|s| s.success()),
        "exit: {exit:?}\n{}",
        gw.logs()
    );
}

// ---------------------------------------------------------------------------------------
// 7. Other upgrades

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_upgrade_tunnels_raw_bytes_and_ends_when_either_side_closes() {
    let _watch = common::watchdog();
    let backend = RawBackend::start(Answer::Switch("foo")).await;
    let gw = Gateway::start(&config(&backend.url(), ""));
    let upgrade =
        b"GET /raw HTTP/1.1\r\nHost: raw.test\r\nConnection: Upgrade\r\nUpgrade: foo\r\n\r\n";

    // The backend closes: the client sees the end at once.
    let stream = common::connect(gw.port).await;
    let (read, mut write) = tokio::io::split(stream);
    let mut r = Reader::new(read);
    write.write_all(upgrade).await.expect("send");
    let head = r.head().await;
    assert_eq!(status(&head), 101, "{head}");
    assert!(
        head.to_ascii_lowercase().contains("\r\nupgrade: foo\r\n"),
        "{head}"
    );
    // What the backend sent right behind its 101 comes first.
    assert_eq!(r.bytes(GREETING.len()).await, GREETING);
    // Bytes both ways, more than a buffer's worth, written while they come back.
    let blob: Vec<u8> = (0..256 << 10).map(|i: u32| (i % 251) as u8).collect();
    let (sent, back) = tokio::join!(write.write_all(&blob), r.bytes(blob.len()));
    sent.expect("send the blob");
    assert!(
        back == blob,
        "{} of {} bytes came back unchanged",
        back.len(),
        blob.len()
    );
    write.write_all(b"close\n").await.expect("send");
    assert_eq!(r.bytes(6).await, b"close\n");
    let (rest, ended) = r.until_end().await;
    assert!(rest.is_empty(), "{rest:?}");
    // At once: within WAIT, where no clock of the tunnel (upgrade_idle_timeout: 1 h)
    // could have ended it; counted as upstream_closed below.
    let _ended = ended.expect("the tunnel ends when the backend closes");

    // The client closes (its write side): the backend sees the end at once, and the
    // tunnel ends.
    let stream = common::connect(gw.port).await;
    let (read, mut write) = tokio::io::split(stream);
    let mut r = Reader::new(read);
    write.write_all(upgrade).await.expect("send");
    assert_eq!(status(&r.head().await), 101);
    assert_eq!(r.bytes(GREETING.len()).await, GREETING);
    write.write_all(b"hello\n").await.expect("send");
    assert_eq!(r.bytes(6).await, b"hello\n");
    write.shutdown().await.expect("half-close");
    assert!(backend.wait_ends(1, WAIT).await, "the backend saw no end");
    let (_, ended) = r.until_end().await;
    assert!(ended.is_some(), "the tunnel did not end within {WAIT:?}");

    assert_eq!(closed_for(&gw, "upstream_closed", 1.0).await, 1.0);
    assert_eq!(closed_for(&gw, "client_closed", 1.0).await, 1.0);
    let lines = access_lines(&gw, "path=/raw ").await;
    assert_eq!(lines.len(), 2, "{}", gw.logs());
    assert!(
        lines
            .iter()
            .all(|l| l.contains("status=101") && l.contains("upgrade=\"other\"")),
        "{lines:#?}"
    );
}

// ---------------------------------------------------------------------------------------
// 8. Attackers

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_is_never_asked_of_the_backend() {
    let _watch = common::watchdog();
    // Offered alone: an ordinary request, without its upgrade fields.
    let plain = RawBackend::start(Answer::Ok).await;
    let gw = Gateway::start(&config(&plain.url(), ""));
    let h2c =
        b"GET /plain HTTP/1.1\r\nHost: smuggle.test\r\nConnection: Upgrade, HTTP2-Settings\r\n\
                Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n";
    let mut r = send_raw(gw.port, h2c).await;
    let head = r.head().await;
    assert_eq!(status(&head), 200, "{head}");
    let heads = plain.heads();
    assert_eq!(heads.len(), 1, "{heads:?}");
    for word in ["upgrade", "h2c", "http2-settings"] {
        assert!(
            !heads[0].contains(word),
            "{word} reached the backend: {}",
            heads[0]
        );
    }
    drop(gw);

    // Offered beside another protocol: only the other one goes up.
    let foo = RawBackend::start(Answer::Switch("foo")).await;
    let gw = Gateway::start(&config(&foo.url(), ""));
    let mixed = b"GET /mixed HTTP/1.1\r\nHost: smuggle.test\r\nConnection: Upgrade\r\nUpgrade: h2c, foo\r\n\r\n";
    let mut r = send_raw(gw.port, mixed).await;
    let head = r.head().await;
    assert_eq!(status(&head), 101, "{head}");
    let heads = foo.heads();
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(heads[0].contains("\r\nupgrade: foo\r\n"), "{}", heads[0]);
    assert!(!heads[0].contains("h2c"), "{}", heads[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmasked_client_frame_is_closed_1002_at_both_ends() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let gw = Gateway::start(&config(&echo.url(), ""));
    let mut r = send_raw(gw.port, &ws_handshake("/unmasked", "")).await;
    let head = r.head().await;
    assert_eq!(status(&head), 101, "{head}");
    assert!(head.contains(SAMPLE_ACCEPT), "{head}");
    // A masked frame first, which passes; then an unmasked one (RFC 6455 §5.1).
    r.io.write_all(&frame(TEXT, b"masked", MASK))
        .await
        .expect("send");
    let back = r.frame().await.expect("the echo");
    assert_eq!(
        (back.opcode, back.payload.as_slice()),
        (TEXT, &b"masked"[..])
    );
    r.io.write_all(&frame(TEXT, b"unmasked", None))
        .await
        .expect("send");

    let close = r.frame().await.expect("a close frame");
    assert_eq!(
        close.close(),
        Some((1002, "WebSocket protocol error".to_string())),
        "{close:?}"
    );
    assert!(!close.masked, "a server's frame is never masked");
    let (rest, ended) = r.until_end().await;
    assert!(ended.is_some(), "the socket ends after its close frame");
    assert!(rest.is_empty(), "nothing after the close frame: {rest:?}");
    let seen = echo.wait_closed("/unmasked").await;
    assert_eq!(seen["code"], 1002, "{seen}");
    assert_eq!(
        seen["received"], 1,
        "the unmasked frame never reached the backend: {seen}"
    );
    assert_eq!(closed_for(&gw, "protocol_error", 1.0).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_upgrade_and_one_with_a_body_are_ordinary_requests() {
    let _watch = common::watchdog();
    let backend = RawBackend::start(Answer::Ok).await;
    let gw = Gateway::start(&config(&backend.url(), ""));

    // The backend declines (a 200): that is the client's answer, body and all.
    let mut r = send_raw(gw.port, &ws_handshake("/declined", "")).await;
    let head = r.head().await;
    assert_eq!(status(&head), 200, "{head}");
    assert_eq!(r.bytes(2).await, b"ok");
    assert!(backend.heads()[0].contains("\r\nupgrade: websocket\r\n"));

    // With a body it is no upgrade (the body is not the new protocol's first bytes): it
    // goes up without its upgrade fields.
    let mut r = send_raw(
        gw.port,
        &[
            ws_handshake("/body", "Content-Length: 5\r\n"),
            b"hello".to_vec(),
        ]
        .concat(),
    )
    .await;
    let head = r.head().await;
    assert_eq!(status(&head), 200, "{head}");
    let heads = backend.heads();
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(heads[1].starts_with("get /body "), "{}", heads[1]);
    assert!(!heads[1].contains("upgrade"), "{}", heads[1]);

    assert_eq!(
        common::metric(&gw, "ratewall_upgraded_connections", &[]).await,
        0.0
    );
    assert_eq!(
        common::metric(&gw, "ratewall_upgraded_bytes_total", &[]).await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_101_to_a_protocol_the_client_did_not_offer_is_a_502() {
    let _watch = common::watchdog();
    let backend = RawBackend::start(Answer::Switch("bar")).await;
    let gw = Gateway::start(&config(&backend.url(), ""));
    let foo = b"GET /foo HTTP/1.1\r\nHost: raw.test\r\nConnection: Upgrade\r\nUpgrade: foo\r\n\r\n";
    for request in [&foo[..], &ws_handshake("/ws", "")[..]] {
        let mut r = send_raw(gw.port, request).await;
        let head = r.head().await;
        assert_eq!(status(&head), 502, "{head}");
    }
    assert_eq!(backend.heads().len(), 2);
    assert_eq!(
        common::metric(&gw, "ratewall_upgraded_connections", &[]).await,
        0.0
    );
}

// ---------------------------------------------------------------------------------------
// 9. HTTP/2 extended CONNECT (RFC 8441)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_extended_connect_is_a_websocket_to_an_http1_backend() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let gw = Gateway::start(&config(&echo.url(), ""));
    // Cleartext HTTP/2 with prior knowledge, on the gateway's one listener.
    let mut socket = h2_websocket(gw.port, "/h2chat", &[]).await.expect("a 200");
    assert_eq!(socket.status, http::StatusCode::OK, "{:?}", socket.headers);
    assert!(
        socket.headers.get("sec-websocket-accept").is_none(),
        "{:?}",
        socket.headers
    );
    let r = &mut socket.stream;

    r.io.write_all(&frame(TEXT, b"over h2", MASK))
        .await
        .expect("send");
    let back = r.frame().await.expect("the echo");
    assert_eq!(
        (back.opcode, back.payload.as_slice()),
        (TEXT, &b"over h2"[..])
    );
    // More than one DATA frame's worth.
    let blob: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    r.io.write_all(&frame(BINARY, &blob, MASK))
        .await
        .expect("send");
    let back = r.frame().await.expect("the echo");
    assert!(
        back.opcode == BINARY && back.payload == blob,
        "{} bytes back",
        back.payload.len()
    );
    assert_eq!(
        common::metric(&gw, "ratewall_upgraded_connections", &[]).await,
        1.0
    );

    r.io.write_all(&frame(CLOSE, &close_payload(1000, "bye"), MASK))
        .await
        .expect("send");
    let close = r.frame().await.expect("the close answer");
    assert_eq!(close.close(), Some((1000, "bye".to_string())));
    let (_, ended) = r.until_end().await;
    assert!(ended.is_some(), "the stream ends with the socket");
    let seen = echo.wait_closed("/h2chat").await;
    assert_eq!(
        (&seen["code"], &seen["reason"]),
        (&json!(1000), &json!("bye"))
    );
    assert_eq!(seen["received"], 2);
    // The backend got an HTTP/1.1 handshake with a key of the gateway's.
    assert_eq!(
        echo.opened(1).await,
        vec![json!({ "opened": "/h2chat", "key": true })]
    );
    let lines = access_lines(&gw, "path=/h2chat ").await;
    assert!(
        lines.len() == 1
            && lines[0].contains("upgrade=\"websocket\"")
            && lines[0].contains("status=200"),
        "{lines:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_socket_is_closed_1001_when_idle_and_when_the_grace_runs_out() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let echo = EchoServer::start().await;
    let body = config(&echo.url(), "upgrade_idle_timeout = \"3s\"\n");
    let mut gw = Gateway::try_start_with_grace(&body, "1s").expect("ratewall did not start");

    // Idle: a close frame 1001 on the stream, and to the backend.
    let before = Instant::now();
    let mut idle = h2_websocket(gw.port, "/h2idle", &[]).await.expect("a 200");
    assert_eq!(idle.status, http::StatusCode::OK);
    let close = idle.stream.frame().await.expect("a close frame");
    let silent = before.elapsed();
    assert_eq!(
        close.close(),
        Some((1001, "idle for upgrade_idle_timeout".to_string()))
    );
    assert!(
        silent >= Duration::from_millis(2_800),
        "closed after {silent:?} of silence, with a 3 s timeout"
    );
    assert_eq!(echo.wait_closed("/h2idle").await["code"], 1001);

    // SIGTERM: the stream works on through the grace (its connection told GOAWAY), then
    // gets 1001 once the grace is over.
    let mut socket = h2_websocket(gw.port, "/h2term", &[]).await.expect("a 200");
    let r = &mut socket.stream;
    let term = Instant::now();
    gw.signal("TERM");
    r.io.write_all(&frame(TEXT, b"in the grace", MASK))
        .await
        .expect("send");
    let back = r.frame().await.expect("the echo");
    assert_eq!(back.payload, b"in the grace");
    let close = r.frame().await.expect("a close frame");
    let at = term.elapsed();
    assert_eq!(
        close.close(),
        Some((1001, "the gateway is shutting down".to_string()))
    );
    assert!(
        at >= Duration::from_millis(800),
        "closed {at:?} after SIGTERM, with a 1 s grace"
    );
    let seen = echo.wait_closed("/h2term").await;
    assert_eq!(seen["code"], 1001, "{seen}");
    let exit = tokio::task::block_in_place(|| gw.wait_exit(WAIT));
    assert!(
        exit.is_some_and(|s| s.success()),
        "exit: {exit:?}\n{}",
        gw.logs()
    );
}

// ---------------------------------------------------------------------------------------
// The pool and the store behind a socket

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_goes_http1_to_a_pool_that_speaks_h2c() {
    let _watch = common::watchdog();
    // The echo backend speaks HTTP/1.1 only: an upgrade must not go up as HTTP/2.
    let echo = EchoServer::start().await;
    let body = format!(
        "[[upstreams]]\nname = \"default\"\nprotocol = \"h2c\"\nservers = [\"{}\"]\n\
         [store]\nbackend = \"memory\"\n",
        echo.url()
    );
    let gw = Gateway::start(&body);
    let mut c = WsClient::open(&ws_url(&gw, "/over-h2c-pool"), &[]).await;
    c.echo("one").await;
    assert_eq!(c.close(1000, "done").await["code"], 1000);
    assert_eq!(echo.wait_closed("/over-h2c-pool").await["code"], 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_closes_a_metered_socket_1011_at_both_ends() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let mut redis = common::RedisServer::start();
    let echo = EchoServer::start().await;
    // Batches of 5 frames: the socket asks the store again after 5.
    let rule = "[[rules]]\nname = \"chat\"\nkey = \"api_key\"\nrate = \"60/m\"\n\
                messages = { rate = \"50/s\", burst = 100 }\nmax_delay = \"1s\"\n";
    let body = format!(
        "{rule}[upstream]\nurl = \"{}\"\n{}",
        echo.url(),
        common::Store::redis(&redis).toml()
    );
    let gw = Gateway::start(&body);
    let mut c = WsClient::open(&ws_url(&gw, "/outage"), &[("x-api-key", "k1")]).await;
    c.echo("while the store is up").await;

    tokio::task::block_in_place(|| redis.kill());
    // `on_error = "deny"`: the next batch cannot be had, and the socket is closed.
    let paced = c.pace(20, 3.0).await;
    assert_eq!(
        paced["closed"],
        json!({ "code": 1011, "reason": "the rate-limit store is unavailable", "sent_code": 1011 }),
        "{paced}"
    );
    let seen = echo.wait_closed("/outage").await;
    assert_eq!(seen["code"], 1011, "{seen}");
    // The first message and at most the rest of its batch.
    assert!(number(&seen["received"]) <= 5, "{seen}");
    assert_eq!(closed_for(&gw, "store_error", 1.0).await, 1.0);
}

// ---------------------------------------------------------------------------------------
// 10. Metrics and the access line

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_the_access_line_follow_a_socket_to_the_byte() {
    let _watch = common::watchdog();
    let echo = EchoServer::start().await;
    let body = format!(
        "[[upstreams]]\nname = \"ws\"\nservers = [\"{}\"]\n\
         [[routes]]\nname = \"chat\"\nmatch = {{ path_prefix = \"/chat/\" }}\nupstream = \"ws\"\n\
         [store]\nbackend = \"memory\"\n",
        echo.url()
    );
    let gw = Gateway::start(&body);
    let labels = [("route", "chat"), ("pool", "ws")];
    let open = "ratewall_upgraded_connections";
    let bytes = "ratewall_upgraded_bytes_total";

    let mut c = WsClient::open(&ws_url(&gw, "/chat/room"), &[]).await;
    assert_eq!(until_metric(&gw, open, &labels, 1.0).await, 1.0);
    c.echo("hello").await;
    let sent = c
        .call(json!({ "send_binary": 1000, "seed": 7 }), WAIT)
        .await;
    let back = c.recv(WAIT).await;
    assert_eq!(back["sha256"], sent["sha256"]);
    let closed = c.close(1000, "done").await;
    assert_eq!(closed["code"], 1000, "{closed}");
    assert_eq!(until_metric(&gw, open, &labels, 0.0).await, 0.0);

    // Every frame, to the byte (RFC 6455 §5.2: 2 bytes of header, 2 more for a length
    // of 126 to 65535, 4 of masking key from the client): "hello", 1000 bytes, and the
    // close frame (code and "done") each way; the handshake is not the tunnel's.
    let up = (2 + 4 + 5) + (2 + 2 + 4 + 1000) + (2 + 4 + 2 + 4);
    let down = (2 + 5) + (2 + 2 + 1000) + (2 + 2 + 4);
    let upstream = [labels[0], labels[1], ("direction", "upstream")];
    assert_eq!(
        common::series(&gw, bytes, &upstream).await,
        Some(f64::from(up))
    );
    let downstream = [labels[0], labels[1], ("direction", "downstream")];
    assert_eq!(
        common::series(&gw, bytes, &downstream).await,
        Some(f64::from(down))
    );
    // After the closing handshake the backend closes the TCP connection first (RFC 6455
    // §7.1.1), so the tunnel ends on its side.
    assert_eq!(closed_for(&gw, "upstream_closed", 1.0).await, 1.0);

    // A client that goes away without a close frame: its side ended it.
    let mut r = send_raw(gw.port, &ws_handshake("/chat/gone", "")).await;
    assert_eq!(status(&r.head().await), 101);
    assert_eq!(until_metric(&gw, open, &labels, 1.0).await, 1.0);
    r.io.shutdown().await.expect("half-close");
    drop(r);
    assert_eq!(closed_for(&gw, "client_closed", 1.0).await, 1.0);
    assert_eq!(until_metric(&gw, open, &labels, 0.0).await, 0.0);
    for other in [
        "idle_timeout",
        "shutdown",
        "message_limit",
        "protocol_error",
        "failed",
    ] {
        assert_eq!(closed_for(&gw, other, 0.0).await, 0.0, "{other}");
    }

    let lines = access_lines(&gw, "path=/chat/room ").await;
    assert_eq!(lines.len(), 1, "{}", gw.logs());
    for field in [
        "status=101",
        "upgrade=\"websocket\"",
        "route=\"chat\"",
        "pool=\"ws\"",
    ] {
        assert!(lines[0].contains(field), "no {field} in {}", lines[0]);
    }
    // An ordinary request's line has no `upgrade`.
    let plain = common::raw_exchange(
        gw.port,
        b"GET /chat/plain HTTP/1.1\r\nHost: ws.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(
        plain.status, 426,
        "the echo server wants a WebSocket: {}",
        plain.text
    );
    let lines = access_lines(&gw, "path=/chat/plain ").await;
    assert!(
        lines.len() == 1 && !lines[0].contains("upgrade="),
        "{lines:#?}"
    );
}
