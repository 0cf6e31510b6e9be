//! The perimeter, tried as an attacker would: the real binary, a real upstream, and clients
//! that speak raw bytes where the bytes matter. Each test is one way a client could exhaust
//! the gateway or slip past a rule (the issue "Hold the perimeter"), and fails on a gateway
//! without the defence: silent and slow connections, a connection flood, a key flood,
//! forged forwarding headers, encoded slashes, lower-case methods, malformed requests,
//! huge heads, key probing on the admin API, a clock stepped back. (The upstream hop's part
//! — uploads and their clocks, stray answers, malformed bodies, transfer codings — is in
//! `tests/it/upstream.rs`.)

use crate::common;

use std::net::IpAddr;
use std::time::{Duration, Instant};

use common::{
    connect, exchange, global_hash, h2_frame, raw_until_closed, series, status_of, until_closed,
    until_quiet, until_scrape, upstream_and_store, Gateway, HttpClient, RedisServer, Store,
    Upstream, H2_START, WAIT,
};
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `ratewall_connections_closed_total` on the gateway's listener for `reason`.
async fn closed_by(gw: &Gateway, reason: &str) -> Option<f64> {
    series(
        gw,
        "ratewall_connections_closed_total",
        &[("listener", "gateway"), ("reason", reason)],
    )
    .await
}

fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: app.test\r\n\r\n").into_bytes()
}

// ---------------------------------------------------------------------------------------
// 1. Silent and slow connections

