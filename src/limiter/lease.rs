//! The slots a request holds under concurrency limits (`max_in_flight`) while it is in
//! flight, given back when the guard is dropped: when the response body ends, when the
//! client goes away mid-response, or when the request fails before a response.
//!
//! In a shared store each slot is a lease with a TTL (`lua/decide.lua`); while the request
//! is in flight a task renews its leases every third of their TTL, so a gateway that dies
//! (and renews nothing) leaves leases that expire on their own.

use std::sync::Arc;
use std::time::Duration;

use super::breaker::Limiter;
use super::{Check, Quota};
use crate::identity::IdentityDigest;

/// One slot taken.
struct Held {
    identity: IdentityDigest,
    rule: String,
    quota: Quota,
    lease: u64,
}

impl Held {
    fn check(&self) -> Check<'_> {
        Check {
            lease: self.lease,
            ..Check::new(&self.identity, &self.rule, &self.quota)
        }
    }
}

/// A request's concurrency slots; dropping it gives them back.
pub struct Leases {
    limiter: Arc<Limiter>,
    /// Taken from the `on_error = "local"` fallback rather than the store.
    local: bool,
    held: Arc<[Held]>,
    renewer: Option<tokio::task::JoinHandle<()>>,
}

impl Leases {
    /// The slots `checks` took, given their decisions: the concurrency checks the store
    /// charged (every enforcing one of a request let through, and the shadow ones that
    /// allowed). `None` when there are none.
    pub fn taken(
        limiter: &Arc<Limiter>,
        local: bool,
        checks: &[Check<'_>],
        allowed: impl Fn(usize) -> bool,
    ) -> Option<Leases> {
        // Most requests have no concurrency rule: nothing to look at, nothing allocated.
        if !checks
            .iter()
            .any(|c| c.quota.algorithm == super::Algorithm::Concurrency)
        {
            return None;
        }
        let held = held(checks, allowed);
        if held.is_empty() {
            return None;
        }
        let renewer = (!local && limiter.store().kind().is_shared()).then(|| {
            let (limiter, held) = (limiter.clone(), held.clone());
            tokio::spawn(async move {
                let every = held
                    .iter()
                    .map(|h| Duration::from_micros(h.quota.lease_us / 3))
                    .min()
                    .unwrap_or(Duration::from_secs(1))
                    .max(Duration::from_millis(100));
                // Renew each lease until it is found gone (an admin reset): then stop.
                let mut live = vec![true; held.len()];
                while live.iter().any(|l| *l) {
                    tokio::time::sleep(every).await;
                    for (h, l) in held.iter().zip(live.iter_mut()).filter(|(_, l)| **l) {
                        *l = limiter.renew(&h.check()).await;
                    }
                }
            })
        });
        Some(Leases {
            limiter: limiter.clone(),
            local,
            held,
            renewer,
        })
    }

    /// A store call that failed (timed out) for `checks` may still have written their
    /// leases: remove them, best effort (removing a lease that is not there is a no-op).
    /// The same slots, renewed only when [`Leases::renew`] is called (the decision API's
    /// leases: their holder renews them, or they lapse).
    pub fn renewed_by_holder(mut self) -> Leases {
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
        self
    }

    /// Renew every slot in the shared store (a slot held in this process needs none):
    /// false where one is no longer held there (it lapsed).
    pub async fn renew(&self) -> bool {
        if self.in_process() {
            return true;
        }
        let mut all = true;
        for h in self.held.iter() {
            all &= self.limiter.renew(&h.check()).await;
        }
        all
    }

    pub fn abandon(limiter: &Arc<Limiter>, checks: &[Check<'_>]) {
        if !limiter.store().kind().is_shared() {
            return;
        }
        let held = held(checks, |_| true);
        if !held.is_empty() {
            // Dropped at once: released.
            drop(Leases {
                limiter: limiter.clone(),
                local: false,
                held,
                renewer: None,
            });
        }
    }
}

/// The concurrency checks among `checks` for which `taken(index)` holds.
fn held(checks: &[Check<'_>], taken: impl Fn(usize) -> bool) -> Arc<[Held]> {
    checks
        .iter()
        .enumerate()
        .filter(|(i, c)| c.quota.algorithm == super::Algorithm::Concurrency && taken(*i))
        .map(|(_, c)| Held {
            identity: *c.identity,
            rule: c.rule.to_string(),
            quota: *c.quota,
            lease: c.lease,
        })
        .collect()
}

/// A release of leases in a shared store, under way.
pub type Releasing = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

impl Leases {
    /// Give the slots back now. In process this is done when it returns (`None`); in a
    /// shared store, the returned future removes the leases: a response's last bytes wait
    /// on it, so the client's next request cannot reach the store before the release.
    pub fn release(mut self) -> Option<Releasing> {
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
        if self.in_process() {
            // Drop gives them back synchronously.
            return None;
        }
        // Taken out, so that Drop has nothing left to release.
        let held = std::mem::replace(&mut self.held, Arc::from(Vec::new()));
        let limiter = self.limiter.clone();
        Some(Box::pin(async move {
            for h in held.iter() {
                limiter.release(&h.check(), false).await;
            }
        }))
    }

    /// Whether the slots live in this process (the memory store, or the `on_error =
    /// "local"` fallback).
    fn in_process(&self) -> bool {
        self.local || !self.limiter.store().kind().is_shared()
    }
}

impl Drop for Leases {
    fn drop(&mut self) {
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
        if self.held.is_empty() {
            return;
        }
        // In process: given back now, before the client can send its next request.
        if self.in_process() {
            for h in self.held.iter() {
                self.limiter.release_in_process(&h.check(), self.local);
            }
            return;
        }
        let (limiter, held) = (self.limiter.clone(), self.held.clone());
        let release = async move {
            for h in held.iter() {
                limiter.release(&h.check(), false).await;
            }
        };
        // Outside a runtime (a process shutting down) there is nothing to run it on:
        // shared leases then expire by their TTL.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(release);
        }
    }
}
