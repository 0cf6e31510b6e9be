//! The metrics the gateway owns: one request's decisions by rule, its outcome and time
//! end to end, the responses clients got and the upstream's answers, refusals before any
//! limit, reloads, the requests in flight or waiting for their tokens, and the gRPC
//! statuses of the answers to gRPC calls; with them the dashboards' (`dashboards.rs`).

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use super::dashboards::{Dashboards, RuleDashboard};
use crate::telemetry::grpc::{Code, Origin};
use crate::telemetry::stats::Outcome;
use crate::telemetry::{label_enum, Disposition, LATENCY_BUCKETS};

label_enum! {
    /// How a rule's decision on one request is counted (`decision=`).
    pub enum DecisionLabel {
        /// The rule allowed the request, the request passed (charged) and the upstream
        /// answered it; one it did not answer is the rule's upstream failure instead
        /// (`ratewall_rule_upstream_failures_total`).
        Allowed,
        /// The rule allowed the request after it waited for its tokens (`max_delay`).
        Delayed,
        /// The rule denied the request.
        Denied,
        /// A shadow rule would have denied it, but let it pass.
        ShadowDenied,
        /// The rule would have allowed the request, but another rule denied it: charged
        /// nothing here (a denied request takes nothing from the rules it passed).
        DeniedByOther,
        /// The store failed; `on_error` answered.
        Error,
        /// The rule refused the request before any limit was consulted: its identity is
        /// missing or unknown (401).
        Refused,
        /// The rule refused the request before any limit was consulted: the key (or header)
        /// it counts by is malformed (400: sent twice, too long).
        BadKey,
        /// The rule allowed and charged the request (it needs no credential, so it was
        /// decided first), and another rule refused it for its credentials (401, or 429
        /// once its address failed too often) or its body: the charge stands.
        RefusedByOther,
    }
}

crate::telemetry::label_sets! {
    pub struct RuleLabels {
        pub rule: String,
        pub decision: DecisionLabel,
    }

    pub struct ClassLabels {
        /// `2xx`..`5xx` from the upstream, or `error` (refused, timed out, reset).
        pub class: &'static str,
    }

    pub struct ResponseLabels {
        /// The status class the client got.
        pub class: &'static str,
        /// Who answered: `upstream` or `gateway` (401, 429, 502, 503, 504...).
        pub source: &'static str,
    }

    pub struct ProtocolLabels {
        /// `HTTP/1.0`, `HTTP/1.1` or `HTTP/2`.
        pub protocol: &'static str,
        /// `TLSv1.3` or `TLSv1.2` over the TLS listener; `none` in cleartext.
        pub tls: &'static str,
    }
}

/// The protocols and TLS versions `ratewall_client_requests_total` counts by.
const PROTOCOLS: [&str; 3] = ["HTTP/1.0", "HTTP/1.1", "HTTP/2"];
const TLS_VERSIONS: [&str; 3] = ["none", "TLSv1.2", "TLSv1.3"];

label_enum! {
    /// Why the gateway refused a request before any limit was consulted
    /// (`ratewall_refusals_total{reason}`).
    pub enum RefusalReason {
        /// 401: no API key (or no value of the header a rule counts by), and the rule needs one.
        MissingKey,
        /// 401: a key not listed, with `unknown = "reject"`.
        UnknownKey,
        /// 400: a malformed key header, or a request head the gateway will not pass on.
        Malformed,
        /// 501: a method or transfer coding the gateway does not forward (`CONNECT`).
        NotImplemented,
        /// 404: no route matches the request, and no pool `default` takes the rest.
        NoRoute,
        /// 401: a bearer token that did not verify (or lacks the claim the rule counts by).
        InvalidToken,
        /// 503: a rule counts by a token claim, and no key set has been fetched yet.
        KeysUnavailable,
        /// 400, 411, 413: a rule reserves the request's `max_tokens` and refuses a body
        /// that says none it can use (`on_unreadable = "reject"`).
        UnreadableBody,
        /// 429: the client's address failed too many tokens or sent too many unknown keys
        /// (`[jwt] failures`, `[keys] failures`); its credential was not checked.
        Throttled,
    }
}

