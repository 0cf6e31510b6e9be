//! What a failover costs in exactness (issue 28, item 2), measured: three real gateways on
//! a real store with replicas, a Rust load driver sending about 2,000 requests a second
//! spread over 100 API keys and the three gateways, each key's limit a burst of 100 that
//! does not refill during the run; the primary SIGKILLed while keys are still admitting;
//! the load kept up until the promoted replica serves and every key is spent again. Per
//! key, the admissions (200s) beyond its limit are the excess. `on_error = "deny"`: an
//! answer during the outage is a 503, never an admission.
//!
//! With `replication = "async"` a promoted replica lacks the writes it had not yet got
//! when the primary died, and the admissions they recorded are granted again: the excess
//! is bounded (generously: a loaded machine), and printed. With `replication = { wait = 1 }`
//! an admission is answered only once a replica has it: the excess is 0.
//!
//! The scenario takes the store set-up ([`Primary`]): Redis Sentinel (one primary, two
//! replicas, so that the promoted one still has one to confirm writes), or a Redis
//! Cluster (three masters with two replicas each, the master of most keys killed). After
//! the run a fresh key on the promoted primary must get exactly its burst through the
//! gateways within [`RECOVERY`]: under this load redis-rs' cluster connection could wedge
//! for good on the failover (`src/limiter/redis/cluster.rs`; docs/scaling.md, "What a
//! failover costs").
//!
//! `cargo test --test it failover:: -- --nocapture` prints the figures.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    redis_key, serial, Gateway, HttpClient, RedisCluster, RedisSentinel, RedisServer, Scrape,
    Upstream,
};
use http::StatusCode;

const KEYS: usize = 100;
const BURST: u64 = 100;
/// The rule's rate: slow enough that nothing refills during a run.
const PER_HOUR: u64 = 1;
/// Requests sent every tick, and the tick: 2,000 a second in all.
const PER_TICK: usize = 20;
const TICK: Duration = Duration::from_millis(10);
/// Requests in flight at most: past it a tick sends fewer (a machine that cannot keep up
/// is slowed, not flooded).
const MAX_IN_FLIGHT: usize = 1000;
/// When the primary dies: about a third of each key's burst is spent by then.
const KILL_AFTER: Duration = Duration::from_millis(1500);
/// How long one scenario may take, failover included.
const DEADLINE: Duration = Duration::from_secs(45);
/// After the promotion, each key must have been denied this many times (it is spent).
const SPENT: u32 = 3;

/// A store whose primary the scenario kills.
pub(crate) trait Primary {
    /// The `[store]` table for the gateways (with `on_error` and `timeout`).
    fn store_toml(&self, on_error: &str, timeout: &str) -> String;
    /// Whether the Redis key `key` lives on the primary [`Primary::kill_primary`] kills.
    fn on_victim(&self, key: &str) -> bool;
    /// SIGKILL the primary.
    fn kill_primary(&mut self);
    /// Who is what now, for a failure's message.
    fn describe(&self) -> String;
}

/// One primary with two replicas under three sentinels (`backend = "redis_sentinel"`):
/// every key lives on the primary, and the one promoted still has a replica to confirm
/// writes (the other, re-pointed to it by the sentinels).
struct SentinelPrimary(RedisSentinel);

impl Primary for SentinelPrimary {
    fn store_toml(&self, on_error: &str, timeout: &str) -> String {
        self.0.store_toml(on_error, timeout)
    }

    fn on_victim(&self, _key: &str) -> bool {
        true
    }

    fn kill_primary(&mut self) {
        self.0.kill_primary();
    }

    fn describe(&self) -> String {
        format!("sentinels {:?}", self.0.sentinel_urls())
    }
}

/// A Redis Cluster of three masters with two replicas each (`backend =
/// "redis_cluster"`): the master killed is the one holding most of the scenario's keys,
/// and only its slots fail over; the replica promoted still has one to confirm writes.
struct ClusterPrimary {
    cluster: RedisCluster,
    victim: usize,
    /// Who served each slot before the kill.
    masters: Vec<Option<usize>>,
}

