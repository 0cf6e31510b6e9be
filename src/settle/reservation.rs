//! A [`Reservation`]: the charges an admitted request holds while its answer is awaited
//! (issue 27). Each was taken on arrival like any charge, so requests in flight cannot
//! overshoot a limit together; once the backend has answered (or failed to), each is
//! committed as it stands, refunded, or adjusted to the cost the backend reported,
//! through [`Limiter::settle`](crate::limiter::breaker::Limiter::settle) on the store that decided it.

use std::sync::Arc;

use crate::identity::IdentityDigest;
use crate::limiter::breaker::Limiter;
use crate::limiter::store::{Receipt, Settlement};
use crate::limiter::{Adjust, Algorithm, Check, Quota, MAX_LEVEL};

/// One charge a request holds.
#[derive(Debug, Clone)]
pub struct Reserved {
    pub identity: IdentityDigest,
    /// The rule's name (its Redis key's last part).
    pub rule: Arc<str>,
    /// The quota it was charged under (its cost is the reserved cost).
    pub quota: Quota,
    pub shadow: bool,
    /// The window the charge fell in, as the store named it when it charged
    /// ([`Decision::window`](crate::limiter::Decision::window); windows only).
    pub window: u64,
}

/// The charges one request holds, and where they were made.
pub struct Reservation {
    limiter: Arc<Limiter>,
    /// Decided by the `on_error = "local"` fallback: settled there too.
    local: bool,
    pub items: Vec<Reserved>,
}

impl Reservation {
    /// The charges `items`, decided just now by `limiter`'s store (or its local fallback).
    pub fn new(limiter: Arc<Limiter>, local: bool, items: Vec<Reserved>) -> Reservation {
        Reservation {
            limiter,
            local,
            items,
        }
    }

    /// Settle each charge at what it really cost (`costs[k]` for `items[k]`; `None`: as
    /// reserved). Only the ones that change are sent to the store, in one call. Returns,
    /// for each item, its [`Receipt`] where it was settled (`None`: nothing to change);
    /// `Err` if the store failed (the charges stand as reserved).
    pub async fn settle(&self, costs: &[Option<u64>]) -> Result<Vec<Option<Receipt>>, Failed> {
        let mut changed = Vec::new();
        let mut items = Vec::new();
        for (k, (item, cost)) in self.items.iter().zip(costs).enumerate() {
            let Some(adj) = cost.and_then(|c| adjust(item, c)) else {
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
        let receipts = self
            .limiter
            .settle(&items, self.local)
            .await
            .ok_or(Failed)?;
        for (k, r) in changed.into_iter().zip(receipts) {
            out[k] = Some(r);
        }
        Ok(out)
    }
}

/// The store did not take a settlement (logged and counted where it failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failed;

/// How to settle `item`, reserved at its quota's cost, at a real `cost`; `None` when
/// there is nothing to do. The whole difference is settled, however large — a reported
/// cost is charged in full — up to [`MAX_LEVEL`] cost units, more than any store holds
/// (past it the store forgives the rest anyway; bounded here, every number the Lua twin
/// sees stays exact). A window's refund goes to the window the charge fell in.
pub fn adjust(item: &Reserved, cost: u64) -> Option<Adjust> {
    let q = &item.quota;
    let reserved = q.cost;
    if cost == reserved || q.algorithm == Algorithm::Concurrency {
        return None;
    }
    let most = i128::from(MAX_LEVEL);
    let delta = (i128::from(cost) - i128::from(reserved)).clamp(-most, most);
    Some(Adjust {
        delta: delta as i64,
        window: item.window,
    })
}