impl RefusalReason {
    /// A refusal of a malformed head, by the status it is answered.
    pub fn of_status(status: u16) -> RefusalReason {
        match status {
            501 => RefusalReason::NotImplemented,
            _ => RefusalReason::Malformed,
        }
    }
}

impl From<crate::identity::Refusal> for RefusalReason {
    fn from(r: crate::identity::Refusal) -> RefusalReason {
        use crate::identity::Refusal;
        match r {
            Refusal::MissingKey
            | Refusal::MissingHeader
            | Refusal::MissingCert
            | Refusal::MissingToken => RefusalReason::MissingKey,
            Refusal::InvalidToken(_) | Refusal::MissingClaim => RefusalReason::InvalidToken,
            Refusal::KeysUnavailable => RefusalReason::KeysUnavailable,
            Refusal::UnknownKey => RefusalReason::UnknownKey,
            Refusal::Malformed(_) => RefusalReason::Malformed,
            Refusal::Throttled(_) => RefusalReason::Throttled,
        }
    }
}

crate::telemetry::label_sets! {
    pub struct RefusalLabels {
        pub reason: RefusalReason,
    }

    pub struct OutcomeLabels {
        pub outcome: Outcome,
    }
}

label_enum! {
    /// A forwarded request the upstream did not answer, by what the client got.
    pub enum UpstreamFailure {
        /// 502.
        Error = "upstream_error",
        /// 504.
        Timeout = "upstream_timeout",
    }
}

crate::telemetry::label_sets! {
    pub struct RuleFailureLabels {
        pub rule: String,
        pub outcome: UpstreamFailure,
    }

    pub struct GrpcLabels {
        /// The `grpc-status`, `0`..`16`.
        pub code: Code,
        /// `gateway` (its own answer) or `upstream` (the backend's, passed on).
        pub source: Origin,
    }
}

label_enum! {
    pub enum ReloadResult {
        Ok,
        Rejected,
    }
}

crate::telemetry::label_sets! {
    pub struct ReloadLabels {
        pub result: ReloadResult,
    }
}

label_enum! {
    /// Who asked for a decision (`ratewall_decisions_total{frontend}`).
    pub enum FrontEndKind {
        /// A request the gateway proxies.
        Proxy,
        /// The decision API (`POST /v1/decide`, `/v1/leases`).
        Decide,
        /// Envoy's rate limit service (`ShouldRateLimit`).
        Rls,
        /// A proxy's forward-auth call.
        ForwardAuth,
        /// A call going out through the egress gateway (issue 45).
        Egress,
    }
}

label_enum! {
    /// How a decision ended, as `ratewall_decisions_total` counts it.
    pub enum DecisionOutcome {
        /// Let through (or no rule limited it, or the store failed and `on_error` let it).
        Allowed,
        Denied,
        /// Refused before any limit: its credentials, a malformed key, no route.
        Refused,
        /// The store failed and `on_error = "deny"`.
        Error,
    }
}

impl DecisionOutcome {
    pub fn of(d: Disposition) -> DecisionOutcome {
        match d {
            Disposition::Allowed
            | Disposition::Delayed
            | Disposition::Unlimited
            | Disposition::StoreBypassed
            | Disposition::Shed
            | Disposition::ShadowDenied => DecisionOutcome::Allowed,
            Disposition::Denied | Disposition::DeniedByOther => DecisionOutcome::Denied,
            Disposition::StoreUnavailable => DecisionOutcome::Error,
            _ => DecisionOutcome::Refused,
        }
    }
}

crate::telemetry::label_sets! {
    pub struct DecisionsLabels {
        pub frontend: FrontEndKind,
        pub decision: DecisionOutcome,
    }
}

/// The classes [`status_class`] names, in order, and "error" (upstream failures).
const CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "error"];

fn class_index(class: &str) -> usize {
    CLASSES
        .iter()
        .position(|c| *c == class)
        .unwrap_or(CLASSES.len() - 1)
}

pub fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

