//! The Rust step functions (`src/limiter/*.rs`, run by the memory store) and their Lua
//! twins (`lua/*.lua`, run by the Redis store) must agree on every decision, for all four
//! algorithms, on random timelines: one rule or several at once (all or nothing over the
//! enforcing rules; shadow checks never deny and are charged only when they allow), awkward
//! rates, bursts, costs and `max_delay`s (a request may wait for its tokens), and gaps that
//! land exactly on the instants where a decision flips (a retry instant, the end of a wait,
//! a reset, a sliding window's edge).
//!
//! Every request is replayed three ways: through [`MemoryStore`] on a [`ManualClock`],
//! through the pure [`limiter::decide`] on a model of what the memory store holds, and
//! through [`RedisStore`] against a real redis-server with the timeline's time passed to
//! the script. The three must give the same [`Decision`]s, field for field, and Redis must
//! hold exactly the state the Rust step function computed, under the TTL it computed.
//!
//! Redis expires keys on its own wall clock, while the timeline runs in simulated time,
//! far faster or far slower. Once a write's TTL has been checked, the test therefore
//! removes it (PERSIST): Redis then keeps every state past its TTL, where the memory store
//! forgets it, so the Lua side must also treat a state whose TTL has passed as no state —
//! which the design promises. A key that Redis expired in real time before the test could
//! pin it (only possible when its TTL is a few ms and the machine stalled) is put back
//! from the Rust state, and counted.

use crate::common;

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::RedisServer;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use ratewall::identity::{digest_api_key, IdentityDigest};
use ratewall::limiter::memory::MemoryStore;
use ratewall::limiter::redis::{DecideAt, RedisStore};
use ratewall::limiter::{
    self, Algorithm, Check, Decision, ManualClock, Quota, Rate, Ruling, State,
};

/// A realistic µs epoch (late 2023), so the times the script sees look like Redis `TIME`.
const EPOCH_US: u64 = 1_700_000_000_000_000;

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::TokenBucket,
    Algorithm::Gcra,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
];

/// How many identities a timeline's requests come from.
const IDENTITIES: usize = 3;

/// Slack, in ms, when comparing a key's PTTL with the real time since the script ran.
const PTTL_SLACK_MS: i64 = 5;

fn algorithm_index(a: Algorithm) -> usize {
    ALGORITHMS
        .iter()
        .position(|&b| b == a)
        .expect("a known algorithm")
}

// ---------------------------------------------------------------------------------------
// One redis-server and one runtime per test function, shared by all its cases.

struct Harness {
    server: RedisServer,
    rt: tokio::runtime::Runtime,
    next_prefix: AtomicU64,
}

impl Harness {
    fn start() -> Harness {
        Harness {
            server: RedisServer::start(),
            rt: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("tokio runtime"),
            next_prefix: AtomicU64::new(0),
        }
    }

    /// A key prefix no other case (or shrinking run) has used: cases never share a key.
    fn fresh_prefix(&self) -> String {
        format!("agree{}", self.next_prefix.fetch_add(1, Relaxed))
    }

    fn redis_store(&self, prefix: &str) -> RedisStore {
        let _in_runtime = self.rt.enter();
        RedisStore::new(&self.server.url(), prefix, Duration::from_secs(10))
            .expect("RedisStore::new")
    }
}

// ---------------------------------------------------------------------------------------
// Timelines.

/// One rule's limit, as generated (shown by proptest when a case fails).
#[derive(Debug, Clone, Copy)]
struct RuleSpec {
    algorithm: Algorithm,
    count: u64,
    period_s: u64,
    /// Only for token_bucket / gcra: the windows reject a burst.
    burst: Option<u64>,
    cost: u64,
    /// Only for token_bucket / gcra: how long a request may wait for its tokens, in µs.
    max_delay_us: Option<u64>,
}

impl RuleSpec {
    fn quota_with_cost(&self, cost: u64) -> Result<Quota, String> {
        let q = Quota::new(
            self.algorithm,
            Rate::every(self.count, Duration::from_secs(self.period_s)),
            self.burst.and_then(NonZeroU64::new),
            NonZeroU64::new(cost).ok_or("cost 0")?,
        )
        .map_err(|e| e.to_string())?;
        match self.max_delay_us {
            Some(us) => q
                .with_max_delay(Duration::from_micros(us))
                .map_err(|e| e.to_string()),
            None => Ok(q),
        }
    }

    fn quota(&self) -> Quota {
        self.quota_with_cost(self.cost)
            .unwrap_or_else(|e| panic!("generated an invalid rule {self:?}: {e}"))
    }
}

/// How far after the previous request a request comes. Resolved against the timeline's
/// rules and what the stores answered so far, so boundaries are hit exactly.
#[derive(Debug, Clone, Copy)]
enum Gap {
    /// The same instant: a burst.
    Zero,
    Micros(u64),
    /// A fraction (‰) of one rule's emission interval (period / count): around a token.
    Interval {
        rule: usize,
        permille: u64,
    },
    /// A fraction (‰) of one rule's period.
    Period {
        rule: usize,
        permille: u64,
    },
    /// To the next multiple of one rule's period (where sliding windows turn), less 0/1 µs.
    Boundary {
        rule: usize,
        early: u64,
    },
    /// To the instant the last denial of this request's first key named (now + retry),
    /// less 0/1 µs; or, when its last decision was allowed to wait for its tokens, to the
    /// end of that wait, less 0/1 µs. The same instant when it was neither.
    Retry {
        early: u64,
    },
    /// To the instant the last decision of this request's first key said its quota is
    /// full again (now + reset: the memory store's entry expires there), less 0/1 µs.
    Reset {
        early: u64,
    },
    /// Longer than any rule's state matters (a full refill, two periods), plus this.
    Beyond(u64),
}

#[derive(Debug, Clone)]
struct Req {
    gap: Gap,
    identity: usize,
    /// Indices into the timeline's rules: distinct, in any order.
    rules: Vec<usize>,
    /// Whether each of `rules` is checked in shadow (decided, never denies).
    shadow: Vec<bool>,
}

impl Req {
    /// This request's checks, on `quotas` (one per rule of the timeline).
    fn checks<'a>(
        &self,
        ids: &'a [IdentityDigest],
        names: &'a [String],
        quotas: &'a [Quota],
    ) -> Vec<Check<'a>> {
        self.rules
            .iter()
            .zip(&self.shadow)
            .map(|(&r, &shadow)| Check {
                shadow,
                ..Check::new(&ids[self.identity], &names[r], &quotas[r])
            })
            .collect()
    }
}

#[derive(Debug, Clone)]
struct Timeline {
    start_us: u64,
    rules: Vec<RuleSpec>,
    requests: Vec<Req>,
}