/// Every way of keeping a connection while saying nothing ends at its clock: a connection
/// that sends nothing, part of a head, a head one byte at a time (slowloris), only the
/// HTTP/2 preface, or nothing after an answer — on the gateway's listener and the admin's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_slow_connections_are_closed_by_their_clocks() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "header_timeout = \"1s\"\nidle_timeout = \"2s\"\n{}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    // Each is closed no sooner than its clock (`between`: the header clock less a margin
    // for the timer), and at all (within WAIT, or `until_closed` says None); which clock
    // closed it is counted by reason at the end. (No upper bound in time: on a loaded
    // machine a close can come late, and the reasons already tell header_timeout from
    // idle_timeout.)
    let between = Duration::from_millis(800);

    // Nothing at all: closed, nothing said.
    let (bytes, took) = raw_until_closed(gw.port, b"").await;
    let took = took.expect("a silent connection is closed");
    assert!(bytes.is_empty() && took >= between, "{took:?} {bytes:?}");

    // Part of a head: 408, then closed.
    let (bytes, took) = raw_until_closed(gw.port, b"GET / HTTP/1.1\r\nHost: app.test\r\n").await;
    let took = took.expect("a half head is closed");
    assert_eq!(status_of(&bytes), 408);
    assert!(took >= between, "{took:?}");

    // Slowloris: a byte every 200 ms keeps nothing open past the head's clock.
    let mut s = connect(gw.port).await;
    let start = Instant::now();
    let head = b"GET / HTTP/1.1\r\nHost: app.test\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut answer = Vec::new();
    for &b in head.iter() {
        if s.write_all(&[b]).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut buf = [0u8; 1024];
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(1), s.read(&mut buf)).await {
            answer.extend_from_slice(&buf[..n]);
            break;
        }
    }
    let (rest, _) = until_closed(&mut s).await;
    answer.extend_from_slice(&rest);
    let took = start.elapsed();
    assert_eq!(status_of(&answer), 408, "slowloris");
    assert!(took >= between, "slowloris kept it {took:?}");

    // Only the HTTP/2 preface, no SETTINGS: closed.
    let (_, took) = raw_until_closed(gw.port, &H2_START[..24]).await;
    let took = took.expect("a preface alone is closed");
    assert!(took >= between, "{took:?}");

    // An answer, then nothing: kept for idle_timeout (2 s), not header_timeout (1 s).
    let mut s = connect(gw.port).await;
    assert_eq!(exchange(&mut s, &get("/kept")).await, 200);
    let (_, took) = until_closed(&mut s).await;
    let took = took.expect("an idle kept-alive connection is closed");
    assert!(
        took >= Duration::from_millis(1700),
        "idle kept-alive closed after {took:?}"
    );

    // HTTP/2 with nothing in flight: a GOAWAY at idle_timeout.
    let mut s = connect(gw.port).await;
    s.write_all(H2_START).await.expect("send");
    let start = Instant::now();
    let mut frames = Vec::new();
    let goaway = tokio::time::timeout(WAIT, async {
        let mut buf = [0u8; 4096];
        loop {
            let n = s.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                return None;
            }
            frames.extend_from_slice(&buf[..n]);
            // Frames: 3 bytes length, 1 byte type...
            let mut at = 0;
            while at + 9 <= frames.len() {
                let len = (usize::from(frames[at]) << 16)
                    | (usize::from(frames[at + 1]) << 8)
                    | usize::from(frames[at + 2]);
                if frames[at + 3] == 0x7 {
                    return Some(start.elapsed());
                }
                at += 9 + len;
            }
        }
    })
    .await
    .ok()
    .flatten()
    .expect("a GOAWAY on an idle HTTP/2 connection");
    assert!(
        goaway >= Duration::from_millis(1700),
        "GOAWAY after {goaway:?}"
    );
    drop(s);

    // The admin listener has the same clocks.
    let (_, took) = raw_until_closed(gw.admin_port, b"").await;
    let took = took.expect("a silent admin connection is closed");
    assert!(took >= between, "admin: {took:?}");

    // Counted by clock; nothing left open.
    assert_eq!(closed_by(&gw, "header_timeout").await, Some(4.0));
    assert_eq!(closed_by(&gw, "idle_timeout").await, Some(2.0));
    let admin = [("listener", "admin"), ("reason", "header_timeout")];
    assert_eq!(
        series(&gw, "ratewall_connections_closed_total", &admin).await,
        Some(1.0)
    );
    let end = Instant::now() + WAIT;
    while series(&gw, "ratewall_connections", &[("listener", "gateway")]).await != Some(0.0) {
        assert!(Instant::now() < end, "connections left open");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A GET of `path` as an HPACK header block: static-table `:method GET`, `:scheme http`,
/// then `:path` and `:authority` as literals.
fn h2_get(path: &str) -> Vec<u8> {
    let mut block = vec![0x82, 0x86, 0x44, path.len() as u8];
    block.extend_from_slice(path.as_bytes());
    block.extend_from_slice(&[0x41, 8]);
    block.extend_from_slice(b"app.test");
    block
}

/// An HTTP/2 client that opens streams and then never takes a byte of their answers (its
/// flow-control window left at 0) blocks no socket write: the gateway must still see it,
/// and end the connection after `body_timeout` — else each such connection holds an
/// upstream request (and connection) per stream, for ever. (Answers small enough for the
/// HTTP/2 layer's send buffer are read whole from the upstream at once; these are not.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_takes_nothing_is_cut_off_at_body_timeout() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "body_timeout = \"1s\"\nidle_timeout = \"30s\"\n{}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let mut s = connect(gw.port).await;
    let mut start = H2_START[..24].to_vec();
    // SETTINGS: INITIAL_WINDOW_SIZE (4) = 0.
    start.extend(h2_frame(0x4, 0, 0, &[0, 4, 0, 0, 0, 0]));
    for i in 0..5u32 {
        start.extend(h2_frame(0x1, 0x5, 1 + 2 * i, &h2_get("/big/2000000")));
    }
    s.write_all(&start).await.expect("send");
    let started = Instant::now();
    let (_, took) = until_closed(&mut s).await;
    let took = took.expect("the connection is closed");
    // Not before its clock; closed by it (counted below), not by idle_timeout (30 s: past
    // the WAIT `until_closed` gives it).
    assert!(
        took >= Duration::from_millis(800),
        "closed after {took:?} with body_timeout 1s"
    );
    assert!(started.elapsed() < WAIT);
    assert_eq!(upstream.seen().len(), 5, "the requests were forwarded");
    // Its reason is counted as the connection's task ends, which may be just after the
    // client saw the close.
    let end = Instant::now() + WAIT;
    while series(&gw, "ratewall_connections", &[("listener", "gateway")]).await != Some(0.0) {
        assert!(Instant::now() < end, "connections left open");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(closed_by(&gw, "send_timeout").await, Some(1.0));
}

/// The idle clock starts when an answer ends, however long the request took: one longer
/// than idle_timeout itself is followed by a full idle period, then the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_longer_than_idle_timeout_still_gets_its_idle_clock() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "idle_timeout = \"1s\"\n{}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let mut s = connect(gw.port).await;
    assert_eq!(exchange(&mut s, &get("/slow/1600")).await, 200);
    let (_, took) = until_closed(&mut s).await;
    // A full idle period after the answer (the claim), then closed (within WAIT).
    let took = took.expect("closed after the idle period");
    assert!(
        took >= Duration::from_millis(800),
        "closed {took:?} after the answer"
    );
}

