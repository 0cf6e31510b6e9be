//! The charges one admitted request holds until its answer says what they cost
//! ([`Settling`]), and what watches the answer's body for a cost that comes at its end
//! ([`Meter`]: a trailer, the usage an LLM answer reports), reading on after the client
//! has gone ([`Meter::drain`]) so that leaving early never dodges the bill.
//!
//! What a client can do to its charge (issue 41), and what each does:
//! - it leaves (FIN, RST, a cancelled HTTP/2 stream, a body cut, malformed or stalled)
//!   before its request reached a backend: given back, as for a backend that could not
//!   be reached, an overload shed, the gateway's own refusal — nothing was done for it;
//! - it leaves once a backend may have received the request (a connection to it was open
//!   and the request going up): the charge stands, whatever the rule charges by, as
//!   nginx's 499 still counts;
//! - it leaves mid-answer while a cost is still to come at the answer's end: the gateway
//!   reads on (within `settle_drain`) and settles what the end reports; where no cost
//!   ever comes, the reservation stands — never less.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body_util::BodyExt;

use super::decode::Decoder;
use super::metrics::{DrainResult, SettleDirection as Direction, SettleMetrics, SettleOutcome};
use super::policy::{parse_cost, Drain, Policy};
use super::reservation::Reservation;
use super::usage::{Framing, UsageField, UsageScanner};
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
/// gives back, in the background, the charges of the rules that charge by status — if
/// the request never reached a backend ([`Settling::reached`]).
pub struct Settling {
    /// Shared with the settlements under way (each a task of its own: a client that goes
    /// away never cuts one short).
    reservation: Option<Arc<Reservation>>,
    held: Vec<Held>,
    metrics: SettleMetrics,
    /// Set by the upstream hop once an attempt starts sending the request to a server.
    reached: Arc<AtomicBool>,
    /// The head has arrived: what is still open is settled at the body's end, or stands.
    answered: bool,
}

impl Settling {
    pub fn new(reservation: Reservation, held: Vec<Held>, metrics: SettleMetrics) -> Settling {
        Settling {
            reservation: Some(Arc::new(reservation)),
            held,
            metrics,
            reached: Arc::new(AtomicBool::new(false)),
            answered: false,
        }
    }

    /// Let every held charge stand as reserved: nothing is sent (a reservation the
    /// decision API handed out and nobody settled within its rule's `settle_within`).
    pub fn stand(mut self) {
        self.answered = true;
    }

    /// Settle every held charge at `cost` units (`None`: a refund of the whole charge),
    /// for a holder that learns the cost elsewhere (the decision API's `POST /v1/settle`),
    /// counted as the proxy's settlements are. False where the store did not take it (the
    /// charges stand as reserved).
    pub async fn settle_all(mut self, cost: Option<u64>) -> bool {
        self.answered = true;
        let units = cost.unwrap_or(0);
        let changes = self.reservation.as_ref().is_some_and(|r| {
            r.items
                .iter()
                .any(|i| super::reservation::adjust(i, units).is_some())
        });
        let costs = vec![Some(units); self.held.len()];
        let updates = self.apply(&costs, cost.is_none()).await;
        !changes || !updates.is_empty()
    }

    /// What the upstream hop sets once the request may have reached a backend
    /// (`upstream::Outbound::reaching`).
    pub fn reached(&self) -> Arc<AtomicBool> {
        self.reached.clone()
    }

    /// Whether a rule reads the answer's body for its usage (`cost_from`): the request
    /// then asks the backend for an answer it can read (`Accept-Encoding: identity`).
    pub fn reads_usage(&self) -> bool {
        self.held.iter().any(|h| h.policy.usage.is_some())
    }

    /// The costs that give back what a request that never reached a backend holds under
    /// the rules that charge by status (`None` elsewhere: the charge stands), or none at
    /// all where it may have reached one.
    fn unsent_costs(&self) -> Option<Vec<Option<u64>>> {
        if self.reached.load(Relaxed) {
            return None;
        }
        let costs: Vec<Option<u64>> = self
            .held
            .iter()
            .map(|h| h.policy.refunds_unsent().then_some(0))
            .collect();
        costs.iter().any(Option::is_some).then_some(costs)
    }