/// A rule of one of `algorithms`. A bucket rule has no `max_delay` `no_delay` times in
/// `4 + no_delay` (see [`max_delay`]).
fn rule_spec(algorithms: &[Algorithm], no_delay: u32) -> impl Strategy<Value = RuleSpec> {
    (
        prop::sample::select(algorithms.to_vec()),
        prop::sample::select(vec![1u64, 2, 3, 5, 7, 10, 60, 100, 999]),
        prop::sample::select(vec![1u64, 2, 10, 60]),
    )
        .prop_flat_map(|(algorithm, count, period_s)| {
            let burst: BoxedStrategy<Option<u64>> = if algorithm.has_burst() {
                prop_oneof![
                    2 => Just(None),
                    1 => Just(Some(1)),
                    2 => (1..=(3 * count).min(3_000)).prop_map(Some),
                ]
                .boxed()
            } else {
                Just(None).boxed()
            };
            (Just(algorithm), Just(count), Just(period_s), burst)
        })
        .prop_flat_map(move |(algorithm, count, period_s, burst)| {
            // The cost may be anything up to the burst (or the window's N).
            let most = burst.unwrap_or(count);
            let cost = prop_oneof![3 => Just(1), 1 => 1..=most, 1 => Just(most)];
            let delay = if algorithm.can_delay() {
                max_delay(count, period_s, no_delay)
            } else {
                Just(None).boxed()
            };
            (cost, delay).prop_map(move |(cost, max_delay_us)| {
                let spec = RuleSpec {
                    algorithm,
                    count,
                    period_s,
                    burst,
                    cost,
                    max_delay_us,
                };
                // A delay the library refuses (too precise for Lua) is no delay.
                match spec.quota_with_cost(cost) {
                    Err(_) if max_delay_us.is_some() => RuleSpec {
                        max_delay_us: None,
                        ..spec
                    },
                    _ => spec,
                }
            })
        })
}

/// A bucket rule's `max_delay` in µs (`None` `no_delay` times in `4 + no_delay`): 1 ms, a
/// fraction of the emission interval, a few whole intervals (rounded down or up: a token's
/// worth of wait, or just short of it), or 60 s; never more than 60 s.
fn max_delay(count: u64, period_s: u64, no_delay: u32) -> BoxedStrategy<Option<u64>> {
    const LONGEST: u64 = 60_000_000;
    // `permille` ‰ of one emission interval (period / count), rounded down or up.
    let of_interval = move |permille: u64, up: bool| {
        let (num, den) = (period_s * 1_000_000 * permille, count * 1_000);
        let us = if up { num.div_ceil(den) } else { num / den };
        Some(us.clamp(1, LONGEST))
    };
    let delay = prop_oneof![
        Just(Some(1_000)),
        (1..1_000u64, any::<bool>()).prop_map(move |(p, up)| of_interval(p, up)),
        (1..=5u64, any::<bool>()).prop_map(move |(k, up)| of_interval(k * 1_000, up)),
        Just(Some(LONGEST)),
    ];
    // (proptest refuses a weight of 0.)
    match no_delay {
        0 => delay.boxed(),
        n => prop_oneof![n => Just(None), 4 => delay].boxed(),
    }
}

fn gap(rules: usize) -> impl Strategy<Value = Gap> {
    prop_oneof![
        6 => Just(Gap::Zero),
        4 => (1..=3_000u64).prop_map(Gap::Micros),
        3 => (0..rules, 0..=2_000u64).prop_map(|(rule, permille)| Gap::Interval { rule, permille }),
        2 => (0..rules, 0..=2_500u64).prop_map(|(rule, permille)| Gap::Period { rule, permille }),
        1 => (0..rules, 0..=1u64).prop_map(|(rule, early)| Gap::Boundary { rule, early }),
        4 => (0..=1u64).prop_map(|early| Gap::Retry { early }),
        1 => (0..=1u64).prop_map(|early| Gap::Reset { early }),
        1 => (0..=10_000_000u64).prop_map(Gap::Beyond),
    ]
}

fn request(rules: usize) -> impl Strategy<Value = Req> {
    let all: Vec<usize> = (0..rules).collect();
    let which = prop_oneof![
        (0..rules).prop_map(|r| vec![r]),
        prop::sample::subsequence(all, 1..=rules).prop_shuffle(),
    ];
    // Each check is in shadow 1 time in 4.
    let which = which.prop_flat_map(|rules| {
        let n = rules.len();
        (
            Just(rules),
            prop::collection::vec(prop::bool::weighted(0.25), n),
        )
    });
    (gap(rules), 0..IDENTITIES, which).prop_map(|(gap, identity, (rules, shadow))| Req {
        gap,
        identity,
        rules,
        shadow,
    })
}

/// 1..=`max_rules` rules of any algorithm (a bucket rule has a `max_delay` 1 time in 2) and
/// 20..=200 requests, starting somewhere in the day after [`EPOCH_US`] so that window
/// edges fall in varied places.
fn timeline(max_rules: usize) -> impl Strategy<Value = Timeline> {
    timeline_of(rule_spec(&ALGORITHMS, 4), max_rules)
}

fn timeline_of(
    rule: impl Strategy<Value = RuleSpec>,
    max_rules: usize,
) -> impl Strategy<Value = Timeline> {
    (
        0..=86_400_000_000u64,
        prop::collection::vec(rule, 1..=max_rules),
    )
        .prop_flat_map(|(offset, rules)| {
            let n = rules.len();
            (
                Just(offset),
                Just(rules),
                prop::collection::vec(request(n), 20..=200),
            )
        })
        .prop_map(|(offset, rules, requests)| Timeline {
            start_us: EPOCH_US + offset,
            rules,
            requests,
        })
}

/// How long `q`'s state can matter after a charge: a full refill (from as far below empty
/// as waiting requests may reserve), or two periods.
fn longest_state_us(q: &Quota) -> u64 {
    if q.algorithm.has_burst() {
        (q.capacity() + q.slack()).div_ceil(q.per_us)
    } else {
        2 * q.period_us()
    }
}