// ---------------------------------------------------------------------------------------
// 2. Too many connections

/// At `max_connections`, the connections idle the longest make room whatever they are
/// doing with it: one that has said nothing, one part way through a head, one that opened
/// HTTP/2 and sent no stream. Each new client is served at once, not after their clocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_half_and_idle_http2_connections_make_room_too() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "workers = 1\nmax_connections = 3\nheader_timeout = \"20s\"\n{}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let silent = connect(gw.port).await;
    let mut half = connect(gw.port).await;
    half.write_all(b"GET / HTTP/1.1\r\nHost: app.test\r\n")
        .await
        .expect("send");
    let mut h2 = connect(gw.port).await;
    h2.write_all(H2_START).await.expect("send");
    until_scrape(&gw, "the three connections accepted", |s| {
        s.get("ratewall_connections", &[("listener", "gateway")]) == 3.0
    })
    .await;
    // Each new client keeps its connection: the next needs room again.
    let mut kept = Vec::new();
    for i in 0..3 {
        let start = Instant::now();
        let mut s = connect(gw.port).await;
        assert_eq!(exchange(&mut s, &get(&format!("/new/{i}"))).await, 200);
        // At once, not after the clocks (header_timeout is 20 s; room made is counted
        // below): within WAIT, whatever the machine's load.
        assert!(
            start.elapsed() < WAIT,
            "client {i} waited {:?} for room",
            start.elapsed()
        );
        kept.push(s);
    }
    assert_eq!(closed_by(&gw, "make_room").await, Some(3.0));
    // The three that made room are the three that had been idle longest: all closed.
    for (name, mut s) in [("silent", silent), ("half", half), ("http2", h2)] {
        let (_, took) = until_closed(&mut s).await;
        assert!(took.is_some(), "the {name} connection is still open");
    }
}

/// At `max_connections`, a new client is served once the connection idle the longest is
/// closed to make room; with every connection busy, it waits for one to finish — never an
/// error, never a crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_max_connections_idle_ones_make_room_and_busy_ones_are_waited_for() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "workers = 1\nmax_connections = 3\n{}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let mut idle = Vec::new();
    for i in 0..3 {
        let mut s = connect(gw.port).await;
        assert_eq!(exchange(&mut s, &get(&format!("/idle/{i}"))).await, 200);
        idle.push(s);
        // Real time on purpose: apart by more than a loaded machine's scheduling delay, the
        // gateway marks a connection idle when its task gets back to reading, after the
        // client has read the answer (nothing shows when it has).
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let start = Instant::now();
    let mut fourth = connect(gw.port).await;
    assert_eq!(exchange(&mut fourth, &get("/fourth")).await, 200);
    // At once (counted as make_room below), not after an idle clock (60 s).
    assert!(start.elapsed() < WAIT, "{:?}", start.elapsed());
    // Exactly one was closed: the one idle the longest.
    let mut closed = Vec::new();
    for (i, s) in idle.iter_mut().enumerate() {
        let mut buf = [0u8; 16];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await
        {
            closed.push(i);
        }
    }
    assert_eq!(closed, [0], "the longest idle connection made room");
    assert_eq!(closed_by(&gw, "make_room").await, Some(1.0));
    drop(idle);
    drop(fourth);

    // Three requests in flight (1.5 s each); a fourth waits for one of them.
    until_quiet(&gw, 0.0).await;
    let client = HttpClient::new();
    let busy: Vec<_> = (0..3)
        .map(|_| {
            let (c, url) = (client.clone(), gw.url("/slow/1500"));
            tokio::spawn(async move { c.get(&url, &[]).await.status })
        })
        .collect();
    // 3 idle, the fourth, and these three.
    assert!(
        upstream.wait_arrived(7, WAIT).await,
        "the three never reached the upstream"
    );
    let start = Instant::now();
    let late = HttpClient::new().get(&gw.url("/late"), &[]).await;
    assert_eq!(late.status, StatusCode::OK);
    assert!(
        start.elapsed() >= Duration::from_millis(700),
        "served before a busy connection ended: {:?}",
        start.elapsed()
    );
    for b in busy {
        assert_eq!(b.await.expect("task"), StatusCode::OK);
    }
}

