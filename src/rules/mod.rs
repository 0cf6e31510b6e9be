//! Request parts -> the route and the rules that apply. Pure, and compiled at load.
//!
//! A [`Rule`] says which requests it applies to ([`Match`]), who it counts them for
//! ([`Key`]), and its limit ([`Quota`], per plan, or none for an exempt plan). A request's
//! candidate rules are found through a [`RuleIndex`] built once per config, on the path a
//! backend will route ([`normalize_path`]); then [`Rule::applies`] looks at who sent it
//! (what it carries, its plan). [`Routes`] picks the pool a request goes to with the same
//! matches, compiled the same way: the first route that fits wins.

mod index;
mod path;
mod route;

use std::collections::HashMap;
use std::time::Duration;

use http::Method;
use serde::Deserialize;

use crate::identity::{Carried, IdentityDigest, Key, Refusal, Requester};
use crate::limiter::{Algorithm, Quota};

pub use index::RuleIndex;
pub use path::{normalize_path, request_host, Glob, HostPattern, PathCase};
pub use route::{Route, Routes};

/// `settle_within`'s default.
pub const SETTLE_WITHIN: Duration = Duration::from_secs(300);

/// Which paths a rule's `match` takes.
#[derive(Debug, Clone, Default)]
pub enum PathMatch {
    #[default]
    Any,
    Prefix(String),
    Exact(String),
    Glob(Glob),
}

#[derive(Debug, Clone)]
pub struct Match {
    pub path: PathMatch,
    /// Empty: every method.
    pub methods: Vec<Method>,
    /// Empty: every host.
    pub hosts: Vec<HostPattern>,
    /// What the request must carry, or must not (`api_key = "absent"`); empty: anything.
    /// Checked after the path, method and host, with the request's [`Requester`].
    pub carrying: Vec<Condition>,
    /// Rules only (`match = { route = "billing" }`): the rule applies only to requests
    /// sent by this route (its position in [`Routes::list`]). Not the index's: checked
    /// with [`Match::fits_route`] once the route is chosen.
    pub route: Option<usize>,
    /// `proxied = false`: the rule is asked for by name alone (the decision API, Envoy's
    /// descriptors) and never applies to a request the gateway or forward-auth sees: the
    /// index leaves it out.
    pub proxied: bool,
    /// `egress = true`: the rule is the egress gateway's (issue 45), applied to the calls
    /// going out through it and never to a request the proxy or forward-auth sees: the
    /// index leaves it out.
    pub egress: bool,
}

impl Default for Match {
    /// Every request the gateway sees.
    fn default() -> Self {
        Match {
            path: PathMatch::Any,
            methods: Vec::new(),
            hosts: Vec::new(),
            carrying: Vec::new(),
            route: None,
            proxied: true,
            egress: false,
        }
    }
}

/// `api_key = "present"`, `"header:x-user" = "absent"`: one condition of a `match` on what
/// a request carries ([`Requester::carries`] says what counts as carried).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    pub carried: Carried,
    pub present: bool,
}

impl std::fmt::Display for Condition {
    /// As the file writes it: `api_key = "absent"`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = if self.present { "present" } else { "absent" };
        write!(f, "{} = \"{value}\"", self.carried)
    }
}

/// What a rule does for a plan: its own limit for it, or none at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    Limit(Quota),
    /// `exempt = true`: requests whose key has the plan are not limited by the rule.
    Exempt,
}

impl std::fmt::Display for Plan {
    /// `100/s burst 300`, or `exempt`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Plan::Limit(q) => q.fmt(f),
            Plan::Exempt => f.write_str("exempt"),
        }
    }
}

/// Whether a rule whose path, method and host fit a request limits it.
#[derive(Debug, Clone, Copy)]
pub enum Applies<'r> {
    /// Yes, with this quota (its plan's, if the request's key has one).
    Limits(&'r Quota),
    /// No: this condition of its `match` on what the request carries does not hold.
    Unmet(&'r Condition),
    /// No: the request's plan is exempt.
    Exempt,
}

/// Whether a rule blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Denies what its limit does not allow (for `enforce_percent` of identities).
    #[default]
    Enforce,
    /// Decides, counts and logs, adds `RateLimit-Shadow`, never denies.
    Shadow,
}

