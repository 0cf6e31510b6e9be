//! A Redis Cluster ([`RedisClusterStore`]): one atomic call per identity (one slot
//! each); a denial refunds what the identities before it took.
//!
//! A cluster connection that answers nothing is replaced ([`Stall`]). redis-rs runs a
//! cluster connection as one task whose calls share one lock over its slot map; while it
//! refreshes that map it polls nothing but the refresh, which waits for the write lock.
//! Since tokio 1.54 (tokio#8371) a lock acquisition takes its permit *before* it checks
//! the task's cooperative budget, so under load a call can hold a read permit while it
//! yields; if a refresh starts then, it waits for a permit that the call, never polled
//! again, never gives back, and every call on the connection times out from then on (seen
//! in `tests/it/failover.rs` on a master SIGKILLed under 2,000 requests a second: the
//! refresh logged waiting for the lock for good while redis-cli saw the cluster whole
//! again). Dropping the connection's last handle aborts its task; the next call connects
//! afresh.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;

use super::{DecideAt, Mode, Scripted, Shared};
use crate::identity::IdentityDigest;
use crate::limiter::store::{Kind, Receipt, Replication, Settlement};
use crate::limiter::{Adjust, Check, Decision, StoreError};

/// A Redis Cluster through redis-rs' cluster client, which follows MOVED/ASK redirections
/// and node failovers by itself (and is replaced when it wedges: see [`Stall`]).
pub struct RedisClusterStore {
    client: ClusterClient,
    /// The connection, made by the first call that needs it; replaced whole (a new cell)
    /// when it stalls. The lock is held only to clone or swap the `Arc`.
    conn: Mutex<Arc<tokio::sync::OnceCell<ClusterConnection>>>,
    stall: Stall,
    s: Scripted,
}

/// When a cluster connection counts as wedged: no call on it has had any answer but a
/// timeout (a result, a Redis error, a refused connection all count as answers) for
/// `after`. A dead master's slots alone do not make it so while other slots answer; a
/// whole cluster down does, and reconnecting then costs one failed connect per `after`.
struct Stall {
    after: Duration,
    epoch: Instant,
    /// Milliseconds since `epoch` of the last answer, or of the last replacement.
    last_answer_ms: AtomicU64,
}

