//! The shared stores: one Redis ([`RedisStore`]) or a Redis Cluster
//! ([`RedisClusterStore`]). Both run the Lua twins of the step functions (`lua/`),
//! composed into one script and called with EVALSHA (loaded again on NOSCRIPT by
//! `redis::Script`, on every node of a cluster). Time is Redis' own `TIME`, so every
//! gateway shares one clock.
//!
//! One Redis decides every rule of a request in one atomic call. In a cluster a script
//! may only touch one slot: keys are hash-tagged on the identity
//! (`<prefix>:{<identity-hash>}:<rule>`), so all rules on one identity are still one
//! atomic call; rules on different identities (say, per key and per IP) are decided one
//! identity at a time, and a denial refunds what the identities before it took.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use tokio::sync::oneshot;

use super::{Algorithm, Check, Decision, StoreError};

/// The script Redis runs: the prelude, each algorithm's file, and the dispatcher, compiled
/// into the binary so it always matches the Rust twins.
pub const SCRIPT: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    include_str!("../../lua/token_bucket.lua"),
    include_str!("../../lua/gcra.lua"),
    include_str!("../../lua/fixed_window.lua"),
    include_str!("../../lua/sliding_window.lua"),
    include_str!("../../lua/decide.lua"),
);

/// Renews one concurrency lease while its request is in flight.
pub const LEASE_SCRIPT: &str = include_str!("../../lua/lease.lua");

/// What the script does with the keys it is given.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Decide,
    Peek,
    Refund,
}

/// The script, the key prefix and the per-call timeout: what both stores share.
struct Scripted {
    script: redis::Script,
    lease_script: redis::Script,
    prefix: String,
    timeout: Duration,
    /// Tells this process's leases from other gateways' in a shared lease set.
    instance: u64,
}

/// One check as the script's arguments (see `lua/prelude.lua`).
struct Encoded {
    key: String,
    /// `<algorithm code>:<five parameters>`: the same string for every request on one
    /// rule's quota, which the script parses once per call.
    quota: String,
    shadow: bool,
}

impl Encoded {
    /// Add this key and its 2 arguments; `starts` marks the first key of a batch's
    /// second and later requests (flag 2).
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>, starts: bool) {
        inv.key(&self.key)
            .arg(&self.quota)
            .arg(["0", "1", "2", "3"][usize::from(self.shadow) | if starts { 2 } else { 0 }]);
    }
}

