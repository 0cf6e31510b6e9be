//! How a request ended, in one vocabulary: what the access log's `decision` field says,
//! what each metric's label says and what the status page counts are all read off one
//! [`Disposition`], never written as strings where the request is decided.
//!
//! A request's disposition is set where it is decided (by the rules, a refusal, the
//! route, overload) and read once, where the request ends. A rule's own share of a
//! request (`ratewall_requests_total{rule, decision}`) is a disposition too: the request
//! was allowed, delayed or denied by that rule, denied by another one while this one
//! allowed, or would have been denied by this watching rule.

use crate::identity::Refusal;

/// How a request (or one rule's part in it) was disposed of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Let through by its rules without waiting.
    Allowed,
    /// Let through after waiting for the tokens it took ahead (`max_delay`).
    Delayed,
    /// Let through: no rule applied to it.
    Unlimited,
    /// A rule denied it: 429.
    Denied,
    /// One rule's share only: this rule would have let the request through, another
    /// denied it (the store charged this rule nothing).
    DeniedByOther,
    /// One rule's share only: a watching rule (shadow mode, or outside
    /// `enforce_percent`) that would have denied it.
    ShadowDenied,
    /// The store failed and `on_error = "allow"`: let through unlimited.
    StoreBypassed,
    /// The store failed and `on_error = "deny"`: 503.
    StoreUnavailable,
    /// Refused for what it carries before any limit was consulted: no key, an unknown
    /// one, a token that did not verify, a malformed key (400), no key set yet (503), or
    /// a client that failed too often (429).
    Refused(Refusal),
    /// A head the gateway will not pass on: 400; or, `not_implemented`, a method or
    /// transfer coding it does not forward (`CONNECT`): 501.
    Malformed { not_implemented: bool },
    /// Its body could not be read for what it asks a model for (malformed, cut, stalled):
    /// 400 or 408, the connection closed after it.
    BodyUnread,
    /// A rule that reserves a request's `max_tokens` refuses its body
    /// (`on_unreadable = "reject"`): 400, 411 or 413.
    UnreadableBody,
    /// No route matches it, and no pool `default` takes the rest: 404.
    NoRoute,
    /// `redirect_https`: a 308 to the TLS listener.
    Redirected,
    /// `redirect_https` with no host to redirect to: 400.
    NotRedirected,
    /// Let through by its rules, then shed by its pool's overload protection: 503.
    Shed,
}

impl Disposition {
    /// The access log's `decision`.
    pub fn decision(self) -> &'static str {
        match self {
            Disposition::Allowed => "allowed",
            Disposition::Delayed => "delayed",
            Disposition::Unlimited => "unlimited",
            Disposition::Denied => "denied",
            Disposition::DeniedByOther => "denied_by_other",
            Disposition::ShadowDenied => "shadow_denied",
            Disposition::StoreBypassed | Disposition::StoreUnavailable => "store_error",
            Disposition::Refused(r) => r.decision(),
            Disposition::Malformed { .. }
            | Disposition::BodyUnread
            | Disposition::UnreadableBody
            | Disposition::NotRedirected => "bad_request",
            Disposition::NoRoute => "no_route",
            Disposition::Redirected => "redirect",
            Disposition::Shed => "shed",
        }
    }

    /// Whether the request counts among the gateway's requests (its metrics, the status
    /// page): all but a `redirect_https` answer, made before the gateway proper.
    pub fn is_counted(self) -> bool {
        !matches!(self, Disposition::Redirected | Disposition::NotRedirected)
    }

    /// Whether the request went past its limits toward a backend (answered by the
    /// backend, by the gateway when forwarding failed, or shed on the way).
    pub fn passed_limits(self) -> bool {
        matches!(
            self,
            Disposition::Allowed
                | Disposition::Delayed
                | Disposition::Unlimited
                | Disposition::StoreBypassed
                | Disposition::Shed
        )
    }
}
