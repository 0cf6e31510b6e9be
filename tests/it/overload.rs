//! A pool's overload protection end to end (`overload = { … }`, issue 28): the real
//! binary in front of a backend with a knee ([`Knee`]: 16 places, each request held
//! 100 ms ±50%; past 16 in flight its latency grows with its concurrency), real HTTP
//! clients in closed loops, the figures printed (`-- --nocapture`).
//!
//! - A burst of 10x the knee's in-flight capacity (160 loops), mostly free (priority 0)
//!   with a steady pro share (priority 10, 8 loops) below the knee: free requests are
//!   delayed then shed (503, `Retry-After`), pro is never shed, the backend's concurrency
//!   stays near its knee (adaptive limit), and pro's p99 stays within 2x its p99 without
//!   the burst.
//! - The mix, half pro and half free at 10x: pro is served first and shed only when
//!   the queue is full of pro; free is delayed then shed (pro's p99 ratio printed).
//! - No overload (8 in flight of the knee's 16): the adaptive limit sheds nothing, of
//!   `RATEWALL_OVERLOAD_N` requests (default 20,000; the figure is 100,000).
//! - A fixed `max_concurrency = 16`: the backend never holds more than 16; a request that
//!   waited `max_wait` is shed with 503 and `Retry-After`; a shed gRPC call gets
//!   `grpc-status: 14`.

use std::time::{Duration, Instant};

use http::StatusCode;

use crate::common::knee::Knee;
use crate::common::{self, serial, Gateway, HttpClient, Scrape};

/// What a shed request's `Retry-After` says.
const RETRY_AFTER: Duration = Duration::from_secs(1);

const PRO: &str = "sk_live_overload_pro_0001";
const FREE: &str = "sk_live_overload_free_0002";

/// A gateway in front of `backend` with `overload` on its pool, a rule that never denies
/// (the rate limits are not what is tested), and `PRO`'s plan at priority 10.
fn gateway(backend: &str, overload: &str) -> Gateway {
    Gateway::start(&format!(
        "[upstream]\nurl = \"{backend}\"\nconnect_timeout = \"1s\"\ntimeout = \"10s\"\n\
         overload = {overload}\n\
         [store]\nbackend = \"memory\"\n\
         [keys.plans]\n\"{PRO}\" = \"pro\"\n\
         [[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"100000/s\"\nburst = 100000\n\
         [rules.plans.pro]\npriority = 10\n"
    ))
}

/// One request as its client saw it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// When it was sent, since the phase began.
    at: Duration,
    /// 0: no answer (a connection error, or none within 30 s).
    status: u16,
    took: Duration,
    retry_after: bool,
    /// A 503's reason, from its problem+json `detail`.
    shed: Option<Shed>,
}

/// Why a request was shed, as its 503 says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shed {
    /// The queue was full of requests of its priority or higher.
    Full,
    /// A request of higher priority took its place in the queue.
    Evicted,
    /// It waited max_wait.
    Waited,
}

fn shed_reason(detail: &str) -> Option<Shed> {
    if detail.ends_with("the queue is full") {
        Some(Shed::Full)
    } else if detail.contains("took this one's place") {
        Some(Shed::Evicted)
    } else if detail.ends_with("waited max_wait") {
        Some(Shed::Waited)
    } else {
        None
    }
}

/// `loops` clients with API key `key`, each sending GET `url` again as soon as its last
/// answer is in (after a 503, once its `Retry-After` has passed, as a client that
/// honours it does), until `run` has passed: every request they sent.
async fn closed_loops(
    client: &HttpClient,
    url: &str,
    key: &'static str,
    loops: usize,
    run: Duration,
) -> Vec<Seen> {
    let start = Instant::now();
    let tasks: Vec<_> = (0..loops)
        .map(|_| {
            let (client, url) = (client.clone(), url.to_string());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while start.elapsed() < run {
                    let at = start.elapsed();
                    let sent = Instant::now();
                    let r = client
                        .try_get(&url, &[("x-api-key", key)], Duration::from_secs(30))
                        .await;
                    let took = sent.elapsed();
                    let shed = r
                        .as_ref()
                        .is_ok_and(|r| r.status == StatusCode::SERVICE_UNAVAILABLE);
                    seen.push(match r {
                        Ok(r) => Seen {
                            at,
                            status: r.status.as_u16(),
                            took,
                            retry_after: r.header("retry-after") == Some("1"),
                            shed: shed
                                .then(|| {
                                    serde_json::from_slice::<serde_json::Value>(&r.body)
                                        .ok()
                                        .and_then(|v| v["detail"].as_str().and_then(shed_reason))
                                })
                                .flatten(),
                        },
                        Err(_) => Seen {
                            at,
                            status: 0,
                            took,
                            retry_after: false,
                            shed: None,
                        },
                    });
                    if shed && start.elapsed() + RETRY_AFTER < run {
                        tokio::time::sleep(RETRY_AFTER).await;
                    }
                }
                seen
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("a client loop"));
    }
    all
}