/// One `[[rules]]` entry, validated.
#[derive(Debug, Clone)]
pub struct Rule {
    pub name: String,
    pub matcher: Match,
    /// Who it counts requests for.
    pub key: Key,
    /// The quota for requests without a plan, then per plan name.
    pub quota: Quota,
    pub plans: HashMap<String, Plan>,
    /// The plans' `priority`, where one sets it (others: 0): a request's place in an
    /// overloaded pool's queue.
    pub priorities: HashMap<String, u32>,
    pub mode: Mode,
    /// With `mode = "enforce"`: the share of identities (by hash) the rule enforces for,
    /// 0 to 100; the others are treated as in shadow mode.
    pub enforce_percent: u8,
    /// With `max_delay`: how many requests may wait on this rule at once in this process.
    pub max_waiting: u32,
    /// Up to this much random time is added to a denial's `Retry-After`, in µs.
    pub retry_jitter_us: u64,
    /// `messages = { rate, burst, max_bytes }`: the WebSocket data frames a client sends
    /// on the sockets this rule admitted, per identity, and how large a message may be.
    pub messages: Option<Messages>,
    /// `bytes = { rate, burst }`: the WebSocket payload bytes a client sends on the
    /// sockets this rule admitted, per identity.
    pub bytes: Option<Bytes>,
    /// How its charges are settled once the backend has answered (`charge`,
    /// `cost_header`, `cost_from`): `None` charges every admitted request on arrival, as
    /// it stands, with nothing to settle.
    pub settle: Option<std::sync::Arc<crate::settle::policy::Policy>>,
    /// The rule whose attempts this rule counts (`charge.attempts`), where it is such a
    /// ceiling: made at load, after the file's own rules, named `<rule>.attempts`.
    pub ceiling_of: Option<String>,
    /// How long a reservation the decision API handed out for this rule waits for its
    /// settlement (`POST /v1/settle`); past it, the charge stands as taken.
    pub settle_within: Duration,
}

/// `messages = { rate = "50/s", burst = 100, max_bytes = "1MiB" }`: a token bucket of
/// data frames per identity, across its sockets (and, through a shared store, across
/// gateways), and the largest message one may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Messages {
    pub rate: crate::limiter::Rate,
    /// Frames a client may send at once; `rate.count` when the file gives none.
    pub burst: u64,
    /// The largest message, its frames' payloads summed (as sent: compressed where they
    /// are); a larger one closes the socket with 1009. `None`: no limit.
    pub max_bytes: Option<u64>,
}

/// `bytes = { rate = "1MiB/s", burst = "4MiB" }`: a token bucket of payload bytes per
/// identity, across its sockets, counted as sent (a compressed payload compressed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes {
    /// Bytes per period.
    pub rate: crate::limiter::Rate,
    /// Bytes a client may send at once; the rate's bytes when the file gives none.
    pub burst: u64,
}

impl Match {
    /// Whether the request's method is one of the rule's. A rule for GET counts HEAD too:
    /// backends answer a HEAD by running their GET handler (RFC 9110 §9.3.2), so HEAD
    /// would otherwise walk around the rule.
    pub fn fits_method(&self, method: &Method) -> bool {
        self.methods.is_empty()
            || self.methods.contains(method)
            || (method == Method::HEAD && self.methods.contains(&Method::GET))
    }

    /// Whether the request's host (without port) is one of the rule's.
    pub fn fits_host(&self, host: Option<&str>) -> bool {
        self.hosts.is_empty() || host.is_some_and(|h| self.hosts.iter().any(|p| p.matches(h)))
    }

    /// Whether a request the route `route` (a position in [`Routes::list`], or none: no
    /// route chose it) sends fits: a match without a route condition fits every route.
    pub fn fits_route(&self, route: Option<usize>) -> bool {
        self.route.is_none_or(|r| route == Some(r))
    }

    /// Whether the (normalised) path fits, checked alone: the [`RuleIndex`] finds the same
    /// rules without looking at each; this is for explaining, and for testing the index.
    pub fn fits_path(&self, path: &str) -> bool {
        match &self.path {
            PathMatch::Any => true,
            PathMatch::Prefix(p) => path.starts_with(p.as_str()),
            PathMatch::Exact(p) => path == p,
            PathMatch::Glob(g) => g.matches(path),
        }
    }

    /// `GET|POST path_prefix /api/ on api.example.com`, or `every request`; then what it
    /// must carry:
    /// `every request, api_key = "absent"`.
    pub fn describe(&self) -> String {
        let mut s = self.describe_parts();
        for c in &self.carrying {
            s.push_str(", ");
            s.push_str(&c.to_string());
        }
        s
    }

    fn describe_parts(&self) -> String {
        if !self.proxied {
            return "asked for by name only (proxied = false)".to_string();
        }
        let every =
            matches!(self.path, PathMatch::Any) && self.methods.is_empty() && self.hosts.is_empty();
        match (self.egress, every) {
            (true, true) => "every call going out (egress = true)".to_string(),
            (true, false) => format!(
                "calls going out (egress = true), {}",
                self.describe_request()
            ),
            (false, _) => self.describe_request(),
        }
    }

