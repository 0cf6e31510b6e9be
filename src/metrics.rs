//! Prometheus metrics (`GET /metrics` on the admin listener), and the in-process
//! [`Stats`] the status page and `/admin/*` read.
//!
//! Label sets are bounded: rule names (from the config), fixed enums, status classes.
//! Never an API key, never an IP. Every series a config implies exists from the moment it
//! loads, at zero (rules added by a reload at theirs), so that an alert's query answers 0
//! rather than nothing. The request path counts through handles resolved beforehand: no
//! label is hashed and nothing is allocated per request.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

pub use crate::stats::{Outcome, Stats, HISTORY_SECS};

/// One vocabulary enum (a decision, an outcome, a reason), written once with the label
/// value of each variant: `Variant = "value"`. The enum comes out as written (its
/// attributes, derives and docs kept; derive `Clone, Copy` at least), with `ALL` (every
/// variant, in declaration order), `name()` (the value: metrics, logs and the config
/// all say it so) and its encoding as a Prometheus label value.
///
/// ```ignore
/// crate::metrics::label_enum! {
///     #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
///     pub enum ReloadResult {
///         Ok = "ok",
///         Rejected = "rejected",
///     }
/// }
/// ```
macro_rules! label_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $label:literal),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: [$name; [$($label),+].len()] = [$($name::$variant),+];

            /// The value as metrics, logs and the config name it.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $label),+
                }
            }
        }

        impl prometheus_client::encoding::EncodeLabelValue for $name {
            fn encode(
                &self,
                e: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
            ) -> Result<(), std::fmt::Error> {
                std::fmt::Write::write_str(e, self.name())
            }
        }
    };
}
pub(crate) use label_enum;

