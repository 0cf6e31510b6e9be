//! Faults and hostile inputs, end to end: the real `ratewall` binary between real clients,
//! a real upstream and a real `redis-server`, while things break.
//!
//! - Redis killed (SIGKILL) and restarted empty under concurrent load, with
//!   `on_error = "deny"` and `"local"`: every request is answered within the store timeout
//!   plus a margin, the chosen policy is applied (503, or in-process limits that still
//!   hold), the outage is logged once, and limiting by Redis resumes by itself.
//! - Redis alive but not answering (`CLIENT PAUSE`): the first calls wait the store
//!   timeout, then the circuit breaker opens and answers are immediate; `/readyz` says so;
//!   the breaker closes by itself when Redis answers again.
//! - SIGHUP under load, with a valid file (new rules in force, unchanged rules keep their
//!   state) and an invalid one (rejected, the old config keeps serving), never a 5xx or a
//!   dropped connection.
//! - SIGTERM with requests in flight: the port closes, in-flight requests finish, exit 0
//!   within `shutdown_grace`; and a grace shorter than a request bounds the drain.
//! - Upstream faults: a response cut mid-body, a dead upstream port, an upstream slower
//!   than `timeout`, none of which spills over onto other requests.
//! - Request smuggling and oversized heads, sent as raw bytes: refused, the connection
//!   closed after a body of unknowable length, and nothing reaches the upstream.
//! - A Redis key of the wrong type: one key's problem, answered by `on_error` and logged
//!   by its Redis key name (never the raw API key), without opening the breaker.
//!
//! The tests take one lock each (`SERIAL`) so that the latency bounds of one are not
//! measured while another one loads the machine.
//!
//! Coverage: 12 faults and 11 bad inputs.
//! - Faults: Redis killed under load with `on_error = "deny"`; the same with
//!   `on_error = "local"`; Redis restarted empty; Redis alive but not answering
//!   (`CLIENT PAUSE`); a Redis key of the wrong type; a valid config reloaded under load;
//!   an invalid config reloaded under load; SIGTERM with requests in flight; SIGTERM with
//!   a request longer than `shutdown_grace`; an upstream cutting its response mid-body; a
//!   dead upstream port; an upstream slower than `timeout`.
//! - Bad inputs: `Content-Length` before `Transfer-Encoding: chunked`; the same after it;
//!   two different `Content-Length`s; `Transfer-Encoding: gzip, chunked`; `xchunked`;
//!   `chunked, identity`; `chunked` on two lines; `chunked` then `identity` on two lines;
//!   two `Host` headers; 200 header lines of 100 bytes; a config file with an unknown key.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    api_rule, burst_then_429, policies, redis_key, serial, try_raw_exchange, try_remaining,
    upstream_and_store, Gateway, HttpClient, RedisServer, Scrape, Store, Upstream,
};
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// ---------------------------------------------------------------------------------------
// 1. Redis killed and restarted under load

/// One request of a load loop.
#[derive(Debug)]
struct Outcome {
    key: usize,
    /// Since the load started.
    start: Duration,
    took: Duration,
    status: Result<u16, String>,
}

impl Outcome {
    fn end(&self) -> Duration {
        self.start + self.took
    }
}

/// Requests per API key in the load: more than the burst, so each key ends up denied.
const PER_KEY: usize = 8;

