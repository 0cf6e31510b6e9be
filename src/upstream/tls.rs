//! TLS to an `https://` upstream: rustls on the ring provider, TLS 1.2 and 1.3 with
//! rustls' safe defaults.
//!
//! The backend's certificate is verified against the system's roots, or against `ca`
//! alone where it is given, for the name in the URL or `sni` (which is also the name sent
//! as SNI). A handshake that fails is the request's [`Error::Tls`]: a 502, its reason
//! logged (an unknown issuer, a name mismatch, an expired certificate, the backend's
//! alert), never a retry without verification. `insecure_skip_verify` turns verification
//! off only when asked, and says so loudly each time the setting is loaded.
//!
//! One [`Tls`] is built per load of the configuration and shared by every worker's
//! client: its `ClientConfig` keeps rustls' in-memory session cache, so a connection
//! opened after another resumes its session (a TLS 1.3 ticket or a 1.2 session id)
//! instead of a full handshake.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, HandshakeKind, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use super::stream::Stream;
use super::Error;

/// `[upstream]`'s TLS keys as the file gives them, paths resolved against its folder.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// PEM file of the certificates trusted for the backend, in place of the system's.
    pub ca: Option<PathBuf>,
    /// The name sent as SNI and verified in the certificate, in place of the URL's host.
    pub sni: Option<String>,
    /// PEM certificate chain and key presented to a backend that asks for one (mTLS).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Accept any certificate: for a test bench only, logged as a warning at each load.
    pub insecure_skip_verify: bool,
}

impl TlsOptions {
    /// Whether any key was given (they mean nothing to an `http://` upstream).
    pub fn any(&self) -> bool {
        *self != TlsOptions::default()
    }
}

/// Why the TLS settings cannot be used, and which key is at fault.
#[derive(Debug)]
pub struct TlsError {
    pub key: &'static str,
    pub message: String,
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[upstream] {}: {}", self.key, self.message)
    }
}

