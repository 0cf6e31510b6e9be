//! `[store]`: where limit state lives, and what requests get while it fails.

use std::fmt;
use std::num::NonZeroU32;
use std::ops::Range;
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::values::{HumanDuration, MaxKeys, Prefix, RedisUrl};
use super::Invalid;
use crate::limiter::redis::{PrimaryAuth, Sentinels};
use crate::limiter::store::{Backend, OnError, Replication, Settings};

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
    replication: Option<RawReplication>,
}

/// `replication = "async" | { wait = <replicas>, timeout = "<duration>" }`, as written.
enum RawReplication {
    Async,
    Wait {
        replicas: u64,
        timeout: Option<HumanDuration>,
    },
}

/// What `replication` takes, for errors.
const REPLICATION: &str = "replication = \"async\" or { wait = <replicas>, timeout = \"5ms\" }";

/// `WAIT`'s timeout when `replication = { wait }` names none (at most the store timeout).
const WAIT_TIMEOUT: Duration = Duration::from_millis(5);

impl<'de> Deserialize<'de> for RawReplication {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Wait {
            wait: u64,
            timeout: Option<HumanDuration>,
        }
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = RawReplication;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(REPLICATION)
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<RawReplication, E> {
                match s {
                    "async" => Ok(RawReplication::Async),
                    other => Err(E::custom(format!(
                        "invalid replication {other:?}: {REPLICATION}"
                    ))),
                }
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<RawReplication, A::Error> {
                let w = Wait::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(RawReplication::Wait {
                    replicas: w.wait,
                    timeout: w.timeout,
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// `replication` against the backend and the store timeout it must fit in.
fn replication(
    raw: Option<RawReplication>,
    backend: &Backend,
    store_timeout: Duration,
    span: Option<Range<usize>>,
) -> Result<Replication, Invalid> {
    let (replicas, timeout) = match raw {
        None | Some(RawReplication::Async) => return Ok(Replication::Async),
        Some(RawReplication::Wait { replicas, timeout }) => (replicas, timeout),
    };
    let bad = |msg: String| Err(Invalid::new(span.clone(), "store.replication", msg));
    if *backend == Backend::Memory {
        return bad(
            "replication = { wait } needs backend = \"redis\", \"redis_cluster\" or \"redis_sentinel\": the memory store has no replica to wait for".into(),
        );
    }
    let max = Replication::MAX_REPLICAS;
    let replicas = match u32::try_from(replicas) {
        Ok(n) if (1..=max).contains(&n) => n,
        _ => return bad(format!("wait = {replicas}: 1 to {max} replicas")),
    };
    let timeout = timeout.map_or(WAIT_TIMEOUT.min(store_timeout), |t| t.0);
    if timeout < Duration::from_millis(1) {
        return bad(format!(
            "timeout = {timeout:?}: at least 1ms (WAIT counts whole milliseconds)"
        ));
    }
    if timeout > store_timeout {
        return bad(format!(
            "timeout = {timeout:?} is longer than the store timeout ({store_timeout:?}): a call, its WAIT included, is given up after the store timeout"
        ));
    }
    Ok(Replication::Wait { replicas, timeout })
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
        let timeout = self.timeout.map_or(d.timeout, |t| t.0);
        let replication = replication(self.replication, &backend, timeout, span)?;
        Ok(Settings {
            backend,
            prefix: self.prefix.map_or(d.prefix, |p| p.0),
            timeout,
            on_error: self.on_error.unwrap_or(d.on_error),
            breaker_failures: self
                .breaker_failures
                .map_or(d.breaker_failures, NonZeroU32::get),
            breaker_cooldown: self.breaker_cooldown.map_or(d.breaker_cooldown, |c| c.0),
            max_keys: self.max_keys.map_or(d.max_keys, |m| m.0),
            replication,
        })
    }
}

/// A master name as `sentinel monitor` takes it: one word.
fn valid_master_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 256 && name.bytes().all(|b| b.is_ascii_graphic())
}
