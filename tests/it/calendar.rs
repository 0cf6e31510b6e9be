//! Calendar quotas (issue 27, part 5): a `fixed_window` rule counting per calendar day,
//! week or month in a time zone. The memory store (Rust, `src/limiter/fixed_window.rs`)
//! and the Redis store (`lua/fixed_window.lua`, algorithm 6, edges from the gateway) must
//! decide and settle alike on one timeline across Berlin's month ends and DST changes;
//! the script picks the period of Redis' own clock as documented; and the real binary's
//! headers say this month's length and the seconds to its end.

use crate::common;

use std::num::NonZeroU64;
use std::time::Duration;

use common::{get, int, item, pttl, upstream_and_store, Gateway, HttpClient, RedisServer, Store};
use common::{Upstream, PREFIX};
use http::StatusCode;
use jiff::civil::date;
use ratewall::identity::{digest_api_key, IdentityDigest};
use ratewall::limiter::calendar::zone;
use ratewall::limiter::memory::MemoryStore;
use ratewall::limiter::redis::{DecideAt, RedisStore};
use ratewall::limiter::store::Settlement;
use ratewall::limiter::{Adjust, Algorithm, Check, ManualClock, Quota, Rate};

/// A fixed_window quota of `rate` ("N/month", ...) in `tz`, months from `anchor_day`.
fn calendar(rate: &str, tz: &str, anchor_day: u8, cost: u64) -> Quota {
    Quota::new(
        Algorithm::FixedWindow,
        Rate::parse(rate).unwrap_or_else(|e| panic!("{rate}: {e}")),
        None,
        NonZeroU64::new(cost).expect("cost > 0"),
    )
    .unwrap_or_else(|e| panic!("{rate}: {e}"))
    .in_zone(zone(tz).expect("a known zone"), anchor_day)
}

