//! End to end: the real `ratewall` binary between a real HTTP client and a real upstream,
//! on the memory store and on a real redis-server.

use crate::common;

use std::net::IpAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    api_rule, command_calls, evalsha_calls, exact_rule, int, raw_exchange, redis_key, serial,
    sf_list, tally, upstream_and_store, Gateway, HttpClient, RedisServer, Store, Upstream,
    ALGORITHMS,
};
use http::StatusCode;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn burst_is_exact_under_concurrency(store: Store) {
    const B: usize = 25;
    for algorithm in ALGORITHMS {
        let upstream = Upstream::start().await;
        let gw = Gateway::start(&format!(
            "{}{}",
            upstream_and_store(&upstream.url(), &store),
            exact_rule("api", "api_key", algorithm, B as u64)
        ));
        let client = HttpClient::new();
        let tasks: Vec<_> = (0..4 * B)
            .map(|_| {
                let (c, url) = (client.clone(), gw.url("/api/thing"));
                tokio::spawn(async move { c.get(&url, &[("x-api-key", "key-one")]).await.status })
            })
            .collect();
        let mut statuses = Vec::new();
        for t in tasks {
            statuses.push(t.await.expect("request task"));
        }
        let counts = tally(statuses);
        assert_eq!(
            counts.get(&200),
            Some(&B),
            "{algorithm}: exactly B pass: {counts:?}\n{}",
            gw.logs()
        );
        assert_eq!(
            counts.get(&429),
            Some(&(3 * B)),
            "{algorithm}: the rest are denied: {counts:?}"
        );
        assert_eq!(
            upstream.seen().len(),
            B,
            "{algorithm}: only allowed requests reach the upstream"
        );
        // Other keys are unaffected.
        let other = client
            .get(&gw.url("/api/thing"), &[("x-api-key", "key-two")])
            .await;
        assert_eq!(other.status, StatusCode::OK, "{algorithm}");
        let state = other
            .header("ratelimit")
            .expect("RateLimit header")
            .to_string();
        assert!(
            state.starts_with(&format!("\"api\";r={};t=", B - 1)),
            "{algorithm}: {state}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_is_exact_under_concurrency_memory() {
    let _watch = common::watchdog();
    burst_is_exact_under_concurrency(Store::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_is_exact_under_concurrency_redis() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    // A generous store timeout: this test is about exactness, not about faults.
    let store = Store::Redis {
        url: redis.url(),
        on_error: "deny",
        timeout: "3s",
    };
    burst_is_exact_under_concurrency(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_header_is_believed_only_from_trusted_peers() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}[client_ip]\ntrusted_proxies = [\"127.0.0.1/32\", \"10.0.0.0/8\"]\n\
         [[rules]]\nname = \"ip\"\nkey = \"client_ip\"\nrate = \"1/h\"\nburst = 2\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let url = gw.url("/");
    let untrusted = HttpClient::from_addr(Some("127.0.0.2".parse::<IpAddr>().unwrap()));
    let trusted = HttpClient::from_addr(Some("127.0.0.1".parse::<IpAddr>().unwrap()));

    // From an untrusted peer a spoofed header changes nothing: one bucket, the peer's.
    for (xff, want) in [("1.1.1.1", 200), ("2.2.2.2", 200), ("3.3.3.3", 429)] {
        let r = untrusted.get(&url, &[("x-forwarded-for", xff)]).await;
        assert_eq!(
            r.status.as_u16(),
            want,
            "untrusted peer, X-Forwarded-For {xff}"
        );
    }
    // The peer's own bucket is empty whatever it claims.
    assert_eq!(
        untrusted.get(&url, &[]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );

    // From a trusted peer the rightmost untrusted hop is the client; what the client wrote
    // to its left does not matter, and trusted hops to its right are skipped.
    for (xff, want) in [
        ("6.6.6.6, 198.51.100.7", 200),
        ("7.7.7.7, 198.51.100.7, 10.1.1.1", 200),
        ("8.8.8.8, 198.51.100.7", 429),
        ("198.51.100.8", 200),
        ("198.51.100.7, 198.51.100.8", 200),
        ("198.51.100.8", 429),
    ] {
        let r = trusted.get(&url, &[("x-forwarded-for", xff)]).await;
        assert_eq!(
            r.status.as_u16(),
            want,
            "trusted peer, X-Forwarded-For {xff}"
        );
    }
    // Garbage never becomes a fresh identity: it falls back to the trusted peer itself.
    for (i, xff) in ["not-an-ip", "unknown", "1.2.3.4, bogus", "999.0.0.1"]
        .iter()
        .enumerate()
    {
        let r = trusted.get(&url, &[("x-forwarded-for", xff)]).await;
        let want = if i < 2 { 200 } else { 429 };
        assert_eq!(
            r.status.as_u16(),
            want,
            "malformed X-Forwarded-For {xff:?} counts against 127.0.0.1"
        );
    }

    // An untrusted peer's own forwarding header is replaced by what the gateway saw; a
    // trusted one's is appended to.
    let seen = upstream.seen();
    let first = &seen[0].headers;
    assert_eq!(
        first["x-forwarded-for"], "127.0.0.2",
        "an untrusted peer's X-Forwarded-For is replaced by the peer"
    );
    let from_trusted = seen
        .iter()
        .find(|s| s.headers["x-forwarded-for"] != "127.0.0.2")
        .expect("requests from the trusted peer were forwarded");
    assert!(
        from_trusted.headers["x-forwarded-for"]
            .to_str()
            .unwrap()
            .ends_with(", 127.0.0.1"),
        "a trusted peer is appended: {:?}",
        from_trusted.headers["x-forwarded-for"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ratelimit_headers_are_structured_fields_that_match_the_bucket() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    for store in [
        Store::Memory,
        Store::Redis {
            url: redis.url(),
            on_error: "deny",
            timeout: "3s",
        },
    ] {
        let upstream = Upstream::start().await;
        // `day` refills one token in 86.4 s: nothing comes back during the test, so what a
        // request takes from it (or does not) shows exactly, however slow the machine.
        let gw = Gateway::start(&format!(
            "{}[[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"10/m\"\nburst = 4\n\
             [[rules]]\nname = \"site\"\nkey = \"global\"\nrate = \"100/10s\"\nburst = 50\n\
             [[rules]]\nname = \"day\"\nkey = \"global\"\nrate = \"1000/d\"\n",
            upstream_and_store(&upstream.url(), &store)
        ));
        let client = HttpClient::new();
        // `api` and `site` refill while the test runs (a token each 6 s, each 100 ms): how
        // many can have come back is bounded by the time since before the first request.
        let start = Instant::now();
        let refilled = |per: Duration| (start.elapsed().as_millis() / per.as_millis()) as i64;
        for n in 1..=4i64 {
            let r = client.get(&gw.url("/x"), &[("x-api-key", "hdr-key")]).await;
            let (api_back, site_back) = (
                refilled(Duration::from_secs(6)),
                refilled(Duration::from_millis(100)),
            );
            assert_eq!(r.status, StatusCode::OK);
            let policy = sf_list(r.header("ratelimit-policy").expect("RateLimit-Policy"));
            assert_eq!(policy.len(), 3);
            // A bucket advertises its burst, and the time its rate refills it from empty:
            // 4 at 10/m in 24 s, 50 at 100/10s in 5 s; without a burst, N per period.
            assert_eq!(policy[0].0, "api");
            assert_eq!((int(&policy[0].1, "q"), int(&policy[0].1, "w")), (4, 24));
            assert_eq!(policy[1].0, "site");
            assert_eq!((int(&policy[1].1, "q"), int(&policy[1].1, "w")), (50, 5));
            assert_eq!(policy[2].0, "day");
            assert_eq!(
                (int(&policy[2].1, "q"), int(&policy[2].1, "w")),
                (1000, 86_400)
            );
            let state = sf_list(r.header("ratelimit").expect("RateLimit"));
            for ((name, p), (_, st)) in policy.iter().zip(&state) {
                assert!(int(st, "r") <= int(p, "q"), "{name}: r above q");
            }
            assert_eq!(state[0].0, "api");
            let api_r = int(&state[0].1, "r");
            assert!(
                (4 - n..=(4 - n + api_back).min(4)).contains(&api_r),
                "api: r={api_r} after {n} requests, {api_back} tokens back at most"
            );
            // 10/m: a token takes 6 s to come back, so with `4 - r` missing the bucket is
            // full in more than 6 (4 - r) - 6 and at most 6 (4 - r) seconds.
            let t = int(&state[0].1, "t");
            let missing = 4 - api_r;
            assert!(
                (6 * missing - 5..=6 * missing).contains(&t),
                "api: t={t} with r={api_r} after {n} requests"
            );
            let site_r = int(&state[1].1, "r");
            assert!(
                (50 - n..=(50 - n + site_back).min(50)).contains(&site_r),
                "site: r={site_r} after {n} requests, {site_back} tokens back at most"
            );
            assert_eq!(
                int(&state[1].1, "t"),
                i64::from(site_r < 50),
                "100/10s: at most 4 missing tokens come back within 0.4 s, rounded up to 1"
            );
            assert_eq!(int(&state[2].1, "r"), 1000 - n, "day after request {n}");
        }
        let r = client.get(&gw.url("/x"), &[("x-api-key", "hdr-key")]).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        let state = sf_list(r.header("ratelimit").expect("RateLimit on a 429"));
        assert_eq!(int(&state[0].1, "r"), 0);
        assert_eq!(
            int(&state[2].1, "r"),
            996,
            "a denied request took nothing from the day rule"
        );
        let retry: u64 = r
            .header("retry-after")
            .expect("Retry-After")
            .parse()
            .expect("whole seconds");
        assert!(
            (1..=6).contains(&retry),
            "a token comes back within 6 s: {retry}"
        );
        let body = r.json();
        assert_eq!(body["status"], 429);
        assert_eq!(body["violated-policies"], serde_json::json!(["api"]));
        assert_eq!(body["retry_after"], retry);
        assert_eq!(upstream.seen().len(), 4);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_and_both_header_styles() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    for (style, draft, legacy) in [
        ("legacy", false, true),
        ("both", true, true),
        ("none", false, false),
    ] {
        let gw = Gateway::start(&format!(
            "{}[response]\nheaders = \"{style}\"\n{}",
            upstream_and_store(&upstream.url(), &Store::Memory),
            api_rule(3)
        ));
        let r = HttpClient::new()
            .get(&gw.url("/"), &[("x-api-key", "k")])
            .await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("ratelimit").is_some(), draft, "{style}");
        assert_eq!(r.header("ratelimit-policy").is_some(), draft, "{style}");
        // The limit is the bucket's burst, as `q` is: what `remaining` counts down from.
        assert_eq!(
            r.header("ratelimit-limit"),
            legacy.then_some("3"),
            "{style}"
        );
        assert_eq!(
            r.header("ratelimit-remaining"),
            legacy.then_some("2"),
            "{style}"
        );
        assert_eq!(
            r.header("ratelimit-reset"),
            legacy.then_some("3600"),
            "{style}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_deny_answers_503_fast_and_limiting_resumes_when_it_is_back() {
    let _watch = common::watchdog();
    let _serial = serial().await;
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = Store::Redis {
        url: redis.url(),
        on_error: "deny",
        timeout: "100ms",
    };
    let gw = Gateway::start(&format!(
        "{}{}",
        upstream_and_store(&upstream.url(), &store),
        api_rule(3)
    ));
    let client = HttpClient::new();
    let url = gw.url("/a");
    assert_eq!(
        client.get(&url, &[("x-api-key", "k")]).await.status,
        StatusCode::OK
    );

    redis.kill();
    for _ in 0..5 {
        let start = Instant::now();
        let r = client.get(&url, &[("x-api-key", "k")]).await;
        let took = start.elapsed();
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", gw.logs());
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        // The store timeout (100 ms) bounds the wait on a dead Redis: an answer within
        // WAIT (10 s, room for any load) is not a wait on a reconnect (the client gives up
        // after 30 s).
        assert!(took < common::WAIT, "503 took {took:?}");
    }
    let ready = client.get(&gw.admin_url("/readyz"), &[]).await;
    assert_eq!(
        ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "not ready while Redis is down"
    );

    redis.restart();
    // The gateway reconnects by itself: no restart.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut status = StatusCode::SERVICE_UNAVAILABLE;
    while Instant::now() < deadline {
        status = client.get(&url, &[("x-api-key", "k")]).await.status;
        if status == StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        status,
        StatusCode::OK,
        "Redis is back, requests pass again\n{}",
        gw.logs()
    );
    // And limits hold again (Redis restarted empty: a fresh bucket of 3, one used above).
    let statuses: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(
                client
                    .get(&url, &[("x-api-key", "k")])
                    .await
                    .status
                    .as_u16(),
            );
        }
        v
    };
    assert_eq!(statuses, vec![200, 200, 429]);
    assert_eq!(
        client.get(&gw.admin_url("/readyz"), &[]).await.status,
        StatusCode::OK
    );
    let logs = gw.logs();
    assert_eq!(
        logs.matches("store failing").count(),
        1,
        "the outage is logged once:\n{logs}"
    );
    assert!(logs.matches("store answers again").count() == 1, "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_allow_forwards_unlimited() {
    let _watch = common::watchdog();
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = Store::Redis {
        url: redis.url(),
        on_error: "allow",
        timeout: "100ms",
    };
    let gw = Gateway::start(&format!(
        "{}{}",
        upstream_and_store(&upstream.url(), &store),
        api_rule(1)
    ));
    let client = HttpClient::new();
    let url = gw.url("/a");
    assert_eq!(
        client.get(&url, &[("x-api-key", "k")]).await.status,
        StatusCode::OK
    );
    assert_eq!(
        client.get(&url, &[("x-api-key", "k")]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    redis.kill();
    // "k" was denied with an hour to wait: that denial is still true, and the gateway
    // remembers it (the deny cache) without asking Redis.
    let r = client.get(&url, &[("x-api-key", "k")]).await;
    assert_eq!(
        r.status,
        StatusCode::TOO_MANY_REQUESTS,
        "a known denial stands"
    );
    for _ in 0..3 {
        let r = client.get(&url, &[("x-api-key", "other")]).await;
        assert_eq!(r.status, StatusCode::OK, "on_error = allow forwards");
        assert_eq!(r.header("x-upstream"), Some("yes"));
        assert!(
            r.header("ratelimit").is_none(),
            "no limit was applied, so none is advertised"
        );
    }
    assert_eq!(
        client.get(&gw.admin_url("/readyz"), &[]).await.status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_redis_key_has_a_ttl_and_no_key_name_holds_an_api_key() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}[[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"5/m\"\n\
         [[rules]]\nname = \"ip\"\nkey = \"client_ip\"\nrate = \"100/h\"\n",
        upstream_and_store(&upstream.url(), &Store::redis(&redis))
    ));
    let client = HttpClient::new();
    let secrets = [
        "sk_live_secret_0001",
        "sk_live_secret_0002",
        "sk_live_secret_0003",
    ];
    for s in secrets {
        for _ in 0..2 {
            assert_eq!(
                client.get(&gw.url("/"), &[("x-api-key", s)]).await.status,
                StatusCode::OK
            );
        }
    }
    let mut conn = redis.conn();
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).expect("KEYS");
    // The deployment's identity tag secret is no limit's state: it lives as long as the
    // deployment (as the key directory does), and holds no API key.
    let secret = format!("{}:tag-secret", common::PREFIX);
    assert!(keys.contains(&secret), "{keys:?}");
    let kept: String = redis::cmd("GET")
        .arg(&secret)
        .query(&mut conn)
        .expect("GET");
    assert!(secrets.iter().all(|s| !kept.contains(s)));
    keys.retain(|k| *k != secret);
    assert_eq!(keys.len(), 4, "3 API keys + 1 client IP: {keys:?}");
    for s in secrets {
        let want = redis_key(s, "api");
        assert!(
            keys.contains(&want),
            "{s}'s key is {want} (CONTRACT.md's layout): {keys:?}"
        );
    }
    for k in &keys {
        let ttl: i64 = redis::cmd("PTTL").arg(k).query(&mut conn).expect("PTTL");
        assert!(ttl > 0, "{k} has no TTL ({ttl})");
        let max = if k.ends_with(":api") {
            2 * 12_000
        } else {
            6 * 36_000
        };
        assert!(
            ttl <= max,
            "{k}: TTL {ttl} ms is longer than the time to full refill {max} ms"
        );
        for s in secrets {
            assert!(!k.contains(s), "{k} contains an API key");
        }
        assert!(
            k.starts_with("rwtest:{") && k.contains("}:"),
            "{k} is <prefix>:{{<hash>}}:<rule>"
        );
    }
    let logs = gw.logs();
    for s in secrets {
        assert!(!logs.contains(s), "the log holds an API key");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_never_reach_the_upstream() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}{}",
        upstream_and_store(&upstream.url(), &Store::Memory),
        api_rule(5)
    ));
    let answer = raw_exchange(
        gw.port,
        b"GET /hop HTTP/1.1\r\nHost: app.example\r\nX-Api-Key: k\r\n\
          Connection: close, X-Secret-Hop, x-other-hop\r\nX-Secret-Hop: 1\r\nX-Other-Hop: 2\r\n\
          Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nTE: trailers\r\nX-End-To-End: kept\r\n\r\n",
    )
    .await
    .text;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    let h = &seen[0].headers;
    for gone in [
        "x-secret-hop",
        "x-other-hop",
        "keep-alive",
        "proxy-connection",
        "te",
    ] {
        assert!(h.get(gone).is_none(), "{gone} reached the upstream: {h:?}");
    }
    assert_eq!(h["x-end-to-end"], "kept");
    assert_eq!(h["host"], "app.example", "the client's Host is kept");
    assert_eq!(h["x-forwarded-host"], "app.example");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    let lower = answer.to_ascii_lowercase();
    assert!(lower.contains("x-upstream: yes"), "{answer}");
    assert!(
        !lower.contains("x-upstream-hop"),
        "the upstream's Connection-named header came back: {answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_body_streams_to_the_upstream_without_buffering() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream_and_store(&upstream.url(), &Store::Memory));
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", gw.port))
        .await
        .expect("connect");
    s.write_all(b"POST /stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n10\r\n0123456789abcdef\r\n")
        .await
        .expect("write head and first chunk");
    // The upstream must see the first chunk while the client still holds back the rest:
    // a gateway that buffered the body would wait for the end and time out here.
    tokio::time::timeout(Duration::from_secs(10), upstream.first_chunk())
        .await
        .expect("the first chunk reached the upstream before the body was complete");
    let chunk = vec![b'z'; 1 << 16];
    for _ in 0..64 {
        s.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
            .await
            .expect("chunk size");
        s.write_all(&chunk).await.expect("chunk");
        s.write_all(b"\r\n").await.expect("chunk end");
    }
    s.write_all(b"0\r\n\r\n").await.expect("last chunk");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("answer")
        .expect("read");
    let answer = String::from_utf8_lossy(&out);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains(&format!("ok {}", 16 + 64 * (1 << 16))),
        "the whole body arrived: {answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_refused_is_502_and_slow_is_504() {
    let _watch = common::watchdog();
    let refusing = common::RefusingPort::new();
    let dead = refusing.url();
    let gw = Gateway::start(&upstream_and_store(&dead, &Store::Memory));
    let r = HttpClient::new().get(&gw.url("/"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.json()["status"], 502);

    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "[upstream]\nurl = \"{}\"\ntimeout = \"300ms\"\n",
        upstream.url()
    ));
    let client = HttpClient::new();
    let start = Instant::now();
    // The upstream would answer after 20 s: a 504 within WAIT (10 s) is the 300 ms
    // timeout's, with room for any load.
    let r = client.get(&gw.url("/slow/20000"), &[]).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.json()["status"], 504);
    assert!(
        start.elapsed() < common::WAIT,
        "504 after {:?}",
        start.elapsed()
    );
    // A fast request right after is unaffected.
    assert_eq!(
        client.get(&gw.url("/fast"), &[]).await.status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_and_unknown_keys_and_plans() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let base = upstream_and_store(&upstream.url(), &Store::Memory);
    let client = HttpClient::new();

    let gw = Gateway::start(&format!("{base}{}", api_rule(2)));
    let r = client.get(&gw.url("/"), &[]).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let r = client
        .get(&gw.url("/"), &[("x-api-key", "a"), ("x-api-key", "b")])
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "two keys are ambiguous");

    let gw = Gateway::start(&format!(
        "{base}[[rules]]\nname = \"api\"\nkey = \"api_key\"\nmissing_key = \"client_ip\"\nrate = \"1/h\"\nburst = 2\n"
    ));
    let codes: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(client.get(&gw.url("/"), &[]).await.status.as_u16());
        }
        v
    };
    assert_eq!(
        codes,
        vec![200, 200, 429],
        "keyless requests are counted by client IP"
    );

    let gw = Gateway::start(&format!(
        "{base}[keys]\nunknown = \"reject\"\n[keys.plans]\n\"pro-key\" = \"pro\"\n\"free-key\" = \"free\"\n\
         [[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"1/h\"\nburst = 2\n[rules.plans.pro]\nburst = 5\n\
         [rules.plans.free]\n"
    ));
    assert_eq!(
        client
            .get(&gw.url("/"), &[("x-api-key", "stranger")])
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
    for (key, passes) in [("free-key", 2), ("pro-key", 5)] {
        let mut ok = 0;
        for _ in 0..8 {
            if client.get(&gw.url("/"), &[("x-api-key", key)]).await.status == StatusCode::OK {
                ok += 1;
            }
        }
        assert_eq!(ok, passes, "{key}");
    }
}

/// Keyed clients by key, anonymous clients by IP: the issue's operator saw a per-IP 300/min
/// ceiling cap a pro key behind one address (277 of 320). With `api_key = "absent"` on the
/// per-IP rule, the pro key gets all 320 and anonymous clients still get exactly 300.
/// (300 an hour here: the memory store's sliding windows are whole minutes of the clock,
/// as Redis' are, and a minute's edge within the run would let one more through 0.2 s
/// later; an hour's lets none through for 12 s, longer than the run.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_ip_ceiling_for_anonymous_clients_leaves_keyed_ones_to_their_plan() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}[keys]\nunknown = \"reject\"\n[keys.plans]\n\"pro-key\" = \"pro\"\n\
         [[rules]]\nname = \"per-ip\"\nkey = \"client_ip\"\nalgorithm = \"sliding_window\"\nrate = \"300/h\"\n\
         match = {{ api_key = \"absent\" }}\n\
         [[rules]]\nname = \"api\"\nkey = \"api_key\"\nmatch = {{ api_key = \"present\" }}\nrate = \"10/s\"\nburst = 20\n\
         [rules.plans.pro]\nrate = \"100/s\"\nburst = 400\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let client = HttpClient::new();
    let url = gw.url("/api/orders");
    let mut pro = Vec::new();
    for _ in 0..320 {
        pro.push(client.get(&url, &[("x-api-key", "pro-key")]).await.status);
    }
    assert_eq!(
        tally(pro),
        [(200, 320)].into_iter().collect(),
        "{}",
        gw.logs()
    );
    let mut anonymous = Vec::new();
    for _ in 0..301 {
        anonymous.push(client.get(&url, &[]).await.status);
    }
    assert_eq!(
        tally(anonymous),
        [(200, 300), (429, 1)].into_iter().collect()
    );
    let r = client.get(&url, &[("x-api-key", "made-up")]).await;
    assert_eq!(
        r.status,
        StatusCode::UNAUTHORIZED,
        "an unknown key is not \"present\""
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_apply_by_path_prefix_and_method() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}[[rules]]\nname = \"api\"\nmatch = {{ path_prefix = \"/api/\", methods = [\"GET\"] }}\nkey = \"global\"\nrate = \"1/h\"\nburst = 1\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let client = HttpClient::new();
    let r = client
        .send("POST", &gw.url("/api/x"), &[], Bytes::from_static(b"{}"))
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        r.header("ratelimit").is_none(),
        "POST is not limited by a GET rule"
    );
    assert!(client
        .get(&gw.url("/other"), &[])
        .await
        .header("ratelimit")
        .is_none());
    assert_eq!(
        client.get(&gw.url("/api/x"), &[]).await.status,
        StatusCode::OK
    );
    assert_eq!(
        client.get(&gw.url("/api/y"), &[]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Dot segments and doubled slashes do not dodge the prefix.
    for path in ["/x/../api/y", "//api/y", "/%61pi/y"] {
        let answer = raw_exchange(
            gw.port,
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(answer.status, 429, "{path}: {}", answer.text);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_clients_are_served() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}{}",
        upstream_and_store(&upstream.url(), &Store::Memory),
        api_rule(2)
    ));
    let client = HttpClient::h2();
    let r = client.get(&gw.url("/h2"), &[("x-api-key", "k")]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("ratelimit"), Some("\"api\";r=1;t=3600"));
    assert_eq!(
        client
            .get(&gw.url("/h2"), &[("x-api-key", "k")])
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        client
            .get(&gw.url("/h2"), &[("x-api-key", "k")])
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
    let seen = upstream.seen();
    assert_eq!(
        seen[0].headers["x-forwarded-host"],
        format!("127.0.0.1:{}", gw.port)
    );
}

/// `len` bytes that differ from one `seed` to the next.
fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u8).wrapping_mul(31).wrapping_add(seed as u8) ^ (j >> 8) as u8)
        .collect()
}

/// Many HTTP/2 streams on one connection, each uploading its own body in several DATA
/// frames at the same time: every stream gets its own answer, the limit counts each stream
/// once, and the upstream receives each admitted body whole and unmixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_http2_streams_with_bodies_are_each_answered_and_arrive_whole() {
    let _watch = common::watchdog();
    const STREAMS: usize = 64;
    const DENIED: usize = 4;
    // Several 16 KiB DATA frames each, and a length no two frames split alike.
    const LEN: usize = 3 * 16 * 1024 + 7;
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}{}",
        upstream_and_store(&upstream.url(), &Store::Memory),
        api_rule((STREAMS - DENIED) as u64)
    ));
    // One TCP connection, one HTTP/2 handshake: every stream below shares it.
    let tcp = common::connect(gw.port).await;
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("HTTP/2 handshake with the gateway");
    let conn = tokio::spawn(conn);
    let url = gw.url("/upload");
    let tasks: Vec<_> = (0..STREAMS)
        .map(|i| {
            let (mut sender, url) = (sender.clone(), url.clone());
            tokio::spawn(async move {
                sender.ready().await.expect("the connection takes streams");
                let (tx, body) = common::channel_body();
                let req = http::Request::post(url)
                    .header("x-api-key", "h2-bodies")
                    .header("x-stream", i.to_string())
                    .body(body)
                    .expect("request");
                let answer = sender.send_request(req);
                let upload = async move {
                    // Frame by frame, yielding between frames so the streams interleave.
                    for piece in pattern(i, LEN).chunks(10_000) {
                        if !tx.send(Bytes::copy_from_slice(piece)).await {
                            break; // answered before the whole body was sent (a 429)
                        }
                        tokio::task::yield_now().await;
                    }
                };
                let (answer, ()) = tokio::join!(answer, upload);
                let answer = answer.unwrap_or_else(|e| panic!("stream {i}: {e}"));
                let status = answer.status();
                let body = answer
                    .into_body()
                    .collect()
                    .await
                    .unwrap_or_else(|e| panic!("stream {i}: body: {e}"))
                    .to_bytes();
                (i, status, body)
            })
        })
        .collect();
    let mut passed = std::collections::BTreeSet::new();
    let mut statuses = Vec::new();
    for t in tasks {
        let (i, status, body) = tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("every stream is answered within 30 s")
            .expect("stream task");
        statuses.push(status);
        if status == StatusCode::OK {
            assert_eq!(&body[..], format!("ok {LEN}\n").as_bytes(), "stream {i}");
            passed.insert(i);
        }
    }
    let counts = tally(statuses);
    assert_eq!(
        (counts.get(&200), counts.get(&429)),
        (Some(&(STREAMS - DENIED)), Some(&DENIED)),
        "each stream counted once against a burst of {}: {counts:?}\n{}",
        STREAMS - DENIED,
        gw.logs()
    );
    let seen = upstream.seen();
    assert_eq!(
        seen.len(),
        STREAMS - DENIED,
        "only admitted streams were forwarded"
    );
    let mut forwarded = std::collections::BTreeSet::new();
    for s in &seen {
        let i: usize = s.headers["x-stream"]
            .to_str()
            .ok()
            .and_then(|v| v.parse().ok())
            .expect("x-stream reached the upstream");
        assert_eq!(s.body_len, LEN, "stream {i}'s body length at the upstream");
        assert_eq!(
            s.body_hash,
            common::fnv1a(common::FNV_START, &pattern(i, LEN)),
            "stream {i}'s body arrived with other bytes than were sent"
        );
        forwarded.insert(i);
    }
    assert_eq!(
        forwarded, passed,
        "the streams answered 200 are the ones forwarded"
    );
    assert!(
        !conn.is_finished(),
        "the connection stayed up for all the streams"
    );
}

