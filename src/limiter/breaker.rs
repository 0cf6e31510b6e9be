//! What the gateway calls: the configured store behind a circuit breaker, with the
//! `on_error = "local"` fallback.
//!
//! Two kinds of store failure are told apart:
//! - **outages** (connection refused or dropped, timeouts): after `breaker_failures` of them
//!   in a row the breaker opens, and for the next `breaker_cooldown` requests stop waiting
//!   on the store and get `on_error` at once, while a background task probes the store;
//!   the first answer closes the breaker. Transitions are logged once, not per request.
//!   (With a Redis Cluster the breaker stays closed: one node's outage must not stop the
//!   slots the other nodes serve; requests on the dead node's slots get `on_error` after
//!   the store timeout.)
//! - **data errors** (a key of the wrong type, a corrupt state someone else wrote): one
//!   key's problem, not the store's. That request gets `on_error`, the key is logged (at
//!   most once a second), and the breaker is not moved.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::deny_cache::DenyCache;
use super::heartbeat::{self, Gateways};
use super::memory::{MemoryStore, Pressure};
use super::metrics::{LimiterMetrics, StoreErrorKind, StoreErrorLabels, StoreLabels};
use super::store::{self, Call, OnError, Receipt, Settlement, Store};
use super::{Check, Decision, MonotonicClock, StoreError};
use crate::telemetry::stats::Stats;

/// The store's health, as /readyz and the logs tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// The last call answered.
    Healthy,
    /// Calls are failing; the breaker is still closed.
    Failing,
    /// The breaker is open: calls are not even tried until a probe succeeds.
    Open,
}

/// What [`Limiter::decide_now`] could do without waiting.
pub enum Now<'a> {
    Answered(StoreAnswer),
    /// The shared store was asked: [`Limiter::ask`] waits for its answer.
    Ask(Asking<'a>),
}

/// A store call under way, and when it was made.
pub struct Asking<'a> {
    call: std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Vec<Decision>, StoreError>> + Send + 'a>,
    >,
    sent_us: u64,
    started: Instant,
}

/// How a request's limits were decided: the store's answer, or what stood in for it.
#[derive(Debug)]
pub enum StoreAnswer {
    /// By the configured store.
    Store(Vec<Decision>),
    /// The store failed and `on_error = "local"`: by this process alone.
    Local(Vec<Decision>),
    /// Denied from the deny cache, without a store call: the rules known to deny have a
    /// decision; the others (not known here) have none.
    Cached(Vec<Option<Decision>>),
    /// The store failed; `on_error` (deny or allow) decides.
    Failed(StoreError),
}

pub struct Limiter {
    store: Box<dyn Store>,
    on_error: OnError,
    /// In-process limits for `on_error = "local"`: the same rules, this instance's share.
    local: MemoryStore,
    threshold: u32,
    cooldown: Duration,
    failures: AtomicU32,
    open: AtomicBool,
    /// When a data error was last logged (ms since `started`), to log at most once a second.
    data_logged_ms: AtomicU64,
    started: Instant,
    metrics: LimiterMetrics,
    /// Store calls made and skipped, for the status page.
    stats: Arc<Stats>,
    /// Denials remembered until their retry time (shared stores only: the memory store
    /// answers as fast as a cache would).
    denials: Option<DenyCache>,
    /// The last lease number handed out.
    leases: AtomicU64,
    /// `ratewall_store_duration_seconds` of this store, looked up once.
    store_seconds: prometheus_client::metrics::histogram::Histogram,
    /// When a full memory store was last logged (ms since `started`).
    full_logged_ms: AtomicU64,
    /// The gateways seen sharing the store: `local_share = "auto"`'s N.
    gateways: Gateways,
}

/// Denials remembered at most; past it, new denials go to the store.
const DENY_CACHE_ENTRIES: usize = 100_000;

impl Limiter {
    /// `store` behind the breaker and policy `settings` give; the `on_error = "local"`
    /// fallback is bounded by the same `max_keys`.
    pub fn new(
        store: Box<dyn Store>,
        settings: &store::Settings,
        metrics: LimiterMetrics,
        stats: Arc<Stats>,
    ) -> Arc<Limiter> {
        let kind = store.kind();
        let store_seconds = metrics
            .store_duration
            .get_or_create(&StoreLabels {
                backend: kind.name(),
            })
            .clone();
        Arc::new(Limiter {
            store_seconds,
            denials: kind.is_shared().then(|| DenyCache::new(DENY_CACHE_ENTRIES)),
            store,
            on_error: settings.on_error,
            local: MemoryStore::bounded(
                Arc::new(MonotonicClock::new()),
                settings.max_keys,
                Pressure::of(&metrics, "local"),
            ),
            full_logged_ms: AtomicU64::new(0),
            gateways: Gateways::new(metrics.gateways_seen.clone()),
            threshold: settings.breaker_failures.max(1),
            cooldown: settings.breaker_cooldown,
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            data_logged_ms: AtomicU64::new(0),
            started: Instant::now(),
            metrics,
            stats,
            leases: AtomicU64::new(1),
        })
    }

