//! The charges one admitted request holds until its answer says what they cost
//! ([`Settling`]), and what watches the answer's body for a cost that comes at its end
//! ([`Meter`]: a trailer, the usage an LLM answer reports).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use super::metrics::{SettleDirection as Direction, SettleMetrics, SettleOutcome as Outcome};
use super::policy::{parse_cost, Policy};
use super::usage::{Framing, UsageField, UsageScanner};
use crate::limiter::reservation::Reservation;
use crate::limiter::Decision;

/// Where a rule's decision shows in the answer: among the enforcing rules' `RateLimit`
/// items, or the watching rules' `RateLimit-Shadow`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shown {
    Applied(usize),
    Shadow(usize),
}

/// One rule's charge, held.
pub struct Held {
    pub policy: Arc<Policy>,
    pub shown: Shown,
    /// Settled already (at the head): nothing more to do at the end.
    settled: bool,
}

impl Held {
    pub fn new(policy: Arc<Policy>, shown: Shown) -> Held {
        Held {
            policy,
            shown,
            settled: false,
        }
    }
}

/// A rule's decision as the answer should now show it: what it would tell the next
/// request after the settlement.
pub type Update = (Shown, Decision);

/// The charges a request holds (its [`Reservation`], item for item with `held`). Dropped
/// before the answer's head arrived (the client went away, the request was given up), it
/// refunds, in the background, the charges of the rules that charge by status.
pub struct Settling {
    reservation: Option<Reservation>,
    held: Vec<Held>,
    metrics: SettleMetrics,
    /// The head has arrived: what is still open is settled at the body's end, or stands.
    answered: bool,
}

impl Settling {
    pub fn new(reservation: Reservation, held: Vec<Held>, metrics: SettleMetrics) -> Settling {
        Settling {
            reservation: Some(reservation),
            held,
            metrics,
            answered: false,
        }
    }

    /// The backend did not answer (unreachable, too slow, or the request failed on the
    /// client's side): refund what charges by status. The decisions to show in the
    /// gateway's answer.
    pub async fn unanswered(mut self) -> Vec<Update> {
        let costs: Vec<Option<u64>> = self
            .held
            .iter()
            .map(|h| h.policy.refunds_unanswered().then_some(0))
            .collect();
        self.answered = true;
        self.apply(&costs, true).await
    }

    /// The answer's head has arrived: settle what its status and cost header say, and
    /// remove the cost headers. The decisions to show, and what is left to settle at the
    /// body's end (a trailer, the usage), if anything.
    pub async fn head(
        mut self,
        status: StatusCode,
        headers: &mut HeaderMap,
    ) -> (Vec<Update>, Option<Settling>) {
        self.answered = true;
        let mut costs = vec![None; self.held.len()];
        let mut refunds = false;
        let mut invalid = Vec::new();
        for (k, h) in self.held.iter_mut().enumerate() {
            if h.policy.refunds(status) {
                costs[k] = Some(0);
                h.settled = true;
                refunds = true;
                continue;
            }
            let Some(name) = &h.policy.cost_header else {
                continue;
            };
            let Some(value) = headers.get(name) else {
                continue;
            };
            h.settled = true;
            match parse_cost(value) {
                Some(c) => costs[k] = Some(c),
                None => invalid.push(k),
            }
        }
        for k in invalid {
            self.invalid(k, "header");
        }
        for h in &self.held {
            if let Some(name) = &h.policy.cost_header {
                headers.remove(name);
            }
        }
        let updates = if costs.iter().any(Option::is_some) {
            self.apply(&costs, refunds).await
        } else {
            Vec::new()
        };
        let open = self
            .held
            .iter()
            .any(|h| !h.settled && h.policy.settles_at_end());
        (updates, open.then_some(self))
    }

    /// Settle at `costs` (`None`: as reserved); `refunds`: the ones at 0 are refunds of
    /// the whole charge (the status, no answer), not a reported cost of 0.
    async fn apply(&mut self, costs: &[Option<u64>], refunds: bool) -> Vec<Update> {
        let Some(r) = &self.reservation else {
            return Vec::new();
        };
        let result = r.settle(costs).await;
        let mut updates = Vec::new();
        for (k, cost) in costs.iter().enumerate() {
            let (Some(cost), Some(item), Some(held)) = (cost, r.items.get(k), self.held.get(k))
            else {
                continue;
            };
            let rule = &*item.rule;
            let reserved = item.quota.cost;
            match &result {
                Err(_) => self.metrics.count(rule, Outcome::Failed),
                Ok(done) => {
                    let Some(receipt) = done.get(k).copied().flatten() else {
                        continue;
                    };
                    updates.push((held.shown, receipt.now));
                    self.metrics.forgave(rule, receipt.forgiven);
                    if *cost < reserved {
                        let outcome = if refunds && *cost == 0 {
                            Outcome::Refunded
                        } else {
                            Outcome::ChargedLess
                        };
                        self.metrics.count(rule, outcome);
                        self.metrics
                            .moved(rule, Direction::Refunded, reserved - cost);
                    } else {
                        self.metrics.count(rule, Outcome::ChargedMore);
                        self.metrics.moved(
                            rule,
                            Direction::Charged,
                            (cost - reserved).saturating_sub(receipt.forgiven),
                        );
                    }
                }
            }
        }
        updates
    }