crate::telemetry::metrics! {
    /// The gateway's metrics, registered by [`GatewayMetrics::register`], every series the
    /// config does not name created then at zero (a rule's, by
    /// [`GatewayMetrics::rule_counters`], at load).
    pub struct GatewayMetrics {
        pub requests: Family<RuleLabels, Counter> = ("requests", "Decisions by rule: allowed (let through, and the upstream answered), delayed (the same, after waiting, max_delay), denied, shadow_denied (would have denied: shadow mode or outside enforce_percent), denied_by_other (this rule would have allowed it, another denied it: charged nothing here), error (store failed), refused (this rule refused the request before any limit: its key missing or unknown, 401), bad_key (its key malformed, 400), refused_by_other (this rule, which needs no credential, charged the request and another refused it for its credentials: the charge stands)"),
        pub responses: Family<ResponseLabels, Counter> = ("responses", "Responses sent to clients, by status class and by who answered (upstream or gateway)"),
        pub upstream_duration: Histogram = ("upstream_duration_seconds", "Time until the upstream's response head (or its failure)",
            buckets = LATENCY_BUCKETS,
        ),
        pub upstream_responses: Family<ClassLabels, Counter> = ("upstream_responses", "Upstream answers by status class, or error (refused, timed out, reset)"),
        pub reloads: Family<ReloadLabels, Counter> = ("config_reloads", "Config reloads (SIGHUP) by result",
            zero = ReloadResult::ALL.map(|result| ReloadLabels { result }),
        ),
        pub decisions: Family<DecisionsLabels, Counter> = ("decisions", "Decisions by who asked (frontend: proxy, decide, rls, forward_auth) and how they ended: allowed (let through: no rule limited it, or the store failed and on_error let it), denied, refused (before any limit: credentials, a malformed key, no route), error (the store failed, on_error = deny). One set of rules and counters answers them all"),
        pub in_flight: Gauge = ("in_flight_requests", "Requests being handled now"),
        /// Requests waiting for the tokens they took ahead (`max_delay`) now.
        pub waiting: Gauge = ("waiting_requests", "Requests waiting for their reserved tokens (max_delay) before they are forwarded"),
        /// End to end, by outcome: from the request's head read to its answer's head handed
        /// to the connection. The upstream's buckets and a minute.
        pub request_duration: Family<OutcomeLabels, Histogram> = ("request_duration_seconds", "Requests end to end, from the head read to the answer's head sent, by outcome: allowed (the upstream answered), denied (429), unauthorized (401: no key or an unknown one), bad_request (400 or 501 before any limit: a malformed head or key, a tunnel), store_unavailable (503: the store failed), overloaded (503: shed by the pool's overload protection), upstream_error (502), upstream_timeout (504), client_error (the client's body malformed or stalled while forwarding). Its _count is every request once",
            buckets = LATENCY_BUCKETS.into_iter().chain([60.0]),
        ),
        pub refusals: Family<RefusalLabels, Counter> = ("refusals", "Requests refused before any limit was consulted, by reason: missing_key (401), unknown_key (401), malformed (400), not_implemented (501), no_route (404), invalid_token (401: a bearer token that did not verify), keys_unavailable (503: no JWKS fetched yet)"),
        /// Forwarded requests the upstream did not answer, per rule that let them through.
        pub rule_upstream_failures: Family<RuleFailureLabels, Counter> = ("rule_upstream_failures", "Requests a rule let through that the upstream did not answer: upstream_error (502), upstream_timeout (504)"),
        /// Requests the cleartext listener answered with a 308 to the TLS listener
        /// (`redirect_https`), never admitted.
        pub https_redirects: Counter = ("https_redirects", "Requests the cleartext listener answered with a 308 to the TLS listener (redirect_https): never admitted, so in no other request count"),
        /// Request header fields whose name has an underscore, dropped before anything read
        /// them (`[server] underscores_in_headers = false`).
        pub underscore_fields_dropped: Counter = ("underscore_fields_dropped", "Request header fields whose name has an underscore (X_Api_Key), dropped before the rules or the upstream saw them: CGI, WSGI and Rack read them as the dashed name ([server] underscores_in_headers = false)"),
        /// Requests by HTTP version and TLS version, and their handles (see `PROTOCOLS`).
        pub client_requests: Family<ProtocolLabels, Counter> = ("client_requests", "Requests from clients by HTTP version (HTTP/1.0, HTTP/1.1, HTTP/2) and TLS version (TLSv1.3, TLSv1.2; none in cleartext)"),
        /// Answers to gRPC calls by `grpc-status` and by who wrote them.
        pub grpc_responses: Family<GrpcLabels, Counter> = ("grpc_responses", "Answers to gRPC calls (content-type application/grpc) by grpc-status (0..16) and by who wrote them: gateway (its own Trailers-Only answers: 8 denied, 16 unauthenticated, 14 store or upstream unavailable, 4 upstream timeout, 13 malformed, 12 no route) or upstream (the backend's status, from its trailers or Trailers-Only headers; an answer ending without one is not counted)"),
        /// Denials by rule and plan, their retry delays, requests near their limit, the
        /// good-client SLO (`dashboards.rs`).
        pub dashboards: Dashboards = nested,
        /// `grpc_responses`' handles, by code, then gateway / upstream.
        grpc_handles: [[Counter; Origin::ALL.len()]; Code::ALL.len()] = {
            Code::ALL.map(|code| {
                Origin::ALL.map(|source| {
                    grpc_responses
                        .get_or_create(&GrpcLabels { code, source })
                        .clone()
                })
            })
        },
        protocol_handles: [[Counter; TLS_VERSIONS.len()]; PROTOCOLS.len()] = {
            PROTOCOLS.map(|protocol| {
                TLS_VERSIONS.map(|tls| {
                    client_requests
                        .get_or_create(&ProtocolLabels { protocol, tls })
                        .clone()
                })
            })
        },
        /// `responses` (by class, then gateway / upstream), `upstream_responses`,
        /// `request_duration` and `refusals` handles, resolved once: counting then takes no
        /// lock on the family and hashes no labels.
        response_handles: [[Counter; 2]; 6] = {
            CLASSES.map(|class| {
                [false, true].map(|upstream| match class {
                    // The upstream's failures only: a client always gets a status.
                    "error" => Counter::default(),
                    _ => responses
                        .get_or_create(&ResponseLabels {
                            class,
                            source: if upstream { "upstream" } else { "gateway" },
                        })
                        .clone(),
                })
            })
        },
        upstream_handles: [Counter; 6] = {
            CLASSES.map(|class| {
                upstream_responses
                    .get_or_create(&ClassLabels { class })
                    .clone()
            })
        },
        duration_handles: [Histogram; Outcome::ALL.len()] = {
            Outcome::ALL.map(|outcome| {
                request_duration
                    .get_or_create(&OutcomeLabels { outcome })
                    .clone()
            })
        },
        decision_handles: [[Counter; DecisionOutcome::ALL.len()]; FrontEndKind::ALL.len()] = {
            FrontEndKind::ALL.map(|frontend| {
                DecisionOutcome::ALL.map(|decision| {
                    decisions
                        .get_or_create(&DecisionsLabels { frontend, decision })
                        .clone()
                })
            })
        },
        refusal_handles: [Counter; RefusalReason::ALL.len()] = {
            RefusalReason::ALL
                .map(|reason| refusals.get_or_create(&RefusalLabels { reason }).clone())
        },
    }
}