/// The time of the next request, and whether it lands on the retry instant of its first
/// key's last denial (`Some(early)`: exactly there, or 1 µs before).
fn next_time(
    gap: Gap,
    quotas: &[Quota],
    now: u64,
    last: Option<(u64, Decision)>,
) -> (u64, Option<u64>) {
    match gap {
        Gap::Zero => (now, None),
        Gap::Micros(us) => (now + us, None),
        Gap::Interval { rule, permille } => {
            let q = &quotas[rule];
            (now + q.period_us() / q.rate.count * permille / 1000, None)
        }
        Gap::Period { rule, permille } => (now + quotas[rule].period_us() * permille / 1000, None),
        Gap::Boundary { rule, early } => {
            let p = quotas[rule].period_us();
            ((now / p + 1) * p - early, None)
        }
        Gap::Retry { early } => match last {
            Some((at, d)) if !d.allowed && at + d.retry_after_us - early >= now => {
                (at + d.retry_after_us - early, Some(early))
            }
            // The end of a wait: the reserved tokens are there (nothing to promise then).
            Some((at, d)) if d.retry_after_us > 0 && at + d.retry_after_us - early >= now => {
                (at + d.retry_after_us - early, None)
            }
            _ => (now, None),
        },
        Gap::Reset { early } => match last {
            Some((at, d)) if at + d.reset_us >= now + early => (at + d.reset_us - early, None),
            _ => (now, None),
        },
        Gap::Beyond(extra) => {
            let longest = quotas.iter().map(longest_state_us).max().unwrap_or(0);
            (now + longest + extra, None)
        }
    }
}

// ---------------------------------------------------------------------------------------
// Replaying a timeline through both stores and the pure step functions.

/// The value `lua/*.lua` stores for a state (the formats in each file's header).
fn lua_value(s: &State) -> String {
    match s {
        State::TokenBucket(t) => format!("t:{}:{}:{}", t.level, t.last_us, t.unit),
        State::Gcra(g) if g.frac == 0 => format!("g:{}", g.tat_us),
        State::Gcra(g) => format!("g:{}:{}", g.tat_us, g.frac),
        State::FixedWindow(f) => format!("f:{}:{}", f.start_us, f.count),
        State::SlidingWindow(w) => format!("s:{}:{}:{}", w.window, w.cur, w.prev),
        State::Concurrency(_) => unreachable!("timelines have no concurrency rules"),
    }
}

/// `q` without its `max_delay`.
fn without_delay(q: &Quota) -> Quota {
    Quota {
        max_delay_us: 0,
        ..*q
    }
}

/// Whether an outcome lets its request through at once, charged, without a wait.
fn passes_now(o: &Ruling<State>) -> bool {
    o.allowed && o.charged.retry_after_us == 0
}

/// `max_delay` only lets requests wait: a request that passes at once without it gets the
/// very same outcome with it, and one that does not cannot pass at once with it.
fn delay_changes_only_waits(
    q: &Quota,
    state: Option<&State>,
    now: u64,
    o: &Ruling<State>,
) -> Result<(), String> {
    if q.max_delay_us == 0 {
        return Ok(());
    }
    let plain = limiter::decide(&without_delay(q), state, now);
    if plain.allowed && plain != *o {
        return Err(format!(
            "max_delay changed a request that passes without it\n without: {plain:?}\n    with: {o:?}"
        ));
    }
    if !plain.allowed && passes_now(o) {
        return Err(format!(
            "max_delay let a request through without a wait that is denied without it\n without: {plain:?}\n    with: {o:?}"
        ));
    }
    Ok(())
}

struct Replay<'h> {
    h: &'h Harness,
    clock: Arc<ManualClock>,
    memory: MemoryStore,
    redis: RedisStore,
    /// Same server, its own prefix: where a key is copied to try a request without
    /// touching the timeline's state.
    scratch: RedisStore,
    conn: redis::Connection,
    /// What the memory store holds, by Redis key: the last state written and when the
    /// memory store forgets it. Redis keeps every one of them (pinned) past that.
    model: HashMap<String, (State, u64)>,
    /// Keys Redis expired in real time before they could be pinned, put back.
    restored: usize,
}

