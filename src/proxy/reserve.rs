//! An admitted request's reservation (issue 27): the charges of its rules that settle once
//! its answer is known, taken from its decisions ([`Gateway::reserve`]), settled when the
//! answer's head arrives or does not ([`RequestCtx::answered`], [`RequestCtx::unanswered`]),
//! and
//! what that shows in the answer's headers.

use std::sync::Arc;

use super::limits::Limit;
use crate::runtime::Live;
use super::{Body, Gateway, RequestCtx};
use crate::telemetry::disposition::Disposition;
use crate::limiter::reservation::{Reservation, Reserved};
use crate::limiter::{Algorithm, Decision};
use crate::settle::{Held, Meter, Settling, Shown};
use crate::upstream::ResponseBody;

impl Gateway {
    /// The answer to a request whose body says no usable `max_tokens` where a rule it
    /// meets refuses such bodies (`on_unreadable = "reject"`): 400, 411 or 413, counted
    /// and logged under that rule; `None` where none does.
    pub(super) fn refuse_body(
        &self,
        ctx: &mut RequestCtx<'_>,
        fitting: &[usize],
        requester: &crate::identity::Requester<'_>,
        asked: Option<&super::tokens::Asked>,
    ) -> Option<http::Response<Body>> {
        let (index, why) = super::limits::refuses_body(ctx.live, fitting, requester, asked)?;
        let cfg = ctx.config();
        if let Some(c) = ctx.live.counters.get(index) {
            c.refused.inc();
        }
        ctx.disposed(Disposition::UnreadableBody);
        ctx.rule = cfg.rules.get(index).map(|r| r.name.as_str());
        let mut resp = super::problem(super::tokens::refusal(why), cfg, &[], ctx.dialect);
        if why == super::tokens::Unreadable::TooLarge {
            // The rest of an overlong body was never read.
            super::close_after(&mut resp);
        }
        Some(resp)
    }

    /// The charges of an admitted request's rules that settle once its answer is known:
    /// every rule with a settlement policy whose check was charged (allowed), each shown
    /// where [`split`] puts its decision. `None` when no rule settles (the common case:
    /// nothing is allocated).
    pub(super) fn reserve(
        &self,
        live: &Live,
        limits: &[Limit<'_, '_>],
        decisions: &[Option<Decision>],
        local: bool,
    ) -> Option<Settling> {
        if !live.settles {
            return None;
        }
        let (mut applied, mut shadow) = (0, 0);
        let mut items = Vec::new();
        let mut held = Vec::new();
        for (l, d) in limits.iter().zip(decisions) {
            let Some(d) = d else { continue };
            let shown = if l.enforced {
                applied += 1;
                Shown::Applied(applied - 1)
            } else {
                shadow += 1;
                Shown::Shadow(shadow - 1)
            };
            let Some(policy) = &l.rule.settle else {
                continue;
            };
            if !d.allowed || l.quota.algorithm == Algorithm::Concurrency {
                continue;
            }
            items.push(Reserved {
                identity: l.identity.digest,
                rule: Arc::from(l.rule.name.as_str()),
                quota: l.quota,
                shadow: !l.enforced,
                window: d.window,
            });
            held.push(Held::new(policy.clone(), shown));
        }
        if items.is_empty() {
            return None;
        }
        let reservation = Reservation::new(live.limiter.clone(), local, items);
        Some(Settling::new(
            reservation,
            held,
            self.metrics.settle.clone(),
        ))
    }
}

impl RequestCtx<'_> {
    /// The request's fields as a settlement needs them: a client's own copy of a cost
    /// header never goes up (a backend that echoed it would report it back as the
    /// request's cost), and an answer whose usage a rule reads is asked for uncompressed
    /// (one that comes compressed anyway is decoded for the scanner: `settle::decode`).
    pub(super) fn settled_fields(&self, headers: &mut http::HeaderMap) {
        for name in self.live.cost_headers.iter() {
            headers.remove(name);
        }
        if self.settling.as_ref().is_some_and(Settling::reads_usage) {
            headers.insert(
                http::header::ACCEPT_ENCODING,
                http::HeaderValue::from_static("identity"),
            );
        }
    }

    /// What the upstream hop tells a settlement: when the request may have reached a
    /// backend; and the names the request's trailers lose ([`Live::screened`]: the cost
    /// headers, the claims').
    pub(super) fn settled_outbound(&self, out: &mut crate::upstream::Outbound) {
        let live = self.live;
        if let Some(settling) = &self.settling {
            out.reaching(settling.reached());
        }
        if !live.screened.is_empty() {
            out.screening(live.screened.clone());
        }
    }

    /// The answer's head arrived: settle what it tells (status, cost header) and show it;
    /// remove every rule's cost header, whether or not it applied (a client never sees
    /// one). What watches the body for a cost at its end, if anything still settles.
    pub(super) async fn answered(
        &mut self,
        resp: &mut http::Response<ResponseBody>,
    ) -> Option<Meter> {
        let mut meter = None;
        if let Some(settling) = self.settling.take() {
            let (updates, rest) = settling.head(resp.status(), resp.headers_mut()).await;
            self.settled(updates);
            meter = rest.map(|s| Meter::new(s, resp.headers()));
        }
        for name in self.live.cost_headers.iter() {
            resp.headers_mut().remove(name);
        }
        meter
    }

    /// No answer came (no server could be reached, none answered in time, the client's
    /// body failed): give back what charges by status if the request never reached a
    /// backend, and show it in the gateway's answer.
    pub(super) async fn unanswered(&mut self) {
        if let Some(settling) = self.settling.take() {
            let updates = settling.unanswered().await;
            self.settled(updates);
        }
    }

    /// Show a settled rule's decision: what it would tell the next request now (the
    /// request's own wait, if it waited, is kept).
    pub(super) fn settled(&mut self, updates: Vec<crate::settle::settling::Update>) {
        for (shown, d) in updates {
            let a = match shown {
                Shown::Applied(k) => self.applied.get_mut(k),
                Shown::Shadow(k) => self.shadow.get_mut(k),
            };
            if let Some(a) = a {
                a.decision.remaining = d.remaining;
                a.decision.reset_us = d.reset_us;
            }
        }
    }
}
