//! Forward-auth (`/v1/forward-auth`, issue 44 item 3) behind the real proxies people run:
//! Debian's nginx (`auth_request`) and Debian's Caddy (`forward_auth`), each on the very
//! file `examples/` ships (ports filled in), in front of a backend that counts what
//! reaches it. And a caller outside `trusted_proxies` whose forwarded fields are not
//! believed.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::client::HttpClient;
use common::nginx::Nginx;
use common::{free_port, upstream_and_store, Backend, Gateway, Store};

/// The decision service's token in the tests: forward-auth needs none (its callers
/// pass their clients' own `Authorization` on), the decision API does.
const TOKEN: &str = "forward-auth-test-token-0123456789";

/// A gateway whose `[decide]` listener serves forward-auth, with `rules` and `extra`
/// `[decide]` keys; its decide port. Started again on other ports where one was taken.
fn gateway(backend: &Backend, rules: &str, decide: &str) -> (Gateway, u16) {
    let mut last = String::new();
    for _ in 0..5 {
        let port = free_port();
        let body = format!(
            "{}[client_ip]\ntrusted_proxies = [\"127.0.0.1/32\"]\n{rules}\n[decide]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"{TOKEN}\"\n{decide}\n",
            upstream_and_store(&backend.url(), &Store::Memory)
        );
        match Gateway::try_start(&body) {
            Ok(g) => return (g, port),
            Err(logs) if logs.contains("cannot listen") || logs.contains("in use") => last = logs,
            Err(logs) => panic!("ratewall did not start: {logs}"),
        }
    }
    panic!("ratewall found its decide port taken five times: {last}");
}

/// A rule `per-key` on `/orders`: five requests per API key, nothing refilled during a
/// test. (It applies only where the original path is believed: the call's own is
/// `/v1/forward-auth`.)
const FIVE_PER_KEY: &str = "[[rules]]\nname = \"per-key\"\nmatch = { path_prefix = \"/orders\" }\n\
     key = \"api_key\"\nrate = \"1/h\"\nburst = 5\n";

fn example(path: &str) -> String {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// `text` with each `(from, to)` replaced, every one of them found (so an example that
/// changes its addresses fails here, not silently).
fn filled(mut text: String, swaps: &[(&str, &str)]) -> String {
    for (from, to) in swaps {
        assert!(text.contains(from), "the example no longer has {from:?}");
        text = text.replace(from, to);
    }
    text
}

/// Six requests of one API key through `front` (a proxy's base URL): five pass with
/// their RateLimit fields, the sixth is a 429 with `Retry-After`, and the backend saw five.
async fn sixth_is_stopped_before_the_backend(front: &str, backend: &Backend) {
    let client = HttpClient::new();
    for left in (0..5).rev() {
        let r = client
            .get(
                &format!("{front}/orders?page={left}"),
                &[("x-api-key", "k1")],
            )
            .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
        let fields = r.header("ratelimit").unwrap_or_default();
        assert_eq!(
            fields,
            format!("\"per-key\";r={left};t={}", (5 - left) * 3600)
        );
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"per-key\";q=5;w=18000")
        );
    }
    let r = client
        .get(&format!("{front}/orders?page=6"), &[("x-api-key", "k1")])
        .await;
    assert_eq!(r.status, 429, "{:?}", r.body);
    assert_eq!(r.header("retry-after"), Some("3600"));
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let body = r.json();
    assert_eq!(body["status"], 429);
    assert_eq!(body["retry_after"], 3600);
    assert_eq!(
        backend.count("/orders"),
        5,
        "the sixth never reached the backend"
    );
    // Another key has its own five.
    let r = client
        .get(&format!("{front}/orders"), &[("x-api-key", "k2")])
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(backend.count("/orders"), 6);
    // A request no rule limits passes, with no RateLimit field (an empty one at most).
    let r = client
        .get(&format!("{front}/other"), &[("x-api-key", "k1")])
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.header("ratelimit").unwrap_or_default(), "");
    assert_eq!(backend.count("/other"), 1);
}