impl<'h> Replay<'h> {
    fn new(h: &'h Harness) -> Replay<'h> {
        let clock = ManualClock::new(0);
        let prefix = h.fresh_prefix();
        Replay {
            h,
            memory: MemoryStore::new(clock.clone()),
            clock,
            redis: h.redis_store(&prefix),
            scratch: h.redis_store(&format!("{prefix}-scratch")),
            conn: h.server.conn(),
            model: HashMap::new(),
            restored: 0,
        }
    }

    /// The state the memory store holds for `check` at `now`: none once its TTL is over.
    fn state(&self, check: &Check<'_>, now: u64) -> Option<State> {
        self.model
            .get(&self.redis.key(check))
            .filter(|(_, expires)| *expires > now)
            .map(|(s, _)| *s)
    }

    /// One request at `now` in both stores and the model. Any disagreement is an error.
    fn step(&mut self, checks: &[Check<'_>], now: u64) -> Result<Vec<Decision>, String> {
        let before: Vec<Option<State>> = checks.iter().map(|c| self.state(c, now)).collect();
        let outcomes: Vec<Ruling<State>> = checks
            .iter()
            .zip(&before)
            .map(|(c, s)| limiter::decide(c.quota, s.as_ref(), now))
            .collect();
        let quotas: Vec<String> = checks
            .iter()
            .map(|c| {
                let shadow = if c.shadow { ", shadow" } else { "" };
                format!("{} {} ({:?}{shadow})", c.rule, c.quota, c.quota.algorithm)
            })
            .collect();
        for ((c, s), o) in checks.iter().zip(&before).zip(&outcomes) {
            delay_changes_only_waits(c.quota, s.as_ref(), now, o).map_err(|e| {
                format!(
                    "the pure step function, {}: {e}\n state before: {s:?}",
                    c.quota
                )
            })?;
        }
        // The request passes when every enforcing check allows; then each check that allows
        // (enforcing or shadow) is charged. Otherwise nothing is.
        let passes = outcomes
            .iter()
            .zip(checks)
            .all(|(o, c)| o.allowed || c.shadow);
        let charged: Vec<bool> = outcomes.iter().map(|o| passes && o.allowed).collect();
        let from_pure: Vec<Decision> = outcomes
            .iter()
            .zip(&charged)
            .map(|(o, &ch)| if ch { o.charged } else { o.uncharged })
            .collect();

        self.clock.set(now);
        let from_memory = self
            .memory
            .decide(checks)
            .map_err(|e| format!("the memory store failed: {e}"))?;
        if from_memory != from_pure {
            return Err(format!(
                "the memory store and the pure step functions disagree\n quotas: {quotas:?}\n states before: {before:?}\n memory: {from_memory:?}\n   pure: {from_pure:?}"
            ));
        }

        let sent = Instant::now();
        let from_redis = self
            .h
            .rt
            .block_on(self.redis.decide_at(checks, Some(now)))
            .map_err(|e| format!("the redis store failed: {e}"))?;
        if from_redis != from_memory {
            let held: Vec<Option<String>> = checks
                .iter()
                .map(|c| {
                    redis::cmd("GET")
                        .arg(self.redis.key(c))
                        .query(&mut self.conn)
                        .ok()
                        .flatten()
                })
                .collect();
            return Err(format!(
                "the stores disagree\n quotas: {quotas:?}\n rust states before: {before:?}\n  memory (rust): {from_memory:?}\n    redis (lua): {from_redis:?}\n redis values after: {held:?}"
            ));
        }

        for ((c, o), &ch) in checks.iter().zip(&outcomes).zip(&charged) {
            let key = self.redis.key(c);
            if ch {
                self.model.insert(key.clone(), (o.next, now + o.ttl_us));
            }
            self.pin(&key, ch.then_some(o), sent)?;
        }
        Ok(from_memory)
    }

    /// Check what Redis holds at `key` after a request, then remove its TTL.
    /// `written`: the outcome the request wrote there, if it was charged.
    fn pin(
        &mut self,
        key: &str,
        written: Option<&Ruling<State>>,
        sent: Instant,
    ) -> Result<(), String> {
        let (pttl, value, _): (i64, Option<String>, i64) = redis::pipe()
            .atomic()
            .cmd("PTTL")
            .arg(key)
            .cmd("GET")
            .arg(key)
            .cmd("PERSIST")
            .arg(key)
            .query(&mut self.conn)
            .map_err(|e| format!("PTTL/GET/PERSIST {key}: {e}"))?;
        let expected = self.model.get(key).map(|(s, _)| lua_value(s));
        let Some(o) = written else {
            // An uncharged check writes nothing: the key is as the last charge left it.
            if value != expected || pttl != if expected.is_some() { -1 } else { -2 } {
                return Err(format!(
                    "{key}: an uncharged check changed it: it holds {value:?} (PTTL {pttl}), expected {expected:?} without a TTL"
                ));
            }
            return Ok(());
        };
        let px = o.ttl_us.div_ceil(1000) as i64;
        let waited = sent.elapsed().as_millis() as i64 + PTTL_SLACK_MS;
        if pttl == -2 {
            if waited < px {
                return Err(format!(
                    "{key}: missing right after a charge; its TTL should be {px} ms and only {waited} ms passed"
                ));
            }
            // Redis expired it in real time before it could be pinned: put it back.
            let value = expected.unwrap_or_default();
            redis::cmd("SET")
                .arg(key)
                .arg(&value)
                .query::<()>(&mut self.conn)
                .map_err(|e| format!("SET {key}: {e}"))?;
            self.restored += 1;
            return Ok(());
        }
        if value != expected {
            return Err(format!(
                "{key}: redis holds {value:?}, the rust state is {expected:?} ({:?})",
                o.next
            ));
        }
        if !(pttl >= 0 && pttl <= px && pttl >= px - waited) {
            return Err(format!(
                "{key}: PTTL {pttl} ms, expected the state's TTL of {} µs rounded up ({px} ms), less at most {waited} ms",
                o.ttl_us
            ));
        }
        Ok(())
    }

    /// One request at `at` through the Redis store, on a copy of `check`'s key: the
    /// timeline's state is left as it is.
    fn try_in_redis(&mut self, check: &Check<'_>, at: u64) -> Result<Decision, String> {
        let (key, scratch) = (self.redis.key(check), self.scratch.key(check));
        redis::pipe()
            .atomic()
            .cmd("DEL")
            .arg(&scratch)
            .ignore()
            .cmd("COPY")
            .arg(&key)
            .arg(&scratch)
            .ignore()
            .query::<()>(&mut self.conn)
            .map_err(|e| format!("COPY {key} {scratch}: {e}"))?;
        let d = self
            .h
            .rt
            .block_on(
                self.scratch
                    .decide_at(std::slice::from_ref(check), Some(at)),
            )
            .map_err(|e| format!("the redis store failed: {e}"))?;
        Ok(d[0])
    }
}

fn identities() -> Vec<IdentityDigest> {
    (0..IDENTITIES)
        .map(|i| digest_api_key(format!("agree-{i}").as_bytes()))
        .collect()
}

fn rule_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("r{i}")).collect()
}

// ---------------------------------------------------------------------------------------
// 1. Rust and Lua agree: 1-4 rules of random algorithms, 20-200 requests from 3 identities,
// each checking a random non-empty subset of the rules.

/// An allowed decision carries a wait only under a `max_delay`, and no longer than it.
fn check_wait(q: &Quota, d: &Decision) -> Result<(), TestCaseError> {
    if d.allowed && d.retry_after_us > q.max_delay_us {
        return Err(TestCaseError::fail(format!(
            "{q}: allowed with a wait of {} µs, more than max_delay ({} µs): {d:?}",
            d.retry_after_us, q.max_delay_us
        )));
    }
    if !d.allowed && d.retry_after_us == 0 {
        return Err(TestCaseError::fail(format!(
            "{q}: denied without a retry: {d:?}"
        )));
    }
    Ok(())
}

#[derive(Default)]
struct AgreeTally {
    cases: AtomicUsize,
    requests: AtomicUsize,
    multi_rule: AtomicUsize,
    allowed: [AtomicUsize; 4],
    denied: [AtomicUsize; 4],
    /// Allowed, charged, and told to wait for reserved tokens (token_bucket, gcra: the
    /// first two of [`ALGORITHMS`], the only ones with a `max_delay`).
    waited: [AtomicUsize; 2],
    /// Denied under a `max_delay` (token_bucket, gcra): the wait would have been too long.
    denied_delay: [AtomicUsize; 2],
    /// A rule said yes in a request an enforcing rule denied: it was not charged.
    uncharged_yes: AtomicUsize,
    shadow_checks: AtomicUsize,
    /// A shadow check said no in a request that passed: the others were charged.
    shadow_no_passed: AtomicUsize,
    /// A shadow check said yes in a request that passed: it was charged.
    shadow_yes_charged: AtomicUsize,
    /// A shadow check said yes in a request an enforcing rule denied: not charged.
    shadow_yes_uncharged: AtomicUsize,
    at_retry: AtomicUsize,
    before_retry: AtomicUsize,
    restored: AtomicUsize,
}