    fn describe_request(&self) -> String {
        if matches!(self.path, PathMatch::Any) && self.methods.is_empty() && self.hosts.is_empty() {
            return "every request".to_string();
        }
        let mut s = String::new();
        if !self.methods.is_empty() {
            let m: Vec<&str> = self.methods.iter().map(|m| m.as_str()).collect();
            s.push_str(&m.join("|"));
            s.push(' ');
        }
        match &self.path {
            // As the file writes it: `path_prefix = "/api/"` is no glob.
            PathMatch::Prefix(p) => {
                s.push_str("path_prefix ");
                s.push_str(p);
            }
            PathMatch::Exact(p) => {
                s.push_str("path ");
                s.push_str(p);
            }
            PathMatch::Glob(g) => {
                s.push_str("glob ");
                s.push_str(g.pattern());
            }
            PathMatch::Any => s.push_str("any path"),
        }
        if !self.hosts.is_empty() {
            let h: Vec<String> = self.hosts.iter().map(ToString::to_string).collect();
            s.push_str(" on ");
            s.push_str(&h.join("|"));
        }
        s
    }
}

impl Rule {
    /// The quota that applies to a request whose API key maps to `plan`; `None` if the
    /// plan is exempt.
    pub fn quota_for(&self, plan: Option<&str>) -> Option<&Quota> {
        match plan.and_then(|p| self.plans.get(p)) {
            Some(Plan::Limit(q)) => Some(q),
            Some(Plan::Exempt) => None,
            None => Some(&self.quota),
        }
    }

    /// Whether the rule limits a request its path, method and host fit, and with what
    /// quota: every condition on what the request carries must hold (all are read, so a
    /// key one of them would refuse is refused whatever the others say), then the
    /// request's plan must not be exempt. The request path, `ratewall check` and the admin
    /// API all ask this, with the request's one [`Requester`].
    pub fn applies(&self, requester: &Requester<'_>) -> Result<Applies<'_>, Refusal> {
        let mut unmet = None;
        for c in &self.matcher.carrying {
            if requester.carries(&c.carried)? != c.present {
                unmet = unmet.or(Some(c));
            }
        }
        if let Some(c) = unmet {
            return Ok(Applies::Unmet(c));
        }
        // The plan only where the rule has plans: finding it may verify a token.
        let plan = match self.plans.is_empty() {
            true => None,
            false => requester.plan(),
        };
        Ok(match self.quota_for(plan) {
            Some(q) => Applies::Limits(q),
            None => Applies::Exempt,
        })
    }

    /// The most any of its quotas (its own, a plan's) lets pass at once.
    pub fn largest_burst(&self) -> u64 {
        self.plans
            .values()
            .filter_map(|p| match p {
                Plan::Limit(q) => Some(q.burst),
                Plan::Exempt => None,
            })
            .fold(self.quota.burst, u64::max)
    }

    /// How the rule acts on what its limit says, for `ratewall check`.
    /// `shared`: whether the store is shared by gateways (Redis), where a concurrency
    /// lease carries a TTL; in memory a lease is given back when its request ends.
    pub fn behaviour(&self, shared: bool) -> String {
        let mut s = match (self.mode, self.enforce_percent) {
            (Mode::Shadow, _) => "shadow: decides and counts, never denies".to_string(),
            (Mode::Enforce, 100) => "enforced".to_string(),
            (Mode::Enforce, p) => {
                format!("enforced for {p}% of identities (by hash), shadow for the rest")
            }
        };
        if self.quota.max_delay_us > 0 {
            s.push_str(&format!(
                "; waits up to {} for tokens (at most {} waiting)",
                humantime::format_duration(Duration::from_micros(self.quota.max_delay_us)),
                self.max_waiting
            ));
        }
        if self.quota.algorithm == Algorithm::Concurrency {
            if shared {
                s.push_str(&format!(
                    "; leases live {} in the store unless renewed",
                    humantime::format_duration(Duration::from_micros(self.quota.lease_us))
                ));
            } else {
                s.push_str("; a slot is held until its request ends");
            }
        }
        if self.retry_jitter_us > 0 {
            s.push_str(&format!(
                "; Retry-After + up to {} jitter",
                humantime::format_duration(Duration::from_micros(self.retry_jitter_us))
            ));
        }
        if let Some(m) = &self.messages {
            s.push_str(&format!(
                "; WebSocket data frames {}, burst {}, per identity across its sockets",
                m.rate, m.burst
            ));
            if let Some(max) = m.max_bytes {
                s.push_str(&format!("; WebSocket messages at most {max} bytes"));
            }
        }
        if let Some(b) = &self.bytes {
            s.push_str(&format!(
                "; WebSocket payload bytes {}, burst {}, per identity across its sockets (as sent)",
                b.rate, b.burst
            ));
        }
        s
    }

    /// Whether the rule denies for `identity`, or only watches (shadow mode, or an
    /// identity outside `enforce_percent`). Stable: by the identity's digest, so the same
    /// identities are enforced on every gateway and after restarts, and raising the
    /// percentage only adds identities.
    pub fn enforces(&self, identity: &IdentityDigest) -> bool {
        match self.mode {
            Mode::Shadow => false,
            Mode::Enforce if self.enforce_percent >= 100 => true,
            Mode::Enforce => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&identity.0[8..16]);
                u64::from_le_bytes(b) % 100 < u64::from(self.enforce_percent)
            }
        }
    }
}
