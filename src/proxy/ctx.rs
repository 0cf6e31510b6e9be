//! One request, one context: everything the proxy learns of a request on its way through
//! the phases ([`super::Gateway::handle`]) is kept in its [`RequestCtx`], borrowed by
//! each phase in turn, and read once at the end by [`super::Gateway::finish`], the only
//! place that writes the access line, counts the request's metrics and feeds the status
//! page.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName, HeaderValue};

use super::access::{AccessLine, Entry};
use super::grpc::{self, Dialect};
use crate::runtime::{Live, WaitSlot};
use super::route::Destination;
use crate::config::Config;
use crate::telemetry::disposition::Disposition;
use crate::headers::{self, Applied};
use crate::identity::IdentityDigest;
use crate::limiter::lease::Leases;
use crate::settle::Settling;

/// A request's state from its head to its access line.
pub struct RequestCtx<'l> {
    /// What the request runs on, taken when it started (a reload never changes it).
    pub live: &'l Live,
    /// Whether it is a gRPC call: the gateway's answers to it are gRPC answers.
    pub dialect: Dialect,
    /// When it started (its latency runs from here).
    pub started: Instant,
    /// The access line's part known from the request's head, where the log is on.
    pub(super) line: Option<AccessLine>,
    /// How it was disposed of, as far as it has come.
    pub disposition: Disposition,
    /// The rule that decided: the one that denied, or the one closest to denying.
    pub rule: Option<&'l str>,
    pub identity: Option<IdentityDigest>,
    /// The label of the request's API key, where it is listed with one.
    pub label: Option<Arc<str>>,
    /// A rule that would have denied had it enforced (shadow mode, rollout).
    pub shadow_denied: Option<&'l str>,
    /// How long it waits for the tokens it reserved before it is forwarded.
    pub waited: Duration,
    /// Where it goes, once a route (or the pool `default`) took it.
    pub to: Option<Destination>,
    /// Whether the upstream answered (rather than the gateway).
    pub upstream: bool,
    /// The server of its last attempt (its URL as the file writes it), and how many
    /// servers were tried.
    pub server: Option<Arc<str>>,
    pub attempts: u32,
    /// What an upgraded connection switched to: `websocket`, or `other`.
    pub upgrade: Option<&'static str>,
    /// A gRPC call's final `grpc-status`, where its answer's head carried one.
    pub grpc_status: Option<grpc::Code>,
    /// The enforcing rules' decisions (`RateLimit-*`), and apart, the watching ones'
    /// (`RateLimit-Shadow`).
    pub applied: Vec<Applied<'l>>,
    pub shadow: Vec<Applied<'l>>,
    /// Its concurrency slots, given back when its response ends.
    pub(super) leases: Option<Leases>,
    /// Its places in the queues of the rules it waits on, held while it waits.
    pub(super) slots: Vec<WaitSlot<'l>>,
    /// The rules with a WebSocket limit (`messages`, `bytes`) that let it through: each
    /// one's position, who the request is under it, and how long it may hold a client
    /// back (its `max_delay`, µs). Used only where the request upgrades.
    pub(super) messages: Vec<(usize, IdentityDigest, u64)>,
    /// The headers its verified token's claims give the backend (`[jwt] forward_claims`).
    pub(super) claims: Vec<(HeaderName, HeaderValue)>,
    /// The charges of its rules that settle once the answer is known (`charge`,
    /// `cost_header`, `cost_from`); none for rules whose charge stands as taken.
    pub(super) settling: Option<Settling>,
    /// Its place in an overloaded pool's queue.
    pub(super) priority: u32,
}

impl<'l> RequestCtx<'l> {
    /// A request on `live`, answered in `dialect`; `line`: its access line, where the log
    /// is on.
    pub(super) fn new(live: &'l Live, dialect: Dialect, line: Option<AccessLine>) -> Self {
        RequestCtx {
            live,
            dialect,
            started: Instant::now(),
            line,
            // Until a rule or a refusal says otherwise (a request no phase disposed of
            // was let through unlimited).
            disposition: Disposition::Unlimited,
            rule: None,
            identity: None,
            label: None,
            shadow_denied: None,
            waited: Duration::ZERO,
            to: None,
            upstream: false,
            server: None,
            attempts: 0,
            upgrade: None,
            grpc_status: None,
            applied: Vec::new(),
            shadow: Vec::new(),
            leases: None,
            slots: Vec::new(),
            messages: Vec::new(),
            claims: Vec::new(),
            settling: None,
            priority: 0,
        }
    }

    pub fn config(&self) -> &'l Config {
        &self.live.config
    }

    /// Disposed of as `d`.
    pub(super) fn disposed(&mut self, d: Disposition) -> &mut Self {
        self.disposition = d;
        self
    }

    /// Going to `to` (its route and pool name the access line).
    pub(super) fn going(&mut self, to: Destination) -> &mut Self {
        self.to = Some(to);
        self
    }

    /// Decided by `rule` (its name), for `identity`.
    pub(super) fn by(&mut self, rule: Option<&'l str>, identity: Option<IdentityDigest>) {
        self.rule = rule;
        self.identity = identity;
    }

    /// The route's name, as logs show it.
    pub fn route(&self) -> Option<&'l str> {
        self.to.and_then(|to| to.route_name(self.config()))
    }

    /// The pool's name.
    pub fn pool(&self) -> Option<&'l str> {
        self.to.and_then(|to| to.pool_name(self.config()))
    }

    /// How long the request waits for its reserved tokens before it is forwarded.
    pub fn wait(&self) -> Duration {
        self.waited
    }

    /// The rate-limit headers the upstream's answer gets.
    pub fn decorate(&self, headers: &mut HeaderMap) {
        let cfg = self.config();
        headers::add_ratelimit(headers, cfg.response, &self.applied);
        headers::add_shadow(headers, cfg.response, &self.shadow);
    }

    /// What the access line says of the request beside its head.
    pub(super) fn entry(&self) -> Entry<'_> {
        Entry {
            rule: self.rule,
            decision: self.disposition.decision(),
            identity: self.identity,
            label: self.label.as_deref(),
            shadow_denied: self.shadow_denied,
            waited: self.waited,
            route: self.route(),
            pool: self.pool(),
            server: self.server.as_deref(),
            attempts: self.attempts,
            upgrade: self.upgrade,
            grpc_status: self.grpc_status,
        }
    }

    /// The upstream answered: count each rule's pass (allowed, or delayed where it
    /// waited), enforcing or watching. Counted only now: a request the backend never
    /// answered is that rule's 502 or 504, not its pass, so no rule counts more passes
    /// than the requests that passed.
    pub(super) fn count_passed(&self) {
        for a in self.applied.iter().chain(&self.shadow) {
            let Some(c) = self.live.counters.get(a.index) else {
                continue;
            };
            if !a.decision.allowed {
                // A watching rule that would have denied: its shadow_denied is counted.
                continue;
            }
            if a.decision.retry_after_us > 0 {
                c.delayed.inc();
            } else {
                c.allowed.inc();
            }
        }
    }
}
