//! The log, end to end: the real `ratewall` binary, its stderr read back.
//!
//! - the access line names the client as the gateway resolved it (through a trusted
//!   proxy), the host and the user agent, bounded and escaped so that a client cannot
//!   forge or split a line, in both formats; `[log] client_ip = false` leaves the address
//!   out;
//! - the startup line prints plain addresses (`admin=none`, never `Some(..)`);
//! - an unreachable upstream is one line when it starts failing and one, with the count of
//!   failed requests, when it answers again; never one per request;
//! - a reload names what changed: rules added, removed and changed, other settings by key;
//! - shutdown ends with `ratewall stopped`, the uptime and the requests served;
//! - no raw API key reaches the log on any of these paths.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, upstream_and_store, Gateway, HttpClient, Store, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const KEY: &str = "sk_live_logs_secret_5e5e5e";
const OTHER_KEY: &str = "sk_live_logs_listed_7a7a7a";

/// The JSON events of `logs` with `target`.
fn events(logs: &str, target: &str) -> Vec<serde_json::Value> {
    logs.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .unwrap_or_else(|e| panic!("a log line is not JSON ({e}): {l}"))
        })
        .filter(|v| v["target"] == target)
        .collect()
}

fn assert_no_key(logs: &str) {
    for secret in [KEY, OTHER_KEY] {
        assert!(!logs.contains(secret), "{secret} in the log:\n{logs}");
    }
}

