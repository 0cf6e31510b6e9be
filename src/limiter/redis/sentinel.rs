//! Redis under Sentinel ([`RedisSentinelStore`]): one primary with replicas, watched by
//! sentinels that promote a replica when the primary fails. The gateway asks the sentinels
//! where the primary is (`SENTINEL get-master-addr-by-name`, each in turn), checks that the
//! node named really is a primary (`ROLE`: a sentinel's stale answer must never send writes
//! to a replica), and sends its calls there through a [`RedisStore`] of that node's own:
//! per-worker connections and batches, exactly as with one Redis.
//!
//! A failover is followed by whichever sign comes first: a sentinel's `+switch-master`
//! message (each sentinel is subscribed to), a call that fails the way calls fail while a
//! primary is gone (refused, dropped, timed out, `READONLY` from a demoted one), or the
//! question asked again every [`EVERY`] anyway (a message is fire-and-forget, and a
//! partition can hide a failover from every call). When the confirmed primary is another
//! node, a store for it is swapped in whole; calls already under way finish on the old one.
//! Calls made while no primary answers fail, and get `on_error` through the breaker, as with
//! one Redis that is down. What the old primary took that its replica had not yet received
//! is lost with it (Redis replicates asynchronously): docs/scaling.md, "Redis Sentinel".

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use futures_util::StreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use redis::aio::ConnectionManager;
use redis::IntoConnectionInfo;
use tokio::sync::{watch, Notify};

use super::single::RedisStore;
use super::{DecideAt, Scripted, Shared};
use crate::limiter::metrics::{LimiterMetrics, PrimaryLabels};
use crate::limiter::store::{Kind, Receipt, Replication, Settlement};
use crate::limiter::{Check, Decision, StoreError};

/// How often the sentinels are asked where the primary is, whatever else happens.
const EVERY: Duration = Duration::from_secs(1);

/// The least time between two questions: calls failing by the thousand during a promotion
/// wake the follower, which asks at most this often.
const MIN_GAP: Duration = Duration::from_millis(100);

/// What a sentinel publishes when it has promoted a replica:
/// `<master name> <old ip> <old port> <new ip> <new port>`.
const SWITCH_CHANNEL: &str = "+switch-master";

/// The primary's credentials (`[store] master_username`, `master_password`); each
/// sentinel's own are in its URL. Never printed: `Debug` hides the password.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PrimaryAuth {
    pub username: Option<String>,
    pub password: Option<String>,
}

impl fmt::Debug for PrimaryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrimaryAuth")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<hidden>"))
            .finish()
    }
}

/// Where a Sentinel-watched primary is found (`[store] backend = "redis_sentinel"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sentinels {
    /// Each sentinel's URL, `redis://[user:password@]host:port`, asked in this order.
    pub urls: Vec<String>,
    /// The name the sentinels monitor the primary by (`sentinel monitor <name> ...`).
    pub master_name: String,
    pub auth: PrimaryAuth,
}

impl Sentinels {
    /// Ask each sentinel in turn where the primary is, each step within `within`, and
    /// check what it says with `ROLE`: the first node confirmed to be a primary, by
    /// address (`host:port`), and a client for it.
    pub async fn primary(&self, within: Duration) -> Result<(String, redis::Client), StoreError> {
        let mut last = None;
        for url in &self.urls {
            let found = match self.ask(url, within).await {
                Ok(address) => self.confirm(&address, within).await.map(|c| (address, c)),
                Err(e) => Err(e),
            };
            match found {
                Ok(found) => return Ok(found),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| StoreError::Protocol("no sentinel is configured".into())))
    }