impl ClusterPrimary {
    /// The cluster, its victim the master of most of `keys`' Redis keys.
    fn start(keys: &[String]) -> ClusterPrimary {
        let cluster = RedisCluster::start_with(2);
        let masters = cluster.masters_by_slot();
        let mut held = std::collections::BTreeMap::<usize, usize>::new();
        for key in keys {
            if let Some(m) = masters[usize::from(cluster.slot_of(key))] {
                *held.entry(m).or_default() += 1;
            }
        }
        let victim = held
            .iter()
            .max_by_key(|&(_, n)| *n)
            .map(|(&m, _)| m)
            .expect("a master holds the keys");
        ClusterPrimary {
            cluster,
            victim,
            masters,
        }
    }
}

impl Primary for ClusterPrimary {
    fn store_toml(&self, on_error: &str, timeout: &str) -> String {
        self.cluster.store_toml(on_error, timeout)
    }

    fn on_victim(&self, key: &str) -> bool {
        self.masters[usize::from(self.cluster.slot_of(key))] == Some(self.victim)
    }

    fn kill_primary(&mut self) {
        self.cluster.kill(self.victim);
    }

    fn describe(&self) -> String {
        format!(
            "node {} killed; the cluster now:\n{}",
            self.victim,
            self.cluster.cluster_nodes()
        )
    }
}

/// What one run measured.
#[derive(Debug)]
struct Figures {
    /// Admissions beyond their key's limit, over every key.
    excess: u64,
    /// The most one key had.
    max_excess: u64,
    /// Keys with any.
    keys_over: usize,
    /// From the kill to the first admission of a key on the killed primary.
    promotion: Duration,
    /// Requests sent in that time, and how many of them were answered 503.
    during: u64,
    unavailable_during: u64,
    /// Requests sent, answered 200, 429, 503, otherwise (other status, or none).
    sent: u64,
    ok: u64,
    denied: u64,
    unavailable: u64,
    other: u64,
    /// Per key: admitted, its limit, whether it lived on the killed primary.
    keys: Vec<(u64, u64, bool)>,
    /// Per key: admitted from requests sent before the kill (all the killed primary can
    /// have recorded and its replica not yet received).
    before_kill: Vec<u64>,
    /// Admissions of the killed primary's keys after the promotion.
    served_after: u64,
    /// The gateways' store errors, by kind.
    errors: Vec<(String, u64)>,
    /// From the run's end to a fresh key's first admission (it then got its burst).
    fresh: Duration,
    /// Cluster connections replaced for answering nothing, over the gateways.
    reconnects: usize,
}

/// One request's outcome: its key, status (0: no answer), when it was sent.
type Outcome = (usize, u16, Instant);

/// The scenario's API keys.
fn api_keys() -> Vec<String> {
    (0..KEYS).map(|i| format!("failover-{i}")).collect()
}

/// Their Redis keys, as a store set-up places them.
fn redis_keys() -> Vec<String> {
    api_keys().iter().map(|k| redis_key(k, "api")).collect()
}