/// Send raw bytes as one request on a new connection and read the answer's status line.
async fn raw_status(port: u16, request: &[u8]) -> String {
    let mut s = common::connect(port).await;
    s.write_all(request).await.expect("send");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        while !got.windows(2).any(|w| w == b"\r\n") {
            let n = s.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed without an answer");
            got.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(common::WAIT, read)
        .await
        .expect("an answer");
    let text = String::from_utf8_lossy(&got);
    text.lines().next().unwrap_or_default().to_string()
}

// ---------------------------------------------------------------------------------------
// The access line

/// A user agent that tries to end its line and forge the next one, hide text and spoof
/// a field: every trick arrives in the log as an escape or inside the quoted value.
const FORGED_UA: &[u8] =
    b"evil/1.0\t status=500 \xe2\x80\xae\xff INFO ratewall::access: decision=\"allowed\"";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_lines_name_the_resolved_client_host_and_user_agent_escaped() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let body = format!(
        "{}[client_ip]\ntrusted_proxies = [\"127.0.0.1/32\"]\n\
         [[rules]]\nname = \"api\"\nkey = \"api_key\"\nmissing_key = \"client_ip\"\nrate = \"1/h\"\nburst = 100\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    );
    let gw = Gateway::start_with(&body, &["--log-format", "json"], &[]);
    let client = HttpClient::new();
    let r = client
        .get(
            &gw.url("/a"),
            &[
                ("x-forwarded-for", "198.51.100.9, 203.0.113.7"),
                ("user-agent", "curl/8.5.0"),
                ("host", "shop.example:8080"),
                ("x-api-key", KEY),
            ],
        )
        .await;
    assert_eq!(r.status.as_u16(), 200);
    // Raw, so that the bytes are exactly what a hostile client sends.
    let long = "L".repeat(2_000);
    let mut forged = b"GET /b HTTP/1.1\r\nHost: h.example\r\nUser-Agent: ".to_vec();
    forged.extend_from_slice(FORGED_UA);
    forged.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
    assert!(raw_status(gw.port, &forged).await.contains(" 200 "));
    let long_ua = format!(
        "GET /c HTTP/1.1\r\nHost: h.example\r\nUser-Agent: {long}\r\nConnection: close\r\n\r\n"
    );
    assert!(raw_status(gw.port, long_ua.as_bytes())
        .await
        .contains(" 200 "));
    // No user agent, and HTTP/2 (its host is `:authority`).
    let h2 = HttpClient::h2();
    let r = h2.get(&gw.url("/d"), &[]).await;
    assert_eq!(r.status.as_u16(), 200);

    assert!(
        gw.wait_for_log("ratewall::access", 4, Duration::from_secs(10)),
        "{}",
        gw.logs()
    );
    let logs = gw.logs();
    let lines = events(&logs, "ratewall::access");
    let by_path = |p: &str| {
        lines
            .iter()
            .find(|e| e["fields"]["path"] == p)
            .unwrap_or_else(|| panic!("no access line for {p}:\n{logs}"))["fields"]
            .clone()
    };
    let a = by_path("/a");
    // The rightmost untrusted address of a trusted peer's X-Forwarded-For.
    assert_eq!(a["client_ip"], "203.0.113.7", "{a}");
    assert_eq!(a["host"], "shop.example:8080", "{a}");
    assert_eq!(a["user_agent"], "curl/8.5.0", "{a}");
    let b = by_path("/b");
    assert_eq!(
        b["client_ip"], "127.0.0.1",
        "no forwarding header: the peer: {b}"
    );
    assert_eq!(
        b["user_agent"],
        "evil/1.0\\u{9} status=500 \\u{202e}\\xff INFO ratewall::access: decision=\"allowed\"",
        "{b}"
    );
    let c = by_path("/c");
    let ua = c["user_agent"].as_str().expect("a user agent");
    assert_eq!(ua, format!("{}…", &long[..256]), "bounded");
    let d = by_path("/d");
    assert_eq!(d["user_agent"], "-", "{d}");
    assert_eq!(d["host"], format!("127.0.0.1:{}", gw.port), "{d}");
    assert_no_key(&logs);
    // JSON lines stay one per event: nothing a client sent split one.
    assert_eq!(lines.len(), 4, "{logs}");
}

/// The text format quotes what a client chose: a forged `status=500` stays inside the
/// `user_agent` value, and the line is one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_the_text_format_a_client_value_cannot_pass_for_a_field() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream_and_store(&upstream.url(), &Store::Memory));
    let mut forged = b"GET /t HTTP/1.1\r\nHost: h.example\r\nUser-Agent: ".to_vec();
    forged.extend_from_slice(FORGED_UA);
    forged.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
    assert!(raw_status(gw.port, &forged).await.contains(" 200 "));
    assert!(gw.wait_for_log("ratewall::access", 1, Duration::from_secs(10)));
    let logs = gw.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("ratewall::access"))
        .expect("an access line");
    assert!(
        line.contains(
            r#"user_agent="evil/1.0\\u{9} status=500 \\u{202e}\\xff INFO ratewall::access: decision=\"allowed\"""#
        ),
        "{line}"
    );
    assert!(line.contains(r#"host="h.example""#), "{line}");
    assert!(line.contains("client_ip=127.0.0.1"), "{line}");
    assert!(line.contains("status=200"), "{line}");
    assert_eq!(
        logs.lines()
            .filter(|l| l.contains("ratewall::access"))
            .count(),
        1,
        "one line, however the value reads: {logs}"
    );
}

// ---------------------------------------------------------------------------------------
// Startup and shutdown

/// The binary on `config` (a whole file) until it says it listens: its log so far.
fn log_of_a_start(config: &str) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, config).expect("write config");
    let log = dir.path().join("log");
    let mut child = Command::new(common::binary())
        .arg("--config")
        .arg(&path)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn ratewall");
    let end = Instant::now() + Duration::from_secs(20);
    let mut text = String::new();
    while Instant::now() < end && !text.contains("ratewall listening") {
        std::thread::sleep(Duration::from_millis(20));
        text = std::fs::read_to_string(&log).unwrap_or_default();
    }
    let _ = child.kill();
    let _ = child.wait();
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_line_prints_plain_addresses() {
    let _watch = common::watchdog();
    let port = free_port();
    let logs = log_of_a_start(&format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n\
         [upstream]\nurl = \"http://127.0.0.1:3999/base/\"\n"
    ));
    let line = logs
        .lines()
        .find(|l| l.contains("ratewall listening"))
        .unwrap_or_else(|| panic!("no startup line:\n{logs}"));
    for want in [
        format!("listen=127.0.0.1:{port}"),
        "admin=none".to_string(),
        "upstream=http://127.0.0.1:3999/base".to_string(),
        "store=\"memory\"".to_string(),
        "workers=1".to_string(),
        "rules=0".to_string(),
    ] {
        assert!(line.contains(&want), "{want} missing: {line}");
    }
    assert!(!line.contains("Some("), "{line}");

    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream_and_store(&upstream.url(), &Store::Memory));
    let logs = gw.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("ratewall listening"))
        .expect("a startup line");
    assert!(
        line.contains(&format!("admin=127.0.0.1:{}", gw.admin_port)),
        "{line}"
    );
    assert!(!line.contains("Some("), "{line}");
}

