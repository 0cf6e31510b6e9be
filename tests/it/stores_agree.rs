//! The memory store (Rust step functions) and the Redis store (`lua/token_bucket.lua`) are
//! twins: on the same timeline they must give the same decision, field for field. These
//! tests drive both with one clock against a real redis-server, and check what the Redis
//! store leaves behind: TTLs, key names, and how it survives bad keys and restarts.

use crate::common;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::num::NonZeroU64;
use std::time::{Duration, Instant};

use common::{get, pttl, scan, RedisServer};
use ratewall::identity::{digest_api_key, digest_ip, IdentityDigest};
use ratewall::limiter::memory::MemoryStore;
use ratewall::limiter::redis::{DecideAt, RedisStore};
use ratewall::limiter::{Algorithm, Check, Decision, ManualClock, Quota, Rate, StoreError};

/// A realistic µs epoch (late 2023), so the times the script sees look like Redis `TIME`.
const EPOCH_US: u64 = 1_700_000_000_000_000;

const PREFIX: &str = "rwtest";

fn quota(rate: &str, burst: Option<u64>, cost: u64) -> Quota {
    Quota::new(
        Algorithm::TokenBucket,
        Rate::parse(rate).unwrap_or_else(|e| panic!("rate {rate}: {e}")),
        burst.map(|b| NonZeroU64::new(b).expect("burst > 0")),
        NonZeroU64::new(cost).expect("cost > 0"),
    )
    .unwrap_or_else(|e| panic!("quota {rate}: {e}"))
}

fn redis_store(server: &RedisServer, timeout: Duration) -> RedisStore {
    RedisStore::new(&server.url(), PREFIX, timeout).expect("RedisStore::new")
}

