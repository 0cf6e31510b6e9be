//! The perimeter, round two (the issue "Hold the perimeter, round two"): a request the
//! gateway reads one way and a backend another. Each test runs the real binary in front of
//! a real backend (nginx where how a real server reads the request is the point), with
//! raw bytes on the socket where the bytes matter, and fails on a gateway without the
//! defence: a `Host` with userinfo, path parameters and encoded control bytes, header
//! names with underscores, guessing the admin token, the listen backlog, and the small
//! ones (two HTTP/2 `content-length`s, a TLS 1.2 renegotiation, more than 100 fields).

use crate::common;

use common::{
    h2_status, raw_exchange, series, upstream_and_store, Gateway, Nginx, Store, Upstream,
};

/// nginx with two vhosts, as in the probe: `api.example.com` and a default one.
const VHOSTS: &str = "  server { listen LISTEN default_server; server_name _; return 200 \"default vhost\\n\"; }\n\
                      server { listen LISTEN; server_name api.example.com; return 200 \"api vhost\\n\"; }\n";

fn get_with_host(target: &str, host: &str) -> Vec<u8> {
    format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").into_bytes()
}

/// The statuses of `n` GETs (Host `app.test`) to `paths` in turn.
async fn in_turn(port: u16, paths: &[&str], n: usize) -> Vec<u16> {
    let mut statuses = Vec::with_capacity(n);
    for path in paths.iter().cycle().take(n) {
        statuses.push(
            raw_exchange(port, &get_with_host(path, "app.test"))
                .await
                .status,
        );
    }
    statuses
}

// ---------------------------------------------------------------------------------------
// 1. A Host with `@`

/// `Host: api.example.com:80@x.invalid` is `x.invalid` to a URI parser and
/// `api.example.com` to nginx, which serves it from that vhost: a `host` rule must not be
/// walked around by it. Such a Host, the same authority in an absolute-form target or in
/// HTTP/2's `:authority`, and an HTTP/2 request with no host at all, are refused (400) and
/// never reach the backend; the plain Host is limited as the rule says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_with_userinfo_is_refused_not_matched_as_another_host() {
    let _watch = common::watchdog();
    let nginx = Nginx::start(VHOSTS);
    let gw = Gateway::start(&format!(
        "{}[[rules]]\nname = \"api-host\"\nmatch = {{ host = \"api.example.com\" }}\n\
         key = \"global\"\nrate = \"1/h\"\nburst = 5\n",
        upstream_and_store(&nginx.url(), &Store::Memory)
    ));
    let sneaky = "api.example.com:80@x.invalid";
    for _ in 0..12 {
        let a = raw_exchange(gw.port, &get_with_host("/", sneaky)).await;
        assert_eq!(a.status, 400, "{}", a.text);
        assert!(!a.text.contains("api vhost"), "{}", a.text);
    }
    for target in [
        format!("http://{sneaky}/"),
        "http://user@api.example.com/".into(),
    ] {
        let host = target.trim_start_matches("http://").trim_end_matches('/');
        let a = raw_exchange(gw.port, &get_with_host(&target, host)).await;
        assert_eq!(a.status, 400, "{target}: {}", a.text);
    }
    let h2 = |authority: Option<&'static str>| {
        let mut fields = vec![(":method", "GET"), (":scheme", "http"), (":path", "/")];
        fields.extend(authority.map(|a| (":authority", a)));
        async move { h2_status(gw.port, &fields, b"").await }
    };
    assert_eq!(
        h2(Some(sneaky)).await,
        Some(400),
        ":authority with userinfo"
    );
    assert_eq!(
        h2(None).await,
        Some(400),
        "HTTP/2 with neither :authority nor host"
    );

    // The plain Host: the burst, then 429s; every pass served by the api vhost.
    let mut statuses = Vec::new();
    for _ in 0..12 {
        let a = raw_exchange(gw.port, &get_with_host("/", "api.example.com")).await;
        if a.status == 200 {
            assert!(a.text.ends_with("api vhost\n"), "{}", a.text);
        }
        statuses.push(a.status);
    }
    assert_eq!(statuses, [[200; 5].as_slice(), &[429; 7]].concat());
    // And HTTP/2 with the same host in :authority counts under the same rule.
    assert_eq!(h2(Some("api.example.com")).await, Some(429));
}