#[test]
fn check_validates_and_a_bad_file_stops_startup() {
    let _watch = common::watchdog();
    let bin = env!("CARGO_BIN_EXE_ratewall");
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/config/limits.toml");
    let out = std::process::Command::new(bin)
        .args(["check", "--config", shipped])
        .output()
        .expect("run check");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("valid") && text.contains("api: 10/s burst 20"),
        "{text}"
    );
    assert!(
        !text.contains("demo-pro-key"),
        "check never prints API keys"
    );

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n[[rules]]\nname = \"a\"\nkey = \"global\"\nrate = \"ten/s\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(bin)
        .args(["check", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.toml:8:8: rules[0].rate:"), "{err}");

    // Running with a bad file exits 1 before binding.
    let port = common::free_port();
    std::fs::write(
        &bad,
        format!("[server]\nlisten = \"127.0.0.1:{port}\"\nlisten_twice = 1\n[upstream]\nurl = \"http://127.0.0.1:2\"\n"),
    )
    .unwrap();
    let out = std::process::Command::new(bin)
        .arg("--config")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("server.listen_twice"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_identity_counts_by_that_header() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}[[rules]]\nname = \"tenant\"\nkey = \"header:x-tenant\"\nrate = \"1/h\"\nburst = 1\n",
        upstream_and_store(&upstream.url(), &Store::Memory)
    ));
    let client = HttpClient::new();
    let url = gw.url("/");
    assert_eq!(
        client.get(&url, &[("x-tenant", "acme")]).await.status,
        StatusCode::OK
    );
    assert_eq!(
        client.get(&url, &[("x-tenant", "acme")]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        client.get(&url, &[("x-tenant", "globex")]).await.status,
        StatusCode::OK
    );
    assert_eq!(
        client.get(&url, &[]).await.status,
        StatusCode::UNAUTHORIZED,
        "missing header, missing_key = reject"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_flushed_from_redis_are_loaded_again() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}{}",
        upstream_and_store(&upstream.url(), &Store::redis(&redis)),
        api_rule(3)
    ));
    let client = HttpClient::new();
    let url = gw.url("/");
    assert_eq!(
        client.get(&url, &[("x-api-key", "k")]).await.status,
        StatusCode::OK
    );
    let mut conn = redis.conn();
    let loads = |conn: &mut redis::Connection| command_calls(conn, "script|load");
    // Loaded once at least: at start (both scripts), or at first use.
    let before = loads(&mut conn);
    assert!(before >= 1, "the script was loaded before the flush");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut conn)
        .expect("SCRIPT FLUSH");
    // EVALSHA now answers NOSCRIPT; the gateway loads the script again and carries on.
    let r = client.get(&url, &[("x-api-key", "k")]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", gw.logs());
    assert_eq!(r.header("ratelimit"), Some("\"api\";r=1;t=7200"));
    assert_eq!(
        loads(&mut conn),
        before + 1,
        "the decision script was loaded again after the flush"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hammering_one_key_costs_redis_almost_nothing() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&format!(
        "{}{}",
        upstream_and_store(&upstream.url(), &Store::redis(&redis)),
        api_rule(5)
    ));
    let client = HttpClient::new();
    let url = gw.url("/a");
    for _ in 0..5 {
        assert_eq!(
            client.get(&url, &[("x-api-key", "abuser")]).await.status,
            StatusCode::OK
        );
    }
    let before = evalsha_calls(&redis);
    for _ in 0..300 {
        let r = client.get(&url, &[("x-api-key", "abuser")]).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(r.header("retry-after").is_some());
        assert!(r
            .header("ratelimit")
            .is_some_and(|h| h.starts_with("\"api\";r=0;")));
    }
    let calls = evalsha_calls(&redis) - before;
    assert!(
        calls <= 3,
        "{calls} Redis calls for 300 denied requests (at most 0.01 each)"
    );
    // Another key is decided by Redis as usual.
    assert_eq!(
        client
            .get(&url, &[("x-api-key", "someone-else")])
            .await
            .status,
        StatusCode::OK
    );
    assert!(evalsha_calls(&redis) > before + calls);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_denial_ends_at_its_retry_time() {
    let _watch = common::watchdog();
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    // 2/s, burst 1: after one request the next token is 500 ms away.
    let gw = Gateway::start(&format!(
        "{}[[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"2/s\"\nburst = 1\n",
        upstream_and_store(&upstream.url(), &Store::redis_roomy(&redis))
    ));
    let client = HttpClient::new();
    let url = gw.url("/a");
    let token_back = Duration::from_millis(500);
    for round in 0..3 {
        // The token comes back 500 ms after the allowed request was decided, which is after
        // `sent`: a request answered before `sent + 500 ms` was decided before that and must
        // be denied (by the cache or by Redis); one answered later may pass, and is left out.
        let sent = Instant::now();
        assert_eq!(
            client.get(&url, &[("x-api-key", "k")]).await.status,
            StatusCode::OK,
            "round {round}: the token is back"
        );
        let answered = Instant::now();
        let mut denied = 0;
        for _ in 0..5 {
            let status = client.get(&url, &[("x-api-key", "k")]).await.status;
            if sent.elapsed() >= token_back {
                break;
            }
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "round {round}");
            denied += 1;
        }
        assert!(
            denied > 0,
            "round {round}: not one request was answered within 500 ms of the last pass"
        );
        // Wait out the retry time, counted from the pass's answer (it was decided before
        // that), then the store, not the cache, decides (real time on purpose: the token
        // comes back on the gateway's and Redis' clocks).
        let wait = (token_back + Duration::from_millis(20)).saturating_sub(answered.elapsed());
        tokio::time::sleep(wait).await;
    }
}