/// The scenario: 3 gateways on `set` with `replication`, the load, the kill, the count.
async fn failover_excess(mut set: impl Primary, replication: &str) -> Figures {
    let upstream = Upstream::start().await;
    let config = format!(
        "[upstream]\nurl = \"{}\"\nconnect_timeout = \"1s\"\ntimeout = \"5s\"\n{}replication = {replication}\n\
         [[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"{PER_HOUR}/h\"\nburst = {BURST}\n",
        upstream.url(),
        set.store_toml("deny", "1s")
    );
    let gateways: Vec<Gateway> = (0..3).map(|_| Gateway::start(&config)).collect();
    let keys = Arc::new(api_keys());
    let victim: Vec<bool> = keys
        .iter()
        .map(|k| set.on_victim(&redis_key(k, "api")))
        .collect();
    assert!(victim.iter().any(|&v| v), "keys on the primary killed");
    let client = HttpClient::new();
    // Each gateway connected, its scripts loaded, before the clock starts (a cluster
    // just made can take a moment more to confirm a `WAIT`).
    for gw in &gateways {
        let warm = client
            .until_status(
                &gw.url("/warm"),
                &[("x-api-key", "warm-up")],
                StatusCode::OK,
                Duration::from_secs(10),
            )
            .await;
        assert!(warm.is_some(), "warm-up\n{}", gw.logs());
    }
    let urls: Arc<Vec<String>> = Arc::new(gateways.iter().map(|g| g.url("/api/x")).collect());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Outcome>();
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));

    let mut admitted = vec![0u64; KEYS];
    let mut before_kill = vec![0u64; KEYS];
    let mut spent_after = vec![0u32; KEYS];
    let (mut sent, mut ok, mut denied, mut unavailable, mut other) = (0u64, 0, 0, 0, 0);
    let (mut killed, mut promoted): (Option<Instant>, Option<Instant>) = (None, None);
    let (mut during, mut unavailable_during, mut served_after) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0usize;
    let mut draining = false;
    loop {
        tick.tick().await;
        while let Ok((k, status, at)) = rx.try_recv() {
            let after_kill = killed.is_some_and(|t| at > t);
            match status {
                200 => {
                    ok += 1;
                    admitted[k] += 1;
                    if !after_kill {
                        before_kill[k] += 1;
                    }
                    if after_kill && victim[k] {
                        promoted.get_or_insert(Instant::now());
                        served_after += 1;
                    }
                }
                429 => {
                    denied += 1;
                    if promoted.is_some_and(|p| at > p) {
                        spent_after[k] += 1;
                    }
                }
                503 => unavailable += 1,
                _ => other += 1,
            }
            if after_kill && promoted.is_none_or(|p| at < p) {
                during += 1;
                if status == 503 {
                    unavailable_during += 1;
                }
            }
        }
        if draining {
            if in_flight.available_permits() == MAX_IN_FLIGHT {
                break;
            }
            continue;
        }
        if killed.is_none() && started.elapsed() >= KILL_AFTER {
            tokio::task::block_in_place(|| set.kill_primary());
            killed = Some(Instant::now());
        }
        if promoted.is_some() && spent_after.iter().all(|&d| d >= SPENT) {
            draining = true;
            continue;
        }
        if started.elapsed() > DEADLINE {
            panic!(
                "no end within {DEADLINE:?} ({replication}): killed {:?} after the start, promoted {:?} after the kill; \
                 {ok} admitted, {denied} denied, {unavailable} 503s, {other} other of {sent}; store errors {:?}\n{}",
                killed.map(|t| t - started),
                promoted.zip(killed).map(|(p, k)| p - k),
                store_errors(&client, &gateways).await,
                set.describe()
            );
        }
        for _ in 0..PER_TICK {
            let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                break;
            };
            let (k, g) = (n % KEYS, (n / KEYS) % gateways.len());
            n += 1;
            sent += 1;
            let (client, keys, urls, tx) = (client.clone(), keys.clone(), urls.clone(), tx.clone());
            tokio::spawn(async move {
                let at = Instant::now();
                let status = client
                    .try_get(
                        &urls[g],
                        &[("x-api-key", &keys[k])],
                        Duration::from_secs(10),
                    )
                    .await
                    .map_or(0, |r| r.status.as_u16());
                let _ = tx.send((k, status, at));
                drop(permit);
            });
        }
    }
    let (Some(killed), Some(promoted)) = (killed, promoted) else {
        panic!("the run ended without a promotion")
    };
    let fresh = fresh_key_gets_its_burst(&set, &client, &urls).await;
    let errors = store_errors(&client, &gateways).await;
    let reconnects = gateways
        .iter()
        .map(|gw| gw.logs().matches(RECONNECTED).count())
        .sum();
    for gw in &gateways {
        assert!(!gw.logs().contains("panicked"), "{}", gw.logs());
    }
    // The limit of each key over the run: its burst, and what refilled since (nothing
    // under an hour at 1/h).
    let refilled = started.elapsed().as_secs() * PER_HOUR / 3600;
    let limit = BURST + refilled;
    let over: Vec<u64> = admitted.iter().map(|&a| a.saturating_sub(limit)).collect();
    Figures {
        excess: over.iter().sum(),
        max_excess: over.iter().copied().max().unwrap_or(0),
        keys_over: over.iter().filter(|&&e| e > 0).count(),
        promotion: promoted - killed,
        during,
        unavailable_during,
        sent,
        ok,
        denied,
        unavailable,
        other,
        keys: admitted
            .iter()
            .zip(&victim)
            .map(|(&a, &v)| (a, limit, v))
            .collect(),
        before_kill,
        served_after,
        errors,
        fresh,
        reconnects,
    }
}

/// What a gateway logs when it replaces a cluster connection that answered nothing.
const RECONNECTED: &str = "the cluster connection answered nothing; connecting again";

