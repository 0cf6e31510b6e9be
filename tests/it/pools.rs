//! Pools, health, retries and routes (issue 24), end to end: the real `ratewall` binary in
//! front of real backends ([`common::Backend`]: bound where a test says, killed and
//! started again on the same port, recording each request target byte for byte), driven
//! by a real HTTP client or raw sockets.
//!
//! What is pinned:
//! - balancing: round robin splits 30 requests 10/10/10 and weights 2:1:1 split 40 as
//!   20/10/10; least_requests sends nothing to a server holding a slow request while
//!   others are idle; `hash:api_key` keeps every key on one server, and a fourth server
//!   takes at most 30% of the keys (and only moves keys to itself);
//! - health: a server killed under 200 concurrent GETs costs no client an error, is
//!   ejected (metrics, `/status.json`) and comes back once started again on its port; the
//!   status page, rendered by headless Chromium, lists each server with its state;
//! - retries: a POST whose body was partly sent is never retried (502), one refused before
//!   anything was sent is (200); the retry budget holds retries to 20% of requests plus
//!   its floor when every server resets;
//! - routes: by host and by path prefix, `strip_prefix` forwarding the rest of the path as
//!   the route matched it (`%2F` a slash, the query as sent; tests/it/route_prefix.rs has
//!   the dot segments), a route without prefixes the target byte for byte; a rule limited
//!   to a route; 404 problem+json for no route without a default pool, nothing forwarded;
//! - reload: a SIGHUP removing a server under load loses no request, and the removed
//!   server gets no new ones;
//! - a host name resolving to two addresses is balanced over both (skipped, saying why,
//!   unless /etc/hosts gives `ratewall-pools.test` both 127.0.0.1 and 127.0.0.2);
//! - `ratewall check --path --host` names the route and pool; the access line carries
//!   `route`, `pool`, `server` and `attempts`.
//!
//! Tests that load the machine hold [`common::serial`], so that no timed health check of
//! another test runs beside their load.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::net::{SocketAddr, ToSocketAddrs};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    binary, channel_body, dump_dom, raw_exchange, serial, Backend, Gateway, HttpClient, OnBody,
    RefusingPort, Resetter, Scrape,
};
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

/// The longest a test waits for any one thing to happen.
const WAIT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------------------
// Config snippets

/// The memory store: no rule needs anything else.
const MEMORY: &str = "[store]\nbackend = \"memory\"\n";

/// `servers = [...]` of `urls`, each a plain URL.
fn servers(urls: &[String]) -> String {
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!("servers = [{}]\n", list.join(", "))
}

/// A `[[upstreams]]` pool `name` of `servers` (a `servers = [...]` line), with the
/// harness's timeouts (connect 1 s, answer 5 s) and `extra` keys.
fn pool(name: &str, servers: &str, extra: &str) -> String {
    format!(
        "[[upstreams]]\nname = \"{name}\"\n{servers}connect_timeout = \"1s\"\ntimeout = \"5s\"\n{extra}"
    )
}

/// A gateway whose only pool, `default`, is `urls` with `extra` keys.
fn one_pool(urls: &[String], extra: &str) -> String {
    format!("{}{MEMORY}", pool("default", &servers(urls), extra))
}

fn urls(backends: &[&Backend]) -> Vec<String> {
    backends.iter().map(|b| b.url()).collect()
}

async fn backends(n: usize) -> Vec<Backend> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(Backend::start().await);
    }
    out
}

// ---------------------------------------------------------------------------------------
// What the gateway says about itself

/// `/status.json`.
async fn status(gw: &Gateway) -> serde_json::Value {
    let r = HttpClient::new()
        .get(&gw.admin_url("/status.json"), &[])
        .await;
    assert_eq!(r.status, StatusCode::OK, "GET /status.json");
    r.json()
}

/// The entries of `/status.json`'s `pools` for the servers of `pool` labelled `label`
/// (one per address the label resolved to).
fn status_servers(status: &serde_json::Value, pool: &str, label: &str) -> Vec<serde_json::Value> {
    let pools = status["pools"]
        .as_array()
        .unwrap_or_else(|| panic!("no pools list in /status.json: {status}"));
    let p = pools
        .iter()
        .find(|p| p["name"] == pool)
        .unwrap_or_else(|| panic!("no pool {pool:?} in /status.json: {status}"));
    p["servers"]
        .as_array()
        .unwrap_or_else(|| panic!("no servers list in pool {pool:?}: {p}"))
        .iter()
        .filter(|s| s["server"] == label)
        .cloned()
        .collect()
}

/// The `state` of the one server of `pool` labelled `label` on the status page.
fn state_of(status: &serde_json::Value, pool: &str, label: &str) -> String {
    let found = status_servers(status, pool, label);
    assert_eq!(
        found.len(),
        1,
        "one entry for {label} in pool {pool:?}: {status}"
    );
    found[0]["state"]
        .as_str()
        .unwrap_or_else(|| panic!("no state for {label}: {}", found[0]))
        .to_string()
}

