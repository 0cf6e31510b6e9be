//! Every metric, held for the process with the one registry: each module registers
//! those it owns ([`GatewayMetrics`], [`LimiterMetrics`], [`UpstreamTlsMetrics`],
//! [`PoolMetrics`], [`ConnectionMetrics`]) and [`Metrics`] holds them. It lives with the
//! gateway, the highest module whose metrics it holds, so that the modules below name
//! only their own (`tests/layering.rs`: no import cycle). The admin listener, above the
//! gateway, has its metrics declared at the bottom ([`AdminMetrics`], in `telemetry/`),
//! and creates their series from its own vocabulary.

use std::sync::Arc;

use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use super::requests::{status_class, GatewayMetrics, RefusalReason};
use crate::connection::ConnectionMetrics;
use crate::limiter::metrics::LimiterMetrics;
use crate::telemetry::stats::{Outcome, Stats};
use crate::telemetry::AdminMetrics;
use crate::telemetry::Disposition;
use crate::upstream::{PoolMetrics, UpstreamTlsMetrics};

crate::telemetry::label_sets! {
    pub struct BuildLabels {
        pub version: &'static str,
    }
}

pub struct Metrics {
    registry: Registry,
    pub gateway: GatewayMetrics,
    pub limiter: LimiterMetrics,
    pub upstream_tls: UpstreamTlsMetrics,
    /// The pools' metrics, per pool and server (`upstream/metrics.rs`).
    pub pools: PoolMetrics,
    /// The admin listener's: `/admin/*` calls refused for their token, by reason; the
    /// admin listener creates their series at zero from its own vocabulary
    /// (`admin::guard::Failure`) when it starts.
    pub admin: AdminMetrics,
    /// The connections' and the TLS listener's metrics (`connection/metrics.rs`).
    pub connection: ConnectionMetrics,
    /// The tunnels' (upgraded connections') metrics (`tunnel/metrics.rs`).
    pub tunnel: crate::tunnel::metrics::TunnelMetrics,
    /// `[jwt] jwks_url` fetches.
    pub jwks: super::jwks::JwksMetrics,
    /// Settlements of charges after the answer (issue 27).
    pub settle: crate::settle::metrics::SettleMetrics,
    /// What the status page shows (the limiter counts its store calls into it too).
    pub stats: Arc<Stats>,
}

/// A request is over: how it was disposed of, whether the upstream answered it, the
/// status it got (as it stands: a gateway's gRPC answer counts as the HTTP status it
/// stands for), and how long it took end to end. Every front-end records its requests
/// with one ([`Metrics::ended`]).
pub struct Ended {
    pub disposition: Disposition,
    pub upstream: bool,
    pub status: u16,
    pub took: std::time::Duration,
}

impl Metrics {
    /// Count a request that is over, and feed the status page, from one [`Ended`]: the
    /// responses by class and source, a refusal's reason, its outcome and time end to
    /// end. A `redirect_https` answer (made before the gateway proper) is not counted.
    pub fn ended(&self, e: &Ended) {
        if !e.disposition.is_counted() {
            return;
        }
        self.gateway
            .count_response(status_class(e.status), e.upstream);
        if let Some(reason) = refusal_reason(e.disposition) {
            self.gateway.count_refusal(reason);
        }
        let outcome = outcome(e.disposition, e.upstream, e.status);
        self.gateway.count_outcome(outcome, e.took);
        self.stats.ended(outcome);
    }

    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("ratewall");
        let gateway = GatewayMetrics::register(&mut registry);
        let limiter = LimiterMetrics::register(&mut registry);
        let upstream_tls = UpstreamTlsMetrics::register(&mut registry);
        let pools = PoolMetrics::register(&mut registry);
        let admin = AdminMetrics::register(&mut registry);
        let connection = ConnectionMetrics::register(&mut registry);
        let tunnel = crate::tunnel::metrics::TunnelMetrics::register(&mut registry);
        let jwks = super::jwks::JwksMetrics::register(&mut registry);
        let settle = crate::settle::metrics::SettleMetrics::register(&mut registry);
        let build_info = Info::new(BuildLabels {
            version: env!("CARGO_PKG_VERSION"),
        });
        registry.register(
            "build",
            "The running ratewall's version (always 1)",
            build_info,
        );
        Metrics {
            registry,
            gateway,
            limiter,
            upstream_tls,
            pools,
            admin,
            connection,
            tunnel,
            jwks,
            settle,
            stats: Arc::new(Stats::new()),
        }
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// `ratewall_refusals_total`'s reason for a request refused before any limit was
/// consulted; none for the rest.
fn refusal_reason(d: Disposition) -> Option<RefusalReason> {
    Some(match d {
        Disposition::Refused(r) => r.into(),
        Disposition::Malformed {
            not_implemented: true,
        } => RefusalReason::NotImplemented,
        Disposition::Malformed { .. } => RefusalReason::Malformed,
        Disposition::UnreadableBody => RefusalReason::UnreadableBody,
        Disposition::NoRoute => RefusalReason::NoRoute,
        _ => return None,
    })
}

/// The status page's outcome (and `ratewall_request_duration_seconds{outcome}`) of a
/// request disposed of as `d`, answered by the upstream or not, with the status `meant`.
fn outcome(d: Disposition, upstream: bool, meant: u16) -> Outcome {
    match d {
        // Shed by the pool's overload protection: a 503 (or gRPC 14) of its own kind.
        Disposition::Shed => Outcome::Overloaded,
        d if d.passed_limits() => Outcome::forwarded(upstream, meant),
        _ => Outcome::answered(meant),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode_with_the_prefix_and_no_identities() {
        let m = Metrics::new();
        m.gateway.rule_counters("api").denied.inc();
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