/// How long, once the run is over, a fresh key on the promoted primary may still be
/// refused.
const RECOVERY: Duration = Duration::from_secs(10);

/// A key never used, on the primary that was killed, sent to the gateways in turn once
/// the run is over (every old key spent again after the promotion): 503s at most for
/// [`RECOVERY`], then exactly its burst of 200s and a 429. How long its first 200 took.
async fn fresh_key_gets_its_burst(
    set: &impl Primary,
    client: &HttpClient,
    urls: &[String],
) -> Duration {
    let asked = Instant::now();
    let key = (0..)
        .map(|i| format!("fresh-{i}"))
        .find(|k| set.on_victim(&redis_key(k, "api")))
        .expect("a key on the victim");
    let mut statuses = Vec::new();
    let mut first = None;
    for n in 0.. {
        let url = &urls[n % urls.len()];
        let status = client
            .try_get(url, &[("x-api-key", &key)], Duration::from_secs(10))
            .await
            .map_or(0, |r| r.status.as_u16());
        if first.is_none() {
            match status {
                200 => first = Some(asked.elapsed()),
                503 if asked.elapsed() < RECOVERY => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                s => panic!(
                    "{key}: {s} {:?} after the run: {}",
                    asked.elapsed(),
                    set.describe()
                ),
            }
        }
        statuses.push(status);
        if status != 200 || statuses.len() > BURST as usize {
            break;
        }
    }
    assert_eq!(
        statuses,
        common::burst_then_429(BURST as usize),
        "{key}: its burst, then 429, through all the gateways"
    );
    first.unwrap_or_default()
}

/// The store errors of all `gateways` together, by kind (those that happened).
async fn store_errors(client: &HttpClient, gateways: &[Gateway]) -> Vec<(String, u64)> {
    let mut all = std::collections::BTreeMap::new();
    for gw in gateways {
        let scrape = Scrape::take(client, gw).await;
        for (kind, n) in scrape.nonzero1("ratewall_store_errors_total", "kind") {
            *all.entry(kind).or_insert(0) += n;
        }
    }
    all.into_iter().collect()
}

fn report(what: &str, f: &Figures) {
    println!(
        "failover excess, {what}: total {} of a {} limit ({:.2}%), max {} per key, {} keys over; \
         promotion {:.2} s, {} requests sent meanwhile ({} answered 503); \
         {} sent: {} admitted, {} denied, {} 503, {} other; {} admitted on the promoted primary; store errors {:?}; a fresh key's first admission {:.2} s after the run; \
         {} cluster connections replaced",
        f.excess,
        KEYS as u64 * BURST,
        f.excess as f64 * 100.0 / (KEYS as u64 * BURST) as f64,
        f.max_excess,
        f.keys_over,
        f.promotion.as_secs_f64(),
        f.during,
        f.unavailable_during,
        f.sent,
        f.ok,
        f.denied,
        f.unavailable,
        f.other,
        f.served_after,
        f.errors,
        f.fresh.as_secs_f64(),
        f.reconnects,
    );
}

/// What holds whatever the mode: keys that never failed over kept exact limits, and the
/// promoted primary served.
fn check_common(what: &str, f: &Figures) {
    for (k, &(admitted, limit, on_victim)) in f.keys.iter().enumerate() {
        if !on_victim {
            assert!(
                admitted <= limit,
                "{what}: key {k} never failed over yet admitted {admitted} of {limit}"
            );
        }
    }
    assert!(
        f.served_after > 0,
        "{what}: the promoted primary admitted nothing"
    );
}

/// Three gateways, 100 keys, about 2,000 requests a second, the Sentinel's primary
/// SIGKILLed mid-run: with asynchronous replication the excess is what the promoted
/// replica had not yet got — bounded here, per key, by its admissions before the kill
/// (the real figure is printed, and docs/scaling.md records it); with
/// `replication = { wait = 1 }` in the same run, none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_costs_a_bounded_excess_async_and_none_with_wait() {
    let _watch = common::watchdog();
    both_modes("redis_sentinel", || SentinelPrimary(RedisSentinel::start())).await;
}