// ---------------------------------------------------------------------------------------
// 2. Path forms a backend routes differently

/// `ratewall check --config <the gateway's file> --path <path>`: what it prints.
fn check_path(gw: &Gateway, path: &str) -> String {
    let out = std::process::Command::new(common::binary())
        .arg("check")
        .arg("--config")
        .arg(&gw.config)
        .args(["--path", path])
        .output()
        .expect("run ratewall check");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `/api;x/orders` is `/api/orders` to Tomcat and Spring, and `/x/..;/api/y` is
/// `/api/y`: the rule for `/api/` counts them (forwarded as sent). An encoded NUL or other
/// control byte in the path is refused before any rule or the backend. And with
/// `path_case = "insensitive"`, `/API/x` counts under `/api/` too; `ratewall check --path`
/// prints the path the rules saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_parameters_control_bytes_and_case_do_not_walk_around_a_path_rule() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let rule = "[[rules]]\nname = \"api\"\nmatch = { path_prefix = \"/api/\" }\nkey = \"global\"\n\
                rate = \"1/h\"\nburst = 5\n";
    let gw = Gateway::start(&format!(
        "{}{rule}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let spellings = [
        "/api;x/orders",
        "/api;jsessionid=1/orders",
        "/x/..;/api/y",
        "/api/;v=2",
    ];
    let statuses = in_turn(gw.port, &spellings, 12).await;
    assert_eq!(statuses, [[200; 5].as_slice(), &[429; 7]].concat());
    let seen: Vec<String> = upstream.seen().iter().map(|s| s.path.clone()).collect();
    assert!(
        seen.iter().any(|p| p == "/api;x/orders"),
        "forwarded as sent: {seen:?}"
    );

    for path in [
        "/other/%00",
        "/x%00.png",
        "/a%0d%0aSet-Cookie:%20x",
        "/a%7f",
        "/a%1F",
    ] {
        let a = raw_exchange(gw.port, &get_with_host(path, "app.test")).await;
        assert_eq!(a.status, 400, "{path}: {}", a.text);
    }
    assert_eq!(
        upstream.seen().len(),
        5,
        "no control byte reached the upstream"
    );
    assert!(check_path(&gw, "/api;x/orders").contains("(rules see the path as /api/orders)"));
    // A parameter holding an encoded slash is read one way by Spring, Undertow and Jetty
    // (the parameter cut first: /api/orders) and another by a decode-first reader
    // (/orders): refused rather than guessed.
    for path in [
        "/api;x%2F..%2F/orders",
        "/api;x%2f..%2f/orders",
        "/api;%5C..%5C/o",
    ] {
        let a = raw_exchange(gw.port, &get_with_host(path, "app.test")).await;
        assert_eq!(a.status, 400, "{path}: {}", a.text);
    }
    assert_eq!(
        upstream.seen().len(),
        5,
        "no ambiguous parameter reached it"
    );
    // `ratewall check --path` says what the gateway answers them.
    for path in ["/api/%00", "/api;x%2F..%2F/orders"] {
        let explained = check_path(&gw, path);
        assert!(
            explained.contains("refused before any rule: 400"),
            "{path}: {explained}"
        );
    }

    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "path_case = \"insensitive\"\n{}{rule}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let spellings = ["/API/orders", "/Api/x", "/aPI;x/y", "/api/z"];
    let statuses = in_turn(gw.port, &spellings, 8).await;
    assert_eq!(statuses, [[200; 5].as_slice(), &[429; 3]].concat());
    let seen: Vec<String> = upstream.seen().iter().map(|s| s.path.clone()).collect();
    assert_eq!(seen[0], "/API/orders", "forwarded as sent");
    let explained = check_path(&gw, "/API;v=2/Orders");
    assert!(
        explained.contains("(rules see the path as /api/orders)"),
        "{explained}"
    );
    assert!(explained.contains("api:"), "{explained}");
}

/// An HTTP/1.0 request may name no host; the upstream hop then sends the upstream's own
/// as its `Host`, and the backend serves it from that vhost: a `host` rule for it applies,
/// since rules match the host forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http10_request_without_host_meets_the_rules_of_the_host_it_is_forwarded_with() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let rule = "[[rules]]\nname = \"vhost\"\nmatch = { host = \"127.0.0.1\" }\nkey = \"global\"\n\
                rate = \"1/h\"\nburst = 2\n";
    let gw = Gateway::start(&format!(
        "{}{rule}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(
            raw_exchange(gw.port, b"GET /x HTTP/1.0\r\n\r\n")
                .await
                .status,
        );
    }
    assert_eq!(statuses, [200, 200, 429, 429], "{}", gw.logs());
    let hosts: Vec<Option<String>> = upstream
        .seen()
        .iter()
        .map(|s| {
            s.headers
                .get("host")
                .and_then(|h| h.to_str().ok())
                .map(str::to_string)
        })
        .collect();
    assert!(
        hosts
            .iter()
            .all(|h| h.as_deref().is_some_and(|h| h.starts_with("127.0.0.1:"))),
        "forwarded with the upstream's host: {hosts:?}"
    );
}

