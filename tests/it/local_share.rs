//! `local_share` (issue 28, item 3): during a store outage with `on_error = "local"`, each
//! gateway limits on its own; with `local_share = "1/3"` three gateways together admit at
//! most the limit (plus one burst), not three times it. Real redis-server, three real
//! gateways, a real upstream, killed Redis.

use crate::common;

use common::{upstream_and_store, Gateway, HttpClient, RedisServer, Store, Upstream};
use http::StatusCode;

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