impl Scripted {
    fn new(prefix: &str, timeout: Duration) -> Scripted {
        use std::hash::{BuildHasher, Hasher};
        // 64 random bits (std's per-process SipHash keys) mixed with the pid and the time.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        Scripted {
            script: redis::Script::new(SCRIPT),
            lease_script: redis::Script::new(LEASE_SCRIPT),
            prefix: prefix.to_string(),
            timeout,
            instance: h.finish(),
        }
    }

    /// A concurrency lease's member in the rule's lease set: unique across gateways.
    fn member(&self, check: &Check<'_>) -> String {
        format!("{:016x}-{:x}", self.instance, check.lease)
    }

    async fn timed<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, ::redis::RedisError>>,
    {
        Ok(tokio::time::timeout(self.timeout, f)
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??)
    }

    /// Connect and load both scripts, so the first request does not pay for it (a script
    /// load can take longer than a store timeout).
    async fn warm<C: ConnectionLike>(&self, conn: &mut C) -> Result<(), StoreError> {
        let t = self.timeout.max(Duration::from_secs(1));
        for script in [&self.script, &self.lease_script] {
            tokio::time::timeout(t, script.prepare_invoke().load_async(conn))
                .await
                .map_err(|_| StoreError::Timeout(t))??;
        }
        Ok(())
    }

    /// Remove a lease: its request ended.
    async fn release<C: ConnectionLike>(
        &self,
        conn: &mut C,
        check: &Check<'_>,
    ) -> Result<(), StoreError> {
        let cmd = redis::cmd("ZREM")
            .arg(self.key(check))
            .arg(self.member(check))
            .to_owned();
        let _: i64 = self.timed(cmd.query_async(conn)).await?;
        Ok(())
    }

    /// Extend a lease by its TTL from now. `false`: it had already expired or was reset.
    async fn renew<C: ConnectionLike>(
        &self,
        conn: &mut C,
        check: &Check<'_>,
    ) -> Result<bool, StoreError> {
        let mut inv = self.lease_script.prepare_invoke();
        inv.key(self.key(check))
            .arg(self.member(check))
            .arg(check.quota.lease_us);
        let live: i64 = self.timed(inv.invoke_async(conn)).await?;
        Ok(live == 1)
    }

    /// `<prefix>:{<identity-hash>}:<rule>`.
    fn key(&self, check: &Check<'_>) -> String {
        let mut key = String::with_capacity(self.prefix.len() + check.rule.len() + 36);
        key.push_str(&self.prefix);
        key.push_str(":{");
        check.identity.push_hex(&mut key);
        key.push_str("}:");
        key.push_str(check.rule);
        key
    }

    /// One check as the script takes it: its key and its arguments.
    fn encode(&self, c: &Check<'_>) -> Encoded {
        let q = c.quota;
        let mut n = itoa::Buffer::new();
        let mut quota = String::with_capacity(64);
        quota.push(char::from(b'0' + q.algorithm.code()));
        let mut param = |p: &str| {
            quota.push(':');
            quota.push_str(p);
        };
        match q.algorithm {
            Algorithm::TokenBucket | Algorithm::Gcra => {
                for p in [q.unit, q.per_us, q.capacity(), q.need(), q.slack()] {
                    param(n.format(p));
                }
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                for p in [q.period_us(), q.rate.count, q.cost, 0, 0] {
                    param(n.format(p));
                }
            }
            // The lease id in place of the third parameter.
            Algorithm::Concurrency => {
                param(n.format(q.burst));
                param(n.format(q.lease_us));
                param(&self.member(c));
                param("0");
                param("0");
            }
        }
        Encoded {
            key: self.key(c),
            quota,
            shadow: c.shadow,
        }
    }

    /// One script call for `checks` (all on one slot, in a cluster).
    async fn call<C: ConnectionLike>(
        &self,
        conn: &mut C,
        checks: &[&Check<'_>],
        now_us: Option<u64>,
        mode: Mode,
    ) -> Result<Vec<Decision>, StoreError> {
        let encoded: Vec<Encoded> = checks.iter().map(|c| self.encode(c)).collect();
        self.call_encoded(conn, &encoded, now_us, mode).await
    }

    async fn call_encoded<C: ConnectionLike>(
        &self,
        conn: &mut C,
        checks: &[Encoded],
        now_us: Option<u64>,
        mode: Mode,
    ) -> Result<Vec<Decision>, StoreError> {
        let mut inv = self.script.prepare_invoke();
        match now_us {
            Some(t) => inv.arg(t),
            None => inv.arg(""),
        };
        inv.arg(match mode {
            Mode::Decide => "",
            Mode::Peek => "peek",
            Mode::Refund => "refund",
        });
        for c in checks {
            c.push(&mut inv, false);
        }
        let reply: Vec<redis::Value> = tokio::time::timeout(self.timeout, inv.invoke_async(conn))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??;
        if reply.len() != checks.len() * 4 {
            return Err(StoreError::Protocol(format!(
                "the script returned {} values for {} keys",
                reply.len(),
                checks.len()
            )));
        }
        decisions(&reply)
    }

    /// One script call deciding several requests, one after another, each all or nothing
    /// (at Redis' time). Each request's answers, or its own key error; an `Err` fails all.
    async fn call_batch<C: ConnectionLike>(
        &self,
        conn: &mut C,
        requests: &[&[Encoded]],
    ) -> Result<Vec<Result<Vec<Decision>, StoreError>>, StoreError> {
        let mut inv = self.script.prepare_invoke();
        inv.arg("").arg("");
        for (r, checks) in requests.iter().enumerate() {
            for (k, c) in checks.iter().enumerate() {
                c.push(&mut inv, r > 0 && k == 0);
            }
        }
        let reply: Vec<redis::Value> = tokio::time::timeout(self.timeout, inv.invoke_async(conn))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??;
        let keys: usize = requests.iter().map(|r| r.len()).sum();
        if reply.len() != keys * 4 {
            return Err(StoreError::Protocol(format!(
                "the script returned {} values for {keys} keys",
                reply.len()
            )));
        }
        let mut rest = &reply[..];
        let mut out = Vec::with_capacity(requests.len());
        for checks in requests {
            let (mine, after) = rest.split_at(checks.len() * 4);
            rest = after;
            let failed = match &mine[0] {
                redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
                redis::Value::SimpleString(s) => Some(s.clone()),
                _ => None,
            };
            out.push(match failed {
                Some(why) => Err(StoreError::Data(why)),
                None => decisions(mine),
            });
        }
        Ok(out)
    }

    async fn ping<C: ConnectionLike>(&self, conn: &mut C) -> Result<(), StoreError> {
        let pong: String = tokio::time::timeout(self.timeout, redis::cmd("PING").query_async(conn))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(StoreError::Protocol(format!("PING answered {pong:?}")))
        }
    }

    async fn delete<C: ConnectionLike>(
        &self,
        conn: &mut C,
        check: &Check<'_>,
    ) -> Result<(), StoreError> {
        let _: i64 = tokio::time::timeout(
            self.timeout,
            redis::cmd("DEL").arg(self.key(check)).query_async(conn),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))??;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------