    /// No answer came (no server could be reached, none answered in time, the client's
    /// body failed): give back what charges by status if the request never reached a
    /// backend; one that may have keeps every charge. The decisions to show in the
    /// gateway's answer.
    pub async fn unanswered(mut self) -> Vec<Update> {
        self.answered = true;
        match self.unsent_costs() {
            Some(costs) => self.apply(&costs, true).await,
            None => Vec::new(),
        }
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
    /// the whole charge (the status, no answer), not a reported cost of 0. The store call
    /// runs as a task of its own, awaited here: dropped mid-way (its client gone), this
    /// leaves it to finish — a settlement once begun is never lost to a client leaving.
    async fn apply(&mut self, costs: &[Option<u64>], refunds: bool) -> Vec<Update> {
        let Some(r) = self.reservation.clone() else {
            return Vec::new();
        };
        let shown: Vec<Shown> = self.held.iter().map(|h| h.shown).collect();
        let task = settle(r, self.metrics.clone(), shown, costs.to_vec(), refunds);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => runtime.spawn(task).await.unwrap_or_default(),
            Err(_) => task.await,
        }
    }

    /// A settling whose charges are all settled (what a [`Meter`] cut short leaves).
    fn done() -> Settling {
        Settling {
            reservation: None,
            held: Vec::new(),
            metrics: SettleMetrics::default(),
            reached: Arc::new(AtomicBool::new(true)),
            answered: true,
        }
    }

    /// The reserved cost of held charge `k`.
    fn reserved(&self, k: usize) -> u64 {
        self.reservation
            .as_ref()
            .and_then(|r| r.items.get(k))
            .map_or(0, |i| i.quota.cost)
    }

    fn rule(&self, k: usize) -> &str {
        self.reservation
            .as_ref()
            .and_then(|r| r.items.get(k))
            .map_or("", |i| &*i.rule)
    }

    fn invalid(&self, k: usize, source: &'static str) {
        let rule = self.rule(k);
        tracing::warn!(
            rule,
            source,
            "the answer reported a cost that is not a whole number at least 0; the reserved cost stands"
        );
        self.metrics.count(rule, SettleOutcome::Invalid);
    }

    /// The usage of the held charges still open at the end cannot be read (the answer's
    /// coding, a corrupt one, past its bound): counted; their reservations stand.
    fn unread(&self, why: &str) {
        for (k, h) in self.held.iter().enumerate() {
            if !h.settled && h.policy.usage.is_some() {
                let rule = self.rule(k);
                tracing::warn!(
                    rule,
                    why,
                    "the answer's usage cannot be read; the reserved cost stands"
                );
                self.metrics.count(rule, SettleOutcome::Unread);
            }
        }
    }

    /// The most a drain reads, and for how long: the largest bounds of the rules still
    /// open at the end.
    fn drain_bounds(&self) -> Drain {
        self.held
            .iter()
            .filter(|h| !h.settled && h.policy.settles_at_end())
            .map(|h| h.policy.drain)
            .fold(
                Drain {
                    bytes: 0,
                    time: Duration::ZERO,
                },
                |a, b| Drain {
                    bytes: a.bytes.max(b.bytes),
                    time: a.time.max(b.time),
                },
            )
    }
}

/// One settlement of `reservation` at `costs`, and the metrics it adds: what each settled
/// rule now tells, where it is `shown`. (See [`Settling::apply`].)
async fn settle(
    reservation: Arc<Reservation>,
    metrics: SettleMetrics,
    shown: Vec<Shown>,
    costs: Vec<Option<u64>>,
    refunds: bool,
) -> Vec<Update> {
    let result = reservation.settle(&costs).await;
    let mut updates = Vec::new();
    for (k, cost) in costs.iter().enumerate() {
        let (Some(cost), Some(item), Some(&shown)) = (cost, reservation.items.get(k), shown.get(k))
        else {
            continue;
        };
        let rule = &*item.rule;
        let reserved = item.quota.cost;
        match &result {
            Err(_) => metrics.count(rule, SettleOutcome::Failed),
            Ok(done) => {
                let Some(receipt) = done.get(k).copied().flatten() else {
                    continue;
                };
                updates.push((shown, receipt.now));
                // A cost past what a settlement carries (`adjust`'s bound) is forgiven too.
                let sent =
                    super::reservation::adjust(item, *cost).map_or(0, |a| a.delta.unsigned_abs());
                let clipped = cost.abs_diff(reserved).saturating_sub(sent);
                let forgiven = receipt.forgiven.saturating_add(clipped);
                metrics.forgave(rule, forgiven);
                if *cost < reserved {
                    let outcome = if refunds && *cost == 0 {
                        SettleOutcome::Refunded
                    } else {
                        SettleOutcome::ChargedLess
                    };
                    metrics.count(rule, outcome);
                    metrics.moved(rule, Direction::Refunded, reserved - cost);
                } else {
                    metrics.count(rule, SettleOutcome::ChargedMore);
                    metrics.moved(
                        rule,
                        Direction::Charged,
                        (cost - reserved).saturating_sub(forgiven),
                    );
                }
            }
        }
    }
    updates
}

