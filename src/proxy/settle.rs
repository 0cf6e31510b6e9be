//! A request's settlement, from the proxy's side (issue 27): the fields a settlement
//! needs on the way up, then what the answer tells it, settled when the answer's head
//! arrives or does not ([`RequestCtx::answered`], [`RequestCtx::unanswered`]), and what
//! that shows in the answer's headers. The settlement itself is held at the decision
//! (`decide/settling.rs`).

use super::RequestCtx;
use crate::settle::{Meter, Settling, Shown};
use crate::upstream::ResponseBody;

impl RequestCtx<'_> {
    /// The request's fields as a settlement needs them: a client's own copy of a cost
    /// header never goes up (a backend that echoed it would report it back as the
    /// request's cost), and an answer whose usage a rule reads is asked for uncompressed
    /// (one that comes compressed anyway is decoded for the scanner: `settle::decode`).
    pub(super) fn settled_fields(&self, headers: &mut http::HeaderMap) {
        for name in self.live.cost_headers.iter() {
            headers.remove(name);
        }
        if self
            .decided
            .settling
            .as_ref()
            .is_some_and(Settling::reads_usage)
        {
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
        if let Some(settling) = &self.decided.settling {
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
        if let Some(settling) = self.decided.settling.take() {
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
        if let Some(settling) = self.decided.settling.take() {
            let updates = settling.unanswered().await;
            self.settled(updates);
        }
    }

    /// Show a settled rule's decision: what it would tell the next request now (the
    /// request's own wait, if it waited, is kept).
    pub(super) fn settled(&mut self, updates: Vec<crate::settle::settling::Update>) {
        for (shown, d) in updates {
            let a = match shown {
                Shown::Applied(k) => self.decided.applied.get_mut(k),
                Shown::Shadow(k) => self.decided.shadow.get_mut(k),
            };
            if let Some(a) = a {
                a.decision.remaining = d.remaining;
                a.decision.reset_us = d.reset_us;
            }
        }
    }
}