/// Out of file descriptors, accepts fail: the gateway closes idle connections to make
/// room, backs off, logs it once in a while (not once per accept), spends next to no CPU
/// meanwhile, and serves again as soon as descriptors are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_file_descriptors_the_accept_loop_neither_spins_nor_floods_the_log() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    // max_connections set beyond what 48 descriptors hold (left unset, it would be derived
    // to fit them, and no accept would fail).
    let gw = Gateway::start_wrapped(
        &format!(
            "workers = 1\nmax_connections = 10000\n{}",
            upstream_and_store(&upstream.url(), &Store::Memory)
        ),
        &["prlimit", "--nofile=48:48", "--"],
    );
    // Connections that each send a byte and then wait: more than there are descriptors.
    let mut flood = Vec::new();
    for _ in 0..80 {
        let mut s = connect(gw.port).await;
        let _ = s.write_all(b"G").await;
        flood.push(s);
    }
    let cpu = |pid: u32| -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        let fields: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        // utime and stime, in clock ticks: fields 14 and 15 of the line (11, 12 after ')').
        fields[11].parse::<u64>().unwrap_or(0) + fields[12].parse::<u64>().unwrap_or(0)
    };
    let before = cpu(gw.pid());
    // Real time on purpose: the CPU spent over 2 s of nothing but failing accepts.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = cpu(gw.pid()) - before;
    assert!(
        used < 50,
        "{used} ticks of CPU in 2 s while out of descriptors: the accept loop spins"
    );
    let logs = gw.logs();
    let lines = logs.matches("accept failed").count();
    assert!(
        (1..=2).contains(&lines),
        "{lines} accept-failure lines:\n{logs}"
    );
    drop(flood);
    until_scrape(&gw, "the flood's connections seen closed", |s| {
        s.get("ratewall_connections", &[("listener", "gateway")]) == 0.0
    })
    .await;
    let r = HttpClient::new().get(&gw.url("/after"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "serving again");
    assert!(
        series(
            &gw,
            "ratewall_accept_errors_total",
            &[("listener", "gateway")]
        )
        .await
            > Some(0.0)
    );
    assert!(
        closed_by(&gw, "make_room").await > Some(0.0),
        "idle connections were closed to make room"
    );
}

// ---------------------------------------------------------------------------------------
// 3. A flood of keys

/// A flood of distinct API keys never grows the memory store past `max_keys`: idle keys are
/// evicted, least recently used first, while a key being denied keeps its state — the
/// abuser gets no fresh burst by flooding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_flood_stays_within_max_keys_and_a_denied_key_stays_denied() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}max_keys = 200\n\
         [[rules]]\nname = \"quota\"\nmatch = {{ path_prefix = \"/q/\" }}\nkey = \"api_key\"\n\
         algorithm = \"fixed_window\"\nrate = \"1000/d\"\n\
         [[rules]]\nname = \"strict\"\nmatch = {{ path_prefix = \"/strict/\" }}\nkey = \"api_key\"\n\
         algorithm = \"fixed_window\"\nrate = \"3/d\"\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let client = HttpClient::new();
    let abuser = [("x-api-key", "sk_abuser_0000000000")];
    for i in 0..4 {
        let r = client.get(&gw.url("/strict/x"), &abuser).await;
        let want = if i < 3 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(r.status, want, "abuser request {i}");
    }
    for n in 0..1_000 {
        let key = format!("sk_flood_{n:06}");
        let r = client.get(&gw.url("/q/x"), &[("x-api-key", &key)]).await;
        assert_eq!(r.status, StatusCode::OK, "flood key {n}");
    }
    let r = client.get(&gw.url("/strict/x"), &abuser).await;
    assert_eq!(
        r.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the flood evicted the abuser's state"
    );
    // The key count is reported by the sweep, once a second: until it is.
    let scrape = until_scrape(&gw, "the sweep reports at most max_keys keys", |s| {
        s.find("ratewall_store_keys", &[("store", "memory")])
            .is_some_and(|k| k > 0.0 && k <= 200.0)
    })
    .await;
    let keys = scrape.find("ratewall_store_keys", &[("store", "memory")]);
    assert!(keys.is_some_and(|k| k > 0.0 && k <= 200.0), "{keys:?} keys");
    let lru = series(
        &gw,
        "ratewall_store_evictions_total",
        &[("store", "memory"), ("reason", "lru")],
    )
    .await;
    assert!(lru.is_some_and(|n| n >= 800.0), "{lru:?} evictions");
}

