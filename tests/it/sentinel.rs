//! `backend = "redis_sentinel"` (issue 28, item 1), end to end: the real `ratewall` binary,
//! a real upstream and real Redis under Sentinel (one primary, two replicas, three
//! sentinels: `common/sentinel.rs`).
//!
//! - The primary is found through the sentinels, a limit holds exactly, and its state is
//!   on the primary; the status page, `/readyz` and the metrics name the primary.
//! - SIGKILL of the primary under load from several clients: requests get `on_error`
//!   (503) during the promotion, then are decided by the new primary, which holds the
//!   keys' state; a fresh key gets exactly its burst after the switch; the status page
//!   names the new primary, and `ratewall_store_primary_changes_total` counted one change.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    metric, redis_key, serial, series, Gateway, HttpClient, RedisSentinel, Upstream, MASTER_NAME,
};
use http::StatusCode;

/// Statuses of `n` requests of `key` on `path`, one after another.
async fn statuses(client: &HttpClient, gw: &Gateway, path: &str, key: &str, n: usize) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(
            client
                .get(&gw.url(path), &[("x-api-key", key)])
                .await
                .status
                .as_u16(),
        );
    }
    out
}

/// `/status.json`'s `store`.
async fn store_status(client: &HttpClient, gw: &Gateway) -> serde_json::Value {
    client.get(&gw.admin_url("/status.json"), &[]).await.json()["store"].clone()
}

