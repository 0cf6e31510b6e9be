//! What `settle_agree` replays its timelines through: the shared store under test (one
//! Redis, or a cluster), a memory store on a manual clock beside it, and a model of what
//! the memory store holds, with what each step must have left at each Redis key.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{key_slot, RedisCluster, RedisServer};
use ratewall::identity::IdentityDigest;
use ratewall::limiter::memory::MemoryStore;
use ratewall::limiter::redis::{DecideAt, RedisClusterStore, RedisStore};
use ratewall::limiter::store::{Receipt, Settlement};
use ratewall::limiter::{self, Adjust, Check, Decision, ManualClock, Settled, State, StoreError};

/// Slack, in ms, when comparing a key's PTTL with the real time since the script ran.
const PTTL_SLACK_MS: i64 = 5;

// ---------------------------------------------------------------------------------------
// The shared store under test: one Redis, or a cluster.

pub(super) enum Shared {
    One(RedisStore),
    Cluster(Box<RedisClusterStore>),
}

impl Shared {
    pub(super) fn key(&self, c: &Check<'_>) -> String {
        match self {
            Shared::One(s) => s.key(c),
            Shared::Cluster(s) => s.key(c),
        }
    }

    async fn decide(&self, checks: &[Check<'_>], now: u64) -> Result<Vec<Decision>, StoreError> {
        match self {
            Shared::One(s) => s.decide_at(checks, Some(now)).await,
            Shared::Cluster(s) => s.decide_at(checks, Some(now)).await,
        }
    }

    async fn settle(&self, items: &[Settlement<'_>], now: u64) -> Result<Vec<Receipt>, StoreError> {
        match self {
            Shared::One(s) => s.settle_at(items, Some(now)).await,
            Shared::Cluster(s) => s.settle_at(items, Some(now)).await,
        }
    }

    async fn peek(&self, checks: &[Check<'_>], now: u64) -> Result<Vec<Decision>, StoreError> {
        match self {
            Shared::One(s) => s.peek_at(checks, Some(now)).await,
            Shared::Cluster(s) => s.peek_at(checks, Some(now)).await,
        }
    }
}

/// Where a test reads a key: one server, or the cluster master serving its slot.
pub(super) enum Servers {
    One(RedisServer),
    Cluster(RedisCluster),
}

/// One set of servers and one runtime per test function, shared by all its cases.
pub(super) struct Harness {
    servers: Servers,
    rt: tokio::runtime::Runtime,
    next_prefix: AtomicU64,
}

impl Harness {
    pub(super) fn start(servers: Servers) -> Harness {
        Harness {
            servers,
            rt: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("tokio runtime"),
            next_prefix: AtomicU64::new(0),
        }
    }

    /// A store on a key prefix no other case (or shrinking run) has used.
    fn store(&self) -> Shared {
        let prefix = format!("settle{}", self.next_prefix.fetch_add(1, Relaxed));
        let _in_runtime = self.rt.enter();
        let timeout = Duration::from_secs(10);
        match &self.servers {
            Servers::One(s) => {
                Shared::One(RedisStore::new(&s.url(), &prefix, timeout).expect("RedisStore"))
            }
            Servers::Cluster(c) => Shared::Cluster(Box::new(
                RedisClusterStore::new(&c.nodes(), &prefix, timeout).expect("RedisClusterStore"),
            )),
        }
    }

    /// A connection per master, and which one serves each slot (none: one server).
    fn nodes(&self) -> Nodes {
        match &self.servers {
            Servers::One(s) => Nodes {
                conns: vec![s.conn()],
                by_slot: Vec::new(),
            },
            Servers::Cluster(c) => Nodes {
                conns: (0..3).map(|i| c.node(i)).collect(),
                by_slot: c
                    .masters_by_slot()
                    .into_iter()
                    .map(|m| m.expect("every slot served"))
                    .collect(),
            },
        }
    }
}

pub(super) struct Nodes {
    conns: Vec<redis::Connection>,
    pub(super) by_slot: Vec<usize>,
}

impl Nodes {
    pub(super) fn of(&mut self, key: &str) -> &mut redis::Connection {
        let i = if self.by_slot.is_empty() {
            0
        } else {
            self.by_slot[usize::from(key_slot(key))]
        };
        &mut self.conns[i]
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

/// What a step must have left at a key in Redis.
#[derive(Debug, Clone, Copy)]
enum Left {
    /// As the last write left it (nothing written).
    Unchanged,
    /// The model's state, under this TTL.
    Written { ttl_us: u64 },
    /// No key (whole again).
    Gone,
    /// A state meaning the model's, in some form: a cluster's request denied by another
    /// identity's rule, whose charge on this one was refunded.
    SameMeaning,
}

pub(super) struct Replay<'h> {
    rt: &'h tokio::runtime::Runtime,
    clock: Arc<ManualClock>,
    memory: MemoryStore,
    pub(super) store: Shared,
    pub(super) nodes: Nodes,
    /// What the memory store holds, by Redis key: the last state written and when the
    /// memory store forgets it. Redis keeps every one of them (pinned) past that.
    model: HashMap<String, (State, u64)>,
    /// Keys whose Redis value means the model's state in another form (see
    /// [`Left::SameMeaning`]), until the next write checked exactly.
    reworded: HashSet<String>,
    /// Keys Redis expired in real time before they could be pinned, put back.
    pub(super) restored: usize,
}

impl<'h> Replay<'h> {
    pub(super) fn new(h: &'h Harness) -> Replay<'h> {
        let clock = ManualClock::new(0);
        Replay {
            rt: &h.rt,
            memory: MemoryStore::new(clock.clone()),
            clock,
            store: h.store(),
            nodes: h.nodes(),
            model: HashMap::new(),
            reworded: HashSet::new(),
            restored: 0,
        }
    }

    fn cluster(&self) -> bool {
        matches!(self.store, Shared::Cluster(_))
    }

    /// The state the memory store holds for `check` at `now`: none once its TTL is over.
    fn state(&self, check: &Check<'_>, now: u64) -> Option<State> {
        self.model
            .get(&self.store.key(check))
            .filter(|(_, expires)| *expires > now)
            .map(|(s, _)| *s)
    }

    /// One request at `now`: the answers, and which checks were charged.
    pub(super) fn decide(
        &mut self,
        checks: &[Check<'_>],
        now: u64,
    ) -> Result<(Vec<Decision>, Vec<bool>), String> {
        let before: Vec<Option<State>> = checks.iter().map(|c| self.state(c, now)).collect();
        let outcomes: Vec<_> = checks
            .iter()
            .zip(&before)
            .map(|(c, s)| limiter::decide(c.quota, s.as_ref(), now))
            .collect();
        // The request passes when every enforcing check allows; then each check that
        // allows (enforcing or shadow) is charged. Otherwise nothing is.
        let passes = outcomes
            .iter()
            .zip(checks)
            .all(|(o, c)| o.allowed || c.shadow);
        let charged: Vec<bool> = outcomes.iter().map(|o| passes && o.allowed).collect();
        for ((o, &ch), b) in outcomes.iter().zip(&charged).zip(&before) {
            if ch {
                never_back(b.as_ref(), Some(&o.next))?;
            }
        }
        let pure: Vec<Decision> = outcomes
            .iter()
            .zip(&charged)
            .map(|(o, &ch)| if ch { o.charged } else { o.uncharged })
            .collect();
        self.clock.set(now);
        let memory = self
            .memory
            .decide(checks)
            .map_err(|e| format!("memory: {e}"))?;
        let sent = Instant::now();
        let shared = self
            .rt
            .block_on(self.store.decide(checks, now))
            .map_err(|e| format!("redis: {e}"))?;
        if memory != pure || shared != memory {
            return Err(format!(
                "decide: the answers differ\n states before: {before:?}\n   pure: {pure:?}\n memory: {memory:?}\n  redis: {shared:?}"
            ));
        }
        let identities: HashSet<&IdentityDigest> = checks.iter().map(|c| c.identity).collect();
        let refunded = self.cluster() && !passes && identities.len() > 1;
        for ((c, o), &ch) in checks.iter().zip(&outcomes).zip(&charged) {
            let key = self.store.key(c);
            let left = if ch {
                self.model.insert(key.clone(), (o.next, now + o.ttl_us));
                Left::Written { ttl_us: o.ttl_us }
            } else if refunded {
                Left::SameMeaning
            } else {
                Left::Unchanged
            };
            self.pin(&key, left, now, sent)?;
        }
        Ok((memory, charged))
    }

    /// Settle `items` at `now`: the answers (what the next request would be told, and what
    /// was forgiven), and what each settlement did (by Rust).
    pub(super) fn settle(
        &mut self,
        items: &[Settlement<'_>],
        now: u64,
    ) -> Result<(Vec<Receipt>, Vec<Settled<State>>), String> {
        let mut pure = Vec::new();
        let mut done = Vec::new();
        let mut writes = Vec::new();
        let mut befores = Vec::new();
        for item in items {
            let c = &item.check;
            let before = self.state(c, now);
            befores.push(before);
            let (s, forgiven) = limiter::settle(c.quota, before.as_ref(), now, item.adjust);
            let after = match s {
                Settled::Keep => before,
                Settled::Clear => None,
                Settled::Write { next, .. } => Some(next),
            };
            never_back(before.as_ref(), after.as_ref())?;
            pure.push(Receipt::new(
                limiter::decide(c.quota, after.as_ref(), now).uncharged,
                forgiven,
            ));
            done.push(s);
            writes.push((self.store.key(c), s));
        }
        self.clock.set(now);
        let memory = self.memory.settle(items);
        let sent = Instant::now();
        let shared = self
            .rt
            .block_on(self.store.settle(items, now))
            .map_err(|e| format!("redis: {e}"))?;
        if memory != pure || shared != memory {
            let adj: Vec<Adjust> = items.iter().map(|i| i.adjust).collect();
            return Err(format!(
                "settle {adj:?} at {now}: the answers differ\n states before: {befores:?}\n rust did: {done:?}\n   pure: {pure:?}\n memory: {memory:?}\n  redis: {shared:?}"
            ));
        }
        for (key, s) in writes {
            let left = match s {
                Settled::Keep => Left::Unchanged,
                Settled::Clear => {
                    self.model.remove(&key);
                    Left::Gone
                }
                Settled::Write { next, ttl_us } => {
                    self.model.insert(key.clone(), (next, now + ttl_us));
                    Left::Written { ttl_us }
                }
            };
            self.pin(&key, left, now, sent)?;
        }
        Ok((memory, done))
    }

    /// What `checks` would be told at `now`, charging nothing.
    pub(super) fn peek(&mut self, checks: &[Check<'_>], now: u64) -> Result<Vec<Decision>, String> {
        let pure: Vec<Decision> = checks
            .iter()
            .map(|c| limiter::decide(c.quota, self.state(c, now).as_ref(), now).uncharged)
            .collect();
        self.clock.set(now);
        let memory = self.memory.peek(checks);
        let sent = Instant::now();
        let shared = self
            .rt
            .block_on(self.store.peek(checks, now))
            .map_err(|e| format!("redis: {e}"))?;
        if memory != pure || shared != memory {
            return Err(format!(
                "peek: the answers differ\n   pure: {pure:?}\n memory: {memory:?}\n  redis: {shared:?}"
            ));
        }
        for c in checks {
            let key = self.store.key(c);
            self.pin(&key, Left::Unchanged, now, sent)?;
        }
        Ok(memory)
    }

    /// Check what Redis holds at `key` after a step, then remove its TTL.
    fn pin(&mut self, key: &str, left: Left, now: u64, sent: Instant) -> Result<(), String> {
        let (pttl, value, _): (i64, Option<String>, i64) = redis::pipe()
            .atomic()
            .cmd("PTTL")
            .arg(key)
            .cmd("GET")
            .arg(key)
            .cmd("PERSIST")
            .arg(key)
            .query(self.nodes.of(key))
            .map_err(|e| format!("PTTL/GET/PERSIST {key}: {e}"))?;
        let expected = self.model.get(key).map(|(s, _)| lua_value(s));
        let live = self
            .model
            .get(key)
            .filter(|(_, e)| *e > now)
            .map(|(s, _)| lua_value(s));
        let put_back = |nodes: &mut Nodes, value: &str| {
            redis::cmd("SET")
                .arg(key)
                .arg(value)
                .query::<()>(nodes.of(key))
                .map_err(|e| format!("SET {key}: {e}"))
        };
        match left {
            Left::Unchanged if self.reworded.contains(key) => {
                // Another form of the model's state, or none where that means the same.
                if value.is_some() && pttl != -1 {
                    return Err(format!("{key}: nothing was written but it has PTTL {pttl}"));
                }
            }
            Left::Unchanged => {
                if value != expected || pttl != if expected.is_some() { -1 } else { -2 } {
                    return Err(format!(
                        "{key}: a step that writes nothing changed it: {value:?} (PTTL {pttl}), expected {expected:?} without a TTL"
                    ));
                }
            }
            Left::Gone => {
                self.reworded.remove(key);
                if value.is_some() {
                    return Err(format!(
                        "{key}: the settlement left {value:?}; expected no key"
                    ));
                }
            }
            Left::SameMeaning => {
                self.reworded.insert(key.to_string());
                if let (None, Some(v)) = (&value, &live) {
                    put_back(&mut self.nodes, v)?;
                    self.restored += 1;
                }
            }
            Left::Written { ttl_us } => {
                self.reworded.remove(key);
                let px = ttl_us.div_ceil(1000) as i64;
                let waited = sent.elapsed().as_millis() as i64 + PTTL_SLACK_MS;
                if pttl == -2 {
                    if waited < px {
                        return Err(format!(
                            "{key}: missing right after a write; its TTL should be {px} ms and only {waited} ms passed"
                        ));
                    }
                    put_back(&mut self.nodes, &expected.unwrap_or_default())?;
                    self.restored += 1;
                    return Ok(());
                }
                if value != expected {
                    return Err(format!(
                        "{key}: redis holds {value:?}, the rust state is {expected:?}"
                    ));
                }
                if !(pttl >= 0 && pttl <= px && pttl >= px - waited) {
                    return Err(format!(
                        "{key}: PTTL {pttl} ms, expected {ttl_us} µs rounded up ({px} ms), less at most {waited} ms"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The time a state says it was last changed at, where it has one (a token bucket's last
/// charge, a window's start or index).
fn state_time(s: &State) -> Option<u64> {
    match s {
        State::TokenBucket(t) => Some(t.last_us),
        State::FixedWindow(f) => Some(f.start_us),
        State::SlidingWindow(s) => Some(s.window),
        _ => None,
    }
}

/// A step that left `after` where `before` lived must not have moved its time back, on
/// any clock (issue 41).
fn never_back(before: Option<&State>, after: Option<&State>) -> Result<(), String> {
    match (before.and_then(state_time), after.and_then(state_time)) {
        (Some(b), Some(a)) if a < b => Err(format!(
            "the state's time moved back from {b} to {a}: {before:?} -> {after:?}"
        )),
        _ => Ok(()),
    }
}