/// The TLS side of an `https://` upstream, ready for handshakes.
pub struct Tls {
    options: TlsOptions,
    /// One per [`Alpn`], in its order: the same roots, client certificate and session
    /// cache, each offering its protocols.
    connectors: [TlsConnector; 3],
    name: ServerName<'static>,
    /// What the certificate is verified against, for `ratewall check` and the logs.
    roots: String,
    /// SHA-256 of every file read: a reload with a changed file builds a new client
    /// (fresh pool, fresh sessions), one with the same files keeps the old.
    material: [u8; 32],
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("options", &self.options)
            .field("name", &self.name)
            .field("roots", &self.roots)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Tls {
    fn eq(&self, other: &Tls) -> bool {
        self.options == other.options && self.name == other.name && self.material == other.material
    }
}

impl Tls {
    /// Read the files `options` name and build the client side of TLS to `host` (the
    /// URL's host, brackets and all for IPv6).
    pub fn new(options: TlsOptions, host: &str) -> Result<Tls, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut material = Sha256::new();
        let name_text = options.sni.clone().unwrap_or_else(|| {
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string()
        });
        let name = match name_text.parse::<IpAddr>() {
            Ok(ip) => ServerName::IpAddress(ip.into()),
            Err(_) => ServerName::try_from(name_text.clone()).map_err(|e| TlsError {
                key: if options.sni.is_some() { "sni" } else { "url" },
                message: format!("{name_text:?} is not a valid server name: {e}"),
            })?,
        };
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError {
                key: "url",
                message: format!("no TLS version available: {e}"),
            })?;
        let (builder, roots) = if options.insecure_skip_verify {
            let verifier = Arc::new(NoVerification(provider));
            let b = builder
                .dangerous()
                .with_custom_certificate_verifier(verifier);
            (b, "nothing (insecure_skip_verify)".to_string())
        } else {
            let (store, roots) = match &options.ca {
                Some(path) => {
                    let certs = certificates(path, "ca", &mut material)?;
                    let mut store = RootCertStore::empty();
                    let (added, _) = store.add_parsable_certificates(certs);
                    if added == 0 {
                        return Err(TlsError {
                            key: "ca",
                            message: format!("{}: no usable CA certificate", path.display()),
                        });
                    }
                    (store, format!("{} ({added} certificates)", path.display()))
                }
                None => system_roots()?,
            };
            (builder.with_root_certificates(store), roots)
        };
        let config = match (&options.cert, &options.key) {
            (Some(cert), Some(key)) => {
                let chain = certificates(cert, "cert", &mut material)?;
                let bytes = read(key, "key", &mut material)?;
                let der = PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError {
                    key: "key",
                    message: format!("{}: no private key: {e}", key.display()),
                })?;
                builder
                    .with_client_auth_cert(chain, der)
                    .map_err(|e| TlsError {
                        key: "key",
                        message: format!(
                            "{} does not go with {}: {e}",
                            key.display(),
                            cert.display()
                        ),
                    })?
            }
            (None, None) => builder.with_no_client_auth(),
            (Some(_), None) => {
                return Err(TlsError {
                    key: "cert",
                    message: "a client certificate needs its `key`".into(),
                })
            }
            (None, Some(_)) => {
                return Err(TlsError {
                    key: "key",
                    message: "a client key needs its `cert`".into(),
                })
            }
        };
        // What a connection speaks is said in ALPN, so that a backend that would pick
        // another protocol refuses the handshake (a clear reason) instead. The clones
        // share the session cache (an `Arc` inside `ClientConfig`).
        let connectors = Alpn::ALL.map(|alpn| {
            let mut config = config.clone();
            config.alpn_protocols = alpn.offered().iter().map(|p| p.to_vec()).collect();
            TlsConnector::from(Arc::new(config))
        });
        Ok(Tls {
            options,
            connectors,
            name,
            roots,
            material: material.finalize().into(),
        })
    }

    pub fn options(&self) -> &TlsOptions {
        &self.options
    }

    /// `ratewall check`'s line: what is verified, against what, with which name.
    pub fn describe(&self) -> String {
        let mut out = format!(
            "tls: name {}, verified against {}",
            self.name.to_str(),
            self.roots
        );
        if let Some(cert) = &self.options.cert {
            out.push_str(&format!(", client certificate {}", cert.display()));
        }
        if self.options.insecure_skip_verify {
            out.push_str(" -- INSECURE: the backend's certificate is NOT verified");
        }
        out
    }

    /// TLS over `tcp` offering `http/1.1`, verified as a backend's is: for the gateway's
    /// own fetches (a `[jwt] jwks_url`).
    pub async fn connect(
        &self,
        tcp: TcpStream,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        self.connectors[Alpn::Http1 as usize]
            .connect(self.name.clone(), tcp)
            .await
    }

    /// TLS over `tcp`, opened to `addr`, within `timeout`, offering `alpn`'s protocols;
    /// how it ended counted in `counted`.
    pub(super) async fn handshake(
        &self,
        tcp: TcpStream,
        addr: SocketAddr,
        timeout: Duration,
        counted: &TlsHandshakes,
        alpn: Alpn,
    ) -> Result<Stream, Error> {
        let connect = self.connectors[alpn as usize].connect(self.name.clone(), tcp);
        match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(tls)) => {
                let resumed = tls.get_ref().1.handshake_kind() == Some(HandshakeKind::Resumed);
                counted.count(match resumed {
                    true => TlsHandshake::Resumed,
                    false => TlsHandshake::Ok,
                });
                Ok(Stream::Tls(Box::new(tls)))
            }
            Ok(Err(source)) => {
                counted.count(TlsHandshake::Failed(TlsFailure::of(&source)));
                Err(Error::Tls {
                    addr,
                    name: self.name.to_str().into_owned(),
                    source,
                })
            }
            Err(_) => {
                counted.count(TlsHandshake::Timeout);
                Err(Error::TlsTimeout {
                    addr,
                    after: timeout,
                })
            }
        }
    }
}