/// At most this many keys go in one batched script call (Redis runs one script at a time:
/// this bounds how long one call holds it).
const MAX_BATCH_KEYS: usize = 256;

/// One Redis, over multiplexed connections: one per worker thread (so a request's Redis
/// I/O runs on the thread that serves it), and one for everything else (start-up, admin).
///
/// Decisions are batched: the requests a worker decides while its event loop goes round
/// once (say, the 30 connections one `epoll_wait` found readable) go to Redis in one
/// script call, decided one after another, each all or nothing as if alone — one `TIME`,
/// one round trip and one script start for all of them. Batches do not wait for each
/// other: a batch is sent as soon as the requests before it in the loop have had their
/// turn, while earlier batches may still be in flight on the same connection.
pub struct RedisStore {
    /// The shared connection and batch (index 0), then one per worker.
    batchers: Box<[Arc<Batcher>]>,
    s: Arc<Scripted>,
}

/// One connection and the requests waiting to go to Redis on it in the next call.
struct Batcher {
    conn: ConnectionManager,
    s: Arc<Scripted>,
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Waiting>,
    /// Whether a task that will send `waiting` is already spawned.
    sending: bool,
}

struct Waiting {
    checks: Vec<Encoded>,
    answer: oneshot::Sender<Result<Vec<Decision>, StoreError>>,
}

impl Batcher {
    async fn decide(self: &Arc<Self>, checks: Vec<Encoded>) -> Result<Vec<Decision>, StoreError> {
        let (answer, answered) = oneshot::channel();
        let spawn = {
            let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            q.waiting.push(Waiting { checks, answer });
            !std::mem::replace(&mut q.sending, true)
        };
        if spawn {
            // Runs after the tasks already woken on this event loop: the requests they
            // decide join this batch.
            tokio::spawn(self.clone().send());
        }
        // No timer of its own: the batch's call is bounded by the store timeout (twice,
        // when a dropped connection is tried again), and always answers or is dropped.
        answered
            .await
            .unwrap_or_else(|_| Err(StoreError::Protocol("the batch was dropped".into())))
    }

    /// Send what waits now, and hand each request its answers: one call per
    /// [`MAX_BATCH_KEYS`] keys. Requests that come meanwhile go in a batch of their own.
    async fn send(self: Arc<Self>) {
        let mut waiting = {
            let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            q.sending = false;
            std::mem::take(&mut q.waiting)
        };
        while !waiting.is_empty() {
            let mut keys = 0;
            let take = waiting
                .iter()
                .take_while(|w| {
                    keys += w.checks.len();
                    keys <= MAX_BATCH_KEYS
                })
                .count()
                .max(1);
            let rest = waiting.split_off(take);
            let batch = std::mem::replace(&mut waiting, rest);
            let answers = match self.call(&batch).await {
                // The connection had dropped: once more on the one being re-established.
                // If the lost call had run, the retry charges twice: stricter, never looser.
                Err(e) if dropped(&e) => self.call(&batch).await,
                other => other,
            };
            match answers {
                Ok(answers) => {
                    for (w, a) in batch.into_iter().zip(answers) {
                        // The request may be gone (its client left): nobody to tell.
                        let _ = w.answer.send(a);
                    }
                }
                Err(e) => {
                    for w in batch {
                        let _ = w.answer.send(Err(e.clone()));
                    }
                }
            }
        }
    }

