//! The Rust step functions (`src/limiter/*.rs`, run by the memory store) and their Lua
//! twins (`lua/*.lua`, run by the Redis store) must agree on every decision, for all four
//! algorithms, on random timelines: one rule or several at once (all or nothing), awkward
//! rates, bursts and costs, and gaps that land exactly on the instants where a decision
//! flips (a retry instant, a reset, a sliding window's edge).
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

mod common;

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::RedisServer;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use ratewall::config::Rate;
use ratewall::identity::digest_api_key;
use ratewall::limiter::memory::MemoryStore;
use ratewall::limiter::redis::RedisStore;
use ratewall::limiter::{
    self, Algorithm, Check, Decision, IdentityDigest, ManualClock, Outcome, Quota, State,
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

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        // A failure prints its shrunk timeline; nothing is written into the repository.
        failure_persistence: None,
        max_shrink_iters: 2_000,
        max_shrink_time: 120_000,
        ..ProptestConfig::default()
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
}

impl RuleSpec {
    fn quota_with_cost(&self, cost: u64) -> Result<Quota, String> {
        Quota::new(
            self.algorithm,
            Rate {
                count: self.count,
                period: Duration::from_secs(self.period_s),
            },
            self.burst.and_then(NonZeroU64::new),
            NonZeroU64::new(cost).ok_or("cost 0")?,
        )
        .map_err(|e| e.to_string())
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
    /// less 0/1 µs. The same instant when that key's last decision was not a denial.
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
}

#[derive(Debug, Clone)]
struct Timeline {
    start_us: u64,
    rules: Vec<RuleSpec>,
    requests: Vec<Req>,
}

fn rule_spec() -> impl Strategy<Value = RuleSpec> {
    (
        prop::sample::select(ALGORITHMS.to_vec()),
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
        .prop_flat_map(|(algorithm, count, period_s, burst)| {
            // The cost may be anything up to the burst (or the window's N).
            let most = burst.unwrap_or(count);
            prop_oneof![3 => Just(1), 1 => 1..=most, 1 => Just(most)].prop_map(move |cost| {
                RuleSpec {
                    algorithm,
                    count,
                    period_s,
                    burst,
                    cost,
                }
            })
        })
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
    (gap(rules), 0..IDENTITIES, which).prop_map(|(gap, identity, rules)| Req {
        gap,
        identity,
        rules,
    })
}

/// 1..=`max_rules` rules and 20..=200 requests, starting somewhere in the day after
/// [`EPOCH_US`] so that window edges fall in varied places.
fn timeline(max_rules: usize) -> impl Strategy<Value = Timeline> {
    (
        0..=86_400_000_000u64,
        prop::collection::vec(rule_spec(), 1..=max_rules),
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

/// How long `q`'s state can matter after a charge: a full refill, or two periods.
fn longest_state_us(q: &Quota) -> u64 {
    if q.algorithm.has_burst() {
        q.capacity().div_ceil(q.per_us)
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
    }
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
        let outcomes: Vec<Outcome<State>> = checks
            .iter()
            .zip(&before)
            .map(|(c, s)| limiter::decide(c.quota, s.as_ref(), now))
            .collect();
        let all = outcomes.iter().all(|o| o.allowed);
        let from_pure: Vec<Decision> = outcomes
            .iter()
            .map(|o| if all { o.charged } else { o.uncharged })
            .collect();
        let quotas: Vec<String> = checks
            .iter()
            .map(|c| format!("{} {} ({:?})", c.rule, c.quota, c.quota.algorithm))
            .collect();

        self.clock.set(now);
        let from_memory = self.memory.decide(checks);
        if from_memory != from_pure {
            return Err(format!(
                "the memory store and the pure step functions disagree\n quotas: {quotas:?}\n states before: {before:?}\n memory: {from_memory:?}\n   pure: {from_pure:?}"
            ));
        }

        let sent = Instant::now();
        let from_redis = self
            .h
            .rt
            .block_on(self.redis.decide(checks, Some(now)))
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

        for (c, o) in checks.iter().zip(&outcomes) {
            let key = self.redis.key(c);
            if all {
                self.model.insert(key.clone(), (o.next, now + o.ttl_us));
            }
            self.pin(&key, all.then_some(o), sent)?;
        }
        Ok(from_memory)
    }

    /// Check what Redis holds at `key` after a request, then remove its TTL.
    /// `written`: the outcome the request wrote there, if it was allowed.
    fn pin(
        &mut self,
        key: &str,
        written: Option<&Outcome<State>>,
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
            // A denied request writes nothing: the key is as the last allowed one left it.
            if value != expected || pttl != if expected.is_some() { -1 } else { -2 } {
                return Err(format!(
                    "{key}: a denied request changed it: it holds {value:?} (PTTL {pttl}), expected {expected:?} without a TTL"
                ));
            }
            return Ok(());
        };
        let px = o.ttl_us.div_ceil(1000) as i64;
        let waited = sent.elapsed().as_millis() as i64 + PTTL_SLACK_MS;
        if pttl == -2 {
            if waited < px {
                return Err(format!(
                    "{key}: missing right after an allowed request; its TTL should be {px} ms and only {waited} ms passed"
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
            .block_on(self.scratch.decide(std::slice::from_ref(check), Some(at)))
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

#[derive(Default)]
struct AgreeTally {
    cases: AtomicUsize,
    requests: AtomicUsize,
    multi_rule: AtomicUsize,
    allowed: [AtomicUsize; 4],
    denied: [AtomicUsize; 4],
    /// A rule said yes in a request another rule denied: it was not charged.
    uncharged_yes: AtomicUsize,
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
        let checks: Vec<Check<'_>> = req
            .rules
            .iter()
            .map(|&r| Check {
                identity: &ids[req.identity],
                rule: &names[r],
                quota: &quotas[r],
            })
            .collect();
        let got = replay.step(&checks, now).map_err(|e| {
            TestCaseError::fail(format!(
                "request {i} ({req:?}) at +{} µs: {e}",
                now - tl.start_us
            ))
        })?;

        let all = got.iter().all(|d| d.allowed);
        for (d, c) in got.iter().zip(&checks) {
            let a = algorithm_index(c.quota.algorithm);
            if d.allowed {
                tally.allowed[a].fetch_add(1, Relaxed);
                prop_assert_eq!(d.retry_after_us, 0, "request {}: allowed with a retry", i);
                if !all {
                    tally.uncharged_yes.fetch_add(1, Relaxed);
                }
            } else {
                tally.denied[a].fetch_add(1, Relaxed);
                prop_assert!(
                    d.retry_after_us > 0,
                    "request {}: denied without a retry: {:?}",
                    i,
                    d
                );
            }
        }
        // A lone check sent exactly at (or 1 µs before) its key's last retry instant: that
        // key was not charged since, so the denial's promise must hold.
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
    let h = Harness::start();
    let tally = AgreeTally::default();
    let started = Instant::now();
    proptest!(config(64), |(tl in timeline(4))| {
        agree_case(&h, &tl, &tally)?;
    });

    let load = |c: &[AtomicUsize; 4]| c.each_ref().map(|v| v.load(Relaxed));
    let (allowed, denied) = (load(&tally.allowed), load(&tally.denied));
    eprintln!(
        "{} cases, {} requests ({} multi-rule) in {:?}: allowed {allowed:?} / denied {denied:?} \
         (token_bucket, gcra, fixed_window, sliding_window); {} uncharged yes; retry instant \
         {} at / {} 1 µs before; {} keys put back after a real-time expiry",
        tally.cases.load(Relaxed),
        tally.requests.load(Relaxed),
        tally.multi_rule.load(Relaxed),
        started.elapsed(),
        tally.uncharged_yes.load(Relaxed),
        tally.at_retry.load(Relaxed),
        tally.before_retry.load(Relaxed),
        tally.restored.load(Relaxed),
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
    assert!(
        tally.uncharged_yes.load(Relaxed) >= 50,
        "all-or-nothing barely exercised"
    );
    assert!(
        tally.at_retry.load(Relaxed) >= 15,
        "retry instants barely hit"
    );
    assert!(
        tally.before_retry.load(Relaxed) >= 15,
        "retry instants barely hit"
    );
}

// ---------------------------------------------------------------------------------------
// 2. A denial's retry is exact. Single-rule timelines, replayed as in 1; for every request,
// against the state it saw (or left), without committing anything:
// - denied with retry R: at now + R the same request passes and at now + R - 1 it does not,
//   by the pure step function and by the Lua script on a copy of the key;
// - `remaining` is exact: `remaining` more requests of cost 1 pass now, not one more;
// - `reset` is exact: at now + reset the key answers as a brand-new one, 1 µs earlier not.

#[derive(Default)]
struct RetryTally {
    /// Denials whose retry instant was tried (in Rust and in Redis), per algorithm.
    denials: [AtomicUsize; 4],
    remaining_checked: AtomicUsize,
    resets_checked: AtomicUsize,
}

/// Whether two outcomes answer the same (their stored states may differ in form).
fn same_answer(a: &Outcome<State>, b: &Outcome<State>) -> bool {
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
            identity: &ids[req.identity],
            rule: "r0",
            quota: &q,
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

        if d.allowed {
            prop_assert_eq!(d.retry_after_us, 0, "request {}: allowed with a retry", i);
        } else {
            // Nothing is charged in between: at now + R the same request passes, and at
            // now + R - 1 it still does not.
            let r = d.retry_after_us;
            prop_assert!(r > 0, "request {}: denied without a retry: {:?}", i, d);
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
        }

        // The state this request left (unchanged when denied).
        let after = replay.state(&check, now);
        // `remaining` requests of cost 1 still pass now, and not one more: at one instant
        // that is one request of cost `remaining` passing, and of cost `remaining + 1` not.
        if d.remaining > 0 {
            let q_rem = spec.quota_with_cost(d.remaining).map_err(|e| {
                TestCaseError::fail(format!(
                    "request {i}: remaining {} is not a valid cost: {e}",
                    d.remaining
                ))
            })?;
            prop_assert!(
                limiter::decide(&q_rem, after.as_ref(), now).allowed,
                "request {}: {:?} but {} more do not pass",
                i,
                d,
                d.remaining
            );
        }
        if let Ok(q_more) = spec.quota_with_cost(d.remaining + 1) {
            prop_assert!(
                !limiter::decide(&q_more, after.as_ref(), now).allowed,
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
    let h = Harness::start();
    let tally = RetryTally::default();
    let started = Instant::now();
    proptest!(config(64), |(tl in timeline(1))| {
        retry_case(&h, &tl, &tally)?;
    });
    let denials = tally.denials.each_ref().map(|v| v.load(Relaxed));
    eprintln!(
        "retry instants tried for {denials:?} denials (token_bucket, gcra, fixed_window, \
         sliding_window), {} remaining and {} resets checked, in {:?}",
        tally.remaining_checked.load(Relaxed),
        tally.resets_checked.load(Relaxed),
        started.elapsed()
    );
    for (k, a) in ALGORITHMS.iter().enumerate() {
        assert!(denials[k] >= 20, "{a:?}: only {} denials tried", denials[k]);
    }
}

// ---------------------------------------------------------------------------------------
// 3. A state some other algorithm wrote (the rule's algorithm changed on reload) counts as
// none, in both stores: the same answer as a brand-new key, and no error.

#[test]
fn wrong_algorithm_state_counts_as_none() {
    let h = Harness::start();
    let spec = |algorithm, count, period_s, cost| RuleSpec {
        algorithm,
        count,
        period_s,
        burst: None,
        cost,
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
            let old_check = Check {
                identity: &x,
                rule: "r",
                quota: &q_old,
            };
            // Exhaust the old quota: its state is far from a fresh one.
            let answers: Vec<bool> = (0..3)
                .map(|_| step(&mut replay, old_check.clone(), t0).allowed)
                .collect();
            assert_eq!(answers, [true, true, false], "{what}: the old quota");
            let old_state = replay.state(&old_check, t1).expect("the old state");

            let changed = step(
                &mut replay,
                Check {
                    identity: &x,
                    rule: "r",
                    quota: &q_new,
                },
                t1,
            );
            let brand_new = step(
                &mut replay,
                Check {
                    identity: &fresh,
                    rule: "r",
                    quota: &q_new,
                },
                t1,
            );
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
            };
            assert!(value.starts_with(tag), "{what}: redis holds {value:?}");
            let again = step(
                &mut replay,
                Check {
                    identity: &x,
                    rule: "r",
                    quota: &q_new,
                },
                t1,
            );
            assert_eq!(
                again.remaining, 1,
                "{what}: the new state was not read back"
            );
        }
    }
}
