//! One request, one context: everything the proxy learns of a request on its way through
//! the phases ([`super::Gateway::handle`]) is kept in its [`RequestCtx`], borrowed by
//! each phase in turn, and read once at the end by [`super::Gateway::finish`], the only
//! place that writes the access line, counts the request's metrics and feeds the status
//! page.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderMap;

use super::access::{AccessLine, Entry};
use super::grpc::{self, Dialect};
use crate::config::Config;
use crate::decide::Decided;
use crate::headers;
use crate::runtime::Live;

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
    /// What its decision found, and what a request let through carries to its answer.
    pub decided: Decided<'l>,
    /// The label of the request's API key, where it is listed with one.
    pub label: Option<Arc<str>>,
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
            decided: Decided::default(),
            label: None,
            upstream: false,
            server: None,
            attempts: 0,
            upgrade: None,
            grpc_status: None,
        }
    }

    pub fn config(&self) -> &'l Config {
        &self.live.config
    }

    /// The route's name, as logs show it.
    pub fn route(&self) -> Option<&'l str> {
        self.decided.to.and_then(|to| to.route_name(self.config()))
    }

    /// The pool's name.
    pub fn pool(&self) -> Option<&'l str> {
        self.decided.to.and_then(|to| to.pool_name(self.config()))
    }

    /// How long the request waits for the tokens it took ahead before it is forwarded.
    pub fn wait(&self) -> Duration {
        self.decided.waited
    }

    /// The rate-limit headers the upstream's answer gets.
    pub fn decorate(&self, headers: &mut HeaderMap) {
        let cfg = self.config();
        headers::add_ratelimit(headers, cfg.response, &self.decided.applied);
        headers::add_shadow(headers, cfg.response, &self.decided.shadow);
    }

    /// What the access line says of the request beside its head.
    pub(super) fn entry(&self) -> Entry<'_> {
        Entry {
            rule: self.decided.rule,
            decision: self.decided.disposition.decision(),
            identity: self.decided.identity,
            label: self.label.as_deref(),
            shadow_denied: self.decided.shadow_denied,
            waited: self.decided.waited,
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
        self.decided.count_passed(self.live);
    }
}