impl Drop for Settling {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let Some(costs) = self.unsent_costs() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut rest = Settling {
            reservation: self.reservation.take(),
            held: std::mem::take(&mut self.held),
            metrics: self.metrics.clone(),
            reached: self.reached.clone(),
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

/// How many decoded bytes a compressed answer's usage is looked for in, per byte of the
/// answer a drain would read: past it the reservation stands (a decompression bomb costs
/// a bounded amount of work).
const DECODED_PER_BYTE: u64 = 16;

/// The most answers read on at once after their clients left, in the whole process: each
/// holds an upstream connection (and its decoder's window) for up to `settle_drain`'s
/// time. Past it an answer is not read on: what its scanners saw so far is settled (no
/// less than the reservation), as for one cut at its bounds.
pub const MAX_DRAINS: usize = 1024;

/// The answers being read on now ([`MAX_DRAINS`]).
static DRAINING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One place among the [`MAX_DRAINS`] answers read on at once, given back when dropped.
struct DrainPlace;

impl DrainPlace {
    fn take() -> Option<DrainPlace> {
        DRAINING
            .fetch_update(Relaxed, Relaxed, |n| (n < MAX_DRAINS).then_some(n + 1))
            .ok()
            .map(|_| DrainPlace)
    }
}

impl Drop for DrainPlace {
    fn drop(&mut self) {
        DRAINING.fetch_sub(1, Relaxed);
    }
}

/// Watches an answer's body for the cost its end reports: a trailer named by a rule's
/// `cost_header`, or the usage an OpenAI-compatible answer reports (`cost_from`), read by
/// one [`UsageScanner`] per count asked for as the bytes pass — from the bytes decoded
/// where the answer came compressed anyway (the gateway asked for `identity`). Never
/// holds a byte back; keeps no copy of the body.
pub struct Meter {
    settling: Settling,
    /// Per held charge: the cost its end reported, once seen.
    costs: Vec<Option<u64>>,
    /// The usage counts the rules ask for, each scanned once (at most three).
    scanners: Vec<(UsageField, UsageScanner)>,
    /// The answer's content coding, undone for the scanners.
    decoder: Option<Decoder>,
    /// The usage cannot be read (a coding not undone, or one that failed): what it
    /// would have settled stands as reserved.
    unread: bool,
}

impl Meter {
    /// A meter for the body of an answer with these `headers` (a usage is read from JSON
    /// and event-stream bodies only, decoded where they are compressed).
    pub fn new(settling: Settling, headers: &HeaderMap) -> Meter {
        let costs = vec![None; settling.held.len()];
        let mut scanners: Vec<(UsageField, UsageScanner)> = Vec::new();
        let mut decoder = None;
        let mut unread = false;
        let content_type = headers.get(http::header::CONTENT_TYPE);
        let wanted: Vec<UsageField> = settling
            .held
            .iter()
            .filter(|h| !h.settled)
            .filter_map(|h| h.policy.usage)
            .collect();
        if let (Some(framing), false) = (Framing::of(content_type), wanted.is_empty()) {
            let budget = settling
                .drain_bounds()
                .bytes
                .saturating_mul(DECODED_PER_BYTE);
            match Decoder::of(headers, budget) {
                Ok(d) => decoder = d,
                Err(why) => {
                    settling.unread(why.name());
                    unread = true;
                }
            }
            for field in wanted {
                if scanners.iter().all(|(f, _)| *f != field) {
                    scanners.push((field, UsageScanner::new(framing, field)));
                }
            }
        }
        Meter {
            settling,
            costs,
            scanners,
            decoder,
            unread,
        }
    }

