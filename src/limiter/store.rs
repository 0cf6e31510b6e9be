//! The one boundary between the limiter and where state is kept: [`Store`], the size of
//! what the gateway needs — decide a batch, give back and renew leases, inspect and reset
//! one identity, health. [`memory::MemoryStore`](super::memory::MemoryStore) answers in
//! process; [`redis`](super::redis) shares state between gateways. A new operation is one
//! method here and one implementation per store.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use super::memory::{MemoryStore, Pressure};
use super::metrics::LimiterMetrics;
use super::redis::{RedisClusterStore, RedisSentinelStore, RedisStore, Sentinels};
use super::{Adjust, Check, Clock, Decision, StoreError};

/// Where limit state lives (`[store] backend`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// Embedded: one gateway's own limits.
    Memory,
    Redis {
        url: String,
    },
    RedisCluster {
        nodes: Vec<String>,
    },
    /// A primary with replicas, found and followed through Redis Sentinel.
    RedisSentinel(Sentinels),
}

crate::telemetry::label_enum! {
    /// What a request gets while the store fails (`[store] on_error`).
    #[derive(Default, serde::Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum OnError {
        /// Answer 503 while the store fails: no request escapes its limit.
        #[default]
        Deny,
        /// Forward without limiting while the store fails: availability over enforcement.
        Allow,
        /// Enforce the same rules in this process until the store answers again. With N
        /// instances behind a balancer, up to N times the limit passes meanwhile (a rule's
        /// `local_share` keeps each to its part).
        Local,
    }
}

/// `[store]`, validated. Its `Default` holds each setting's default.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub backend: Backend,
    /// The first part of every Redis key.
    pub prefix: String,
    /// The longest one store call may take.
    pub timeout: Duration,
    pub on_error: OnError,
    /// Outages in a row that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker stops calls before a probe may close it.
    pub breaker_cooldown: Duration,
    /// The most keys the memory store (and the `local` fallback) tracks; see
    /// [`crate::limiter::memory`] for what is evicted when it is full.
    pub max_keys: usize,
    /// Whether an admission waits for replicas to have it (`[store] replication`).
    pub replication: Replication,
}

/// Whether a write script call waits for replicas (`[store] replication`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Replication {
    /// Redis' own: the primary answers, its replicas get the write a moment later. A
    /// failover loses what the promoted replica had not yet got, and every admission those
    /// writes recorded can be granted again.
    #[default]
    Async,
    /// After each write script call, `WAIT replicas timeout` on the same connection, in
    /// the same round trip: the call's admissions stand only once `replicas` replicas have
    /// the write. Fewer within `timeout` make the call a store error
    /// ([`StoreError::Unreplicated`](super::StoreError::Unreplicated)), which `on_error`
    /// answers.
    Wait { replicas: u32, timeout: Duration },
}

impl Replication {
    /// The most replicas `wait` may name.
    pub const MAX_REPLICAS: u32 = 16;
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            backend: Backend::Memory,
            prefix: "ratewall".into(),
            timeout: Duration::from_millis(50),
            on_error: OnError::Deny,
            breaker_failures: 5,
            breaker_cooldown: Duration::from_secs(1),
            max_keys: 1_000_000,
            replication: Replication::Async,
        }
    }
}

crate::telemetry::label_enum! {
    /// Which store it is: what the limiter needs to know of one beyond its calls.
    pub enum Kind {
        Memory,
        Redis,
        RedisCluster,
        RedisSentinel,
    }
}

impl Kind {
    /// Whether gateways share it: its answers take a network round trip (worth a deny
    /// cache and a breaker), and its leases must outlive no gateway (they carry a TTL).
    pub fn is_shared(self) -> bool {
        self != Kind::Memory
    }

    /// Whether one request's rules may span nodes that fail apart from each other.
    pub fn is_clustered(self) -> bool {
        self == Kind::RedisCluster
    }
}

/// A store's answer: there already (an in-process store), or a call under way. The
/// request path awaits a future only where there is one, so a memory-store request
/// carries none.
pub enum Call<'a, T> {
    Ready(Result<T, StoreError>),
    Pending(Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>),
}

impl<'a, T> Call<'a, T> {
    pub fn pending(f: impl Future<Output = Result<T, StoreError>> + Send + 'a) -> Self {
        Call::Pending(Box::pin(f))
    }
}

impl<'a, T: Send + 'a> IntoFuture for Call<'a, T> {
    type Output = Result<T, StoreError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        match self {
            Call::Ready(r) => Box::pin(std::future::ready(r)),
            Call::Pending(f) => f,
        }
    }
}

/// One charge to settle (issue 27): the check it was decided under, and how.
#[derive(Debug, Clone)]
pub struct Settlement<'a> {
    pub check: Check<'a>,
    pub adjust: Adjust,
}

