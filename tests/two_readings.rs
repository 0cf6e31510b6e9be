//! The perimeter, round two (the issue "Hold the perimeter, round two"): a request the
//! gateway reads one way and a backend another. Each test runs the real binary in front of
//! a real backend (nginx where how a real server reads the request is the point), with
//! raw bytes on the socket where the bytes matter, and fails on a gateway without the
//! defence: a `Host` with userinfo, path parameters and encoded control bytes, header
//! names with underscores, guessing the admin token, the listen backlog, and the small
//! ones (two HTTP/2 `content-length`s, a TLS 1.2 renegotiation, more than 100 fields).

mod common;

use common::{
    h2_status, raw_exchange, series, upstream_and_store, Gateway, Nginx, Store, Upstream,
};

/// nginx with two vhosts, as in the probe: `api.example.com` and a default one.
const VHOSTS: &str = "  server { listen LISTEN default_server; server_name _; return 200 \"default vhost\\n\"; }\n\
                      server { listen LISTEN; server_name api.example.com; return 200 \"api vhost\\n\"; }\n";

fn get_with_host(target: &str, host: &str) -> Vec<u8> {
    format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").into_bytes()
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
    let mut statuses = Vec::new();
    for i in 0..12 {
        let path = spellings[i % spellings.len()];
        statuses.push(
            raw_exchange(gw.port, &get_with_host(path, "app.test"))
                .await
                .status,
        );
    }
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

    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "path_case = \"insensitive\"\n{}{rule}",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let spellings = ["/API/orders", "/Api/x", "/aPI;x/y", "/api/z"];
    let mut statuses = Vec::new();
    for i in 0..8 {
        let path = spellings[i % spellings.len()];
        statuses.push(
            raw_exchange(gw.port, &get_with_host(path, "app.test"))
                .await
                .status,
        );
    }
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

// ---------------------------------------------------------------------------------------
// 3. Header names with underscores

/// `X_Api_Key` and `X_Forwarded_For` are `HTTP_X_API_KEY` and `HTTP_X_FORWARDED_FOR` to a
/// CGI, WSGI or Rack backend: a key the limiter never counted, a chain the gateway never
/// rewrote. They are dropped (and counted) unless `underscores_in_headers = true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_names_with_underscores_are_dropped_unless_asked_for() {
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