/// Send requests in a loop until `t0 + run`. The loops share `counter`: every run of
/// `PER_KEY` requests, spread over the loops that take them, carries a new API key, so the
/// store is asked throughout (a key Redis denied is answered from the deny cache).
async fn load_loop(
    client: HttpClient,
    url: String,
    prefix: &'static str,
    counter: Arc<AtomicUsize>,
    t0: Instant,
    run: Duration,
) -> Vec<Outcome> {
    let mut out = Vec::new();
    while t0.elapsed() < run {
        let key = counter.fetch_add(1, Ordering::Relaxed) / PER_KEY;
        let name = format!("{prefix}-load-{key}");
        let start = t0.elapsed();
        let at = Instant::now();
        let r = client
            .try_get(&url, &[("x-api-key", &name)], Duration::from_secs(5))
            .await;
        out.push(Outcome {
            key,
            start,
            took: at.elapsed(),
            status: r.map(|r| r.status.as_u16()),
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    out
}

const OUTAGE_BURST: usize = 5;

async fn redis_outage_under_load(on_error: &'static str) {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    // 250 ms: a loaded machine must not turn a healthy Redis into a second outage (the
    // first call after the restart also loads the script again), and every request must
    // still be answered well within the 1 s bound below.
    let store = Store::Redis {
        url: redis.url(),
        on_error,
        timeout: "250ms",
    };
    let gw = Gateway::start(&format!(
        "{}{}",
        upstream_and_store(&upstream.url(), &store),
        api_rule(OUTAGE_BURST as u64)
    ));
    let client = HttpClient::new();
    let url = gw.url("/api/x");

    let t0 = Instant::now();
    let run = Duration::from_secs(4);
    let counter = Arc::new(AtomicUsize::new(0));
    let loops: Vec<_> = (0..4)
        .map(|_| {
            tokio::spawn(load_loop(
                client.clone(),
                url.clone(),
                on_error,
                counter.clone(),
                t0,
                run,
            ))
        })
        .collect();
    tokio::time::sleep_until((t0 + Duration::from_millis(1000)).into()).await;
    let killing = t0.elapsed();
    tokio::task::block_in_place(|| redis.kill());
    let killed = t0.elapsed();
    tokio::time::sleep_until((t0 + Duration::from_millis(2500)).into()).await;
    let restarting = t0.elapsed();
    tokio::task::block_in_place(|| redis.restart());
    let mut outcomes = Vec::new();
    for l in loops {
        outcomes.extend(l.await.expect("load loop"));
    }
    let ctx = format!("on_error = {on_error}");

    // Every request was answered, quickly.
    assert!(
        outcomes.len() >= 200,
        "{ctx}: the load ran: {} requests",
        outcomes.len()
    );
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| o.status.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{ctx}: {} requests got no answer, e.g. {:?}\n{}",
        failed.len(),
        &failed[..failed.len().min(5)],
        gw.logs()
    );
    let slow: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.took >= Duration::from_secs(1))
        .collect();
    assert!(
        slow.is_empty(),
        "{ctx}: store timeout 250 ms, yet {} requests took 1 s or more, e.g. {:?}",
        slow.len(),
        &slow[..slow.len().min(5)]
    );

    let status = |o: &Outcome| *o.status.as_ref().expect("checked above");
    let tally = |os: &[&Outcome]| {
        let mut m: BTreeMap<u16, usize> = BTreeMap::new();
        for o in os {
            *m.entry(status(o)).or_default() += 1;
        }
        m
    };
    let mut by_key: BTreeMap<usize, Vec<&Outcome>> = BTreeMap::new();
    for o in &outcomes {
        by_key.entry(o.key).or_default().push(o);
    }
    // The keys whose every request was sent and answered within `from..to`.
    let keys_within = |from: Duration, to: Duration| -> Vec<(usize, BTreeMap<u16, usize>)> {
        by_key
            .iter()
            .filter(|(_, os)| {
                os.len() == PER_KEY && os.iter().all(|o| o.start >= from && o.end() < to)
            })
            .map(|(k, os)| (*k, tally(os)))
            .collect()
    };
    let exact = BTreeMap::from([(200, OUTAGE_BURST), (429, PER_KEY - OUTAGE_BURST)]);

    // Before the kill Redis alone decided: exactly the burst of each key passed, however
    // its requests interleaved across the loops.
    let before = keys_within(Duration::ZERO, killing);
    assert!(
        before.len() >= 5,
        "{ctx}: the load ran before the kill: {} keys",
        before.len()
    );
    for (k, counts) in &before {
        assert_eq!(counts, &exact, "{ctx}: key {k} before the kill");
    }
    for (k, os) in &by_key {
        let passed = os
            .iter()
            .filter(|o| o.end() < killing && status(o) == 200)
            .count();
        assert!(
            passed <= OUTAGE_BURST,
            "{ctx}: key {k} got {passed} 200s from Redis with a burst of {OUTAGE_BURST}"
        );
    }

    // Requests sent after the kill completed and answered before the restart began: Redis
    // could not have decided any of them.
    let during: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.start > killed && o.end() < restarting)
        .collect();
    let during_counts = tally(&during);
    let outage_keys = keys_within(killed, restarting);
    assert!(
        during.len() >= 50 && outage_keys.len() >= 5,
        "{ctx}: the load ran through the outage ({killed:?}..{restarting:?}): {} requests, {} \
         keys",
        during.len(),
        outage_keys.len()
    );
    let counts = tally(&outcomes.iter().collect::<Vec<_>>());
    match on_error {
        "deny" => {
            assert!(
                counts.keys().all(|s| [200, 429, 503].contains(s)),
                "{ctx}: statuses {counts:?}"
            );
            assert!(
                !during_counts.contains_key(&200) && during_counts.contains_key(&503),
                "{ctx}: nothing passes while Redis is down, and requests are refused: \
                 {during_counts:?}"
            );
            // A key Redis never saw cannot be in the deny cache: all of it is refused.
            for (k, counts) in &outage_keys {
                assert_eq!(
                    counts,
                    &BTreeMap::from([(503, PER_KEY)]),
                    "{ctx}: key {k} during the outage"
                );
            }
        }
        "local" => {
            assert!(
                counts.keys().all(|s| [200, 429].contains(s)),
                "{ctx}: never a 503 with local limits: {counts:?}\n{}",
                gw.logs()
            );
            // The local store is only used while Redis fails, and nothing refills within
            // the test: while Redis is down no key passes more than its burst, and a key
            // that lived entirely in the outage passes exactly its burst.
            for (k, os) in &by_key {
                let local = os
                    .iter()
                    .filter(|o| o.start > killed && o.end() < restarting && status(o) == 200)
                    .count();
                assert!(
                    local <= OUTAGE_BURST,
                    "{ctx}: key {k} got {local} 200s while Redis was down, with a local burst \
                     of {OUTAGE_BURST}"
                );
            }
            for (k, counts) in &outage_keys {
                assert_eq!(counts, &exact, "{ctx}: key {k} during the outage");
            }
        }
        other => unreachable!("{other}"),
    }

    // Limiting by Redis resumes by itself.
    let back = tokio::task::block_in_place(|| {
        gw.wait_for_log("store answers again", 1, Duration::from_secs(10))
    });
    assert!(
        back,
        "{ctx}: the gateway never logged that Redis answers again\n{}",
        gw.logs()
    );
    let fresh = format!("{on_error}-fresh-after-restart");
    assert_eq!(
        client.statuses(&url, &fresh, OUTAGE_BURST + 1).await,
        burst_then_429(OUTAGE_BURST),
        "{ctx}: a fresh key gets exactly its burst\n{}",
        gw.logs()
    );
    let mut conn = redis.conn();
    let exists: bool = redis::cmd("EXISTS")
        .arg(redis_key(&fresh, "api"))
        .query(&mut conn)
        .expect("EXISTS");
    assert!(
        exists,
        "{ctx}: the fresh key was decided by Redis\n{}",
        gw.logs()
    );
    let ready = client.get(&gw.admin_url("/readyz"), &[]).await;
    assert_eq!(ready.status, StatusCode::OK, "{ctx}: {:?}", ready.body);

    let logs = gw.logs();
    for (line, want) in [
        ("store failing", 1),
        ("circuit breaker open", 1),
        ("store answers again", 1),
        ("circuit breaker closed", 1),
    ] {
        assert_eq!(
            logs.matches(line).count(),
            want,
            "{ctx}: {line:?} is logged once per outage:\n{logs}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_under_load() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    redis_outage_under_load("deny").await;
    redis_outage_under_load("local").await;
}

// ---------------------------------------------------------------------------------------
// 2. A Redis that does not answer

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_pause_opens_the_breaker_and_answers_stay_fast() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    const BURST: usize = 3;
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = Store::Redis {
        url: redis.url(),
        on_error: "deny",
        timeout: "100ms",
    };
    let gw = Gateway::start(&format!(
        "{}breaker_failures = 3\nbreaker_cooldown = \"500ms\"\n{}",
        upstream_and_store(&upstream.url(), &store),
        api_rule(BURST as u64)
    ));
    let client = HttpClient::new();
    let url = gw.url("/api/x");
    // The connection to Redis is up before the pause.
    assert_eq!(
        client.get(&url, &[("x-api-key", "warm-up")]).await.status,
        StatusCode::OK
    );

    // Paused long enough for the checks below to run inside it on a loaded machine (they
    // take well under a second).
    let paused_at = Instant::now();
    let pause_ends = paused_at + Duration::from_millis(6000);
    tokio::task::block_in_place(|| {
        let mut c = redis.conn();
        redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(6000)
            .arg("ALL")
            .query::<()>(&mut c)
            .expect("CLIENT PAUSE");
    });

    // Counted, not timed: the store calls made, and how each failed.
    let store = |s: &Scrape| {
        (
            s.get(
                "ratewall_store_call_duration_seconds_count",
                &[("backend", "redis")],
            ),
            s.get("ratewall_store_errors_total", &[("kind", "timeout")]),
            s.get("ratewall_store_errors_total", &[("kind", "breaker_open")]),
        )
    };
    let (calls, _, _) = store(&Scrape::take(&client, &gw).await);
    // Three failures in a row open the breaker: each of them waited the store timeout
    // (not before it; timed out, as counted).
    for i in 0..3 {
        let start = Instant::now();
        let r = client.get(&url, &[("x-api-key", "paused")]).await;
        let took = start.elapsed();
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "request {i}");
        assert_eq!(r.header("retry-after"), Some("1"));
        assert!(
            took >= Duration::from_millis(90),
            "request {i} took {took:?}: at least the 100 ms store timeout"
        );
    }
    assert_eq!(
        store(&Scrape::take(&client, &gw).await),
        (calls + 3.0, 3.0, 0.0),
        "(store calls, timeouts, skipped by the breaker) after three requests"
    );
    // Open: no more waiting on the store, as no call is made (a closed breaker would cost
    // each request a call and its 100 ms timeout). Only a trial once per cooldown (500 ms),
    // should the twenty take that long on a loaded machine: it fails, and the breaker
    // opens again.
    let open = Instant::now();
    for i in 0..20 {
        let r = client.get(&url, &[("x-api-key", "paused")]).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "request {i}");
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    let cooldowns = (open.elapsed().as_millis() / 500) as f64;
    let (now_calls, timeouts, skipped) = store(&Scrape::take(&client, &gw).await);
    let trials = now_calls - (calls + 3.0);
    assert!(
        trials <= cooldowns && timeouts == 3.0 + trials && skipped + trials == 20.0,
        "with the breaker open no store call is made but a trial per cooldown ({cooldowns} \
         passed): {trials} calls, {timeouts} timeouts, {skipped} skipped"
    );
    let ready = client.get(&gw.admin_url("/readyz"), &[]).await;
    let body = String::from_utf8_lossy(&ready.body).into_owned();
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("breaker open"), "{body}");
    assert!(
        Instant::now() < pause_ends,
        "the checks above ran while Redis was paused"
    );
    assert!(gw.logs().contains("circuit breaker open"), "{}", gw.logs());

    // After the pause the breaker closes by itself and Redis limits again. Keys used
    // during the pause are avoided: Redis runs the queued calls when the pause ends.
    let deadline = pause_ends + Duration::from_secs(5);
    let mut probe = 0;
    loop {
        probe += 1;
        let key = format!("after-pause-probe-{probe}");
        let r = client.get(&url, &[("x-api-key", &key)]).await;
        if r.status == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Redis still not used 5 s after the pause ended: {}\n{}",
            r.status,
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        Instant::now() > pause_ends,
        "a request passed while Redis was paused"
    );
    assert_eq!(
        client.statuses(&url, "after-pause", BURST + 1).await,
        burst_then_429(BURST)
    );
    assert!(
        gw.logs().contains("circuit breaker closed"),
        "{}",
        gw.logs()
    );
    assert_eq!(
        client.get(&gw.admin_url("/readyz"), &[]).await.status,
        StatusCode::OK
    );
}