/// A series of `/metrics` that prometheus-parse folds into a histogram (`_count`, `_sum`),
/// read from the text: the value of the line that starts with `series` (name and labels
/// exactly as exported), 0 when there is none.
fn text_value(scrape: &Scrape, series: &str) -> f64 {
    scrape
        .text
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

/// Attempts `pool` sent to `server` that ended as `outcome` (`2xx`, `error`...).
fn attempts(scrape: &Scrape, pool: &str, server: &str, outcome: &str) -> f64 {
    scrape.get(
        "ratewall_upstream_server_requests_total",
        &[("pool", pool), ("server", server), ("outcome", outcome)],
    )
}

fn retries(scrape: &Scrape, pool: &str) -> f64 {
    scrape.get("ratewall_upstream_retries_total", &[("pool", pool)])
}

/// The JSON log's events of `target`.
fn events(logs: &str, target: &str) -> Vec<serde_json::Value> {
    logs.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == target)
        .collect()
}

/// A log field that is a number, whether the log writes it as one or as a string.
fn number(v: &serde_json::Value) -> Option<u64> {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

// ---------------------------------------------------------------------------------------
// Load

/// What a load's clients got.
#[derive(Default, Debug)]
struct Tally {
    ok: usize,
    /// Every answer other than 200, and every request that failed, with what happened.
    bad: Vec<String>,
}

/// `clients` tasks sending GETs to `url` + `/<n>` in a loop, each pausing `pause` after
/// each answer, until [`Load::finish`].
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    tasks: JoinSet<Tally>,
}

impl Load {
    fn start(client: &HttpClient, url: &str, clients: usize, pause: Duration) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let mut tasks = JoinSet::new();
        for c in 0..clients {
            let (client, url, stop, sent) =
                (client.clone(), url.to_string(), stop.clone(), sent.clone());
            tasks.spawn(async move {
                let mut tally = Tally::default();
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) {
                    i += 1;
                    sent.fetch_add(1, Ordering::SeqCst);
                    let u = format!("{url}/{c}-{i}");
                    match client.try_get(&u, &[], Duration::from_secs(30)).await {
                        Ok(r) if r.status == StatusCode::OK => tally.ok += 1,
                        Ok(r) => tally.bad.push(format!(
                            "{u}: {} {}",
                            r.status,
                            String::from_utf8_lossy(&r.body)
                        )),
                        Err(e) => tally.bad.push(format!("{u}: {e}")),
                    }
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                }
                tally
            });
        }
        Load { stop, sent, tasks }
    }

    /// Requests sent so far.
    fn sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }

    /// Stop the clients and add up what they got (every request sent was answered or
    /// failed: the tally has one entry for each).
    async fn finish(mut self) -> Tally {
        self.stop.store(true, Ordering::SeqCst);
        let mut all = Tally::default();
        while let Some(t) = self.tasks.join_next().await {
            let t = t.expect("a load client panicked");
            all.ok += t.ok;
            all.bad.extend(t.bad);
        }
        assert_eq!(
            all.ok + all.bad.len(),
            self.sent(),
            "every request sent is answered or failed"
        );
        all
    }
}

/// Check `holds` every 50 ms until it is true (at most `within`): whether it became so.
async fn eventually(within: Duration, mut holds: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    loop {
        if holds() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How the gateway shows one server of the pool `default`: its ejections and healthy
/// gauge on `/metrics`, its state on `/status.json`.
struct Shown {
    ejections: f64,
    healthy: Option<f64>,
    state: String,
}

impl Shown {
    async fn take(gw: &Gateway, label: &str) -> Shown {
        let m = Scrape::take(&HttpClient::new(), gw).await;
        let server = [("pool", "default"), ("server", label)];
        Shown {
            ejections: m.get("ratewall_upstream_ejections_total", &server),
            healthy: m.find("ratewall_upstream_server_healthy", &server),
            state: state_of(&status(gw).await, "default", label),
        }
    }
}

impl std::fmt::Display for Shown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ejections {}, healthy gauge {:?}, state {:?}",
            self.ejections, self.healthy, self.state
        )
    }
}