    fn invalid(&self, k: usize, source: &'static str) {
        let rule = self
            .reservation
            .as_ref()
            .and_then(|r| r.items.get(k))
            .map_or("", |i| &*i.rule);
        tracing::warn!(
            rule,
            source,
            "the answer reported a cost that is not a whole number at least 0; the reserved cost stands"
        );
        self.metrics.count(rule, Outcome::Invalid);
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let costs: Vec<Option<u64>> = self
            .held
            .iter()
            .map(|h| h.policy.refunds_unanswered().then_some(0))
            .collect();
        if costs.iter().all(Option::is_none) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut rest = Settling {
            reservation: self.reservation.take(),
            held: std::mem::take(&mut self.held),
            metrics: self.metrics.clone(),
            answered: true,
        };
        runtime.spawn(async move {
            rest.apply(&costs, true).await;
        });
    }
}

/// The settlement a body's end waits for before its last frame goes out (so a client
/// that has the whole answer sees it on its next request).
pub type Finishing = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Watches an answer's body for the cost its end reports: a trailer named by a rule's
/// `cost_header`, or the usage an OpenAI-compatible answer reports (`cost_from`), read by
/// one [`UsageScanner`] per count asked for as the bytes pass. Never holds a byte back;
/// keeps no copy of the body.
pub struct Meter {
    settling: Settling,
    /// Per held charge: the cost its end reported, once seen.
    costs: Vec<Option<u64>>,
    /// The usage counts the rules ask for, each scanned once (at most three).
    scanners: Vec<(UsageField, UsageScanner)>,
}

impl Meter {
    /// A meter for the body of an answer of `content_type` (a usage is read from JSON
    /// and event-stream bodies only).
    pub fn new(settling: Settling, content_type: Option<&http::HeaderValue>) -> Meter {
        let costs = vec![None; settling.held.len()];
        let mut scanners: Vec<(UsageField, UsageScanner)> = Vec::new();
        if let Some(framing) = Framing::of(content_type) {
            for h in settling.held.iter().filter(|h| !h.settled) {
                if let Some(field) = h.policy.usage {
                    if scanners.iter().all(|(f, _)| *f != field) {
                        scanners.push((field, UsageScanner::new(framing, field)));
                    }
                }
            }
        }
        Meter {
            settling,
            costs,
            scanners,
        }
    }

    /// A frame passing through: data is scanned for a usage; trailers carrying a cost
    /// are read and the cost removed.
    pub fn frame(&mut self, frame: &mut hyper::body::Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            for (_, scanner) in &mut self.scanners {
                scanner.feed(data);
            }
        } else if let Some(trailers) = frame.trailers_mut() {
            self.trailers(trailers);
        }
    }

    fn trailers(&mut self, trailers: &mut HeaderMap) {
        for k in 0..self.settling.held.len() {
            let h = &self.settling.held[k];
            if h.settled {
                continue;
            }
            let Some(name) = h.policy.cost_header.clone() else {
                continue;
            };
            if let Some(value) = trailers.get(&name) {
                match parse_cost(value) {
                    Some(c) => self.costs[k] = Some(c),
                    None => self.settling.invalid(k, "trailer"),
                }
                self.settling.held[k].settled = true;
            }
            trailers.remove(&name);
        }
    }

    /// The body has ended: the settlement of what it reported, to run before its last
    /// frame goes out; `None` when it reported nothing (the reservations stand).
    pub fn finish(mut self) -> Option<Finishing> {
        let mut costs = std::mem::take(&mut self.costs);
        for (k, h) in self.settling.held.iter().enumerate() {
            let Some(field) = h.policy.usage.filter(|_| !h.settled && costs[k].is_none()) else {
                continue;
            };
            if let Some((_, scanner)) = self.scanners.iter_mut().find(|(f, _)| *f == field) {
                costs[k] = scanner.finish();
            }
        }
        if costs.iter().all(Option::is_none) {
            return None;
        }
        let mut settling = self.settling;
        Some(Box::pin(async move {
            settling.apply(&costs, false).await;
        }))
    }
}