    /// A frame passing through: data is scanned for a usage; trailers carrying a cost
    /// are read and the cost removed.
    pub fn frame(&mut self, frame: &mut hyper::body::Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            self.scan(data);
        } else if let Some(trailers) = frame.trailers_mut() {
            self.trailers(trailers);
        }
    }

    fn scan(&mut self, data: &Bytes) {
        if self.unread || self.scanners.is_empty() {
            return;
        }
        let scanners = &mut self.scanners;
        match &mut self.decoder {
            None => {
                for (_, scanner) in scanners.iter_mut() {
                    scanner.feed(data);
                }
            }
            Some(decoder) => {
                let fed = decoder.feed(data, |decoded| {
                    for (_, scanner) in scanners.iter_mut() {
                        scanner.feed(decoded);
                    }
                });
                if let Err(e) = fed {
                    self.settling.unread(e.name());
                    self.unread = true;
                }
            }
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
        if let Some(Err(e)) = self.decoder.as_mut().map(Decoder::finish) {
            if !self.unread {
                self.settling.unread(e.name());
                self.unread = true;
            }
        }
        let mut costs = std::mem::take(&mut self.costs);
        for (k, h) in self.settling.held.iter().enumerate() {
            let Some(field) = h.policy.usage.filter(|_| !h.settled && costs[k].is_none()) else {
                continue;
            };
            if self.unread {
                continue;
            }
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

    /// The body was cut short (the backend broke it, or a drain stopped at its bounds):
    /// the settlement of the usage its scanners saw so far where it is above the
    /// reservation (a backend that reports usage as it goes), else none (the reservations
    /// stand). Never less than the reservation.
    pub fn cut(mut self) -> Option<Finishing> {
        let mut costs = vec![None; self.settling.held.len()];
        for (k, h) in self.settling.held.iter().enumerate() {
            let Some(field) = h.policy.usage.filter(|_| !h.settled && !self.unread) else {
                continue;
            };
            let reserved = self.settling.reserved(k);
            costs[k] = self
                .scanners
                .iter()
                .find(|(f, _)| *f == field)
                .and_then(|(_, s)| s.seen())
                .filter(|&seen| seen > reserved);
        }
        if costs.iter().all(Option::is_none) {
            return None;
        }
        let mut settling = std::mem::replace(&mut self.settling, Settling::done());
        Some(Box::pin(async move {
            settling.apply(&costs, false).await;
        }))
    }

    /// The client went away before the answer's end: read the rest of `body` (within the
    /// rules' `settle_drain`: so many bytes, so long) and settle what its end reports, as
    /// if the client had stayed. Cut at a bound, broken by the backend, past
    /// [`MAX_DRAINS`] at once, or ending without a cost, the reservations stand (or the
    /// usage seen so far, if more): a client that leaves never pays less than them.
    pub async fn drain<B>(mut self, mut body: B)
    where
        B: hyper::body::Body<Data = Bytes> + Unpin,
    {
        let metrics = self.settling.metrics.clone();
        let Some(_place) = DrainPlace::take() else {
            if let Some(settle) = self.cut() {
                settle.await;
            }
            metrics.drained(DrainResult::Cut);
            return;
        };
        let bounds = self.settling.drain_bounds();
        let deadline = tokio::time::Instant::now() + bounds.time;
        let mut read = 0u64;
        // Whether the answer ended (else it was cut).
        let ended = loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) | Ok(Some(Err(_))) => break false,
                Ok(None) => break true,
                Ok(Some(Ok(frame))) => frame,
            };
            let mut frame = frame;
            if let Some(data) = frame.data_ref() {
                read = read.saturating_add(data.len() as u64);
                if read > bounds.bytes {
                    break false;
                }
            }
            self.frame(&mut frame);
            if body.is_end_stream() {
                break true;
            }
        };
        let result = match ended {
            true => self.finished().await,
            false => {
                if let Some(settle) = self.cut() {
                    settle.await;
                }
                DrainResult::Cut
            }
        };
        metrics.drained(result);
    }

    /// The end reached while draining: settle what it reported.
    async fn finished(self) -> DrainResult {
        match self.finish() {
            Some(settle) => {
                settle.await;
                DrainResult::Settled
            }
            None => DrainResult::Stood,
        }
    }
}
