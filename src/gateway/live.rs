//! What a request runs on: the config, the limiter over its store, the upstream pools
//! and the per-rule counters, built once per load and swapped whole on reload.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;

use super::metrics::RuleCounters;
use super::Metrics;
use crate::config::Config;
use crate::limiter::guard::Limiter;
use crate::limiter::{store, Clock, MonotonicClock, StoreError};
use crate::upstream;

/// Everything a request runs on. A request takes the current one when it starts and keeps
/// it to the end, so a reload never changes the rules under a request in flight.
pub struct Live {
    pub config: Arc<Config>,
    /// One upstream client (and its pool) per worker thread: a request's upstream
    /// connection is driven by the thread that serves its client, so forwarding never
    /// wakes another thread.
    pub upstreams: Arc<[upstream::Client]>,
    pub limiter: Arc<Limiter>,
    /// Whether the deny cache may be used under this config (see [`Limiter::decide`]).
    pub cache_denials: bool,
    /// `ratewall_requests_total` handles for each of `config.rules`, in order.
    pub counters: Vec<RuleCounters>,
    /// Per rule of `config.rules`: requests waiting on its `max_delay` now.
    pub(super) waiting: Vec<AtomicU32>,
}

impl Live {
    /// Build what `config` needs, reusing `old`'s store and upstream pool where the
    /// config did not change them: limit state and pooled connections survive a reload.
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
        let limiter = match old {
            Some(o) if o.config.store == config.store => o.limiter.clone(),
            _ => {
                let s = &config.store;
                let store = store::open(s, config.server.workers, clock, &metrics.limiter)?;
                Limiter::new(store, s, metrics.limiter.clone(), metrics.stats.clone())
            }
        };
        let workers = config.server.workers.max(1);
        let upstreams = match old {
            Some(o) if o.config.upstream == config.upstream && o.upstreams.len() == workers => {
                o.upstreams.clone()
            }
            _ => {
                if let Some(tls) = config
                    .upstream
                    .tls
                    .as_ref()
                    .filter(|t| t.options().insecure_skip_verify)
                {
                    tracing::warn!(
                        upstream = config.upstream.url.to_string().trim_end_matches('/'),
                        tls = %tls.describe(),
                        "INSECURE: [upstream] insecure_skip_verify = true: the backend's TLS certificate is NOT verified; anyone on the path can pose as the backend. For a test bench only: give the backend's CA as [upstream] ca instead"
                    );
                }
                let handshakes = metrics
                    .upstream_tls
                    .handshakes(config.upstream.tls.is_some());
                (0..workers)
                    .map(|_| upstream::Client::new(&config.upstream, handshakes.clone()))
                    .collect()
            }
        };
        // In a cluster, rules on different identities mean refunds, and a refund can make
        // a remembered denial stale: cache only when every rule counts the same identity.
        let one_identity = config
            .rules
            .windows(2)
            .all(|w| w[0].key.kind == w[1].key.kind);
        let cache_denials = !limiter.store().kind().is_clustered() || one_identity;
        Ok(Live {
            counters: config
                .rules
                .iter()
                .map(|r| metrics.gateway.rule_counters(&r.name))
                .collect(),
            waiting: config.rules.iter().map(|_| AtomicU32::new(0)).collect(),
            config: Arc::new(config),
            upstreams,
            limiter,
            cache_denials,
        })
    }

    /// This worker thread's upstream client (the first one off the workers).
    pub fn upstream(&self) -> &upstream::Client {
        let n = crate::worker::current().unwrap_or(0);
        // Never empty: built with at least one client.
        &self.upstreams[n % self.upstreams.len().max(1)]
    }
}

/// One place in a rule's queue of requests waiting for reserved tokens (`max_waiting`).
pub(super) struct WaitSlot<'a>(&'a AtomicU32);

impl<'a> WaitSlot<'a> {
    pub(super) fn take(waiting: &'a AtomicU32, max: u32) -> Option<WaitSlot<'a>> {
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
