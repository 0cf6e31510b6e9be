//! A [`Reservation`]: the charges an admitted request holds while its answer is awaited
//! (issue 27). Each was taken on arrival like any charge, so requests in flight cannot
//! overshoot a limit together; once the backend has answered (or failed to), each is
//! committed as it stands, refunded, or adjusted to the cost the backend reported,
//! through [`Limiter::settle`](super::guard::Limiter::settle) on the store that decided it.

use std::sync::Arc;
use std::time::Instant;

use super::guard::Limiter;
use super::store::Settlement;
use super::{Adjust, Algorithm, Check, Decision, Quota};
use crate::identity::IdentityDigest;

/// One charge a request holds.
#[derive(Debug, Clone)]
pub struct Reserved {
    pub identity: IdentityDigest,
    /// The rule's name (its Redis key's last part).
    pub rule: Arc<str>,
    /// The quota it was charged under (its cost is the reserved cost).
    pub quota: Quota,
    pub shadow: bool,
    /// The charged decision's reset (µs): where a window's charge fell.
    pub reset_us: u64,
}

/// When the charges were decided: on the store's own clock where it is in process (so an
/// injected clock times them too), else on this process's.
#[derive(Debug, Clone, Copy)]
enum Stamp {
    Store(u64),
    Process(Instant),
}

/// The charges one request holds, and where they were made.
pub struct Reservation {
    limiter: Arc<Limiter>,
    /// Decided by the `on_error = "local"` fallback: settled there too.
    local: bool,
    at: Stamp,
    pub items: Vec<Reserved>,
}

impl Reservation {
    /// The charges `items`, decided just now by `limiter`'s store (or its local fallback).
    pub fn new(limiter: Arc<Limiter>, local: bool, items: Vec<Reserved>) -> Reservation {
        let at = match (local, limiter.store().clock_us()) {
            (false, Some(us)) => Stamp::Store(us),
            _ => Stamp::Process(Instant::now()),
        };
        Reservation {
            limiter,
            local,
            at,
            items,
        }
    }

    /// µs since the charges were decided, on the clock they were decided on.
    fn age_us(&self) -> u64 {
        match self.at {
            Stamp::Store(at) => self
                .limiter
                .store()
                .clock_us()
                .map_or(0, |now| now.saturating_sub(at)),
            Stamp::Process(at) => at.elapsed().as_micros().min(u128::from(u64::MAX)) as u64,
        }
    }

    /// Settle each charge at what it really cost (`costs[k]` for `items[k]`; `None`: as
    /// reserved). Only the ones that change are sent to the store, in one call. Returns,
    /// for each item, what its rule would tell the identity's next request now, where it
    /// was settled (`None`: nothing to change); `Err` if the store failed (the charges
    /// stand as reserved).
    pub async fn settle(&self, costs: &[Option<u64>]) -> Result<Vec<Option<Decision>>, Failed> {
        let age = self.age_us();
        let mut changed = Vec::new();
        let mut items = Vec::new();
        for (k, (item, cost)) in self.items.iter().zip(costs).enumerate() {
            let Some(adj) = cost.and_then(|c| adjust(item, c, age)) else {
                continue;
            };
            changed.push(k);
            items.push(Settlement {
                check: Check {
                    identity: &item.identity,
                    rule: &item.rule,
                    quota: &item.quota,
                    shadow: item.shadow,
                    lease: 0,
                },
                adjust: adj,
            });
        }
        let mut out = vec![None; self.items.len()];
        if items.is_empty() {
            return Ok(out);
        }
        let decisions = self
            .limiter
            .settle(&items, self.local)
            .await
            .ok_or(Failed)?;
        for (k, d) in changed.into_iter().zip(decisions) {
            out[k] = Some(d);
        }
        Ok(out)
    }
}

/// The store did not take a settlement (logged and counted where it failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failed;

/// How to settle `item`, reserved at its quota's cost, at a real `cost`, `age_us` after it
/// was charged; `None` when there is nothing to do. What a charge may add is bounded by
/// what the rule can hold (burst or N, plus `max_debt`), so every value stays exact in
/// Lua. A window's refund is made only while the window it fell in can still be open.
pub fn adjust(item: &Reserved, cost: u64, age_us: u64) -> Option<Adjust> {
    let q = &item.quota;
    let reserved = q.cost;
    let most = reserved.saturating_add(q.burst).saturating_add(q.max_debt);
    let cost = cost.min(most);
    if cost == reserved || q.algorithm == Algorithm::Concurrency {
        return None;
    }
    let window = matches!(
        q.algorithm,
        Algorithm::FixedWindow | Algorithm::SlidingWindow
    );
    let left_us = item.reset_us.checked_sub(age_us);
    if window && cost < reserved && left_us.is_none_or(|l| l == 0) {
        // The window the charge fell in has ended: the charge stands.
        return None;
    }
    Some(Adjust {
        delta: cost as i64 - reserved as i64,
        left_us: if window { left_us } else { None },
    })
}
