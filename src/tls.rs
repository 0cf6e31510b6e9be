//! TLS at the perimeter (`[server.tls]`): the certificates the gateway presents, chosen by
//! SNI, the client certificates it may ask for, and the rustls server config built from
//! them once per load. Certificates are read when the config is loaded (at start, by
//! `ratewall check`, and on SIGHUP), and handed to [`Settings::build`] as bytes by path, so
//! that building is no I/O of its own: a file that cannot be read or a key that does not match its
//! certificate fails the load, so a bad rotation keeps the old config and certificates
//! serving, like any bad config.
//!
//! rustls with the ring provider: TLS 1.2 and 1.3, its safe defaults (no renegotiation,
//! no compression, AEAD suites only), ALPN `h2` and `http/1.1`.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A certificate expiring within this is warned about by `ratewall check` and at load.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(14 * 24 * 3600);

/// `[server.tls]`, validated, with its certificates loaded.
pub struct Settings {
    pub listen: SocketAddr,
    /// In the file's order; the first is the default (a client without SNI, or naming
    /// a host no certificate covers).
    pub certificates: Vec<Certificate>,
    /// Client certificates, if asked for.
    pub client_auth: Option<ClientAuth>,
    /// Answer cleartext requests with a 308 to the same URL over https.
    pub redirect_https: bool,
    /// What the TLS listener's handshakes run on: built once per load, swapped whole on
    /// reload with the config it belongs to.
    pub server_config: Arc<rustls::ServerConfig>,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("listen", &self.listen)
            .field("certificates", &self.certificates)
            .field("client_auth", &self.client_auth)
            .field("redirect_https", &self.redirect_https)
            .finish_non_exhaustive()
    }
}

/// Whether a client must present a certificate, and whom it must be issued by.
#[derive(Debug, Clone)]
pub struct ClientAuth {
    pub ca: PathBuf,
    pub required: bool,
}

/// One certificate (chain) and its key, as loaded.
#[derive(Clone)]
pub struct Certificate {
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    /// The names it is valid for (its subjectAltName DNS names and IP addresses).
    pub names: Vec<String>,
    /// Its `notAfter`, in seconds since the Unix epoch.
    pub not_after: i64,
    /// The SHA-256 of the chain's certificates (DER): whether a reload changed it.
    pub sha256: [u8; 32],
    key: Arc<CertifiedKey>,
}

impl fmt::Debug for Certificate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key material.
        f.debug_struct("Certificate")
            .field("cert", &self.cert_path)
            .field("names", &self.names)
            .field("not_after", &self.not_after)
            .finish()
    }
}

impl Certificate {
    /// Seconds from now until it expires (negative: expired).
    pub fn expires_in(&self) -> i64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        self.not_after - now
    }

    /// Its `notAfter` as RFC 3339 (UTC, seconds).
    pub fn not_after_text(&self) -> String {
        let t = UNIX_EPOCH + Duration::from_secs(u64::try_from(self.not_after).unwrap_or(0));
        humantime::format_rfc3339_seconds(t).to_string()
    }
}

/// Why the TLS settings could not be loaded: which file, and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path:?}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path:?}: {message}")]
    Invalid { path: PathBuf, message: String },
}

fn invalid(path: &Path, message: impl Into<String>) -> LoadError {
    LoadError::Invalid {
        path: path.to_owned(),
        message: message.into(),
    }
}

/// The process-wide crypto provider: ring.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A file's bytes by its path, or why it could not be read: what the config's load read.
pub type Contents<'a> = &'a dyn Fn(&Path) -> std::io::Result<Vec<u8>>;

/// Every PEM certificate in `path`, in order.
fn read_certs(
    path: &Path,
    contents: Contents<'_>,
) -> Result<Vec<CertificateDer<'static>>, LoadError> {
    let bytes = contents(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(path, "no CERTIFICATE block in the file"));
    }
    Ok(certs)
}

