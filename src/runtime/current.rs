//! The configuration requests start on, kept current: swapped whole when the file is
//! read again (SIGHUP, the admin API), every front-end's requests starting on whichever
//! is current when they start and finishing on it.

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::requests::{ReloadLabels, ReloadResult};
use super::{Live, Metrics};
use crate::config::{ConfigError, Source};
use crate::limiter::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("no config file to reload from")]
    NoFile,
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// The current [`Live`], and where a reload reads the next one from.
pub struct Current {
    live: ArcSwap<Live>,
    /// The file SIGHUP re-reads, and the command line's or environment's overrides it
    /// keeps.
    source: Option<Source>,
    metrics: Arc<Metrics>,
}

impl Current {
    pub fn new(live: Live, source: Option<Source>, metrics: Arc<Metrics>) -> Current {
        metrics.stats.started_with(live.config.sha256.clone());
        Current {
            live: ArcSwap::from_pointee(live),
            source,
            metrics,
        }
    }

    /// The configuration requests start on now.
    pub fn live(&self) -> Arc<Live> {
        self.live.load_full()
    }

    /// Re-read the config file; on success new requests run on it, on failure nothing
    /// changes. Requests in flight finish on the configuration they started with.
    pub fn reload(&self) -> Result<(), ReloadError> {
        let result = self.try_reload();
        let outcome = if result.is_ok() {
            ReloadResult::Ok
        } else {
            ReloadResult::Rejected
        };
        self.metrics
            .gateway
            .reloads
            .get_or_create(&ReloadLabels { result: outcome })
            .inc();
        let sha256 = match &result {
            Ok(()) => self.live.load().config.sha256.clone(),
            // What the rejected file holds, where it can be read.
            Err(_) => self
                .source
                .as_ref()
                .and_then(|s| std::fs::read(&s.path).ok())
                .map(|bytes| crate::config::sha256_hex(&bytes)),
        };
        let shown = result.as_ref().map(|_| ()).map_err(ToString::to_string);
        self.metrics.stats.reloaded(shown, sha256);
        result
    }

    fn try_reload(&self) -> Result<(), ReloadError> {
        let source = self.source.as_ref().ok_or(ReloadError::NoFile)?;
        let config = source.load()?;
        let old = self.live.load_full();
        let (s, o) = (&config.server, &old.config.server);
        if s.listen != o.listen
            || s.admin_listen != o.admin_listen
            || s.workers != o.workers
            || s.max_connections != o.max_connections
            || s.backlog != o.backlog
            || s.shutdown_grace != o.shutdown_grace
            || s.tls.as_ref().map(|t| t.listen) != o.tls.as_ref().map(|t| t.listen)
        {
            tracing::warn!(
                "listen addresses ([server.tls] listen included: a TLS listener is added or removed only by a restart), workers, max_connections, backlog or shutdown_grace changed in the file; they take effect on restart only"
            );
        }
        if config.store != old.config.store {
            tracing::warn!("[store] changed: limits start from a fresh store");
        }
        let live = Live::build(config, Some(&old), &self.metrics)?;
        if !Arc::ptr_eq(&live.limiter, &old.limiter) {
            tokio::spawn({
                let limiter = live.limiter.clone();
                async move { limiter.warm().await }
            });
        }
        self.live.store(Arc::new(live));
        Ok(())
    }
}