/// What one settlement left: what its rule would tell the identity's next request now
/// (its window not named: 0, as the script's settle mode answers the cost forgiven in
/// that place), and the cost units the store could not charge (forgiven: see
/// [`super::settle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Receipt {
    pub now: Decision,
    pub forgiven: u64,
}

impl Receipt {
    /// The receipt of a settlement that leaves `now` to tell, having forgiven `forgiven`.
    pub fn new(now: Decision, forgiven: u64) -> Receipt {
        Receipt {
            now: Decision { window: 0, ..now },
            forgiven,
        }
    }
}

/// Where limit state is kept.
pub trait Store: Send + Sync {
    fn kind(&self) -> Kind;

    /// Decide one request against every rule in `checks`, all or nothing: either every
    /// enforcing check allows and all are charged, or none is. One [`Decision`] per
    /// check, in order.
    fn decide<'a>(&'a self, checks: &'a [Check<'a>]) -> Call<'a, Vec<Decision>>;

    /// What `checks` would be told now, charging nothing (the admin API's inspect).
    fn peek<'a>(&'a self, checks: &'a [Check<'a>]) -> Call<'a, Vec<Decision>>;

    /// Settle charges decided earlier ([`super::settle`]): each stands on its own (a
    /// request's rules on one Redis, or on one identity in a cluster, in one atomic call).
    /// One [`Receipt`] per item, in order.
    fn settle<'a>(&'a self, items: &'a [Settlement<'a>]) -> Call<'a, Vec<Receipt>>;

    /// Forget one identity's state under one rule (the admin API's reset).
    fn reset<'a>(&'a self, check: &'a Check<'a>) -> Call<'a, ()>;

    /// Give back the slot a concurrency check took: its request ended.
    fn release<'a>(&'a self, check: &'a Check<'a>) -> Call<'a, ()>;

    /// Keep a concurrency lease alive while its request is in flight; `false`: it was
    /// gone (reset). In-process slots live as long as the process.
    fn renew<'a>(&'a self, check: &'a Check<'a>) -> Call<'a, bool>;

    /// Whether the store answers now (for /readyz and the breaker's probe).
    fn ping(&self) -> Call<'_, ()>;

    /// Write this gateway's heartbeat to a shared store and count the gateways that wrote
    /// theirs within `window`, this one included: the N `local_share = "auto"` divides a
    /// limit by. An in-process store is one gateway's own: 1.
    fn heartbeat(&self, _window: Duration) -> Call<'_, u32> {
        Call::Ready(Ok(1))
    }

    /// The deployment's identity tag secret, kept in a shared store
    /// ([`crate::identity::tag`]): `fresh` is written where there is none yet (the first
    /// gateway's wins), and what the store keeps is answered. `None` from a store that is
    /// one gateway's own.
    fn tag_secret<'a>(&'a self, _fresh: &'a str) -> Call<'a, Option<String>> {
        Call::Ready(Ok(None))
    }

    /// The address of the node calls go to now, where the store follows one that can
    /// change (a Sentinel's primary); `None` otherwise, or while none is known.
    fn primary(&self) -> Option<String> {
        None
    }

    /// The store as the status page, `/readyz` and the breaker's logs name it: its kind,
    /// and for a Sentinel's primary its name and address (`redis_sentinel mymaster →
    /// 10.0.0.2:6379`).
    fn describe(&self) -> String {
        self.kind().name().to_string()
    }

    /// Connect and load scripts ahead of the first request.
    fn warm(&self) -> Call<'_, ()> {
        self.ping()
    }

    /// Drop state that is whole again; the number of keys held, for an in-process store.
    fn sweep(&self) -> Option<usize> {
        None
    }
}

/// The store `settings` name, set up without waiting on it: a gateway starts while Redis
/// is down, and answers by `on_error` until it is reachable. `workers`: one Redis
/// connection each.
pub fn open(
    settings: &Settings,
    workers: usize,
    clock: Arc<dyn Clock>,
    metrics: &LimiterMetrics,
) -> Result<Box<dyn Store>, StoreError> {
    Ok(match &settings.backend {
        Backend::Memory => Box::new(MemoryStore::bounded(
            clock,
            settings.max_keys,
            Pressure::of(metrics, "memory"),
        )),
        Backend::Redis { url } => Box::new(RedisStore::replicated(
            url,
            &settings.prefix,
            settings.timeout,
            workers,
            settings.replication,
        )?),
        Backend::RedisCluster { nodes } => Box::new(RedisClusterStore::replicated(
            nodes,
            &settings.prefix,
            settings.timeout,
            settings.replication,
        )?),
        Backend::RedisSentinel(at) => Box::new(RedisSentinelStore::new(
            at,
            &settings.prefix,
            settings.timeout,
            workers,
            settings.replication,
            metrics,
        )?),
    })
}