/// `wait = 1` on one Redis: with a replica, requests pass as before; without one, no
/// write is confirmed, so no request is admitted: each is a store error (`on_error`: 503),
/// counted as `unreplicated`, within the store timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_admits_only_what_a_replica_confirmed() {
    let _watch = common::watchdog();
    let primary = RedisServer::start();
    let upstream = Upstream::start().await;
    // `wait`: 200 ms where no replica can answer (the 503 comes within it); where one
    // can, a second (a loaded machine can hold an acknowledgement past 200 ms).
    let config = |redis: &RedisServer, wait: &str, timeout: &str| {
        format!(
            "[upstream]\nurl = \"{}\"\n[store]\nbackend = \"redis\"\nurl = \"{}\"\nprefix = \"{}\"\ntimeout = \"{timeout}\"\non_error = \"deny\"\n\
             breaker_failures = 1000\nreplication = {{ wait = 1, timeout = \"{wait}\" }}\n\
             [[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 3\n",
            upstream.url(),
            redis.url(),
            common::PREFIX
        )
    };
    let client = HttpClient::new();

    // No replica: nothing is confirmed. (That the 503 comes from the replication wait,
    // not the store timeout, is what `kind = "unreplicated"` below says, not a clock.)
    let gw = Gateway::start(&config(&primary, "200ms", "500ms"));
    for _ in 0..3 {
        let r = client.get(&gw.url("/x"), &[("x-api-key", "lonely")]).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", gw.logs());
    }
    let scrape = Scrape::take(&client, &gw).await;
    assert_eq!(
        scrape.get("ratewall_store_errors_total", &[("kind", "unreplicated")]),
        3.0
    );
    assert!(
        gw.logs().contains("0 of 1 replicas confirmed"),
        "{}",
        gw.logs()
    );
    assert_eq!(
        upstream.seen().len(),
        0,
        "nothing unconfirmed was forwarded"
    );
    drop(gw);

    // With a replica: the burst passes, then 429, as without replication.
    let replica = RedisServer::start_replica_of(&primary);
    let gw = Gateway::start(&config(&primary, "1s", "2s"));
    assert_eq!(
        client.statuses(&gw.url("/x"), "paired", 4).await,
        common::burst_then_429(3),
        "{}",
        gw.logs()
    );
    let key = redis_key("paired", "api");
    let on_replica: Option<String> = redis::cmd("GET")
        .arg(&key)
        .query(&mut replica.conn())
        .expect("GET on the replica");
    assert!(
        on_replica.is_some(),
        "the replica has {key} once it was admitted"
    );
}

/// The same scenario on a Redis Cluster (three masters, two replicas each), the master of
/// most keys SIGKILLed: only its slots fail over, and the gateways follow the promoted
/// replica. With asynchronous replication the excess is bounded as on Sentinel; with
/// `replication = { wait = 1 }` in the same run, none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_costs_a_bounded_excess_async_and_none_with_wait() {
    let _watch = common::watchdog();
    both_modes("redis_cluster", || ClusterPrimary::start(&redis_keys())).await;
}

/// The scenario twice on a fresh set each time: with asynchronous replication a key's
/// excess is at most what it was admitted before the kill; with
/// `replication = { wait = 1 }`, none.
async fn both_modes<P: Primary>(store: &str, start: impl Fn() -> P) {
    let _serial = serial().await;
    let run = failover_excess(start(), "\"async\"").await;
    report(&format!("{store}, async"), &run);
    check_common("async", &run);
    // What asynchronous replication can lose is what the replica had not yet received
    // at the kill: a key's excess is at most its admissions before the kill, and only
    // then if the replica lagged the whole run. On one idle host the lag is far under a
    // millisecond (0 lost in the runs docs/scaling.md records); on a loaded CI machine a
    // replica has been seen a second behind (21 of 30 admissions a key lost), so the
    // bound asserted is the one replication gives, not a guess at the lag (`report` prints
    // the excess).
    for (k, (&(admitted, limit, _), &before)) in run.keys.iter().zip(&run.before_kill).enumerate() {
        assert!(
            admitted.saturating_sub(limit) <= before,
            "async: key {k} admitted {admitted} of {limit}, more over it than the {before} \
             the killed primary could have recorded: {run:?}"
        );
    }
    let run = failover_excess(start(), "{ wait = 1, timeout = \"50ms\" }").await;
    report(&format!("{store}, wait = 1"), &run);
    check_common("wait = 1", &run);
    assert_eq!(
        run.excess, 0,
        "wait = 1: every admission was on a replica when it was answered: {run:?}"
    );
}