// ---------------------------------------------------------------------------------------
// 3. Header names with underscores

/// `X_Api_Key` and `X_Forwarded_For` are `HTTP_X_API_KEY` and `HTTP_X_FORWARDED_FOR` to a
/// CGI, WSGI or Rack backend: a key the limiter never counted, a chain the gateway never
/// rewrote. They are dropped (and counted) unless `underscores_in_headers = true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_names_with_underscores_are_dropped_unless_asked_for() {
    let _watch = common::watchdog();
    let request = b"GET /u HTTP/1.1\r\nHost: app.test\r\nX_Api_Key: sk_victim_key\r\n\
                    X_Forwarded_For: 203.0.113.66\r\nx_forwarded_for: 203.0.113.67\r\n\
                    X-Api-Key: sk_mine\r\nConnection: close\r\n\r\n";
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream_and_store(&upstream.url(), &Store::Memory));
    assert_eq!(raw_exchange(gw.port, request).await.status, 200);
    let seen = upstream.seen();
    let names: Vec<&str> = seen[0].headers.keys().map(|n| n.as_str()).collect();
    assert!(
        !names.iter().any(|n| n.contains('_')),
        "an underscored field reached the upstream: {names:?}"
    );
    assert_eq!(seen[0].headers["x-api-key"], "sk_mine");
    assert_eq!(seen[0].headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(
        series(&gw, "ratewall_underscore_fields_dropped_total", &[]).await,
        Some(3.0)
    );
    // Over HTTP/2 alike.
    let fields = [
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/u2"),
        (":authority", "app.test"),
        ("x_api_key", "sk_victim_key"),
        ("x-api-key", "sk_mine"),
    ];
    assert_eq!(h2_status(gw.port, &fields, b"").await, Some(200));
    let seen = upstream.seen();
    let h2 = seen
        .iter()
        .find(|s| s.path == "/u2")
        .expect("the HTTP/2 request");
    assert!(
        !h2.headers.keys().any(|n| n.as_str().contains('_')),
        "an underscored field reached the upstream over HTTP/2: {:?}",
        h2.headers
    );
    assert_eq!(
        series(&gw, "ratewall_underscore_fields_dropped_total", &[]).await,
        Some(4.0)
    );

    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "underscores_in_headers = true\n{}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    assert_eq!(raw_exchange(gw.port, request).await.status, 200);
    let seen = upstream.seen();
    assert_eq!(
        seen[0].headers["x_api_key"], "sk_victim_key",
        "asked for: forwarded"
    );
    assert_eq!(
        series(&gw, "ratewall_underscore_fields_dropped_total", &[]).await,
        Some(0.0)
    );
}

// ---------------------------------------------------------------------------------------
// 4. Guessing the admin token

