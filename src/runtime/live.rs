//! What a request runs on: the config, the limiter over its store, the upstream pools
//! and the per-rule counters, built once per load and swapped whole on reload.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;

use super::requests::RuleCounters;
use super::Metrics;
use crate::config::Config;
use crate::limiter::breaker::Limiter;
use crate::limiter::{store, Clock, MonotonicClock, StoreError};
use crate::upstream;

/// Everything a request runs on. A request takes the current one when it starts and keeps
/// it to the end, so a reload never changes the rules under a request in flight.
pub struct Live {
    pub config: Arc<Config>,
    /// The config's pools (`config.upstreams`, in order), each server with one client
    /// per worker thread: a request's upstream connection is driven by the thread that
    /// serves its client, so forwarding never wakes another thread. A pool whose
    /// settings a reload left alone is the same value, connections and health kept.
    pub pools: Arc<upstream::Pools>,
    pub limiter: Arc<Limiter>,
    /// The worker threads serving (one client per worker in each pool's servers).
    pub workers: usize,
    /// Whether the deny cache may be used under this config (see [`Limiter::decide_now`]).
    pub cache_denials: bool,
    /// Whether any rule settles its charges after the answer (`charge`, `cost_header`,
    /// `cost_from`): only then does an admitted request hold a reservation.
    pub settles: bool,
    /// The settlements' metrics, for the charges a request's rules settle.
    pub settle_metrics: crate::settle::metrics::SettleMetrics,
    /// Whether any rule reserves a request's own `max_tokens` (the body of a request such
    /// a rule applies to is read).
    pub reserves_max_tokens: bool,
    /// Every rule's `cost_header`: removed from every answer (head and trailers) before a
    /// client sees it, and from every request (head and trailers) before a backend does.
    pub cost_headers: Arc<[http::HeaderName]>,
    /// What a request's trailers lose on the way up beside the hop-by-hop and forwarding
    /// fields: every name the gateway strips or sets in its head (the cost headers, the
    /// claims' headers, `[jwt] forward_claims`), so that a trailer never carries what the
    /// head may not.
    pub screened: Arc<[http::HeaderName]>,
    /// `ratewall_requests_total` handles for each of `config.rules`, in order.
    pub counters: Vec<RuleCounters>,
    /// Per rule of `config.rules`: requests waiting on its `max_delay` now.
    pub waiting: Vec<AtomicU32>,
}

impl Live {
    /// Build what `config` needs, reusing `old`'s store and pools where the config did
    /// not change them: limit state, kept connections and servers' health survive a
    /// reload.
    pub fn build(
        config: Config,
        old: Option<&Live>,
        metrics: &Arc<Metrics>,
    ) -> Result<Live, StoreError> {
        Live::build_with_clock(config, old, metrics, Arc::new(MonotonicClock::new()))
    }

    /// [`Live::build`] with the memory store's clock given: tests move it by hand.
    pub fn build_with_clock(
        config: Config,
        old: Option<&Live>,
        metrics: &Arc<Metrics>,
        clock: Arc<dyn Clock>,
    ) -> Result<Live, StoreError> {
        let mut config = config;
        carry_jwt(&mut config, old, metrics);
        if let Some(o) = old {
            // The key directory outlives configs; with the memory store it is the keys
            // file's, read again.
            let file = config.keys.file.clone();
            config.keys.adopt(&o.config.keys, |keys| {
                let path = file.as_deref()?;
                crate::config::reread_keys_file(path, keys)
                    .map_err(|e| tracing::warn!(error = %e, "cannot read the keys file again; its contents as loaded serve"))
                    .ok()
            });
        }
        let limiter = match old {
            Some(o) if o.config.store == config.store => o.limiter.clone(),
            _ => {
                let s = &config.store;
                let store = store::open(s, config.server.workers, clock, &metrics.limiter)?;
                Limiter::new(store, s, metrics.limiter.clone(), metrics.stats.clone())
            }
        };
        // `local_share = "auto"` needs the count of gateways: write heartbeats (where a
        // runtime runs: `ratewall check` writes nothing). Plans share their rule's share.
        let auto = config.rules.iter().any(|r| r.quota.local_share.is_auto());
        if auto
            && config.store.on_error == store::OnError::Local
            && tokio::runtime::Handle::try_current().is_ok()
        {
            limiter.start_heartbeat();
        }
        // The threads running now: `workers` takes effect on restart only, so a reload
        // that changes it keeps the running count (and the pools built for it).
        let workers = old.map_or(config.server.workers.max(1), |o| o.workers);
        let pools = pools_for(&config, old, workers, metrics);
        configure_overload(&config, &pools, metrics);
        // In a cluster, rules on different identities mean refunds, and a refund can make
        // a remembered denial stale: cache only when every rule counts the same identity.
        let one_identity = config
            .rules
            .windows(2)
            .all(|w| w[0].key.kind == w[1].key.kind);
        let policies = || config.rules.iter().filter_map(|r| r.settle.as_deref());
        let settles = policies().next().is_some();
        let reserves_max_tokens = policies().any(|p| p.max_tokens.is_some());
        let (cost_headers, screened) = screened_names(&config);
        // A refund can make a remembered denial stale too (stricter than the store).
        let cache_denials = (!limiter.store().kind().is_clustered() || one_identity) && !settles;
        for rule in config.rules.iter().filter(|r| r.settle.is_some()) {
            metrics.settle.create(&rule.name);
        }
        Ok(Live {
            settles,
            settle_metrics: metrics.settle.clone(),
            reserves_max_tokens,
            cost_headers,
            screened,
            counters: config
                .rules
                .iter()
                .map(|r| metrics.gateway.counters_of(r))
                .collect(),
            waiting: config.rules.iter().map(|_| AtomicU32::new(0)).collect(),
            config: Arc::new(config),
            pools,
            workers,
            limiter,
            cache_denials,
        })
    }
}