/// One certificate chain and its key: both readable, the key one rustls can sign with,
/// and the certificate's own.
pub fn certificate(
    cert_path: &Path,
    key_path: &Path,
    contents: Contents<'_>,
) -> Result<Certificate, LoadError> {
    let chain = read_certs(cert_path, contents)?;
    let key_bytes = contents(key_path).map_err(|source| LoadError::Read {
        path: key_path.to_owned(),
        source,
    })?;
    let key = PrivateKeyDer::from_pem_slice(&key_bytes)
        .map_err(|e| invalid(key_path, format!("no private key in the file: {e}")))?;
    let (not_after, names) = der::summary(&chain[0])
        .ok_or_else(|| invalid(cert_path, "cannot parse the certificate"))?;
    let sha256 = crate::identity::sha256(
        &chain
            .iter()
            .flat_map(|c| c.iter().copied())
            .collect::<Vec<u8>>(),
    );
    let key = CertifiedKey::from_der(chain, key, &provider()).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => invalid(
            key_path,
            format!("the key does not match the certificate {cert_path:?}"),
        ),
        e => invalid(key_path, format!("unusable private key: {e}")),
    })?;
    Ok(Certificate {
        cert_path: cert_path.to_owned(),
        key_path: key_path.to_owned(),
        names,
        not_after,
        sha256,
        key: Arc::new(key),
    })
}

/// The ALPN protocols offered, most preferred first.
pub const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

impl Settings {
    /// The certificates (and the client CA), from `contents`, and the server config built
    /// on them.
    pub fn build(
        listen: SocketAddr,
        files: &[(PathBuf, PathBuf)],
        client_auth: Option<ClientAuth>,
        redirect_https: bool,
        contents: Contents<'_>,
    ) -> Result<Settings, LoadError> {
        let certificates = files
            .iter()
            .map(|(c, k)| certificate(c, k, contents))
            .collect::<Result<Vec<_>, _>>()?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| invalid(Path::new(""), e.to_string()))?;
        let builder = match &client_auth {
            None => builder.with_no_client_auth(),
            Some(auth) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in read_certs(&auth.ca, contents)? {
                    roots
                        .add(cert)
                        .map_err(|e| invalid(&auth.ca, format!("not a usable CA: {e}")))?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
                let verifier = match auth.required {
                    true => verifier,
                    false => verifier.allow_unauthenticated(),
                };
                let verifier = verifier
                    .build()
                    .map_err(|e| invalid(&auth.ca, format!("not a usable CA: {e}")))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(Arc::new(BySni {
            keys: certificates.iter().map(|c| c.key.clone()).collect(),
        }));
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        // Session resumption: by stateless tickets (TLS 1.3, and 1.2 clients that ask),
        // from one ticketer for the process, so that tickets issued before a reload still
        // resume after it; and rustls' in-memory cache for 1.2 clients without tickets.
        if let Some(ticketer) = ticketer() {
            config.ticketer = ticketer;
        }
        Ok(Settings {
            listen,
            certificates,
            client_auth,
            redirect_https,
            server_config: Arc::new(config),
        })
    }
}

impl Settings {
    /// Whether `other` presents the same certificates, in the same order.
    pub fn same_certificates(&self, other: &Settings) -> bool {
        self.certificates.len() == other.certificates.len()
            && self
                .certificates
                .iter()
                .zip(&other.certificates)
                .all(|(a, b)| a.sha256 == b.sha256)
    }

    /// What `ratewall check` prints of the listener: one line, then one per certificate.
    pub fn describe(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let clients = match &self.client_auth {
            None => "no client certificates".to_string(),
            Some(a) => format!(
                "client certificates {} (CA {})",
                if a.required { "required" } else { "optional" },
                a.ca.display()
            ),
        };
        let _ = writeln!(
            out,
            "tls           listen {}, TLS 1.2 and 1.3, ALPN h2 and http/1.1, {clients}, redirect_https {}",
            self.listen,
            if self.redirect_https { "on" } else { "off" }
        );
        for (i, c) in self.certificates.iter().enumerate() {
            let left = c.expires_in();
            let when = match left {
                l if l < 0 => "EXPIRED".to_string(),
                l => format!("in {} days", l / 86_400),
            };
            let _ = writeln!(
                out,
                "  - {}{}: {}; expires {} ({when})",
                c.cert_path.display(),
                if i == 0 { " (default)" } else { "" },
                if c.names.is_empty() {
                    "no subjectAltName".to_string()
                } else {
                    c.names.join(", ")
                },
                c.not_after_text(),
            );
        }
        out
    }