/// The `q` quantile (nearest rank) of what `seen` took, in ms.
fn quantile_ms(seen: &[&Seen], q: f64) -> f64 {
    let mut v: Vec<f64> = seen.iter().map(|s| s.took.as_secs_f64() * 1e3).collect();
    assert!(!v.is_empty(), "no requests to take a quantile of");
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn with_status(seen: &[Seen], status: u16) -> Vec<&Seen> {
    seen.iter().filter(|s| s.status == status).collect()
}

fn shed_total(m: &Scrape, priority: &str) -> f64 {
    m.get(
        "ratewall_overload_shed_total",
        &[("upstream", "default"), ("priority", priority)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_ten_times_the_knee_keeps_pro_within_2x_its_unloaded_p99_never_sheds_it_delays_then_sheds_free_and_holds_the_backend_near_its_knee(
) {
    let _watch = common::watchdog();
    burst().await;
}

/// The burst scenario.
async fn burst() {
    let _serial = serial().await;
    // 16 places of 100 ms (160/s): long enough that the scheduling noise of a loaded
    // machine (a debug build, other processes; tens of ms at a p99) is small beside the
    // backend's own time.
    let knee = Knee::start(16, Duration::from_millis(100));
    let gw = gateway(&knee.url(), "{ adaptive = true, max_wait = \"500ms\" }");
    let client = HttpClient::new();
    let url = gw.url("/api/work");
    const PRO_LOOPS: usize = 8;
    // Two requests at a time first: the controller's floor (its latency unloaded) is the
    // mean of requests sent at low concurrency (at most min_limit, 4, in flight), once
    // ten are in: some 40 here.
    closed_loops(&client, &url, PRO, 2, Duration::from_secs(2)).await;
    // Unloaded: pro's loops with a few free ones, 12 in flight of the knee's 16. The first
    // half second (connections opened) is left out: the baseline is the steady one.
    let (pro, free) = tokio::join!(
        closed_loops(&client, &url, PRO, PRO_LOOPS, Duration::from_secs(4)),
        closed_loops(&client, &url, FREE, 4, Duration::from_secs(4)),
    );
    let steady = |s: &&Seen| s.at >= Duration::from_millis(500);
    let calm_pro: Vec<&Seen> = pro.iter().filter(steady).collect();
    let calm_free: Vec<&Seen> = free.iter().filter(steady).collect();
    assert!(
        pro.iter().chain(&free).all(|s| s.status == 200),
        "without the burst every request is served: {:?}",
        common::tally(
            pro.iter()
                .chain(&free)
                .filter_map(|s| StatusCode::from_u16(s.status).ok())
        )
    );
    let (calm_pro_p50, calm_pro_p99) = (quantile_ms(&calm_pro, 0.5), quantile_ms(&calm_pro, 0.99));
    let calm_free_p99 = quantile_ms(&calm_free, 0.99);
    println!(
        "unloaded: pro {} requests p50 {calm_pro_p50:.1} ms p99 {calm_pro_p99:.1} ms; free {} requests p50 {:.1} ms p99 {calm_free_p99:.1} ms; backend max in flight {}",
        calm_pro.len(),
        calm_free.len(),
        quantile_ms(&calm_free, 0.5),
        knee.max_in_flight()
    );

    // The burst: 160 loops, 10x the knee's 16 in flight; pro's share unchanged.
    knee.reset_max();
    let served_before = knee.served();
    let burst = Duration::from_secs(6);
    let (pro, free) = tokio::join!(
        closed_loops(&client, &url, PRO, PRO_LOOPS, burst),
        closed_loops(&client, &url, FREE, 160 - PRO_LOOPS, burst),
    );
    let backend_max = knee.max_in_flight();
    let served = knee.served() - served_before;
    let m = Scrape::take(&client, &gw).await;
    let limit = m.get("ratewall_overload_limit", &[("upstream", "default")]);
    let mean_wait_ms = |p: &str| {
        let labels = [("upstream", "default"), ("priority", p)];
        1e3 * m.sum("ratewall_overload_wait_seconds_sum", &labels)
            / m.sum("ratewall_overload_wait_seconds_count", &labels)
                .max(1.0)
    };
    println!(
        "mean wait for a permit: pro {:.1} ms, free {:.1} ms",
        mean_wait_ms("10"),
        mean_wait_ms("0")
    );

    let (pro_ok, pro_shed) = (with_status(&pro, 200), with_status(&pro, 503));
    let (free_ok, free_shed) = (with_status(&free, 200), with_status(&free, 503));
    let pro_p50 = quantile_ms(&pro_ok, 0.5);
    let pro_p99 = quantile_ms(&pro_ok, 0.99);
    let slow_free = free_ok
        .iter()
        .filter(|s| s.took.as_secs_f64() * 1e3 > 2.0 * calm_free_p99)
        .count();
    println!(
        "burst of {} requests in {burst:?} ({:.0}/s offered to a backend of {:.0}/s; it served {served}): \
         pro {} served p50 {pro_p50:.1} ms p99 {pro_p99:.1} ms, {} shed; \
         free {} served p50 {:.1} ms p99 {:.1} ms ({slow_free} above 2x the unloaded p99), {} shed (p50 {:.1} ms); \
         shed_total priority 10: {}, priority 0: {}; backend max in flight {backend_max}; limit at the end {limit}",
        pro.len() + free.len(),
        (pro.len() + free.len()) as f64 / burst.as_secs_f64(),
        knee.throughput(),
        pro_ok.len(),
        pro_shed.len(),
        free_ok.len(),
        quantile_ms(&free_ok, 0.5),
        quantile_ms(&free_ok, 0.99),
        free_shed.len(),
        if free_shed.is_empty() { 0.0 } else { quantile_ms(&free_shed, 0.5) },
        shed_total(&m, "10"),
        shed_total(&m, "0"),
    );

    let failed: Vec<&Seen> = pro
        .iter()
        .chain(&free)
        .filter(|s| ![200, 503].contains(&s.status))
        .collect();
    assert!(
        failed.is_empty(),
        "answers other than 200 and 503: {failed:?}"
    );
    assert!(
        pro_shed.is_empty(),
        "no pro request is shed while free ones wait: {} of {} pro requests were",
        pro_shed.len(),
        pro.len()
    );
    assert_eq!(shed_total(&m, "10"), 0.0, "shed_total at priority 10");
    println!(
        "pro p99 under the burst / unloaded: {:.2}x",
        pro_p99 / calm_pro_p99
    );
    assert!(
        pro_p99 <= 2.0 * calm_pro_p99,
        "pro's p99 under the burst, {pro_p99:.1} ms, is above 2x its p99 without it ({calm_pro_p99:.1} ms)"
    );
    assert!(
        slow_free > 0,
        "free requests are delayed: none served took more than 2x the unloaded p99 ({calm_free_p99:.1} ms)"
    );
    assert!(
        !free_shed.is_empty(),
        "free requests are shed under the burst"
    );
    assert_eq!(
        shed_total(&m, "0"),
        free_shed.len() as f64,
        "shed_total at priority 0 counts every free 503"
    );
    assert!(
        free_shed.iter().all(|s| s.retry_after),
        "every shed request has Retry-After: 1"
    );
    // A queue of 1000 never fills with 152 free loops: each shed free request waited
    // max_wait (500 ms) first.
    let early = free_shed
        .iter()
        .filter(|s| s.took < Duration::from_millis(500))
        .count();
    assert_eq!(
        early, 0,
        "free requests shed before they waited max_wait (delayed, then shed)"
    );
    assert!(
        backend_max <= 32,
        "the backend's max in flight, {backend_max}, is above 2x its knee (16): the adaptive limit let too many through"
    );
}

/// How many requests the no-overload test sends: `RATEWALL_OVERLOAD_N`, or 20,000.
fn no_overload_n() -> usize {
    std::env::var("RATEWALL_OVERLOAD_N")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_half_the_knee_the_adaptive_limit_sheds_nothing() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    // A quick knee (16 places of 2 ms) and 8 loops: half its concurrency, never past it.
    let knee = Knee::start(16, Duration::from_millis(2));
    let gw = gateway(&knee.url(), "{ adaptive = true }");
    let client = HttpClient::new();
    let url = gw.url("/api/work");
    let n = no_overload_n();
    const LOOPS: usize = 8;
    let start = Instant::now();
    let tasks: Vec<_> = (0..LOOPS)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            let key = if i % 2 == 0 { PRO } else { FREE };
            let mine = n / LOOPS + usize::from(i < n % LOOPS);
            tokio::spawn(async move {
                let mut statuses = Vec::with_capacity(mine);
                for _ in 0..mine {
                    let r = client
                        .try_get(&url, &[("x-api-key", key)], Duration::from_secs(30))
                        .await;
                    statuses.push(r.map_or(0, |r| r.status.as_u16()));
                }
                statuses
            })
        })
        .collect();
    let mut statuses = Vec::with_capacity(n);
    for t in tasks {
        statuses.extend(t.await.expect("a client loop"));
    }
    let took = start.elapsed();
    let m = Scrape::take(&client, &gw).await;
    let shed = shed_total(&m, "0") + shed_total(&m, "10");
    let permits = m.sum(
        "ratewall_overload_wait_seconds_count",
        &[("upstream", "default")],
    );
    let not_ok = statuses.iter().filter(|s| **s != 200).count();
    println!(
        "no overload: {n} requests in {took:.1?} ({:.0}/s), {LOOPS} in flight of the knee's 16; \
         {not_ok} not 200, {shed} shed, {permits} permits; \
         limit at the end {}; backend max in flight {}",
        n as f64 / took.as_secs_f64(),
        m.get("ratewall_overload_limit", &[("upstream", "default")]),
        knee.max_in_flight()
    );
    // Every request went through the adaptive limit: its permits are the requests.
    assert_eq!(
        permits, n as f64,
        "every request took a permit of the adaptive limit"
    );
    assert_eq!(
        shed, 0.0,
        "the adaptive limit shed requests without overload"
    );
    assert_eq!(
        not_ok,
        0,
        "requests not answered 200: {:?}",
        common::tally(
            statuses
                .iter()
                .filter_map(|s| StatusCode::from_u16(*s).ok())
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_limit_of_16_never_lets_more_reach_the_backend_and_sheds_who_waited_max_wait() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let knee = Knee::start(16, Duration::from_millis(20));
    // Free requests alone, and no share kept for pro: all 16 places are theirs.
    let gw = gateway(
        &knee.url(),
        "{ max_concurrency = 16, max_wait = \"50ms\", reserve_for_higher = \"0%\" }",
    );
    let client = HttpClient::new();
    let url = gw.url("/api/work");
    // 64 loops: 48 waiting at any time, about 60 ms of queue at 800/s: some wait 50 ms.
    let seen = closed_loops(&client, &url, FREE, 64, Duration::from_secs(4)).await;
    let m = Scrape::take(&client, &gw).await;
    let (ok, shed) = (with_status(&seen, 200), with_status(&seen, 503));
    println!(
        "fixed 16: {} requests, {} served (p50 {:.1} ms p99 {:.1} ms), {} shed (min {:.1} ms); backend max in flight {}",
        seen.len(),
        ok.len(),
        quantile_ms(&ok, 0.5),
        quantile_ms(&ok, 0.99),
        shed.len(),
        if shed.is_empty() { 0.0 } else { quantile_ms(&shed, 0.0) },
        knee.max_in_flight()
    );
    assert_eq!(ok.len() + shed.len(), seen.len(), "only 200s and 503s");
    assert_eq!(
        knee.max_in_flight(),
        16,
        "max_concurrency = 16: the backend held at most 16 at once (and 64 loops filled them)"
    );
    assert!(!shed.is_empty(), "requests queued past max_wait are shed");
    assert!(
        shed.iter().all(|s| s.retry_after),
        "a shed request has Retry-After: 1"
    );
    assert!(
        shed.iter().all(|s| s.took >= Duration::from_millis(50)),
        "a shed request waited max_wait (50 ms) first"
    );
    assert_eq!(shed_total(&m, "0"), shed.len() as f64);
    assert_eq!(
        m.get("ratewall_overload_limit", &[("upstream", "default")]),
        16.0
    );
    assert_eq!(
        m.get(
            "ratewall_request_duration_seconds_count",
            &[("outcome", "overloaded")]
        ),
        shed.len() as f64,
        "a shed request's outcome is overloaded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_shed_at_once_is_a_503_with_retry_after_and_a_grpc_call_unavailable() {
    let _watch = common::watchdog();
    let upstream = common::Upstream::start().await;
    // One place, no queue: while one request holds the place, the next is shed at once.
    let gw = gateway(&upstream.url(), "{ max_concurrency = 1, max_queue = 0 }");
    let holding = {
        let url = gw.url("/slow/1500");
        tokio::spawn(async move {
            HttpClient::new()
                .get(&url, &[("x-api-key", PRO)])
                .await
                .status
        })
    };
    assert!(
        upstream.wait_arrived(1, Duration::from_secs(10)).await,
        "the first request reached the backend"
    );
    let r = HttpClient::new()
        .get(&gw.url("/api/x"), &[("x-api-key", PRO)])
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(
        String::from_utf8_lossy(&r.body).contains("queue is full"),
        "{:?}",
        r.body
    );
    let grpc = HttpClient::h2()
        .send(
            "POST",
            &gw.url("/pkg.Service/M"),
            &[
                ("content-type", "application/grpc+proto"),
                ("x-api-key", PRO),
            ],
            bytes::Bytes::from_static(b"\x00\x00\x00\x00\x00"),
        )
        .await;
    assert_eq!(grpc.status, StatusCode::OK, "a gRPC answer is an HTTP 200");
    assert_eq!(grpc.header("grpc-status"), Some("14"), "{:?}", grpc.headers);
    assert_eq!(holding.await.expect("the held request"), StatusCode::OK);
    assert_eq!(
        upstream.arrived(),
        1,
        "the shed requests never reached the backend"
    );
    let m = Scrape::take(&HttpClient::new(), &gw).await;
    assert_eq!(shed_total(&m, "10"), 2.0);
    assert_eq!(
        m.get(
            "ratewall_request_duration_seconds_count",
            &[("outcome", "overloaded")]
        ),
        2.0,
        "both shed requests, HTTP and gRPC, end as overloaded"
    );
    let status = HttpClient::new()
        .get(&gw.admin_url("/status.json"), &[])
        .await
        .json();
    assert_eq!(status["totals"]["overloaded"], 2, "{status}");
    assert_eq!(status["totals"]["store_unavailable"], 0, "{status}");
}

/// The mix: a burst of 10x the knee's in-flight capacity, half pro and half free
/// (80 loops each). Pro alone is then five times what the backend serves, so pro is shed
/// too; what priority promises is the order: a pro request is never shed while a free one
/// is queued (a pro arriving at a full queue takes a free one's place; a pro 503 is only
/// ever "the queue is full", full of pro), pro is served first, and free requests are
/// delayed then shed. Pro's p99 against its unloaded one is printed, not asserted: here,
/// with pro itself past capacity, it measured 1.85x to 1.98x (the adaptive limit's
/// overshoot past the knee, about 8 waiting inside the backend, plus the queue), too close
/// to 2x for a test on a loaded machine; the 2x bound is asserted where pro fits in the
/// capacity (the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_pro_half_free_at_ten_times_the_knee_pro_is_served_first_shed_only_when_the_queue_is_full_of_pro_and_free_is_delayed_then_shed(
) {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let knee = Knee::start(16, Duration::from_millis(100));
    let gw = gateway(
        &knee.url(),
        "{ adaptive = true, max_queue = 4, max_wait = \"500ms\" }",
    );
    let client = HttpClient::new();
    let url = gw.url("/api/work");
    closed_loops(&client, &url, PRO, 2, Duration::from_secs(2)).await;
    let (pro, free) = tokio::join!(
        closed_loops(&client, &url, PRO, 6, Duration::from_secs(4)),
        closed_loops(&client, &url, FREE, 6, Duration::from_secs(4)),
    );
    assert!(
        pro.iter().chain(&free).all(|s| s.status == 200),
        "without the burst every request is served"
    );
    let steady = |s: &&Seen| s.at >= Duration::from_millis(500);
    let calm_pro: Vec<&Seen> = pro.iter().filter(steady).collect();
    let calm_pro_p99 = quantile_ms(&calm_pro, 0.99);

    knee.reset_max();
    let burst = Duration::from_secs(6);
    let (pro, free) = tokio::join!(
        closed_loops(&client, &url, PRO, 80, burst),
        closed_loops(&client, &url, FREE, 80, burst),
    );
    let backend_max = knee.max_in_flight();
    let m = Scrape::take(&client, &gw).await;
    let (pro_ok, pro_shed) = (with_status(&pro, 200), with_status(&pro, 503));
    let (free_ok, free_shed) = (with_status(&free, 200), with_status(&free, 503));
    let pro_p99 = quantile_ms(&pro_ok, 0.99);
    let reasons = |shed: &[&Seen]| {
        let n = |r: Shed| shed.iter().filter(|s| s.shed == Some(r)).count();
        (n(Shed::Full), n(Shed::Evicted), n(Shed::Waited))
    };
    println!(
        "half and half: unloaded pro p99 {calm_pro_p99:.1} ms; burst: pro {} served p99 {pro_p99:.1} ms ({:.2}x), \
         {} shed (full, evicted, waited: {:?}); free {} served, {} shed ({:?}); backend max in flight {backend_max}",
        pro_ok.len(),
        pro_p99 / calm_pro_p99,
        pro_shed.len(),
        reasons(&pro_shed),
        free_ok.len(),
        free_shed.len(),
        reasons(&free_shed),
    );
    assert!(
        pro.iter()
            .chain(&free)
            .all(|s| [200, 503].contains(&s.status)),
        "answers other than 200 and 503"
    );
    assert!(
        pro_shed
            .iter()
            .chain(&free_shed)
            .all(|s| s.retry_after && s.shed.is_some()),
        "every shed request has Retry-After: 1 and says why"
    );
    assert!(
        pro_shed.iter().all(|s| s.shed == Some(Shed::Full)),
        "a pro request is shed only when the queue is full of pro, never while a free one is queued: {:?}",
        reasons(&pro_shed)
    );
    assert!(
        pro_ok.len() > 3 * free_ok.len().max(1),
        "pro is served first: {} pro against {} free",
        pro_ok.len(),
        free_ok.len()
    );
    let delayed = free_shed
        .iter()
        .filter(|s| s.shed != Some(Shed::Full) && s.took >= Duration::from_millis(5))
        .count();
    assert!(
        delayed > 0,
        "free requests are delayed (queued), then shed when pro takes their place or max_wait passes: {:?}",
        reasons(&free_shed)
    );
    assert!(
        backend_max <= 32,
        "the backend's concurrency stays near its knee of 16 (at most 2x): {backend_max}"
    );
    assert_eq!(
        shed_total(&m, "10") + shed_total(&m, "0"),
        (pro_shed.len() + free_shed.len()) as f64,
        "shed_total counts every 503"
    );
}

/// Issue 42, item 2: free requests that take 5 s at the backend fill what they may of
/// `max_concurrency = 4` (3 places, 25% kept for priority 10); every pro request sent
/// meanwhile is served at once, none shed (before: 6 of 10 shed after `max_wait`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_free_requests_never_take_the_place_kept_for_pro() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let backend = crate::common::backend::Backend::start().await;
    let gw = gateway(
        &backend.url(),
        "{ max_concurrency = 4, max_queue = 20, max_wait = \"1s\" }",
    );
    let client = HttpClient::new();
    let slow = gw.url("/slow/5000");
    let free: Vec<_> = (0..8)
        .map(|_| {
            let (client, url) = (client.clone(), slow.clone());
            tokio::spawn(async move {
                client
                    .try_get(&url, &[("x-api-key", FREE)], Duration::from_secs(30))
                    .await
                    .map(|r| r.status.as_u16())
                    .unwrap_or(0)
            })
        })
        .collect();
    // The free requests hold their 3 places (the others wait, then are shed).
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend.in_flight() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        backend.in_flight(),
        3,
        "the free requests hold 3 of 4 places"
    );
    let mut pro = Vec::new();
    for _ in 0..10 {
        let r = client
            .try_get(
                &gw.url("/pro"),
                &[("x-api-key", PRO)],
                Duration::from_secs(30),
            )
            .await
            .map(|r| r.status.as_u16())
            .unwrap_or(0);
        pro.push(r);
    }
    assert_eq!(
        backend.in_flight(),
        3,
        "no fourth free request got in meanwhile"
    );
    assert_eq!(
        pro, [200; 10],
        "every pro request found the place kept for it"
    );
    let mut statuses = Vec::new();
    for f in free {
        statuses.push(f.await.expect("a free request"));
    }
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        [200, 200, 200, 503, 503, 503, 503, 503],
        "3 free requests were served; those that waited past max_wait were shed"
    );
}
