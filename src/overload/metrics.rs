//! The overload protection's metrics, per pool (`upstream=`, the pool's name) and priority
//! (`priority=`, a plan's priority as a number): every series a config implies — each
//! protected pool with priority 0 and each priority a plan sets — is created at zero.

use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

crate::telemetry::label_sets! {
    pub struct OverloadLabels {
        pub upstream: String,
    }

    pub struct OverloadPriorityLabels {
        pub upstream: String,
        pub priority: u32,
    }
}

/// Each protected pool's name, with the priorities its requests may have.
pub type Protected = Vec<(String, Vec<u32>)>;

crate::telemetry::metrics! {
    /// The families, registered once.
    #[derive(Clone)]
    pub struct OverloadMetrics {
        limit: Family<OverloadLabels, Gauge> = ("overload_limit", "The concurrency limit of each pool with overload protection now: adapted from its backend's latency (adaptive), or its max_concurrency"),
        in_flight: Family<OverloadLabels, Gauge> = ("overload_in_flight", "Requests holding one of the pool's overload permits: sent to its backend and not answered yet"),
        queue_length: Family<OverloadPriorityLabels, Gauge> = ("overload_queue_length", "Requests waiting for the pool's permit now, by their plan's priority"),
        wait: Family<OverloadPriorityLabels, Histogram> = ("overload_wait_seconds", "How long requests that got the pool's permit waited for it (0 for those that found room), by priority",
            buckets = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
        ),
        shed: Family<OverloadPriorityLabels, Counter> = ("overload_shed", "Requests answered 503 by the pool's overload protection, by priority: the queue full of requests of their priority or higher, evicted by a higher priority, or max_wait passed"),
        /// The series the last config implied ([`OverloadMetrics::configure`]).
        known: Arc<Mutex<Protected>> = { Arc::default() },
    }
}

/// One pool's handles.
#[derive(Clone)]
pub struct PoolHandles {
    pub limit: Gauge,
    pub in_flight: Gauge,
}

/// One pool's handles at one priority.
#[derive(Clone)]
pub struct PriorityHandles {
    pub queue_length: Gauge,
    pub wait: Histogram,
    pub shed: Counter,
}

impl OverloadMetrics {
    pub fn pool(&self, upstream: &str) -> PoolHandles {
        let labels = OverloadLabels {
            upstream: upstream.to_string(),
        };
        PoolHandles {
            limit: self.limit.get_or_create(&labels).clone(),
            in_flight: self.in_flight.get_or_create(&labels).clone(),
        }
    }

    pub fn priority(&self, upstream: &str, priority: u32) -> PriorityHandles {
        let labels = OverloadPriorityLabels {
            upstream: upstream.to_string(),
            priority,
        };
        PriorityHandles {
            queue_length: self.queue_length.get_or_create(&labels).clone(),
            wait: self.wait.get_or_create(&labels).clone(),
            shed: self.shed.get_or_create(&labels).clone(),
        }
    }

    /// The series of `pools` (each protected pool's name, with the priorities its
    /// requests may have), created at zero; those of pools and priorities no longer
    /// there, removed.
    pub fn configure(&self, pools: Protected) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        for (pool, priorities) in known.iter() {
            let kept = pools.iter().find(|(p, _)| p == pool);
            for &priority in priorities {
                if kept.is_some_and(|(_, ps)| ps.contains(&priority)) {
                    continue;
                }
                let labels = OverloadPriorityLabels {
                    upstream: pool.clone(),
                    priority,
                };
                self.queue_length.remove(&labels);
                self.wait.remove(&labels);
                self.shed.remove(&labels);
            }
            if kept.is_none() {
                let labels = OverloadLabels {
                    upstream: pool.clone(),
                };
                self.limit.remove(&labels);
                self.in_flight.remove(&labels);
            }
        }
        for (pool, priorities) in &pools {
            self.pool(pool);
            for &p in priorities {
                self.priority(pool, p);
            }
        }
        *known = pools;
    }
}
