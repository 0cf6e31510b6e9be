//! Every metric, held for the process with the one registry: each module registers
//! those it owns ([`GatewayMetrics`], [`LimiterMetrics`], [`UpstreamTlsMetrics`]) and
//! [`Metrics`] holds them. It lives with the gateway, the highest module whose metrics it
//! holds, so that the modules below name only their own (`tests/layering.rs`: no import
//! cycle). The connections' and the TLS listener's metrics are still registered here;
//! they move to `src/connection/` with its split. The admin listener, above the gateway,
//! creates its `admin_auth_failures` series from its own vocabulary.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use super::metrics::GatewayMetrics;
use crate::limiter::metrics::LimiterMetrics;
use crate::stats::Stats;
use crate::upstream::UpstreamTlsMetrics;

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
pub struct TlsSessionLabels {
    /// `TLSv1.3` or `TLSv1.2`.
    pub version: &'static str,
    /// The ALPN protocol agreed: `h2`, `http/1.1`, or `none`.
    pub alpn: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertificateLabels {
    /// The certificate file, as `[server.tls] certificates` names it (resolved).
    pub cert: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdminFailureLabels {
    /// `missing`, `wrong` or `throttled` (`admin::Failure`).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
}

pub struct Metrics {
    registry: Registry,
    pub gateway: GatewayMetrics,
    pub limiter: LimiterMetrics,
    pub upstream_tls: UpstreamTlsMetrics,
    /// The pools' metrics, per pool and server (`upstream/metrics.rs`).
    pub pools: crate::upstream::PoolMetrics,
    /// `/admin/*` calls refused for their token, by reason (`missing`, `wrong`,
    /// `throttled`); the admin listener, above the gateway, creates its series at zero
    /// from its own vocabulary (`admin::Failure`) when it starts.
    pub admin_auth_failures: Family<AdminFailureLabels, Counter>,
    // The connections' and the TLS listener's metrics (src/connection.rs and src/server.rs
    // count them): they move to src/connection/ with its split.
    pub connections_open: Family<ListenerLabels, Gauge>,
    pub connections_closed: Family<ClosedLabels, Counter>,
    pub accept_errors: Family<ListenerLabels, Counter>,
    /// TLS handshakes on the TLS listener, by result.
    pub tls_handshakes: Family<HandshakeLabels, Counter>,
    /// TLS connections by the version and ALPN protocol agreed.
    pub tls_sessions: Family<TlsSessionLabels, Counter>,
    /// Seconds until each configured certificate expires (negative: expired).
    pub tls_certificate_expiry: Family<CertificateLabels, Gauge>,
    /// The certificates `tls_certificate_expiry` has series for.
    tls_certificates_shown: std::sync::Mutex<Vec<CertificateLabels>>,
    /// What the status page shows (the limiter counts its store calls into it too).
    pub stats: Arc<Stats>,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("ratewall");
        let gateway = GatewayMetrics::register(&mut registry);
        let limiter = LimiterMetrics::register(&mut registry);
        let upstream_tls = UpstreamTlsMetrics::register(&mut registry);
        let pools = crate::upstream::PoolMetrics::register(&mut registry);
        let admin_auth_failures = Family::<AdminFailureLabels, Counter>::default();
        registry.register(
            "admin_auth_failures",
            "Admin API calls refused for their token, by reason: missing (no Bearer token), wrong, throttled (the peer's failed calls used up its allowance: 429, the token not checked)",
            admin_auth_failures.clone(),
        );
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
            admin_auth_failures,
            connections_open,
            connections_closed,
            accept_errors,
            tls_handshakes,
            tls_sessions,
            tls_certificate_expiry,
            tls_certificates_shown: std::sync::Mutex::default(),
            stats: Arc::new(Stats::new()),
        }
    }

    /// Count one TLS handshake, and the version and ALPN of a done one.
    pub fn tls_handshake(
        &self,
        outcome: crate::connection::Handshake,
        session: Option<&crate::tls::Session>,
    ) {
        self.tls_handshakes
            .get_or_create(&HandshakeLabels {
                result: outcome.result().name(),
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
                result: outcome.result().name(),
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
