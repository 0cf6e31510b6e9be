//! The metrics client connections own, registered here ([`ConnectionMetrics`]): the
//! connections open and closed (by listener, and why), failed accepts, and the TLS
//! listener's handshakes, sessions and certificates' expiry. `proxy::Metrics` holds
//! them, with the one registry; a listener's [`Registry`](super::Registry) counts
//! through its [`ListenerMetrics`], every series resolved when the listener starts.

use std::sync::{Mutex, PoisonError};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::registry::Closed;
use super::tls::{Handshake, HandshakeResult};

crate::telemetry::label_sets! {
    pub struct ListenerLabels {
        /// `gateway` or `admin`.
        pub listener: &'static str,
    }

    pub struct ClosedLabels {
        pub listener: &'static str,
        /// The clock that ran out (`header_timeout`, `idle_timeout`, `body_timeout`,
        /// `send_timeout`), or `make_room` (idle, closed at `max_connections`): a
        /// [`Closed`]'s name.
        pub reason: &'static str,
    }

    pub struct HandshakeLabels {
        /// `ok`, or why not: `timeout` (header_timeout), `closed` (by the client, or the
        /// connection failed), `failed` (refused by TLS: no common version, a bad client
        /// certificate, not TLS at all), `shutdown` (asked to close first).
        pub result: HandshakeResult,
        /// Why a `failed` one was refused (`protocol`, `client_certificate`, `not_tls`,
        /// `alert`, `other`); `none` for the other results.
        pub reason: &'static str,
    }

    pub struct TlsSessionLabels {
        /// `TLSv1.3` or `TLSv1.2`.
        pub version: &'static str,
        /// The ALPN protocol agreed: `h2`, `http/1.1`, or `none`.
        pub alpn: &'static str,
    }

    pub struct CertificateLabels {
        /// The certificate file, as `[server.tls] certificates` names it (resolved).
        pub cert: String,
    }
}

crate::telemetry::metrics! {
    /// The connections' and the TLS listener's metrics, registered by
    /// [`ConnectionMetrics::register`].
    pub struct ConnectionMetrics {
        pub connections_open: Family<ListenerLabels, Gauge> = ("connections", "Client connections open now, by listener"),
        pub connections_closed: Family<ClosedLabels, Counter> = ("connections_closed", "Client connections the gateway closed, by listener and why: the clock that ran out (header_timeout, idle_timeout, body_timeout, send_timeout) or make_room (idle, closed at max_connections)"),
        pub accept_errors: Family<ListenerLabels, Counter> = ("accept_errors", "Failed accepts (out of file descriptors, say), by listener"),
        /// TLS handshakes on the TLS listener, by result.
        pub tls_handshakes: Family<HandshakeLabels, Counter> = ("tls_handshakes", "TLS handshakes on the TLS listener ([server.tls]), by result: ok, timeout (not done within header_timeout), closed (by the client, or the connection failed), failed (refused by TLS), shutdown (asked to close first). For failed, by reason: protocol (nothing in common: version, suite, ALPN), client_certificate (missing or not verified, mTLS), not_tls (bytes that are not TLS), alert (the client refused the handshake, e.g. our certificate), other; reason=none for the other results"),
        /// TLS connections by the version and ALPN protocol agreed.
        pub tls_sessions: Family<TlsSessionLabels, Counter> = ("tls_connections", "TLS connections by the protocol version and the ALPN protocol agreed (h2, http/1.1, none)"),
        /// Seconds until each configured certificate expires (negative: expired).
        pub tls_certificate_expiry: Family<CertificateLabels, Gauge> = ("tls_certificate_expiry_seconds", "Seconds until each certificate of [server.tls] expires (negative: expired), by file"),
        /// The certificates `tls_certificate_expiry` has series for.
        tls_certificates_shown: Mutex<Vec<CertificateLabels>> = { Mutex::default() },
    }
}

impl ConnectionMetrics {
    /// The connection metrics of one listener (`gateway` or `admin`), every series
    /// created now, at zero.
    pub fn listener(&self, listener: &'static str) -> ListenerMetrics {
        let closed = Closed::ALL.map(|why| {
            self.connections_closed
                .get_or_create(&ClosedLabels {
                    listener,
                    reason: why.name(),
                })
                .clone()
        });
        ListenerMetrics {
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

    /// Count one TLS handshake, and the version and ALPN of a done one.
    pub fn tls_handshake(&self, outcome: Handshake, session: Option<&crate::tls::Session>) {
        self.tls_handshakes
            .get_or_create(&HandshakeLabels {
                result: outcome.result(),
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
        for outcome in Handshake::ALL {
            let _ = self.tls_handshakes.get_or_create(&HandshakeLabels {
                result: outcome.result(),
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
                .unwrap_or_else(PoisonError::into_inner);
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
}

/// The metrics of one listener's connections, resolved by [`ConnectionMetrics::listener`]
/// (a default one counts into series no registry exports: for tests).
#[derive(Clone, Default)]
pub struct ListenerMetrics {
    pub open: Gauge,
    /// One counter per [`Closed`] reason, in the order of [`Closed::ALL`].
    pub closed: [Counter; Closed::ALL.len()],
    pub accept_errors: Counter,
}

impl ListenerMetrics {
    pub(super) fn count(&self, why: Closed) {
        if let Some(c) = self.closed.get(why as usize) {
            c.inc();
        }
    }
}