fn agree_case(h: &Harness, tl: &Timeline, tally: &AgreeTally) -> Result<(), TestCaseError> {
    let quotas: Vec<Quota> = tl.rules.iter().map(RuleSpec::quota).collect();
    let names = rule_names(quotas.len());
    let ids = identities();
    let mut replay = Replay::new(h);
    // (identity, rule) -> (time, decision) of the last request that checked it.
    let mut last: HashMap<(usize, usize), (u64, Decision)> = HashMap::new();
    let mut now = tl.start_us;
    for (i, req) in tl.requests.iter().enumerate() {
        let first = (req.identity, req.rules[0]);
        let (t, boundary) = next_time(req.gap, &quotas, now, last.get(&first).copied());
        now = t;
        let checks = req.checks(&ids, &names, &quotas);
        let at = |e: String| {
            TestCaseError::fail(format!(
                "request {i} ({req:?}) at +{} µs: {e}",
                now - tl.start_us
            ))
        };
        let got = replay.step(&checks, now).map_err(at)?;

        // Whether the request passed: every enforcing check allowed it.
        let passed = got.iter().zip(&checks).all(|(d, c)| d.allowed || c.shadow);
        for (d, c) in got.iter().zip(&checks) {
            let a = algorithm_index(c.quota.algorithm);
            check_wait(c.quota, d).map_err(|e| at(e.to_string()))?;
            if d.allowed {
                tally.allowed[a].fetch_add(1, Relaxed);
                if !passed {
                    tally.uncharged_yes.fetch_add(1, Relaxed);
                    // Not charged: nothing was reserved, so there is nothing to wait for.
                    prop_assert_eq!(d.retry_after_us, 0, "request {}: {:?}", i, d);
                } else if d.retry_after_us > 0 {
                    tally.waited[a].fetch_add(1, Relaxed);
                }
            } else {
                tally.denied[a].fetch_add(1, Relaxed);
                if c.quota.max_delay_us > 0 {
                    tally.denied_delay[a].fetch_add(1, Relaxed);
                }
            }
            if c.shadow {
                tally.shadow_checks.fetch_add(1, Relaxed);
                let which = match (d.allowed, passed) {
                    (false, true) => Some(&tally.shadow_no_passed),
                    (true, true) => Some(&tally.shadow_yes_charged),
                    (true, false) => Some(&tally.shadow_yes_uncharged),
                    (false, false) => None,
                };
                if let Some(n) = which {
                    n.fetch_add(1, Relaxed);
                }
            }
        }
        // A lone check sent exactly at (or 1 µs before) its key's last retry instant: that
        // key was not charged since, so the denial's promise must hold (with `max_delay`,
        // the request is then let through, maybe told to wait).
        if let (Some(early), [d]) = (boundary, got.as_slice()) {
            if early == 0 {
                prop_assert!(
                    d.allowed,
                    "request {}: denied at its own retry instant: {:?}",
                    i,
                    d
                );
                tally.at_retry.fetch_add(1, Relaxed);
            } else {
                prop_assert!(
                    !d.allowed,
                    "request {}: allowed 1 µs before its retry instant",
                    i
                );
                prop_assert_eq!(d.retry_after_us, 1, "request {}: {:?}", i, d);
                tally.before_retry.fetch_add(1, Relaxed);
            }
        }
        for (&r, d) in req.rules.iter().zip(&got) {
            last.insert((req.identity, r), (now, *d));
        }
        if checks.len() > 1 {
            tally.multi_rule.fetch_add(1, Relaxed);
        }
    }
    tally.requests.fetch_add(tl.requests.len(), Relaxed);
    tally.restored.fetch_add(replay.restored, Relaxed);
    tally.cases.fetch_add(1, Relaxed);
    Ok(())
}

#[test]
fn rust_and_lua_agree_for_all_four_algorithms() {
    let _watch = common::watchdog();
    let h = Harness::start();
    let tally = AgreeTally::default();
    let started = Instant::now();
    crate::proptest_seeds!("algorithms_agree::rust_and_lua_agree_for_all_four_algorithms", 64, |(tl in timeline(4))| {
        agree_case(&h, &tl, &tally)?;
    });

    let load = |c: &[AtomicUsize; 4]| c.each_ref().map(|v| v.load(Relaxed));
    let (allowed, denied) = (load(&tally.allowed), load(&tally.denied));
    let waited = tally.waited.each_ref().map(|v| v.load(Relaxed));
    let denied_delay = tally.denied_delay.each_ref().map(|v| v.load(Relaxed));
    let n = |c: &AtomicUsize| c.load(Relaxed);
    eprintln!(
        "{} cases, {} requests ({} multi-rule) in {:?}: allowed {allowed:?} / denied {denied:?} \
         (token_bucket, gcra, fixed_window, sliding_window); allowed with a wait {waited:?} / \
         denied under max_delay {denied_delay:?} (token_bucket, gcra); {} uncharged yes; {} \
         shadow checks: {} no in a request that passed, {} yes charged, {} yes uncharged; \
         retry instant {} at / {} 1 µs before; {} keys put back after a real-time expiry",
        n(&tally.cases),
        n(&tally.requests),
        n(&tally.multi_rule),
        started.elapsed(),
        n(&tally.uncharged_yes),
        n(&tally.shadow_checks),
        n(&tally.shadow_no_passed),
        n(&tally.shadow_yes_charged),
        n(&tally.shadow_yes_uncharged),
        n(&tally.at_retry),
        n(&tally.before_retry),
        n(&tally.restored),
    );
    // The timelines must have exercised both answers of every algorithm.
    for (k, a) in ALGORITHMS.iter().enumerate() {
        assert!(
            allowed[k] >= 50,
            "{a:?}: only {} allowed decisions",
            allowed[k]
        );
        assert!(
            denied[k] >= 50,
            "{a:?}: only {} denied decisions",
            denied[k]
        );
    }
    // And waits, and denials beyond max_delay, of both bucket algorithms (few: in a
    // multi-rule request another rule often denies first; 2 and 4 test them at length).
    for (k, a) in ALGORITHMS[..2].iter().enumerate() {
        assert!(
            waited[k] >= 5,
            "{a:?}: only {} requests allowed with a wait",
            waited[k]
        );
        assert!(
            denied_delay[k] >= 5,
            "{a:?}: only {} denials under a max_delay",
            denied_delay[k]
        );
    }
    assert!(
        n(&tally.uncharged_yes) >= 50,
        "all-or-nothing barely exercised"
    );
    assert!(
        n(&tally.shadow_no_passed) >= 20,
        "shadow denials barely exercised"
    );
    assert!(
        n(&tally.shadow_yes_charged) >= 20,
        "charged shadow checks barely exercised"
    );
    assert!(
        n(&tally.shadow_yes_uncharged) >= 20,
        "uncharged shadow checks barely exercised"
    );
    assert!(n(&tally.at_retry) >= 15, "retry instants barely hit");
    assert!(n(&tally.before_retry) >= 15, "retry instants barely hit");
}

// ---------------------------------------------------------------------------------------
// 2. A denial's retry is exact. Single-rule timelines (of any algorithm, then of buckets
// that always have a max_delay), replayed as in 1; for every request, against the state it
// saw (or left), without committing anything:
// - denied with retry R: at now + R the same request passes (under a max_delay, maybe told
//   to wait) and at now + R - 1 it does not, by the pure step function and by the Lua
//   script on a copy of the key;
// - allowed and told to wait W (max_delay): had it come W later, it would have passed at
//   once without a wait, and 1 µs earlier than that not;
// - `remaining` is exact: `remaining` more requests of cost 1 pass now without a wait, not
//   one more;
// - `reset` is exact: at now + reset the key answers as a brand-new one, 1 µs earlier not.