/// What a connection offers in ALPN (RFC 7301): the protocols of the pool's `protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Alpn {
    /// `http/1.1` alone: the gateway's own client (`http1`, and `auto` once its server chose
    /// HTTP/1.1).
    Http1 = 0,
    /// `h2` alone (`h2`).
    H2 = 1,
    /// `h2`, then `http/1.1`: the server chooses (`auto`).
    Auto = 2,
}

impl Alpn {
    const ALL: [Alpn; 3] = [Alpn::Http1, Alpn::H2, Alpn::Auto];

    fn offered(self) -> &'static [&'static [u8]] {
        match self {
            Alpn::Http1 => &[b"http/1.1"],
            Alpn::H2 => &[b"h2"],
            Alpn::Auto => &[b"h2", b"http/1.1"],
        }
    }
}

/// How a handshake with the backend ended, for the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsHandshake {
    /// A full handshake.
    Ok,
    /// A handshake that resumed an earlier connection's session.
    Resumed,
    Failed(TlsFailure),
    /// Not done within `connect_timeout`.
    Timeout,
}

crate::telemetry::label_enum! {
    /// Why a handshake with the backend failed.
    pub enum TlsFailure {
        /// Its certificate is not signed by a CA we trust (`ca`, or the system's roots).
        UnknownIssuer,
        /// Its certificate is not for the name we asked for (the URL's host, or `sni`).
        NameMismatch,
        /// Its certificate has expired.
        Expired,
        /// Any other fault of its certificate (not yet valid, revoked, badly signed, none).
        Certificate,
        /// The backend ended the handshake with an alert: it refused us (our ALPN, our
        /// client certificate under TLS 1.2, no common version...).
        Alert,
        /// Nothing in common, or a backend that broke the protocol or did not speak TLS.
        Protocol,
        /// The connection was closed or reset under the handshake.
        Closed,
        Other,
    }
}

impl TlsHandshake {
    /// Every result and reason the metrics have a series for: ok, resumed, each failure
    /// (from [`TlsFailure::ALL`], not listed again), timeout.
    pub const ALL: [TlsHandshake; 3 + TlsFailure::ALL.len()] = {
        let mut all = [TlsHandshake::Timeout; 3 + TlsFailure::ALL.len()];
        all[0] = TlsHandshake::Ok;
        all[1] = TlsHandshake::Resumed;
        let mut i = 0;
        while i < TlsFailure::ALL.len() {
            all[2 + i] = TlsHandshake::Failed(TlsFailure::ALL[i]);
            i += 1;
        }
        all
    };

    /// The `result` label.
    pub fn name(self) -> &'static str {
        match self {
            TlsHandshake::Ok => "ok",
            TlsHandshake::Resumed => "resumed",
            TlsHandshake::Failed(_) => "failed",
            TlsHandshake::Timeout => "timeout",
        }
    }

    /// The `reason` label: why a failed one failed, `none` for the others.
    pub fn reason(self) -> &'static str {
        match self {
            TlsHandshake::Failed(why) => why.name(),
            _ => "none",
        }
    }
}

impl TlsFailure {
    /// Why the handshake that returned `e` failed: the `rustls::Error` inside it says,
    /// or else the connection failed under it.
    fn of(e: &std::io::Error) -> TlsFailure {
        use rustls::{CertificateError as C, Error as E};
        let tls = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        match tls {
            Some(E::InvalidCertificate(c)) => match c {
                C::UnknownIssuer => TlsFailure::UnknownIssuer,
                C::NotValidForName | C::NotValidForNameContext { .. } => TlsFailure::NameMismatch,
                C::Expired | C::ExpiredContext { .. } => TlsFailure::Expired,
                _ => TlsFailure::Certificate,
            },
            Some(E::NoCertificatesPresented) => TlsFailure::Certificate,
            Some(E::AlertReceived(_)) => TlsFailure::Alert,
            Some(
                E::PeerIncompatible(_)
                | E::PeerMisbehaved(_)
                | E::NoApplicationProtocol
                | E::InvalidMessage(_)
                | E::InappropriateMessage { .. }
                | E::InappropriateHandshakeMessage { .. },
            ) => TlsFailure::Protocol,
            Some(_) => TlsFailure::Other,
            None if e.kind() == std::io::ErrorKind::InvalidData => TlsFailure::Other,
            None => TlsFailure::Closed,
        }
    }
}

