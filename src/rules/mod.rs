//! Request parts -> the rules that apply. Pure, and compiled at load.
//!
//! A [`Rule`] says which requests it applies to ([`Match`]), who it counts them for
//! ([`Key`]), and its limit ([`Quota`], per plan). A request's rules are found through a
//! [`RuleIndex`] built once per config, on the path a backend will route
//! ([`normalize_path`]).

mod index;
mod path;

use std::collections::HashMap;
use std::time::Duration;

use http::Method;
use serde::Deserialize;

use crate::identity::{IdentityDigest, Key};
use crate::limiter::{Algorithm, Quota};

pub use index::RuleIndex;
pub use path::{normalize_path, request_host, Glob, HostPattern};

/// Which paths a rule's `match` takes.
#[derive(Debug, Clone, Default)]
pub enum PathMatch {
    #[default]
    Any,
    Prefix(String),
    Exact(String),
    Glob(Glob),
}

#[derive(Debug, Clone, Default)]
pub struct Match {
    pub path: PathMatch,
    /// Empty: every method.
    pub methods: Vec<Method>,
    /// Empty: every host.
    pub hosts: Vec<HostPattern>,
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
    pub plans: HashMap<String, Quota>,
    pub mode: Mode,
    /// With `mode = "enforce"`: the share of identities (by hash) the rule enforces for,
    /// 0 to 100; the others are treated as in shadow mode.
    pub enforce_percent: u8,
    /// With `max_delay`: how many requests may wait on this rule at once in this process.
    pub max_waiting: u32,
    /// Up to this much random time is added to a denial's `Retry-After`, in µs.
    pub retry_jitter_us: u64,
}

impl Match {
    /// `GET|POST /api/* on api.example.com`, or `every request`.
    pub fn describe(&self) -> String {
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
            PathMatch::Prefix(p) => {
                s.push_str(p);
                s.push('*');
            }
            PathMatch::Exact(p) => s.push_str(p),
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
    /// The quota that applies to a request whose API key maps to `plan`.
    pub fn quota_for(&self, plan: Option<&str>) -> &Quota {
        plan.and_then(|p| self.plans.get(p)).unwrap_or(&self.quota)
    }

    /// How the rule acts on what its limit says, for `ratewall check`.
    pub fn behaviour(&self) -> String {
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
            s.push_str(&format!(
                "; leases live {} in a shared store unless renewed",
                humantime::format_duration(Duration::from_micros(self.quota.lease_us))
            ));
        }
        if self.retry_jitter_us > 0 {
            s.push_str(&format!(
                "; Retry-After + up to {} jitter",
                humantime::format_duration(Duration::from_micros(self.retry_jitter_us))
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