label_enum! {
    /// How a rule's decision on one request is counted (`decision=`).
    #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
    pub enum DecisionLabel {
        /// The rule allowed the request, the request passed (charged) and the upstream
        /// answered it; one it did not answer is the rule's upstream failure instead
        /// (`ratewall_rule_upstream_failures_total`).
        Allowed = "allowed",
        /// The rule allowed the request after it waited for its tokens (`max_delay`).
        Delayed = "delayed",
        /// The rule denied the request.
        Denied = "denied",
        /// A shadow rule would have denied it, but let it pass.
        ShadowDenied = "shadow_denied",
        /// The rule would have allowed the request, but another rule denied it: charged
        /// nothing here (a denied request takes nothing from the rules it passed).
        DeniedByOther = "denied_by_other",
        /// The store failed; `on_error` answered.
        Error = "error",
        /// The rule refused the request before any limit was consulted: its identity is
        /// missing or unknown (401).
        Refused = "refused",
        /// The rule refused the request before any limit was consulted: the key (or header)
        /// it counts by is malformed (400: sent twice, too long).
        BadKey = "bad_key",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabels {
    pub rule: String,
    pub decision: DecisionLabel,
}

label_enum! {
    #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
    pub enum StoreErrorKind {
        /// No answer within `[store].timeout`.
        Timeout = "timeout",
        /// Refused, dropped or otherwise unreachable.
        Connection = "connection",
        /// One key's data (wrong type, corrupt state).
        Data = "data",
        /// Not tried: the circuit breaker is open.
        BreakerOpen = "breaker_open",
        /// The memory store had no room for a new key (every key in the way is being denied).
        Full = "full",
        /// Anything else the store answered unexpectedly.
        Other = "other",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreErrorLabels {
    pub kind: StoreErrorKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreLabels {
    pub backend: &'static str,
}

/// An in-process store: `memory` (the configured backend) or `local` (the `on_error =
/// "local"` fallback).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MemoryLabels {
    pub store: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    /// `gateway` or `admin`.
    pub listener: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClosedLabels {
    pub listener: &'static str,
    /// The clock that ran out (`header_timeout`, `idle_timeout`, `body_timeout`,
    /// `send_timeout`), or `make_room` (idle, closed at `max_connections`).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    /// `ok`, or why not: `timeout` (header_timeout), `closed` (by the client, or the
    /// connection failed), `failed` (refused by TLS: no common version, a bad client
    /// certificate, not TLS at all), `shutdown` (asked to close first).
    pub result: &'static str,
    /// Why a `failed` one was refused (`protocol`, `client_certificate`, `not_tls`,
    /// `alert`, `other`); `none` for the other results.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamHandshakeLabels {
    /// `ok` (a full handshake), `resumed` (an earlier session resumed), `failed`,
    /// `timeout` (not done within connect_timeout).
    pub result: &'static str,
    /// Why a `failed` one failed (see `upstream::TlsFailure`); `none` for the others.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TlsSessionLabels {
    /// `TLSv1.3` or `TLSv1.2`.
    pub version: &'static str,
    /// The ALPN protocol agreed: `h2`, `http/1.1`, or `none`.
    pub alpn: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProtocolLabels {
    /// `HTTP/1.0`, `HTTP/1.1` or `HTTP/2`.
    pub protocol: &'static str,
    /// `TLSv1.3` or `TLSv1.2` over the TLS listener; `none` in cleartext.
    pub tls: &'static str,
}

/// The protocols and TLS versions `ratewall_client_requests_total` counts by.
const PROTOCOLS: [&str; 3] = ["HTTP/1.0", "HTTP/1.1", "HTTP/2"];
const TLS_VERSIONS: [&str; 3] = ["none", "TLSv1.2", "TLSv1.3"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertificateLabels {
    /// The certificate file, as `[server.tls] certificates` names it (resolved).
    pub cert: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EvictionLabels {
    pub store: &'static str,
    /// `expired` (equivalent to no entry), `lru` (live, not being denied) or `held`
    /// (being denied, when nothing else could make room).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabels {
    /// `2xx`..`5xx` from the upstream, or `error` (refused, timed out, reset).
    pub class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResponseLabels {
    /// The status class the client got.
    pub class: &'static str,
    /// Who answered: `upstream` or `gateway` (401, 429, 502, 503, 504...).
    pub source: &'static str,
}

label_enum! {
    /// Why the gateway refused a request before any limit was consulted
    /// (`ratewall_refusals_total{reason}`).
    #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
    pub enum RefusalReason {
        /// 401: no API key (or no value of the header a rule counts by), and the rule needs one.
        MissingKey = "missing_key",
        /// 401: a key not listed, with `unknown = "reject"`.
        UnknownKey = "unknown_key",
        /// 400: a malformed key header, or a request head the gateway will not pass on.
        Malformed = "malformed",
        /// 501: a method or transfer coding the gateway does not forward (`CONNECT`).
        NotImplemented = "not_implemented",
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
            Refusal::MissingKey | Refusal::MissingHeader | Refusal::MissingCert => {
                RefusalReason::MissingKey
            }
            Refusal::UnknownKey => RefusalReason::UnknownKey,
            Refusal::Malformed(_) => RefusalReason::Malformed,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdminFailureLabels {
    /// `missing`, `wrong` or `throttled`.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub reason: RefusalReason,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: Outcome,
}

label_enum! {
    /// A forwarded request the upstream did not answer, by what the client got.
    #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
    pub enum UpstreamFailure {
        /// 502.
        Error = "upstream_error",
        /// 504.
        Timeout = "upstream_timeout",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleFailureLabels {
    pub rule: String,
    pub outcome: UpstreamFailure,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
}

label_enum! {
    #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
    pub enum ReloadResult {
        Ok = "ok",
        Rejected = "rejected",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    pub result: ReloadResult,
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

pub struct Metrics {
    registry: Registry,
    pub requests: Family<RuleLabels, Counter>,
    pub responses: Family<ResponseLabels, Counter>,
    pub store_duration: Family<StoreLabels, Histogram>,
    pub store_errors: Family<StoreErrorLabels, Counter>,
    pub upstream_duration: Histogram,
    pub upstream_responses: Family<ClassLabels, Counter>,
    pub deny_cache_hits: Counter,
    pub breaker_open: Gauge,
    pub reloads: Family<ReloadLabels, Counter>,
    pub in_flight: Gauge,
    /// Requests waiting for reserved tokens (`max_delay`) now.
    pub waiting: Gauge,
    /// Keys the in-process stores hold, as of the last sweep.
    pub memory_keys: Family<MemoryLabels, Gauge>,
    /// Entries the in-process stores dropped to make room for new keys.
    pub memory_evictions: Family<EvictionLabels, Counter>,
    pub connections_open: Family<ListenerLabels, Gauge>,
    pub connections_closed: Family<ClosedLabels, Counter>,
    pub accept_errors: Family<ListenerLabels, Counter>,
    /// End to end, by outcome: from the request's head read to its answer's head handed
    /// to the connection.
    pub request_duration: Family<OutcomeLabels, Histogram>,
    pub refusals: Family<RefusalLabels, Counter>,
    /// Forwarded requests the upstream did not answer, per rule that let them through.
    pub rule_upstream_failures: Family<RuleFailureLabels, Counter>,
    /// `responses` (by class, then gateway / upstream), `upstream_responses`,
    /// `request_duration` and `refusals` handles, resolved once: counting then takes no
    /// lock on the family and hashes no labels.
    response_handles: [[Counter; 2]; 6],
    upstream_handles: [Counter; 6],
    duration_handles: [Histogram; Outcome::ALL.len()],
    refusal_handles: [Counter; RefusalReason::ALL.len()],
    /// TLS handshakes on the TLS listener, by result.
    pub tls_handshakes: Family<HandshakeLabels, Counter>,
    /// TLS connections by the version and ALPN protocol agreed.
    pub tls_sessions: Family<TlsSessionLabels, Counter>,
    /// Seconds until each configured certificate expires (negative: expired).
    pub tls_certificate_expiry: Family<CertificateLabels, Gauge>,
    /// Requests the cleartext listener answered with a 308 to the TLS listener
    /// (`redirect_https`), never admitted.
    pub https_redirects: Counter,
    /// Request header fields whose name has an underscore, dropped before anything read
    /// them (`[server] underscores_in_headers = false`).
    pub underscore_fields_dropped: Counter,
    /// `/admin/*` calls refused for their token, by reason (`missing`, `wrong`,
    /// `throttled`: the peer's failures used up its allowance, the token not checked).
    pub admin_auth_failures: Family<AdminFailureLabels, Counter>,
    /// TLS handshakes with an `https://` upstream, by result and reason.
    pub upstream_tls_handshakes: Family<UpstreamHandshakeLabels, Counter>,
    /// Requests by HTTP version and TLS version, and their handles (see `PROTOCOLS`).
    pub client_requests: Family<ProtocolLabels, Counter>,
    protocol_handles: [[Counter; TLS_VERSIONS.len()]; PROTOCOLS.len()],
    /// The certificates `tls_certificate_expiry` has series for.
    tls_certificates_shown: std::sync::Mutex<Vec<CertificateLabels>>,
    pub stats: Stats,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("ratewall");
        let requests = Family::<RuleLabels, Counter>::default();
        registry.register(
            "requests",
            "Decisions by rule: allowed (let through, and the upstream answered), delayed (the same, after waiting, max_delay), denied, shadow_denied (would have denied: shadow mode or outside enforce_percent), denied_by_other (this rule would have allowed it, another denied it: charged nothing here), error (store failed), refused (this rule refused the request before any limit: its key missing or unknown, 401), bad_key (its key malformed, 400)",
            requests.clone(),
        );
        let responses = Family::<ResponseLabels, Counter>::default();
        registry.register(
            "responses",
            "Responses sent to clients, by status class and by who answered (upstream or gateway)",
            responses.clone(),
        );
        let store_duration = Family::<StoreLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 0.5, 1.0,
            ])
        });
        registry.register(
            "store_call_duration_seconds",
            "Time of one store call (one per limited request), by backend",
            store_duration.clone(),
        );
        let store_errors = Family::<StoreErrorLabels, Counter>::default();
        registry.register(
            "store_errors",
            "Store calls that failed, by kind",
            store_errors.clone(),
        );
        let upstream_duration = Histogram::new([
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0,
        ]);
        registry.register(
            "upstream_duration_seconds",
            "Time until the upstream's response head (or its failure)",
            upstream_duration.clone(),
        );
        let upstream_responses = Family::<ClassLabels, Counter>::default();
        registry.register(
            "upstream_responses",
            "Upstream answers by status class, or error (refused, timed out, reset)",
            upstream_responses.clone(),
        );
        let deny_cache_hits = Counter::default();
        registry.register(
            "deny_cache_hits",
            "Requests denied from the local cache of denials, without a store call",
            deny_cache_hits.clone(),
        );
        let breaker_open = Gauge::default();
        registry.register(
            "store_breaker_open",
            "1 while the store's circuit breaker is open (on_error applied without trying the store)",
            breaker_open.clone(),
        );
        let reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "config_reloads",
            "Config reloads (SIGHUP) by result",
            reloads.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "in_flight_requests",
            "Requests being handled now",
            in_flight.clone(),
        );
        let waiting = Gauge::default();
        registry.register(
            "waiting_requests",
            "Requests waiting for their reserved tokens (max_delay) before they are forwarded",
            waiting.clone(),
        );
        let memory_keys = Family::<MemoryLabels, Gauge>::default();
        registry.register(
            "store_keys",
            "Keys the in-process store holds (store=memory: the memory backend; store=local: the on_error = \"local\" fallback), as of the last sweep",
            memory_keys.clone(),
        );
        let memory_evictions = Family::<EvictionLabels, Counter>::default();
        registry.register(
            "store_evictions",
            "Entries an in-process store dropped to make room for a new key at max_keys: reason=expired (already equivalent to none), lru (the least recently used not being denied), held (the least recently denied, when a shard held nothing else)",
            memory_evictions.clone(),
        );
        for store in ["memory", "local"] {
            let _ = memory_keys.get_or_create(&MemoryLabels { store });
            for reason in ["expired", "lru", "held"] {
                let _ = memory_evictions.get_or_create(&EvictionLabels { store, reason });
            }
        }
        let connections_open = Family::<ListenerLabels, Gauge>::default();
        registry.register(
            "connections",
            "Client connections open now, by listener",
            connections_open.clone(),
        );
        let connections_closed = Family::<ClosedLabels, Counter>::default();
        registry.register(
            "connections_closed",
            "Client connections the gateway closed, by listener and why: the clock that ran out (header_timeout, idle_timeout, body_timeout, send_timeout) or make_room (idle, closed at max_connections)",
            connections_closed.clone(),
        );
        let accept_errors = Family::<ListenerLabels, Counter>::default();
        registry.register(
            "accept_errors",
            "Failed accepts (out of file descriptors, say), by listener",
            accept_errors.clone(),
        );
        let request_duration = Family::<OutcomeLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0,
            ])
        });
        registry.register(
            "request_duration_seconds",
            "Requests end to end, from the head read to the answer's head sent, by outcome: allowed (the upstream answered), denied (429), unauthorized (401: no key or an unknown one), bad_request (400 or 501 before any limit: a malformed head or key, a tunnel), store_unavailable (503), upstream_error (502), upstream_timeout (504), client_error (the client's body malformed or stalled while forwarding). Its _count is every request once",
            request_duration.clone(),
        );
        let refusals = Family::<RefusalLabels, Counter>::default();
        registry.register(
            "refusals",
            "Requests refused before any limit was consulted, by reason: missing_key (401), unknown_key (401), malformed (400), not_implemented (501)",
            refusals.clone(),
        );
        let rule_upstream_failures = Family::<RuleFailureLabels, Counter>::default();
        registry.register(
            "rule_upstream_failures",
            "Requests a rule let through that the upstream did not answer: upstream_error (502), upstream_timeout (504)",
            rule_upstream_failures.clone(),
        );
        let tls_handshakes = Family::<HandshakeLabels, Counter>::default();
        registry.register(
            "tls_handshakes",
            "TLS handshakes on the TLS listener ([server.tls]), by result: ok, timeout (not done within header_timeout), closed (by the client, or the connection failed), failed (refused by TLS), shutdown (asked to close first). For failed, by reason: protocol (nothing in common: version, suite, ALPN), client_certificate (missing or not verified, mTLS), not_tls (bytes that are not TLS), alert (the client refused the handshake, e.g. our certificate), other; reason=none for the other results",
            tls_handshakes.clone(),
        );
        let tls_sessions = Family::<TlsSessionLabels, Counter>::default();
        registry.register(
            "tls_connections",
            "TLS connections by the protocol version and the ALPN protocol agreed (h2, http/1.1, none)",
            tls_sessions.clone(),
        );
        let tls_certificate_expiry = Family::<CertificateLabels, Gauge>::default();
        registry.register(
            "tls_certificate_expiry_seconds",
            "Seconds until each certificate of [server.tls] expires (negative: expired), by file",
            tls_certificate_expiry.clone(),
        );
        let https_redirects = Counter::default();
        registry.register(
            "https_redirects",
            "Requests the cleartext listener answered with a 308 to the TLS listener (redirect_https): never admitted, so in no other request count",
            https_redirects.clone(),
        );
        let underscore_fields_dropped = Counter::default();
        registry.register(
            "underscore_fields_dropped",
            "Request header fields whose name has an underscore (X_Api_Key), dropped before the rules or the upstream saw them: CGI, WSGI and Rack read them as the dashed name ([server] underscores_in_headers = false)",
            underscore_fields_dropped.clone(),
        );
        let admin_auth_failures = Family::<AdminFailureLabels, Counter>::default();
        registry.register(
            "admin_auth_failures",
            "Admin API calls refused for their token, by reason: missing (no Bearer token), wrong, throttled (the peer's failed calls used up its allowance: 429, the token not checked)",
            admin_auth_failures.clone(),
        );
        for why in crate::admin::Failure::ALL {
            let _ = admin_auth_failures.get_or_create(&AdminFailureLabels { reason: why.name() });
        }
        let upstream_tls_handshakes = Family::<UpstreamHandshakeLabels, Counter>::default();
        registry.register(
            "upstream_tls_handshakes",
            "TLS handshakes with an https:// upstream, by result: ok (full), resumed (an earlier session resumed), failed, timeout (not done within connect_timeout). For failed, by reason: unknown_issuer, name_mismatch, expired, certificate (another fault of the backend's certificate), alert (the backend refused us), protocol, closed (closed or reset under the handshake), other; reason=none for the other results",
            upstream_tls_handshakes.clone(),
        );
        let client_requests = Family::<ProtocolLabels, Counter>::default();
        registry.register(
            "client_requests",
            "Requests from clients by HTTP version (HTTP/1.0, HTTP/1.1, HTTP/2) and TLS version (TLSv1.3, TLSv1.2; none in cleartext)",
            client_requests.clone(),
        );
        let protocol_handles = PROTOCOLS.map(|protocol| {
            TLS_VERSIONS.map(|tls| {
                client_requests
                    .get_or_create(&ProtocolLabels { protocol, tls })
                    .clone()
            })
        });
        let build_info = Info::new(BuildLabels {
            version: env!("CARGO_PKG_VERSION"),
        });
        registry.register(
            "build",
            "The running ratewall's version (always 1)",
            build_info,
        );
        // Every series the config does not name, created now at zero.
        for kind in StoreErrorKind::ALL {
            let _ = store_errors.get_or_create(&StoreErrorLabels { kind });
        }
        for result in ReloadResult::ALL {
            let _ = reloads.get_or_create(&ReloadLabels { result });
        }
        let response_handles = CLASSES.map(|class| {
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
        });
        let upstream_handles = CLASSES.map(|class| {
            upstream_responses
                .get_or_create(&ClassLabels { class })
                .clone()
        });
        let duration_handles = Outcome::ALL.map(|outcome| {
            request_duration
                .get_or_create(&OutcomeLabels { outcome })
                .clone()
        });
        let refusal_handles = RefusalReason::ALL
            .map(|reason| refusals.get_or_create(&RefusalLabels { reason }).clone());
        Metrics {
            request_duration,
            refusals,
            rule_upstream_failures,
            duration_handles,
            refusal_handles,
            connections_open,
            connections_closed,
            accept_errors,
            memory_keys,
            memory_evictions,
            response_handles,
            upstream_handles,
            waiting,
            registry,
            requests,
            responses,
            store_duration,
            store_errors,
            upstream_duration,
            upstream_responses,
            deny_cache_hits,
            breaker_open,
            reloads,
            in_flight,
            tls_handshakes,
            tls_sessions,
            tls_certificate_expiry,
            tls_certificates_shown: std::sync::Mutex::default(),
            upstream_tls_handshakes,
            https_redirects,
            underscore_fields_dropped,
            admin_auth_failures,
            client_requests,
            protocol_handles,
            stats: Stats::new(),
        }
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

    /// Count one TLS handshake, and the version and ALPN of a done one.
    pub fn tls_handshake(
        &self,
        outcome: crate::connection::Handshake,
        session: Option<&crate::tls::Session>,
    ) {
        self.tls_handshakes
            .get_or_create(&HandshakeLabels {
                result: outcome.name(),
                reason: outcome.reason(),
            })
            .inc();
        if let Some(s) = session {
            self.tls_sessions
                .get_or_create(&TlsSessionLabels {
                    version: s.version,
                    alpn: s.alpn.unwrap_or("none"),
                })
                .inc();
        }
    }

    /// The TLS series `tls` implies, at zero where not counted yet, and the certificates'
    /// expiry now (those of an earlier config dropped). Called at load, on reload and by
    /// the upkeep every second.
    pub fn tls_settings(&self, tls: Option<&crate::tls::Settings>) {
        let Some(tls) = tls else {
            self.tls_certificate_expiry.clear();
            return;
        };
        for outcome in crate::connection::Handshake::ALL {
            let _ = self.tls_handshakes.get_or_create(&HandshakeLabels {
                result: outcome.name(),
                reason: outcome.reason(),
            });
        }
        for version in ["TLSv1.3", "TLSv1.2"] {
            for alpn in ["h2", "http/1.1", "none"] {
                let _ = self
                    .tls_sessions
                    .get_or_create(&TlsSessionLabels { version, alpn });
            }
        }
        let labels: Vec<_> = tls
            .certificates
            .iter()
            .map(|c| CertificateLabels {
                cert: c.cert_path.display().to_string(),
            })
            .collect();
        {
            // A reload that changed the files: the old ones' series go.
            let mut shown = self
                .tls_certificates_shown
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if *shown != labels {
                self.tls_certificate_expiry.clear();
                shown.clone_from(&labels);
            }
        }
        for (c, l) in tls.certificates.iter().zip(&labels) {
            self.tls_certificate_expiry
                .get_or_create(l)
                .set(c.expires_in());
        }
    }

    /// The counters of the upstream's TLS handshakes: for an `https://` upstream every
    /// series, created now at zero (counts so far kept); for an `http://` one, none (those
    /// of an earlier `https://` upstream dropped) and counters that count nowhere.
    pub fn upstream_tls_handshakes(&self, https: bool) -> crate::upstream::TlsHandshakes {
        use crate::upstream::{TlsHandshake, TlsHandshakes};
        if !https {
            self.upstream_tls_handshakes.clear();
            return TlsHandshakes::default();
        }
        TlsHandshakes(TlsHandshake::ALL.map(|h| {
            self.upstream_tls_handshakes
                .get_or_create(&UpstreamHandshakeLabels {
                    result: h.name(),
                    reason: h.reason(),
                })
                .clone()
        }))
    }

    /// Count one response to a client, of `class` (see [`status_class`]), answered by the
    /// upstream or by the gateway.
    pub fn count_response(&self, class: &'static str, upstream: bool) {
        self.response_handles[class_index(class)][usize::from(upstream)].inc();
    }

    /// Count one upstream answer of `class`, or "error".
    pub fn count_upstream(&self, class: &'static str) {
        self.upstream_handles[class_index(class)].inc();
    }

    /// Count one request, ended as `outcome` after `took` (end to end).
    pub fn count_outcome(&self, outcome: Outcome, took: Duration) {
        self.duration_handles[outcome.index()].observe(took.as_secs_f64());
        self.stats.ended(outcome);
    }

    /// Count one request refused before any limit was consulted.
    pub fn count_refusal(&self, reason: RefusalReason) {
        self.refusal_handles[reason as usize].inc();
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The connection metrics of one listener (`gateway` or `admin`), every series
    /// created now, at zero.
    pub fn connections(&self, listener: &'static str) -> crate::connection::ConnectionMetrics {
        let closed = crate::connection::Closed::ALL.map(|why| {
            self.connections_closed
                .get_or_create(&ClosedLabels {
                    listener,
                    reason: why.name(),
                })
                .clone()
        });
        crate::connection::ConnectionMetrics {
            open: self
                .connections_open
                .get_or_create(&ListenerLabels { listener })
                .clone(),
            closed,
            accept_errors: self
                .accept_errors
                .get_or_create(&ListenerLabels { listener })
                .clone(),
        }
    }

    /// The key count gauge of the in-process store `store`.
    pub fn store_keys(&self, store: &'static str) -> Gauge {
        self.memory_keys
            .get_or_create(&MemoryLabels { store })
            .clone()
    }

    /// One rule's decision counters, resolved once (at config load) so that counting a
    /// request allocates nothing and takes no lock.
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
            upstream_error: failures(UpstreamFailure::Error),
            upstream_timeout: failures(UpstreamFailure::Timeout),
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
    pub upstream_error: Counter,
    pub upstream_timeout: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// A guard that holds a gauge one higher until dropped (requests in flight, waiting).
pub struct Gauged<'a>(&'a Gauge);

impl<'a> Gauged<'a> {
    pub fn new(g: &'a Gauge) -> Self {
        g.inc();
        Gauged(g)
    }
}

impl Drop for Gauged<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode_with_the_prefix_and_no_identities() {
        let m = Metrics::new();
        m.rule_counters("api").denied.inc();
        let text = m.encode();
        assert!(
            text.contains("ratewall_requests_total{rule=\"api\",decision=\"denied\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE ratewall_upstream_duration_seconds histogram"),
            "{text}"
        );
        assert!(text.contains("ratewall_in_flight_requests 0"), "{text}");
    }
}
