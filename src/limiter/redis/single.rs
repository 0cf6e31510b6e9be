//! One Redis ([`RedisStore`]): every rule of a request in one atomic script call, and
//! the requests a worker decides in one turn of its event loop batched into one call.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::oneshot;

use super::{dropped, DecideAt, Encoded, Mode, Scripted, Shared};
use crate::limiter::store::{Kind, Receipt, Replication, Settlement};
use crate::limiter::{Adjust, Check, Decision, StoreError};

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
        // On a multi-thread runtime (the decision service's) a task spawned by a running
        // one runs next, ahead of the tasks already woken: yield once, so that the calls
        // those decide join this batch, as they do on a worker's loop.
        let flavor = tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor());
        if flavor.is_ok_and(|f| f == tokio::runtime::RuntimeFlavor::MultiThread) {
            tokio::task::yield_now().await;
        }
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
        Self::replicated(url, prefix, timeout, workers, Replication::Async)
    }

    /// The same, each write call followed by `WAIT` as `replication` asks
    /// (`[store] replication`).
    pub fn replicated(
        url: &str,
        prefix: &str,
        timeout: Duration,
        workers: usize,
        replication: Replication,
    ) -> Result<Self, StoreError> {
        let s = Arc::new(Scripted::new(prefix, timeout, replication));
        Self::on_client(redis::Client::open(url)?, s, workers)
    }

    /// The same on a client made elsewhere, with the script, prefix, timeout and
    /// replication of `s` (each primary a Sentinel names gets a store of its own; one `s`
    /// keeps the gateway's lease ids the same across them).
    pub(super) fn on_client(
        client: redis::Client,
        s: Arc<Scripted>,
        workers: usize,
    ) -> Result<Self, StoreError> {
        let timeout = s.timeout;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(250))))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500));
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

    /// The Redis member name of a check's lease (for tests and the admin API).
    pub fn lease_member(&self, check: &Check<'_>) -> String {
        self.s.member(check)
    }
}

impl Shared for RedisStore {
    type Conn = ConnectionManager;
    const KIND: Kind = Kind::Redis;

    fn scripted(&self) -> &Scripted {
        &self.s
    }

    async fn connection(&self) -> Result<ConnectionManager, StoreError> {
        Ok(self.conn())
    }

    /// A connection left broken by a Redis restart is tried once more: the next try
    /// reconnects.
    async fn ping(&self) -> Result<(), StoreError> {
        match self.s.ping(&mut self.conn()).await {
            Err(e) if dropped(&e) => self.s.ping(&mut self.conn()).await,
            other => other,
        }
    }

    /// Connect and load the scripts ahead of the first request.
    async fn warm(&self) -> Result<(), StoreError> {
        self.s.warm(&mut self.conn()).await
    }
}

impl DecideAt for RedisStore {
    /// Decide all `checks` in one script call, all or nothing. `now_us`: `None` reads Redis
    /// `TIME` (always, in production), and the request joins its worker's next batch;
    /// tests pass a time to replay a timeline exactly, in a call of its own.
    async fn decide_at(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        if now_us.is_none() {
            let encoded = checks.iter().map(|c| self.s.encode(c, None)).collect();
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

    /// Settle `items` in one script call (a dropped connection is tried once more, as a
    /// decision is: a settlement run twice moves the limit twice, by at most one charge).
    async fn settle_at(
        &self,
        items: &[Settlement<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Receipt>, StoreError> {
        let all: Vec<(&Check<'_>, Adjust)> = items.iter().map(|i| (&i.check, i.adjust)).collect();
        match self.s.settle(&mut self.conn(), &all, now_us).await {
            Err(e) if dropped(&e) => self.s.settle(&mut self.conn(), &all, now_us).await,
            other => other,
        }
    }

    /// What `checks` would be told now, without charging or writing anything.
    async fn peek_at(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        let all: Vec<&Check<'_>> = checks.iter().collect();
        self.s
            .call(&mut self.conn(), &all, now_us, Mode::Peek)
            .await
    }
}