    /// Certificates expired or expiring within [`EXPIRY_WARNING`]: one line each.
    pub fn warnings(&self) -> Vec<String> {
        let soon = i64::try_from(EXPIRY_WARNING.as_secs()).unwrap_or(i64::MAX);
        self.certificates
            .iter()
            .filter(|c| c.expires_in() < soon)
            .map(|c| match c.expires_in() {
                l if l < 0 => format!(
                    "certificate {} expired at {}",
                    c.cert_path.display(),
                    c.not_after_text()
                ),
                l => format!(
                    "certificate {} expires within 14 days: at {} (in {}h)",
                    c.cert_path.display(),
                    c.not_after_text(),
                    l / 3600
                ),
            })
            .collect()
    }
}

/// The process's session ticketer (keys rotated by rustls every 6 hours, the previous
/// key still accepted), or none where it cannot be made (then sessions resume from the
/// in-memory cache only).
fn ticketer() -> Option<Arc<dyn rustls::server::ProducesTickets>> {
    static TICKETER: std::sync::OnceLock<Option<Arc<dyn rustls::server::ProducesTickets>>> =
        std::sync::OnceLock::new();
    TICKETER
        .get_or_init(|| {
            rustls::crypto::ring::Ticketer::new()
                .map_err(|e| tracing::warn!(error = %e, "no TLS session tickets"))
                .ok()
        })
        .clone()
}

/// The certificate for a handshake: the first whose names cover the client's SNI (as
/// webpki matches them, wildcards included), else the first.
#[derive(Debug)]
struct BySni {
    keys: Vec<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for BySni {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // One certificate: it is the default whatever the client names; nothing to parse.
        if let [only] = &self.keys[..] {
            return Some(only.clone());
        }
        let covers = |name: &ServerName<'_>, key: &CertifiedKey| {
            key.end_entity_cert()
                .ok()
                .and_then(|der| webpki::EndEntityCert::try_from(der).ok())
                .is_some_and(|ee| ee.verify_is_valid_for_subject_name(name).is_ok())
        };
        if let Some(name) = hello
            .server_name()
            .and_then(|n| ServerName::try_from(n).ok())
        {
            if let Some(key) = self.keys.iter().find(|k| covers(&name, k)) {
                return Some(key.clone());
            }
        }
        self.keys.first().cloned()
    }
}

/// What a finished handshake says about the connection: for the access log, metrics,
/// the forwarding headers and the `client_cert` key.
#[derive(Debug, Clone, Default)]
pub struct Session {
    /// `TLSv1.3` or `TLSv1.2`.
    pub version: &'static str,
    /// The negotiated ALPN protocol (`h2`, `http/1.1`), or none.
    pub alpn: Option<&'static str>,
    /// The SHA-256 of the verified client certificate (DER), if one was presented.
    pub client_cert: Option<[u8; 32]>,
}

impl Session {
    pub fn of(conn: &rustls::ServerConnection) -> Session {
        let version = match conn.protocol_version() {
            Some(rustls::ProtocolVersion::TLSv1_3) => "TLSv1.3",
            Some(rustls::ProtocolVersion::TLSv1_2) => "TLSv1.2",
            _ => "unknown",
        };
        let alpn = match conn.alpn_protocol() {
            Some(b"h2") => Some("h2"),
            Some(b"http/1.1") => Some("http/1.1"),
            _ => None,
        };
        let client_cert = conn
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| crate::identity::sha256(c.as_ref()));
        Session {
            version,
            alpn,
            client_cert,
        }
    }
}

