//! The pools' metrics, registered here: per pool and server, with label values from the
//! config only (the pool's name, the server's URL as the file writes it; a name that
//! resolves to several addresses is one `server`). Each server's series are created at
//! zero when its pool is built, and the request path counts through handles resolved
//! then ([`ServerCounters`], [`PoolCounters`]): no label is hashed per request.

use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::telemetry::LATENCY_BUCKETS;

crate::telemetry::label_sets! {
    pub struct PoolLabels {
        pub pool: String,
    }

    pub struct ServerLabels {
        pub pool: String,
        pub server: String,
    }

    pub struct ServerOutcomeLabels {
        pub pool: String,
        pub server: String,
        pub outcome: ServerOutcome,
    }
}

crate::telemetry::label_enum! {
    /// How one attempt on a server ended (`outcome=`): its answer's status class, or its
    /// failure.
    pub enum ServerOutcome {
        /// 1xx (a final answer after them) and 2xx.
        S2xx = "2xx",
        S3xx = "3xx",
        S4xx = "4xx",
        S5xx = "5xx",
        /// Refused, reset, unreadable: a 502.
        Error,
        /// No answer head within the pool's `timeout`: a 504.
        Timeout,
    }
}

/// How one attempt on a server ended (`outcome=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attempt {
    /// It answered, with a status of this class (index 0 to 3: 2xx to 5xx; 1xx is 2xx's).
    Answered(u16),
    /// Refused, reset, unreadable: a 502.
    Error,
    /// No answer within the pool's `timeout`: a 504.
    Timeout,
}

impl Attempt {
    fn outcome(self) -> ServerOutcome {
        match self {
            Attempt::Answered(status) => match status {
                0..=299 => ServerOutcome::S2xx,
                300..=399 => ServerOutcome::S3xx,
                400..=499 => ServerOutcome::S4xx,
                _ => ServerOutcome::S5xx,
            },
            Attempt::Error => ServerOutcome::Error,
            Attempt::Timeout => ServerOutcome::Timeout,
        }
    }
}

/// Each pool's name with its servers' labels, as a config lists them.
pub type Configured = Vec<(String, Vec<String>)>;

crate::telemetry::metrics! {
    /// Every pool's metric families.
    #[derive(Clone)]
    pub struct PoolMetrics {
        requests: Family<ServerOutcomeLabels, Counter> = ("upstream_server_requests", "Attempts on each pool's servers, by how they ended: the answer's status class, error (refused, reset, unreadable: 502) or timeout (504), a retried request counting once per attempt"),
        duration: Family<ServerLabels, Histogram> = ("upstream_server_duration_seconds", "Time until a server's response head (or its failure), per attempt",
            buckets = LATENCY_BUCKETS,
        ),
        healthy: Family<ServerLabels, Gauge> = ("upstream_server_healthy", "How many of a server's addresses take requests (1 or 0 for one address; a name resolving to several counts each): not those ejected (passive health) or failing their health checks"),
        ejections: Family<ServerLabels, Counter> = ("upstream_ejections", "Times a server was ejected after max_fails failures within fail_window"),
        retries: Family<PoolLabels, Counter> = ("upstream_retries", "Requests sent again to another server of the pool after an attempt failed before any answer"),
        budget_exhausted: Family<PoolLabels, Counter> = ("upstream_retry_budget_exhausted", "Retries not made because the pool's retry budget (20% of its requests over 10 s, plus 3 per second) was spent"),
        no_server: Family<PoolLabels, Counter> = ("upstream_no_server", "Requests answered 502 at once because no server of the pool could take them (all ejected or failing their checks, and none to fall back on)"),
        /// The pools' overload protection (`crate::overload`).
        pub overload: crate::overload::OverloadMetrics = nested,
        /// The pools and servers the last config had ([`PoolMetrics::retain`]).
        known: Arc<Mutex<Configured>> = { Arc::default() },
    }
}

impl PoolMetrics {
    /// The handles of the server `server` (its label) of `pool`, its series created at zero.
    pub fn server(&self, pool: &str, server: &str) -> ServerCounters {
        let labels = ServerLabels {
            pool: pool.to_string(),
            server: server.to_string(),
        };
        let healthy = self.healthy.get_or_create(&labels).clone();
        ServerCounters {
            requests: ServerOutcome::ALL.map(|outcome| {
                self.requests
                    .get_or_create(&ServerOutcomeLabels {
                        pool: pool.to_string(),
                        server: server.to_string(),
                        outcome,
                    })
                    .clone()
            }),
            duration: self.duration.get_or_create(&labels).clone(),
            healthy,
            ejections: self.ejections.get_or_create(&labels).clone(),
        }
    }

    /// The handles of `pool`, its series created at zero.
    pub fn pool(&self, pool: &str) -> PoolCounters {
        let labels = PoolLabels {
            pool: pool.to_string(),
        };
        PoolCounters {
            retries: self.retries.get_or_create(&labels).clone(),
            budget_exhausted: self.budget_exhausted.get_or_create(&labels).clone(),
            no_server: self.no_server.get_or_create(&labels).clone(),
        }
    }

    /// Drop the series of the pools and servers the config no longer has: `keep` lists
    /// each pool now configured with its servers' labels.
    pub fn retain(&self, keep: Configured) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        for (pool, servers) in known.iter() {
            let kept = keep.iter().find(|(k, _)| k == pool);
            for server in servers {
                if kept.is_some_and(|(_, s)| s.contains(server)) {
                    continue;
                }
                let l = ServerLabels {
                    pool: pool.clone(),
                    server: server.clone(),
                };
                for outcome in ServerOutcome::ALL {
                    self.requests.remove(&ServerOutcomeLabels {
                        pool: l.pool.clone(),
                        server: l.server.clone(),
                        outcome,
                    });
                }
                self.duration.remove(&l);
                self.healthy.remove(&l);
                self.ejections.remove(&l);
            }
            if kept.is_none() {
                let labels = PoolLabels { pool: pool.clone() };
                self.retries.remove(&labels);
                self.budget_exhausted.remove(&labels);
                self.no_server.remove(&labels);
            }
        }
        *known = keep;
    }
}

/// One server's handles.
#[derive(Clone)]
pub struct ServerCounters {
    requests: [Counter; 6],
    duration: Histogram,
    pub healthy: Gauge,
    pub ejections: Counter,
}

impl ServerCounters {
    /// One attempt ended as `how`, `took` after it started.
    pub fn attempted(&self, how: Attempt, took: std::time::Duration) {
        self.requests[how.outcome() as usize].inc();
        self.duration.observe(took.as_secs_f64());
    }
}

/// One pool's handles.
#[derive(Clone)]
pub struct PoolCounters {
    pub retries: Counter,
    pub budget_exhausted: Counter,
    pub no_server: Counter,
}