/// A flood of keys each left unable to pay for its next request (a burst of 1: every
/// one is held after its first request) fills the store with held states; past that a
/// new identity is refused (429, counted in `ratewall_store_refused_keys_total`) rather
/// than taking a held state's place, and the states kept stay denied. (tests/it/key_flood.rs
/// tries it with an abuser.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_full_of_held_keys_refuses_new_identities() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}max_keys = 100\n\
         [[rules]]\nname = \"login\"\nkey = \"api_key\"\nrate = \"1/m\"\nburst = 1\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let client = HttpClient::new();
    for n in 0..300 {
        let key = format!("sk_held_{n:04}");
        let r = client.get(&gw.url("/x"), &[("x-api-key", &key)]).await;
        let want = if n < 100 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(r.status, want, "new identity {n}");
    }
    let refused = series(
        &gw,
        "ratewall_store_refused_keys_total",
        &[("store", "memory")],
    )
    .await;
    assert_eq!(refused, Some(200.0), "refused keys counted");
    // The first keys kept their state: denied.
    let r = client
        .get(&gw.url("/x"), &[("x-api-key", "sk_held_0000")])
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
}

// ---------------------------------------------------------------------------------------
// 4. Forwarding headers

/// From a trusted proxy the forwarding headers tell one story, continued: its
/// `X-Forwarded-Proto`/`-Host` are kept, and the peer is appended to `X-Forwarded-For` and
/// `Forwarded`. From anyone else, nothing it says about forwarding reaches the upstream:
/// every such field is replaced by what the gateway saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_headers_are_continued_from_trusted_proxies_and_replaced_from_others() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}[client_ip]\ntrusted_proxies = [\"127.0.0.1/32\"]\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let claims: [(&str, &str); 7] = [
        ("host", "public.example"),
        ("x-forwarded-for", "203.0.113.9"),
        ("x-forwarded-proto", "https"),
        ("x-forwarded-host", "public.example"),
        ("x-forwarded-port", "443"),
        (
            "forwarded",
            "for=203.0.113.9;proto=https;host=public.example",
        ),
        ("x-real-ip", "203.0.113.9"),
    ];
    let trusted = HttpClient::from_addr(Some("127.0.0.1".parse::<IpAddr>().unwrap()));
    let untrusted = HttpClient::from_addr(Some("127.0.0.2".parse::<IpAddr>().unwrap()));
    assert_eq!(
        trusted.get(&gw.url("/t"), &claims).await.status,
        StatusCode::OK
    );
    assert_eq!(
        untrusted.get(&gw.url("/u"), &claims).await.status,
        StatusCode::OK
    );
    let seen = upstream.seen();
    let h = |path: &str, name: &str| -> Vec<String> {
        seen.iter()
            .find(|s| s.path == path)
            .expect("forwarded")
            .headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(h("/t", "x-forwarded-proto"), ["https"]);
    assert_eq!(h("/t", "x-forwarded-host"), ["public.example"]);
    assert_eq!(h("/t", "x-forwarded-for"), ["203.0.113.9, 127.0.0.1"]);
    assert_eq!(
        h("/t", "forwarded"),
        ["for=203.0.113.9;proto=https;host=public.example, for=127.0.0.1"]
    );
    assert_eq!(h("/t", "x-forwarded-port"), ["443"]);
    assert_eq!(h("/t", "x-real-ip"), ["203.0.113.9"]);

    assert_eq!(h("/u", "x-forwarded-proto"), ["http"]);
    assert_eq!(h("/u", "x-forwarded-host"), ["public.example"]);
    assert_eq!(h("/u", "x-forwarded-for"), ["127.0.0.2"]);
    assert_eq!(h("/u", "forwarded"), ["for=127.0.0.2;proto=http"]);
    assert!(
        h("/u", "x-forwarded-port").is_empty(),
        "a forged X-Forwarded-Port passed"
    );
    assert_eq!(h("/u", "x-real-ip"), ["127.0.0.2"]);
}

// ---------------------------------------------------------------------------------------
// 5. and 6. Paths and methods a backend reads differently

