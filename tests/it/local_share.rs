//! `local_share` (issue 28, item 3): during a store outage with `on_error = "local"`, each
//! gateway limits on its own; with `local_share = "1/3"` three gateways together admit at
//! most the limit (plus one burst), not three times it; with `"auto"` they count each
//! other by their heartbeats in Redis and do the same. Real redis-server, three real
//! gateways, a real upstream, killed Redis.

use std::time::{Duration, Instant};

use crate::common;

use common::{
    dump_dom, metric, pttl, redis_now_us, upstream_and_store, Gateway, HttpClient, RedisCluster,
    RedisServer, Store, Upstream, PREFIX,
};
use http::StatusCode;
use ratewall::limiter::memory::MemoryStore;
use ratewall::limiter::redis::{RedisClusterStore, RedisStore};
use ratewall::limiter::Store as _;

const BURST: u64 = 30;

/// How many of `n` requests of one key each gateway admits, one after another.
async fn admitted(
    client: &HttpClient,
    gateways: &[Gateway],
    key: &str,
    path: &str,
    n: usize,
) -> Vec<usize> {
    let mut out = Vec::new();
    for gw in gateways {
        let mut passed = 0;
        for _ in 0..n {
            let r = client.get(&gw.url(path), &[("x-api-key", key)]).await;
            match r.status {
                StatusCode::OK => passed += 1,
                StatusCode::TOO_MANY_REQUESTS => {}
                other => panic!("{path} on {}: {other} during the outage", gw.url("")),
            }
        }
        out.push(passed);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_with_a_third_each_stay_at_the_limit_while_redis_is_down() {
    let _watch = common::watchdog();
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = Store::Redis {
        url: redis.url(),
        on_error: "local",
        timeout: "250ms",
    };
    // Two rules on two paths: the whole limit per gateway, and a third of it.
    let rules = format!(
        "[[rules]]\nname = \"whole\"\nmatch = {{ path_prefix = \"/whole\" }}\nkey = \"api_key\"\nrate = \"1/h\"\nburst = {BURST}\n\
         [[rules]]\nname = \"shared\"\nmatch = {{ path_prefix = \"/shared\" }}\nkey = \"api_key\"\nrate = \"1/h\"\nburst = {BURST}\nlocal_share = \"1/3\"\n"
    );
    let config = format!("{}{rules}", upstream_and_store(&upstream.url(), &store));
    let gateways: Vec<Gateway> = (0..3).map(|_| Gateway::start(&config)).collect();
    let client = HttpClient::new();
    // While Redis answers, the share changes nothing: the three share one limit.
    let up = admitted(&client, &gateways, "k-up", "/shared", 15).await;
    assert_eq!(
        up.iter().sum::<usize>(),
        BURST as usize,
        "one limit through Redis: {up:?}"
    );

    tokio::task::block_in_place(|| redis.kill());
    let whole = admitted(&client, &gateways, "k-down", "/whole", BURST as usize + 5).await;
    let shared = admitted(&client, &gateways, "k-down", "/shared", BURST as usize + 5).await;
    assert_eq!(
        whole,
        vec![BURST as usize; 3],
        "without local_share each gateway admits the whole burst on its own"
    );
    assert_eq!(
        shared,
        vec![BURST as usize / 3; 3],
        "with local_share = \"1/3\" each admits a third: together the limit"
    );
    assert!(
        shared.iter().sum::<usize>() as u64 <= 2 * BURST,
        "at most the limit plus one burst"
    );
}

/// `store.gateways_seen` in the gateway's `/status.json`.
async fn gateways_seen(client: &HttpClient, gw: &Gateway) -> serde_json::Value {
    let status = client.get(&gw.admin_url("/status.json"), &[]).await.json();
    status["store"]["gateways_seen"].clone()
}

/// Wait (at most `within`) until every gateway says it sees `n` gateways, in
/// `/status.json` and in `ratewall_gateways_seen`.
async fn until_each_sees(client: &HttpClient, gateways: &[Gateway], n: u64, within: Duration) {
    let end = Instant::now() + within;
    loop {
        let mut seen = Vec::new();
        for gw in gateways {
            seen.push((
                gateways_seen(client, gw).await,
                metric(gw, "ratewall_gateways_seen", &[]).await,
            ));
        }
        if seen
            .iter()
            .all(|(json, m)| json.as_u64() == Some(n) && *m == n as f64)
        {
            return;
        }
        assert!(
            Instant::now() < end,
            "within {within:?} not every gateway saw {n}: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_with_auto_count_each_other_and_keep_a_third_each_while_redis_is_down() {
    let _watch = common::watchdog();
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = Store::Redis {
        url: redis.url(),
        on_error: "local",
        timeout: "250ms",
    };
    let rules = format!(
        "[[rules]]\nname = \"auto\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = {BURST}\nlocal_share = \"auto\"\n"
    );
    let config = format!("{}{rules}", upstream_and_store(&upstream.url(), &store));
    let gateways: Vec<Gateway> = (0..3).map(|_| Gateway::start(&config)).collect();
    let client = HttpClient::new();
    // Heartbeats every 5 s, the first at start: each sees the three within two beats. The
    // bound is wide for a loaded machine.
    until_each_sees(&client, &gateways, 3, Duration::from_secs(30)).await;
    // One member per gateway, scored by Redis' clock, the set expiring 15 s on.
    let mut conn = redis.conn();
    let key = format!("{PREFIX}:gateways");
    let members: Vec<(String, u64)> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut conn)
        .expect("ZRANGE");
    assert_eq!(members.len(), 3, "{members:?}");
    let now_ms = redis_now_us(&mut conn) / 1000;
    for (member, at_ms) in &members {
        assert!(
            member.len() == 16 && member.bytes().all(|b| b.is_ascii_hexdigit()),
            "an instance id: {member:?}"
        );
        assert!(
            *at_ms <= now_ms && now_ms - at_ms < 15_000,
            "{member} beat at {at_ms}, now {now_ms}"
        );
    }
    let ttl = pttl(&mut conn, &key);
    assert!(ttl > 0 && ttl <= 15_000, "the set's TTL: {ttl} ms");

    // While Redis answers, "auto" changes nothing: the three share one limit.
    let up = admitted(&client, &gateways, "k-up", "/", 15).await;
    assert_eq!(
        up.iter().sum::<usize>(),
        BURST as usize,
        "one limit through Redis: {up:?}"
    );

    tokio::task::block_in_place(|| redis.kill());
    let down = admitted(&client, &gateways, "k-down", "/", BURST as usize + 5).await;
    assert_eq!(
        down,
        vec![BURST as usize / 3; 3],
        "with local_share = \"auto\" and three gateways seen, each admits a third"
    );
    assert!(
        down.iter().sum::<usize>() as u64 <= 2 * BURST,
        "at most the limit plus one burst"
    );
    // The last count is kept through the outage, and the status page shows it.
    for gw in &gateways {
        assert_eq!(gateways_seen(&client, gw).await.as_u64(), Some(3));
        assert_eq!(metric(gw, "ratewall_gateways_seen", &[]).await, 3.0);
    }
    let dom = dump_dom(&gateways[0].admin_url("/")).await;
    assert!(
        dom.contains(r#"<dd id="store-gateways">3</dd>"#),
        "the status page shows the 3 gateways seen:\n{dom}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_never_reached_redis_counts_itself_alone_and_keeps_the_whole_limit() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    // Nothing listens there: no heartbeat is ever answered.
    let refusing = common::RefusingPort::new();
    let store = Store::Redis {
        url: format!("redis://127.0.0.1:{}", refusing.port),
        on_error: "local",
        timeout: "250ms",
    };
    let rules = format!(
        "[[rules]]\nname = \"auto\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = {BURST}\nlocal_share = \"auto\"\n"
    );
    let gw = Gateway::start(&format!(
        "{}{rules}",
        upstream_and_store(&upstream.url(), &store)
    ));
    let client = HttpClient::new();
    let passed = admitted(
        &client,
        std::slice::from_ref(&gw),
        "k",
        "/",
        BURST as usize + 5,
    )
    .await;
    assert_eq!(
        passed,
        vec![BURST as usize],
        "1 gateway seen: the whole limit"
    );
    assert_eq!(gateways_seen(&client, &gw).await.as_u64(), Some(1));
    assert_eq!(metric(&gw, "ratewall_gateways_seen", &[]).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_count_the_gateways_within_the_window_and_drop_the_rest() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let window = Duration::from_secs(15);
    let open = || RedisStore::new(&redis.url(), PREFIX, Duration::from_secs(5)).expect("store");
    let (a, b) = (open(), open());
    assert_eq!(a.heartbeat(window).await.expect("a"), 1);
    assert_eq!(b.heartbeat(window).await.expect("b"), 2);
    assert_eq!(
        a.heartbeat(window).await.expect("a again"),
        2,
        "one member per gateway"
    );
    // A gateway last heard from 20 s ago (Redis' clock) is dropped, and not counted.
    let mut conn = redis.conn();
    let key = format!("{PREFIX}:gateways");
    let now_ms = redis_now_us(&mut conn) / 1000;
    let _: i64 = redis::cmd("ZADD")
        .arg(&key)
        .arg(now_ms - 20_000)
        .arg("00000000000dead0")
        .query(&mut conn)
        .expect("ZADD");
    assert_eq!(b.heartbeat(window).await.expect("b again"), 2);
    let gone: Option<f64> = redis::cmd("ZSCORE")
        .arg(&key)
        .arg("00000000000dead0")
        .query(&mut conn)
        .expect("ZSCORE");
    assert_eq!(gone, None, "the stale member was removed");
    let ttl = pttl(&mut conn, &key);
    assert!(ttl > 14_000 && ttl <= 15_000, "the set's TTL: {ttl} ms");
    // A key of another type is a store error, not a panic; nothing is overwritten.
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("x")
        .query(&mut conn)
        .expect("SET");
    assert!(a.heartbeat(window).await.is_err());
    assert_eq!(common::get(&mut conn, &key).as_deref(), Some("x"));
    // The memory store is one gateway's own.
    let memory = MemoryStore::new(std::sync::Arc::new(ratewall::limiter::MonotonicClock::new()));
    assert_eq!(memory.heartbeat(window).await.expect("memory"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_cluster_the_heartbeats_meet_in_one_key_on_one_node() {
    let _watch = common::watchdog();
    let cluster = tokio::task::block_in_place(RedisCluster::start);
    let window = Duration::from_secs(15);
    let open =
        || RedisClusterStore::new(&cluster.nodes(), PREFIX, Duration::from_secs(5)).expect("store");
    let (a, b, c) = (open(), open(), open());
    assert_eq!(a.heartbeat(window).await.expect("a"), 1);
    assert_eq!(b.heartbeat(window).await.expect("b"), 2);
    assert_eq!(c.heartbeat(window).await.expect("c"), 3);
    assert_eq!(a.heartbeat(window).await.expect("a again"), 3);
    let key = format!("{PREFIX}:gateways");
    let mut node = cluster.node(cluster.node_of(&key));
    let n: u64 = redis::cmd("ZCARD")
        .arg(&key)
        .query(&mut node)
        .expect("ZCARD on the key's node");
    assert_eq!(n, 3);
}