/// `ratewall_upstream_tls_handshakes_total`'s counters, one per [`TlsHandshake::ALL`]
/// entry, resolved once (by the metrics) so that counting hashes no labels. The default
/// counts nowhere (an `http://` upstream, or tests).
#[derive(Clone, Default)]
pub struct TlsHandshakes(pub [Counter; TlsHandshake::ALL.len()]);

impl TlsHandshakes {
    fn count(&self, h: TlsHandshake) {
        if let Some(at) = TlsHandshake::ALL.iter().position(|x| *x == h) {
            self.0[at].inc();
        }
    }
}

crate::telemetry::label_sets! {
    pub struct UpstreamHandshakeLabels {
        /// `ok` (a full handshake), `resumed` (an earlier session resumed), `failed`,
        /// `timeout` (not done within connect_timeout).
        pub result: &'static str,
        /// Why a `failed` one failed (see [`TlsFailure`]); `none` for the others.
        pub reason: &'static str,
    }
}

crate::telemetry::metrics! {
    /// The metrics of TLS to the backend: its handshakes, by result and reason; their
    /// series follow the config (see [`UpstreamTlsMetrics::handshakes`]).
    pub struct UpstreamTlsMetrics {
        pub handshakes: Family<UpstreamHandshakeLabels, Counter> = ("upstream_tls_handshakes", "TLS handshakes with an https:// upstream, by result: ok (full), resumed (an earlier session resumed), failed, timeout (not done within connect_timeout). For failed, by reason: unknown_issuer, name_mismatch, expired, certificate (another fault of the backend's certificate), alert (the backend refused us), protocol, closed (closed or reset under the handshake), other; reason=none for the other results"),
    }
}

impl UpstreamTlsMetrics {
    /// The counters of the upstream's TLS handshakes: for an `https://` upstream every
    /// series, created now at zero (counts so far kept); for an `http://` one, none (those
    /// of an earlier `https://` upstream dropped) and counters that count nowhere.
    pub fn handshakes(&self, https: bool) -> TlsHandshakes {
        if !https {
            self.handshakes.clear();
            return TlsHandshakes::default();
        }
        TlsHandshakes(TlsHandshake::ALL.map(|h| {
            self.handshakes
                .get_or_create(&UpstreamHandshakeLabels {
                    result: h.name(),
                    reason: h.reason(),
                })
                .clone()
        }))
    }
}

fn read(path: &Path, key: &'static str, material: &mut Sha256) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|e| TlsError {
        key,
        message: format!("cannot read {}: {e}", path.display()),
    })?;
    material.update((bytes.len() as u64).to_le_bytes());
    material.update(&bytes);
    Ok(bytes)
}

fn certificates(
    path: &Path,
    key: &'static str,
    material: &mut Sha256,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path, key, material)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError {
            key,
            message: format!("{}: not PEM certificates: {e}", path.display()),
        })?;
    if certs.is_empty() {
        return Err(TlsError {
            key,
            message: format!("{}: no certificate in it", path.display()),
        });
    }
    Ok(certs)
}

