//! The key directory in Redis: one hash, `<prefix>:keys` (field: the 64-hex SHA-256 of an
//! API key; value: its plan; no raw key anywhere), changed by the admin API of any
//! gateway ([`RedisKeys::change`]: the write and a PUBLISH on `<prefix>:keys:changes`, in
//! one script), and followed by every gateway ([`RedisKeys::follow`]).
//!
//! Why both pub/sub and a full resynchronisation: pub/sub is fast (a change reaches every
//! subscribed gateway within milliseconds) but fire-and-forget: a subscriber that was
//! disconnected when a message was sent (a restart of Redis, a network blip, a `CLIENT
//! KILL`, a failover) never gets it, and nothing tells it so. So each gateway also reads
//! the whole hash every `[keys] resync` (30 s by default), and at once each time it
//! (re)subscribes: a lost message is caught up within one resync, and a field written
//! straight into Redis without a PUBLISH is picked up too. While Redis is down the last
//! directory read keeps serving; failures are logged and counted, never a panic, and a
//! hash of the wrong type leaves the last set in place.
//!
//! With a Redis Cluster the hash lives on one slot, and the subscriber listens on one
//! reachable node: a cluster broadcasts PUBLISH to every node. Under Sentinel each
//! operation, and each subscription, goes to the primary the sentinels name at that moment
//! (a failover drops the subscription; the next one is on the new primary, and its
//! resynchronisation catches up).

use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::identity::directory::{self, Change, Directory, Entries, Entry};
use crate::limiter::metrics::{SyncLabels, SyncOutcome};
use crate::limiter::store::{Backend, Settings};

/// Sets or deletes one field and publishes the change, atomically; answers the field's
/// value before. KEYS[1]: the hash; ARGV: field, plan (empty: delete), channel, message.
const CHANGE_SCRIPT: &str = r"
local old = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
redis.call('PUBLISH', ARGV[3], ARGV[4])
return old
";

/// Fields read per HSCAN call in a resynchronisation.
const SCAN_COUNT: usize = 1000;

/// The longest one Redis call of the directory may take (a page of HSCAN, a change, a
/// connect): not on any request's path, so longer than the store timeout.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a subscriber waits before it subscribes again after losing its connection,
/// at first; doubled on each failure up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Messages applied in one swap of the directory, at most.
const MAX_BATCH: usize = 1000;

#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    #[error("no answer from Redis within {0:?}")]
    Timeout(Duration),
    #[error("{0} is not a hash (WRONGTYPE): the key directory cannot be read or changed")]
    WrongType(String),
    #[error("{0}")]
    Redis(#[from] redis::RedisError),
    #[error("{0}")]
    Sentinel(crate::limiter::StoreError),
}

/// Where a shared store's directory lives, and how it is followed: what a change of
/// config must change for the follower to start again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    target: Target,
    prefix: String,
    resync: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Redis(String),
    Cluster(Vec<String>),
    Sentinel(super::Sentinels),
}

impl Location {
    /// `None` for the memory store (its directory is the keys file's).
    pub fn of(store: &Settings, resync: Duration) -> Option<Location> {
        let target = match &store.backend {
            Backend::Memory => return None,
            Backend::Redis { url } => Target::Redis(url.clone()),
            Backend::RedisCluster { nodes } => Target::Cluster(nodes.clone()),
            Backend::RedisSentinel(at) => Target::Sentinel(at.clone()),
        };
        Some(Location {
            target,
            prefix: store.prefix.clone(),
            resync,
        })
    }
}

/// The directory's hash and channel in one Redis or cluster. Connects per operation:
/// changes are an operator's, resynchronisations every few seconds at most.
pub struct RedisKeys {
    at: Location,
    hash: String,
    channel: String,
}

impl RedisKeys {
    pub fn new(at: Location) -> RedisKeys {
        RedisKeys {
            hash: format!("{}:keys", at.prefix),
            channel: format!("{}:keys:changes", at.prefix),
            at,
        }
    }