    async fn call(
        &self,
        batch: &[Waiting],
    ) -> Result<Vec<Result<Vec<Decision>, StoreError>>, StoreError> {
        let mut conn = self.conn.clone();
        if let [one] = batch {
            // Alone: the plain call, whose key errors are Redis errors.
            return self
                .s
                .call_encoded(&mut conn, &one.checks, None, Mode::Decide)
                .await
                .map(|d| vec![Ok(d)]);
        }
        let requests: Vec<&[Encoded]> = batch.iter().map(|w| &w.checks[..]).collect();
        self.s.call_batch(&mut conn, &requests).await
    }
}

impl RedisStore {
    /// Set up the connection without waiting for it: a gateway starts while Redis is down
    /// and answers by `on_error` until Redis is reachable.
    pub fn new(url: &str, prefix: &str, timeout: Duration) -> Result<Self, StoreError> {
        Self::for_workers(url, prefix, timeout, 0)
    }

    /// The same, with a connection of its own for each of `workers` worker threads, made
    /// on the worker's first request (its I/O is then driven by that worker).
    pub fn for_workers(
        url: &str,
        prefix: &str,
        timeout: Duration,
        workers: usize,
    ) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(250))))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500));
        let s = Arc::new(Scripted::new(prefix, timeout));
        let batchers = (0..=workers)
            .map(|_| {
                Ok(Arc::new(Batcher {
                    conn: ConnectionManager::new_lazy_with_config(client.clone(), config.clone())?,
                    s: s.clone(),
                    queue: Mutex::default(),
                }))
            })
            .collect::<Result<_, StoreError>>()?;
        Ok(RedisStore { batchers, s })
    }

    /// This thread's connection and batch: its worker's own, or the shared one.
    fn batcher(&self) -> &Arc<Batcher> {
        let n = crate::worker::current().map_or(0, |n| n + 1);
        &self.batchers[if n < self.batchers.len() { n } else { 0 }]
    }

    fn conn(&self) -> ConnectionManager {
        self.batcher().conn.clone()
    }

    /// The Redis key of one identity under one rule: `<prefix>:{<identity-hash>}:<rule>`.
    pub fn key(&self, check: &Check<'_>) -> String {
        self.s.key(check)
    }

    /// Decide all `checks` in one script call, all or nothing. `now_us`: `None` reads Redis
    /// `TIME` (always, in production), and the request joins its worker's next batch;
    /// tests pass a time to replay a timeline exactly, in a call of its own.
    pub async fn decide(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        if now_us.is_none() {
            let encoded = checks.iter().map(|c| self.s.encode(c)).collect();
            return self.batcher().decide(encoded).await;
        }
        let all: Vec<&Check<'_>> = checks.iter().collect();
        match self
            .s
            .call(&mut self.conn(), &all, now_us, Mode::Decide)
            .await
        {
            // This worker's connection had dropped (Redis restarted, say) while another's
            // already reconnected: one more try on the connection the manager is
            // re-establishing, so each worker does not fail one request of its own. If the
            // lost call had run, the retry charges twice: stricter, never looser.
            Err(e) if dropped(&e) => {
                self.s
                    .call(&mut self.conn(), &all, now_us, Mode::Decide)
                    .await
            }
            other => other,
        }
    }

    /// What `checks` would be told now, without charging or writing anything.
    pub async fn peek(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        let all: Vec<&Check<'_>> = checks.iter().collect();
        self.s
            .call(&mut self.conn(), &all, now_us, Mode::Peek)
            .await
    }

    /// Forget one identity's state under one rule.
    pub async fn reset(&self, check: &Check<'_>) -> Result<(), StoreError> {
        self.s.delete(&mut self.conn(), check).await
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        match self.s.ping(&mut self.conn()).await {
            // A connection left broken by a Redis restart: the next try reconnects.
            Err(e) if dropped(&e) => self.s.ping(&mut self.conn()).await,
            other => other,
        }
    }

    /// Connect and load the scripts ahead of the first request.
    pub async fn warm(&self) -> Result<(), StoreError> {
        self.s.warm(&mut self.conn()).await
    }

    /// Remove a concurrency lease (its request ended).
    pub async fn release(&self, check: &Check<'_>) -> Result<(), StoreError> {
        self.s.release(&mut self.conn(), check).await
    }

    /// Renew a concurrency lease; `false` if it was already gone.
    pub async fn renew(&self, check: &Check<'_>) -> Result<bool, StoreError> {
        self.s.renew(&mut self.conn(), check).await
    }

    /// The Redis member name of a check's lease (for tests and the admin API).
    pub fn lease_member(&self, check: &Check<'_>) -> String {
        self.s.member(check)
    }
}