/// The little of X.509 (RFC 5280 §4.1) the gateway reads itself: a certificate's
/// `notAfter` and subjectAltName entries. DER only, no allocation but the names.
mod der {
    /// One TLV at the start of `b`: (tag, contents, rest).
    fn tlv(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
        let (&tag, b) = b.split_first()?;
        let (&first, mut b) = b.split_first()?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || b.len() < n {
                return None;
            }
            let len = b[..n]
                .iter()
                .fold(0usize, |a, &x| (a << 8) | usize::from(x));
            b = &b[n..];
            len
        };
        if b.len() < len {
            return None;
        }
        Some((tag, &b[..len], &b[len..]))
    }

    /// `notAfter` (seconds since the epoch) and the subjectAltName DNS names and IPs.
    pub(super) fn summary(cert: &[u8]) -> Option<(i64, Vec<String>)> {
        let (_, cert, _) = tlv(cert)?;
        let (_, tbs, _) = tlv(cert)?;
        let mut rest = tbs;
        let (tag, _, r) = tlv(rest)?;
        // [0] version, then serial; or serial straight away (v1).
        rest = if tag == 0xa0 { tlv(r)?.2 } else { r };
        let (_, _, r) = tlv(rest)?; // signature algorithm
        let (_, _, r) = tlv(r)?; // issuer
        let (_, validity, r) = tlv(r)?;
        let (_, _, after) = tlv(validity)?;
        let (tag, not_after, _) = tlv(after)?;
        let not_after = time(tag, not_after)?;
        let (_, _, mut r) = tlv(r)?; // subject
        r = tlv(r)?.2; // subjectPublicKeyInfo
        let mut names = Vec::new();
        while let Some((tag, body, next)) = tlv(r) {
            r = next;
            if tag != 0xa3 {
                continue;
            }
            let (_, mut exts, _) = tlv(body)?;
            while let Some((_, ext, next)) = tlv(exts) {
                exts = next;
                let (_, oid, mut e) = tlv(ext)?;
                if oid != [0x55, 0x1d, 0x11] {
                    continue;
                }
                let (mut tag, mut value, after) = tlv(e)?;
                if tag == 0x01 {
                    e = after; // critical
                    (tag, value, _) = tlv(e)?;
                }
                if tag != 0x04 {
                    return None;
                }
                let (_, mut general, _) = tlv(value)?;
                while let Some((tag, name, next)) = tlv(general) {
                    general = next;
                    match tag {
                        0x82 => names.push(String::from_utf8_lossy(name).into_owned()),
                        0x87 if name.len() == 4 => {
                            let a: [u8; 4] = name.try_into().ok()?;
                            names.push(std::net::Ipv4Addr::from(a).to_string());
                        }
                        0x87 if name.len() == 16 => {
                            let a: [u8; 16] = name.try_into().ok()?;
                            names.push(std::net::Ipv6Addr::from(a).to_string());
                        }
                        _ => {}
                    }
                }
            }
        }
        Some((not_after, names))
    }

    /// UTCTime (`YYMMDDHHMMSSZ`, RFC 5280 §4.1.2.5.1: years 50-99 are 19xx) or
    /// GeneralizedTime (`YYYYMMDDHHMMSSZ`), as seconds since the epoch.
    fn time(tag: u8, t: &[u8]) -> Option<i64> {
        let digits = |s: &[u8]| -> Option<i64> {
            s.iter().try_fold(0i64, |a, &d| {
                d.is_ascii_digit().then(|| a * 10 + i64::from(d - b'0'))
            })
        };
        let (year, rest) = match tag {
            0x17 if t.len() == 13 => {
                let y = digits(&t[..2])?;
                (if y >= 50 { 1900 + y } else { 2000 + y }, &t[2..])
            }
            0x18 if t.len() == 15 => (digits(&t[..4])?, &t[4..]),
            _ => return None,
        };
        if rest.last() != Some(&b'Z') {
            return None;
        }
        let (month, day) = (digits(&rest[..2])?, digits(&rest[2..4])?);
        let (h, m, s) = (
            digits(&rest[4..6])?,
            digits(&rest[6..8])?,
            digits(&rest[8..10])?,
        );
        Some(days_from_civil(year, month, day) * 86_400 + h * 3600 + m * 60 + s)
    }

    /// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
    fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
        let y = if m <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let mp = (m + 9) % 12;
        let doy = (153 * mp + 2) / 5 + d - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        era * 146_097 + doe - 719_468
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn times_are_seconds_since_the_epoch() {
            assert_eq!(super::time(0x17, b"700101000000Z"), Some(0));
            assert_eq!(super::time(0x17, b"491231235959Z"), Some(2_524_607_999));
            assert_eq!(super::time(0x18, b"20000301000000Z"), Some(951_868_800));
            assert_eq!(super::time(0x18, b"20000301000000"), None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_certificate_gives_its_names_and_expiry() {
        let mut params =
            rcgen::CertificateParams::new(vec!["a.test".to_string(), "*.b.test".to_string()])
                .expect("params");
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress(std::net::IpAddr::from([
                127, 0, 0, 1,
            ])));
        params.not_after = rcgen::date_time_ymd(2031, 5, 17);
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("cert");
        let (not_after, names) = der::summary(cert.der()).expect("parsed");
        assert_eq!(names, ["a.test", "*.b.test", "127.0.0.1"]);
        assert_eq!(
            humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(not_after as u64))
                .to_string(),
            "2031-05-17T00:00:00Z"
        );
    }
}
