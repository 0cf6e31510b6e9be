//! A route's prefix holds (issue 42, item 3): the real binary in front of a real backend
//! ([`common::Backend`], which records each request target byte for byte), driven by raw
//! sockets, with a real nginx doing the same job beside it for comparison.
//!
//! A route with `strip_prefix`/`add_prefix` forwards the path its match was tried on —
//! percent-decoded, dot segments (`.`, `..`, `%2e`, `%2E`) resolved, doubled slashes
//! folded, as the rules read it — with the prefix taken off, `add_prefix` put in front,
//! and the query as the client sent it. No request reaches the backend outside
//! `add_prefix`: `/billing/x/%2e%2e/%2e%2e/billing/internal` is `/v2/internal`, never
//! `/billing/internal`. A route without either prefix forwards the client's bytes.

use crate::common;

use common::{raw_exchange, Backend, Gateway, Nginx};

/// What a client got: the target the backend received, or the status of an answer that
/// never reached it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Got {
    Sent(String),
    Status(u16),
}

fn sent(target: &str) -> Got {
    Got::Sent(target.to_string())
}

/// `GET target` with `Host: host` to `port`, and what became of it at `backend`.
async fn through(port: u16, backend: &Backend, target: &str, host: &str) -> Got {
    let before = backend.hits().len();
    let request = format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let answer = raw_exchange(port, request.as_bytes()).await;
    let hits = backend.hits();
    match hits.get(before) {
        Some(hit) if answer.status == 200 => Got::Sent(hit.target.clone()),
        Some(hit) => panic!(
            "{target}: {} yet the backend saw {}",
            answer.status, hit.target
        ),
        None => Got::Status(answer.status),
    }
}

/// The routes: `edge` (by host alone, so that a path that climbs out of `/billing` still
/// takes it) and `billing` strip `/billing` and add `/v2`; `added` only adds `/v3`;
/// `plain` rewrites nothing. No pool `default`: a path no route fits is a 404.
fn routes(backend: &Backend) -> String {
    format!(
        "[[upstreams]]\nname = \"echo\"\nservers = [\"{}\"]\n\
         [[routes]]\nname = \"edge\"\nmatch = {{ host = \"edge.test\" }}\nupstream = \"echo\"\nstrip_prefix = \"/billing\"\nadd_prefix = \"/v2\"\n\
         [[routes]]\nname = \"billing\"\nmatch = {{ path_prefix = \"/billing/\" }}\nupstream = \"echo\"\nstrip_prefix = \"/billing\"\nadd_prefix = \"/v2\"\n\
         [[routes]]\nname = \"added\"\nmatch = {{ path_prefix = \"/added/\" }}\nupstream = \"echo\"\nadd_prefix = \"/v3\"\n\
         [[routes]]\nname = \"plain\"\nmatch = {{ path_prefix = \"/plain/\" }}\nupstream = \"echo\"\n",
        backend.url()
    )
}

