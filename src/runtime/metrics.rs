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

use super::requests::GatewayMetrics;
use crate::connection::ConnectionMetrics;
use crate::limiter::metrics::LimiterMetrics;
use crate::telemetry::stats::Stats;
use crate::telemetry::AdminMetrics;
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

impl Metrics {
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