    /// One sentinel's answer: the primary's address.
    async fn ask(&self, url: &str, within: Duration) -> Result<String, StoreError> {
        let client = redis::Client::open(url)?;
        let cmd = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.master_name)
            .to_owned();
        let answer: Option<(String, u16)> = timed(within, async {
            let mut conn = client
                .get_multiplexed_async_connection_with_config(&connection_config(within))
                .await?;
            cmd.query_async(&mut conn).await
        })
        .await?;
        // The sentinel by its address only: its URL may hold a password.
        let sentinel = client.get_connection_info().addr().to_string();
        answer
            .map(|(host, port)| address(&host, port))
            .ok_or_else(|| {
                StoreError::Protocol(format!(
                    "sentinel {sentinel} monitors no master named {:?}",
                    self.master_name
                ))
            })
    }

    /// A client for the node at `address` that has answered `ROLE` with `master`.
    async fn confirm(&self, address: &str, within: Duration) -> Result<redis::Client, StoreError> {
        let client = self.client_for(address)?;
        let role: Vec<redis::Value> = timed(within, async {
            let mut conn = client
                .get_multiplexed_async_connection_with_config(&connection_config(within))
                .await?;
            redis::cmd("ROLE").query_async(&mut conn).await
        })
        .await?;
        let role = match role.first() {
            Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(redis::Value::SimpleString(s)) => s.clone(),
            _ => String::new(),
        };
        if role == "master" {
            Ok(client)
        } else {
            Err(StoreError::Protocol(format!(
                "{address}, named the primary of {:?} by a sentinel, is not one (ROLE: {role:?})",
                self.master_name
            )))
        }
    }

    /// A client for a data node: its address, the primary's credentials.
    fn client_for(&self, address: &str) -> Result<redis::Client, StoreError> {
        let mut settings = redis::RedisConnectionInfo::default();
        if let Some(user) = &self.auth.username {
            settings = settings.set_username(user);
        }
        if let Some(password) = &self.auth.password {
            settings = settings.set_password(password);
        }
        let info = format!("redis://{address}")
            .into_connection_info()?
            .set_redis_settings(settings);
        Ok(redis::Client::open(info)?)
    }
}

/// `host:port`, an IPv6 host in brackets.
fn address(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn connection_config(within: Duration) -> redis::AsyncConnectionConfig {
    redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(within))
        .set_response_timeout(Some(within))
}

async fn timed<T>(
    within: Duration,
    f: impl std::future::Future<Output = Result<T, redis::RedisError>>,
) -> Result<T, StoreError> {
    Ok(tokio::time::timeout(within, f)
        .await
        .map_err(|_| StoreError::Timeout(within))??)
}

/// The primary calls go to now.
struct Primary {
    /// `host:port`, as the sentinels name it.
    address: String,
    store: RedisStore,
}

/// A primary found and followed through Redis Sentinel; see the module's comment.
pub struct RedisSentinelStore {
    inner: Arc<Inner>,
}

struct Inner {
    at: Sentinels,
    /// Shared by each primary's store: the prefix, the timeout, the scripts, and the
    /// instance id that tells this gateway's leases from others'.
    s: Arc<Scripted>,
    workers: usize,
    primary: ArcSwapOption<Primary>,
    /// Wakes the follower: a call failed as calls fail during a failover.
    ask: Notify,
    /// One question at a time (the follower's, and `warm`'s at start).
    asking: tokio::sync::Mutex<()>,
    /// Whether the follower and the subscriptions run.
    watching: AtomicBool,
    /// Whether the last question went unanswered (logged once, not every second).
    lost: AtomicBool,
    changes: Counter,
    primaries: Family<PrimaryLabels, Gauge>,
    /// Dropped with the store: the subscriptions see it and end (the follower ends when
    /// it can no longer reach the store).
    closed: watch::Sender<()>,
}

impl RedisSentinelStore {
    /// Set up without waiting on anything: the primary is looked for in the background
    /// (and by `warm`), and calls get `on_error` until one is found.
    pub fn new(
        at: &Sentinels,
        prefix: &str,
        timeout: Duration,
        workers: usize,
        replication: Replication,
        metrics: &LimiterMetrics,
    ) -> Result<Self, StoreError> {
        for url in &at.urls {
            redis::Client::open(url.as_str())?;
        }
        let store = RedisSentinelStore {
            inner: Arc::new(Inner {
                at: at.clone(),
                s: Arc::new(Scripted::new(prefix, timeout, replication)),
                workers,
                primary: ArcSwapOption::empty(),
                ask: Notify::new(),
                asking: tokio::sync::Mutex::new(()),
                watching: AtomicBool::new(false),
                lost: AtomicBool::new(false),
                changes: metrics.primary_changes.clone(),
                primaries: metrics.primary.clone(),
                closed: watch::channel(()).0,
            }),
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            store.watch();
        }
        Ok(store)
    }