/// Wait until the gateway's status page names `127.0.0.1:<port>` as its primary.
async fn wait_named(client: &HttpClient, gw: &Gateway, port: u16, within: Duration) {
    let want = format!("127.0.0.1:{port}");
    let end = Instant::now() + within;
    loop {
        let store = store_status(client, gw).await;
        if store["primary"] == want.as_str() {
            return;
        }
        assert!(
            Instant::now() < end,
            "the gateway never named {want} its primary: {store}\n{}",
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn config(upstream: &Upstream, sentinel: &RedisSentinel, on_error: &str, timeout: &str) -> String {
    // `exact`: 5 per key on /exact, nothing refills within the test; `load`: the
    // concurrent clients' keys on /load, room for all their requests.
    format!(
        "[upstream]\nurl = \"{}\"\nconnect_timeout = \"1s\"\ntimeout = \"5s\"\n{}\
         [[rules]]\nname = \"exact\"\nmatch = {{ path_prefix = \"/exact\" }}\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 5\n\
         [[rules]]\nname = \"load\"\nmatch = {{ path_prefix = \"/load\" }}\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 1000000\n",
        upstream.url(),
        sentinel.store_toml(on_error, timeout),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_on_sentinel_limits_exactly_on_the_primary_it_names() {
    let _watch = common::watchdog();
    let sentinel = tokio::task::block_in_place(RedisSentinel::start);
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&config(&upstream, &sentinel, "deny", "2s"));
    let client = HttpClient::new();
    let primary = sentinel.primary_port();
    wait_named(&client, &gw, primary, Duration::from_secs(15)).await;

    let got = statuses(&client, &gw, "/exact", "k-exact", 8).await;
    assert_eq!(
        got,
        [200, 200, 200, 200, 200, 429, 429, 429],
        "burst 5, then 429"
    );
    // The state is the primary's.
    let key = redis_key("k-exact", "exact");
    let exists: bool = redis::cmd("EXISTS")
        .arg(&key)
        .query(&mut sentinel.primary())
        .expect("EXISTS");
    assert!(exists, "{key} on the primary {primary}");

    let address = format!("127.0.0.1:{primary}");
    let store = store_status(&client, &gw).await;
    assert_eq!(store["backend"], "redis_sentinel", "{store}");
    assert_eq!(
        store["described"],
        format!("redis_sentinel {MASTER_NAME} \u{2192} {address}").as_str(),
        "{store}"
    );
    let ready = client.get(&gw.admin_url("/readyz"), &[]).await;
    assert_eq!(ready.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&ready.body).into_owned();
    assert!(text.contains(&address), "/readyz names the primary: {text}");
    assert_eq!(
        metric(&gw, "ratewall_store_primary", &[("address", &address)]).await,
        1.0
    );
    assert_eq!(
        metric(&gw, "ratewall_store_primary_changes_total", &[]).await,
        0.0,
        "finding the first primary is no change"
    );
    assert!(gw
        .logs()
        .contains("redis primary found through the sentinels"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_under_load_is_followed_and_the_limit_holds_after_it() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let mut sentinel = tokio::task::block_in_place(RedisSentinel::start);
    let upstream = Upstream::start().await;
    // A second for a store call: a loaded machine can keep a live primary's answer past
    // a quarter of one, and a call to the killed primary fails at once (refused) anyway.
    let gw = Arc::new(Gateway::start(&config(&upstream, &sentinel, "deny", "1s")));
    let client = HttpClient::new();
    let old = sentinel.primary_port();
    wait_named(&client, &gw, old, Duration::from_secs(15)).await;

    // Four clients, a key each, until told to stop: each answer with when it came, and a
    // count of each one's 200s.
    let stop = Arc::new(AtomicBool::new(false));
    let served: Arc<[AtomicUsize; 4]> = Arc::new(Default::default());
    let started = Instant::now();
    let load: Vec<_> = (0..4)
        .map(|i| {
            let (gw, stop, client, served) =
                (gw.clone(), stop.clone(), client.clone(), served.clone());
            tokio::spawn(async move {
                let key = format!("k-load-{i}");
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let r = client.get(&gw.url("/load"), &[("x-api-key", &key)]).await;
                    seen.push((started.elapsed(), r.status.as_u16()));
                    if r.status == StatusCode::OK {
                        served[i].fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                seen
            })
        })
        .collect();
    // Until every client has been served more than `than`'s count.
    let more_served = |than: [usize; 4], within: Duration| {
        let served = served.clone();
        async move {
            let end = Instant::now() + within;
            let now = || served.each_ref().map(|n| n.load(Ordering::Relaxed));
            while (0..4).any(|i| now()[i] <= than[i]) {
                assert!(Instant::now() < end, "a client is not served: {:?}", now());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            now()
        }
    };
    more_served([0; 4], Duration::from_secs(15)).await;

    let killed_at = started.elapsed();
    tokio::task::block_in_place(|| sentinel.kill_primary());
    let new =
        tokio::task::block_in_place(|| sentinel.wait_for_new_primary(old, Duration::from_secs(30)));
    assert_ne!(new, old);
    wait_named(&client, &gw, new, Duration::from_secs(30)).await;
    let switched_at = started.elapsed();
    // Load goes on against the new primary: the second after the switch (real time on
    // purpose: the checks below count from it), then until every client is served again.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // (Two more each: one counted just after the second began could have been answered
    // just before.)
    let then = served.each_ref().map(|n| n.load(Ordering::Relaxed) + 1);
    more_served(then, Duration::from_secs(15)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for (i, task) in load.into_iter().enumerate() {
        let seen = task.await.expect("load task");
        let before = seen
            .iter()
            .filter(|(t, s)| *t < killed_at && *s == 200)
            .count();
        let after = seen
            .iter()
            .filter(|(t, s)| *t > switched_at + Duration::from_secs(1) && *s == 200)
            .count();
        assert!(
            before > 0,
            "client {i} was served before the kill: {seen:?}\n{}",
            gw.logs()
        );
        assert!(
            after > 0,
            "client {i} is served by the new primary after the switch: {seen:?}\n{}",
            gw.logs()
        );
        all.extend(seen.into_iter().map(|(_, s)| s));
    }
    let failed = all.iter().filter(|&&s| s == 503).count();
    let tally = common::tally(all.iter().map(|&s| StatusCode::from_u16(s).unwrap()));
    assert!(
        failed > 0,
        "requests during the promotion get on_error = \"deny\": 503: {tally:?}\n{}",
        gw.logs()
    );
    assert!(
        all.iter().all(|s| [200, 503].contains(s)),
        "only 200 (limited by Redis, room to spare) and 503 (on_error): {tally:?}\n{}",
        gw.logs()
    );

    // The new primary holds the keys' state, and it is a primary.
    let mut conn = sentinel.node(new);
    assert_eq!(common::role(&mut conn), "master");
    for i in 0..4 {
        let key = redis_key(&format!("k-load-{i}"), "load");
        let exists: bool = redis::cmd("EXISTS")
            .arg(&key)
            .query(&mut conn)
            .expect("EXISTS");
        assert!(exists, "{key} on the new primary {new}");
    }
    // A fresh key gets exactly its burst from the new primary.
    let got = statuses(&client, &gw, "/exact", "k-after", 8).await;
    assert_eq!(
        got,
        [200, 200, 200, 200, 200, 429, 429, 429],
        "burst 5 after the failover:\n{}",
        gw.logs()
    );
    let exists: bool = redis::cmd("EXISTS")
        .arg(redis_key("k-after", "exact"))
        .query(&mut conn)
        .expect("EXISTS");
    assert!(exists, "the fresh key's state is on the new primary");

    let new_address = format!("127.0.0.1:{new}");
    let store = store_status(&client, &gw).await;
    assert_eq!(
        store["described"],
        format!("redis_sentinel {MASTER_NAME} \u{2192} {new_address}").as_str(),
        "{store}"
    );
    assert_eq!(
        metric(&gw, "ratewall_store_primary_changes_total", &[]).await,
        1.0,
        "one change: {}",
        gw.logs()
    );
    assert_eq!(
        metric(&gw, "ratewall_store_primary", &[("address", &new_address)]).await,
        1.0
    );
    assert_eq!(
        series(
            &gw,
            "ratewall_store_primary",
            &[("address", &format!("127.0.0.1:{old}"))]
        )
        .await,
        None,
        "the old primary's series is gone"
    );
    let logs = gw.logs();
    assert!(
        logs.contains("redis primary changed") && logs.contains(&new_address),
        "the change is logged with the new primary:\n{logs}"
    );

    // The old primary comes back (empty) and is made a replica: the gateway stays on the
    // new primary, and the limits it holds stand.
    tokio::task::block_in_place(|| sentinel.restart_node(old));
    let end = Instant::now() + Duration::from_secs(30);
    while common::role(&mut sentinel.node(old)) != "slave" {
        assert!(
            Instant::now() < end,
            "the old primary was never made a replica"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Real time on purpose: a window in which a gateway that went back to the old primary
    // would show it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The sentinels may have failed over once more on their own (a loaded machine can keep
    // the new primary silent past their 1 s `down-after-milliseconds` while it feeds the
    // returning replica): then the gateway follows them, as it must. What it must never
    // do is go back to a node the sentinels do not name.
    let named = tokio::task::block_in_place(|| sentinel.primary_port());
    let changes = if named == new {
        assert_eq!(
            store_status(&client, &gw).await["primary"],
            new_address.as_str(),
            "{}",
            gw.logs()
        );
        1.0
    } else {
        wait_named(&client, &gw, named, Duration::from_secs(30)).await;
        2.0
    };
    assert_eq!(
        statuses(&client, &gw, "/exact", "k-after", 1).await,
        [429],
        "{}",
        gw.logs()
    );
    assert_eq!(
        metric(&gw, "ratewall_store_primary_changes_total", &[]).await,
        changes,
        "one change per failover the sentinels made: {}",
        gw.logs()
    );
}