/// A short `RATEWALL_ADMIN_TOKEN` is refused as the file's would be: the process does not
/// start (and does not print the token). Wrong tokens are counted, logged (rate-limited,
/// with the peer, never the token) and, past a small allowance per peer, answered 429 with
/// a `Retry-After` without being checked; a peer with the right token elsewhere is not
/// slowed, and the `Bearer` scheme is matched in any case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessing_the_admin_token_is_slowed_counted_and_logged() {
    let _watch = common::watchdog();
    const TOKEN: &str = "round-two-admin-token-0123456789";
    let upstream = Upstream::start().await;
    let base = format!(
        "{}[[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 5\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    );
    let refused = Gateway::try_start_with(&base, "2s", &[], &[("RATEWALL_ADMIN_TOKEN", "zq")])
        .err()
        .expect("a two-character environment token must not start the gateway");
    assert!(
        refused.contains("RATEWALL_ADMIN_TOKEN: an admin token is at least 16"),
        "{refused}"
    );
    assert!(
        !refused.contains("zq"),
        "the token is never printed: {refused}"
    );

    let gw = Gateway::start_with(&base, &[], &[("RATEWALL_ADMIN_TOKEN", TOKEN)]);
    let state = gw.admin_url("/admin/state?rule=api&key=k");
    let guesser = common::HttpClient::new();
    let mut statuses = Vec::new();
    let started = std::time::Instant::now();
    for i in 0..40 {
        let guess = format!("Bearer guess-{i:04}-aaaaaaaaaaaaaaaa");
        let r = guesser.get(&state, &[("authorization", &guess)]).await;
        if r.status == 429 {
            let wait: u64 = r
                .header("retry-after")
                .expect("Retry-After")
                .parse()
                .unwrap();
            assert!((1..=2).contains(&wait), "Retry-After {wait}");
        }
        statuses.push(r.status.as_u16());
    }
    let took = started.elapsed();
    let checked = statuses.iter().filter(|s| **s == 401).count();
    // 10 at once, then one a second: within `took`, no more than that were checked.
    assert!(
        checked >= 10 && checked as u64 <= 10 + took.as_secs() + 1,
        "{checked} of 40 checked in {took:?}: {statuses:?}"
    );
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 40 - checked);

    // Another peer with the right token, its scheme in lower case, is not slowed.
    let operator = common::HttpClient::from_addr(Some("127.0.0.2".parse().unwrap()));
    let bearer = format!("bearer {TOKEN}");
    let r = operator.get(&state, &[("authorization", &bearer)]).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    // One with no token at all is counted as such.
    let r = common::HttpClient::from_addr(Some("127.0.0.3".parse().unwrap()))
        .get(&state, &[])
        .await;
    assert_eq!(r.status, 401);

    let count = |reason: &'static str| {
        let gw = &gw;
        async move {
            series(
                gw,
                "ratewall_admin_auth_failures_total",
                &[("reason", reason)],
            )
            .await
        }
    };
    assert_eq!(count("wrong").await, Some(checked as f64));
    assert_eq!(count("throttled").await, Some((40 - checked) as f64));
    assert_eq!(count("missing").await, Some(1.0));
    let logs = gw.logs();
    let lines: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("admin calls refused"))
        .collect();
    assert!(
        !lines.is_empty() && lines.len() <= 2,
        "logged, but not once per guess: {lines:?}"
    );
    assert!(
        lines[0].contains("127.0.0.1"),
        "with the peer: {}",
        lines[0]
    );
    assert!(!logs.contains("guess-0"), "a guessed token reached the log");

    // The guesser's address, once its allowance is back, is checked again (real time on
    // purpose: the allowance refills on the gateway's clock).
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let r = guesser
        .get(&state, &[("authorization", &format!("Bearer {TOKEN}"))])
        .await;
    assert_eq!(r.status, 200);
}

// ---------------------------------------------------------------------------------------
// 5. The listen backlog

