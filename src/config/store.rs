//! `[store]`: where limit state lives, and what requests get while it fails.

use std::num::NonZeroU32;
use std::ops::Range;

use serde::Deserialize;

use super::values::{HumanDuration, MaxKeys, Prefix, RedisUrl};
use super::Invalid;
use crate::limiter::redis::{PrimaryAuth, Sentinels};
use crate::limiter::store::{Backend, OnError, Settings};

#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
enum RawBackend {
    #[default]
    Memory,
    Redis,
    RedisCluster,
    RedisSentinel,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    #[serde(default)]
    backend: RawBackend,
    url: Option<RedisUrl>,
    nodes: Option<Vec<RedisUrl>>,
    sentinels: Option<Vec<RedisUrl>>,
    master_name: Option<String>,
    master_username: Option<String>,
    master_password: Option<String>,
    prefix: Option<Prefix>,
    timeout: Option<HumanDuration>,
    on_error: Option<OnError>,
    breaker_failures: Option<NonZeroU32>,
    breaker_cooldown: Option<HumanDuration>,
    max_keys: Option<MaxKeys>,
}

impl RawStore {
    /// `span`: the `[store]` table, where the file has one.
    pub(super) fn validate(self, span: Option<Range<usize>>) -> Result<Settings, Invalid> {
        let d = Settings::default();
        let backend = match (self.backend, self.url, self.nodes) {
            (RawBackend::RedisSentinel, _, _) => Backend::RedisSentinel(Sentinels {
                urls: match self.sentinels {
                    Some(urls) if !urls.is_empty() => urls.into_iter().map(|u| u.0).collect(),
                    _ => return Err(Invalid::new(
                        span,
                        "store.sentinels",
                        "backend = \"redis_sentinel\" needs sentinels = [\"redis://host:26379\", ...] (one or more sentinels)",
                    )),
                },
                master_name: match self.master_name {
                    Some(name) if valid_master_name(&name) => name,
                    _ => return Err(Invalid::new(
                        span,
                        "store.master_name",
                        "backend = \"redis_sentinel\" needs master_name = \"<name>\": the name the sentinels monitor the primary by (1 to 256 characters, no spaces)",
                    )),
                },
                auth: PrimaryAuth {
                    username: self.master_username,
                    password: self.master_password,
                },
            }),
            (RawBackend::Memory, _, _) => Backend::Memory,
            (RawBackend::Redis, Some(url), _) => Backend::Redis { url: url.0 },
            (RawBackend::Redis, None, _) => {
                return Err(Invalid::new(
                    span,
                    "store.url",
                    "backend = \"redis\" needs url = \"redis://host:port\"",
                ))
            }
            (RawBackend::RedisCluster, _, Some(nodes)) if !nodes.is_empty() => {
                Backend::RedisCluster {
                    nodes: nodes.into_iter().map(|n| n.0).collect(),
                }
            }
            (RawBackend::RedisCluster, _, _) => {
                return Err(Invalid::new(
                    span,
                    "store.nodes",
                    "backend = \"redis_cluster\" needs nodes = [\"redis://host:port\", ...] (one or more seed nodes)",
                ))
            }
        };
        Ok(Settings {
            backend,
            prefix: self.prefix.map_or(d.prefix, |p| p.0),
            timeout: self.timeout.map_or(d.timeout, |t| t.0),
            on_error: self.on_error.unwrap_or(d.on_error),
            breaker_failures: self
                .breaker_failures
                .map_or(d.breaker_failures, NonZeroU32::get),
            breaker_cooldown: self.breaker_cooldown.map_or(d.breaker_cooldown, |c| c.0),
            max_keys: self.max_keys.map_or(d.max_keys, |m| m.0),
        })
    }
}

/// A master name as `sentinel monitor` takes it: one word.
fn valid_master_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 256 && name.bytes().all(|b| b.is_ascii_graphic())
}