// ---------------------------------------------------------------------------------------
// Balancing

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_splits_evenly_and_by_weight() {
    let _watch = common::watchdog();
    let b = backends(3).await;
    let gw = Gateway::start(&one_pool(&urls(&[&b[0], &b[1], &b[2]]), ""));
    let client = HttpClient::new();
    for i in 0..30 {
        let r = client.get(&gw.url(&format!("/rr/{i}")), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "request {i}: {r:?}");
    }
    let counts: Vec<usize> = b.iter().map(|s| s.count("/rr/")).collect();
    assert_eq!(counts, [10, 10, 10], "30 requests over three servers");
    // The metrics count the same attempts, per server.
    let scrape = Scrape::take(&client, &gw).await;
    for s in &b {
        assert_eq!(
            attempts(&scrape, "default", &s.url(), "2xx"),
            10.0,
            "ratewall_upstream_server_requests_total of {}:\n{}",
            s.url(),
            scrape.text
        );
    }

    let w = backends(3).await;
    let weighted = format!(
        "servers = [{{ url = \"{}\", weight = 2 }}, \"{}\", \"{}\"]\n",
        w[0].url(),
        w[1].url(),
        w[2].url()
    );
    let gw = Gateway::start(&format!("{}{MEMORY}", pool("default", &weighted, "")));
    for i in 0..40 {
        let r = client.get(&gw.url(&format!("/w/{i}")), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "request {i}: {r:?}");
    }
    let counts: Vec<usize> = w.iter().map(|s| s.count("/w/")).collect();
    assert_eq!(counts, [20, 10, 10], "40 requests over weights 2:1:1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_requests_prefers_an_idle_server_to_one_holding_a_slow_request() {
    let _watch = common::watchdog();
    let b = backends(3).await;
    let gw = Gateway::start(&one_pool(
        &urls(&[&b[0], &b[1], &b[2]]),
        "balance = \"least_requests\"\n",
    ));
    let client = HttpClient::new();
    let slow = {
        let (client, url) = (client.clone(), gw.url("/slow/3000"));
        tokio::spawn(async move { client.get(&url, &[]).await })
    };
    let held = eventually(WAIT, || b.iter().any(|s| s.in_flight() == 1)).await;
    assert!(held, "the slow request reached no server");
    let holder = b
        .iter()
        .position(|s| s.in_flight() == 1)
        .expect("a server holds it");
    for i in 0..20 {
        let r = client.get(&gw.url(&format!("/quick/{i}")), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "request {i}: {r:?}");
    }
    // Still held: every quick request had an idle server to go to.
    assert_eq!(
        b[holder].in_flight(),
        1,
        "the slow request ended before the quick ones: the test proves nothing"
    );
    let quick: Vec<usize> = b.iter().map(|s| s.count("/quick/")).collect();
    assert_eq!(
        quick[holder], 0,
        "quick requests per server {quick:?}; server {holder} holds the slow one"
    );
    assert_eq!(quick.iter().sum::<usize>(), 20);
    let r = slow.await.expect("the slow request's task");
    assert_eq!(r.status, StatusCode::OK, "the slow request: {r:?}");
}

/// The server that answered (its `x-backend` header).
fn answered_by(r: &common::Reply) -> String {
    r.header("x-backend")
        .unwrap_or_else(|| panic!("no x-backend header: {r:?}"))
        .to_string()
}

/// Each of `keys` sent `times` times (8 at a time) to `url`: the servers that answered
/// each key, in order.
async fn route_keys(
    client: &HttpClient,
    url: &str,
    keys: &[String],
    times: usize,
) -> BTreeMap<String, Vec<String>> {
    let mut tasks = JoinSet::new();
    for chunk in keys.chunks(keys.len().div_ceil(8)) {
        let (client, url, chunk) = (client.clone(), url.to_string(), chunk.to_vec());
        tasks.spawn(async move {
            let mut out = Vec::new();
            for key in chunk {
                let mut by = Vec::new();
                for _ in 0..times {
                    let r = client.get(&url, &[("x-api-key", &key)]).await;
                    assert_eq!(r.status, StatusCode::OK, "key {key}: {r:?}");
                    by.push(answered_by(&r));
                }
                out.push((key, by));
            }
            out
        });
    }
    let mut all = BTreeMap::new();
    while let Some(part) = tasks.join_next().await {
        all.extend(part.expect("a key sender panicked"));
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hash_by_api_key_keeps_each_key_on_one_server_and_a_fourth_moves_few() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let b = backends(4).await;
    let three = urls(&[&b[0], &b[1], &b[2]]);
    let gw = Gateway::start(&one_pool(&three, "balance = \"hash:api_key\"\n"));
    let client = HttpClient::new();
    let keys: Vec<String> = (0..1000).map(|k| format!("tenant-key-{k:04}")).collect();

    let before = route_keys(&client, &gw.url("/h"), &keys, 2).await;
    let mut per_server: HashMap<String, usize> = HashMap::new();
    for (key, by) in &before {
        assert_eq!(by[0], by[1], "key {key} went to two servers");
        *per_server.entry(by[0].clone()).or_default() += 1;
    }
    // Spread over all three (an even share is 333).
    for s in &b[..3] {
        let n = per_server.get(&s.name()).copied().unwrap_or(0);
        assert!(
            n >= 150,
            "{} holds {n} of 1000 keys: {per_server:?}",
            s.name()
        );
    }

    let four = urls(&[&b[0], &b[1], &b[2], &b[3]]);
    gw.rewrite_config(&one_pool(&four, "balance = \"hash:api_key\"\n"));
    gw.reload(1);
    let after = route_keys(&client, &gw.url("/h"), &keys, 1).await;
    let moved: Vec<(&String, &String)> = keys
        .iter()
        .filter(|k| after[*k][0] != before[*k][0])
        .map(|k| (k, &after[k][0]))
        .collect();
    eprintln!(
        "keys per server of three: {per_server:?}; the fourth server took {} of 1000",
        moved.len()
    );
    assert!(
        moved.len() <= 300,
        "a fourth server moved {} of 1000 keys",
        moved.len()
    );
    // Consistent hashing: keys move only to the new server, and it takes a fair share.
    let to_others: Vec<_> = moved.iter().filter(|(_, s)| **s != b[3].name()).collect();
    assert!(
        to_others.is_empty(),
        "{} keys moved between the old servers, e.g. {:?}",
        to_others.len(),
        to_others.first()
    );
    assert!(
        moved.len() >= 100,
        "the fourth server took only {} of 1000 keys",
        moved.len()
    );
}

// ---------------------------------------------------------------------------------------
// Health

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_under_load_costs_no_client_an_error_and_comes_back() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let mut b = backends(3).await;
    let label = b[2].url();
    let gw = Gateway::start(&one_pool(
        &urls(&[&b[0], &b[1], &b[2]]),
        "fail_timeout = \"1s\"\n\
         health = { path = \"/healthz\", interval = \"200ms\", timeout = \"150ms\", healthy = 2, unhealthy = 2 }\n",
    ));
    let client = HttpClient::new();
    // Healthy, and said so, before any load.
    let page = status(&gw).await;
    assert_eq!(state_of(&page, "default", &label), "healthy", "{page}");

    let load = Load::start(&client, &gw.url("/load"), 200, Duration::from_millis(100));
    let warmed = eventually(WAIT, || b.iter().all(|s| s.count("/load/") >= 30)).await;
    assert!(warmed, "the load did not reach every server");

    b[2].kill().await;
    let end = Instant::now() + WAIT;
    let ejected = loop {
        let shown = Shown::take(&gw, &label).await;
        if shown.ejections >= 1.0 && shown.healthy == Some(0.0) && shown.state != "healthy" {
            break Ok(shown);
        }
        if Instant::now() >= end {
            break Err(shown);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    if let Err(shown) = &ejected {
        let _ = load.finish().await;
        panic!("the killed server's ejection is not shown within {WAIT:?}: {shown}");
    }
    // The others keep serving while it stays down (its trial requests fail and go again).
    let served = load.sent();
    let more = eventually(WAIT, || load.sent() >= served + 2_000).await;
    assert!(more, "the load stalled with one server down");

    b[2].restart().await;
    let end = Instant::now() + Duration::from_secs(40);
    let back = loop {
        let shown = Shown::take(&gw, &label).await;
        let served = b[2].count("/load/");
        if shown.healthy == Some(1.0) && shown.state == "healthy" && served >= 20 {
            break Ok(());
        }
        if Instant::now() >= end {
            break Err(format!(
                "{shown}, {served} requests served since its restart"
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let tally = load.finish().await;
    eprintln!(
        "{} requests, {} failed; the killed server served {} after its restart",
        tally.ok + tally.bad.len(),
        tally.bad.len(),
        b[2].count("/load/")
    );
    if let Err(shown) = back {
        panic!("the restarted server did not come back: {shown}");
    }
    assert!(
        tally.bad.is_empty(),
        "{} of {} requests failed, e.g. {:?}",
        tally.bad.len(),
        tally.ok + tally.bad.len(),
        &tally.bad[..tally.bad.len().min(5)]
    );
}

/// The part of a rendered page about `label`: the table row (or list item) that names it.
fn row_naming<'a>(dom: &'a str, label: &str) -> Option<&'a str> {
    dom.split("<tr")
        .flat_map(|row| row.split("<li"))
        .find(|part| part.contains(label))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_each_server_of_a_pool_with_its_state() {
    let _watch = common::watchdog();
    let live = Backend::start().await;
    let refusing = RefusingPort::new();
    let refused = refusing.url();
    // Ejected after its first failure, for longer than the test takes.
    let gw = Gateway::start(&one_pool(
        &[live.url(), refused.clone()],
        "max_fails = 1\nfail_timeout = \"5m\"\n",
    ));
    let client = HttpClient::new();
    for i in 0..4 {
        let r = client.get(&gw.url(&format!("/page/{i}")), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "request {i}: {r:?}");
    }
    let json = status(&gw).await;
    assert_eq!(state_of(&json, "default", &live.url()), "healthy", "{json}");
    assert_eq!(state_of(&json, "default", &refused), "ejected", "{json}");
    let dom = dump_dom(&gw.admin_url("/")).await;
    assert!(
        dom.contains("data-loaded=\"yes\""),
        "the page's script did not render /status.json:\n{dom}"
    );
    for (label, state) in [(live.url(), "healthy"), (refused, "ejected")] {
        let row = row_naming(&dom, &label)
            .unwrap_or_else(|| panic!("the status page does not list {label}:\n{dom}"));
        assert!(
            row.contains(state),
            "the status page's row of {label} does not say {state}: {row}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Retries

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_partly_sent_is_not_retried_and_one_refused_before_sending_is() {
    let _watch = common::watchdog();
    // Partly sent: the server reads the head and the body's first bytes, then resets.
    let dying = Backend::start_on(
        "127.0.0.1:0".parse().expect("addr"),
        OnBody::ResetAfterFirstChunk,
    )
    .await;
    let healthy = Backend::start().await;
    let gw = Gateway::start(&one_pool(&urls(&[&dying, &healthy]), ""));
    let client = HttpClient::new();
    // Round robin: once a request went to the healthy server, the next goes to the dying.
    let mut last = String::new();
    for i in 0..4 {
        last = answered_by(&client.get(&gw.url(&format!("/probe/{i}")), &[]).await);
        if last == healthy.name() {
            break;
        }
    }
    assert_eq!(last, healthy.name(), "no probe reached the healthy server");
    let mut s = common::connect(gw.port).await;
    s.write_all(
        b"POST /upload HTTP/1.1\r\nHost: pool.test\r\nContent-Type: application/octet-stream\r\nContent-Length: 100000\r\n\r\n",
    )
    .await
    .expect("send the head");
    s.write_all(&[b'a'; 1000])
        .await
        .expect("send the first bytes");
    tokio::time::timeout(WAIT, dying.cut())
        .await
        .expect("the POST reached the dying server, which cut it");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(WAIT, read)
        .await
        .expect("an answer to the cut POST");
    let text = String::from_utf8_lossy(&answer).into_owned();
    assert!(
        text.starts_with("HTTP/1.1 502"),
        "the cut POST's answer: {text:?}"
    );
    assert!(
        !healthy.hits().iter().any(|h| h.method == "POST"),
        "the POST was sent again to the healthy server: {:?}",
        healthy.hits()
    );
    let scrape = Scrape::take(&client, &gw).await;
    assert_eq!(retries(&scrape, "default"), 0.0, "{}", scrape.text);
    assert!(attempts(&scrape, "default", &dying.url(), "error") >= 1.0);

    // Refused before anything was sent: tried again on the other server, body and all.
    let live = Backend::start().await;
    let refusing = RefusingPort::new();
    let refused = refusing.url();
    let gw = Gateway::start(&one_pool(&[refused.clone(), live.url()], ""));
    for i in 0..4 {
        let (tx, body) = channel_body();
        let (client, url) = (client.clone(), gw.url(&format!("/upload/{i}")));
        let reply = tokio::spawn(async move {
            client
                .try_send("POST", &url, &[], body, Duration::from_secs(30))
                .await
        });
        for _ in 0..3 {
            assert!(
                tx.send(Bytes::from(vec![b'b'; 10_000])).await,
                "POST {i}: body refused"
            );
        }
        drop(tx);
        let r = reply
            .await
            .expect("the POST's task")
            .unwrap_or_else(|e| panic!("POST {i}: {e}"));
        assert_eq!(r.status, StatusCode::OK, "POST {i}: {r:?}");
        assert_eq!(r.body, "ok 30000\n", "POST {i}");
    }
    let posts: Vec<usize> = live
        .hits()
        .iter()
        .filter(|h| h.method == "POST")
        .map(|h| h.body_len)
        .collect();
    assert_eq!(
        posts, [30_000; 4],
        "the live server got each POST whole, once"
    );
    let scrape = Scrape::take(&client, &gw).await;
    assert!(
        attempts(&scrape, "default", &refused, "error") >= 1.0,
        "no POST was tried on the refusing server first:\n{}",
        scrape.text
    );
    assert!(retries(&scrape, "default") >= 1.0, "{}", scrape.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_budget_holds_retries_down_when_every_server_resets() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let r = [
        Resetter::start().await,
        Resetter::start().await,
        Resetter::start().await,
    ];
    let list: Vec<String> = r.iter().map(Resetter::url).collect();
    // Never ejected (max_fails = 0), and three retries a request: without a budget, every
    // request would be tried on all three servers.
    let gw = Gateway::start(&one_pool(&list, "retries = 2\nmax_fails = 0\n"));
    let client = HttpClient::new();
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    const CLIENTS: usize = 8;
    const EACH: usize = 100;
    for c in 0..CLIENTS {
        let (client, url) = (client.clone(), gw.url("/reset"));
        tasks.spawn(async move {
            let mut statuses = Vec::new();
            for i in 0..EACH {
                let r = client
                    .try_get(&format!("{url}/{c}-{i}"), &[], Duration::from_secs(30))
                    .await;
                statuses.push(r.map(|r| r.status.as_u16()));
            }
            statuses
        });
    }
    let mut all = Vec::new();
    while let Some(part) = tasks.join_next().await {
        all.extend(part.expect("a client panicked"));
    }
    let elapsed = started.elapsed();
    let requests = CLIENTS * EACH;
    let not_502: Vec<_> = all.iter().filter(|s| **s != Ok(502)).collect();
    assert!(
        not_502.is_empty(),
        "every request ends 502: {} did not, e.g. {:?}",
        not_502.len(),
        not_502.first()
    );
    let scrape = Scrape::take(&client, &gw).await;
    let retried = retries(&scrape, "default");
    let exhausted = scrape.get(
        "ratewall_upstream_retry_budget_exhausted_total",
        &[("pool", "default")],
    );
    // 20% of the requests, plus 3 a second over the run and the budget's 10 s window (a
    // fresh pool may spend its floor, 3 × 10, at once).
    let budget = 0.2 * requests as f64 + 3.0 * (elapsed.as_secs_f64().ceil() + 10.0);
    eprintln!(
        "{requests} requests in {elapsed:?}: {retried} retries (budget {budget}), {exhausted} refused by the budget"
    );
    assert!(
        retried <= budget,
        "{retried} retries for {requests} requests in {elapsed:?}: over the budget {budget}"
    );
    assert!(retried >= 1.0, "no request was retried at all");
    assert!(
        exhausted >= 1.0,
        "the budget never refused a retry ({retried} retries)"
    );
    // Nothing was sent that the counts do not show: each attempt is a first or a retry.
    let sent: usize = r.iter().map(Resetter::resets).sum();
    assert!(
        sent >= requests && sent as f64 <= requests as f64 + retried,
        "the servers saw {sent} attempts for {requests} requests and {retried} retries"
    );
}

// ---------------------------------------------------------------------------------------
// Routes

/// `GET target` with `Host: host`, raw (the request line's bytes exactly as written): its
/// status.
async fn raw_get(port: u16, target: &str, host: &str) -> u16 {
    let request = format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    raw_exchange(port, request.as_bytes()).await.status
}

fn targets(b: &Backend) -> Vec<String> {
    b.hits().into_iter().map(|h| h.target).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_by_host_and_path_prefix_strip_the_prefix_of_the_path_as_matched() {
    let _watch = common::watchdog();
    let (web, billing, api) = (
        Backend::start().await,
        Backend::start().await,
        Backend::start().await,
    );
    let body = format!(
        "{}{}{}{MEMORY}\
         [[routes]]\nname = \"billing\"\nmatch = {{ path_prefix = \"/billing/\" }}\nupstream = \"billing\"\nstrip_prefix = \"/billing\"\n\
         [[routes]]\nname = \"api\"\nmatch = {{ host = \"api.example.com\" }}\nupstream = \"api\"\n",
        pool("default", &servers(&[web.url()]), ""),
        pool("billing", &servers(&[billing.url()]), ""),
        pool("api", &servers(&[api.url()]), ""),
    );
    let gw = Gateway::start(&body);
    let sent = [
        ("/billing/inv%2F1/a%20b/%7Euser?x=1&y=%2F&z", "shop.example"),
        ("/billing/?q=a%26b", "shop.example"),
        ("/v1/%E2%82%AC/%2e%2E?k=v&k=w", "api.example.com"),
        // First match wins: the billing route comes before the host's.
        ("/billing/x?h=api", "api.example.com"),
        ("/elsewhere/%41?x", "shop.example"),
    ];
    for (target, host) in sent {
        assert_eq!(raw_get(gw.port, target, host).await, 200, "{host} {target}");
    }
    assert_eq!(
        targets(&billing),
        ["/inv/1/a%20b/~user?x=1&y=%2F&z", "/?q=a%26b", "/x?h=api"],
        "what the billing pool saw"
    );
    assert_eq!(
        targets(&api),
        ["/v1/%E2%82%AC/%2e%2E?k=v&k=w"],
        "what the api pool saw"
    );
    assert_eq!(
        targets(&web),
        ["/elsewhere/%41?x"],
        "what the default pool saw"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_matching_a_route_limits_only_that_routes_requests() {
    let _watch = common::watchdog();
    let (web, billing) = (Backend::start().await, Backend::start().await);
    let body = format!(
        "{}{}{MEMORY}\
         [[routes]]\nname = \"billing\"\nmatch = {{ path_prefix = \"/billing/\" }}\nupstream = \"billing\"\n\
         [[rules]]\nname = \"billing-only\"\nkey = \"global\"\nrate = \"1/h\"\nburst = 3\nmatch = {{ route = \"billing\" }}\n",
        pool("default", &servers(&[web.url()]), ""),
        pool("billing", &servers(&[billing.url()]), ""),
    );
    let gw = Gateway::start(&body);
    let client = HttpClient::new();
    let mut routed = Vec::new();
    let mut other = Vec::new();
    for i in 0..5 {
        let r = client.get(&gw.url(&format!("/billing/{i}")), &[]).await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(
                r.json()["violated-policies"],
                serde_json::json!(["billing-only"]),
                "{r:?}"
            );
        }
        routed.push(r.status.as_u16());
        other.push(
            client
                .get(&gw.url(&format!("/other/{i}")), &[])
                .await
                .status
                .as_u16(),
        );
    }
    assert_eq!(routed, [200, 200, 200, 429, 429], "the billing route");
    assert_eq!(other, [200; 5], "requests of no route: no rule applies");
    assert_eq!(billing.count("/billing/"), 3);
    assert_eq!(web.count("/other/"), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_route_without_a_default_pool_is_a_404_problem_and_nothing_is_forwarded() {
    let _watch = common::watchdog();
    let api = Backend::start().await;
    let body = format!(
        "{}{MEMORY}[[routes]]\nname = \"api\"\nmatch = {{ path_prefix = \"/api/\" }}\nupstream = \"api\"\n",
        pool("api", &servers(&[api.url()]), ""),
    );
    let gw = Gateway::start(&body);
    let client = HttpClient::new();
    let r = client.get(&gw.url("/nowhere?x=1"), &[]).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{r:?}");
    assert_eq!(
        r.header("content-type"),
        Some("application/problem+json"),
        "{r:?}"
    );
    let problem = r.json();
    assert_eq!(problem["status"], 404, "{problem}");
    assert!(
        problem.to_string().contains("no route"),
        "the problem says why: {problem}"
    );
    assert!(api.hits().is_empty(), "forwarded: {:?}", api.hits());
    // A routed request still goes through.
    let r = client.get(&gw.url("/api/x"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(targets(&api), ["/api/x"]);
    // Counted, and logged, as no_route.
    let scrape = Scrape::take(&client, &gw).await;
    assert_eq!(
        text_value(
            &scrape,
            "ratewall_request_duration_seconds_count{outcome=\"no_route\"}"
        ),
        1.0,
        "{}",
        scrape.text
    );
    assert_eq!(
        scrape.get("ratewall_refusals_total", &[("reason", "no_route")]),
        1.0,
        "{}",
        scrape.text
    );
    let logged = gw.wait_for_log("decision=\"no_route\"", 1, WAIT);
    assert!(logged, "no access line says no_route:\n{}", gw.logs());
}

// ---------------------------------------------------------------------------------------
// Reload

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_removing_a_server_under_load_loses_no_request() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let b = backends(3).await;
    let gw = Gateway::start(&one_pool(&urls(&[&b[0], &b[1], &b[2]]), ""));
    let client = HttpClient::new();
    // Each request held 50 ms, so that some are in flight on the server as it goes.
    let load = Load::start(&client, &gw.url("/slow/50"), 50, Duration::ZERO);
    let warmed = eventually(WAIT, || b.iter().all(|s| s.count("/slow/") >= 20)).await;
    assert!(warmed, "the load did not reach every server");

    gw.rewrite_config(&one_pool(&urls(&[&b[0], &b[1]]), ""));
    let in_flight = b[2].in_flight();
    gw.reload(1);
    assert!(
        in_flight > 0,
        "no request was in flight on the removed server: the test proves nothing"
    );
    // Its last requests (picked before the reload) arrive and end; then nothing more.
    let mut last = b[2].arrived();
    let mut still = Instant::now();
    let settled = eventually(WAIT, || {
        let now = b[2].arrived();
        if now != last {
            (last, still) = (now, Instant::now());
        }
        b[2].in_flight() == 0 && still.elapsed() >= Duration::from_millis(500)
    })
    .await;
    assert!(settled, "the removed server kept getting requests");
    let removed = b[2].arrived();
    let others = b[0].arrived() + b[1].arrived();
    let more = eventually(WAIT, || b[0].arrived() + b[1].arrived() >= others + 300).await;
    let tally = load.finish().await;
    assert!(more, "the load stalled after the reload");
    assert_eq!(
        b[2].arrived(),
        removed,
        "the removed server got requests after the reload"
    );
    assert!(
        tally.bad.is_empty(),
        "{} of {} requests lost, e.g. {:?}",
        tally.bad.len(),
        tally.ok + tally.bad.len(),
        &tally.bad[..tally.bad.len().min(5)]
    );
}

// ---------------------------------------------------------------------------------------
// A name with two addresses

/// A name `/etc/hosts` gives two loopback addresses, for the test below:
/// ```text
/// 127.0.0.1 ratewall-pools.test
/// 127.0.0.2 ratewall-pools.test
/// ```
const TWO_ADDRESS_NAME: &str = "ratewall-pools.test";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_resolving_to_two_addresses_is_balanced_over_both() {
    let _watch = common::watchdog();
    let resolved: Vec<std::net::IpAddr> = (TWO_ADDRESS_NAME, 80)
        .to_socket_addrs()
        .map(|a| a.map(|s| s.ip()).collect())
        .unwrap_or_default();
    let want: [std::net::IpAddr; 2] = [[127, 0, 0, 1].into(), [127, 0, 0, 2].into()];
    if !want.iter().all(|ip| resolved.contains(ip)) {
        return common::skip(&format!(
            "{TWO_ADDRESS_NAME} resolves to {resolved:?}, not to both 127.0.0.1 and \
             127.0.0.2; add both lines to /etc/hosts to run this test (.ci/run does)"
        ));
    }
    // The same port on both addresses.
    let (first, second) = {
        let mut pair = None;
        for _ in 0..10 {
            let first = Backend::start().await;
            let other: SocketAddr = ([127, 0, 0, 2], first.addr.port()).into();
            if std::net::TcpListener::bind(other).is_ok() {
                pair = Some((first, Backend::start_on(other, OnBody::Read).await));
                break;
            }
        }
        pair.expect("a port free on both 127.0.0.1 and 127.0.0.2")
    };
    let label = format!("http://{TWO_ADDRESS_NAME}:{}", first.addr.port());
    let gw = Gateway::start(&one_pool(std::slice::from_ref(&label), ""));
    let client = HttpClient::new();
    for i in 0..40 {
        let r = client.get(&gw.url(&format!("/two/{i}")), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "request {i}: {r:?}");
    }
    let counts = [first.count("/two/"), second.count("/two/")];
    assert!(
        counts.iter().all(|n| (15..=25).contains(n)),
        "40 requests over 127.0.0.1 and 127.0.0.2: {counts:?}"
    );
    // One label for the name; the status page lists each address.
    let scrape = Scrape::take(&client, &gw).await;
    assert_eq!(
        attempts(&scrape, "default", &label, "2xx"),
        40.0,
        "{}",
        scrape.text
    );
    let page = status(&gw).await;
    let listed = status_servers(&page, "default", &label);
    for addr in [first.addr, second.addr] {
        assert!(
            listed
                .iter()
                .any(|s| s["address"].as_str() == Some(&addr.to_string())),
            "{addr} not on the status page: {listed:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// `ratewall check` and the access log

#[test]
fn check_names_the_route_and_pool_a_request_would_take() {
    let _watch = common::watchdog();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("limits.toml");
    std::fs::write(
        &file,
        "[server]\nlisten = \"127.0.0.1:8080\"\n\
         [[upstreams]]\nname = \"api-pool\"\nservers = [\"http://127.0.0.1:3001\"]\n\
         [[upstreams]]\nname = \"billing-pool\"\nservers = [\"http://127.0.0.1:3002\"]\n\
         [[routes]]\nname = \"api-route\"\nmatch = { host = \"api.example.com\" }\nupstream = \"api-pool\"\n\
         [[routes]]\nname = \"billing-route\"\nmatch = { path_prefix = \"/billing/\" }\nupstream = \"billing-pool\"\n\
         [store]\nbackend = \"memory\"\n",
    )
    .expect("write the config");
    // The part of `check`'s output about the sample request (after the effective config).
    let explain = |path: &str, host: &str| {
        let out = Command::new(binary())
            .arg("check")
            .arg("--config")
            .arg(&file)
            .args(["--path", path, "--host", host])
            .output()
            .expect("run ratewall check");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "check --path {path} --host {host}: {}\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let at = stdout
            .find("sample request")
            .unwrap_or_else(|| panic!("no sample request in:\n{stdout}"));
        stdout[at..].to_string()
    };
    let names = |text: &str, route: &str, pool: &str| {
        text.lines().any(|l| l.contains(route) && l.contains(pool))
    };
    let billing = explain("/billing/x", "h.example");
    assert!(
        names(&billing, "billing-route", "billing-pool"),
        "no line names billing-route and billing-pool:\n{billing}"
    );
    assert!(!names(&billing, "api-route", "api-pool"), "{billing}");
    // First match wins: the host's route comes first.
    let api = explain("/billing/x", "api.example.com");
    assert!(
        names(&api, "api-route", "api-pool"),
        "no line names api-route and api-pool:\n{api}"
    );
    assert!(!names(&api, "billing-route", "billing-pool"), "{api}");
    // No route and no default pool.
    let none = explain("/elsewhere", "h.example");
    assert!(
        none.lines()
            .any(|l| l.starts_with("route") && l.contains("404")),
        "check does not say the request has no route and gets a 404:\n{none}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_names_route_pool_server_and_attempts() {
    let _watch = common::watchdog();
    let live = Backend::start().await;
    let refusing = RefusingPort::new();
    let refused = refusing.url();
    let body = format!(
        "{}{MEMORY}[[routes]]\nname = \"billing\"\nmatch = {{ path_prefix = \"/billing/\" }}\nupstream = \"payments\"\n",
        pool("payments", &servers(&[refused.clone(), live.url()]), ""),
    );
    let gw = Gateway::start_with(&body, &["--log-format", "json"], &[]);
    let client = HttpClient::new();
    for i in 0..2 {
        let r = client.get(&gw.url(&format!("/billing/{i}")), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "request {i}: {r:?}");
    }
    assert!(
        gw.wait_for_log("ratewall::access", 2, WAIT),
        "{}",
        gw.logs()
    );
    let logs = gw.logs();
    let lines = events(&logs, "ratewall::access");
    assert_eq!(lines.len(), 2, "{logs}");
    let mut tries = 0;
    for line in &lines {
        let f = &line["fields"];
        assert_eq!(f["route"], "billing", "{f}");
        assert_eq!(f["pool"], "payments", "{f}");
        assert_eq!(
            f["server"],
            live.url().as_str(),
            "the server that answered: {f}"
        );
        let n = number(&f["attempts"]).unwrap_or_else(|| panic!("no attempts: {f}"));
        assert!((1..=2).contains(&n), "{f}");
        tries += n;
    }
    // Round robin over a refusing server and a live one: at least one request went to the
    // refusing one first, and the attempts logged are the metrics' retries more than the
    // requests.
    let scrape = Scrape::take(&client, &gw).await;
    let retried = retries(&scrape, "payments");
    assert!(retried >= 1.0, "{}", scrape.text);
    assert_eq!(tries as f64, 2.0 + retried, "{lines:?}");
}