/// The config's pools: `old`'s where the pools did not change (connections and health
/// kept), else built for `workers`.
fn pools_for(
    config: &Config,
    old: Option<&Live>,
    workers: usize,
    metrics: &Arc<Metrics>,
) -> Arc<upstream::Pools> {
    match old {
        Some(o) if o.config.upstreams == config.upstreams => o.pools.clone(),
        _ => {
            let https = config
                .upstreams
                .iter()
                .flat_map(|p| &p.servers)
                .any(|s| s.tls.is_some());
            let handshakes = metrics.upstream_tls.handshakes(https);
            Arc::new(upstream::Pools::build(
                &config.upstreams,
                old.map(|o| &*o.pools),
                workers,
                &metrics.pools,
                |_| handshakes.clone(),
            ))
        }
    }
}

/// The overload series a config implies: each protected pool at priority 0 and at each
/// priority a plan sets.
fn configure_overload(config: &Config, pools: &upstream::Pools, metrics: &Arc<Metrics>) {
    let mut priorities: Vec<u32> = std::iter::once(0)
        .chain(
            config
                .rules
                .iter()
                .flat_map(|r| r.priorities.values().copied()),
        )
        .collect();
    priorities.sort_unstable();
    priorities.dedup();
    for overload in pools.iter().filter_map(|p| p.overload()) {
        overload.levels(&priorities);
    }
    metrics.pools.overload.configure(
        pools
            .iter()
            .filter(|p| p.overload().is_some())
            .map(|p| (p.settings.name.clone(), priorities.clone()))
            .collect(),
    );
}

/// Every rule's `cost_header`, and beside them the claims' headers: what a request's
/// trailers lose on the way up ([`Live::cost_headers`], [`Live::screened`]).
fn screened_names(config: &Config) -> (Arc<[http::HeaderName]>, Arc<[http::HeaderName]>) {
    let policies = || config.rules.iter().filter_map(|r| r.settle.as_deref());
    let mut cost_headers: Vec<http::HeaderName> =
        policies().filter_map(|p| p.cost_header.clone()).collect();
    cost_headers.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    cost_headers.dedup();
    let mut screened = cost_headers.clone();
    if let Some(jwt) = &config.jwt {
        screened.extend(
            jwt.verifier
                .settings
                .forward_claims
                .iter()
                .map(|(_, h)| h.clone()),
        );
    }
    screened.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    screened.dedup();
    let cost_headers: Arc<[http::HeaderName]> = cost_headers.into();
    let screened: Arc<[http::HeaderName]> = screened.into();
    (cost_headers, screened)
}

/// `[jwt]` across a reload: the old verifier (its fetched keys, its cache, its fetch
/// task) where the settings and keys are the same; else the new one, whose `jwks_url`
/// starts being fetched now (where a runtime runs: `ratewall check` fetches nothing).
fn carry_jwt(config: &mut Config, old: Option<&Live>, metrics: &Arc<Metrics>) {
    let Some(jwt) = &mut config.jwt else {
        return;
    };
    if let Some(kept) = old
        .and_then(|o| o.config.jwt.as_ref())
        .filter(|o| o.same_as(jwt))
    {
        jwt.verifier = kept.verifier.clone();
        return;
    }
    jwt.verifier.count_checks(metrics.jwks.checks());
    if let (Some(fetch), Ok(_)) = (&jwt.fetch, tokio::runtime::Handle::try_current()) {
        super::jwks::start(&jwt.verifier, fetch, metrics.clone());
    }
}

/// One place in a rule's queue of requests waiting for tokens taken ahead (`max_waiting`).
pub struct WaitSlot<'a>(&'a AtomicU32);

impl<'a> WaitSlot<'a> {
    pub fn take(waiting: &'a AtomicU32, max: u32) -> Option<WaitSlot<'a>> {
        waiting
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| WaitSlot(waiting))
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}