// ---------------------------------------------------------------------------------------

/// A Redis Cluster through redis-rs' cluster client, which follows MOVED/ASK redirections
/// and node failovers by itself.
pub struct RedisClusterStore {
    client: ClusterClient,
    conn: tokio::sync::OnceCell<ClusterConnection>,
    s: Scripted,
}

impl RedisClusterStore {
    /// Set up the client without connecting: the first call connects (and a failed
    /// connect is tried again by the next call), so the gateway starts while the cluster
    /// is down and answers by `on_error`.
    pub fn new(nodes: &[String], prefix: &str, timeout: Duration) -> Result<Self, StoreError> {
        let client = ClusterClient::builder(nodes.to_vec())
            .connection_timeout(timeout.max(Duration::from_millis(250)))
            .response_timeout(timeout)
            .retries(2)
            .build()?;
        Ok(RedisClusterStore {
            client,
            conn: tokio::sync::OnceCell::new(),
            s: Scripted::new(prefix, timeout),
        })
    }

    pub fn key(&self, check: &Check<'_>) -> String {
        self.s.key(check)
    }

    async fn connection(&self) -> Result<ClusterConnection, StoreError> {
        let timeout = self.s.timeout.max(Duration::from_millis(250));
        let conn = tokio::time::timeout(
            timeout,
            self.conn
                .get_or_try_init(|| self.client.get_async_connection()),
        )
        .await
        .map_err(|_| StoreError::Timeout(timeout))??;
        Ok(conn.clone())
    }

    /// Decide all `checks`: one atomic call per identity (one slot each); when an identity
    /// denies, the identities already charged are refunded and the rest only looked at,
    /// so a denied request takes nothing. The answers are in `checks`' order.
    pub async fn decide(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        let mut conn = self.connection().await?;
        let groups = by_identity(checks);
        if groups.len() == 1 {
            let all: Vec<&Check<'_>> = checks.iter().collect();
            return self.s.call(&mut conn, &all, now_us, Mode::Decide).await;
        }
        let mut out: Vec<Option<Decision>> = vec![None; checks.len()];
        // Per group taken so far, the checks it charged (a denying shadow check took nothing).
        let mut charged: Vec<Vec<usize>> = Vec::new();
        let mut denied = false;
        for idx in &groups {
            let group: Vec<&Check<'_>> = idx.iter().map(|&i| &checks[i]).collect();
            let mode = if denied { Mode::Peek } else { Mode::Decide };
            let decisions = match self.s.call(&mut conn, &group, now_us, mode).await {
                Ok(d) => d,
                // Already denied: these are only looked at for the headers. Their node
                // failing must not turn a denial into a store error (which `on_error =
                // "allow"` would forward): show them as having nothing left.
                Err(e) if denied => {
                    tracing::debug!(error = %e, "peek after a denial failed");
                    vec![
                        Decision {
                            allowed: true,
                            remaining: 0,
                            retry_after_us: 0,
                            reset_us: 0,
                        };
                        group.len()
                    ]
                }
                Err(e) => {
                    self.refund(&mut conn, checks, &charged, now_us, &mut out)
                        .await;
                    return Err(e);
                }
            };
            let all_allowed = group
                .iter()
                .zip(&decisions)
                .all(|(c, d)| d.allowed || c.shadow);
            let took: Vec<usize> = idx
                .iter()
                .zip(&decisions)
                .filter(|(_, d)| d.allowed)
                .map(|(&i, _)| i)
                .collect();
            for (&i, d) in idx.iter().zip(decisions) {
                out[i] = Some(d);
            }
            if !denied {
                if all_allowed {
                    charged.push(took);
                } else {
                    denied = true;
                    self.refund(&mut conn, checks, &charged, now_us, &mut out)
                        .await;
                    charged.clear();
                }
            }
        }
        out.into_iter()
            .map(|d| d.ok_or_else(|| StoreError::Protocol("a rule went undecided".into())))
            .collect()
    }

