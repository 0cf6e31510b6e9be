//! Observability end to end: `/metrics` parsed as Prometheus text, the JSON access log, the
//! admin API (state, reset, top), the status page rendered by headless Chromium, and
//! `ratewall check --path`. Real processes only: the `ratewall` binary, a real upstream,
//! a real redis-server.

use crate::common;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    api_key_hash, remaining, upstream_and_store, Gateway, HttpClient, RedisServer, Reply, Scrape,
    Store, Upstream,
};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// The admin token the tests configure (at least 16 characters).
const ADMIN_TOKEN: &str = "obs-admin-token-0123456789abcdef";

// ---------------------------------------------------------------------------------------
// Helpers

/// An upstream that answers 500 to paths ending in `/boom`, answers after `<ms>` to paths
/// containing `/slow/<ms>`, and 200 "ok" to anything else.
struct FaultyUpstream {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl FaultyUpstream {
    async fn start() -> FaultyUpstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(async move {
                    let svc = service_fn(|req: Request<Incoming>| async move {
                        let path = req.uri().path().to_string();
                        if let Some(ms) = path
                            .split_once("/slow/")
                            .and_then(|(_, ms)| ms.parse::<u64>().ok())
                        {
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                        }
                        let mut resp = Response::new(Full::new(Bytes::from_static(b"ok\n")));
                        if path.ends_with("/boom") {
                            *resp.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                        }
                        Ok::<_, Infallible>(resp)
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        FaultyUpstream { addr, task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for FaultyUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The gateway, once both its listeners accept (the harness waits for the public one).
/// A gateway with the admin token configured, unless `body` has an `[admin]` table.
fn start(body: &str) -> Gateway {
    admin_ready(Gateway::start(&with_token(body)))
}

fn with_token(body: &str) -> String {
    if body.contains("[admin]") {
        body.to_string()
    } else {
        format!("[admin]\ntoken = \"{ADMIN_TOKEN}\"\n{body}")
    }
}

/// A GET on the admin API, with the admin token.
async fn admin_get(client: &HttpClient, url: &str) -> Reply {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    client.get(url, &[("authorization", auth.as_str())]).await
}

fn start_with(body: &str, args: &[&str], env: &[(&str, &str)]) -> Gateway {
    admin_ready(Gateway::start_with(body, args, env))
}

/// [`start_with`], with the admin token configured.
fn start_with_token(body: &str, args: &[&str], env: &[(&str, &str)]) -> Gateway {
    start_with(&with_token(body), args, env)
}

fn admin_ready(gw: Gateway) -> Gateway {
    let end = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", gw.admin_port)).is_err() {
        assert!(
            Instant::now() < end,
            "the admin listener did not come up:\n{}",
            gw.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    gw
}

fn map2(entries: &[(&str, &str, u64)]) -> BTreeMap<(String, String), u64> {
    entries
        .iter()
        .map(|(a, b, v)| ((a.to_string(), b.to_string()), *v))
        .collect()
}

fn map1(entries: &[(&str, u64)]) -> BTreeMap<String, u64> {
    entries.iter().map(|(a, v)| (a.to_string(), *v)).collect()
}

/// `after - before`, per series, keeping what changed.
fn delta<K: Ord + Clone>(after: &BTreeMap<K, u64>, before: &BTreeMap<K, u64>) -> BTreeMap<K, u64> {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v.saturating_sub(before.get(k).copied().unwrap_or(0));
            (d > 0).then(|| (k.clone(), d))
        })
        .collect()
}

fn is_short_id(s: &str) -> bool {
    s.len() == 8
        && s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// `/admin/state`'s identity (8 hex digits) for one API key under rule `api`.
async fn identity_of(client: &HttpClient, gw: &Gateway, key: &str) -> String {
    let r = admin_get(
        client,
        &gw.admin_url(&format!("/admin/state?rule=api&key={key}")),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "/admin/state for a key");
    let id = r.json()["identity"]
        .as_str()
        .expect("identity is a string")
        .to_string();
    assert!(
        is_short_id(&id),
        "identity {id:?} is 8 lowercase hex digits"
    );
    id
}

async fn admin_post(client: &HttpClient, url: &str, token: Option<&str>) -> Reply {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    client.send("POST", url, &headers, Bytes::new()).await
}

/// Keys `<prefix>:{<digest>}:<rule>` in Redis (the digest `/admin/state` gives).
fn redis_keys_of(redis: &RedisServer, prefix: &str, digest: &str, rule: &str) -> Vec<String> {
    common::scan(&mut redis.conn(), &format!("{prefix}:{{{digest}}}:{rule}"))
}

/// The text of the element with `id="<id>"` up to its first child tag.
fn element_text<'d>(dom: &'d str, id: &str) -> Option<&'d str> {
    let at = dom.find(&format!("id=\"{id}\""))?;
    let open_end = at + dom[at..].find('>')? + 1;
    let len = dom[open_end..].find('<')?;
    Some(dom[open_end..open_end + len].trim())
}

/// The inner HTML of the `<tbody id="<id>">`.
fn tbody<'d>(dom: &'d str, id: &str) -> &'d str {
    let at = dom
        .find(&format!("<tbody id=\"{id}\">"))
        .unwrap_or_else(|| panic!("no tbody #{id} in the DOM:\n{dom}"));
    let rest = &dom[at..];
    &rest[..rest.find("</tbody>").expect("</tbody>")]
}

/// Run headless Chromium on `url` with `extra` arguments; at most 90 s. Its stdout.
async fn run_chromium(url: &str, extra: &[String]) -> String {
    let profile = tempfile::tempdir().expect("profile dir");
    let mut cmd = tokio::process::Command::new(common::chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .arg("--virtual-time-budget=5000")
    .args(extra)
    .arg(url)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    let child = cmd.spawn().expect("spawn chromium");
    let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output())
        .await
        .expect("chromium did not finish within 90 s")
        .expect("chromium output");
    assert!(
        out.status.success(),
        "chromium failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("the DOM is UTF-8")
}

/// Run the `ratewall` binary with `args`, at most 30 s: (exit code, stdout, stderr).
fn run_ratewall(args: &[&str]) -> (i32, String, String) {
    run_ratewall_with(args, &[])
}

/// [`run_ratewall`] with `env` set for it.
fn run_ratewall_with(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (out_path, err_path) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewall"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("spawn ratewall");
    let end = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait ratewall") {
            break s;
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("ratewall {args:?} did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    (
        status.code().unwrap_or(-1),
        read(&out_path),
        read(&err_path),
    )
}

// ---------------------------------------------------------------------------------------
// 1. Metrics count known traffic exactly

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_known_traffic_exactly() {
    let _watch = common::watchdog();
    const K1: &str = "sk_live_metrics_alpha_7c1d";
    const K2: &str = "sk_live_metrics_bravo_2b9e";
    let upstream = FaultyUpstream::start().await;
    // `api` applies under /api/v1/, `site` under all of /api/; /health/* is unlimited.
    let body = format!(
        "[upstream]\nurl = \"{}\"\nconnect_timeout = \"1s\"\ntimeout = \"2s\"\n\
         [store]\nbackend = \"memory\"\n\
         [[rules]]\nname = \"api\"\nmatch = {{ path_prefix = \"/api/v1/\" }}\nkey = \"api_key\"\n\
         rate = \"1/h\"\nburst = 3\n\
         [[rules]]\nname = \"site\"\nmatch = {{ path_prefix = \"/api/\" }}\nkey = \"global\"\n\
         rate = \"1/h\"\nburst = 100\n",
        upstream.url()
    );
    let gw = start(&body);
    let client = HttpClient::new();
    let key1 = [("x-api-key", K1)];

    // 3 allowed, then 2 denied by `api` (which `site` counts as denied by another: it
    // charged nothing).
    for i in 0..5 {
        let r = client.get(&gw.url("/api/v1/orders"), &key1).await;
        let want = if i < 3 { 200 } else { 429 };
        assert_eq!(r.status.as_u16(), want, "request {i} with K1");
    }
    // 2 without a key: 401, before any limit is consulted.
    for _ in 0..2 {
        let r = client.get(&gw.url("/api/v1/orders"), &[]).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    }
    // `site` only.
    let r = client.get(&gw.url("/api/ping"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "/api/ping");
    // No rule.
    let r = client.get(&gw.url("/health"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "/health");
    // Allowed by both rules; the upstream answers 500.
    let r = client
        .get(&gw.url("/api/v1/boom"), &[("x-api-key", K2)])
        .await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "/api/v1/boom");
    // No rule; the upstream is slower than the 2 s timeout: the gateway answers 504.
    let r = client.get(&gw.url("/health/slow/6000"), &[]).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "/health/slow/6000");

    // One good reload, one rejected.
    gw.rewrite_config(&body);
    gw.signal("HUP");
    assert!(
        gw.wait_for_log("config reloaded", 1, Duration::from_secs(15)),
        "the valid file was not reloaded:\n{}",
        gw.logs()
    );
    gw.rewrite_config("[upstream]\nurl = \"http://127.0.0.1:1\"\nno_such_key = true\n");
    gw.signal("HUP");
    assert!(
        gw.wait_for_log("config reload rejected", 1, Duration::from_secs(15)),
        "the invalid file was not rejected:\n{}",
        gw.logs()
    );

    let m = Scrape::take(&client, &gw).await;
    let ctx = format!("\n--- /metrics ---\n{}", m.text);
    assert_eq!(
        m.nonzero2("ratewall_requests_total", "rule", "decision"),
        map2(&[
            ("api", "allowed", 4),
            ("api", "denied", 2),
            // The two requests without a key: `api` refused them, and `site`, which needs
            // no key, charged them all the same.
            ("api", "refused", 2),
            ("site", "allowed", 3 + 1 + 1),
            ("site", "denied_by_other", 2),
            ("site", "refused_by_other", 2),
        ]),
        "ratewall_requests_total by rule and decision{ctx}"
    );
    assert_eq!(
        m.nonzero2("ratewall_responses_total", "class", "source"),
        map2(&[
            ("2xx", "upstream", 3 + 1 + 1),
            ("4xx", "gateway", 2 + 2),
            ("5xx", "upstream", 1),
            ("5xx", "gateway", 1),
        ]),
        "ratewall_responses_total by class and source{ctx}"
    );
    // Limited requests that reached the store: 3 + 2 (api+site) + 2 (the 401s, charged to
    // site alone) + 1 (site) + 1 (boom).
    // Should a deny cache answer a denial without a store call, it counts there instead.
    let cache_hits = m.scalar("ratewall_deny_cache_hits_total");
    assert!(cache_hits <= 2.0, "only 2 requests were denied{ctx}");
    assert_eq!(
        m.get(
            "ratewall_store_call_duration_seconds_count",
            &[("backend", "memory")]
        ),
        9.0 - cache_hits,
        "one store call per limited request{ctx}"
    );
    assert_eq!(
        m.nonzero1("ratewall_store_call_duration_seconds_count", "backend"),
        map1(&[("memory", 9 - cache_hits as u64)]),
        "only the memory backend{ctx}"
    );
    assert_eq!(
        m.nonzero1("ratewall_upstream_responses_total", "class"),
        map1(&[("2xx", 5), ("5xx", 1), ("error", 1)]),
        "ratewall_upstream_responses_total by class{ctx}"
    );
    assert_eq!(
        m.scalar("ratewall_upstream_duration_seconds_count"),
        7.0,
        "one upstream timing per forwarded request{ctx}"
    );
    assert_eq!(
        m.nonzero1("ratewall_config_reloads_total", "result"),
        map1(&[("ok", 1), ("rejected", 1)]),
        "ratewall_config_reloads_total{ctx}"
    );
    assert_eq!(
        m.nonzero1("ratewall_store_errors_total", "kind"),
        BTreeMap::new(),
        "no store errors{ctx}"
    );
    assert_eq!(m.scalar("ratewall_in_flight_requests"), 0.0, "{ctx}");
    assert_eq!(m.scalar("ratewall_store_breaker_open"), 0.0, "{ctx}");

    // No label carries a key or an address; nor does anything else in the text.
    let values = m.label_values();
    assert!(values.len() >= 10, "labels were parsed: {values:?}");
    // A pool's `server` label is its URL as the file writes it (here the test's upstream on
    // 127.0.0.1): the operator's own value, not a client's address.
    let upstream_url = upstream.url();
    for v in values.iter().filter(|v| **v != upstream_url) {
        for secret in [K1, K2, "127.0.0.1"] {
            assert!(
                !v.contains(secret),
                "label value {v:?} carries {secret:?}{ctx}"
            );
        }
    }
    let text = m.text.replace(&upstream_url, "the upstream's URL");
    for secret in [K1, K2, "127.0.0.1"] {
        assert!(!text.contains(secret), "/metrics carries {secret:?}{ctx}");
    }
}

/// Every labelled series the config implies, present (at 0) before any traffic: an
/// alert's query answers 0, not nothing.
fn assert_series_at_zero(m: &Scrape, rules: &[&str], ctx: &str) {
    let mut missing = Vec::new();
    let mut need = |metric: &str, labels: &[(&str, &str)]| {
        if m.find(metric, labels).is_none() {
            missing.push(format!("{metric}{labels:?}"));
        }
    };
    for rule in rules {
        for decision in [
            "allowed",
            "delayed",
            "denied",
            "shadow_denied",
            "denied_by_other",
            "error",
            "refused",
            "bad_key",
        ] {
            need(
                "ratewall_requests_total",
                &[("rule", rule), ("decision", decision)],
            );
        }
        for outcome in ["upstream_error", "upstream_timeout"] {
            need(
                "ratewall_rule_upstream_failures_total",
                &[("rule", rule), ("outcome", outcome)],
            );
        }
    }
    for kind in [
        "timeout",
        "connection",
        "data",
        "unreplicated",
        "breaker_open",
        "full",
        "other",
    ] {
        need("ratewall_store_errors_total", &[("kind", kind)]);
    }
    for result in ["ok", "rejected"] {
        need("ratewall_config_reloads_total", &[("result", result)]);
    }
    for reason in [
        "missing_key",
        "unknown_key",
        "malformed",
        "not_implemented",
        "no_route",
    ] {
        need("ratewall_refusals_total", &[("reason", reason)]);
    }
    for outcome in OUTCOMES {
        need(
            "ratewall_request_duration_seconds_count",
            &[("outcome", outcome)],
        );
    }
    for class in ["1xx", "2xx", "3xx", "4xx", "5xx"] {
        for source in ["upstream", "gateway"] {
            need(
                "ratewall_responses_total",
                &[("class", class), ("source", source)],
            );
        }
    }
    for class in ["1xx", "2xx", "3xx", "4xx", "5xx", "error"] {
        need("ratewall_upstream_responses_total", &[("class", class)]);
    }
    assert!(
        missing.is_empty(),
        "series missing before their first event:\n  {}{ctx}",
        missing.join("\n  ")
    );
}

/// The request outcomes, as `ratewall_request_duration_seconds{outcome}` and
/// `/status.json` name them.
const OUTCOMES: [&str; 10] = [
    "allowed",
    "denied",
    "unauthorized",
    "bad_request",
    "no_route",
    "store_unavailable",
    "overloaded",
    "upstream_error",
    "upstream_timeout",
    "client_error",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alertable_series_exist_at_zero_and_a_request_counts_once_per_rule_and_once_in_total() {
    let _watch = common::watchdog();
    const K1: &str = "sk_live_alerts_one_1111";
    const K2: &str = "sk_live_alerts_two_2222";
    const K3: &str = "sk_live_alerts_three_3333";
    let upstream = FaultyUpstream::start().await;
    // `per-key` counts each key (2 each), `all` everyone (4 in all); keys not listed are
    // refused.
    let rules = format!(
        "[upstream]\nurl = \"{}\"\nconnect_timeout = \"1s\"\ntimeout = \"1s\"\n\
         [store]\nbackend = \"memory\"\n\
         [keys]\nunknown = \"reject\"\n[keys.plans]\n\"{K1}\" = \"std\"\n\"{K2}\" = \"std\"\n\"{K3}\" = \"std\"\n\
         [[rules]]\nname = \"per-key\"\nmatch = {{ path_prefix = \"/api/\" }}\nkey = \"api_key\"\n\
         rate = \"1/h\"\nburst = 2\n[rules.plans.std]\nrate = \"1/h\"\nburst = 2\n\
         [[rules]]\nname = \"all\"\nmatch = {{ path_prefix = \"/api/\" }}\nkey = \"global\"\n\
         rate = \"1/h\"\nburst = 7\n",
        upstream.url()
    );
    let gw = start(&rules);
    let client = HttpClient::new();

    let m = Scrape::take(&client, &gw).await;
    let ctx = format!("\n--- /metrics ---\n{}", m.text);
    assert_series_at_zero(&m, &["per-key", "all"], &ctx);
    assert_eq!(
        m.find(
            "ratewall_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0),
        "ratewall_build_info{{version}} = 1{ctx}"
    );
    assert!(
        m.text
            .contains("# TYPE ratewall_request_duration_seconds histogram"),
        "{ctx}"
    );

    let get = |key: Option<&'static str>, path: &'static str| {
        let client = &client;
        let url = gw.url(path);
        async move {
            let headers: Vec<(&str, &str)> = key.map(|k| ("x-api-key", k)).into_iter().collect();
            client.get(&url, &headers).await.status.as_u16()
        }
    };
    // Both rules allow: per-key K1 2 -> 0, all 7 -> 5.
    assert_eq!(get(Some(K1), "/api/x").await, 200);
    assert_eq!(get(Some(K1), "/api/x").await, 200);
    // Allowed by both, then the upstream is slower than its 1 s timeout: 504.
    assert_eq!(get(Some(K2), "/api/slow/3000").await, 504);
    assert_eq!(get(Some(K2), "/api/x").await, 200);
    // Refused by per-key for their keys: no key, a key not listed, a key sent twice.
    // Each is charged to `all`, which needs no credential: 3 -> 0.
    assert_eq!(get(None, "/api/x").await, 401);
    assert_eq!(get(Some("sk_live_not_listed_0000"), "/api/x").await, 401);
    let twice = client
        .get(&gw.url("/api/x"), &[("x-api-key", K1), ("x-api-key", K2)])
        .await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST, "a key sent twice");
    // `all` is spent. K1: denied by both rules (per-key is spent too).
    assert_eq!(get(Some(K1), "/api/x").await, 429);
    // K3: `per-key` allows (and is not charged), `all` denies.
    assert_eq!(get(Some(K3), "/api/x").await, 429);
    // A request without a key now: `all` denies it before its key is looked at.
    assert_eq!(get(None, "/api/x").await, 429);
    // A malformed head, refused before any rule: a lower-case standard method.
    let lower = client
        .send("get", &gw.url("/api/x"), &[], Bytes::new())
        .await;
    assert_eq!(lower.status, StatusCode::BAD_REQUEST, "method get");
    // No rule applies.
    assert_eq!(get(None, "/health").await, 200);

    let m = Scrape::take(&client, &gw).await;
    let ctx = format!("\n--- /metrics ---\n{}", m.text);
    // Per rule: the rule's own decision, once per rule that applied.
    assert_eq!(
        m.nonzero2("ratewall_requests_total", "rule", "decision"),
        map2(&[
            // K3's is not per-key's pass: `all` denied it, so per-key charged nothing. K2's
            // 504 is no rule's pass either: their upstream failure, below.
            ("per-key", "allowed", 3),
            ("per-key", "denied_by_other", 1),
            ("per-key", "denied", 1),
            // No key and a key not listed: 401; the key sent twice: 400.
            ("per-key", "refused", 2),
            ("per-key", "bad_key", 1),
            ("all", "allowed", 3),
            ("all", "denied", 3),
            // The three refused for their keys, charged here all the same.
            ("all", "refused_by_other", 3),
        ]),
        "ratewall_requests_total{ctx}"
    );
    assert_eq!(
        m.nonzero2("ratewall_rule_upstream_failures_total", "rule", "outcome"),
        map2(&[
            ("per-key", "upstream_timeout", 1),
            ("all", "upstream_timeout", 1)
        ]),
        "ratewall_rule_upstream_failures_total{ctx}"
    );
    // In total: every request once. Three 429s, though the per-rule denials add up to 4.
    let count = |outcome: &str| {
        m.get(
            "ratewall_request_duration_seconds_count",
            &[("outcome", outcome)],
        ) as u64
    };
    let totals: BTreeMap<String, u64> = OUTCOMES
        .iter()
        .map(|o| (o.to_string(), count(o)))
        .filter(|(_, n)| *n > 0)
        .collect();
    assert_eq!(
        totals,
        map1(&[
            ("allowed", 4),
            ("denied", 3),
            ("unauthorized", 2),
            ("bad_request", 2),
            ("upstream_timeout", 1)
        ]),
        "ratewall_request_duration_seconds_count by outcome{ctx}"
    );
    assert_eq!(
        m.nonzero1("ratewall_refusals_total", "reason"),
        map1(&[("missing_key", 1), ("unknown_key", 1), ("malformed", 2)]),
        "ratewall_refusals_total{ctx}"
    );
    // The 504 took the upstream's 1 s timeout, end to end; the rest far less.
    let slow = m.get(
        "ratewall_request_duration_seconds_sum",
        &[("outcome", "upstream_timeout")],
    );
    assert!((0.9..10.0).contains(&slow), "the 504 took {slow} s{ctx}");
    // The status page's numbers are these.
    let stats = client.get(&gw.admin_url("/status.json"), &[]).await.json();
    for o in OUTCOMES {
        assert_eq!(
            stats["totals"][o].as_u64(),
            Some(count(o)),
            "/status.json totals.{o}: {stats}"
        );
    }

    // A rule added by a reload has its series at once, at zero.
    gw.rewrite_config(&format!(
        "{rules}[[rules]]\nname = \"added\"\nmatch = {{ path_prefix = \"/other/\" }}\n\
         key = \"client_ip\"\nrate = \"5/s\"\n"
    ));
    gw.reload(1);
    let m = Scrape::take(&client, &gw).await;
    let ctx = format!("\n--- /metrics ---\n{}", m.text);
    assert_series_at_zero(&m, &["per-key", "all", "added"], &ctx);
    assert_eq!(
        m.nonzero1("ratewall_config_reloads_total", "result"),
        map1(&[("ok", 1)]),
        "{ctx}"
    );
}

// ---------------------------------------------------------------------------------------
// 2. Store errors and the breaker

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_store_errors_and_the_breaker() {
    let _watch = common::watchdog();
    const FAILED: usize = 6;
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = start(&format!(
        "[upstream]\nurl = \"{}\"\nconnect_timeout = \"1s\"\ntimeout = \"5s\"\n\
         [store]\nbackend = \"redis\"\nurl = \"{}\"\nprefix = \"rwobs\"\ntimeout = \"100ms\"\n\
         on_error = \"deny\"\nbreaker_failures = 3\nbreaker_cooldown = \"60s\"\n\
         [[rules]]\nname = \"api\"\nmatch = {{ path_prefix = \"/api/\" }}\nkey = \"api_key\"\n\
         rate = \"1/h\"\nburst = 100\n\
         [[rules]]\nname = \"site\"\nkey = \"global\"\nrate = \"1/h\"\nburst = 100\n",
        upstream.url(),
        redis.url()
    ));
    let client = HttpClient::new();
    let key = [("x-api-key", "sk_live_breaker_test_0001")];

    // Requests while Redis answers, until one passes: the connection and the scripts are
    // up. (On a loaded box the very first call may miss the 100 ms store timeout.)
    let passed = client
        .until_status(
            &gw.url("/api/x"),
            &key,
            StatusCode::OK,
            Duration::from_secs(20),
        )
        .await;
    assert!(
        passed.is_some(),
        "no request passed while Redis was up\n{}",
        gw.logs()
    );
    // Counts so far; what follows is measured from here.
    let before = Scrape::take(&client, &gw).await;
    assert_eq!(
        before.scalar("ratewall_store_breaker_open"),
        0.0,
        "the breaker is closed while Redis answers\n{}",
        before.text
    );

    tokio::task::block_in_place(|| redis.kill());
    for i in 0..FAILED {
        let t = Instant::now();
        let r = client.get(&gw.url("/api/x"), &key).await;
        assert_eq!(
            r.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "request {i} with Redis down, on_error = deny"
        );
        assert_eq!(r.header("retry-after"), Some("1"));
        // Within the store timeout, not a wait for Redis: within WAIT, room for any load.
        assert!(
            t.elapsed() < common::WAIT,
            "request {i} took {:?}",
            t.elapsed()
        );
    }
    let ready = client.get(&gw.admin_url("/readyz"), &[]).await;
    assert_eq!(
        ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "/readyz while on_error = deny turns requests away"
    );

    let m = Scrape::take(&client, &gw).await;
    let ctx = format!(
        "\n--- /metrics before ---\n{}\n--- /metrics after ---\n{}\n--- log ---\n{}",
        before.text,
        m.text,
        gw.logs()
    );
    let kind = "kind";
    let errors = delta(
        &m.nonzero1("ratewall_store_errors_total", kind),
        &before.nonzero1("ratewall_store_errors_total", kind),
    );
    let outage = errors.get("connection").copied().unwrap_or(0)
        + errors.get("timeout").copied().unwrap_or(0);
    assert_eq!(
        errors.values().sum::<u64>(),
        FAILED as u64,
        "one store error per failed request: {errors:?}{ctx}"
    );
    assert_eq!(
        outage, 3,
        "the first breaker_failures = 3 calls fail as connection or timeout: {errors:?}{ctx}"
    );
    assert_eq!(
        errors.get("breaker_open").copied().unwrap_or(0),
        FAILED as u64 - 3,
        "after 3 outages in a row the breaker answers: {errors:?}{ctx}"
    );
    assert_eq!(m.scalar("ratewall_store_breaker_open"), 1.0, "{ctx}");
    let (rule, decision) = ("rule", "decision");
    assert_eq!(
        delta(
            &m.nonzero2("ratewall_requests_total", rule, decision),
            &before.nonzero2("ratewall_requests_total", rule, decision),
        ),
        map2(&[
            ("api", "error", FAILED as u64),
            ("site", "error", FAILED as u64),
        ]),
        "decision=error: failed requests x rules applied{ctx}"
    );
    let error_total =
        |s: &Scrape| -> f64 { s.sum("ratewall_requests_total", &[("decision", "error")]) };
    assert_eq!(
        error_total(&m) - error_total(&before),
        (FAILED * 2) as f64,
        "decision=error over every rule{ctx}"
    );
    let (class, source) = ("class", "source");
    assert_eq!(
        delta(
            &m.nonzero2("ratewall_responses_total", class, source),
            &before.nonzero2("ratewall_responses_total", class, source),
        ),
        map2(&[("5xx", "gateway", FAILED as u64)]),
        "{ctx}"
    );
    // Calls tried: the 3 that failed; the breaker skips the rest.
    let calls = |s: &Scrape| {
        s.get(
            "ratewall_store_call_duration_seconds_count",
            &[("backend", "redis")],
        )
    };
    assert!(calls(&before) >= 1.0, "{ctx}");
    assert_eq!(calls(&m) - calls(&before), 3.0, "{ctx}");
    assert_eq!(m.scalar("ratewall_in_flight_requests"), 0.0, "{ctx}");
}

// ---------------------------------------------------------------------------------------
// 3. The access log

/// One request the access-log test sends.
struct Sent {
    method: &'static str,
    url: &'static str,
    key: Option<&'static str>,
    status: u16,
}

/// What its access event must say.
struct Logged {
    path: &'static str,
    rule: &'static str,
    decision: &'static str,
    id: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_has_one_json_event_per_request() {
    let _watch = common::watchdog();
    const K1: &str = "sk_live_access_log_one_a1a1";
    const K2: &str = "sk_live_access_log_two_b2b2";
    let upstream = Upstream::start().await;
    let gw = start_with_token(
        &format!(
            "{}[[rules]]\nname = \"api\"\nmatch = {{ path_prefix = \"/api/v1/\" }}\n\
             key = \"api_key\"\nrate = \"1/h\"\nburst = 2\n\
             [[rules]]\nname = \"site\"\nmatch = {{ path_prefix = \"/api/\" }}\nkey = \"global\"\n\
             rate = \"1/h\"\nburst = 100\n",
            upstream_and_store(&upstream.url(), &Store::Memory)
        ),
        &["--log-format", "json"],
        &[],
    );
    let client = HttpClient::new();
    let id1 = identity_of(&client, &gw, K1).await;
    let id2 = identity_of(&client, &gw, K2).await;
    assert_ne!(id1, id2, "two keys, two identities");
    let global = {
        let r = admin_get(&client, &gw.admin_url("/admin/state?rule=site")).await;
        assert_eq!(r.status, StatusCode::OK, "/admin/state of a global rule");
        r.json()["identity"].as_str().expect("identity").to_string()
    };
    assert!(is_short_id(&global));

    // What each request is, what it gets, and what its access event must say.
    let sent = |method, url, key, status| Sent {
        method,
        url,
        key,
        status,
    };
    let logged = |path, rule, decision, id: &str| Logged {
        path,
        rule,
        decision,
        id: id.to_string(),
    };
    let cases = [
        (
            sent("GET", "/api/v1/orders?token=secret123", Some(K1), 200),
            logged("/api/v1/orders", "api", "allowed", &id1),
        ),
        (
            sent("POST", "/api/v1/orders", Some(K1), 200),
            logged("/api/v1/orders", "api", "allowed", &id1),
        ),
        (
            sent("GET", "/api/v1/orders", Some(K1), 429),
            logged("/api/v1/orders", "api", "denied", &id1),
        ),
        (
            // The rule that refused it: `api` needs a key.
            sent("GET", "/api/v1/orders", None, 401),
            logged("/api/v1/orders", "api", "unauthorized", "-"),
        ),
        (
            sent("GET", "/public/page?token=secret123", None, 200),
            logged("/public/page", "-", "unlimited", "-"),
        ),
        (
            sent("GET", "/api/status", None, 200),
            logged("/api/status", "site", "allowed", &global),
        ),
        (
            sent("PUT", "/api/v1/items", Some(K2), 200),
            logged("/api/v1/items", "api", "allowed", &id2),
        ),
    ];
    for (req, _) in &cases {
        let headers: Vec<(&str, &str)> =
            req.key.map(|k| vec![("x-api-key", k)]).unwrap_or_default();
        let r = client
            .send(req.method, &gw.url(req.url), &headers, Bytes::new())
            .await;
        assert_eq!(r.status.as_u16(), req.status, "{} {}", req.method, req.url);
    }
    assert!(
        gw.wait_for_log("ratewall::access", cases.len(), Duration::from_secs(10)),
        "access events missing:\n{}",
        gw.logs()
    );
    let logs = gw.logs();
    let mut events = Vec::new();
    for line in logs.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a log line is not JSON ({e}): {line}"));
        if v["target"] == "ratewall::access" {
            events.push(v);
        }
    }
    assert_eq!(
        events.len(),
        cases.len(),
        "one access event per request:\n{logs}"
    );
    for (event, (req, want)) in events.iter().zip(&cases) {
        let f = &event["fields"];
        let ctx = format!("{} {}: {event}", req.method, req.url);
        assert_eq!(event["level"], "INFO", "{ctx}");
        assert_eq!(f["method"], req.method, "{ctx}");
        assert_eq!(f["path"], want.path, "{ctx}");
        assert_eq!(f["status"], req.status, "{ctx}");
        assert_eq!(f["rule"], want.rule, "{ctx}");
        assert_eq!(f["decision"], want.decision, "{ctx}");
        assert_eq!(f["id"], want.id.as_str(), "{ctx}");
        assert!(f["latency_us"].is_u64(), "latency_us is a number: {ctx}");
    }
    for secret in ["secret123", K1, K2, "token="] {
        assert!(
            !logs.contains(secret),
            "{secret:?} appears in the log:\n{logs}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// 4. Admin state and reset

fn admin_rules() -> &'static str {
    "[[rules]]\nname = \"api\"\nmatch = { path_prefix = \"/api/\" }\nkey = \"api_key\"\n\
     rate = \"1/h\"\nburst = 5\n\
     [rules.plans.vip]\nexempt = true\n\
     [[rules]]\nname = \"by-ip\"\nmatch = { path_prefix = \"/ip/\" }\nkey = \"client_ip\"\n\
     rate = \"1/h\"\nburst = 5\n\
     [keys.plans]\n\"sk_vip_exempt_from_api\" = \"vip\"\n"
}

async fn admin_state_and_reset(store: Store, redis: Option<&RedisServer>) {
    const KEY: &str = "sk_live_state_reset_5a5a";
    const BURST: i64 = 5;
    let upstream = Upstream::start().await;
    let gw = start(&format!(
        "[admin]\ntoken = \"{ADMIN_TOKEN}\"\n{}{}",
        upstream_and_store(&upstream.url(), &store),
        admin_rules()
    ));
    let client = HttpClient::new();
    let key = [("x-api-key", KEY)];
    let state_url = gw.admin_url(&format!("/admin/state?rule=api&key={KEY}"));
    let reset_url = gw.admin_url(&format!("/admin/reset?rule=api&key={KEY}"));
    let state = || async {
        let r = admin_get(&client, &state_url).await;
        assert_eq!(r.status, StatusCode::OK, "/admin/state");
        r.json()
    };

    let mut last = None;
    for _ in 0..2 {
        let r = client.get(&gw.url("/api/x"), &key).await;
        assert_eq!(r.status, StatusCode::OK);
        last = Some(remaining(&r, "api"));
    }
    let r_after_two = last.expect("two requests");
    assert_eq!(r_after_two, BURST - 2);

    let s1 = state().await;
    let s2 = state().await;
    assert_eq!(
        s1["remaining"], r_after_two,
        "state = last RateLimit r: {s1}"
    );
    assert_eq!(
        s2["remaining"], r_after_two,
        "inspecting charges nothing: {s2}"
    );
    assert_eq!(s1["rule"], "api");
    assert_eq!(s1["algorithm"], "token_bucket");
    assert_eq!(s1["limit"], 1);
    assert_eq!(s1["window_s"], 3600);
    assert_eq!(s1["burst"], BURST);
    assert_eq!(s1["cost"], 1);
    assert_eq!(s1["allowed_now"], true);
    assert!(s1["reset_s"].as_u64().is_some_and(|t| t > 0), "{s1}");
    let id = s1["identity"].as_str().expect("identity").to_string();
    assert!(is_short_id(&id), "{s1}");
    // Its Redis keys are named by its digest; the tag shown is keyed, not the digest's start.
    let digest = s1["digest"].as_str().expect("digest").to_string();
    assert_eq!(digest.len(), 32, "{s1}");
    assert!(!digest.starts_with(&id), "{s1}");
    assert!(
        !s1.to_string().contains(KEY),
        "the answer never names the key"
    );

    let r = client.get(&gw.url("/api/x"), &key).await;
    assert_eq!(
        remaining(&r, "api"),
        r_after_two - 1,
        "the next real request is the only one charged"
    );
    assert_eq!(state().await["remaining"], r_after_two - 1);

    if let Some(redis) = redis {
        let keys = redis_keys_of(redis, "rwtest", &digest, "api");
        assert_eq!(keys.len(), 1, "the identity's Redis key exists: {keys:?}");
    }

    // Mutating calls need the token.
    let r = admin_post(&client, &reset_url, None).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "reset without a token");
    let r = admin_post(
        &client,
        &reset_url,
        Some("obs-admin-token-WRONG-456789abcdef"),
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::UNAUTHORIZED,
        "reset with a wrong token"
    );
    let r = admin_post(
        &client,
        &reset_url,
        Some(&ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1]),
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::UNAUTHORIZED,
        "reset with a token prefix"
    );
    assert_eq!(
        state().await["remaining"],
        r_after_two - 1,
        "refused resets changed nothing"
    );

    let r = admin_post(&client, &reset_url, Some(ADMIN_TOKEN)).await;
    assert_eq!(r.status, StatusCode::OK, "reset with the token");
    let body = r.json();
    assert_eq!(body["rule"], "api", "{body}");
    assert_eq!(body["identity"], id.as_str(), "{body}");
    assert_eq!(body["reset"], true, "{body}");
    assert!(!body.to_string().contains(KEY));
    if let Some(redis) = redis {
        let keys = redis_keys_of(redis, "rwtest", &digest, "api");
        assert!(keys.is_empty(), "reset deleted the Redis key: {keys:?}");
    }
    assert_eq!(
        state().await["remaining"],
        BURST,
        "a full bucket after reset"
    );
    let r = client.get(&gw.url("/api/x"), &key).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(remaining(&r, "api"), BURST - 1, "the bucket starts over");
    if let Some(redis) = redis {
        let keys = redis_keys_of(redis, "rwtest", &digest, "api");
        assert_eq!(
            keys.len(),
            1,
            "the next request wrote the key again: {keys:?}"
        );
    }

    // Bad inputs.
    // A key whose plan is exempt from the rule has no state under it: 404, saying why.
    let r = admin_get(
        &client,
        &gw.admin_url("/admin/state?rule=api&key=sk_vip_exempt_from_api"),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "an exempt plan's key");
    let error = r.json()["error"].to_string();
    assert!(error.contains("exempt"), "{error}");
    assert!(!error.contains("sk_vip"), "no key material: {error}");

    for (path, want) in [
        (format!("/admin/state?rule=nope&key={KEY}"), 404),
        ("/admin/state?rule=api".to_string(), 400),
        ("/admin/state?rule=api&key=".to_string(), 400),
        ("/admin/state?key=x".to_string(), 400),
        ("/admin/state?rule=by-ip&ip=not-an-ip".to_string(), 400),
        ("/admin/state?rule=by-ip&ip=300.1.2.3".to_string(), 400),
        ("/admin/state?rule=by-ip".to_string(), 400),
        ("/admin/state?rule=by-ip&ip=192.0.2.7".to_string(), 200),
    ] {
        let r = admin_get(&client, &gw.admin_url(&path)).await;
        assert_eq!(r.status.as_u16(), want, "GET {path}");
        if want != 200 {
            assert!(r.json()["error"].is_string(), "GET {path}: a JSON error");
        }
    }
    for (path, want) in [
        (format!("/admin/reset?rule=nope&key={KEY}"), 404),
        ("/admin/reset?rule=api".to_string(), 400),
        ("/admin/reset?rule=by-ip&ip=garbage".to_string(), 400),
    ] {
        let r = admin_post(&client, &gw.admin_url(&path), Some(ADMIN_TOKEN)).await;
        assert_eq!(r.status.as_u16(), want, "POST {path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_state_and_reset_memory() {
    let _watch = common::watchdog();
    admin_state_and_reset(Store::Memory, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_state_and_reset_redis() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let store = Store::Redis {
        url: redis.url(),
        on_error: "deny",
        timeout: "2s",
    };
    admin_state_and_reset(store, Some(&redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_reset_needs_a_configured_token() {
    let _watch = common::watchdog();
    const KEY: &str = "sk_live_token_gate_7777";
    const ENV_TOKEN: &str = "obs-env-token-fedcba9876543210";
    let upstream = Upstream::start().await;
    let base = format!(
        "{}{}",
        upstream_and_store(&upstream.url(), &Store::Memory),
        admin_rules()
    );
    let client = HttpClient::new();
    let path = format!("/admin/reset?rule=api&key={KEY}");

    // No token anywhere: admin calls are off, whatever is sent — reads too (a state
    // answer tells a key guesser which keys have plans, and what is left of them).
    let off = admin_ready(Gateway::start(&base));
    for token in [None, Some(ADMIN_TOKEN), Some("")] {
        let r = admin_post(&client, &off.admin_url(&path), token).await;
        assert_eq!(
            r.status,
            StatusCode::FORBIDDEN,
            "no token configured, sent {token:?}"
        );
    }
    let r = client
        .get(
            &off.admin_url(&format!("/admin/state?rule=api&key={KEY}")),
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "reads are off too");
    // The status page and the metrics stay readable.
    for open in ["/", "/status.json", "/metrics", "/healthz"] {
        let r = client.get(&off.admin_url(open), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{open}");
    }
    drop(off);

    // RATEWALL_ADMIN_TOKEN alone enables them.
    let env_only = start_with(&base, &[], &[("RATEWALL_ADMIN_TOKEN", ENV_TOKEN)]);
    let r = admin_post(&client, &env_only.admin_url(&path), Some(ENV_TOKEN)).await;
    assert_eq!(r.status, StatusCode::OK, "the environment's token");
    let r = admin_post(&client, &env_only.admin_url(&path), Some(ADMIN_TOKEN)).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "another token");
    drop(env_only);

    // Both: the environment wins.
    let both = start_with(
        &format!("[admin]\ntoken = \"{ADMIN_TOKEN}\"\n{base}"),
        &[],
        &[("RATEWALL_ADMIN_TOKEN", ENV_TOKEN)],
    );
    let r = admin_post(&client, &both.admin_url(&path), Some(ENV_TOKEN)).await;
    assert_eq!(r.status, StatusCode::OK, "the environment's token wins");
    let r = admin_post(&client, &both.admin_url(&path), Some(ADMIN_TOKEN)).await;
    assert_eq!(
        r.status,
        StatusCode::UNAUTHORIZED,
        "the file's token is overridden"
    );
}

// ---------------------------------------------------------------------------------------
// 5. /admin/top

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_top_names_the_noisy_identity_by_hash_and_hint() {
    let _watch = common::watchdog();
    const NOISY: &str = "sk_live_noisy_neighbour_9f3e";
    const QUIET: &str = "sk_live_quiet_tenant_abcd";
    const SHORT: &str = "short";
    let upstream = Upstream::start().await;
    let gw = start(&format!(
        "{}[[rules]]\nname = \"api\"\nmatch = {{ path_prefix = \"/api/\" }}\nkey = \"api_key\"\n\
         rate = \"1/h\"\nburst = 2\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let client = HttpClient::new();
    for (key, denied) in [(NOISY, 30), (QUIET, 3), (SHORT, 2)] {
        for i in 0..2 + denied {
            let r = client.get(&gw.url("/api/x"), &[("x-api-key", key)]).await;
            let want = if i < 2 { 200 } else { 429 };
            assert_eq!(r.status.as_u16(), want, "{key} request {i}");
        }
    }
    let r = admin_get(&client, &gw.admin_url("/admin/top?minutes=5")).await;
    assert_eq!(r.status, StatusCode::OK);
    let text = String::from_utf8(r.body.to_vec()).expect("UTF-8");
    let top = r.json();
    let entries = top.as_array().expect("/admin/top is a list");
    assert_eq!(entries.len(), 3, "three limited identities: {top}");
    for (entry, (key, denied, hint)) in entries.iter().zip([
        (NOISY, 30, "key …9f3e"),
        (QUIET, 3, "key …abcd"),
        (SHORT, 2, "key (5 bytes)"),
    ]) {
        let id = identity_of(&client, &gw, key).await;
        assert_eq!(entry["id"], id.as_str(), "{key}: {top}");
        assert_eq!(entry["hint"], hint, "{key}: {top}");
        assert_eq!(entry["rule"], "api", "{key}: {top}");
        assert_eq!(entry["denied"], denied, "{key}: {top}");
        assert_eq!(entry["error"], 0, "{key}: {top}");
    }
    let r = admin_get(&client, &gw.admin_url("/admin/top?minutes=5&n=1")).await;
    let one = r.json();
    assert_eq!(one.as_array().map(Vec::len), Some(1), "n=1: {one}");
    assert_eq!(one[0]["denied"], 30, "{one}");

    let stats = admin_get(&client, &gw.admin_url("/admin/stats")).await;
    let stats_text = String::from_utf8(stats.body.to_vec()).expect("UTF-8");
    let public = client.get(&gw.admin_url("/status.json"), &[]).await;
    assert_eq!(public.status, StatusCode::OK);
    let public_text = String::from_utf8(public.body.to_vec()).expect("UTF-8");
    for key in [NOISY, QUIET, "sk_live_"] {
        assert!(!public_text.contains(key), "/status.json names {key:?}");
    }
    for key in [NOISY, QUIET, "sk_live_"] {
        assert!(!text.contains(key), "/admin/top names {key:?}: {text}");
        assert!(
            !stats_text.contains(key),
            "/admin/stats names {key:?}: {stats_text}"
        );
    }
    // The page anyone on the admin listener can read shows no key material at all: not
    // even the last characters the token holder's hints show.
    assert!(stats_text.contains("9f3e"), "{stats_text}");
    let public_top = public.json()["top"].clone();
    let entries = public_top.as_array().expect("a top list");
    assert_eq!(entries.len(), 3, "{public_top}");
    // Each by its tag: the one the access log, /admin/top and /admin/state use, stable
    // across restarts and gateways: keyed by the secret kept beside the config (no keys
    // file), never the digest's first digits (those name its Redis keys).
    let secret = std::fs::read_to_string(
        gw.config
            .parent()
            .expect("the config's folder")
            .join(".ratewall-tag-secret"),
    )
    .expect("the tag secret");
    let key = ratewall::identity::tag::TagKey::from_secret(secret.trim().as_bytes());
    let ids: Vec<String> = [NOISY, QUIET, SHORT]
        .iter()
        .map(|k| {
            let tag = key.tag(&ratewall::identity::digest_api_key(k.as_bytes()));
            assert_ne!(tag.as_str(), &api_key_hash(k)[..8]);
            tag.as_str().to_string()
        })
        .collect();
    for entry in entries {
        assert_eq!(entry["hint"], "key", "/status.json: {entry}");
        assert!(
            ids.iter().any(|id| entry["id"] == id.as_str()),
            "/status.json names an identity by its tag: {entry} (one of {ids:?})"
        );
    }
    // And the admin API answers no one without the token.
    for path in [
        "/admin/top",
        "/admin/stats",
        "/admin/state?rule=api&key=short",
    ] {
        let r = client.get(&gw.admin_url(path), &[]).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{path} without a token");
        let r = client
            .get(
                &gw.admin_url(path),
                &[("authorization", "Bearer wrong-token-0123456789")],
            )
            .await;
        assert_eq!(
            r.status,
            StatusCode::UNAUTHORIZED,
            "{path} with a wrong token"
        );
    }
}

// ---------------------------------------------------------------------------------------
// 6. The status page in a real browser

/// The numbers `data-<attr>="N"` carries on the elements of `dom` that also carry
/// `data-class="<class>"`, summed (the chart's bars of one outcome).
fn chart_sum(dom: &str, class: &str) -> u64 {
    let needle = format!("data-class=\"{class}\" data-n=\"");
    dom.match_indices(&needle)
        .filter_map(|(at, _)| {
            let rest = &dom[at + needle.len()..];
            rest[..rest.find('"')?].parse::<u64>().ok()
        })
        .sum()
}

/// The text of the rules table's cell for `rule` and `outcome`.
fn rule_cell<'d>(rules: &'d str, rule: &str, outcome: &str) -> Option<&'d str> {
    let needle = format!("data-rule=\"{rule}\" data-k=\"{outcome}\">");
    let at = rules.find(&needle)? + needle.len();
    Some(&rules[at..at + rules[at..].find('<')?])
}

/// A number of milliseconds as the page shows it ("12.5 ms").
fn page_ms(text: Option<&str>) -> Option<f64> {
    text?.strip_suffix(" ms")?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_page_shows_every_outcome_backend_store_and_reloads_in_headless_chromium() {
    let _watch = common::watchdog();
    const NOISY: &str = "sk_live_status_page_noisy_c0de";
    const CALM: &str = "sk_live_status_page_calm_0000";
    let browser = common::chromium();
    let mut redis = RedisServer::start();
    let upstream = FaultyUpstream::start().await;
    let rules =
        "[[rules]]\nname = \"api\"\nmatch = { path_prefix = \"/api/\" }\nkey = \"api_key\"\n\
         rate = \"1/h\"\nburst = 4\n\
         [[rules]]\nname = \"everyone\"\nmatch = { path_prefix = \"/api/\" }\nkey = \"global\"\n\
         rate = \"10/s\"\nburst = 500\n";
    let store = format!(
        "[store]\nbackend = \"redis\"\nurl = \"{}\"\nprefix = \"rwpage\"\ntimeout = \"1s\"\n\
         on_error = \"deny\"\n",
        redis.url()
    );
    let body = |upstream: &str| {
        format!(
            "[upstream]\nurl = \"{upstream}\"\nconnect_timeout = \"1s\"\ntimeout = \"5s\"\n{store}{rules}"
        )
    };
    let gw = start(&body(&upstream.url()));
    let client = HttpClient::new();
    let get = |key: Option<&'static str>, path: &'static str| {
        let client = &client;
        let url = gw.url(path);
        async move {
            let headers: Vec<(&str, &str)> = key.map(|k| ("x-api-key", k)).into_iter().collect();
            client.get(&url, &headers).await.status.as_u16()
        }
    };

    // While everything answers: NOISY 4 allowed then 7 denied; CALM 2 allowed, one of them
    // answered after 300 ms; a 401; a request no rule limits.
    let passed = client
        .until_status(
            &gw.url("/api/x"),
            &[("x-api-key", NOISY)],
            StatusCode::OK,
            Duration::from_secs(20),
        )
        .await;
    assert!(passed.is_some(), "no request passed\n{}", gw.logs());
    for i in 1..11 {
        let want = if i < 4 { 200 } else { 429 };
        assert_eq!(get(Some(NOISY), "/api/x").await, want, "NOISY request {i}");
    }
    assert_eq!(get(Some(CALM), "/api/slow/300").await, 200);
    assert_eq!(get(Some(CALM), "/api/x").await, 200);
    assert_eq!(get(None, "/api/x").await, 401);
    assert_eq!(get(None, "/about").await, 200);
    let noisy_id = identity_of(&client, &gw, NOISY).await;

    // The backend goes away (a reload to a port nobody listens on): 2 × 502.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    gw.rewrite_config(&with_token(&body(&format!("http://{dead}"))));
    gw.reload(1);
    let serving = common::sha256_hex(&std::fs::read(&gw.config).expect("the config file"));
    for _ in 0..2 {
        assert_eq!(get(Some(CALM), "/api/x").await, 502);
    }
    // Then the store: 3 × 503.
    redis.kill();
    for _ in 0..3 {
        assert_eq!(get(Some(CALM), "/api/x").await, 503);
    }
    // A reload the gateway rejects: the last one serves on.
    gw.rewrite_config("[upstream]\nurl = \"http://127.0.0.1:1\"\nno_such_key = true\n");
    let rejected = common::sha256_hex(&std::fs::read(&gw.config).expect("the config file"));
    gw.signal("HUP");
    assert!(
        gw.wait_for_log("config reload rejected", 1, Duration::from_secs(15)),
        "{}",
        gw.logs()
    );

    let want: [(&str, u64); 10] = [
        ("allowed", 4 + 2 + 1),
        ("denied", 7),
        ("unauthorized", 1),
        ("bad_request", 0),
        ("no_route", 0),
        ("store_unavailable", 3),
        ("overloaded", 0),
        ("upstream_error", 2),
        ("upstream_timeout", 0),
        ("client_error", 0),
    ];
    let stats = client.get(&gw.admin_url("/status.json"), &[]).await.json();
    for (k, n) in want {
        assert_eq!(stats["totals"][k], n, "totals.{k}: {stats}");
        assert_eq!(
            stats["window"]["outcomes"][k], n,
            "last minute {k}: {stats}"
        );
        let charted: u64 = stats["history"]
            .as_array()
            .expect("history")
            .iter()
            .map(|p| p[k].as_u64().unwrap_or(0))
            .sum();
        assert_eq!(charted, n, "the chart's {k}: {stats}");
    }
    // Per rule, the page's numbers are the metrics'.
    let m = Scrape::take(&client, &gw).await;
    for rule in stats["rules"].as_array().expect("rules") {
        let name = rule["name"].as_str().expect("a name");
        for (k, decision) in [
            ("allowed", "allowed"),
            ("denied", "denied"),
            ("refused", "refused"),
            ("store_error", "error"),
        ] {
            let metric = m.get(
                "ratewall_requests_total",
                &[("rule", name), ("decision", decision)],
            );
            assert_eq!(rule["outcomes"][k], metric as u64, "{name} {k}: {rule}");
        }
        let failed = m.get(
            "ratewall_rule_upstream_failures_total",
            &[("rule", name), ("outcome", "upstream_error")],
        );
        assert_eq!(rule["outcomes"]["upstream_error"], failed as u64, "{rule}");
    }
    let api = &stats["rules"][0]["outcomes"];
    assert_eq!(
        (
            &api["allowed"],
            &api["denied"],
            &api["refused"],
            &api["store_error"],
            &api["upstream_error"]
        ),
        (
            // NOISY's 4 and CALM's 2 the backend answered (CALM's two 502s are not passes).
            &serde_json::json!(4 + 2),
            &serde_json::json!(7),
            &serde_json::json!(1),
            &serde_json::json!(3),
            &serde_json::json!(2)
        ),
        "{stats}"
    );
    // The backend: 7 answers, one of them after 300 ms; 2 failures.
    let w = &stats["window"];
    assert_eq!(w["upstream"]["count"], 7, "{w}");
    let p50 = w["upstream"]["p50_ms"].as_f64().expect("a p50");
    let p99 = w["upstream"]["p99_ms"].as_f64().expect("a p99");
    assert!(p50 < 250.0, "p50 {p50} ms: {w}");
    assert!((300.0..2_000.0).contains(&p99), "p99 {p99} ms: {w}");
    assert_eq!(stats["upstream"]["health"], "failing", "{stats}");
    // The store: every request with a rule asked it once (the deny cache aside); the
    // last 3 failed.
    let errors = w["store_errors"].as_u64().expect("store errors");
    assert!(errors >= 3, "{w}");
    assert!(
        w["store_error_rate"].as_f64().is_some_and(|r| r > 0.0),
        "{w}"
    );
    assert!(w["store"]["p50_ms"].as_f64().is_some(), "{w}");
    assert_ne!(stats["store"]["health"], "healthy", "{stats}");
    // The config: the accepted reload serves; the last reload was rejected, and why.
    let reload = &stats["config"]["last_reload"];
    assert_eq!(
        stats["config"]["serving"]["sha256"],
        serving.as_str(),
        "{stats}"
    );
    assert_eq!(reload["accepted"], false, "{reload}");
    assert_eq!(reload["sha256"], rejected.as_str(), "{reload}");
    assert!(
        reload["error"]
            .as_str()
            .is_some_and(|e| e.contains("no_such_key")),
        "{reload}"
    );
    assert_eq!(stats["version"], env!("CARGO_PKG_VERSION"));
    assert!(stats["uptime_s"].as_u64().is_some(), "{stats}");

    // The page, rendered by a real browser, shows the same.
    let page = gw.admin_url("/");
    let dom = run_chromium(&page, &["--dump-dom".to_string()]).await;
    assert!(
        dom.contains("<body data-loaded=\"yes\">"),
        "the page's script ran and rendered /status.json:\n{dom}"
    );
    for (k, n) in want {
        assert_eq!(
            element_text(&dom, &format!("total-{k}")),
            Some(n.to_string().as_str()),
            "total {k}:\n{dom}"
        );
        assert_eq!(
            element_text(&dom, &format!("minute-{k}")),
            Some(format!("{n} last minute").as_str()),
            "last minute {k}"
        );
        assert_eq!(chart_sum(&dom, k), n, "the chart's bars of {k}");
    }
    assert!(
        dom.matches("class=\"tick\"").count() >= 4,
        "a time axis (a tick every 2 minutes over 10):\n{dom}"
    );
    let rules_html = tbody(&dom, "rules");
    // `api`'s passes the backend answered: the two 502s are its upstream failures.
    for (k, n) in [
        ("allowed", 6),
        ("denied", 7),
        ("denied_by_other", 0),
        ("refused", 1),
        ("store_error", 3),
        ("upstream_error", 2),
        ("upstream_timeout", 0),
    ] {
        let n = n.to_string();
        assert_eq!(
            rule_cell(rules_html, "api", k),
            Some(n.as_str()),
            "api {k}:\n{rules_html}"
        );
    }
    assert_eq!(
        rule_cell(rules_html, "everyone", "upstream_error"),
        Some("2"),
        "{rules_html}"
    );
    assert_eq!(element_text(&dom, "upstream-health"), Some("failing"));
    assert_eq!(element_text(&dom, "upstream-answered"), Some("7"));
    assert_eq!(element_text(&dom, "upstream-502"), Some("2"));
    let shown_p99 = page_ms(element_text(&dom, "upstream-p99"));
    assert!(
        shown_p99.is_some_and(|v| (300.0..2_000.0).contains(&v)),
        "p99 {shown_p99:?}"
    );
    assert!(page_ms(element_text(&dom, "upstream-p50")).is_some_and(|v| v < 250.0));
    assert!(page_ms(element_text(&dom, "store-p50")).is_some());
    assert_eq!(element_text(&dom, "store-backend"), Some("redis"));
    assert_ne!(element_text(&dom, "store-health"), Some("healthy"));
    assert_eq!(element_text(&dom, "store-503"), Some("3"));
    assert!(
        element_text(&dom, "store-error-rate").is_some_and(|r| r.ends_with(" %") && r != "0.0 %"),
        "{:?}",
        element_text(&dom, "store-error-rate")
    );
    assert_eq!(element_text(&dom, "config-sha"), Some(&serving[..12]));
    assert_eq!(element_text(&dom, "reload-result"), Some("rejected"));
    assert_eq!(element_text(&dom, "reload-sha"), Some(&rejected[..12]));
    assert!(
        element_text(&dom, "reload-error").is_some_and(|e| e.contains("no_such_key")),
        "{:?}",
        element_text(&dom, "reload-error")
    );
    assert_eq!(
        element_text(&dom, "version"),
        Some(env!("CARGO_PKG_VERSION"))
    );
    assert!(element_text(&dom, "uptime").is_some_and(|u| u.ends_with('s')));
    assert!(
        element_text(&dom, "certificates").is_some_and(|c| c.contains("TLS is not configured")),
        "the place kept for certificate expiry"
    );
    // Who is being limited comes first, above the totals and the chart, with a summary
    // line that names the most denied identity by its tag.
    let at = |id: &str| {
        dom.find(&format!("id=\"{id}\""))
            .unwrap_or_else(|| panic!("no #{id}"))
    };
    assert!(
        at("limited") < at("totals") && at("totals") < at("chart"),
        "who is being limited, first"
    );
    let summary = dom[at("limited-summary")..]
        .split("</p>")
        .next()
        .unwrap_or_default();
    assert!(
        summary.contains("denied <b>7</b> times") && summary.contains(&noisy_id),
        "the summary names {noisy_id} and its denials: {summary}"
    );
    // A process younger than the chart's 10 minutes: its start is marked, and what came
    // before is no traffic at all rather than zero.
    assert!(
        dom.contains("id=\"start-mark\"") && dom.contains("id=\"before-start\""),
        "the process's start on the chart"
    );
    // 401 and 400 apart.
    assert_eq!(element_text(&dom, "total-unauthorized"), Some("1"));
    assert_eq!(element_text(&dom, "total-bad_request"), Some("0"));
    let top = tbody(&dom, "top");
    // By tag and kind only: the key's last characters are for admin token holders.
    assert!(
        top.contains("<td>key</td>") && !top.contains("c0de"),
        "the noisy key in the top table, without key material:\n{top}"
    );
    // By the identity's tag, the one /admin/state and the access log name it by.
    assert!(
        top.contains(&format!("<code>{noisy_id}</code>")),
        "its tag {noisy_id} as /admin/state says it:\n{top}"
    );
    assert!(
        gw.logs().contains(&format!("id=\"{noisy_id}\"")),
        "its tag {noisy_id} in the access log:\n{}",
        gw.logs()
    );
    assert!(
        top.contains("data-denied=\"7\""),
        "its denied count:\n{top}"
    );
    for secret in [NOISY, CALM] {
        assert!(!dom.contains(secret), "the page shows {secret:?}");
    }

    // A screenshot (RATEWALL_WRITE_STATUS_PNG=1 writes it to docs/status.png).
    let shots = tempfile::tempdir().expect("screenshot dir");
    let png = shots.path().join("s.png");
    run_chromium(
        &page,
        &[
            format!("--screenshot={}", png.display()),
            "--window-size=1280,1400".to_string(),
            "--hide-scrollbars".to_string(),
        ],
    )
    .await;
    let bytes = std::fs::read(&png).unwrap_or_else(|e| {
        panic!(
            "{} wrote no screenshot at {}: {e}",
            browser.display(),
            png.display()
        )
    });
    assert_eq!(
        &bytes[..8.min(bytes.len())],
        b"\x89PNG\r\n\x1a\n",
        "a PNG screenshot"
    );
    assert!(
        bytes.len() > 10 * 1024,
        "the screenshot is not trivial: {} bytes",
        bytes.len()
    );
    if std::env::var_os("RATEWALL_WRITE_STATUS_PNG").is_some() {
        let docs = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/status.png");
        std::fs::write(docs, &bytes).expect("write docs/status.png");
    }
}

// ---------------------------------------------------------------------------------------
// 7. ratewall check --path

#[test]
fn check_explains_a_sample_request() {
    let _watch = common::watchdog();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/config/limits.toml");
    let sample = |out: &str| -> String {
        out.split_once("sample request:")
            .map(|(_, s)| s.to_string())
            .unwrap_or_else(|| panic!("no sample request section in:\n{out}"))
    };

    // The shipped config names no tag secret: the environment's keys the tags, so that the
    // answer does not hang on whether another test's gateway made one beside the config.
    let (code, out, err) = run_ratewall_with(
        &[
            "check",
            "--config",
            config,
            "--path",
            "/api/orders",
            "--method",
            "post",
            "--header",
            "x-api-key: demo-pro-key",
        ],
        &[("RATEWALL_TAG_SECRET", "the-docs-example-secret")],
    );
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains(": valid"), "{out}");
    let s = sample(&out);
    assert!(s.starts_with(" POST /api/orders"), "{s}");
    assert!(s.contains("2 rule(s) apply"), "{s}");
    let daily = s
        .lines()
        .find(|l| l.trim_start().starts_with("- daily:"))
        .unwrap_or_else(|| panic!("no daily line:\n{s}"));
    assert!(daily.contains("shadow: never denies"), "{daily}");
    let api = s
        .lines()
        .find(|l| l.trim_start().starts_with("- api:"))
        .unwrap_or_else(|| panic!("no api line:\n{s}"));
    assert!(api.contains("100/s burst 300"), "{api}");
    assert!(api.contains("plan pro"), "{api}");
    assert!(api.contains("token_bucket"), "{api}");
    let id = api
        .split_once("(identity ")
        .and_then(|(_, rest)| rest.get(..8))
        .unwrap_or_else(|| panic!("no identity in {api}"));
    assert!(is_short_id(id), "{api}");
    assert!(
        !s.contains("demo-pro-key"),
        "the key itself is not shown: {s}"
    );
    // The rules that do not apply, each with why: path, method, plan.
    let (_, not) = s
        .split_once("5 rule(s) do not apply:\n")
        .unwrap_or_else(|| panic!("no rules that do not apply:\n{s}"));
    let not: Vec<&str> = not.lines().map(str::trim).collect();
    assert_eq!(
        not,
        [
            "exports: the path does not fit glob /api/*/export",
            "login: the path is not /api/login",
            "uploads: the path does not start with /api/upload",
            "per-ip: plan pro is exempt from it",
            "exports.attempts: the path does not fit glob /api/*/export",
        ],
        "{s}"
    );

    let (code, out, err) = run_ratewall(&[
        "check", "--config", config, "--path", "/health", "--method", "DELETE",
    ]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let s = sample(&out);
    assert!(s.contains("1 rule(s) apply"), "{s}");
    let per_ip = s
        .lines()
        .find(|l| l.trim_start().starts_with("- per-ip:"))
        .unwrap_or_else(|| panic!("no per-ip line:\n{s}"));
    assert!(per_ip.contains("sliding_window"), "{per_ip}");
    assert!(per_ip.contains("127.0.0.1"), "{per_ip}");
    let listed: Vec<&str> = s
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("- "))
        .filter_map(|l| l.split_once(':').map(|(name, _)| name))
        .collect();
    assert_eq!(listed, ["per-ip"], "{s}");

    let (code, out, err) = run_ratewall(&["check", "--config", config, "--path", "/api/x"]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let s = sample(&out);
    let api = s
        .lines()
        .find(|l| l.trim_start().starts_with("- api:"))
        .unwrap_or_else(|| panic!("no api line:\n{s}"));
    assert!(api.contains("refused with 401"), "{api}");

    let (code, out, err) = run_ratewall(&[
        "check", "--config", config, "--path", "/api/x", "--header", "nocolon",
    ]);
    assert_eq!(
        code, 1,
        "a bad --header fails: stdout:\n{out}\nstderr:\n{err}"
    );
    assert!(err.contains("nocolon"), "the error names the header: {err}");
}