/// A TLS client verifying against the certificates of `ca` (a PEM file), or the system's
/// roots: the egress gateway's (issue 45), whose server name is each call's own host.
/// HTTP/1.1 is offered in ALPN, what the call is sent in.
pub fn client_config(ca: Option<&Path>) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let store = match ca {
        Some(path) => {
            let certs = certificates(path, "ca", &mut Sha256::new())?;
            let mut store = RootCertStore::empty();
            if store.add_parsable_certificates(certs).0 == 0 {
                return Err(TlsError {
                    key: "ca",
                    message: format!("{}: no usable CA certificate", path.display()),
                });
            }
            store
        }
        None => system_roots()?.0,
    };
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError {
            key: "tls",
            message: format!("no TLS version available: {e}"),
        })?
        .with_root_certificates(store)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The system's trusted roots (rustls-native-certs: the platform's store, `SSL_CERT_FILE`
/// and `SSL_CERT_DIR` where set). Certificates it cannot parse are skipped; none at all
/// is an error, as no backend could then be verified.
fn system_roots() -> Result<(RootCertStore, String), TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut store = RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map_or_else(|| "none found".to_string(), ToString::to_string);
        return Err(TlsError {
            key: "ca",
            message: format!("no system root certificates ({why}): give the backend's CA as `ca`"),
        });
    }
    Ok((store, format!("the system roots ({added} certificates)")))
}

/// `insecure_skip_verify`: any certificate, for any name, is taken. The handshake's
/// signatures are still checked (the peer holds the key of the certificate it showed),
/// which keeps the session's own integrity but says nothing of who the peer is. Also what
/// bench's TLS client (examples/tls_handshakes.rs) verifies with.
#[derive(Debug)]
pub struct NoVerification(pub Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Whether a handshake's failure is the backend's certificate (as opposed to the
/// connection, or the backend refusing ours).
pub(super) fn is_certificate_error(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|e| {
            matches!(
                e,
                rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::{AlertDescription, CertificateError, Error as E, PeerIncompatible};
    use std::io;

    /// An error as tokio-rustls returns a refused handshake: the rustls error inside.
    fn refused(e: rustls::Error) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }

    #[test]
    fn a_failed_handshake_is_counted_by_what_rustls_said() {
        let cases = [
            (
                refused(E::InvalidCertificate(CertificateError::UnknownIssuer)),
                "unknown_issuer",
            ),
            (
                refused(E::InvalidCertificate(CertificateError::NotValidForName)),
                "name_mismatch",
            ),
            (
                refused(E::InvalidCertificate(CertificateError::Expired)),
                "expired",
            ),
            (
                refused(E::InvalidCertificate(CertificateError::Revoked)),
                "certificate",
            ),
            (refused(E::NoCertificatesPresented), "certificate"),
            (
                refused(E::AlertReceived(AlertDescription::CertificateRequired)),
                "alert",
            ),
            (
                refused(E::PeerIncompatible(
                    PeerIncompatible::Tls12NotOfferedOrEnabled,
                )),
                "protocol",
            ),
            (refused(E::NoApplicationProtocol), "protocol"),
            (refused(E::DecryptError), "other"),
            (io::Error::from(io::ErrorKind::UnexpectedEof), "closed"),
            (io::Error::from(io::ErrorKind::ConnectionReset), "closed"),
        ];
        for (e, want) in cases {
            assert_eq!(TlsFailure::of(&e).name(), want, "{e:?}");
        }
    }

    #[test]
    fn every_result_and_reason_has_one_counter() {
        let counters = TlsHandshakes::default();
        for (i, h) in TlsHandshake::ALL.into_iter().enumerate() {
            counters.count(h);
            assert_eq!(counters.0[i].get(), 1, "{h:?}");
            let others: u64 = counters.0.iter().map(Counter::get).sum();
            assert_eq!(others, i as u64 + 1, "{h:?} counted once, in its own");
        }
        let failed = TlsHandshake::ALL
            .iter()
            .filter(|h| h.name() == "failed")
            .count();
        assert_eq!(failed, 8, "every reason");
        assert!(TlsHandshake::ALL
            .iter()
            .all(|h| (h.name() == "failed") != (h.reason() == "none")));
    }
}