    /// Give back what `charged` groups took; their answers become what they would be told
    /// now. Best effort: a refund that fails leaves the charge, which can only make the
    /// limit stricter, never looser.
    async fn refund(
        &self,
        conn: &mut ClusterConnection,
        checks: &[Check<'_>],
        charged: &[Vec<usize>],
        now_us: Option<u64>,
        out: &mut [Option<Decision>],
    ) {
        for idx in charged.iter().filter(|idx| !idx.is_empty()) {
            let group: Vec<&Check<'_>> = idx.iter().map(|&i| &checks[i]).collect();
            match self.s.call(conn, &group, now_us, Mode::Refund).await {
                Ok(decisions) => {
                    for (&i, d) in idx.iter().zip(decisions) {
                        out[i] = Some(d);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "refund failed; the charge stands"),
            }
        }
    }

    pub async fn peek(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        let mut conn = self.connection().await?;
        let mut out: Vec<Option<Decision>> = vec![None; checks.len()];
        for idx in by_identity(checks) {
            let group: Vec<&Check<'_>> = idx.iter().map(|&i| &checks[i]).collect();
            for (&i, d) in idx
                .iter()
                .zip(self.s.call(&mut conn, &group, now_us, Mode::Peek).await?)
            {
                out[i] = Some(d);
            }
        }
        out.into_iter()
            .map(|d| d.ok_or_else(|| StoreError::Protocol("a rule went unanswered".into())))
            .collect()
    }

    pub async fn reset(&self, check: &Check<'_>) -> Result<(), StoreError> {
        self.s.delete(&mut self.connection().await?, check).await
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.s.ping(&mut self.connection().await?).await
    }

    pub async fn release(&self, check: &Check<'_>) -> Result<(), StoreError> {
        self.s.release(&mut self.connection().await?, check).await
    }

    /// Connect ahead of the first request (each node loads the script on first use).
    pub async fn warm(&self) -> Result<(), StoreError> {
        self.connection().await.map(|_| ())
    }

    pub async fn renew(&self, check: &Check<'_>) -> Result<bool, StoreError> {
        self.s.renew(&mut self.connection().await?, check).await
    }
}

/// The script's answers, 4 numbers per key (`lua/decide.lua`).
fn decisions(reply: &[redis::Value]) -> Result<Vec<Decision>, StoreError> {
    let num = |v: &redis::Value| match v {
        redis::Value::Int(n) => {
            u64::try_from(*n).map_err(|_| StoreError::Protocol(format!("negative value {n}")))
        }
        other => Err(StoreError::Protocol(format!("not a number: {other:?}"))),
    };
    reply
        .chunks_exact(4)
        .map(|c| {
            Ok(Decision {
                allowed: num(&c[0])? == 1,
                remaining: num(&c[1])?,
                retry_after_us: num(&c[2])?,
                reset_us: num(&c[3])?,
            })
        })
        .collect()
}

/// Whether a call failed because its connection had dropped (worth one more try on the
/// connection being re-established), not because Redis refused or timed out.
fn dropped(e: &StoreError) -> bool {
    match e {
        StoreError::Redis(r) => {
            r.is_connection_dropped()
                || (r.is_io_error() && !r.is_connection_refusal() && !r.is_timeout())
        }
        _ => false,
    }
}

/// Indexes of `checks` grouped by identity (so by cluster slot), in first-seen order.
fn by_identity(checks: &[Check<'_>]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(super::IdentityDigest, Vec<usize>)> = Vec::new();
    for (i, c) in checks.iter().enumerate() {
        match groups.iter_mut().find(|(d, _)| d == c.identity) {
            Some((_, idx)) => idx.push(i),
            None => groups.push((*c.identity, vec![i])),
        }
    }
    groups.into_iter().map(|(_, idx)| idx).collect()
}