/// A listening socket's backlog, as `ss -ltn` shows it (Send-Q of a listening socket).
fn listen_backlog(port: u16) -> u32 {
    let out = std::process::Command::new("ss")
        .args(["-ltnH", &format!("sport = :{port}")])
        .output()
        .expect("run ss (iproute2)");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.split_whitespace().nth(2)?.parse().ok())
        .unwrap_or_else(|| panic!("no listening socket on {port}: {text:?}"))
}

fn somaxconn() -> u32 {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(4096)
}

/// Every listener (cleartext, TLS, admin) takes `[server] backlog`, 1024 by default, not
/// std's 128: a burst of new connections waits in the queue instead of for SYN
/// retransmits. Past `net.core.somaxconn` it is cut there, and the start-up log says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listeners_take_the_configured_backlog_up_to_somaxconn() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let pki = common::Pki::new("backlog");
    let cert = pki.server_cert("gw", &["localhost"], 30);
    let (gw, tls_port) = common::start_on_free_tls_port(|port| {
        format!(
            "{}{}",
            upstream_and_store(&upstream.url(), &Store::Memory),
            common::tls_table(port, std::slice::from_ref(&cert), "")
        )
    });
    let expected = 1024.min(somaxconn());
    for (listener, port) in [
        ("cleartext", gw.port),
        ("tls", tls_port),
        ("admin", gw.admin_port),
    ] {
        assert_eq!(listen_backlog(port), expected, "{listener}");
    }
    drop(gw);

    let asked = 60_000;
    let gw = Gateway::start(&format!(
        "backlog = {asked}\n{}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let cap = somaxconn();
    assert_eq!(listen_backlog(gw.port), asked.min(cap));
    if cap < asked {
        let logs = gw.logs();
        assert!(
            logs.contains(&format!(
                "backlog {asked} is cut to net.core.somaxconn = {cap}"
            )),
            "{logs}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// 6. Small ones

/// Two equal `content-length` fields in one HTTP/2 request go up as one line (an nginx
/// backend answers 400 to two); two that differ are refused by the gateway itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_http2_content_lengths_go_up_as_one_or_are_refused() {
    let _watch = common::watchdog();
    let nginx = Nginx::start(VHOSTS);
    let gw = Gateway::start(&upstream_and_store(&nginx.url(), &Store::Memory));
    let post = |lengths: &'static [&'static str]| {
        let mut fields = vec![
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "api.example.com"),
        ];
        fields.extend(lengths.iter().map(|l| ("content-length", *l)));
        async move { h2_status(gw.port, &fields, b"hello").await }
    };
    assert_eq!(post(&["5"]).await, Some(200), "one content-length");
    assert_eq!(post(&["5", "5"]).await, Some(200), "{}", nginx.error_log());
    // Refused before the backend: h2 resets such a stream itself (PROTOCOL_ERROR), and the
    // gateway's screen answers 400 to any that got past it.
    let differing = post(&["5", "6"]).await;
    assert!(
        matches!(differing, Some(400 | common::H2_RESET)),
        "a 400 or a reset, never a hang or a forward: {differing:?}"
    );
}

/// More than hyper's default 100 fields, well within `max_header_bytes`, are served (nginx
/// accepts them); the bound that remains is one field per 32 bytes of `max_header_bytes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_than_100_header_fields_within_max_header_bytes_are_served() {
    let _watch = common::watchdog();
    // Room in nginx's header buffers (4 x 8 KiB by default) for 700 fields, as a backend
    // that takes such heads has.
    let nginx = Nginx::start(&format!("  large_client_header_buffers 8 16k;\n{VHOSTS}"));
    let gw = Gateway::start(&upstream_and_store(&nginx.url(), &Store::Memory));
    let head = |n: usize| {
        let fields: String = (0..n).map(|i| format!("X-Field-{i}: {i}\r\n")).collect();
        format!("GET / HTTP/1.1\r\nHost: api.example.com\r\n{fields}Connection: close\r\n\r\n")
    };
    let a = raw_exchange(gw.port, head(150).as_bytes()).await;
    assert_eq!(
        a.status,
        200,
        "150 fields, {} bytes: {}",
        head(150).len(),
        a.text
    );
    assert!(a.text.ends_with("api vhost\n"), "{}", a.text);
    let a = raw_exchange(gw.port, head(700).as_bytes()).await;
    assert_eq!(
        a.status,
        200,
        "700 fields, {} bytes: {}",
        head(700).len(),
        a.text
    );
    // 1,100 fields of a few bytes: under 32 KiB, over the default 1,024 fields.
    let tiny: String = (0..1100).map(|i| format!("a{i}:\r\n")).collect();
    let tiny =
        format!("GET / HTTP/1.1\r\nHost: api.example.com\r\n{tiny}Connection: close\r\n\r\n");
    let a = raw_exchange(gw.port, tiny.as_bytes()).await;
    assert_eq!(a.status, 431);
    // `max_header_fields` raises it for clients that send many tiny fields.
    let gw = Gateway::start(&format!(
        "max_header_fields = 2000\n{}",
        upstream_and_store(&nginx.url(), &Store::Memory)
    ));
    let a = raw_exchange(gw.port, tiny.as_bytes()).await;
    // Past the gateway: nginx itself answers (its 400 is its own limit on such heads).
    assert_ne!(a.status, 431, "{}", a.text);
    assert!(
        a.text.to_ascii_lowercase().contains("server: nginx"),
        "forwarded, nginx answered: {}",
        a.text
    );
}