// ---------------------------------------------------------------------------------------
// 3. SIGHUP under load

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_valid_then_invalid() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let base = upstream_and_store(&upstream.url(), &Store::Memory);
    let api = api_rule(50);
    let gw = Gateway::start(&format!("{base}{api}"));
    let client = HttpClient::new();

    // Load: three loops over two paths for as long as the test, each on a new key every
    // 40 requests so that some are forwarded and some denied throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let loops: Vec<_> = (0..3)
        .map(|n| {
            let (client, stop, sent) = (client.clone(), stop.clone(), sent.clone());
            let urls = [gw.url("/a"), gw.url("/v2/x")];
            tokio::spawn(async move {
                let mut out = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("load-{n}-{}", i / 40);
                    let start = Instant::now();
                    sent.fetch_add(1, Ordering::Relaxed);
                    let r = client
                        .try_get(&urls[i % 2], &[("x-api-key", &key)], Duration::from_secs(5))
                        .await;
                    out.push((start, r.map(|r| r.status.as_u16())));
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                out
            })
        })
        .collect();

    // A key that uses 7 of its 50 tokens before the reload.
    let steady = [("x-api-key", "steady")];
    let mut last = None;
    for _ in 0..7 {
        last = Some(client.get(&gw.url("/a"), &steady).await);
    }
    let last = last.expect("seven requests");
    assert_eq!(last.status, StatusCode::OK);
    assert_eq!(try_remaining(&last, "api"), Some(43), "{:?}", last.headers);
    let before = client
        .get(&gw.url("/v2/x"), &[("x-api-key", "v2-before")])
        .await;
    assert_eq!(policies(&before), ["api"], "no v2 rule yet");

    // Each phase runs under load: until 15 more requests were sent (the check below wants
    // 10 in each).
    let phase = || {
        let sent = sent.clone();
        async move {
            let from = sent.load(Ordering::Relaxed);
            let end = Instant::now() + Duration::from_secs(20);
            while sent.load(Ordering::Relaxed) < from + 15 {
                assert!(Instant::now() < end, "the load stalled");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };

    // (a) A valid file with a second rule.
    phase().await;
    let v2 = "[[rules]]\nname = \"v2\"\nmatch = { path_prefix = \"/v2/\" }\nkey = \"api_key\"\nrate = \"3/h\"\n";
    gw.rewrite_config(&format!("{base}{api}{v2}"));
    gw.signal("HUP");
    let first_hup = Instant::now();
    let reloaded = tokio::task::block_in_place(|| {
        gw.wait_for_log("config reloaded", 1, Duration::from_secs(10))
    });
    assert!(reloaded, "no reload logged\n{}", gw.logs());
    let r = client.get(&gw.url("/a"), &steady).await;
    assert_eq!(
        try_remaining(&r, "api"),
        Some(42),
        "the unchanged rule kept its state: {:?}",
        r.headers
    );
    let v2_key = [("x-api-key", "v2-after")];
    let mut v2_statuses = Vec::new();
    for i in 0..4 {
        let r = client.get(&gw.url("/v2/x"), &v2_key).await;
        if i == 0 {
            assert_eq!(policies(&r), ["api", "v2"], "the new rule is in force");
            assert_eq!(try_remaining(&r, "v2"), Some(2), "{:?}", r.headers);
        }
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(r.json()["violated-policies"], serde_json::json!(["v2"]));
        }
        v2_statuses.push(r.status.as_u16());
    }
    assert_eq!(v2_statuses, [200, 200, 200, 429]);

    // (b) An invalid file: rejected whole, the previous config keeps serving.
    let v3 = "[[rules]]\nname = \"v3\"\nkey = \"api_key\"\nrate = \"1/h\"\ncolour = \"red\"\n";
    phase().await;
    gw.rewrite_config(&format!("{base}{api}{v2}{v3}"));
    gw.signal("HUP");
    let second_hup = Instant::now();
    let rejected = tokio::task::block_in_place(|| {
        gw.wait_for_log("config reload rejected", 1, Duration::from_secs(10))
    });
    assert!(rejected, "no rejection logged\n{}", gw.logs());
    assert!(
        gw.logs().contains("colour"),
        "the rejection names the unknown key\n{}",
        gw.logs()
    );
    assert_eq!(gw.logs().matches("config reloaded").count(), 1);
    let r = client.get(&gw.url("/a"), &steady).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(policies(&r), ["api"], "v3 was not applied");
    assert_eq!(try_remaining(&r, "api"), Some(41), "{:?}", r.headers);
    let r = client
        .get(&gw.url("/v2/x"), &[("x-api-key", "v2-after-rejection")])
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(policies(&r), ["api", "v2"], "the valid config still serves");
    assert_eq!(
        client.get(&gw.url("/v2/x"), &v2_key).await.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the v2 rule kept its state through the rejected reload"
    );

    phase().await;
    stop.store(true, Ordering::Relaxed);
    let mut results = Vec::new();
    for l in loops {
        results.extend(l.await.expect("load loop"));
    }
    let phases = [
        results.iter().filter(|(t, _)| *t < first_hup).count(),
        results
            .iter()
            .filter(|(t, _)| (first_hup..second_hup).contains(t))
            .count(),
        results.iter().filter(|(t, _)| *t >= second_hup).count(),
    ];
    assert!(
        phases.iter().all(|&n| n >= 10),
        "the load ran before, between and after the reloads: {phases:?}"
    );
    let statuses = common::tally(
        results
            .iter()
            .filter_map(|(_, r)| r.as_ref().ok().and_then(|&s| StatusCode::from_u16(s).ok())),
    );
    assert!(
        statuses.contains_key(&200) && statuses.contains_key(&429),
        "the load was both forwarded and limited: {statuses:?}"
    );
    let bad: Vec<&Result<u16, String>> = results
        .iter()
        .map(|(_, r)| r)
        .filter(|r| !matches!(r, Ok(200 | 429)))
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} load requests failed or got another status, e.g. {:?}\n{}",
        bad.len(),
        results.len(),
        &bad[..bad.len().min(5)],
        gw.logs()
    );
}

