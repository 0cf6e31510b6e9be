//! Signed tokens for the tests: keys made here (RSA by `openssl genpkey`, EC P-256,
//! P-384 and Ed25519 by rcgen; never a checked-in key), tokens signed with them
//! (`jsonwebtoken`), their public keys as PEM files and as a JWKS, and a JWKS served over
//! https by a local server (certificates by the harness' CA) whose document can be
//! changed, and which can be stopped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use base64::Engine;
use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;

use super::tls_upstream::{write_pem, Ca};

/// A signing key, its algorithm, and its public half.
pub struct SigningKey {
    pub alg: Algorithm,
    encoding: EncodingKey,
    /// The public key, PEM (SubjectPublicKeyInfo).
    pub public_pem: String,
    /// The public key as a JWK's members (`kty`, `crv`, `x`, `y`), for a JWKS.
    jwk: Option<serde_json::Value>,
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

impl SigningKey {
    /// An RSA key of 2048 bits (RS256), by `openssl genpkey`.
    pub fn rsa(dir: &Path) -> SigningKey {
        let key = dir.join(format!("rsa-{}.pem", super::free_port()));
        let ok = Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
                "-out",
            ])
            .arg(&key)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl (installed by scripts/test)");
        assert!(ok.success(), "openssl genpkey");
        let public = Command::new("openssl")
            .args(["pkey", "-pubout", "-in"])
            .arg(&key)
            .output()
            .expect("openssl pkey");
        let private = std::fs::read(&key).expect("the RSA key");
        SigningKey {
            alg: Algorithm::RS256,
            encoding: EncodingKey::from_rsa_pem(&private).expect("an RSA key"),
            public_pem: String::from_utf8(public.stdout).expect("PEM"),
            jwk: None,
        }
    }

    /// An EC P-256 key (ES256).
    pub fn p256() -> SigningKey {
        Self::ec(&rcgen::PKCS_ECDSA_P256_SHA256, Algorithm::ES256, "P-256")
    }

    /// An EC P-384 key (ES384).
    pub fn p384() -> SigningKey {
        Self::ec(&rcgen::PKCS_ECDSA_P384_SHA384, Algorithm::ES384, "P-384")
    }

    fn ec(alg: &'static rcgen::SignatureAlgorithm, jwt: Algorithm, crv: &str) -> SigningKey {
        let key = rcgen::KeyPair::generate_for(alg).expect("EC key");
        let raw = key.public_key_raw();
        // Uncompressed point: 0x04, then x and y.
        let half = (raw.len() - 1) / 2;
        SigningKey {
            alg: jwt,
            encoding: EncodingKey::from_ec_pem(key.serialize_pem().as_bytes()).expect("EC"),
            public_pem: key.public_key_pem(),
            jwk: Some(serde_json::json!({
                "kty": "EC", "crv": crv, "x": b64(&raw[1..1 + half]), "y": b64(&raw[1 + half..])
            })),
        }
    }

    /// An Ed25519 key (EdDSA).
    pub fn ed25519() -> SigningKey {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("Ed25519 key");
        SigningKey {
            alg: Algorithm::EdDSA,
            encoding: EncodingKey::from_ed_pem(key.serialize_pem().as_bytes()).expect("Ed"),
            public_pem: key.public_key_pem(),
            jwk: Some(serde_json::json!({
                "kty": "OKP", "crv": "Ed25519", "x": b64(key.public_key_raw())
            })),
        }
    }

    /// A shared secret (HS256).
    pub fn secret(secret: &[u8]) -> SigningKey {
        SigningKey {
            alg: Algorithm::HS256,
            encoding: EncodingKey::from_secret(secret),
            public_pem: String::new(),
            jwk: None,
        }
    }

    /// `claims`, signed, with `kid` in the header where given.
    pub fn sign(&self, claims: &serde_json::Value, kid: Option<&str>) -> String {
        let mut header = Header::new(self.alg);
        header.kid = kid.map(str::to_string);
        jsonwebtoken::encode(&header, claims, &self.encoding).expect("sign")
    }

    /// `claims` under a header of the test's own making (any members: `crit`, `b64`...),
    /// signed with this key by its algorithm, whatever the header's `alg` says.
    pub fn sign_with_header(
        &self,
        header: &serde_json::Value,
        claims: &serde_json::Value,
    ) -> String {
        let message = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let signature =
            jsonwebtoken::crypto::sign(message.as_bytes(), &self.encoding, self.alg).expect("sign");
        format!("{message}.{signature}")
    }

    /// The public key as a JWKS entry with `kid` (EC and Ed25519 keys).
    pub fn jwk(&self, kid: &str) -> serde_json::Value {
        let mut jwk = self.jwk.clone().expect("a JWK for EC and Ed25519 keys");
        jwk["kid"] = kid.into();
        jwk["use"] = "sig".into();
        jwk
    }

    /// The public key written as `dir/name`.
    pub fn public_file(&self, dir: &Path, name: &str) -> PathBuf {
        write_pem(dir, name, &self.public_pem)
    }
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
}

/// Claims for `sub`, valid for an hour, from `iss` for `aud`.
pub fn claims(sub: &str, iss: &str, aud: &str) -> serde_json::Value {
    serde_json::json!({ "sub": sub, "iss": iss, "aud": aud, "exp": unix_now() + 3600 })
}

/// A JWKS document of `keys` (kid, key).
pub fn jwks(keys: &[(&str, &SigningKey)]) -> String {
    let keys: Vec<serde_json::Value> = keys.iter().map(|(kid, k)| k.jwk(kid)).collect();
    serde_json::json!({ "keys": keys }).to_string()
}

/// A JWKS served over https at `/jwks.json` by a certificate of its own CA (write
/// [`JwksServer::ca_file`] as the gateway's `jwks_ca`): the document can be replaced, and
/// the server stopped (its port then refuses).
pub struct JwksServer {
    pub port: u16,
    document: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
    pub ca_file: PathBuf,
}

impl JwksServer {
    pub async fn start(dir: &Path, document: String) -> JwksServer {
        let ca = Ca::new("jwks test CA");
        let leaf = ca.leaf(&["127.0.0.1"]);
        let ca_file = write_pem(dir, "jwks-ca.pem", &ca.pem());
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
                .collect::<Result<_, _>>()
                .expect("certificate");
        let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).expect("key");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let document = Arc::new(Mutex::new(document));
        let doc = document.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, doc) = (acceptor.clone(), doc.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let doc = doc.clone();
                        async move {
                            let resp = match req.uri().path() {
                                "/jwks.json" => {
                                    let body = doc.lock().unwrap().clone();
                                    http::Response::new(Full::new(Bytes::from(body)))
                                }
                                _ => http::Response::builder()
                                    .status(404)
                                    .body(Full::new(Bytes::new()))
                                    .unwrap(),
                            };
                            Ok::<_, std::convert::Infallible>(resp)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        JwksServer {
            port,
            document,
            task,
            ca_file,
        }
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}/jwks.json", self.port)
    }

    /// Serve `document` from now on.
    pub fn replace(&self, document: String) {
        *self.document.lock().unwrap() = document;
    }

    /// Stop accepting: the port refuses from now on.
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for JwksServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