/// OpenSSL's `s_client` over TLS 1.2 to `port`: after the handshake, `request` (if any)
/// and its answer, then `R` (renegotiate). Whether rustls' `no_renegotiation` alert came
/// within 5 s, and what `s_client` printed.
fn renegotiate(port: u16, request: Option<&str>) -> (bool, String) {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let mut client = std::process::Command::new("openssl")
        .args(["s_client", "-tls1_2", "-msg", "-connect"])
        .arg(format!("127.0.0.1:{port}"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run openssl s_client");
    let mut stdin = client.stdin.take().expect("stdin");
    let mut stdout = client.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let mut wait_for = |needle: &str, within: Duration| -> bool {
        let end = Instant::now() + within;
        loop {
            if String::from_utf8_lossy(&seen).contains(needle) {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            if let Ok(chunk) = rx.recv_timeout(Duration::from_millis(20)) {
                seen.extend(chunk);
            }
        }
    };
    let mut alerted = false;
    if wait_for("Verify return code", Duration::from_secs(10)) {
        let answered = match request {
            Some(r) => {
                let _ = stdin.write_all(r.as_bytes());
                wait_for("HTTP/1.1 200", Duration::from_secs(10))
            }
            None => true,
        };
        if answered {
            let _ = stdin.write_all(b"R\n");
            alerted = wait_for("no_renegotiation", Duration::from_secs(5));
        }
    }
    let _ = client.kill();
    let _ = client.wait();
    let text = String::from_utf8_lossy(&seen).into_owned();
    (alerted, text)
}

/// A TLS 1.2 client that asks to renegotiate gets rustls' `no_renegotiation` alert at once,
/// not silence until `header_timeout` (20 s here): before its first request (the gateway
/// still waits to learn the protocol) and on a kept-alive connection after an answer.
/// OpenSSL's `s_client`, asked to renegotiate (`R`), as the probe did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls12_renegotiation_is_answered_with_no_renegotiation_at_once() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let pki = common::Pki::new("reneg");
    let cert = pki.server_cert("gw", &["localhost"], 30);
    let (_gw, tls_port) = common::start_on_free_tls_port(|port| {
        format!(
            "header_timeout = \"20s\"\n{}{}",
            upstream_and_store(&upstream.url(), &Store::Memory),
            common::tls_table(port, std::slice::from_ref(&cert), "")
        )
    });
    for request in [None, Some("GET /kept HTTP/1.1\r\nHost: localhost\r\n\r\n")] {
        let (alerted, text) = tokio::task::spawn_blocking(move || renegotiate(tls_port, request))
            .await
            .expect("s_client");
        assert!(
            alerted,
            "{request:?}: no no_renegotiation alert within 5 s of the renegotiation: {}",
            &text[text.len().saturating_sub(2000)..]
        );
    }
}