/// µs since the UNIX epoch of a wall-clock time in Berlin (an unambiguous one).
fn berlin(y: i16, m: i8, d: i8, h: i8, min: i8) -> u64 {
    let tz = zone("Europe/Berlin").unwrap();
    let ts = tz
        .to_ambiguous_timestamp(date(y, m, d).at(h, min, 0, 0))
        .unambiguous()
        .expect("an unambiguous local time");
    ts.as_microsecond() as u64
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

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const MINUTE: u64 = 60_000_000;
const HOUR: u64 = 60 * MINUTE;

/// What one timeline exercised.
#[derive(Default)]
struct Seen {
    allowed: usize,
    denied: usize,
    /// Decisions in another period than the key's previous decision.
    new_periods: usize,
    /// Requests placed exactly at a period's edge, or 1 µs before it.
    at_edges: usize,
    /// The edges those were at.
    edges: std::collections::BTreeSet<u64>,
    stepped_back: usize,
    settled: usize,
    ttls_checked: usize,
}

impl Seen {
    fn summary(&self) -> String {
        format!(
            "{} allowed, {} denied, {} new periods, {} at {} edges, {} steps back, {} settled, {} TTLs",
            self.allowed,
            self.denied,
            self.new_periods,
            self.at_edges,
            self.edges.len(),
            self.stepped_back,
            self.settled,
            self.ttls_checked
        )
    }
}

/// Drive the memory store (on a manual clock) and the Redis store (with the same explicit
/// times) through `requests` requests from `from` to past `until`, and compare every
/// decision and every settlement's answer.
async fn agree_from(
    server: &RedisServer,
    rules: &[(&str, Quota)],
    from: u64,
    until: u64,
    seed: u64,
) -> Seen {
    let mut conn = server.conn();
    let redis = RedisStore::new(&server.url(), PREFIX, Duration::from_secs(5)).expect("store");
    let clock = ManualClock::new(from);
    let memory = MemoryStore::new(clock.clone());
    let identities: Vec<IdentityDigest> = (0..3)
        .map(|i| digest_api_key(format!("cal-{seed}-{i}").as_bytes()))
        .collect();
    let mut rng = Rng(seed);
    let mut now = from;
    let mut seen = Seen::default();
    // (identity, rule) -> the period start of its last decision.
    let mut last = std::collections::HashMap::new();
    let started = std::time::Instant::now();
    let mut i = 0usize;
    // The latest time seen: at or past it, no state starts after `now`.
    let mut high = from;
    while now < until {
        i += 1;
        let (id, rule) = (rng.below(identities.len()), rng.below(rules.len()));
        let mut targets = vec![(id, rule)];
        if rng.below(4) == 0 {
            targets.push((id, (rule + 1 + rng.below(rules.len() - 1)) % rules.len()));
        }
        match rng.below(100) {
            0..=34 => {}
            35..=74 => now += rng.range(1, MINUTE),
            75..=84 => now += rng.range(MINUTE, 20 * MINUTE),
            85..=95 => {
                // Exactly at the next edge of any rule's period, or 1 µs before it, when
                // it is near (so no edge is jumped over); else a few seconds on.
                let end = rules
                    .iter()
                    .map(|(_, q)| q.calendar.expect("a calendar quota").window(now).1)
                    .min()
                    .expect("rules");
                if end - now <= 6 * HOUR {
                    now = end - rng.range(0, 1);
                    seen.at_edges += 1;
                    seen.edges.insert(end);
                } else {
                    now += rng.range(1_000_000, 10_000_000);
                }
            }
            _ => {
                // The clock steps back (a failover, an NTP step), up to half an hour.
                now = now.saturating_sub(rng.range(1, 30 * MINUTE)).max(from);
                seen.stepped_back += 1;
            }
        }
        let checks: Vec<Check<'_>> = targets
            .iter()
            .map(|&(id, r)| Check::new(&identities[id], rules[r].0, &rules[r].1))
            .collect();
        clock.set(now);
        high = high.max(now);
        let from_memory = memory.decide(&checks).expect("room");
        let from_redis = redis
            .decide_at(&checks, Some(now))
            .await
            .unwrap_or_else(|e| panic!("request {i}: redis failed: {e}"));
        let state = |conn: &mut redis::Connection| -> Vec<String> {
            checks
                .iter()
                .map(|c| format!("{:?}", get(conn, &redis.key(c))))
                .collect()
        };
        assert_eq!(
            from_memory,
            from_redis,
            "request {i} at {now} ({}) on {targets:?}: memory and redis disagree; redis holds {:?}",
            jiff::Timestamp::from_microsecond(now as i64).unwrap(),
            state(&mut conn)
        );
        let all = from_memory.iter().all(|d| d.allowed);
        for ((t, c), d) in targets.iter().zip(&checks).zip(&from_memory) {
            let (start, _) = c.quota.calendar.unwrap().window(now);
            // Never past the end of the state's period: the longest one, plus how far
            // the clock may have stepped back before it.
            let longest = c.quota.rate.period.as_micros() as u64 + 30 * MINUTE;
            assert!(
                d.reset_us <= longest && d.retry_after_us <= longest,
                "{d:?}"
            );
            if d.allowed {
                seen.allowed += 1;
            } else {
                seen.denied += 1;
                assert!(d.retry_after_us > 0);
            }
            if last.insert(*t, start).is_some_and(|s| s != start) {
                seen.new_periods += 1;
            }
        }
        if all && i.is_multiple_of(7) && now >= high {
            // What Redis keeps: the period's start and its count, for as long as it lasts.
            let c = &checks[0];
            let key = redis.key(c);
            let (start, end) = c.quota.calendar.unwrap().window(now);
            let value = get(&mut conn, &key).expect("a charged key");
            if end - now > 10_000_000 {
                assert!(value.starts_with(&format!("f:{start}:")), "{key} = {value}");
                let ttl_ms = pttl(&mut conn, &key);
                let want = (end - now).div_ceil(1000) as i64;
                assert!(
                    ttl_ms <= want && ttl_ms >= want - 5_000,
                    "{key}: PTTL {ttl_ms} ms, the period ends in {want} ms"
                );
                seen.ttls_checked += 1;
            }
        }
        if all && rng.below(8) == 0 {
            // Settle the charge: a refund (now, or later than its period) or a charge more.
            let k = rng.below(checks.len());
            let cost = checks[k].quota.cost as i64;
            // At once, within minutes, or hours later (past a period's end, at times).
            let age = match rng.below(100) {
                0..=49 => 0,
                50..=97 => rng.range(1_000_000, 10 * MINUTE),
                _ => rng.range(HOUR, 6 * HOUR),
            };
            // Into the period the charge fell in, as the store named it.
            let adjust = if rng.below(3) == 0 {
                Adjust {
                    delta: rng.range(1, 4) as i64,
                    window: from_memory[k].window,
                }
            } else {
                Adjust::refund(cost as u64, &from_memory[k])
            };
            now += age;
            clock.set(now);
            let items = [Settlement {
                check: checks[k].clone(),
                adjust,
            }];
            let m = memory.settle(&items);
            let r = redis
                .settle_at(&items, Some(now))
                .await
                .unwrap_or_else(|e| panic!("settle {i}: redis failed: {e}"));
            assert_eq!(
                m, r,
                "settle {i} {adjust:?} at {now}: memory and redis disagree"
            );
            seen.settled += 1;
        }
    }
    eprintln!(
        "{i} requests from {from} to {now} in {:?}: {}",
        started.elapsed(),
        seen.summary()
    );
    seen
}

fn berlin_rules() -> Vec<(&'static str, Quota)> {
    vec![
        ("month", calendar("120/month", "Europe/Berlin", 1, 1)),
        ("month_c3", calendar("360/month", "Europe/Berlin", 1, 3)),
        ("bill25", calendar("100/month", "Europe/Berlin", 25, 1)),
        ("day", calendar("25/day", "Europe/Berlin", 1, 1)),
        ("week", calendar("150/week", "Europe/Berlin", 1, 2)),
        ("utc_day", calendar("20/day", "UTC", 1, 1)),
    ]
}

fn enough(seen: &Seen, what: &str, edges: &[u64]) {
    for e in edges {
        assert!(
            seen.edges.contains(e),
            "{what}: the edge {e} was never met exactly: {:?}",
            seen.edges
        );
    }
    assert!(
        seen.allowed >= 200,
        "{what}: too few allowed: {}",
        seen.summary()
    );
    assert!(
        seen.denied >= 200,
        "{what}: too few denied: {}",
        seen.summary()
    );
    assert!(
        seen.new_periods >= 25,
        "{what}: too few new periods: {}",
        seen.summary()
    );
    assert!(
        seen.edges.len() >= 5,
        "{what}: too few edges: {}",
        seen.summary()
    );
    assert!(
        seen.stepped_back >= 20,
        "{what}: too few steps back: {}",
        seen.summary()
    );
    assert!(
        seen.settled >= 30,
        "{what}: too few settlements: {}",
        seen.summary()
    );
    assert!(
        seen.ttls_checked >= 10,
        "{what}: too few TTLs: {}",
        seen.summary()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_redis_agree_across_the_berlin_month_end_after_the_spring_change() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let rules = berlin_rules();
    // 28 March to 2 April 2026: the clocks go forward on the 29th, March ends on the 31st
    // (at 22:00 UTC, in summer time), and a week ends on Monday the 30th.
    let seen = agree_from(
        &server,
        &rules,
        berlin(2026, 3, 28, 0, 0),
        berlin(2026, 4, 2, 0, 0),
        0x9E37_79B9_7F4A_7C15,
    )
    .await;
    // The month's end (also a day's), the week's, and the end of the 23-hour day.
    let edges = [
        berlin(2026, 4, 1, 0, 0),
        berlin(2026, 3, 30, 0, 0),
        berlin(2026, 3, 29, 0, 0),
    ];
    enough(&seen, "spring", &edges);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_redis_agree_across_the_autumn_change_and_the_october_month_end() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let rules = berlin_rules();
    // 24 October to 1 November 2026: "bill25"'s month ends at midnight on the 25th, three
    // hours before the clocks go back; that day is 25 hours; October ends on the 31st.
    let seen = agree_from(
        &server,
        &rules,
        berlin(2026, 10, 24, 0, 0),
        berlin(2026, 11, 1, 6, 0),
        0xD1B5_4A32_D192_ED03,
    )
    .await;
    // bill25's month end, the end of the 25-hour day, October's end.
    let edges = [
        berlin(2026, 10, 25, 0, 0),
        berlin(2026, 10, 26, 0, 0),
        berlin(2026, 11, 1, 0, 0),
    ];
    enough(&seen, "autumn", &edges);
}

/// One call of the script, as `Scripted::encode` writes a calendar window's quota, at
/// Redis time `now`: its five numbers, or the error it fails with.
fn script(
    conn: &mut redis::Connection,
    key: &str,
    now: u64,
    quota: &str,
) -> redis::RedisResult<Vec<i64>> {
    redis::cmd("EVAL")
        .arg(ratewall::limiter::redis::SCRIPT)
        .arg(1)
        .arg(key)
        .arg(now)
        .arg("")
        .arg(quota)
        .arg("0")
        .query::<Vec<String>>(conn)
        .map(|reply| {
            // One string of the key's five numbers (lua/decide.lua's reply).
            assert_eq!(reply.len(), 1, "one request, none failed: {reply:?}");
            (reply[0].split(' '))
                .map(|n| n.parse().expect("a whole number"))
                .collect()
        })
}

#[test]
fn the_script_counts_in_the_period_of_redis_clock_as_documented() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    let mut conn = server.conn();
    // March and April 2026 in Berlin, as a gateway would send them on 31 March.
    let (e0, e1, e2) = (
        berlin(2026, 3, 1, 0, 0),
        berlin(2026, 4, 1, 0, 0),
        berlin(2026, 5, 1, 0, 0),
    );
    // Limit 10, cost 1, no borrowing (max_debt 0), then the edges.
    let quota = format!("6:10:1:0:{e0}:{e1}:{e2}");
    let state = |conn: &mut redis::Connection, key: &str| get(conn, key).expect("written");

    // Redis' clock in the gateway's period: counted there, to its end.
    let now = e1 - HOUR;
    let d = script(&mut conn, "cal:a", now, &quota).unwrap();
    assert_eq!(d, vec![1, 9, 0, HOUR as i64, e0 as i64]);
    assert_eq!(state(&mut conn, "cal:a"), format!("f:{e0}:1"));

    // Redis ahead of the gateway, past e1: Redis' period, April.
    let now = e1 + 5_000_000;
    let d = script(&mut conn, "cal:b", now, &quota).unwrap();
    assert_eq!(d, vec![1, 9, 0, (e2 - now) as i64, e1 as i64]);
    assert_eq!(state(&mut conn, "cal:b"), format!("f:{e1}:1"));
    // The key charged in March is in April now: a fresh count.
    let d = script(&mut conn, "cal:a", now, &quota).unwrap();
    assert_eq!(d[1], 9);
    assert_eq!(state(&mut conn, "cal:a"), format!("f:{e1}:1"));

    // Redis behind the gateway, before e0: counted in the gateway's period, to its end.
    let now = e0 - 5_000_000;
    let d = script(&mut conn, "cal:c", now, &quota).unwrap();
    assert_eq!(d, vec![1, 9, 0, (e1 - now) as i64, e0 as i64]);
    assert_eq!(state(&mut conn, "cal:c"), format!("f:{e0}:1"));

    // Past e2: periods of the next one's length (April's 30 days) on from e2.
    let len = e2 - e1;
    let now = e2 + len + 7;
    let d = script(&mut conn, "cal:d", now, &quota).unwrap();
    assert_eq!(
        d,
        vec![1, 9, 0, (e2 + 2 * len - now) as i64, (e2 + len) as i64]
    );
    assert_eq!(state(&mut conn, "cal:d"), format!("f:{}:1", e2 + len));

    // Edges that are not a period: the key's error, nothing written.
    let bad = format!("6:10:1:0:{e1}:{e0}:{e2}");
    let e = script(&mut conn, "cal:e", e0, &bad).unwrap_err();
    assert_eq!(e.code(), Some("RATEWALL"), "{e}");
    assert!(e.to_string().contains("bad calendar edges"), "{e}");
    assert_eq!(get(&mut conn, "cal:e"), None);
}

fn unix_now_us() -> u64 {
    jiff::Timestamp::now().as_microsecond() as u64
}

/// This month's start and end in Berlin at `now_us`, by jiff alone (not the gateway's
/// calendar code): the first of this month and of the next, at local midnight.
fn month_by_jiff(now_us: u64) -> (u64, u64) {
    let tz = jiff::tz::TimeZone::get("Europe/Berlin").unwrap();
    let now = jiff::Timestamp::from_microsecond(now_us as i64).unwrap();
    let first = now.to_zoned_datetime(tz.clone()).date().first_of_month();
    let next = first.checked_add(jiff::Span::new().months(1)).unwrap();
    let at = |d: jiff::civil::Date| {
        d.to_zoned_datetime(tz.clone())
            .unwrap()
            .timestamp()
            .as_microsecond() as u64
    };
    (at(first), at(next))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_monthly_rule_advertises_this_months_length_and_the_seconds_to_its_end() {
    let _watch = common::watchdog();
    let server = RedisServer::start();
    for store in [Store::Memory, Store::redis_roomy(&server)] {
        let upstream = Upstream::start().await;
        let gw = Gateway::start(&format!(
            "{}[[rules]]\nname = \"monthly\"\nkey = \"api_key\"\nalgorithm = \"fixed_window\"\nrate = \"100/month\"\ntimezone = \"Europe/Berlin\"\n",
            upstream_and_store(&upstream.url(), &store),
        ));
        let client = HttpClient::new();
        let before = unix_now_us();
        let r = client
            .get(&gw.url("/api/x"), &[("x-api-key", "monthly-key")])
            .await;
        let after = unix_now_us();
        assert_eq!(r.status, StatusCode::OK, "{}", gw.logs());
        // This month by jiff itself, from this machine's clock (the gateway's own is the
        // same clock; a month may end between the two readings).
        let months = [month_by_jiff(before), month_by_jiff(after)];
        let policy = item(&r, "ratelimit-policy", "monthly");
        assert_eq!(int(&policy, "q"), 100);
        let w = int(&policy, "w") as u64;
        let lengths = months.map(|(start, end)| (end - start) / 1_000_000);
        assert!(
            lengths.contains(&w),
            "w = {w}: this month in Berlin is {lengths:?} s"
        );
        let state = item(&r, "ratelimit", "monthly");
        assert_eq!(int(&state, "r"), 99);
        let t = int(&state, "t") as u64;
        // t is the seconds to the month's end, rounded up, at the gateway's moment.
        let (lo, hi) = (
            (months[1].1 - after).div_ceil(1_000_000),
            (months[0].1 - before).div_ceil(1_000_000),
        );
        assert!(
            (lo.min(hi)..=hi.max(lo)).contains(&t),
            "t = {t}: the month ends in {lo} to {hi} s"
        );
    }
}