#[derive(Default)]
struct RetryTally {
    /// Denials whose retry instant was tried (in Rust and in Redis), per algorithm.
    denials: [AtomicUsize; 4],
    /// Of those, denials under a max_delay (token_bucket, gcra).
    delay_denials: [AtomicUsize; 2],
    /// Waits whose end was tried (token_bucket, gcra).
    waits: [AtomicUsize; 2],
    remaining_checked: AtomicUsize,
    resets_checked: AtomicUsize,
}

/// Whether two outcomes answer the same (their stored states may differ in form).
fn same_answer(a: &Ruling<State>, b: &Ruling<State>) -> bool {
    a.allowed == b.allowed && a.charged == b.charged && a.uncharged == b.uncharged
}

fn retry_case(h: &Harness, tl: &Timeline, tally: &RetryTally) -> Result<(), TestCaseError> {
    let spec = tl.rules[0];
    let q = spec.quota();
    let a = algorithm_index(q.algorithm);
    let ids = identities();
    let mut replay = Replay::new(h);
    let mut last: HashMap<usize, (u64, Decision)> = HashMap::new();
    let mut now = tl.start_us;
    for (i, req) in tl.requests.iter().enumerate() {
        now = next_time(req.gap, &[q], now, last.get(&req.identity).copied()).0;
        let check = Check {
            shadow: req.shadow[0],
            ..Check::new(&ids[req.identity], "r0", &q)
        };
        let ctx = |e: String| {
            TestCaseError::fail(format!(
                "request {i} ({req:?}) at +{} µs: {e}",
                now - tl.start_us
            ))
        };
        let before = replay.state(&check, now);
        let d = replay
            .step(std::slice::from_ref(&check), now)
            .map_err(ctx)?[0];
        last.insert(req.identity, (now, d));
        check_wait(&q, &d).map_err(|e| ctx(e.to_string()))?;

        if d.allowed && d.retry_after_us > 0 {
            // Its tokens are there in W: had it come then, it would have passed at once.
            let w = d.retry_after_us;
            let then = limiter::decide(&q, before.as_ref(), now + w);
            let sooner = limiter::decide(&q, before.as_ref(), now + w - 1);
            prop_assert!(
                passes_now(&then),
                "request {}: {:?} told to wait {} µs, but then: {:?}",
                i,
                before,
                w,
                then
            );
            prop_assert!(
                !passes_now(&sooner),
                "request {}: {:?} told to wait {} µs, but passes at once 1 µs sooner",
                i,
                before,
                w
            );
            tally.waits[a].fetch_add(1, Relaxed);
        } else if !d.allowed {
            // Nothing is charged in between: at now + R the same request passes, and at
            // now + R - 1 it still does not.
            let r = d.retry_after_us;
            let at = limiter::decide(&q, before.as_ref(), now + r);
            let early = limiter::decide(&q, before.as_ref(), now + r - 1);
            prop_assert!(
                at.allowed,
                "request {}: {:?} retry {} µs, still denied then: {:?}",
                i,
                before,
                r,
                at.uncharged
            );
            prop_assert!(
                !early.allowed,
                "request {}: {:?} retry {} µs, but allowed 1 µs earlier",
                i,
                before,
                r
            );
            // The Lua twin on a copy of the key.
            let lua_at = replay.try_in_redis(&check, now + r).map_err(ctx)?;
            prop_assert_eq!(
                lua_at,
                at.charged,
                "request {}: redis at the retry instant",
                i
            );
            let lua_early = replay.try_in_redis(&check, now + r - 1).map_err(ctx)?;
            prop_assert_eq!(
                lua_early,
                early.uncharged,
                "request {}: redis 1 µs before the retry instant",
                i
            );
            tally.denials[a].fetch_add(1, Relaxed);
            if q.max_delay_us > 0 {
                tally.delay_denials[a].fetch_add(1, Relaxed);
            }
        }

        // The state this request left (unchanged when denied).
        let after = replay.state(&check, now);
        // `remaining` requests of cost 1 still pass now without a wait, and not one more: at
        // one instant that is one request of cost `remaining` passing at once, and of cost
        // `remaining + 1` not.
        if d.remaining > 0 {
            let q_rem = spec.quota_with_cost(d.remaining).map_err(|e| {
                TestCaseError::fail(format!(
                    "request {i}: remaining {} is not a valid cost: {e}",
                    d.remaining
                ))
            })?;
            prop_assert!(
                passes_now(&limiter::decide(&q_rem, after.as_ref(), now)),
                "request {}: {:?} but {} more do not pass",
                i,
                d,
                d.remaining
            );
        }
        if let Ok(q_more) = spec.quota_with_cost(d.remaining + 1) {
            prop_assert!(
                !passes_now(&limiter::decide(&q_more, after.as_ref(), now)),
                "request {}: {:?} but {} more pass",
                i,
                d,
                d.remaining + 1
            );
        }
        tally.remaining_checked.fetch_add(1, Relaxed);
        // At now + reset the key answers as a brand-new one, and 1 µs earlier it does not.
        let t = now + d.reset_us;
        prop_assert!(
            same_answer(
                &limiter::decide(&q, after.as_ref(), t),
                &limiter::decide(&q, None, t)
            ),
            "request {}: {:?}: not full again after reset {} µs",
            i,
            d,
            d.reset_us
        );
        if d.reset_us > 0 {
            prop_assert!(
                !same_answer(
                    &limiter::decide(&q, after.as_ref(), t - 1),
                    &limiter::decide(&q, None, t - 1)
                ),
                "request {}: {:?}: already full 1 µs before reset {} µs",
                i,
                d,
                d.reset_us
            );
        }
        tally.resets_checked.fetch_add(1, Relaxed);
    }
    Ok(())
}

