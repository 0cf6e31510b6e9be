//! `local_share = "auto"`: how many gateways share the store. Each gateway whose rules ask
//! for it writes a heartbeat to the shared store every [`INTERVAL`] (one background task
//! per limiter, `Store::heartbeat`; in Redis `<prefix>:gateways`, see
//! `limiter/redis/heartbeat.rs`) and keeps the answer, the gateways heard from within
//! [`WINDOW`], in an atomic. The `on_error = "local"` fallback divides each `"auto"` limit
//! by it while the store fails.
//!
//! That is exactly when no heartbeat is answered: the last count is kept for as long as
//! the store is down (the gateways that wrote before the outage are the ones limiting on
//! their own during it). Before any heartbeat has been answered the count is 1: a
//! gateway that never reached the store limits to the whole limit, as without a share.
//! A gateway that stopped is counted until its heartbeat is a [`WINDOW`] old, so for a
//! moment after it the others keep a smaller share: stricter, never looser.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;

use super::breaker::Limiter;

/// How often a gateway writes its heartbeat.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// A gateway not heard from for this long (three heartbeats) is no longer counted.
pub const WINDOW: Duration = Duration::from_secs(3 * INTERVAL.as_secs());

/// The last count of gateways seen, and whether heartbeats are written at all.
pub struct Gateways {
    seen: AtomicU32,
    beating: AtomicBool,
    /// `ratewall_gateways_seen`.
    gauge: Gauge,
}

impl Gateways {
    /// One gateway (this one) until a heartbeat says more.
    pub fn new(gauge: Gauge) -> Gateways {
        gauge.set(1);
        Gateways {
            seen: AtomicU32::new(1),
            beating: AtomicBool::new(false),
            gauge,
        }
    }

    /// The gateways seen lately, this one included (1 before any heartbeat was answered).
    pub fn seen(&self) -> u32 {
        self.seen.load(Relaxed)
    }

    /// Whether this gateway writes heartbeats (a rule has `local_share = "auto"`).
    pub fn beating(&self) -> bool {
        self.beating.load(Relaxed)
    }

    fn record(&self, n: u32) {
        let n = n.max(1);
        self.seen.store(n, Relaxed);
        self.gauge.set(i64::from(n));
    }
}

/// Start `limiter`'s heartbeat, once (later calls do nothing): a task on the current
/// runtime that writes one every [`INTERVAL`], the first at once, for as long as the
/// limiter lives (a reload that changes the store drops the old limiter, and its task
/// stops at its next beat). An in-process store has nothing to share: no task.
pub fn start(limiter: &Arc<Limiter>) {
    if !limiter.store().kind().is_shared() || limiter.gateways().beating.swap(true, Relaxed) {
        return;
    }
    tokio::spawn(beat(Arc::downgrade(limiter)));
}

async fn beat(limiter: Weak<Limiter>) {
    let mut every = tokio::time::interval(INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Whether the last heartbeat was answered: a change is logged once, not every beat.
    let mut answered = true;
    loop {
        every.tick().await;
        let Some(limiter) = limiter.upgrade() else {
            return;
        };
        match limiter.store().heartbeat(WINDOW).await {
            Ok(n) => {
                if !answered {
                    tracing::info!(gateways = n, "heartbeat answered again");
                }
                answered = true;
                limiter.gateways().record(n);
            }
            Err(e) => {
                if answered {
                    tracing::warn!(error = %e, gateways = limiter.gateways().seen(), "heartbeat failed; local_share = \"auto\" keeps the last count of gateways");
                }
                answered = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_is_one_until_told_and_never_below_one() {
        let gauge = Gauge::default();
        let g = Gateways::new(gauge.clone());
        assert_eq!((g.seen(), gauge.get()), (1, 1));
        g.record(3);
        assert_eq!((g.seen(), gauge.get()), (3, 3));
        g.record(0);
        assert_eq!((g.seen(), gauge.get()), (1, 1));
        assert!(!g.beating());
    }
}