/// `%2F`, `%5C`, a backslash, encoded dots: however a path to `/api/` is spelled, the rule
/// for `/api/` counts it (a backend such as Flask routes them all to `/api/…`), and the
/// upstream gets the bytes as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoded_slashes_do_not_walk_around_a_path_rule() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}[[rules]]\nname = \"api\"\nmatch = {{ path_prefix = \"/api/\" }}\nkey = \"global\"\n\
         rate = \"1/h\"\nburst = 20\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let spellings = [
        "/api%2Fx",
        "/%2Fapi/x",
        "/api%2fx",
        "/api%5Cx",
        "/%2e/api/x",
        "/x/%2E%2E/api/x",
        "/x%2F..%2Fapi/x",
        "//api//x",
    ];
    let mut passed = 0;
    for i in 0..40 {
        let path = spellings[i % spellings.len()];
        let (bytes, _) = raw_until_closed(
            gw.port,
            format!("GET {path} HTTP/1.1\r\nHost: app.test\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await;
        match status_of(&bytes) {
            200 => passed += 1,
            429 => {}
            other => panic!("{path}: {other}"),
        }
    }
    assert_eq!(passed, 20, "the burst, and not one more");
    let seen: Vec<String> = upstream.seen().iter().map(|s| s.path.clone()).collect();
    assert!(
        seen.iter().any(|p| p == "/api%2Fx"),
        "forwarded as sent: {seen:?}"
    );
    assert!(
        seen.iter().any(|p| p == "/x%2F..%2Fapi/x"),
        "forwarded as sent: {seen:?}"
    );
}

/// `get` is not `GET` to a `methods = ["GET"]` filter, yet backends route it as `GET`:
/// standard methods in any other case are refused, before any rule or the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_case_method_is_refused_not_forwarded() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}[[rules]]\nname = \"m\"\nmatch = {{ path_prefix = \"/m/\", methods = [\"GET\", \"POST\"] }}\n\
         key = \"global\"\nrate = \"1/h\"\nburst = 2\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    for method in ["get", "Get", "pOST", "delete"] {
        for _ in 0..3 {
            let (bytes, _) = raw_until_closed(
                gw.port,
                format!("{method} /m/x HTTP/1.1\r\nHost: app.test\r\n\r\n").as_bytes(),
            )
            .await;
            assert_eq!(status_of(&bytes), 400, "{method}");
        }
    }
    assert!(
        upstream.seen().is_empty(),
        "a miscased method reached the upstream"
    );
    // Extension methods are case-sensitive tokens of their own, and pass.
    let (bytes, _) = raw_until_closed(
        gw.port,
        b"purge /m/x HTTP/1.1\r\nHost: app.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&bytes), 200);
}

// ---------------------------------------------------------------------------------------
// 8. Malformed requests

/// HTTP/1.1 without `Host`, `CONNECT`, and bare CR line endings are refused at once, and
/// never reach the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_refused_at_once() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    // Clocks of a minute: a close within WAIT is the refusal's, not a clock's.
    let gw = Gateway::start(&format!(
        "header_timeout = \"60s\"\nidle_timeout = \"60s\"\n{}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    for (request, want) in [
        (&b"GET /no-host HTTP/1.1\r\n\r\n"[..], 400),
        (
            b"CONNECT upstream.test:443 HTTP/1.1\r\nHost: upstream.test:443\r\n\r\n",
            501,
        ),
        (b"GET /cr HTTP/1.1\r\nHost: app.test\r\r", 400),
        (b"GET /cr HTTP/1.1\rHost: app.test\r\n\r\n", 400),
        (
            b"GET /cr HTTP/1.1\r\nHost: app.test\r\nX-A: b\rc\r\n\r\n",
            400,
        ),
    ] {
        let (bytes, took) = raw_until_closed(gw.port, request).await;
        assert_eq!(
            status_of(&bytes),
            want,
            "{:?}",
            String::from_utf8_lossy(request)
        );
        assert!(
            took.is_some(),
            "{:?}: not closed within {WAIT:?}",
            String::from_utf8_lossy(request)
        );
    }
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    // HTTP/1.0 needs no Host.
    let (bytes, _) = raw_until_closed(gw.port, b"GET /old HTTP/1.0\r\n\r\n").await;
    assert_eq!(status_of(&bytes), 200);
}

// ---------------------------------------------------------------------------------------
// 9. Huge heads