/// SIGHUP under load on the Redis store: six request loops run while the config is
/// reloaded five times (a rule added, then removed, and so on). No request fails or gets
/// another answer than 200 or 429, and no key passes more than its burst: the `api` rule
/// keeps its state in Redis through every reload, so a key whose requests all ran gets
/// exactly its burst, wherever the reloads fell among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_on_redis_drops_nothing_and_admits_no_more_than_the_burst() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    const BURST: usize = 5;
    const RELOADS: usize = 5;
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    // A roomy store timeout: a 503 here would be a store fault, not what the reload did.
    let base = upstream_and_store(&upstream.url(), &Store::redis_roomy(&redis));
    let api = api_rule(BURST as u64);
    let extra = "[[rules]]\nname = \"other\"\nmatch = { path_prefix = \"/other/\" }\n\
                 key = \"api_key\"\nrate = \"1/h\"\nburst = 1\n";
    let gw = Gateway::start(&format!("{base}{api}"));
    let client = HttpClient::new();
    let url = gw.url("/api/x");

    let t0 = Instant::now();
    let run = Duration::from_secs(5);
    let counter = Arc::new(AtomicUsize::new(0));
    let loops: Vec<_> = (0..6)
        .map(|_| {
            tokio::spawn(load_loop(
                client.clone(),
                url.clone(),
                "hup",
                counter.clone(),
                t0,
                run,
            ))
        })
        .collect();
    let mut hups = Vec::new();
    for n in 1..=RELOADS {
        tokio::time::sleep_until((t0 + Duration::from_millis(700 * n as u64)).into()).await;
        let body = if n % 2 == 1 {
            format!("{base}{api}{extra}")
        } else {
            format!("{base}{api}")
        };
        gw.rewrite_config(&body);
        hups.push(t0.elapsed());
        gw.reload(n);
    }
    let mut outcomes = Vec::new();
    for l in loops {
        outcomes.extend(l.await.expect("load loop"));
    }

    assert!(
        outcomes.len() >= 200,
        "the load ran: {} requests",
        outcomes.len()
    );
    let bad: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| !matches!(o.status, Ok(200 | 429)))
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} requests failed or got another answer than 200/429 across the reloads \
         at {hups:?}, e.g. {:?}\n{}",
        bad.len(),
        outcomes.len(),
        &bad[..bad.len().min(5)],
        gw.logs()
    );
    let mut by_key: BTreeMap<usize, Vec<&Outcome>> = BTreeMap::new();
    for o in &outcomes {
        by_key.entry(o.key).or_default().push(o);
    }
    let mut whole = 0;
    let mut spanning = 0;
    for (k, os) in &by_key {
        let passed = os.iter().filter(|o| o.status == Ok(200)).count();
        assert!(
            passed <= BURST,
            "key {k} got {passed} 200s with a burst of {BURST} (reloads at {hups:?})"
        );
        if os.len() == PER_KEY {
            assert_eq!(passed, BURST, "key {k}: all {PER_KEY} requests ran");
            whole += 1;
            let (first, last) = (
                os.iter().map(|o| o.start).min().expect("requests"),
                os.iter().map(|o| o.end()).max().expect("requests"),
            );
            if hups.iter().any(|h| (first..last).contains(h)) {
                spanning += 1;
            }
        }
    }
    assert!(
        whole >= 20 && spanning >= 1,
        "keys whose requests all ran: {whole}, of them across a reload: {spanning}"
    );
    // The state was Redis': a key of the load is there under CONTRACT.md's name.
    let exists: bool = redis::cmd("EXISTS")
        .arg(redis_key("hup-load-0", "api"))
        .query(&mut redis.conn())
        .expect("EXISTS");
    assert!(exists, "the load was decided by Redis");
    let logs = gw.logs();
    assert_eq!(logs.matches("config reloaded").count(), RELOADS, "{logs}");
    assert!(!logs.contains("config reload rejected"), "{logs}");
}