    /// The hash's name, `<prefix>:keys`.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    async fn timed<T>(
        f: impl std::future::Future<Output = Result<T, redis::RedisError>>,
    ) -> Result<T, DirectoryError> {
        tokio::time::timeout(CALL_TIMEOUT, f)
            .await
            .map_err(|_| DirectoryError::Timeout(CALL_TIMEOUT))?
            .map_err(DirectoryError::Redis)
    }

    fn wrong_type(&self, e: DirectoryError) -> DirectoryError {
        match e {
            DirectoryError::Redis(r) if r.code() == Some("WRONGTYPE") => {
                DirectoryError::WrongType(self.hash.clone())
            }
            e => e,
        }
    }

    /// A connection for the calls of one operation (a change, a resynchronisation).
    async fn connect(&self) -> Result<Conn, DirectoryError> {
        let client = match &self.at.target {
            Target::Redis(url) => redis::Client::open(url.as_str())?,
            Target::Sentinel(at) => Self::primary(at).await?,
            Target::Cluster(nodes) => {
                let client = redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(CALL_TIMEOUT)
                    .response_timeout(CALL_TIMEOUT)
                    .build()?;
                return Ok(Conn::Cluster(
                    Self::timed(client.get_async_connection()).await?,
                ));
            }
        };
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CALL_TIMEOUT))
            .set_response_timeout(Some(CALL_TIMEOUT));
        Ok(Conn::Single(
            Self::timed(client.get_multiplexed_async_connection_with_config(&config)).await?,
        ))
    }

    /// The primary the sentinels name now.
    async fn primary(at: &super::Sentinels) -> Result<redis::Client, DirectoryError> {
        at.primary(CALL_TIMEOUT)
            .await
            .map(|(_, client)| client)
            .map_err(DirectoryError::Sentinel)
    }

    /// Apply `change` to the hash and publish it; the entry the key had before, as the
    /// hash held it ([`Entry::encode`]: its plan, then its label where it had one).
    pub async fn change(&self, change: &Change) -> Result<Option<String>, DirectoryError> {
        let plan = match change {
            Change::Set(_, entry) => entry.encode(),
            Change::Delete(_) => String::new(),
        };
        let script = redis::Script::new(CHANGE_SCRIPT);
        let mut inv = script.key(&self.hash);
        inv.arg(directory::hex(change.digest()))
            .arg(plan)
            .arg(&self.channel)
            .arg(change.message());
        let mut conn = self.connect().await?;
        let old = match &mut conn {
            Conn::Single(c) => Self::timed(inv.invoke_async(c)).await,
            Conn::Cluster(c) => Self::timed(inv.invoke_async(c)).await,
        };
        old.map_err(|e| self.wrong_type(e))
    }

    /// The whole hash, read with HSCAN on one connection; and how many fields were not a
    /// valid entry (not 64 hex digits, or not a plan name and label), which are left out.
    /// A value is the plan, then a space and the label where it has one: a value written
    /// before labels (its plan alone) reads as it was.
    pub async fn read_all(&self) -> Result<(Entries, usize), DirectoryError> {
        let mut conn = self.connect().await?;
        let mut entries = Entries::new();
        let mut bad = 0;
        let mut cursor = 0u64;
        loop {
            let cmd = redis::cmd("HSCAN")
                .arg(&self.hash)
                .arg(cursor)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .to_owned();
            let page: Result<(u64, Vec<(String, String)>), _> = match &mut conn {
                Conn::Single(c) => Self::timed(cmd.query_async(c)).await,
                Conn::Cluster(c) => Self::timed(cmd.query_async(c)).await,
            };
            let (next, page) = page.map_err(|e| self.wrong_type(e))?;
            for (field, plan) in page {
                match (directory::parse_hex(&field), Entry::parse(&plan)) {
                    (Some(d), Some(entry)) => {
                        entries.insert(d, entry);
                    }
                    _ => bad += 1,
                }
            }
            if next == 0 {
                return Ok((entries, bad));
            }
            cursor = next;
        }
    }

    /// A subscription to the changes channel: on the one Redis, or on the first cluster
    /// node that accepts it.
    async fn subscribe(&self) -> Result<redis::aio::PubSub, DirectoryError> {
        let clients: Vec<redis::Client> = match &self.at.target {
            Target::Redis(url) => vec![redis::Client::open(url.as_str())?],
            Target::Sentinel(at) => vec![Self::primary(at).await?],
            Target::Cluster(nodes) => nodes
                .iter()
                .map(|n| redis::Client::open(n.as_str()))
                .collect::<Result<_, _>>()?,
        };
        let mut last = None;
        for client in clients {
            let attempt = async {
                let mut sub = Self::timed(client.get_async_pubsub()).await?;
                Self::timed(sub.subscribe(&self.channel)).await?;
                Ok::<_, DirectoryError>(sub)
            };
            match attempt.await {
                Ok(sub) => return Ok(sub),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(DirectoryError::Timeout(CALL_TIMEOUT)))
    }

    /// Keep `directory` in step with the hash, for as long as the task runs: subscribe,
    /// read the hash whole, apply each change published, read it whole again every
    /// `resync` (and after each new subscription). Never returns.
    pub async fn follow(self, directory: Arc<Directory>, syncs: Family<SyncLabels, Counter>) {
        let count = |outcome: SyncOutcome| {
            syncs.get_or_create(&SyncLabels { outcome }).inc();
        };
        let mut backoff = FIRST_BACKOFF;
        loop {
            match self.subscribe().await {
                Ok(sub) => {
                    count(SyncOutcome::Subscribed);
                    tracing::debug!(channel = %self.channel, "subscribed to key directory changes");
                    backoff = FIRST_BACKOFF;
                    let (mut sink, mut stream) = sub.split();
                    self.resync(&directory, &count).await;
                    let mut tick = tokio::time::interval_at(
                        tokio::time::Instant::now() + self.at.resync,
                        self.at.resync,
                    );
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tokio::select! {
                            msg = stream.next() => {
                                let Some(msg) = msg else { break };
                                let mut changes = Vec::new();
                                self.read_message(&msg, &mut changes, &count);
                                // The messages already waiting go in the same swap.
                                while changes.len() < MAX_BATCH {
                                    match stream.next().now_or_never() {
                                        Some(Some(m)) => self.read_message(&m, &mut changes, &count),
                                        _ => break,
                                    }
                                }
                                directory.apply_all(&changes);
                            }
                            _ = tick.tick() => {
                                // A connection that went quiet without closing is found
                                // here, and subscribed again.
                                let alive = tokio::time::timeout(CALL_TIMEOUT, sink.ping::<String>()).await;
                                if !matches!(alive, Ok(Ok(_))) {
                                    break;
                                }
                                self.resync(&directory, &count).await;
                            }
                        }
                    }
                    count(SyncOutcome::Lost);
                    tracing::warn!(
                        channel = %self.channel,
                        "key directory subscription lost; subscribing again (a resynchronisation catches up what was missed)"
                    );
                }
                Err(e) => {
                    count(SyncOutcome::SubscribeFailed);
                    tracing::warn!(error = %e, channel = %self.channel, "cannot subscribe to key directory changes; the last directory read keeps serving");
                    // Still try to read the hash: the subscription may be what fails.
                    self.resync(&directory, &count).await;
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    fn read_message(
        &self,
        msg: &redis::Msg,
        changes: &mut Vec<Change>,
        count: &impl Fn(SyncOutcome),
    ) {
        let parsed = msg
            .get_payload::<String>()
            .ok()
            .and_then(|text| Change::parse_message(&text));
        match parsed {
            Some(c) => {
                count(SyncOutcome::Change);
                changes.push(c);
            }
            None => {
                count(SyncOutcome::Ignored);
                tracing::warn!(channel = %self.channel, "ignored a malformed key directory message");
            }
        }
    }

    /// Read the hash whole once, before the gateway serves, within `within`: so that its
    /// first requests already know the runtime keys. A failure is logged (the follower
    /// tries again).
    pub async fn first_read(
        &self,
        directory: &Directory,
        syncs: &Family<SyncLabels, Counter>,
        within: Duration,
    ) {
        let count = |outcome: SyncOutcome| {
            syncs.get_or_create(&SyncLabels { outcome }).inc();
        };
        if tokio::time::timeout(within, self.resync(directory, &count))
            .await
            .is_err()
        {
            count(SyncOutcome::Failed);
            tracing::warn!(hash = %self.hash, "the key directory was not read before serving (no answer within {within:?}); the follower keeps trying");
        }
    }

    /// Read the hash whole and make it the directory; on failure keep the last one.
    async fn resync(&self, directory: &Directory, count: &impl Fn(SyncOutcome)) {
        match self.read_all().await {
            Ok((entries, bad)) => {
                if bad > 0 {
                    count(SyncOutcome::Ignored);
                    tracing::warn!(hash = %self.hash, fields = bad, "key directory fields that are not <64 hex digits> = <plan> were ignored");
                }
                directory.replace(entries);
                count(SyncOutcome::Resynced);
            }
            Err(e @ DirectoryError::WrongType(_)) => {
                count(SyncOutcome::WrongType);
                tracing::error!(error = %e, "key directory resynchronisation failed; the last directory read keeps serving");
            }
            Err(e) => {
                count(SyncOutcome::Failed);
                tracing::warn!(error = %e, "key directory resynchronisation failed; the last directory read keeps serving");
            }
        }
    }
}

/// One connection, to one Redis or a cluster.
enum Conn {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}