/// Issue 42, item 9: the startup line named only a pool's first server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_line_names_every_server_of_every_pool() {
    let _watch = common::watchdog();
    let port = free_port();
    let logs = log_of_a_start(&format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n\
         [[upstreams]]\nname = \"default\"\n\
         servers = [\"http://127.0.0.1:3997\", \"http://127.0.0.1:3998/v2\"]\n\
         [[upstreams]]\nname = \"billing\"\nservers = [\"http://127.0.0.1:3999\"]\n"
    ));
    let line = logs
        .lines()
        .find(|l| l.contains("ratewall listening"))
        .unwrap_or_else(|| panic!("no startup line:\n{logs}"));
    for want in [
        "upstream=http://127.0.0.1:3997, http://127.0.0.1:3998/v2",
        "pools=billing: http://127.0.0.1:3999",
    ] {
        assert!(line.contains(want), "{want} missing: {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_with_a_final_line_of_uptime_and_requests_served() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let mut gw = Gateway::start(&upstream_and_store(&upstream.url(), &Store::Memory));
    let client = HttpClient::new();
    for _ in 0..3 {
        assert_eq!(client.get(&gw.url("/x"), &[]).await.status.as_u16(), 200);
    }
    let h2 = HttpClient::h2();
    for _ in 0..2 {
        assert_eq!(h2.get(&gw.url("/y"), &[]).await.status.as_u16(), 200);
    }
    gw.signal("TERM");
    let status = gw.wait_exit(Duration::from_secs(15)).expect("it exits");
    assert!(status.success(), "{status:?}");
    let logs = gw.logs();
    let last = logs
        .lines()
        .rfind(|l| !l.trim().is_empty())
        .expect("a last line");
    assert!(last.contains("ratewall stopped"), "the last line: {last}");
    assert!(last.contains("requests=5"), "{last}");
    assert!(last.contains("uptime="), "{last}");
    assert!(last.contains("uptime_s="), "{last}");
}

// ---------------------------------------------------------------------------------------
// The upstream's outages

/// A tiny upstream on `port`: `200 ok` to every request, kept alive.
async fn answer_on(port: u16) -> tokio::task::JoinHandle<()> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind the upstream's port");
    tokio::spawn(async move {
        // Dropped, with every connection, when this task is aborted.
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            while conns.try_join_next().is_some() {}
            conns.spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    while let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        got.drain(..end + 4);
                        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                        if s.write_all(ok).await.is_err() {
                            return;
                        }
                    }
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
            });
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_is_logged_once_per_change_of_state_with_a_count() {
    let _watch = common::watchdog();
    let port = free_port();
    let gw = Gateway::start(&format!(
        "workers = 1\n{}",
        upstream_and_store(&format!("http://127.0.0.1:{port}"), &Store::Memory)
    ));
    let client = HttpClient::new();
    const DOWN: usize = 25;
    for _ in 0..DOWN {
        let r = client.get(&gw.url("/z"), &[("x-api-key", KEY)]).await;
        assert_eq!(r.status.as_u16(), 502);
    }
    assert!(gw.wait_for_log("ratewall::access", DOWN, Duration::from_secs(10)));
    let logs = gw.logs();
    assert_eq!(
        logs.matches("upstream pool failing").count(),
        1,
        "one line for {DOWN} failed requests:\n{logs}"
    );
    assert!(logs.contains(&format!("127.0.0.1:{port}")), "{logs}");
    assert!(!logs.contains("upstream pool answers again"), "{logs}");

    // It comes up: one line, with the count.
    let up = answer_on(port).await;
    for _ in 0..3 {
        assert_eq!(client.get(&gw.url("/z"), &[]).await.status.as_u16(), 200);
    }
    assert!(gw.wait_for_log("upstream pool answers again", 1, Duration::from_secs(10)));
    let logs = gw.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("upstream pool answers again"))
        .expect("the recovery line");
    assert!(line.contains(&format!("failures={DOWN}")), "{line}");
    assert!(line.contains("down_for="), "{line}");
    assert_eq!(
        logs.matches("upstream pool answers again").count(),
        1,
        "{logs}"
    );

    // Down again: a new outage, a new line.
    up.abort();
    let _ = up.await;
    // Kept connections may answer once more: until the gateway sees it gone.
    let until = Instant::now() + Duration::from_secs(10);
    let mut failed = 0;
    while failed < 5 && Instant::now() < until {
        if client.get(&gw.url("/z"), &[]).await.status.as_u16() == 502 {
            failed += 1;
        }
    }
    assert_eq!(failed, 5);
    let logs = gw.logs();
    assert_eq!(logs.matches("upstream pool failing").count(), 2, "{logs}");
    assert_no_key(&logs);
}