    pub fn store(&self) -> &dyn Store {
        &*self.store
    }

    pub fn on_error(&self) -> OnError {
        self.on_error
    }

    /// The gateways seen sharing the store ([`heartbeat`]).
    pub fn gateways(&self) -> &Gateways {
        &self.gateways
    }

    /// Write heartbeats to the shared store from now on, so that `local_share = "auto"`
    /// knows how many gateways share it (once; only where the store is shared).
    pub fn start_heartbeat(self: &Arc<Self>) {
        heartbeat::start(self);
    }

    pub fn health(&self) -> Health {
        if self.open.load(Relaxed) {
            Health::Open
        } else if self.failures.load(Relaxed) > 0 {
            Health::Failing
        } else {
            Health::Healthy
        }
    }

    /// Decide one request against every rule in `checks`, all or nothing, as far as it
    /// goes without waiting: the whole answer from an in-process store, the deny cache or an
    /// open breaker; else the store's call, under way, for [`Limiter::ask`] to finish. (The
    /// request path awaits a future only when there is one.)
    ///
    /// `cache_denials`: whether denials may be answered from, and kept in, the deny cache.
    /// Only when no request can see another's charge that is about to be refunded: always
    /// with one Redis (a request is one atomic call); in a cluster, only when every rule
    /// counts the same identity (no request spans slots, so there are no refunds).
    pub fn decide_now<'a>(
        self: &'a Arc<Self>,
        checks: &'a [Check<'a>],
        cache_denials: bool,
    ) -> Now<'a> {
        // A known denial stands whatever the store is doing: it is still true.
        let denials = self.denials.as_ref().filter(|_| cache_denials);
        // The deny cache's clock, read only where there is a cache.
        let sent_us = if denials.is_some() { self.now_us() } else { 0 };
        if let Some(hit) = denials.and_then(|c| c.lookup(checks, sent_us)) {
            self.metrics.deny_cache_hits.inc();
            return Now::Answered(StoreAnswer::Cached(hit));
        }
        if self.open.load(Relaxed) {
            self.count_error(&StoreError::CircuitOpen);
            self.stats.store_skipped();
            return Now::Answered(self.fallback(checks, StoreError::CircuitOpen));
        }
        let started = Instant::now();
        match self.store.decide(checks) {
            Call::Ready(result) => {
                Now::Answered(self.answered(checks, cache_denials, result, sent_us, started))
            }
            Call::Pending(call) => Now::Ask(Asking {
                call,
                sent_us,
                started,
            }),
        }
    }

    /// The answer to the store call [`Limiter::decide_now`] made.
    pub async fn ask(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        cache_denials: bool,
        asking: Asking<'_>,
    ) -> StoreAnswer {
        let Asking {
            call,
            sent_us,
            started,
        } = asking;
        let result = call.await;
        self.answered(checks, cache_denials, result, sent_us, started)
    }

    fn answered(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        cache_denials: bool,
        result: Result<Vec<Decision>, StoreError>,
        sent_us: u64,
        started: Instant,
    ) -> StoreAnswer {
        let took = started.elapsed();
        self.store_seconds.observe(took.as_secs_f64());
        self.stats.store_called(took, result.is_err());
        if let Err(e) = &result {
            self.count_error(e);
        }
        match result {
            Ok(d) => {
                self.succeeded();
                if let Some(cache) = self.denials.as_ref().filter(|_| cache_denials) {
                    cache.remember(checks, &d, sent_us);
                }
                StoreAnswer::Store(d)
            }
            Err(e) if e.is_data_error() => {
                self.log_data_error(&e);
                self.fallback(checks, e)
            }
            // One request's lack of room, not an outage: the breaker does not move.
            Err(e @ StoreError::Full(_)) => {
                self.log_full(&e);
                self.fallback(checks, e)
            }
            Err(e) => {
                self.failed(&e);
                self.fallback(checks, e)
            }
        }
    }

    /// Settle charges decided earlier (`settle::reservation`) on the store that decided
    /// them (`local`: the `on_error = "local"` fallback). A store that fails, or whose
    /// breaker is open, is counted and logged, and the charges stand as they were: a
    /// refund lost is stricter, an added charge lost is at most that charge looser.
    pub async fn settle(&self, items: &[Settlement<'_>], local: bool) -> Option<Vec<Receipt>> {
        if local {
            // At the share the charges were decided at (the count of gateways is frozen
            // while the store fails).
            let gateways = self.gateways.seen();
            let quotas: Vec<super::Quota> = items
                .iter()
                .map(|i| i.check.quota.for_local_share(gateways))
                .collect();
            let shared: Vec<Settlement<'_>> = items
                .iter()
                .zip(&quotas)
                .map(|(i, quota)| Settlement {
                    check: Check {
                        quota,
                        ..i.check.clone()
                    },
                    adjust: i.adjust,
                })
                .collect();
            return Some(self.local.settle(&shared));
        }
        if self.open.load(Relaxed) {
            self.count_error(&StoreError::CircuitOpen);
            return None;
        }
        let started = Instant::now();
        let result = self.store.settle(items).await;
        self.store_seconds.observe(started.elapsed().as_secs_f64());
        match result {
            Ok(d) => Some(d),
            Err(e) => {
                self.count_error(&e);
                tracing::warn!(error = %e, "a settlement failed; the charges stand as reserved");
                None
            }
        }
    }

    /// Whether the store answers now, without waiting on an open breaker.
    pub async fn ping(&self) -> Result<(), StoreError> {
        if self.open.load(Relaxed) {
            return Err(StoreError::CircuitOpen);
        }
        self.store.ping().await
    }

    /// What `checks` would be told now (the admin API's inspect); no breaker, no fallback.
    pub async fn peek(&self, checks: &[Check<'_>]) -> Result<Vec<Decision>, StoreError> {
        if self.open.load(Relaxed) {
            return Err(StoreError::CircuitOpen);
        }
        self.store.peek(checks).await
    }

    /// Forget one identity's state under one rule, in the store and in the local fallback.
    pub async fn reset(&self, check: &Check<'_>) -> Result<(), StoreError> {
        self.local.reset(check);
        if let Some(cache) = &self.denials {
            cache.forget(check);
        }
        self.store.reset(check).await
    }

    /// Give back a concurrency slot taken by `check`. `local`: it was taken from the
    /// `on_error = "local"` fallback. Best effort: a shared store that cannot be reached
    /// lets the lease expire by its TTL.
    pub async fn release(&self, check: &Check<'_>, local: bool) {
        if local {
            self.local.release(check);
            return;
        }
        if let Err(e) = self.store.release(check).await {
            tracing::debug!(error = %e, rule = check.rule, "lease release failed; it expires by its TTL");
        }
    }

    /// Give back a slot held in this process: the local fallback's (`local`), or the
    /// memory store's. Synchronous: a mutex, no I/O.
    pub fn release_in_process(&self, check: &Check<'_>, local: bool) {
        if local {
            self.local.release(check);
        } else if !self.store.kind().is_shared() {
            // Answered at once: nothing to wait for.
            let _ = self.store.release(check);
        }
        // A shared store's leases are released with `release`.
    }

    /// Renew a concurrency lease in the shared store; `false` once it is gone.
    pub async fn renew(&self, check: &Check<'_>) -> bool {
        match self.store.renew(check).await {
            Ok(live) => live,
            Err(e) => {
                // Keep trying: the store may answer before the lease expires.
                tracing::debug!(error = %e, rule = check.rule, "lease renewal failed");
                true
            }
        }
    }

    /// Get the store ready for the first request (connect, load scripts). A store that
    /// does not answer is only logged: requests then get `on_error` until it does.
    pub async fn warm(&self) {
        if let Err(e) = self.store.warm().await {
            tracing::warn!(error = %e, on_error = self.on_error.name(), "store not ready; requests get on_error until it answers");
        }
    }

    /// A fresh lease number for a concurrency check.
    pub fn next_lease(&self) -> u64 {
        self.leases.fetch_add(1, Relaxed)
    }

    /// Drop refilled state from the in-process stores, and report how many keys each
    /// holds (`ratewall_store_keys`).
    pub fn sweep(&self) {
        if let Some(n) = self.store.sweep() {
            self.metrics.store_keys("memory").set(n as i64);
        }
        let n = self.local.sweep();
        self.metrics.store_keys("local").set(n as i64);
        if let Some(cache) = &self.denials {
            cache.sweep(self.now_us());
        }
    }

    /// Microseconds since this limiter started: the deny cache's clock.
    fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    fn count_error(&self, e: &StoreError) {
        let kind = match e {
            StoreError::CircuitOpen => StoreErrorKind::BreakerOpen,
            StoreError::Full(_) => StoreErrorKind::Full,
            StoreError::Timeout(_) => StoreErrorKind::Timeout,
            StoreError::Unreplicated { .. } => StoreErrorKind::Unreplicated,
            e if e.is_data_error() => StoreErrorKind::Data,
            StoreError::Redis(r) if r.is_timeout() => StoreErrorKind::Timeout,
            StoreError::Redis(r)
                if r.is_io_error()
                    || r.is_connection_dropped()
                    || r.is_connection_refusal()
                    || r.is_unrecoverable_error() =>
            {
                StoreErrorKind::Connection
            }
            _ => StoreErrorKind::Other,
        };
        self.metrics
            .store_errors
            .get_or_create(&StoreErrorLabels { kind })
            .inc();
    }

    fn fallback(&self, checks: &[Check<'_>], e: StoreError) -> StoreAnswer {
        match self.on_error {
            // The memory store is already in this process: a second one would only start
            // every identity afresh. Its failure (full) is denied.
            OnError::Local if !self.store.kind().is_shared() => StoreAnswer::Failed(e),
            OnError::Local => match self.local.decide(&Self::local_shares(
                checks,
                self.gateways.seen(),
                &mut Vec::new(),
            )) {
                Ok(d) => StoreAnswer::Local(d),
                Err(full) => {
                    let e = StoreError::from(full);
                    self.count_error(&e);
                    self.log_full(&e);
                    StoreAnswer::Failed(e)
                }
            },
            OnError::Deny | OnError::Allow => StoreAnswer::Failed(e),
        }
    }

    /// `checks` at this gateway's share of each limit (`local_share`; `"auto"`: one part
    /// in `gateways`), for the `local` fallback; `quotas` holds the scaled quotas they
    /// point at.
    fn local_shares<'a>(
        checks: &[Check<'a>],
        gateways: u32,
        quotas: &'a mut Vec<super::Quota>,
    ) -> Vec<Check<'a>> {
        *quotas = checks
            .iter()
            .map(|c| c.quota.for_local_share(gateways))
            .collect();
        checks
            .iter()
            .zip(quotas.iter())
            .map(|(c, quota)| Check { quota, ..c.clone() })
            .collect()
    }

    fn succeeded(&self) {
        if self.failures.swap(0, Relaxed) > 0 {
            tracing::info!("store answers again; limiting by the store resumed");
        }
    }

    fn failed(self: &Arc<Self>, e: &StoreError) {
        let n = self.failures.fetch_add(1, Relaxed) + 1;
        if n == 1 {
            tracing::warn!(error = %e, on_error = self.on_error.name(), store = %self.store.describe(), "store failing; applying on_error");
        }
        // In a cluster one node's failure is not the others': its slots get on_error after
        // the store timeout, and the breaker, which would stop every slot, stays closed.
        let clustered = self.store.kind().is_clustered();
        if !clustered && n >= self.threshold && !self.open.swap(true, Relaxed) {
            self.metrics.breaker_open.set(1);
            tracing::warn!(
                failures = n,
                cooldown = ?self.cooldown,
                store = %self.store.describe(),
                "circuit breaker open: not waiting on the store; probing it in the background"
            );
            tokio::spawn(Self::probe(self.clone()));
        }
    }

    /// While the breaker is open: ping the store every cool-down; close on the first answer.
    async fn probe(this: Arc<Self>) {
        loop {
            tokio::time::sleep(this.cooldown).await;
            match this.store.ping().await {
                Ok(()) => {
                    this.failures.store(0, Relaxed);
                    this.open.store(false, Relaxed);
                    this.metrics.breaker_open.set(0);
                    tracing::info!(store = %this.store.describe(), "store answers again; circuit breaker closed");
                    return;
                }
                Err(e) => tracing::debug!(error = %e, "store probe failed; breaker stays open"),
            }
        }
    }

    /// A full memory store, logged at most once a second.
    fn log_full(&self, e: &StoreError) {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.full_logged_ms.load(Relaxed);
        if (last == 0 || now >= last + 1_000)
            && self
                .full_logged_ms
                .compare_exchange(last, now.max(1), Relaxed, Relaxed)
                .is_ok()
        {
            tracing::warn!(error = %e, on_error = self.on_error.name(), "memory store full: a new key's request gets on_error (raise [store] max_keys, or add a client_ip rule)");
        }
    }

    fn log_data_error(&self, e: &StoreError) {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.data_logged_ms.load(Relaxed);
        if (last == 0 || now >= last + 1_000)
            && self
                .data_logged_ms
                .compare_exchange(last, now.max(1), Relaxed, Relaxed)
                .is_ok()
        {
            tracing::warn!(error = %e, on_error = self.on_error.name(), "store data error; applying on_error to this request");
        }
    }
}