impl Stall {
    fn new(timeout: Duration) -> Stall {
        Stall {
            after: (timeout * 2).max(Duration::from_secs(1)),
            epoch: Instant::now(),
            last_answer_ms: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn answered(&self) {
        self.answered_at(self.now_ms());
    }

    fn timed_out(&self) -> bool {
        self.timed_out_at(self.now_ms())
    }

    fn answered_at(&self, now: u64) {
        self.last_answer_ms.store(now, Ordering::Relaxed);
    }

    /// A call timed out at `now`: whether the connection has answered nothing for
    /// `after` (then the clock restarts, so that one replacement is made per `after` at
    /// most, however many calls time out together).
    fn timed_out_at(&self, now: u64) -> bool {
        let last = self.last_answer_ms.load(Ordering::Relaxed);
        let after = u64::try_from(self.after.as_millis()).unwrap_or(u64::MAX);
        now.saturating_sub(last) >= after
            && self
                .last_answer_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

impl RedisClusterStore {
    /// Set up the client without connecting: the first call connects (and a failed
    /// connect is tried again by the next call), so the gateway starts while the cluster
    /// is down and answers by `on_error`.
    pub fn new(nodes: &[String], prefix: &str, timeout: Duration) -> Result<Self, StoreError> {
        Self::replicated(nodes, prefix, timeout, Replication::Async)
    }

    /// The same, each write call followed by `WAIT` on the master that ran it, as
    /// `replication` asks (`[store] replication`).
    pub fn replicated(
        nodes: &[String],
        prefix: &str,
        timeout: Duration,
        replication: Replication,
    ) -> Result<Self, StoreError> {
        let client = ClusterClient::builder(nodes.to_vec())
            .connection_timeout(timeout.max(Duration::from_millis(250)))
            .response_timeout(timeout)
            // redis-rs' default (16): a redirection (MOVED, or ASK while a slot migrates)
            // is a retry, and a slot in motion can take several; the call as a whole is
            // still bounded by the store timeout.
            .build()?;
        Ok(RedisClusterStore {
            client,
            conn: Mutex::new(Arc::new(tokio::sync::OnceCell::new())),
            stall: Stall::new(timeout),
            s: Scripted::new(prefix, timeout, replication),
        })
    }

    pub fn key(&self, check: &Check<'_>) -> String {
        self.s.key(check)
    }

    async fn connection(&self) -> Result<ClusterConnection, StoreError> {
        let timeout = self.s.timeout.max(Duration::from_millis(250));
        let cell = match self.conn.lock() {
            Ok(cell) => cell.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let conn = tokio::time::timeout(
            timeout,
            cell.get_or_try_init(|| self.client.get_async_connection()),
        )
        .await
        .map_err(|_| StoreError::Timeout(timeout))??;
        Ok(conn.clone())
    }

    /// Note how a call on the connection ended; replace the connection once it has
    /// answered nothing for [`Stall::after`].
    fn observe<T>(&self, result: &Result<T, StoreError>) {
        // A timeout ours (the store timeout) or redis-rs' (its response timeout).
        let timed_out = match result {
            Err(StoreError::Timeout(_)) => true,
            Err(StoreError::Redis(e)) => e.is_timeout(),
            _ => false,
        };
        if !timed_out {
            self.stall.answered();
        } else if self.stall.timed_out() {
            tracing::warn!(
                after = ?self.stall.after,
                "the cluster connection answered nothing; connecting again"
            );
            let fresh = Arc::new(tokio::sync::OnceCell::new());
            match self.conn.lock() {
                Ok(mut cell) => *cell = fresh,
                Err(poisoned) => *poisoned.into_inner() = fresh,
            }
        }
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
            // Each into the window its charge fell in, as its decision named it.
            let (taken, group): (Vec<usize>, Vec<(&Check<'_>, Adjust)>) = idx
                .iter()
                .filter_map(|&i| {
                    let charged = out[i].as_ref()?;
                    Some((
                        i,
                        (&checks[i], Adjust::refund(checks[i].quota.cost, charged)),
                    ))
                })
                .unzip();
            match self.s.settle(conn, &group, now_us).await {
                Ok(receipts) => {
                    // Told as the window it was decided in, now without its charge.
                    for (i, r) in taken.into_iter().zip(receipts) {
                        let window = out[i].map_or(0, |d| d.window);
                        out[i] = Some(Decision { window, ..r.now });
                    }
                }
                Err(e) => tracing::warn!(error = %e, "refund failed; the charge stands"),
            }
        }
    }
}

/// Indexes of `checks` grouped by identity (so by cluster slot), in first-seen order.
fn by_identity(checks: &[Check<'_>]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(IdentityDigest, Vec<usize>)> = Vec::new();
    for (i, c) in checks.iter().enumerate() {
        match groups.iter_mut().find(|(d, _)| d == c.identity) {
            Some((_, idx)) => idx.push(i),
            None => groups.push((*c.identity, vec![i])),
        }
    }
    groups.into_iter().map(|(_, idx)| idx).collect()
}

impl Shared for RedisClusterStore {
    type Conn = ClusterConnection;
    const KIND: Kind = Kind::RedisCluster;

    fn scripted(&self) -> &Scripted {
        &self.s
    }

    async fn connection(&self) -> Result<ClusterConnection, StoreError> {
        RedisClusterStore::connection(self).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.s.ping(&mut self.connection().await?).await
    }

    /// Connect ahead of the first request (each node loads the script on first use).
    async fn warm(&self) -> Result<(), StoreError> {
        self.connection().await.map(|_| ())
    }
}

impl DecideAt for RedisClusterStore {
    async fn decide_at(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        let result = self.decide_on(checks, now_us).await;
        self.observe(&result);
        result
    }

    async fn settle_at(
        &self,
        items: &[Settlement<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Receipt>, StoreError> {
        let result = self.settle_on(items, now_us).await;
        self.observe(&result);
        result
    }

    async fn peek_at(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        let result = self.peek_on(checks, now_us).await;
        self.observe(&result);
        result
    }
}

impl RedisClusterStore {
    /// Decide all `checks`: one atomic call per identity (one slot each); when an identity
    /// denies, the identities already charged are refunded and the rest only looked at,
    /// so a denied request takes nothing. The answers are in `checks`' order.
    async fn decide_on(
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
                            window: 0,
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

    /// Settle `items`, one atomic call per identity (one slot each).
    async fn settle_on(
        &self,
        items: &[Settlement<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Receipt>, StoreError> {
        let mut conn = self.connection().await?;
        let checks: Vec<Check<'_>> = items.iter().map(|i| i.check.clone()).collect();
        let mut out: Vec<Option<Receipt>> = vec![None; items.len()];
        for idx in by_identity(&checks) {
            let group: Vec<(&Check<'_>, Adjust)> = idx
                .iter()
                .map(|&i| (&items[i].check, items[i].adjust))
                .collect();
            for (&i, r) in idx
                .iter()
                .zip(self.s.settle(&mut conn, &group, now_us).await?)
            {
                out[i] = Some(r);
            }
        }
        out.into_iter()
            .map(|r| r.ok_or_else(|| StoreError::Protocol("a rule went unsettled".into())))
            .collect()
    }

    /// What `checks` would be told, one identity at a time, charging nothing.
    async fn peek_on(
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_replaced_once_per_stall_and_never_while_it_answers() {
        let stall = Stall::new(Duration::from_millis(50));
        assert_eq!(stall.after, Duration::from_secs(1), "at least a second");
        assert_eq!(
            Stall::new(Duration::from_secs(2)).after,
            Duration::from_secs(4),
            "twice a long store timeout"
        );
        stall.answered_at(0);
        assert!(!stall.timed_out_at(999), "answered within the second");
        assert!(stall.timed_out_at(1000), "a second of timeouts only");
        assert!(!stall.timed_out_at(1000), "one replacement, not one a call");
        assert!(!stall.timed_out_at(1999));
        assert!(
            stall.timed_out_at(2000),
            "the new one answers nothing either"
        );
        stall.answered_at(2100);
        assert!(!stall.timed_out_at(3000), "it answered since");
        assert!(stall.timed_out_at(3100));
    }
}