/// nginx with `examples/nginx/ratewall-auth.conf`, ratewall answering denials with
/// `deny_status = 403` (what `auth_request` passes on), and with the default 429 (which
/// `auth_request` makes a 500): either way the client gets the file's 429, and only the
/// second has nginx log an error per denial. With ratewall gone, nothing passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_auth_request_stops_the_sixth_request_with_a_429() {
    let _watch = common::watchdog();
    for deny_status in ["forward_auth = { deny_status = 403 }", ""] {
        let backend = Backend::start().await;
        let (gw, decide) = gateway(&backend, FIVE_PER_KEY, deny_status);
        let conf = filled(
            example("examples/nginx/ratewall-auth.conf"),
            &[
                ("listen 8000;", "listen LISTEN;"),
                ("127.0.0.1:8081", &format!("127.0.0.1:{decide}")),
                ("http://127.0.0.1:3000", &backend.url()),
            ],
        );
        let nginx = Nginx::start(&conf);
        sixth_is_stopped_before_the_backend(&nginx.url(), &backend).await;
        let logged = nginx
            .error_log()
            .contains("auth request unexpected status: 429");
        assert_eq!(
            logged,
            deny_status.is_empty(),
            "{deny_status}: {}",
            nginx.error_log()
        );
        // ratewall gone: nginx answers 500, and lets nothing through unjudged.
        drop(gw);
        let r = HttpClient::new()
            .get(&format!("{}/orders", nginx.url()), &[("x-api-key", "k9")])
            .await;
        assert_eq!(r.status, 500);
        assert_eq!(backend.count("/orders"), 6);
    }
}

/// Caddy with `examples/caddy/Caddyfile`: ratewall's own 429 reaches the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caddy_forward_auth_stops_the_sixth_request_with_a_429() {
    let _watch = common::watchdog();
    let backend = Backend::start().await;
    let (_gw, decide) = gateway(&backend, FIVE_PER_KEY, "");
    let caddy = Caddy::start(|port| {
        filled(
            example("examples/caddy/Caddyfile"),
            &[
                (":8000 {", &format!("http://127.0.0.1:{port} {{")),
                (
                    "reverse_proxy 127.0.0.1:8081",
                    &format!("reverse_proxy 127.0.0.1:{decide}"),
                ),
                (
                    "reverse_proxy 127.0.0.1:3000",
                    &format!("reverse_proxy {}", backend.addr),
                ),
            ],
        )
    });
    sixth_is_stopped_before_the_backend(&caddy.url(), &backend).await;
}

/// A caller outside `trusted_proxies` (here 127.0.0.5, where 127.0.0.1 only is trusted)
/// is judged as the call it made: its `X-Forwarded-For` names no client, and its
/// `X-Forwarded-Uri` no path. From the trusted address the same fields are believed; a
/// description that does not add up is a 400 there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_callers_forwarded_fields_are_ignored() {
    let _watch = common::watchdog();
    let backend = Backend::start().await;
    let rules = "[[rules]]\nname = \"per-ip\"\nkey = \"client_ip\"\nrate = \"1/h\"\nburst = 2\n\
                 [[rules]]\nname = \"free\"\nmatch = { path_prefix = \"/free/\" }\nkey = \"global\"\nrate = \"1/h\"\nburst = 100\n";
    let (_gw, decide) = gateway(&backend, rules, "");
    let url = format!("http://127.0.0.1:{decide}/v1/forward-auth");
    let call = |client: HttpClient, ip: String, extra: Vec<(&'static str, &'static str)>| {
        let url = url.clone();
        async move {
            let mut h = vec![
                ("x-forwarded-for", ip.as_str()),
                ("x-forwarded-method", "GET"),
                ("x-forwarded-proto", "https"),
                ("x-forwarded-host", "api.example.com"),
                ("x-forwarded-uri", "/free/x"),
            ];
            h.retain(|(n, _)| !extra.iter().any(|(e, _)| e == n));
            h.extend(extra);
            client.get(&url, &h).await
        }
    };
    let untrusted = || HttpClient::from_addr(Some("127.0.0.5".parse().expect("an address")));
    // Three calls, each naming a client of its own: one client (127.0.0.5) to ratewall.
    let mut statuses = Vec::new();
    for n in 1..=3 {
        let r = call(untrusted(), format!("203.0.113.{n}"), vec![]).await;
        if r.status == 200 {
            let fields = r.header("ratelimit").unwrap_or_default().to_string();
            assert!(
                fields.starts_with("\"per-ip\";") && !fields.contains("free"),
                "judged as the call itself, not /free/x: {fields}"
            );
        }
        statuses.push(r.status.as_u16());
    }
    assert_eq!(
        statuses,
        [200, 200, 429],
        "the forged client IPs were not believed"
    );
    // From the trusted proxy, each forwarded client is its own, on the path it names.
    for n in 1..=3 {
        let r = call(HttpClient::new(), format!("203.0.113.{n}"), vec![]).await;
        assert_eq!(r.status, 200, "{:?}", r.body);
        let fields = r.header("ratelimit").unwrap_or_default();
        assert!(
            fields.contains("\"free\";r=") && fields.contains("\"per-ip\";r=1"),
            "{fields}"
        );
    }
    // Malformed descriptions from the trusted proxy: a 400 naming the field, never a pass.
    for (extra, says) in [
        (vec![("x-original-uri", "/elsewhere")], "different values"),
        (vec![("x-forwarded-uri", "free/x")], "not a path"),
        (vec![("x-forwarded-host", "a@b.example")], "host"),
        (vec![("x-forwarded-method", "get")], "upper case"),
    ] {
        let r = call(HttpClient::new(), "203.0.113.9".into(), extra.clone()).await;
        assert_eq!(r.status, 400, "{extra:?}: {:?}", r.body);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        let detail = r.json()["detail"].as_str().unwrap_or_default().to_string();
        assert!(detail.contains(says), "{extra:?}: {detail}");
    }
}

