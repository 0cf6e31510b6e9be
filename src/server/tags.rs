//! The identity tags' secret, found at start ([`crate::identity::tag`]): the one the
//! config or `RATEWALL_TAG_SECRET` gives; else the shared store's (created once by the
//! first gateway, read by every other; asked again every few seconds until the store
//! answers, tags reading `--------` meanwhile); else, on the in-process store, the one
//! kept beside the keys file (or the config), made at the first start.

use std::path::Path;
use std::time::Duration;

use crate::config::Config;
use crate::front_end::Shared;
use crate::identity::tag::{self, TagKey};
use crate::limiter::store::Backend;

/// How often a shared store that did not answer is asked again for the secret.
const RETRY: Duration = Duration::from_secs(2);

/// Key this process's tags, or start asking the shared store until it answers.
pub(super) async fn key_tags(shared: &Shared, config_path: Option<&Path>) {
    let live = shared.live();
    let config = &live.config;
    if let Some(secret) = &config.server.tag_secret {
        tag::process().set(TagKey::from_secret(secret.as_bytes()));
        tracing::info!("identity tags keyed by the configured tag secret");
        return;
    }
    if live.limiter.store().kind().is_shared() {
        // Asked beside serving, never before: a store that is down must not hold the start.
        let shared = shared.clone();
        tokio::spawn(async move {
            let Err(e) = from_store(&shared).await else {
                return;
            };
            tracing::warn!(error = %e, "identity tags read -------- until the store gives the deployment's tag secret; asking again every 2s");
            loop {
                tokio::time::sleep(RETRY).await;
                if from_store(&shared).await.is_ok() {
                    return;
                }
            }
        });
        return;
    }
    let path = tag::secret_file(
        config.keys.file.as_deref(),
        config_path.unwrap_or(Path::new("limits.toml")),
    );
    match tag::kept_secret(&path) {
        Ok(secret) => {
            tag::process().set(TagKey::from_secret(secret.as_bytes()));
            tracing::info!(file = %path.display(), "identity tags keyed by the secret kept in this file");
        }
        Err(e) => match tag::fresh_secret() {
            Ok(secret) => {
                tag::process().set(TagKey::from_secret(secret.as_bytes()));
                tracing::warn!(error = %e, "identity tags keyed by a secret of this process only: they change at a restart (set [server] tag_secret or RATEWALL_TAG_SECRET to keep them)");
            }
            Err(e) => tracing::warn!(error = %e, "identity tags read --------"),
        },
    }
}

/// The shared store's secret, made there if it has none: `Err` says why not.
async fn from_store(shared: &Shared) -> Result<(), String> {
    let fresh = tag::fresh_secret()?;
    let live = shared.live();
    match live.limiter.store().tag_secret(&fresh).await {
        Ok(Some(secret)) => {
            tag::process().set(TagKey::from_secret(secret.as_bytes()));
            tracing::info!("identity tags keyed by the deployment's tag secret in the store");
            Ok(())
        }
        Ok(None) => Err("the store keeps no tag secret".to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// What `ratewall check` keys its tags with: the configured secret, or the one kept beside
/// the keys file (read, never made); `false` when it has none (a shared store's, or one
/// not made yet).
pub fn key_check_tags(config: &Config, config_path: &Path) -> bool {
    if let Some(secret) = &config.server.tag_secret {
        tag::process().set(TagKey::from_secret(secret.as_bytes()));
        return true;
    }
    if !matches!(config.store.backend, Backend::Memory) {
        return false;
    }
    let path = tag::secret_file(config.keys.file.as_deref(), config_path);
    match tag::existing_secret(&path) {
        Some(secret) => {
            tag::process().set(TagKey::from_secret(secret.as_bytes()));
            true
        }
        None => false,
    }
}