#[test]
fn retry_after_is_exact_for_all_four_algorithms() {
    let _watch = common::watchdog();
    let h = Harness::start();
    let tally = RetryTally::default();
    let started = Instant::now();
    crate::proptest_seeds!("algorithms_agree::retry_after_is_exact_for_all_four_algorithms", 64, |(tl in timeline(1))| {
        retry_case(&h, &tl, &tally)?;
    });
    // And more waits: a token bucket or GCRA with a max_delay, every time.
    let waiting = rule_spec(&[Algorithm::TokenBucket, Algorithm::Gcra], 0);
    crate::proptest_seeds!("algorithms_agree::retry_after_is_exact_for_all_four_algorithms", 16, |(tl in timeline_of(&waiting, 1))| {
        retry_case(&h, &tl, &tally)?;
    });
    let denials = tally.denials.each_ref().map(|v| v.load(Relaxed));
    let delay_denials = tally.delay_denials.each_ref().map(|v| v.load(Relaxed));
    let waits = tally.waits.each_ref().map(|v| v.load(Relaxed));
    eprintln!(
        "retry instants tried for {denials:?} denials (token_bucket, gcra, fixed_window, \
         sliding_window), {delay_denials:?} of them under a max_delay, and the end of \
         {waits:?} waits (token_bucket, gcra); {} remaining and {} resets checked, in {:?}",
        tally.remaining_checked.load(Relaxed),
        tally.resets_checked.load(Relaxed),
        started.elapsed()
    );
    for (k, a) in ALGORITHMS.iter().enumerate() {
        assert!(denials[k] >= 20, "{a:?}: only {} denials tried", denials[k]);
    }
    for (k, a) in ALGORITHMS[..2].iter().enumerate() {
        assert!(
            delay_denials[k] >= 5,
            "{a:?}: only {} denials under a max_delay tried",
            delay_denials[k]
        );
        assert!(waits[k] >= 10, "{a:?}: only {} waits tried", waits[k]);
    }
}

// ---------------------------------------------------------------------------------------
// 3. A state some other algorithm wrote (the rule's algorithm changed on reload) counts as
// none, in both stores: the same answer as a brand-new key, and no error.