/// What forward-auth cannot wait for: a rule that settles by the answer stands as charged
/// (nothing given back, since no answer comes), and a concurrency slot is given back as
/// soon as the decision is made (the next call from the same key gets it again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settlements_stand_and_slots_come_back_at_once() {
    let _watch = common::watchdog();
    let backend = Backend::start().await;
    let rules = "[[rules]]\nname = \"slots\"\nkey = \"api_key\"\nmax_in_flight = 1\n\
                 [[rules]]\nname = \"charged\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 3\n\
                 charge = { statuses = [\"2xx\"], attempts = { rate = \"100/h\", burst = 100 } }\n";
    let (_gw, decide) = gateway(&backend, rules, "");
    let url = format!("http://127.0.0.1:{decide}/v1/forward-auth");
    let client = HttpClient::new();
    let described = [
        ("x-api-key", "k1"),
        ("x-forwarded-method", "POST"),
        ("x-forwarded-host", "api.example.com"),
        ("x-forwarded-uri", "/imports"),
    ];
    let mut seen = Vec::new();
    for _ in 0..4 {
        let r = client.get(&url, &described).await;
        seen.push((
            r.status.as_u16(),
            r.header("ratelimit").unwrap_or_default().to_string(),
        ));
        // Time for a refund to land, were one (wrongly) sent.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let statuses: Vec<u16> = seen.iter().map(|(s, _)| *s).collect();
    assert_eq!(statuses, [200, 200, 200, 429], "{seen:?}");
    for (n, (_, fields)) in seen.iter().take(3).enumerate() {
        assert!(
            fields.starts_with("\"slots\";r=0, "),
            "the slot, free again: {fields}"
        );
        assert!(
            fields.contains(&format!("\"charged\";r={}", 2 - n)),
            "{fields}"
        );
    }
}

/// A real Caddy (Debian's `caddy`) on a free port of 127.0.0.1, its state in a temporary
/// folder, killed on drop.
struct Caddy {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Caddy {
    /// Caddy on the Caddyfile `config(port)` writes.
    fn start(config: impl Fn(u16) -> String) -> Caddy {
        let mut last = String::new();
        for _ in 0..5 {
            match Self::start_once(&config) {
                Ok(c) => return c,
                Err(e) if e.contains("address already in use") => last = e,
                Err(e) => panic!("caddy did not start: {e}"),
            }
        }
        panic!("caddy found its port taken five times: {last}");
    }

    fn start_once(config: &impl Fn(u16) -> String) -> Result<Caddy, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let file = dir.path().join("Caddyfile");
        std::fs::write(&file, config(port)).expect("write the Caddyfile");
        let log = dir.path().join("caddy.log");
        let mut child = Command::new("caddy")
            .args(["run", "--adapter", "caddyfile", "--config"])
            .arg(&file)
            .env("HOME", dir.path())
            .env("XDG_DATA_HOME", dir.path())
            .env("XDG_CONFIG_HOME", dir.path())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("a log file"))
            .spawn()
            .map_err(|e| format!("spawn caddy (is it installed? scripts/test installs it): {e}"))?;
        let end = Instant::now() + Duration::from_secs(15);
        while Instant::now() < end {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("caddy exited {status}: {log}"));
            }
            let log_text = std::fs::read_to_string(&log).unwrap_or_default();
            if log_text.contains("serving initial configuration")
                && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            {
                return Ok(Caddy {
                    port,
                    child,
                    _dir: dir,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        Err("caddy did not listen within 15 s".into())
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Caddy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
