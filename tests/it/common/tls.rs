//! TLS for the tests: a throw-away CA made with rcgen (never a checked-in key), server and
//! client certificates it signs, written as PEM files in a temporary folder, and a rustls
//! client (tokio-rustls, hyper's HTTP/1.1 or HTTP/2 by ALPN) that can present one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::net::TcpStream;

/// A CA, and the folder its certificates are written to.
pub struct Pki {
    pub dir: tempfile::TempDir,
    ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    /// The CA's certificate file (PEM).
    pub ca_pem: PathBuf,
}

/// A client certificate and its key, for a rustls client.
pub struct ClientIdentity {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for ClientIdentity {
    fn clone(&self) -> Self {
        ClientIdentity {
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl Pki {
    pub fn new(name: &str) -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} test CA"));
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().expect("CA key");
        let ca = rcgen::CertifiedIssuer::self_signed(params, key).expect("CA");
        let ca_pem = dir.path().join(format!("{name}-ca.pem"));
        std::fs::write(&ca_pem, ca.pem()).expect("write CA");
        Pki { dir, ca, ca_pem }
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// A server certificate for `names`, valid for `days` from now, written to
    /// `<file>.pem` and `<file>-key.pem`: (cert path, key path).
    pub fn server_cert(&self, file: &str, names: &[&str], days: i64) -> (PathBuf, PathBuf) {
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("params");
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            names.first().copied().unwrap_or("x"),
        );
        let now = time_now();
        params.not_before = now - time::Duration::days(30);
        params.not_after = now + time::Duration::days(days);
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca).expect("sign");
        let (c, k) = (
            self.path(&format!("{file}.pem")),
            self.path(&format!("{file}-key.pem")),
        );
        std::fs::write(&c, cert.pem()).expect("write cert");
        std::fs::write(&k, key.serialize_pem()).expect("write key");
        (c, k)
    }

    /// A client certificate named `cn`, signed by this CA.
    pub fn client_cert(&self, cn: &str) -> ClientIdentity {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca).expect("sign");
        ClientIdentity {
            chain: vec![cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        }
    }

    /// The CA's certificate.
    pub fn ca_der(&self) -> CertificateDer<'static> {
        self.ca.der().clone()
    }
}

fn time_now() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc()
}

/// Start the binary with a TLS listener on a free port, `body(port)` the config after its
/// `[server]` table (with a `tls_table` on `port`). A port is picked free just before; one
/// taken in between (another test's connection may get it as its own port) is picked
/// again, as `Gateway::start` does for the ports it picks itself.
pub fn start_on_free_tls_port(body: impl Fn(u16) -> String) -> (super::Gateway, u16) {
    let mut last = String::new();
    for _ in 0..5 {
        let port = super::free_port();
        match super::Gateway::try_start(&body(port)) {
            Ok(gw) => return (gw, port),
            Err(logs) if logs.contains("cannot listen") => last = logs,
            Err(logs) => panic!("ratewall did not start:\n{logs}"),
        }
    }
    panic!("no free port for the TLS listener after 5 tries:\n{last}")
}

/// A `[server.tls]` table listening on `port` with `certs` (in order: the first is the
/// default) and `extra` lines.
pub fn tls_table(port: u16, certs: &[(PathBuf, PathBuf)], extra: &str) -> String {
    let list: Vec<String> = certs
        .iter()
        .map(|(c, k)| {
            format!(
                "{{ cert = \"{}\", key = \"{}\" }}",
                super::toml_path(c),
                super::toml_path(k)
            )
        })
        .collect();
    format!(
        "[server.tls]\nlisten = \"127.0.0.1:{port}\"\ncertificates = [{}]\n{extra}",
        list.join(", ")
    )
}

/// A rustls client trusting `roots`, offering `alpn`, presenting `identity` if given.
pub fn client_config(
    roots: &[CertificateDer<'static>],
    alpn: &[&[u8]],
    identity: Option<ClientIdentity>,
) -> Arc<rustls::ClientConfig> {
    let mut store = rustls::RootCertStore::empty();
    for r in roots {
        store.add(r.clone()).expect("root");
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(store);
    let mut config = match identity {
        Some(id) => builder
            .with_client_auth_cert(id.chain, id.key)
            .expect("client cert"),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// One TLS connection's facts and its one exchange.
#[derive(Debug)]
pub struct TlsReply {
    pub status: StatusCode,
    pub body: Bytes,
    /// The server's end-entity certificate (DER).
    pub server_cert: Vec<u8>,
    pub alpn: Option<Vec<u8>>,
    pub version: Option<rustls::ProtocolVersion>,
}

/// The handshake alone: the TLS stream, or why it failed.
pub async fn handshake(
    port: u16,
    sni: &str,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    let name = ServerName::try_from(sni.to_string()).expect("server name");
    tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
}

/// Connect to `port` naming `sni`, and send one GET `path` with `headers` (HTTP/2 where
/// ALPN agreed on it, else HTTP/1.1).
pub async fn tls_get(
    port: u16,
    sni: &str,
    config: Arc<rustls::ClientConfig>,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<TlsReply, String> {
    let tls = handshake(port, sni, config)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let (_, conn) = tls.get_ref();
    let server_cert = conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let alpn = conn.alpn_protocol().map(<[u8]>::to_vec);
    let version = conn.protocol_version();
    let h2 = alpn.as_deref() == Some(b"h2");
    let mut req = Request::get(format!("https://{sni}:{port}{path}"));
    if !h2 {
        req = req.header("host", format!("{sni}:{port}"));
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Empty::<Bytes>::new()).expect("request");
    let io = TokioIo::new(tls);
    let resp = if h2 {
        let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .map_err(|e| format!("h2: {e}"))?;
        tokio::spawn(conn);
        send.send_request(req).await
    } else {
        let (mut send, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| format!("h1: {e}"))?;
        tokio::spawn(conn);
        send.send_request(req).await
    }
    .map_err(|e| format!("request: {e}"))?;
    let (parts, body) = resp.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok(TlsReply {
        status: parts.status,
        body,
        server_cert,
        alpn,
        version,
    })
}

/// A certificate file's first certificate (DER), to compare with what a server presented.
pub fn cert_der(path: &Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_file_iter(path)
        .expect("cert file")
        .next()
        .expect("a certificate")
        .expect("PEM")
        .to_vec()
}