#[test]
fn wrong_algorithm_state_counts_as_none() {
    let _watch = common::watchdog();
    let h = Harness::start();
    let spec = |algorithm, count, period_s, cost| RuleSpec {
        algorithm,
        count,
        period_s,
        burst: None,
        cost,
        max_delay_us: None,
    };
    let (x, fresh) = (
        digest_api_key(b"changed-rule"),
        digest_api_key(b"brand-new"),
    );
    let t0 = EPOCH_US + 1_234_567;
    let t1 = t0 + 1_000;
    for old in ALGORITHMS {
        for new in ALGORITHMS {
            if old == new {
                continue;
            }
            let what = format!("{old:?} state read by {new:?}");
            let (q_old, q_new) = (spec(old, 2, 10, 1).quota(), spec(new, 5, 7, 2).quota());
            let mut replay = Replay::new(&h);
            let step = |replay: &mut Replay<'_>, c: Check<'_>, t| {
                replay
                    .step(std::slice::from_ref(&c), t)
                    .unwrap_or_else(|e| panic!("{what}: {e}"))[0]
            };
            let old_check = Check::new(&x, "r", &q_old);
            // Exhaust the old quota: its state is far from a fresh one.
            let answers: Vec<bool> = (0..3)
                .map(|_| step(&mut replay, old_check.clone(), t0).allowed)
                .collect();
            assert_eq!(answers, [true, true, false], "{what}: the old quota");
            let old_state = replay.state(&old_check, t1).expect("the old state");

            let changed = step(&mut replay, Check::new(&x, "r", &q_new), t1);
            let brand_new = step(&mut replay, Check::new(&fresh, "r", &q_new), t1);
            assert_eq!(
                changed, brand_new,
                "{what}: not the same as a brand-new key"
            );
            assert_eq!(
                changed,
                Decision {
                    allowed: true,
                    remaining: 3,
                    retry_after_us: 0,
                    reset_us: limiter::decide(&q_new, None, t1).charged.reset_us,
                    window: limiter::decide(&q_new, None, t1).charged.window,
                },
                "{what}"
            );
            assert_eq!(
                limiter::decide(&q_new, Some(&old_state), t1),
                limiter::decide(&q_new, None, t1),
                "{what}: the pure step function"
            );
            // The new algorithm's state replaced the old one (Replay::step checked the
            // value is exactly the Rust state), and it is read back as its own.
            let key = replay.redis.key(&old_check);
            let value: String = redis::cmd("GET")
                .arg(&key)
                .query(&mut replay.conn)
                .expect("GET");
            let tag = match new {
                Algorithm::TokenBucket => "t:",
                Algorithm::Gcra => "g:",
                Algorithm::FixedWindow => "f:",
                Algorithm::SlidingWindow => "s:",
                Algorithm::Concurrency => unreachable!("not among ALGORITHMS"),
            };
            assert!(value.starts_with(tag), "{what}: redis holds {value:?}");
            let again = step(&mut replay, Check::new(&x, "r", &q_new), t1);
            assert_eq!(
                again.remaining, 1,
                "{what}: the new state was not read back"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// 4. With a max_delay, the token bucket and GCRA still admit exactly the same requests and
// tell them the same waits and retries: 1-3 bucket rules (most with a max_delay), each
// replayed as a token bucket and as GCRA, through both stores (as in 1). Their states
// differ (a level below empty, a TAT ahead); their decisions may not.

#[derive(Default)]
struct TwinTally {
    requests: AtomicUsize,
    allowed: AtomicUsize,
    waited: AtomicUsize,
    denied: AtomicUsize,
    denied_delay: AtomicUsize,
    shadow_no_passed: AtomicUsize,
}

fn twins_case(h: &Harness, tl: &Timeline, tally: &TwinTally) -> Result<(), TestCaseError> {
    let as_quotas = |algorithm| -> Vec<Quota> {
        tl.rules
            .iter()
            .map(|s| RuleSpec { algorithm, ..*s }.quota())
            .collect()
    };
    let (tb, gcra) = (
        as_quotas(Algorithm::TokenBucket),
        as_quotas(Algorithm::Gcra),
    );
    let names = rule_names(tl.rules.len());
    let ids = identities();
    let (mut r_tb, mut r_gcra) = (Replay::new(h), Replay::new(h));
    let mut last: HashMap<(usize, usize), (u64, Decision)> = HashMap::new();
    let mut now = tl.start_us;
    for (i, req) in tl.requests.iter().enumerate() {
        let first = (req.identity, req.rules[0]);
        now = next_time(req.gap, &tb, now, last.get(&first).copied()).0;
        let at = |which: &str, e: String| {
            TestCaseError::fail(format!(
                "request {i} ({req:?}) at +{} µs, as {which}: {e}",
                now - tl.start_us
            ))
        };
        let (checks_tb, checks_gcra) = (
            req.checks(&ids, &names, &tb),
            req.checks(&ids, &names, &gcra),
        );
        let d_tb = r_tb
            .step(&checks_tb, now)
            .map_err(|e| at("token_bucket", e))?;
        let d_gcra = r_gcra.step(&checks_gcra, now).map_err(|e| at("gcra", e))?;
        prop_assert_eq!(
            &d_tb,
            &d_gcra,
            "request {} at +{} µs: the token bucket and GCRA disagree (left token_bucket, \
             right gcra)",
            i,
            now - tl.start_us
        );
        let passed = d_tb
            .iter()
            .zip(&checks_tb)
            .all(|(d, c)| d.allowed || c.shadow);
        for (d, c) in d_tb.iter().zip(&checks_tb) {
            check_wait(c.quota, d).map_err(|e| at("token_bucket", e.to_string()))?;
            match (d.allowed, d.retry_after_us > 0) {
                (true, false) => &tally.allowed,
                (true, true) => &tally.waited,
                (false, _) if c.quota.max_delay_us > 0 => &tally.denied_delay,
                (false, _) => &tally.denied,
            }
            .fetch_add(1, Relaxed);
            if c.shadow && !d.allowed && passed {
                tally.shadow_no_passed.fetch_add(1, Relaxed);
            }
        }
        for (&r, d) in req.rules.iter().zip(&d_tb) {
            last.insert((req.identity, r), (now, *d));
        }
    }
    tally.requests.fetch_add(tl.requests.len(), Relaxed);
    Ok(())
}

#[test]
fn token_bucket_and_gcra_agree_with_max_delay() {
    let _watch = common::watchdog();
    let h = Harness::start();
    let tally = TwinTally::default();
    let started = Instant::now();
    // Bucket rules with a max_delay 4 times in 5.
    let rules = rule_spec(&[Algorithm::TokenBucket], 1);
    crate::proptest_seeds!("algorithms_agree::token_bucket_and_gcra_agree_with_max_delay", 16, |(tl in timeline_of(&rules, 3))| {
        twins_case(&h, &tl, &tally)?;
    });
    let n = |c: &AtomicUsize| c.load(Relaxed);
    eprintln!(
        "token_bucket and gcra agreed on {} requests in {:?}: {} allowed at once, {} allowed \
         with a wait, {} denied under a max_delay, {} denied without one; {} shadow denials \
         in requests that passed",
        n(&tally.requests),
        started.elapsed(),
        n(&tally.allowed),
        n(&tally.waited),
        n(&tally.denied_delay),
        n(&tally.denied),
        n(&tally.shadow_no_passed),
    );
    assert!(n(&tally.allowed) >= 100, "too few allowed at once");
    assert!(n(&tally.waited) >= 50, "too few allowed with a wait");
    assert!(
        n(&tally.denied_delay) >= 50,
        "too few denied under a max_delay"
    );
    assert!(n(&tally.shadow_no_passed) >= 10, "too few shadow denials");
}

// ---------------------------------------------------------------------------------------
// 5. A clock stepped back (Redis failing over to a replica whose clock is behind, an NTP
// step) never reopens a window, in Lua as in Rust: a timeline that steps back, now and
// then 1 µs back across a window start, replayed through both stores (as in 1). A request
// timed before the latest time its window's state knows is decided at that time, so a
// fixed window's start and a sliding window's index never move back, and fixed windows
// never overlap: N per window at most.

/// How the clock moves before a request: forward, back, or to just past the next window
/// start and then back across it.
#[derive(Debug, Clone, Copy)]
enum Step {
    Forward(u64),
    Back(u64),
    /// A request at the next window start (a fixed window's end; the next multiple of the
    /// period), then this one this many µs before it.
    AcrossEdge(u64),
}

fn back_case(h: &Harness, spec: RuleSpec, steps: &[Step]) -> Result<(), TestCaseError> {
    let q = spec.quota();
    let p = q.period_us();
    let id = digest_api_key(b"stepped-back");
    let check = Check::new(&id, "w", &q);
    let mut replay = Replay::new(h);
    let key = replay.redis.key(&check);
    let mut now = EPOCH_US;
    let mut admitted: HashMap<u64, u64> = HashMap::new();
    for (i, &step) in steps.iter().enumerate() {
        let fail = |e: String| TestCaseError::fail(format!("request {i} ({step:?}): {e}"));
        let held = |r: &Replay<'_>| r.model.get(&key).map(|(s, _)| *s);
        now = match step {
            Step::Forward(us) => now + us,
            Step::Back(us) => now - us,
            Step::AcrossEdge(back) => {
                let edge = match held(&replay) {
                    Some(State::FixedWindow(f)) => f.start_us + p,
                    _ => (now / p + 1) * p,
                };
                replay
                    .step(std::slice::from_ref(&check), edge)
                    .map_err(fail)?;
                edge - back
            }
        };
        let before = held(&replay);
        let d = replay
            .step(std::slice::from_ref(&check), now)
            .map_err(fail)?;
        match (before, held(&replay)) {
            (Some(State::FixedWindow(a)), Some(State::FixedWindow(b))) => prop_assert!(
                b.start_us == a.start_us || b.start_us >= a.start_us + p,
                "request {}: a window from {} after one from {}: they overlap",
                i,
                b.start_us,
                a.start_us
            ),
            (Some(State::SlidingWindow(a)), Some(State::SlidingWindow(b))) => prop_assert!(
                b.window >= a.window,
                "request {}: window {} after window {}",
                i,
                b.window,
                a.window
            ),
            _ => {}
        }
        if let (true, Some(State::FixedWindow(f))) = (d[0].allowed, held(&replay)) {
            let n = admitted.entry(f.start_us).or_default();
            *n += q.cost;
            prop_assert!(
                *n <= q.rate.count,
                "{} admitted in the window from {}",
                n,
                f.start_us
            );
        }
    }
    Ok(())
}

#[test]
fn a_clock_stepped_back_never_reopens_a_window() {
    let _watch = common::watchdog();
    let h = Harness::start();
    let started = Instant::now();
    let spec = (
        prop::sample::select(vec![Algorithm::FixedWindow, Algorithm::SlidingWindow]),
        prop::sample::select(vec![1u64, 2, 3, 5, 10, 60]),
        prop::sample::select(vec![1u64, 2, 10, 60]),
        1u64..3,
    )
        .prop_map(|(algorithm, count, period_s, cost)| RuleSpec {
            algorithm,
            count,
            period_s,
            burst: None,
            cost: cost.min(count),
            max_delay_us: None,
        });
    let steps = prop::collection::vec(
        prop_oneof![
            3 => (0u64..3_000_000).prop_map(Step::Forward),
            1 => (1u64..2_000_000).prop_map(Step::Back),
            2 => prop_oneof![Just(1u64), 1u64..1_000].prop_map(Step::AcrossEdge),
        ],
        5..80,
    );
    crate::proptest_seeds!("algorithms_agree::a_clock_stepped_back_never_reopens_a_window", 40, |(spec in &spec, steps in &steps)| {
        back_case(&h, spec, &steps)?;
    });
    eprintln!("stepped-back timelines agreed in {:?}", started.elapsed());
}