    /// Start the follower and a subscription to each sentinel, once (on the runtime that
    /// calls first: the control runtime, in the gateway).
    fn watch(&self) {
        if self.inner.watching.swap(true, Relaxed) {
            return;
        }
        tokio::spawn(follow(Arc::downgrade(&self.inner)));
        for url in &self.inner.at.urls {
            tokio::spawn(listen(
                url.clone(),
                Arc::downgrade(&self.inner),
                self.inner.closed.subscribe(),
            ));
        }
    }

    /// The primary calls go to now; while none is known, a connection error (counted and
    /// answered as an outage), and the follower is woken.
    fn current(&self) -> Result<Arc<Primary>, StoreError> {
        self.inner.primary.load_full().ok_or_else(|| {
            self.inner.ask.notify_one();
            StoreError::Redis(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "no Redis primary found through the sentinels yet",
            )))
        })
    }

    /// A call's result, having woken the follower if it failed as calls fail while a
    /// primary is gone: anything but one key's bad data.
    fn noticed<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(e) = &result {
            if !e.is_data_error() {
                self.inner.ask.notify_one();
            }
        }
        result
    }
}

impl Inner {
    /// Ask the sentinels once, and move the calls to the primary they name, if it is
    /// another one and confirmed.
    async fn discover(&self) {
        let _one = self.asking.lock().await;
        let within = self.s.timeout.max(Duration::from_millis(250));
        match self.at.primary(within).await {
            Ok((address, client)) => {
                if self.lost.swap(false, Relaxed) {
                    tracing::info!(master_name = %self.at.master_name, "the sentinels answer again");
                }
                self.adopt(address, client).await;
            }
            Err(e) => {
                if !self.lost.swap(true, Relaxed) {
                    tracing::warn!(error = %e, master_name = %self.at.master_name, "no Redis primary confirmed through the sentinels; asking again every second");
                }
            }
        }
    }

    async fn adopt(&self, address: String, client: redis::Client) {
        let old = self.primary.load_full();
        if old.as_ref().is_some_and(|p| p.address == address) {
            return;
        }
        let store = match RedisStore::on_client(client, self.s.clone(), self.workers) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, primary = %address, "cannot set up a store for the primary");
                return;
            }
        };
        // Connect and load the scripts before the first request goes there (a request
        // would load them itself on NOSCRIPT, past its timeout).
        if let Err(e) = Shared::warm(&store).await {
            tracing::debug!(error = %e, primary = %address, "the new primary's scripts were not loaded ahead");
        }
        self.primary.store(Some(Arc::new(Primary {
            address: address.clone(),
            store,
        })));
        self.primaries
            .get_or_create(&PrimaryLabels {
                address: address.clone(),
            })
            .set(1);
        match old {
            Some(old) => {
                self.primaries.remove(&PrimaryLabels {
                    address: old.address.clone(),
                });
                self.changes.inc();
                tracing::warn!(
                    master_name = %self.at.master_name,
                    old = %old.address,
                    new = %address,
                    "redis primary changed (a sentinel failover); calls go to the new primary"
                );
            }
            None => tracing::info!(
                master_name = %self.at.master_name,
                primary = %address,
                "redis primary found through the sentinels"
            ),
        }
    }
}