// ---------------------------------------------------------------------------------------
// Reloads

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_names_what_changed() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let upstream_with = |timeout: &str| {
        format!(
            "[upstream]\nurl = \"{}\"\nconnect_timeout = \"1s\"\ntimeout = \"{timeout}\"\n[store]\nbackend = \"memory\"\n",
            upstream.url()
        )
    };
    let base = upstream_with("5s");
    let rule = |name: &str, rate: &str| {
        format!("[[rules]]\nname = \"{name}\"\nkey = \"client_ip\"\nrate = \"{rate}\"\n")
    };
    let first = format!(
        "{base}[keys.plans]\n\"{KEY}\" = \"pro\"\n{}{}{}[rules.plans.pro]\nrate = \"50/s\"\n",
        rule("stays", "10/s"),
        rule("goes", "10/s"),
        rule("tuned", "10/s")
    );
    let gw = Gateway::start_with(&first, &["--log-format", "json"], &[]);
    let client = HttpClient::new();
    let r = client.get(&gw.url("/r"), &[("x-api-key", KEY)]).await;
    assert_eq!(r.status.as_u16(), 200);

    // A rule removed, one added, one changed; another key listed; the log without
    // addresses; a longer upstream timeout.
    gw.rewrite_config(&format!(
        "{}[log]\nclient_ip = false\n[keys.plans]\n\"{KEY}\" = \"pro\"\n\"{OTHER_KEY}\" = \"pro\"\n{}{}[rules.plans.pro]\nrate = \"50/s\"\n{}",
        upstream_with("7s"),
        rule("stays", "10/s"),
        rule("tuned", "20/s"),
        rule("new", "1/s")
    ));
    gw.reload(1);
    // The same file again: nothing changed, and it says so.
    gw.reload(2);
    let r = client.get(&gw.url("/after"), &[("x-api-key", KEY)]).await;
    assert_eq!(r.status.as_u16(), 200);
    assert!(gw.wait_for_log("/after", 1, Duration::from_secs(10)));

    let logs = gw.logs();
    let reloads: Vec<serde_json::Value> = events(&logs, "ratewall::server")
        .into_iter()
        .filter(|e| {
            e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("config reloaded"))
        })
        .collect();
    assert_eq!(reloads.len(), 2, "{logs}");
    let f = &reloads[0]["fields"];
    assert_eq!(f["added"], "new", "{f}");
    assert_eq!(f["removed"], "goes", "{f}");
    assert_eq!(f["changed"], "tuned", "{f}");
    // The upstream's timeout is the pool's change, not a setting (issue 42, item 9).
    assert_eq!(f["settings"], "keys.plans, log.client_ip", "{f}");
    assert_eq!(f["pools"], "~default", "{f}");
    assert_eq!(f["rules"], 3, "{f}");
    let f = &reloads[1]["fields"];
    assert_eq!(f["message"], "config reloaded: nothing changed", "{f}");
    assert_eq!(
        (&f["added"], &f["removed"], &f["changed"], &f["settings"]),
        (&"-".into(), &"-".into(), &"-".into(), &"-".into()),
        "{f}"
    );
    // `[log] client_ip = false` took effect: the address is gone from the access line.
    let access = events(&logs, "ratewall::access");
    let before = access
        .iter()
        .find(|e| e["fields"]["path"] == "/r")
        .expect("the first access line");
    assert_eq!(before["fields"]["client_ip"], "127.0.0.1", "{before}");
    let after = access
        .iter()
        .find(|e| e["fields"]["path"] == "/after")
        .expect("the access line after the reload");
    assert!(after["fields"].get("client_ip").is_none(), "{after}");
    assert_no_key(&logs);
}