/// A small deterministic generator (xorshift64*), so a failing timeline replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-ish in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Microseconds for the bucket to refill from empty to full.
fn full_refill_us(q: &Quota) -> u64 {
    q.capacity().div_ceil(q.per_us)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_redis_agree_on_every_decision() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let mut conn = server.conn();
    let redis_store = redis_store(&server, Duration::from_secs(5));
    let clock = ManualClock::new(EPOCH_US);
    let memory = MemoryStore::new(clock.clone());

    // Redis expires keys on its own wall clock while the timeline runs on virtual time, far
    // faster. A key must not vanish in real time before the timeline has refilled it, so
    // every quota here keeps its state for at least 300 ms after any charge (cost x one
    // token's time), which is far longer than the few ms of real time between two requests
    // on the same bucket. (That is also why "1000/m" is used with cost 5: one token alone
    // refills in 60 ms.)
    let rules: Vec<(&str, Quota)> = vec![
        ("r3s_b1", quota("3/s", Some(1), 1)),
        ("r3s", quota("3/s", None, 1)),
        ("r7_10s", quota("7/10s", None, 1)),
        ("r7_3s_b2", quota("7/3s", Some(2), 1)),
        ("r1000m_b20_c5", quota("1000/m", Some(20), 5)),
        ("r2s_b4_c2", quota("2/s", Some(4), 2)),
        ("r100s_c40", quota("100/s", None, 40)),
        ("r1m_b3_c3", quota("1/m", Some(3), 3)),
    ];
    for (name, q) in &rules {
        assert!(
            q.need().div_ceil(q.per_us) >= 300_000,
            "{name}: a charge must be remembered for at least 300 ms of real time"
        );
    }
    // Rates that do not divide a second leave per_us > 1 or an odd unit: make sure the
    // timeline really has them.
    assert!(rules
        .iter()
        .any(|(_, q)| q.per_us > 1 && 1_000_000 % q.rate.count != 0));

    let identities: Vec<IdentityDigest> = vec![
        digest_api_key(b"key-alpha"),
        digest_api_key(b"key-bravo"),
        digest_api_key(b"key-charlie"),
        digest_ip(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))),
        digest_ip(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 77))),
        digest_ip(IpAddr::V6(Ipv6Addr::LOCALHOST)),
    ];

    const REQUESTS: usize = 3_600;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut now = EPOCH_US;
    // (identity, rule) -> (time, decision) of the last request that checked it.
    let mut last: HashMap<(usize, usize), (u64, Decision)> = HashMap::new();

    let (mut checks_allowed, mut checks_denied) = (0usize, 0usize);
    let (mut requests_allowed, mut requests_denied) = (0usize, 0usize);
    let mut multi_requests = 0usize;
    // A rule said yes but another said no, so the yes was not charged.
    let mut uncharged_yes = 0usize;
    // A request sent exactly when the previous denial said to retry, and allowed.
    let mut allowed_on_retry_boundary = 0usize;
    // One µs before that instant, and still denied.
    let mut denied_just_before_boundary = 0usize;
    let mut long_gaps = 0usize;
    let max_refill = rules.iter().map(|(_, q)| full_refill_us(q)).max().unwrap();

    let mut hot = (0, 0);
    for i in 0..REQUESTS {
        // Which buckets this request is checked against. Clients come in streaks: most requests hit the bucket the previous one did.
        if i == 0 || rng.below(100) < 35 {
            hot = (rng.below(identities.len()), rng.below(rules.len()));
        }
        let (id, rule) = hot;
        let mut targets = vec![(id, rule)];
        let roll = rng.below(100);
        if roll < 35 {
            // Two rules at once: mostly the same identity under another rule, sometimes
            // another identity (a per-IP and a per-key rule on one request).
            let other_rule = (rule + 1 + rng.below(rules.len() - 1)) % rules.len();
            let other_id = if rng.below(4) == 0 {
                rng.below(identities.len())
            } else {
                id
            };
            targets.push((other_id, other_rule));
            if roll < 5 {
                let third = (other_rule + 1 + rng.below(rules.len() - 1)) % rules.len();
                if third != rule {
                    targets.push((id, third));
                }
            }
        }

        // When it happens.
        let mut boundary: Option<u64> = None;
        match rng.below(100) {
            0..=39 => {}                                 // same instant: a burst
            40..=64 => now += rng.range(1, 2_000),       // a few µs to 2 ms
            65..=81 => now += rng.range(2_000, 700_000), // up to 0.7 s
            82..=87 => {
                // Longer than any bucket's full refill.
                now += rng.range(max_refill, 3 * max_refill);
                long_gaps += 1;
            }
            _ => {
                // Exactly at (or 1 µs before) the instant the last denial of this bucket
                // named, when that is still ahead.
                if let Some(&(t, d)) = last.get(&targets[0]) {
                    if !d.allowed {
                        let at = t + d.retry_after_us - rng.range(0, 1);
                        if at > now {
                            now = at;
                            boundary = Some(t + d.retry_after_us);
                        }
                    }
                }
            }
        }

        let checks: Vec<Check<'_>> = targets
            .iter()
            .map(|&(id, rule)| Check::new(&identities[id], rules[rule].0, &rules[rule].1))
            .collect();

        clock.set(now);
        let from_memory = memory.decide(&checks).expect("the memory store has room");
        let from_redis = redis_store
            .decide_at(&checks, Some(now))
            .await
            .unwrap_or_else(|e| panic!("request {i}: redis store failed: {e}"));
        if from_memory != from_redis {
            let state: Vec<String> = checks
                .iter()
                .map(|c| {
                    let k = redis_store.key(c);
                    format!(
                        "{} ({}) = {:?} pttl {}",
                        k,
                        c.quota,
                        get(&mut conn, &k),
                        pttl(&mut conn, &k)
                    )
                })
                .collect();
            panic!(
                "request {i} at t={now} (+{} µs from start) checking {targets:?}: the stores disagree\n memory: {from_memory:?}\n  redis: {from_redis:?}\n redis state after: {state:#?}",
                now - EPOCH_US
            );
        }
        assert_eq!(
            from_memory.len(),
            checks.len(),
            "request {i}: one decision per check"
        );

        let all = from_memory.iter().all(|d| d.allowed);
        for (d, c) in from_memory.iter().zip(&checks) {
            // The decisions must also be sane on their own, not only equal.
            assert!(
                d.remaining <= c.quota.burst,
                "request {i}: {d:?} above burst"
            );
            assert!(
                d.reset_us <= full_refill_us(c.quota),
                "request {i}: {d:?} reset beyond a full refill"
            );
            if d.allowed {
                checks_allowed += 1;
                assert_eq!(d.retry_after_us, 0, "request {i}: allowed with a retry");
                if !all {
                    uncharged_yes += 1;
                }
            } else {
                checks_denied += 1;
                assert!(d.retry_after_us > 0, "request {i}: denied without a retry");
            }
        }
        if all {
            requests_allowed += 1;
        } else {
            requests_denied += 1;
        }
        if checks.len() > 1 {
            multi_requests += 1;
        }
        if let Some(b) = boundary {
            let d = from_memory[0];
            if now == b {
                // At the named instant the bucket holds enough for this request.
                assert!(
                    d.allowed,
                    "request {i}: denied at its own retry instant: {d:?}"
                );
                allowed_on_retry_boundary += 1;
            } else {
                assert!(
                    !d.allowed,
                    "request {i}: allowed 1 µs before its retry instant"
                );
                assert_eq!(d.retry_after_us, 1, "request {i}: {d:?}");
                denied_just_before_boundary += 1;
            }
        }
        for (&t, d) in targets.iter().zip(&from_memory) {
            last.insert(t, (now, *d));
        }
    }

    let checks_total = checks_allowed + checks_denied;
    eprintln!(
        "{REQUESTS} requests ({multi_requests} multi-rule, {long_gaps} long gaps) over {} s: \
         requests {requests_allowed} allowed / {requests_denied} denied; \
         checks {checks_allowed} allowed / {checks_denied} denied; \
         {uncharged_yes} uncharged yes; retry boundary {allowed_on_retry_boundary} at / \
         {denied_just_before_boundary} before",
        (now - EPOCH_US) / 1_000_000
    );
    assert!(
        checks_allowed * 10 >= checks_total,
        "too few allowed decisions"
    );
    assert!(
        checks_denied * 10 >= checks_total,
        "too few denied decisions"
    );
    assert!(
        requests_allowed * 10 >= REQUESTS,
        "too few allowed requests"
    );
    assert!(requests_denied * 10 >= REQUESTS, "too few denied requests");
    assert!(
        multi_requests >= REQUESTS / 5,
        "too few multi-rule requests"
    );
    assert!(uncharged_yes >= 50, "all-or-nothing barely exercised");
    assert!(long_gaps >= 100, "too few full refills");
    assert!(
        allowed_on_retry_boundary >= 20,
        "retry boundaries barely exercised"
    );
    assert!(
        denied_just_before_boundary >= 20,
        "retry boundaries barely exercised"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_have_ttl_equal_to_time_to_full_refill() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let mut conn = server.conn();
    let store = redis_store(&server, Duration::from_secs(5));

    // The exact case first: a fresh "2/s" bucket of 4 is one token short after one
    // request, and one token at 2/s takes 500 ms.
    let q = quota("2/s", Some(4), 1);
    let alone = digest_api_key(b"ttl-exact");
    let check = Check::new(&alone, "exact", &q);
    let before = Instant::now();
    let d = store
        .decide_at(std::slice::from_ref(&check), Some(EPOCH_US))
        .await
        .unwrap();
    assert_eq!(
        d,
        vec![Decision {
            allowed: true,
            remaining: 3,
            retry_after_us: 0,
            reset_us: 500_000,
            window: 0,
        }]
    );
    let ttl = pttl(&mut conn, &store.key(&check));
    let waited = before.elapsed().as_millis() as i64;
    assert!(ttl > 0 && ttl <= 500, "PTTL {ttl} ms, expected in (0, 500]");
    assert!(
        ttl >= 500 - waited - 50,
        "PTTL {ttl} ms is shorter than 500 ms less the {waited} ms since the request (50 ms slack)"
    );

    // Then many buckets, charged to various depths over a short timeline. Their TTLs run
    // on Redis' wall clock, so every charge here is remembered for seconds at least: no key
    // can expire before it is inspected, however slow the machine.
    let rules: Vec<(&str, Quota)> = vec![
        ("r7_100s", quota("7/100s", None, 1)),
        ("r3m_b5", quota("3/m", Some(5), 1)),
        ("r1000h_b50_c4", quota("1000/h", Some(50), 4)),
        ("r1h_b2", quota("1/h", Some(2), 1)),
        ("r2m_b4_c2", quota("2/m", Some(4), 2)),
    ];
    for (name, q) in &rules {
        assert!(q.need().div_ceil(q.per_us) >= 10_000_000, "{name}");
    }
    let ids: Vec<IdentityDigest> = (0..4u8)
        .map(|n| digest_ip(IpAddr::V4(Ipv4Addr::new(198, 51, 100, n))))
        .collect();
    let mut rng = Rng(0xDEAD_BEEF_CAFE_F00D);
    let mut now = EPOCH_US;
    // key -> (reset_us of its last charge, when that request was sent)
    let mut charged: HashMap<String, (u64, Instant)> = HashMap::new();
    for _ in 0..200 {
        now += rng.range(0, 50_000);
        let (name, q) = &rules[rng.below(rules.len())];
        let id = &ids[rng.below(ids.len())];
        let check = Check::new(id, name, q);
        let sent = Instant::now();
        let d = store
            .decide_at(std::slice::from_ref(&check), Some(now))
            .await
            .unwrap()[0];
        if d.allowed {
            charged.insert(store.key(&check), (d.reset_us, sent));
        }
    }

    // The exact case's key may have expired by now: leave it out.
    let exact_key = store.key(&check);
    let keys: Vec<String> = scan(&mut conn, &format!("{PREFIX}:*"))
        .into_iter()
        .filter(|k| *k != exact_key)
        .collect();
    let mut expected: Vec<String> = charged.keys().cloned().collect();
    expected.sort();
    assert!(
        expected.len() >= 10,
        "too few buckets charged: {expected:?}"
    );
    assert_eq!(keys, expected, "exactly the charged buckets have keys");
    for key in &keys {
        let rule = key.rsplit(':').next().unwrap();
        let q = &rules.iter().find(|(n, _)| *n == rule).unwrap().1;
        let ttl = pttl(&mut conn, key);
        let bound = full_refill_us(q).div_ceil(1000) as i64;
        assert!(ttl > 0, "{key}: PTTL {ttl}: every key must expire");
        assert!(
            ttl <= bound,
            "{key}: PTTL {ttl} ms is longer than a full refill of {q} ({bound} ms)"
        );
        // And exactly the time to full refill from its last charge, less the real time
        // that has passed since.
        let (reset_us, sent) = charged[key];
        let px = reset_us.div_ceil(1000) as i64;
        let waited = sent.elapsed().as_millis() as i64;
        assert!(
            ttl <= px && ttl >= px - waited - 50,
            "{key}: PTTL {ttl} ms, expected {px} ms less the {waited} ms since (50 ms slack)"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_key_names_never_contain_the_raw_api_key() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let mut conn = server.conn();
    let store = redis_store(&server, Duration::from_secs(5));
    let raw: &[u8] = b"super-secret-key-123";
    let raw_hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let id = digest_api_key(raw);
    let (per_sec, per_min) = (quota("5/s", None, 1), quota("100/m", Some(10), 2));
    let checks = [
        Check::new(&id, "per_sec", &per_sec),
        Check::new(&id, "per_min", &per_min),
    ];
    for n in 0..3 {
        let d = store
            .decide_at(&checks, Some(EPOCH_US + n * 1_000))
            .await
            .unwrap();
        assert!(d.iter().all(|d| d.allowed), "{d:?}");
    }
    store
        .decide_at(&checks[1..], Some(EPOCH_US + 5_000))
        .await
        .unwrap();

    let keys = scan(&mut conn, "*");
    assert_eq!(keys.len(), 2, "one key per rule: {keys:?}");
    let hex = id.hex();
    for key in &keys {
        let lower = key.to_ascii_lowercase();
        assert!(
            !lower.contains("super-secret-key-123"),
            "{key} contains the raw key"
        );
        assert!(
            !lower.contains(&raw_hex),
            "{key} contains the raw key in hex"
        );
        let rest = key
            .strip_prefix(&format!("{PREFIX}:{{"))
            .unwrap_or_else(|| panic!("{key}: not <prefix>:{{..."));
        let (digest, rule) = rest
            .split_once("}:")
            .unwrap_or_else(|| panic!("{key}: no }}:<rule>"));
        assert_eq!(digest.len(), 32, "{key}: digest is not 32 chars");
        assert!(
            digest
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)),
            "{key}: digest is not lowercase hex"
        );
        assert_eq!(digest, hex, "{key}: digest is not the identity's");
        assert!(rule == "per_sec" || rule == "per_min", "{key}: rule {rule}");
        // The value is the bucket's tag and numbers only.
        let value = get(&mut conn, key).expect("value");
        let parts: Vec<&str> = value.split(':').collect();
        assert!(
            parts.len() == 4
                && parts[0] == "t"
                && parts[1..]
                    .iter()
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())),
            "{key} = {value:?}: not t:level:last:unit"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_type_key_is_a_store_error_not_a_crash() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let mut conn = server.conn();
    let store = redis_store(&server, Duration::from_secs(5));
    let q = quota("10/s", None, 1);
    let (victim, bystander) = (digest_api_key(b"victim"), digest_api_key(b"bystander"));
    let bad = Check::new(&victim, "r", &q);
    let good = Check::new(&bystander, "r", &q);
    let key = store.key(&bad);

    // A hash where the bucket's string should be.
    let _: i64 = redis::cmd("HSET")
        .arg(&key)
        .arg("f")
        .arg("v")
        .query(&mut conn)
        .unwrap();
    let r = store
        .decide_at(std::slice::from_ref(&bad), Some(EPOCH_US))
        .await;
    assert!(
        matches!(r, Err(StoreError::Redis(_))),
        "a hash key must be a Redis error (at once, not a timeout), got {r:?}"
    );
    // Checked together with a healthy bucket: still an error, and the healthy one is
    // not charged (the script fails before it writes anything).
    let r = store
        .decide_at(&[good.clone(), bad.clone()], Some(EPOCH_US))
        .await;
    assert!(
        matches!(r, Err(StoreError::Redis(_))),
        "a hash key among others must be a Redis error, got {r:?}"
    );
    assert_eq!(
        get(&mut conn, &store.key(&good)),
        None,
        "the healthy bucket was written by a failed request"
    );
    let kind: String = redis::cmd("TYPE").arg(&key).query(&mut conn).unwrap();
    assert_eq!(
        kind, "hash",
        "the store must not overwrite a key it cannot read"
    );

    // Corrupt strings.
    for garbage in ["garbage", "1:2", "5:1700000000000000:0", "-1:2:3", ""] {
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg(garbage)
            .query(&mut conn)
            .unwrap();
        let r = store
            .decide_at(std::slice::from_ref(&bad), Some(EPOCH_US))
            .await;
        assert!(
            matches!(r, Err(StoreError::Redis(_))),
            "value {garbage:?} must be a Redis error, got {r:?}"
        );
        assert_eq!(
            get(&mut conn, &key).as_deref(),
            Some(garbage),
            "value {garbage:?} was overwritten"
        );
    }

    // Another identity is unaffected, and the store still works after the errors.
    let d = store
        .decide_at(std::slice::from_ref(&good), Some(EPOCH_US))
        .await
        .expect("a healthy bucket must still be decided");
    assert_eq!(
        d,
        vec![Decision {
            allowed: true,
            remaining: 9,
            retry_after_us: 0,
            reset_us: 100_000,
            window: 0,
        }],
        "the healthy bucket was charged by a failed request"
    );
    // And once the bad key is gone, the victim gets a fresh bucket.
    let _: i64 = redis::cmd("DEL").arg(&key).query(&mut conn).unwrap();
    let d = store.decide_at(&[bad], Some(EPOCH_US)).await.unwrap();
    assert!(d[0].allowed && d[0].remaining == 9, "{d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_or_nothing_in_redis() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let mut conn = server.conn();
    let store = redis_store(&server, Duration::from_secs(5));
    let (roomy, tight) = (quota("10/s", None, 1), quota("1/m", Some(1), 1));
    let id = digest_ip(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 9)));
    let both = [
        Check::new(&id, "roomy", &roomy),
        Check::new(&id, "tight", &tight),
    ];
    let roomy_key = store.key(&both[0]);

    let t = EPOCH_US;
    let d = store.decide_at(&both, Some(t)).await.unwrap();
    assert!(d[0].allowed && d[1].allowed, "{d:?}");
    assert_eq!((d[0].remaining, d[1].remaining), (9, 0));
    let roomy_state = get(&mut conn, &roomy_key).expect("roomy bucket written");

    // 1 ms later: the tight rule is exhausted, so the request is denied and the roomy
    // rule, which had room, is not charged.
    let d = store.decide_at(&both, Some(t + 1_000)).await.unwrap();
    assert_eq!(
        d[0],
        Decision {
            allowed: true,
            remaining: 9,
            retry_after_us: 0,
            reset_us: 99_000,
            window: 0,
        },
        "the roomy rule says yes and is untouched"
    );
    assert_eq!(
        d[1],
        Decision {
            allowed: false,
            remaining: 0,
            retry_after_us: 59_999_000,
            reset_us: 59_999_000,
            window: 0,
        }
    );
    assert_eq!(
        get(&mut conn, &roomy_key).as_deref(),
        Some(roomy_state.as_str()),
        "a denied request rewrote the roomy bucket"
    );

    // The next request on the roomy rule alone finds its 9 tokens (plus 2 ms of refill,
    // not yet a whole token) and takes one.
    let d = store.decide_at(&both[..1], Some(t + 2_000)).await.unwrap();
    assert_eq!(
        d,
        vec![Decision {
            allowed: true,
            remaining: 8,
            retry_after_us: 0,
            reset_us: 198_000,
            window: 0,
        }]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_is_survived() {
    let _watch = common::watchdog();
    let mut server = RedisServer::start();
    let timeout = Duration::from_millis(200);
    let store = redis_store(&server, timeout);
    let q = quota("5/s", None, 1);
    let id = digest_api_key(b"restart");
    let check = [Check::new(&id, "r", &q)];

    // The lazy connection may take a moment on a loaded machine: allow a few tries.
    let mut first = None;
    for _ in 0..50 {
        if let Ok(d) = store.decide_at(&check, Some(EPOCH_US)).await {
            first = Some(d);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = first.expect("redis store never answered");
    assert!(first[0].allowed && first[0].remaining == 4, "{first:?}");

    server.kill();
    for n in 0..3 {
        let start = Instant::now();
        let r = store.decide_at(&check, Some(EPOCH_US + 1_000)).await;
        let took = start.elapsed();
        assert!(r.is_err(), "try {n}: redis is down but decide said {r:?}");
        // Bounded by the store's timeout, not a wait for Redis to come back: within WAIT,
        // room for any load.
        assert!(
            took < common::WAIT,
            "try {n}: an error took {took:?} with a {timeout:?} timeout"
        );
    }

    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut tries = 0;
    let back = loop {
        tries += 1;
        match store.decide_at(&check, Some(EPOCH_US + 2_000)).await {
            Ok(d) => break d,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no answer {tries} tries after the restart: {e}"),
        }
    };
    // The restarted server is empty (no persistence): a fresh bucket, and the script was
    // loaded again.
    assert!(back[0].allowed && back[0].remaining == 4, "{back:?}");
    let d = store
        .decide_at(&check, Some(EPOCH_US + 3_000))
        .await
        .unwrap();
    assert!(d[0].allowed && d[0].remaining == 3, "{d:?}");
}

/// Tokens reserved under `max_delay` stay reserved when a reload lowers the limit: for the
/// token bucket (a level below zero) and GCRA (a TAT beyond the new burst) alike, a denial
/// then says when the request will really pass, and both stores agree on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_tokens_outlive_a_shrunk_quota_with_honest_retries() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let redis = redis_store(&server, Duration::from_secs(2));
    for (n, algorithm) in [Algorithm::TokenBucket, Algorithm::Gcra]
        .into_iter()
        .enumerate()
    {
        let clock = ManualClock::new(EPOCH_US);
        let memory = MemoryStore::new(clock.clone());
        let plain = Quota::new(
            algorithm,
            Rate::parse("1/s").expect("rate"),
            None,
            NonZeroU64::MIN,
        )
        .expect("quota");
        let delayed = plain
            .with_max_delay(Duration::from_secs(10))
            .expect("max_delay");
        let id = digest_api_key(format!("shrunk-{n}").as_bytes());
        let both = |q: &Quota, at: u64| {
            let check = [Check::new(&id, "shrunk", q)];
            clock.set(EPOCH_US + at);
            let m = memory.decide(&check).expect("the memory store has room");
            let r = block_on(redis.decide_at(&check, Some(EPOCH_US + at))).expect("redis decides");
            assert_eq!(m, r, "{algorithm:?} at +{at} µs: memory vs redis");
            m[0]
        };
        // One at once, four waiting 1..4 s: the last one is due at +4 s.
        for k in 0..5u64 {
            let d = both(&delayed, 0);
            assert!(
                d.allowed && d.retry_after_us == k * 1_000_000,
                "{algorithm:?} {k}: {d:?}"
            );
        }
        // The reload drops max_delay. A request passes when the reserved ones are served.
        for (at, retry) in [
            (0, 5_000_000),
            (1_000_000, 4_000_000),
            (3_000_000, 2_000_000),
        ] {
            let d = both(&plain, at);
            assert!(!d.allowed, "{algorithm:?} at +{at}");
            assert_eq!(d.retry_after_us, retry, "{algorithm:?} at +{at}: {d:?}");
        }
        assert!(!both(&plain, 4_999_999).allowed, "{algorithm:?}");
        assert!(both(&plain, 5_000_000).allowed, "{algorithm:?}");
    }
}

/// Run a future to completion on the test's runtime from synchronous code.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

/// A rule that changes between a rate limit and a concurrency limit on reload keeps its
/// Redis key name: the other kind's state counts as none, in Redis as in memory, instead
/// of failing every request of the identity until the old key expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_changing_kind_starts_afresh_in_both_stores() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let redis = redis_store(&server, Duration::from_secs(2));
    let clock = ManualClock::new(EPOCH_US);
    let memory = MemoryStore::new(clock.clone());
    let rate = quota("1/m", Some(2), 1);
    let conc = Quota::concurrency(NonZeroU64::new(1).expect("1"), Duration::from_secs(30));
    let id = digest_api_key(b"changing-kind");
    let both = |q: &Quota, lease: u64| {
        let check = [Check {
            lease,
            ..Check::new(&id, "flip", q)
        }];
        let m = memory.decide(&check).expect("the memory store has room");
        let r = block_on(redis.decide_at(&check, Some(EPOCH_US))).expect("redis decides");
        assert_eq!(m, r, "memory vs redis");
        m[0]
    };
    assert!(both(&rate, 0).allowed);
    // Now a concurrency limit: the rate state is none; one slot, then full.
    let d = both(&conc, 1);
    assert!(d.allowed && d.remaining == 0, "{d:?}");
    assert!(!both(&conc, 2).allowed);
    // Back to a rate limit: the lease set is none; the full burst again.
    let d = both(&rate, 0);
    assert!(d.allowed && d.remaining == 1, "{d:?}");
    // Foreign data at a key is still an error, not silently replaced.
    let mut conn = server.conn();
    let key = redis.key(&Check::new(&id, "flip", &conc));
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("not ours")
        .query(&mut conn)
        .expect("SET");
    let err = block_on(redis.decide_at(&[Check::new(&id, "flip", &conc)], Some(EPOCH_US)))
        .expect_err("foreign data is an error");
    assert!(err.is_data_error(), "{err}");
}