/// Ask the sentinels every [`EVERY`], and at once (at most every [`MIN_GAP`]) when a call
/// or a sentinel's message says the primary may have moved; ends with the store.
async fn follow(store: Weak<Inner>) {
    loop {
        let Some(inner) = store.upgrade() else { return };
        inner.discover().await;
        tokio::select! {
            _ = inner.ask.notified() => {}
            _ = tokio::time::sleep(EVERY) => {}
        }
        drop(inner);
        tokio::time::sleep(MIN_GAP).await;
    }
}

/// Listen to one sentinel's `+switch-master` messages and wake the follower on one about
/// this primary; subscribe again (every [`EVERY`]) while the sentinel is unreachable.
async fn listen(url: String, store: Weak<Inner>, mut closed: watch::Receiver<()>) {
    let Ok(client) = redis::Client::open(url.as_str()) else {
        return;
    };
    let Some(master_name) = store.upgrade().map(|i| i.at.master_name.clone()) else {
        return;
    };
    loop {
        let subscribe = async {
            let mut sub = client.get_async_pubsub().await?;
            sub.subscribe(SWITCH_CHANNEL).await?;
            Ok::<_, redis::RedisError>(sub)
        };
        let subscribed = tokio::select! {
            s = tokio::time::timeout(EVERY * 5, subscribe) => s,
            _ = closed.changed() => return,
        };
        if let Ok(Ok(sub)) = subscribed {
            let mut messages = sub.into_on_message();
            loop {
                tokio::select! {
                    m = messages.next() => {
                        let Some(m) = m else { break };
                        let about_ours = m
                            .get_payload::<String>()
                            .is_ok_and(|text| text.split(' ').next() == Some(master_name.as_str()));
                        if about_ours {
                            let Some(inner) = store.upgrade() else { return };
                            inner.ask.notify_one();
                        }
                    }
                    _ = closed.changed() => return,
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = closed.changed() => return,
        }
    }
}

impl Shared for RedisSentinelStore {
    type Conn = ConnectionManager;
    const KIND: Kind = Kind::RedisSentinel;

    fn scripted(&self) -> &Scripted {
        &self.inner.s
    }

    async fn connection(&self) -> Result<ConnectionManager, StoreError> {
        Shared::connection(&self.current()?.store).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let primary = self.current()?;
        self.noticed(Shared::ping(&primary.store).await)
    }

    /// Find the primary (when none is known yet), connect to it and load the scripts.
    async fn warm(&self) -> Result<(), StoreError> {
        self.watch();
        if self.inner.primary.load().is_none() {
            self.inner.discover().await;
        }
        let primary = self.current()?;
        Shared::warm(&primary.store).await
    }

    fn primary(&self) -> Option<String> {
        self.inner
            .primary
            .load()
            .as_ref()
            .map(|p| p.address.clone())
    }

    fn describe(&self) -> String {
        let to = self
            .inner
            .primary
            .load()
            .as_ref()
            .map_or_else(|| "no primary yet".to_string(), |p| p.address.clone());
        format!(
            "{} {} \u{2192} {to}",
            Self::KIND.name(),
            self.inner.at.master_name
        )
    }
}

impl DecideAt for RedisSentinelStore {
    async fn decide_at(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        let primary = self.current()?;
        self.noticed(primary.store.decide_at(checks, now_us).await)
    }

    async fn peek_at(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        let primary = self.current()?;
        self.noticed(primary.store.peek_at(checks, now_us).await)
    }

    async fn settle_at(
        &self,
        items: &[Settlement<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Receipt>, StoreError> {
        let primary = self.current()?;
        self.noticed(primary.store.settle_at(items, now_us).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_bracket_ipv6_hosts() {
        assert_eq!(address("10.0.0.2", 6379), "10.0.0.2:6379");
        assert_eq!(address("::1", 6380), "[::1]:6380");
    }

    #[test]
    fn the_primarys_password_is_never_printed() {
        let auth = PrimaryAuth {
            username: Some("gw".into()),
            password: Some("s3cret-pw".into()),
        };
        let shown = format!("{auth:?}");
        assert!(!shown.contains("s3cret-pw"), "{shown}");
        assert!(shown.contains("gw"), "{shown}");
    }
}