impl GatewayMetrics {
    /// Count one decision `frontend` asked for, disposed of as `d`.
    pub fn count_decision(&self, frontend: FrontEndKind, d: Disposition) {
        self.decision_handles[frontend as usize][DecisionOutcome::of(d) as usize].inc();
    }

    /// Count one request by its HTTP version and, over TLS, its TLS version.
    pub fn count_protocol(&self, version: http::Version, tls: Option<&'static str>) {
        let p = match version {
            http::Version::HTTP_10 | http::Version::HTTP_09 => 0,
            http::Version::HTTP_2 => 2,
            _ => 1,
        };
        let t = match tls {
            None => 0,
            Some("TLSv1.2") => 1,
            Some(_) => 2,
        };
        self.protocol_handles[p][t].inc();
    }

    /// Count one response to a client, of `class` (see [`status_class`]), answered by the
    /// upstream or by the gateway.
    pub fn count_response(&self, class: &'static str, upstream: bool) {
        self.response_handles[class_index(class)][usize::from(upstream)].inc();
    }

    /// Count one answer to a gRPC call, of status `code`, written by `source`.
    pub fn count_grpc(&self, code: Code, source: Origin) {
        self.grpc_handles[usize::from(code.number())][source as usize].inc();
    }

    /// Count one upstream answer of `class`, or "error".
    pub fn count_upstream(&self, class: &'static str) {
        self.upstream_handles[class_index(class)].inc();
    }

