//! An https upstream in the test process (rustls behind hyper's HTTP/1.1 server), with
//! certificates the harness makes (rcgen): no key is checked in.
//!
//! It counts what the tests ask about: TLS handshakes (full or resumed), the SNI each
//! asked for, the client certificate each presented, and requests answered. It answers
//! every request 200 with the body `tls ok` (with a request body: `tls ok, <n> bytes, sum
//! <checksum>`); `/close` with `Connection: close`, so that the next request needs a new
//! connection.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{HandshakeKind, RootCertStore, ServerConfig};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

/// A certificate authority made for one test.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, as PEM.
pub struct Leaf {
    pub cert: String,
    pub key: String,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("CA key");
        Ca {
            issuer: CertifiedIssuer::self_signed(params, key).expect("CA certificate"),
        }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for `names` (DNS names, or IP addresses), signed by this CA.
    pub fn leaf(&self, names: &[&str]) -> Leaf {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names.clone()).expect("leaf params");
        params.distinguished_name.push(
            DnType::CommonName,
            names.first().cloned().unwrap_or_default(),
        );
        let key = KeyPair::generate().expect("leaf key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("leaf certificate");
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

/// Write `text` to `dir/name`, returning the path.
pub fn write_pem(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write PEM");
    path
}

/// What the https upstream saw.
#[derive(Default)]
pub struct TlsSeen {
    pub handshakes: AtomicUsize,
    pub resumed: AtomicUsize,
    pub requests: AtomicUsize,
    /// The SNI of each handshake, in order (`None`: none sent).
    pub sni: Mutex<Vec<Option<String>>>,
    /// The client certificate of each handshake (DER of the end entity), in order.
    pub client_certs: Mutex<Vec<Option<Vec<u8>>>>,
    /// The ALPN protocol of each handshake.
    pub alpn: Mutex<Vec<Option<Vec<u8>>>>,
    /// Handshakes that failed, with rustls' reason.
    pub failed: Mutex<Vec<String>>,
    /// Connections served and ended (closed by either side).
    pub ended: AtomicUsize,
}

/// Whether the upstream asks for a client certificate.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum ClientCerts {
    None,
    Required,
}

pub struct TlsUpstream {
    pub addr: SocketAddr,
    pub seen: Arc<TlsSeen>,
    task: JoinHandle<()>,
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TlsUpstream {
    /// Serve `leaf` on a free port; client certificates per `clients`, from `client_ca`.
    pub async fn start(leaf: &Leaf, clients: ClientCerts, client_ca: Option<&Ca>) -> TlsUpstream {
        Self::start_with(leaf, clients, client_ca, None).await
    }

    /// The same, closing a kept connection idle for `idle` (hyper's header read timeout).
    pub async fn start_with(
        leaf: &Leaf,
        clients: ClientCerts,
        client_ca: Option<&Ca>,
        idle: Option<std::time::Duration>,
    ) -> TlsUpstream {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .expect("leaf PEM");
        let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).expect("key PEM");
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("versions");
        let builder = match clients {
            ClientCerts::None => builder.with_no_client_auth(),
            _ => {
                let mut roots = RootCertStore::empty();
                let ca = client_ca.expect("a client CA");
                roots.add(ca.issuer.der().clone()).expect("client CA");
                let v = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
                builder.with_client_cert_verifier(v.build().expect("client verifier"))
            }
        };
        let mut config = builder.with_single_cert(chain, key).expect("server cert");
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen = Arc::new(TlsSeen::default());
        let task = tokio::spawn(serve(listener, acceptor, seen.clone(), idle));
        TlsUpstream { addr, seen, task }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn handshakes(&self) -> usize {
        self.seen.handshakes.load(Ordering::SeqCst)
    }

    pub fn resumed(&self) -> usize {
        self.seen.resumed.load(Ordering::SeqCst)
    }

    pub fn requests(&self) -> usize {
        self.seen.requests.load(Ordering::SeqCst)
    }

    pub fn sni(&self) -> Vec<Option<String>> {
        self.seen.sni.lock().unwrap().clone()
    }

    pub fn client_certs(&self) -> Vec<Option<Vec<u8>>> {
        self.seen.client_certs.lock().unwrap().clone()
    }

    pub fn failed(&self) -> Vec<String> {
        self.seen.failed.lock().unwrap().clone()
    }

    /// Wait until `n` connections served have ended (at most [`super::WAIT`]): whether they
    /// did.
    pub async fn wait_ended(&self, n: usize) -> bool {
        let end = std::time::Instant::now() + super::WAIT;
        while self.seen.ended.load(Ordering::SeqCst) < n {
            if std::time::Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        true
    }
}

async fn serve(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    seen: Arc<TlsSeen>,
    idle: Option<std::time::Duration>,
) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let (acceptor, seen) = (acceptor.clone(), seen.clone());
        tokio::spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(tls) => tls,
                Err(e) => {
                    seen.failed.lock().unwrap().push(e.to_string());
                    return;
                }
            };
            {
                let (_, conn) = tls.get_ref();
                seen.handshakes.fetch_add(1, Ordering::SeqCst);
                if conn.handshake_kind() == Some(HandshakeKind::Resumed) {
                    seen.resumed.fetch_add(1, Ordering::SeqCst);
                }
                seen.alpn
                    .lock()
                    .unwrap()
                    .push(conn.alpn_protocol().map(<[u8]>::to_vec));
                seen.sni
                    .lock()
                    .unwrap()
                    .push(conn.server_name().map(str::to_string));
                seen.client_certs.lock().unwrap().push(
                    conn.peer_certificates()
                        .and_then(|c| c.first())
                        .map(|c| c.to_vec()),
                );
            }
            let seen2 = seen.clone();
            let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let seen = seen2.clone();
                async move {
                    seen.requests.fetch_add(1, Ordering::SeqCst);
                    let mut resp = http::Response::builder().status(200);
                    if req.uri().path() == "/close" {
                        resp = resp.header("connection", "close");
                    }
                    let body = req
                        .into_body()
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    let text = match body.len() {
                        0 => "tls ok".to_string(),
                        n => format!("tls ok, {n} bytes, sum {}", checksum(&body)),
                    };
                    Ok::<_, std::convert::Infallible>(
                        resp.body(Full::new(Bytes::from(text))).unwrap(),
                    )
                }
            });
            let mut http = hyper::server::conn::http1::Builder::new();
            if let Some(idle) = idle {
                http.timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(idle);
            }
            let _ = http.serve_connection(TokioIo::new(tls), service).await;
            seen.ended.fetch_add(1, Ordering::SeqCst);
        });
    }
}

/// The sum of `bytes`, each weighted by its place: what the upstream says it read.
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().enumerate().fold(0u64, |acc, (i, b)| {
        acc.wrapping_add((i as u64 + 1) * u64::from(*b))
    })
}
