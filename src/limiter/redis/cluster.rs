//! A Redis Cluster ([`RedisClusterStore`]): one atomic call per identity (one slot
//! each); a denial refunds what the identities before it took.

use std::time::Duration;

use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;

use super::{DecideAt, Mode, Scripted, Shared};
use crate::identity::IdentityDigest;
use crate::limiter::store::{Kind, Replication, Settlement};
use crate::limiter::{Adjust, Check, Decision, StoreError};

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
            conn: tokio::sync::OnceCell::new(),
            s: Scripted::new(prefix, timeout, replication),
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
            let group: Vec<(&Check<'_>, Adjust)> = idx
                .iter()
                .map(|&i| (&checks[i], Adjust::refund_now(checks[i].quota.cost)))
                .collect();
            match self.s.settle(conn, &group, now_us).await {
                Ok(decisions) => {
                    for (&i, d) in idx.iter().zip(decisions) {
                        out[i] = Some(d);
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
    /// Decide all `checks`: one atomic call per identity (one slot each); when an identity
    /// denies, the identities already charged are refunded and the rest only looked at,
    /// so a denied request takes nothing. The answers are in `checks`' order.
    async fn decide_at(
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

    /// Settle `items`, one atomic call per identity (one slot each).
    async fn settle_at(
        &self,
        items: &[Settlement<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        let mut conn = self.connection().await?;
        let checks: Vec<Check<'_>> = items.iter().map(|i| i.check.clone()).collect();
        let mut out: Vec<Option<Decision>> = vec![None; items.len()];
        for idx in by_identity(&checks) {
            let group: Vec<(&Check<'_>, Adjust)> = idx
                .iter()
                .map(|&i| (&items[i].check, items[i].adjust))
                .collect();
            for (&i, d) in idx
                .iter()
                .zip(self.s.settle(&mut conn, &group, now_us).await?)
            {
                out[i] = Some(d);
            }
        }
        out.into_iter()
            .map(|d| d.ok_or_else(|| StoreError::Protocol("a rule went unsettled".into())))
            .collect()
    }

    /// What `checks` would be told, one identity at a time, charging nothing.
    async fn peek_at(
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