/// Each target as ratewall forwards it, and as nginx does with the same prefixes
/// (`location /billing/ { proxy_pass http://backend/v2/; }`, `location /added/ {
/// proxy_pass http://backend/v3/added/; }`, 404 elsewhere), both measured here.
///
/// | sent | ratewall | nginx 1.22.1 |
/// | --- | --- | --- |
/// | `/billing/../billing/x` | `/v2/x` | `/v2/x` |
/// | `/billing/x/%2e%2e/%2e%2e/billing/internal` | `/v2/internal` | `/v2/internal` |
/// | `/billing/a%2Fb?q=%2F..%2F` | `/v2/a/b?q=%2F..%2F` | the same |
/// | `/billing/a;p=1/b` | `/v2/a/b` (parameters dropped, as the rules read it) | `/v2/a;p=1/b` |
/// | `/billing/x/..%5C..%5Cinternal` | 404 (it is `/internal` to a backend reading `\` as `/`) | `/v2/x/..%5C..%5Cinternal` |
/// | `/billing/%2e%2e/%2e%2e/internal` | 404 (`/internal`: no route) | 400 |
///
/// Before the fix, 19 of these 31 cases were forwarded otherwise: the first two as
/// `/v2/../billing/x` and `/v2/x/%2e%2e/%2e%2e/billing/internal` (which a backend
/// resolves to `/billing/x` and `/billing/internal`, outside `/v2/`), every dot segment
/// and doubled slash as sent, `/billing/%2e%2e/%2e%2e/internal` on the host route as
/// `/v2/%2e%2e/%2e%2e/internal` (`/internal`), and `/billing../x` as `/v2/../x` (`/x`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_prefix_holds_whatever_dot_segments_the_path_carries() {
    let _watch = common::watchdog();
    let (ours, theirs) = (Backend::start().await, Backend::start().await);
    let gw = Gateway::start(&routes(&ours));
    let nginx = Nginx::start(&format!(
        "  server {{ listen LISTEN;\n    \
             location /billing/ {{ proxy_pass {0}/v2/; }}\n    \
             location /added/ {{ proxy_pass {0}/v3/added/; }}\n    \
             location / {{ return 404; }}\n  }}\n",
        theirs.url()
    ));
    let shop = "shop.test";
    // (target, host, ratewall, nginx where its config has the same route).
    let cases: Vec<(&str, &str, Got, Option<Got>)> = vec![
        // `..` and `.` segments, plain and percent-encoded in any case.
        (
            "/billing/../billing/x",
            shop,
            sent("/v2/x"),
            Some(sent("/v2/x")),
        ),
        (
            "/billing/x/%2e%2e/%2e%2e/billing/internal",
            shop,
            sent("/v2/internal"),
            Some(sent("/v2/internal")),
        ),
        (
            "/billing/x/%2E%2e/y",
            shop,
            sent("/v2/y"),
            Some(sent("/v2/y")),
        ),
        (
            "/billing/%2e%2E/billing/y",
            shop,
            sent("/v2/y"),
            Some(sent("/v2/y")),
        ),
        (
            "/billing/x/.%2E/y",
            shop,
            sent("/v2/y"),
            Some(sent("/v2/y")),
        ),
        ("/billing/./x/.", shop, sent("/v2/x/"), Some(sent("/v2/x/"))),
        (
            "/billing/%2e/x/%2E",
            shop,
            sent("/v2/x/"),
            Some(sent("/v2/x/")),
        ),
        ("/billing/x/..", shop, sent("/v2/"), Some(sent("/v2/"))),
        ("/billing/x/%2e%2e", shop, sent("/v2/"), Some(sent("/v2/"))),
        // Only the prefix; trailing and doubled slashes.
        ("/billing/", shop, sent("/v2/"), Some(sent("/v2/"))),
        ("/billing/x/", shop, sent("/v2/x/"), Some(sent("/v2/x/"))),
        ("/billing//x//", shop, sent("/v2/x/"), Some(sent("/v2/x/"))),
        // The query as sent; an encoded slash is a slash, as the rules read it.
        (
            "/billing/a%2Fb?q=%2F..%2F&r=/../",
            shop,
            sent("/v2/a/b?q=%2F..%2F&r=/../"),
            Some(sent("/v2/a/b?q=%2F..%2F&r=/../")),
        ),
        (
            "/billing/inv%2F1/a%20b/%7Euser?x=1",
            shop,
            sent("/v2/inv/1/a%20b/~user?x=1"),
            Some(sent("/v2/inv/1/a%20b/~user?x=1")),
        ),
        // Decoded once: `%252F` is the text `%2F`, sent encoded again.
        (
            "/billing/a%252Fb",
            shop,
            sent("/v2/a%252Fb"),
            Some(sent("/v2/a%252Fb")),
        ),
        (
            "/billing/a%3Fb",
            shop,
            sent("/v2/a%3Fb"),
            Some(sent("/v2/a%3Fb")),
        ),
        // Where the two differ: path parameters and backslashes, which the rules read as
        // Tomcat and IIS route them.
        (
            "/billing/a;p=1/b",
            shop,
            sent("/v2/a/b"),
            Some(sent("/v2/a;p=1/b")),
        ),
        (
            "/billing/x/..%5C..%5Cinternal",
            shop,
            Got::Status(404),
            Some(sent("/v2/x/..%5C..%5Cinternal")),
        ),
        // Climbing out of the prefix leaves the route (no route, no default pool: 404).
        (
            "/billing/x/..%2F..%2Finternal",
            shop,
            Got::Status(404),
            Some(Got::Status(404)),
        ),
        (
            "/billing/%2e%2e/%2e%2e/internal",
            shop,
            Got::Status(404),
            Some(Got::Status(400)),
        ),
        // A route by host alone: whatever the path, it stays inside `/v2`, resolved from
        // its root as RFC 3986 §5.2.4 resolves an absolute path.
        (
            "/billing/%2e%2e/%2e%2e/internal",
            "edge.test",
            sent("/v2/internal"),
            None,
        ),
        (
            "/billing/../../x/../../internal",
            "edge.test",
            sent("/v2/internal"),
            None,
        ),
        ("/billing", "edge.test", sent("/v2/"), None),
        ("/billing?a=1", "edge.test", sent("/v2/?a=1"), None),
        // The prefix ends a segment, or it is not taken off.
        ("/billing../x", "edge.test", sent("/v2/billing../x"), None),
        ("/billingx/y", "edge.test", sent("/v2/billingx/y"), None),
        ("/other/%2e%2e/x", "edge.test", sent("/v2/x"), None),
        // add_prefix alone.
        (
            "/added/a/%2e%2e/b",
            shop,
            sent("/v3/added/b"),
            Some(sent("/v3/added/b")),
        ),
        (
            "/added/",
            shop,
            sent("/v3/added/"),
            Some(sent("/v3/added/")),
        ),
        // No prefix on the route: the client's bytes, as before.
        (
            "/plain/a/%2e%2e/b?x=%2F",
            shop,
            sent("/plain/a/%2e%2e/b?x=%2F"),
            None,
        ),
        (
            "/plain/a%2Fb;p=1/../c",
            shop,
            sent("/plain/a%2Fb;p=1/../c"),
            None,
        ),
    ];
    let mut wrong = Vec::new();
    for (target, host, want, nginx_does) in &cases {
        let got = through(gw.port, &ours, target, host).await;
        if got != *want {
            wrong.push(format!("ratewall {host} {target}: {got:?}, not {want:?}"));
        }
        if let Some(n) = nginx_does {
            let got = through(nginx.port, &theirs, target, host).await;
            if got != *n {
                wrong.push(format!("nginx {target}: {got:?}, not {n:?}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} wrong:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    // Nothing reached the backend outside a rewriting route's prefix, nor with a dot
    // segment left in it.
    for hit in ours.hits() {
        let p = hit.path();
        if p.starts_with("/plain/") {
            continue;
        }
        assert!(
            (p.starts_with("/v2/") || p.starts_with("/v3/added/"))
                && !p.split('/').any(|s| s == ".." || s == "."),
            "{p}"
        );
    }
}