/// A SIGHUP sent as soon as the gateway says it listens is a reload like any other: the
/// process neither dies of it (SIGHUP's default action, until a handler is installed) nor
/// loses it. Twenty starts, each signalled the moment "ratewall listening" is in its log.
#[test]
fn a_sighup_right_after_listening_neither_kills_nor_is_lost() {
    let _watch = common::watchdog();
    const STARTS: usize = 20;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut outcomes = Vec::new();
    let mut n = 0;
    let mut taken = 0;
    while n < STARTS {
        let (port, admin) = (common::free_port(), common::free_port());
        let cfg = dir.path().join(format!("limits-{n}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n\
                 [upstream]\nurl = \"http://127.0.0.1:9\"\n[store]\nbackend = \"memory\"\n"
            ),
        )
        .expect("config");
        let log = dir.path().join(format!("ratewall-{n}.log"));
        let mut child = std::process::Command::new(common::binary())
            .arg("--config")
            .arg(&cfg)
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn ratewall");
        let logs = || std::fs::read_to_string(&log).unwrap_or_default();
        let end = Instant::now() + Duration::from_secs(20);
        while !logs().contains("ratewall listening") {
            if Instant::now() > end || matches!(child.try_wait(), Ok(Some(_))) {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        if !logs().contains("ratewall listening") {
            // A port free a moment ago, taken by another test since: pick others.
            if logs().contains("Address already in use") && taken < 5 {
                taken += 1;
                continue;
            }
            panic!("start {n}: ratewall did not start:\n{}", logs());
        }
        let hup = std::process::Command::new("kill")
            .args(["-HUP", &child.id().to_string()])
            .status()
            .expect("kill -HUP");
        assert!(hup.success());
        let end = Instant::now() + Duration::from_secs(5);
        let outcome = loop {
            if let Ok(Some(status)) = child.try_wait() {
                break Some(format!("start {n}: the process ended: {status}"));
            }
            if logs().contains("config reloaded") {
                break None;
            }
            if Instant::now() > end {
                break Some(format!("start {n}: still running, but the SIGHUP was lost"));
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let _ = child.kill();
        let _ = child.wait();
        outcomes.extend(outcome);
        n += 1;
    }
    assert!(
        outcomes.is_empty(),
        "{} of {STARTS} gateways signalled SIGHUP right after \"ratewall listening\" did not \
         reload: {outcomes:#?} (the SIGHUP handler must be registered before the gateway \
         says it listens)",
        outcomes.len()
    );
}

// ---------------------------------------------------------------------------------------
// 4. SIGTERM

/// A new connection to `port` is refused, or at least not served.
async fn new_connection_is_not_served(port: u16) -> Result<(), String> {
    let connect = tokio::net::TcpStream::connect(("127.0.0.1", port));
    let mut s = match tokio::time::timeout(Duration::from_secs(2), connect).await {
        Err(_) => return Err("connecting hung".into()),
        Ok(Err(_)) => return Ok(()),
        Ok(Ok(s)) => s,
    };
    let _ = s
        .write_all(b"GET /late HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await;
    let mut out = Vec::new();
    match tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut out)).await {
        Ok(_) if out.starts_with(b"HTTP/1.1 200") => Err(format!(
            "served after SIGTERM: {}",
            String::from_utf8_lossy(&out)
        )),
        Ok(_) => Ok(()),
        Err(_) => Err("the new connection was accepted and held open".into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_and_exits_zero() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    // A grace far longer than the drain (the requests take 1.5 s): the exit comes when they
    // are done, and the log says the grace did not run out (no clock bounds the exit).
    let mut gw =
        Gateway::try_start_with_grace(&upstream_and_store(&upstream.url(), &Store::Memory), "30s")
            .expect("ratewall did not start");
    let client = HttpClient::new();
    let in_flight: Vec<_> = (0..3)
        .map(|_| {
            let (c, url) = (client.clone(), gw.url("/slow/1500"));
            tokio::spawn(async move {
                let r = c.try_get(&url, &[], Duration::from_secs(10)).await;
                (r, Instant::now())
            })
        })
        .collect();
    // In flight: all three reached the upstream, and none has been answered (the upstream
    // records a request as it answers it).
    assert!(
        upstream.wait_arrived(3, Duration::from_secs(10)).await,
        "the three requests never reached the upstream\n{}",
        gw.logs()
    );
    assert_eq!(
        upstream.seen().len(),
        0,
        "a 1.5 s request was answered at once"
    );
    let term = Instant::now();
    gw.signal("TERM");
    // The listener is closed before this line is logged.
    let draining =
        tokio::task::block_in_place(|| gw.wait_for_log("draining", 1, Duration::from_secs(2)));
    assert!(draining, "SIGTERM not handled\n{}", gw.logs());
    let refused = new_connection_is_not_served(gw.port).await;
    assert_eq!(refused, Ok(()), "the port stops accepting on SIGTERM");

    for t in in_flight {
        let (r, answered) = t.await.expect("request task");
        let r = r.unwrap_or_else(|e| panic!("an in-flight request failed: {e}\n{}", gw.logs()));
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(&r.body[..], b"ok 0\n");
        assert!(
            answered > term,
            "answered {:?} before SIGTERM: it was not in flight",
            term - answered
        );
    }
    let status = tokio::task::block_in_place(|| gw.wait_exit(Duration::from_secs(40)));
    let status = status.unwrap_or_else(|| panic!("still running 40 s after SIGTERM"));
    assert!(status.success(), "exit status {status:?}\n{}", gw.logs());
    assert_eq!(upstream.seen().len(), 3);
    assert!(gw.logs().contains("draining"), "{}", gw.logs());
    assert!(!gw.logs().contains("grace ran out"), "{}", gw.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_grace_bounds_the_drain() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let mut gw = Gateway::try_start_with_grace(
        &upstream_and_store(&upstream.url(), &Store::Memory),
        "500ms",
    )
    .expect("ratewall did not start");
    let client = HttpClient::new();
    // A request of 30 s: an exit within WAIT (10 s) is the grace's, not the request's end.
    let url = gw.url("/slow/30000");
    let slow =
        tokio::spawn(async move { client.try_get(&url, &[], Duration::from_secs(40)).await });
    assert!(
        upstream.wait_arrived(1, Duration::from_secs(10)).await,
        "the slow request never reached the upstream"
    );
    gw.signal("TERM");
    let term = Instant::now();
    let status = tokio::task::block_in_place(|| gw.wait_exit(common::WAIT));
    let status = status.unwrap_or_else(|| {
        panic!(
            "still running {:?} after SIGTERM, with a 500 ms grace",
            term.elapsed()
        )
    });
    assert!(status.success(), "exit status {status:?}\n{}", gw.logs());
    let r = tokio::time::timeout(common::WAIT, slow)
        .await
        .expect("the cut request ends with the process, not later")
        .expect("request task");
    assert!(
        !matches!(&r, Ok(reply) if reply.status == StatusCode::OK),
        "the request outlived its grace: {r:?}"
    );
    assert!(gw.logs().contains("grace ran out"), "{}", gw.logs());
}

// ---------------------------------------------------------------------------------------
// 5. Upstream faults

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_faults_do_not_spill_over() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "[upstream]\nurl = \"{}\"\nconnect_timeout = \"1s\"\ntimeout = \"300ms\"\n{}",
        upstream.url(),
        Store::Memory.toml()
    ));
    let client = HttpClient::new();

    // A response cut mid-body: the client sees the failure, and the pool recovers.
    for round in 0..3 {
        // Not hung: answered or failed within WAIT ("no answer" otherwise).
        let r = client.try_get(&gw.url("/reset"), &[], common::WAIT).await;
        match &r {
            Err(e) => assert!(!e.starts_with("no answer"), "round {round}: {e}"),
            Ok(reply) => assert_eq!(
                reply.status,
                StatusCode::BAD_GATEWAY,
                "round {round}: a cut response reached the client as if whole: {} bytes",
                reply.body.len()
            ),
        }
        for i in 0..5 {
            let r = client
                .try_get(&gw.url("/fine"), &[], Duration::from_secs(5))
                .await
                .unwrap_or_else(|e| panic!("round {round}, request {i} after a cut: {e}"));
            assert_eq!(r.status, StatusCode::OK);
            assert_eq!(&r.body[..], b"ok 0\n");
        }
        let batch: Vec<_> = (0..8)
            .map(|_| {
                let (c, url) = (client.clone(), gw.url("/fine"));
                tokio::spawn(async move { c.try_get(&url, &[], Duration::from_secs(5)).await })
            })
            .collect();
        for t in batch {
            let r = t
                .await
                .expect("task")
                .expect("concurrent request after a cut");
            assert_eq!(r.status, StatusCode::OK);
        }
    }
    let resets = upstream
        .seen()
        .iter()
        .filter(|s| s.path == "/reset")
        .count();
    assert_eq!(resets, 3);

    // A slow upstream: 504 for it (the upstream's own answer, at 3 s, would be a 200), not
    // before its 300 ms timeout.
    let start = Instant::now();
    let r = client
        .try_get(&gw.url("/slow/3000"), &[], common::WAIT)
        .await
        .expect("the slow request is answered");
    let took = start.elapsed();
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.json()["status"], 504);
    assert!(
        took >= Duration::from_millis(300),
        "504 after {took:?} with a 300 ms timeout"
    );

    // ...and while a slow request waits, others go through: ten, one after the other, all
    // answered while one of 20 s is still in flight (queued behind it, the first would
    // wait for it). Counted, not timed.
    let patient = Gateway::start(&format!(
        "[upstream]\nurl = \"{}\"\nconnect_timeout = \"1s\"\ntimeout = \"60s\"\n{}",
        upstream.url(),
        Store::Memory.toml()
    ));
    let arrived = upstream.arrived();
    let slow = {
        let (c, url) = (client.clone(), patient.url("/slow/20000"));
        tokio::spawn(async move { c.try_get(&url, &[], Duration::from_secs(30)).await })
    };
    assert!(
        upstream.wait_arrived(arrived + 1, common::WAIT).await,
        "the slow request never reached the upstream"
    );
    for i in 0..10 {
        let r = client
            .try_get(&patient.url("/fast"), &[], common::WAIT)
            .await
            .unwrap_or_else(|e| panic!("fast request {i}: {e}"));
        assert_eq!(r.status, StatusCode::OK);
    }
    assert!(
        !slow.is_finished(),
        "the slow request ended before the ten beside it: {:?}",
        slow.await
    );
    slow.abort();

    // Nothing listening upstream: 502.
    let refusing = common::RefusingPort::new();
    let dead = refusing.url();
    let gw = Gateway::start(&upstream_and_store(&dead, &Store::Memory));
    let start = Instant::now();
    let r = client.get(&gw.url("/"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.json()["status"], 502);
    // Answered, not held: within WAIT, room for any load.
    assert!(
        start.elapsed() < common::WAIT,
        "502 after {:?}",
        start.elapsed()
    );
}

// ---------------------------------------------------------------------------------------
// 6. Request smuggling

/// A refusal that blames the request, not the upstream or the store.
fn is_refusal(status: u16) -> bool {
    (400..600).contains(&status) && !(502..=504).contains(&status)
}

/// One hostile request and what must come back.
struct Attempt {
    name: &'static str,
    request: Vec<u8>,
    ok: fn(u16) -> bool,
    want: &'static str,
    /// RFC 9112 §6.1 and §6.3: after refusing a request whose body length cannot be
    /// determined reliably the server must close the connection, or the rest of the
    /// bytes are read as a next request.
    must_close: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_smuggling_attempts_are_rejected() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream_and_store(&upstream.url(), &Store::Memory));

    // Each body ends the request one way (chunked) and carries a second request, named
    // after the case, that another reading of the framing would see.
    let smuggled =
        |case: &str| format!("0\r\n\r\nGET /smuggled-{case} HTTP/1.1\r\nHost: x\r\n\r\n");
    let framed = |case: &str, headers: &str, body: &str| {
        format!("POST /{case} HTTP/1.1\r\nHost: x\r\n{headers}\r\n{body}").into_bytes()
    };
    let te_attempt = |case: &'static str, name: &'static str, te: &str| Attempt {
        name,
        request: framed(case, te, &smuggled(case)),
        ok: is_refusal,
        want: "4xx/5xx, not 502-504",
        must_close: true,
    };
    let mut big = String::from("GET /big HTTP/1.1\r\nHost: x\r\n");
    for i in 0..200 {
        // 100 bytes a line, CRLF included.
        big.push_str(&format!("X-Filler-{i:03}: {}\r\n", "a".repeat(84)));
    }
    big.push_str("\r\n");
    let attempts = vec![
        Attempt {
            name: "Content-Length then Transfer-Encoding: chunked",
            request: framed(
                "cl-te",
                &format!(
                    "Content-Length: {}\r\nTransfer-Encoding: chunked\r\n",
                    smuggled("cl-te").len()
                ),
                &smuggled("cl-te"),
            ),
            // hyper's documented fallback (RFC 9112 §6.3, docs/operations.md): drop the
            // Content-Length, read the body as chunked, close the connection after.
            ok: |s| s == 400 || s == 200,
            want: "400, or forwarded as chunked with the connection closed",
            must_close: true,
        },
        Attempt {
            name: "Transfer-Encoding: chunked then Content-Length",
            request: framed(
                "te-cl",
                "Transfer-Encoding: chunked\r\nContent-Length: 3\r\n",
                &smuggled("te-cl"),
            ),
            ok: |s| s == 400 || s == 200,
            want: "400, or forwarded as chunked with the connection closed",
            must_close: true,
        },
        Attempt {
            name: "two different Content-Lengths",
            request: framed(
                "cl-cl",
                &format!(
                    "Content-Length: 5\r\nContent-Length: {}\r\n",
                    5 + smuggled("cl-cl").len()
                ),
                &format!("hello{}", smuggled("cl-cl")),
            ),
            ok: |s| s == 400,
            want: "400",
            must_close: true,
        },
        te_attempt(
            "te-gzip",
            "Transfer-Encoding: gzip, chunked",
            "Transfer-Encoding: gzip, chunked\r\n",
        ),
        te_attempt(
            "te-x",
            "Transfer-Encoding: xchunked",
            "Transfer-Encoding: xchunked\r\n",
        ),
        te_attempt(
            "te-identity",
            "Transfer-Encoding: chunked, identity",
            "Transfer-Encoding: chunked, identity\r\n",
        ),
        te_attempt(
            "te-twice",
            "Transfer-Encoding: chunked on two lines",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
        ),
        te_attempt(
            "te-lines",
            "Transfer-Encoding: chunked, then identity on a second line",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        ),
        Attempt {
            name: "two Host headers",
            request: format!(
                "POST /two-hosts HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\
                 Content-Length: {}\r\n\r\n{}",
                smuggled("two-hosts").len() - 5,
                &smuggled("two-hosts")[5..]
            )
            .into_bytes(),
            ok: |s| s == 400,
            want: "400",
            must_close: false,
        },
        Attempt {
            name: "200 header lines of 100 bytes",
            request: big.into_bytes(),
            ok: |s| s == 431,
            want: "431",
            must_close: false,
        },
    ];
    let mut wrong = Vec::new();
    for a in &attempts {
        match try_raw_exchange(gw.port, &a.request).await {
            Ok(r) if !(a.ok)(r.status) => {
                wrong.push(format!("{}: {}, want {}", a.name, r.status, a.want))
            }
            Ok(r) if a.must_close && !r.closed => wrong.push(format!(
                "{}: {} but the connection stayed open; read: {:?}",
                a.name, r.status, r.text
            )),
            Ok(_) => {}
            Err(e) => wrong.push(format!("{}: {e}, want {}", a.name, a.want)),
        }
    }
    // Anything forwarded (or smuggled on a pooled upstream connection) would show up here
    // (real time on purpose: a window for what should never come).
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Only the two Content-Length + Transfer-Encoding requests may have been forwarded
    // (the fallback), each with its chunked body (empty) and no Content-Length; nothing
    // smuggled behind any request ever arrives.
    let forwarded = upstream.seen();
    let seen: Vec<String> = forwarded.iter().map(|s| s.path.clone()).collect();
    assert!(
        wrong.is_empty() && seen.iter().all(|p| p == "/cl-te" || p == "/te-cl"),
        "wrong answers: {wrong:#?}\nthe upstream saw: {seen:?}"
    );
    for f in &forwarded {
        assert!(
            f.headers.get("content-length").is_none(),
            "{} kept its Content-Length",
            f.path
        );
        assert_eq!(
            f.body_len, 0,
            "{}: only the chunked body (empty) is forwarded",
            f.path
        );
    }
    let before_ok = forwarded.len();

    // A well-framed request on the same gateway does reach the upstream.
    let ok = try_raw_exchange(
        gw.port,
        b"POST /ok HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    )
    .await
    .expect("a well-framed request is answered");
    assert_eq!(ok.status, 200, "{}", ok.text);
    let seen = upstream.seen();
    assert_eq!(seen.len(), before_ok + 1);
    assert_eq!(seen[before_ok].path, "/ok");
    assert_eq!(seen[before_ok].body_len, 3);
}

// ---------------------------------------------------------------------------------------
// 7. Data errors

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_type_redis_key_is_answered_by_on_error_and_logged_with_its_key() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    const FAILURES: usize = 3;
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}breaker_failures = {FAILURES}\n{}",
        upstream_and_store(&upstream.url(), &Store::redis(&redis)),
        api_rule(100)
    ));
    let client = HttpClient::new();
    let url = gw.url("/api/x");
    assert_eq!(
        client.get(&url, &[("x-api-key", "victim")]).await.status,
        StatusCode::OK
    );

    let mut conn = redis.conn();
    let mut keys: Vec<String> = redis::cmd("SCAN")
        .arg(0)
        .arg("MATCH")
        .arg("rwtest:*")
        .arg("COUNT")
        .arg(1000)
        .query::<(u64, Vec<String>)>(&mut conn)
        .expect("SCAN")
        .1;
    // Beside the deployment's identity tag secret, one key.
    keys.retain(|k| k != "rwtest:tag-secret");
    keys.sort();
    assert_eq!(keys.len(), 1, "one key for one API key: {keys:?}");
    let key = keys.remove(0);
    assert_eq!(key, redis_key("victim", "api"));
    assert!(!key.contains("victim"));
    redis::cmd("DEL")
        .arg(&key)
        .query::<()>(&mut conn)
        .expect("DEL");
    redis::cmd("HSET")
        .arg(&key)
        .arg("planted")
        .arg("by the test")
        .query::<()>(&mut conn)
        .expect("HSET");

    // More data errors than breaker_failures, interleaved with other keys.
    for i in 0..2 * FAILURES + 2 {
        let r = client.get(&url, &[("x-api-key", "victim")]).await;
        assert_eq!(
            r.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "victim request {i}\n{}",
            gw.logs()
        );
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
    }
    for i in 0..2 * FAILURES + 2 {
        let other = format!("bystander-{i}");
        let r = client.get(&url, &[("x-api-key", &other)]).await;
        assert_eq!(r.status, StatusCode::OK, "{other}\n{}", gw.logs());
        assert_eq!(
            try_remaining(&r, "api"),
            Some(99),
            "{other} was decided by Redis"
        );
        let r = client.get(&url, &[("x-api-key", "victim")]).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    let ready = client.get(&gw.admin_url("/readyz"), &[]).await;
    assert_eq!(
        ready.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&ready.body)
    );
    let kind: String = redis::cmd("TYPE").arg(&key).query(&mut conn).expect("TYPE");
    assert_eq!(kind, "hash", "the gateway left the foreign key alone");

    let logs = gw.logs();
    assert!(logs.contains(&key), "the log names the Redis key:\n{logs}");
    assert!(
        !logs.contains("victim"),
        "the log holds the raw API key:\n{logs}"
    );
    assert!(
        !logs.contains("circuit breaker open") && !logs.contains("store failing"),
        "a data error is not an outage:\n{logs}"
    );
}