/// A head over `max_header_bytes` (by default 32 KiB) is 431, over HTTP/1 and HTTP/2; many
/// connections each sending a huge unfinished head cost the gateway at most that much each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_heads_are_bounded_by_max_header_bytes() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "workers = 1\n{}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let client = HttpClient::new();
    let (small, large) = ("a".repeat(30_000), "a".repeat(34_000));
    let r = client.get(&gw.url("/small"), &[("x-pad", &small)]).await;
    assert_eq!(r.status, StatusCode::OK);
    let (bytes, _) = raw_until_closed(
        gw.port,
        format!("GET /large HTTP/1.1\r\nHost: app.test\r\nX-Pad: {large}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(status_of(&bytes), 431);
    let h2 = HttpClient::h2();
    assert_eq!(
        h2.get(&gw.url("/small2"), &[("x-pad", &small)])
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        h2.get(&gw.url("/large2"), &[("x-pad", &large)])
            .await
            .status,
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );

    // 200 connections, each sending 300 KiB of a head that never ends.
    let rss = || -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", gw.pid())).expect("status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    };
    let before = rss();
    let mut conns = Vec::new();
    let chunk = vec![b'a'; 16 * 1024];
    for _ in 0..200 {
        let mut s = connect(gw.port).await;
        let _ = s
            .write_all(b"GET /huge HTTP/1.1\r\nHost: app.test\r\nX-Huge: ")
            .await;
        for _ in 0..19 {
            if s.write_all(&chunk).await.is_err() {
                break;
            }
        }
        conns.push(s);
    }
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 25 * 1024,
        "RSS grew {grown} KiB for 200 unfinished heads"
    );
    for mut s in conns {
        let (bytes, _) = until_closed(&mut s).await;
        assert_eq!(status_of(&bytes), 431);
    }
}

// ---------------------------------------------------------------------------------------
// 10. The admin listener