    /// Count one request, ended as `outcome` after `took` (end to end).
    pub fn count_outcome(&self, outcome: Outcome, took: Duration) {
        self.duration_handles[outcome.index()].observe(took.as_secs_f64());
    }

    /// Count one request refused before any limit was consulted.
    pub fn count_refusal(&self, reason: RefusalReason) {
        self.refusal_handles[reason as usize].inc();
    }

    /// `rule`'s counters ([`GatewayMetrics::rule_counters`]), its dashboards' by its plans.
    pub fn counters_of(&self, rule: &crate::rules::Rule) -> RuleCounters {
        RuleCounters {
            dashboard: self.dashboards.rule(rule),
            ..self.rule_counters(&rule.name)
        }
    }

    /// One rule's decision counters, resolved once (at config load) so that counting a
    /// request allocates nothing and takes no lock. Its dashboards' know no plan
    /// ([`GatewayMetrics::counters_of`] gives them the rule's).
    pub fn rule_counters(&self, rule: &str) -> RuleCounters {
        let counter = |decision| {
            self.requests
                .get_or_create(&RuleLabels {
                    rule: rule.to_string(),
                    decision,
                })
                .clone()
        };
        let failures = |outcome| {
            self.rule_upstream_failures
                .get_or_create(&RuleFailureLabels {
                    rule: rule.to_string(),
                    outcome,
                })
                .clone()
        };
        RuleCounters {
            allowed: counter(DecisionLabel::Allowed),
            delayed: counter(DecisionLabel::Delayed),
            denied: counter(DecisionLabel::Denied),
            shadow_denied: counter(DecisionLabel::ShadowDenied),
            denied_by_other: counter(DecisionLabel::DeniedByOther),
            error: counter(DecisionLabel::Error),
            refused: counter(DecisionLabel::Refused),
            bad_key: counter(DecisionLabel::BadKey),
            refused_by_other: counter(DecisionLabel::RefusedByOther),
            upstream_error: failures(UpstreamFailure::Error),
            upstream_timeout: failures(UpstreamFailure::Timeout),
            dashboard: self.dashboards.rule_named(rule, std::iter::empty()),
        }
    }
}

/// `ratewall_requests_total` for one rule, one handle per decision, and its
/// `ratewall_rule_upstream_failures_total` (handles share the registered counters).
#[derive(Clone)]
pub struct RuleCounters {
    pub allowed: Counter,
    pub delayed: Counter,
    pub denied: Counter,
    pub shadow_denied: Counter,
    pub denied_by_other: Counter,
    pub error: Counter,
    pub refused: Counter,
    pub bad_key: Counter,
    pub refused_by_other: Counter,
    pub upstream_error: Counter,
    pub upstream_timeout: Counter,
    /// Its denials by plan, retry delays, near-limit requests and SLO counts.
    pub dashboard: RuleDashboard,
}

impl RuleCounters {
    /// The rule's `ratewall_requests_total{decision}` handle for `share`.
    pub fn of(&self, share: DecisionLabel) -> &Counter {
        match share {
            DecisionLabel::Allowed => &self.allowed,
            DecisionLabel::Delayed => &self.delayed,
            DecisionLabel::Denied => &self.denied,
            DecisionLabel::ShadowDenied => &self.shadow_denied,
            DecisionLabel::DeniedByOther => &self.denied_by_other,
            DecisionLabel::Error => &self.error,
            DecisionLabel::Refused => &self.refused,
            DecisionLabel::BadKey => &self.bad_key,
            DecisionLabel::RefusedByOther => &self.refused_by_other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{DecisionLabel, UpstreamFailure};

    #[test]
    fn the_label_values_are_the_ones_dashboards_query() {
        assert_eq!(
            DecisionLabel::ALL.map(DecisionLabel::name),
            [
                "allowed",
                "delayed",
                "denied",
                "shadow_denied",
                "denied_by_other",
                "error",
                "refused",
                "bad_key",
                "refused_by_other"
            ]
        );
        assert_eq!(
            UpstreamFailure::ALL.map(UpstreamFailure::name),
            ["upstream_error", "upstream_timeout"]
        );
    }
}