/// Nobody learns from the admin API which keys exist, or what is left of them, without the
/// admin token — not even from its read-only calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_answers_only_to_its_token() {
    let _watch = common::watchdog();
    const TOKEN: &str = "perimeter-admin-token-0123456789";
    let upstream = Upstream::start().await;
    let rules = "[keys.plans]\n\"sk_pro_key_0001\" = \"pro\"\n\
                 [[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 5\n\
                 [rules.plans.pro]\nburst = 50\n";
    let gw = Gateway::start(&format!(
        "[admin]\ntoken = \"{TOKEN}\"\n{}{rules}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let client = HttpClient::new();
    let probe = gw.admin_url("/admin/state?rule=api&key=sk_pro_key_0001");
    let r = client.get(&probe, &[]).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let body = String::from_utf8_lossy(&r.body);
    assert!(
        !body.contains("50") && !body.contains("remaining"),
        "{body}"
    );
    let auth = format!("Bearer {TOKEN}");
    let r = client.get(&probe, &[("authorization", &auth)]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["limit"], 1);
    for open in ["/", "/status.json", "/metrics", "/healthz", "/readyz"] {
        let r = client.get(&gw.admin_url(open), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{open}");
        assert!(
            !String::from_utf8_lossy(&r.body).contains("sk_pro"),
            "{open}"
        );
    }
    // Without a configured token, the admin API is off.
    let off = Gateway::start(&format!(
        "{}{rules}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let r = client
        .get(
            &off.admin_url("/admin/state?rule=api&key=sk_pro_key_0001"),
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
}

// ---------------------------------------------------------------------------------------
// 11. A clock stepped back

/// A window left in Redis by a clock that ran ahead (a failover to a replica whose clock is
/// behind, an NTP step) is not reopened: the request is decided at the window's start, in
/// the window, and denied — not counted as the first of a fresh one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_written_by_a_clock_ahead_is_not_reopened() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}[[rules]]\nname = \"fw\"\nmatch = {{ path_prefix = \"/fw/\" }}\nkey = \"global\"\n\
         algorithm = \"fixed_window\"\nrate = \"3/h\"\n\
         [[rules]]\nname = \"sw\"\nmatch = {{ path_prefix = \"/sw/\" }}\nkey = \"global\"\n\
         algorithm = \"sliding_window\"\nrate = \"3/h\"\n",
        upstream_and_store(&upstream.url(), &Store::redis(&redis))
    ));
    let mut conn = redis.conn();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).expect("TIME");
    let now_us = secs * 1_000_000 + micros;
    let hour_us = 3_600_000_000u64;
    let id = global_hash();
    // A full window that began 5 s from now on Redis' clock; and a sliding window whose
    // count is in the next hour's window.
    let fixed = format!("f:{}:3", now_us + 5_000_000);
    let sliding = format!("s:{}:3:0", now_us / hour_us + 1);
    for (rule, value) in [("fw", fixed), ("sw", sliding)] {
        let _: () = redis::cmd("SET")
            .arg(format!("rwtest:{{{id}}}:{rule}"))
            .arg(value)
            .arg("PX")
            .arg(2 * hour_us / 1_000)
            .query(&mut conn)
            .expect("SET");
    }
    let client = HttpClient::new();
    for path in ["/fw/x", "/sw/x"] {
        let r = client.get(&gw.url(path), &[]).await;
        assert_eq!(
            r.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{path}: a window reopened"
        );
        let retry: u64 = r
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .expect("Retry-After");
        assert!(
            retry > 3_600,
            "{path}: Retry-After {retry} counts from now, past the window"
        );
    }
}

/// A body far larger than the gateway should ever hold (512 MiB) streams through it to an
/// upstream that reads none of it for 2 s, then all of it: the gateway's resident memory
/// (VmRSS, sampled every 20 ms) stays within 64 MiB of what it was before, the whole body
/// arrives, and while the upstream read nothing the client could not hand over the bulk
/// of the body (the gateway stopped reading: backpressure, not a buffer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_streamed_body_is_carried_in_bounded_memory() {
    let _watch = common::watchdog();
    const TOTAL: usize = 512 << 20;
    const CHUNK: usize = 1 << 20;
    const BOUND_KIB: u64 = 64 << 10;
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "workers = 1\n{}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    // Warm: the pool, the allocator's first arenas, the upstream connection.
    let warm = HttpClient::new()
        .send("POST", &gw.url("/warm"), &[], vec![b'w'; 4 * CHUNK].into())
        .await;
    assert_eq!(warm.status, StatusCode::OK);
    let baseline = gw.rss_kib();

    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (sampling, pid) = (sampling.clone(), gw.pid());
        tokio::spawn(async move {
            let mut peak = 0;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
                    let rss = status
                        .lines()
                        .find_map(|l| l.strip_prefix("VmRSS:"))
                        .and_then(|v| v.trim().strip_suffix("kB"))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .unwrap_or(0);
                    peak = peak.max(rss);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            peak
        })
    };

    let mut s = connect(gw.port).await;
    s.write_all(
        format!("POST /hold/2000 HTTP/1.1\r\nHost: big.test\r\nContent-Length: {TOTAL}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .expect("head");
    let started = Instant::now();
    let chunk = vec![b'z'; CHUNK];
    let mut written = 0;
    let mut written_in_stall = None;
    while written < TOTAL {
        if written_in_stall.is_none() && started.elapsed() >= Duration::from_millis(1800) {
            written_in_stall = Some(written);
        }
        tokio::time::timeout(Duration::from_secs(30), s.write_all(&chunk))
            .await
            .unwrap_or_else(|_| panic!("the gateway took nothing for 30 s after {written} bytes"))
            .unwrap_or_else(|e| panic!("the gateway cut the upload after {written} bytes: {e}"));
        written += CHUNK;
    }
    let (answer, _) = until_closed(&mut s).await;
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.await.expect("sampler");
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with(&format!("ok {TOTAL}\n")),
        "the whole body reached the upstream: {answer}\n{}",
        gw.logs()
    );
    let stalled = written_in_stall.unwrap_or(TOTAL);
    eprintln!(
        "RSS {} KiB before, peak {peak} KiB; {} KiB handed over during the stall; {:?} in all",
        baseline,
        stalled >> 10,
        started.elapsed()
    );
    assert!(
        stalled < TOTAL / 4,
        "the client handed over {} MiB while the upstream read nothing: the gateway buffered it",
        stalled >> 20
    );
    assert!(
        peak <= baseline + BOUND_KIB,
        "the gateway's RSS peaked at {} MiB, from {} MiB before a {} MiB upload (bound: +{} \
         MiB); {} MiB were handed over during the upstream's 2 s stall",
        peak >> 10,
        baseline >> 10,
        TOTAL >> 20,
        BOUND_KIB >> 10,
        stalled >> 20
    );
}
