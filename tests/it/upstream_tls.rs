//! `[upstream] url = "https://…"`, end to end: the real `ratewall` binary (one worker, so
//! one pool) in front of an https upstream in the test process
//! (`common::tls_upstream`), with certificates made here.
//!
//! What is pinned: the backend's certificate is verified against `ca`, for the URL's host
//! or `sni` (which is also the SNI sent); a certificate that does not verify (an unknown
//! issuer, another name) is a 502 whose reason is in the log, never a request sent
//! without verification; kept-alive TLS connections are reused (one handshake for
//! sequential requests) and a new connection resumes the session; a client certificate
//! goes up when configured; `insecure_skip_verify` works only when asked, and says so
//! loudly at start.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::tls_upstream::{checksum, write_pem, Ca, ClientCerts, Leaf, TlsUpstream};
use common::{channel_body, toml_path, Gateway, HttpClient, Scrape, Store, Upstream};

const WAIT: Duration = Duration::from_secs(10);

/// Certificates written for one test, in their own folder.
struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Files {
        Files {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    /// `name` written with `text`, as a TOML string's contents.
    fn pem(&self, name: &str, text: &str) -> String {
        toml_path(&write_pem(self.dir.path(), name, text))
    }
}

/// The gateway in front of `url` with the `[upstream]` lines `extra` (one worker, the
/// memory store, no rules).
fn gateway(url: &str, extra: &str) -> Gateway {
    Gateway::start(&format!(
        "workers = 1\n[upstream]\nurl = \"{url}\"\nconnect_timeout = \"2s\"\ntimeout = \"5s\"\n{extra}\n{}",
        Store::Memory.toml()
    ))
}

async fn status(gw: &Gateway, path: &str) -> (u16, String) {
    let reply = HttpClient::new().get(&gw.url(path), &[]).await;
    (
        reply.status.as_u16(),
        String::from_utf8_lossy(&reply.body).into_owned(),
    )
}

/// The gateway's upstream TLS handshakes that are not zero, by `(result, reason)`.
async fn handshakes(gw: &Gateway) -> Vec<(String, String, u64)> {
    Scrape::take(&HttpClient::new(), gw)
        .await
        .nonzero2("ratewall_upstream_tls_handshakes_total", "result", "reason")
        .into_iter()
        .map(|((result, reason), n)| (result, reason, n))
        .collect()
}

fn counted(pairs: &[(&str, &str, u64)]) -> Vec<(String, String, u64)> {
    let mut v: Vec<_> = pairs
        .iter()
        .map(|(a, b, n)| (a.to_string(), b.to_string(), *n))
        .collect();
    v.sort();
    v
}

/// A backend with a certificate for `names` from a fresh CA; the CA's PEM path.
async fn backend(files: &Files, names: &[&str]) -> (TlsUpstream, String) {
    let ca = Ca::new("backend CA");
    let up = TlsUpstream::start(&ca.leaf(names), ClientCerts::None, None).await;
    (up, files.pem("backend-ca.pem", &ca.pem()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_backend_answers_and_its_tls_connection_is_kept() {
    let _watch = common::watchdog();
    let files = Files::new();
    let (up, ca) = backend(&files, &["localhost"]).await;
    let gw = gateway(
        &format!("https://localhost:{}", up.port()),
        &format!("ca = \"{ca}\""),
    );
    for _ in 0..5 {
        assert_eq!(
            status(&gw, "/x").await,
            (200, "tls ok".into()),
            "{}",
            gw.logs()
        );
    }
    assert_eq!(up.requests(), 5);
    assert_eq!(
        up.handshakes(),
        1,
        "one TLS connection, kept: {:?}",
        up.failed()
    );
    assert_eq!(up.sni(), vec![Some("localhost".to_string())]);
    assert_eq!(up.client_certs(), vec![None]);
    // A backend that offers h2 too is told HTTP/1.1, the one protocol spoken to it.
    assert_eq!(
        *up.seen.alpn.lock().unwrap(),
        vec![Some(b"http/1.1".to_vec())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_resumes_the_tls_session() {
    let _watch = common::watchdog();
    let files = Files::new();
    let (up, ca) = backend(&files, &["localhost"]).await;
    let gw = gateway(
        &format!("https://localhost:{}", up.port()),
        &format!("ca = \"{ca}\""),
    );
    // Every series at zero from the start.
    let scrape = Scrape::take(&HttpClient::new(), &gw).await;
    let family = scrape.family("ratewall_upstream_tls_handshakes_total");
    assert_eq!(family.len(), 11, "{family:?}");
    assert!(family.values().all(|n| *n == 0.0), "{family:?}");
    for reason in [
        "unknown_issuer",
        "name_mismatch",
        "expired",
        "alert",
        "closed",
    ] {
        let labels = [("result", "failed"), ("reason", reason)];
        assert_eq!(
            scrape.find("ratewall_upstream_tls_handshakes_total", &labels),
            Some(0.0)
        );
    }
    // The first connection makes a full handshake.
    assert_eq!(status(&gw, "/close").await.0, 200, "{}", gw.logs());
    assert_eq!(handshakes(&gw).await, counted(&[("ok", "none", 1)]));
    // Each answer closes its connection: the next request needs a new one.
    for _ in 0..2 {
        assert_eq!(status(&gw, "/close").await.0, 200, "{}", gw.logs());
    }
    assert_eq!(up.handshakes(), 3);
    assert!(
        up.resumed() >= 1,
        "later connections resume the session: {} of 3 resumed",
        up.resumed()
    );
    // The gateway counts what the backend saw: full ones and resumed ones.
    let resumed = up.resumed() as u64;
    let mut want = vec![("resumed", "none", resumed)];
    if resumed < 3 {
        want.push(("ok", "none", 3 - resumed));
    }
    assert_eq!(handshakes(&gw).await, counted(&want));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_upstream_has_no_tls_handshake_series() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream.url(), "");
    assert_eq!(status(&gw, "/x").await.0, 200);
    let scrape = Scrape::take(&HttpClient::new(), &gw).await;
    let family = scrape.family("ratewall_upstream_tls_handshakes_total");
    assert!(family.is_empty(), "{family:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_an_unknown_issuer_is_a_502_with_the_reason_logged() {
    let _watch = common::watchdog();
    let files = Files::new();
    let (up, _) = backend(&files, &["localhost"]).await;
    // The gateway trusts another CA.
    let other = files.pem("other-ca.pem", &Ca::new("another CA").pem());
    let gw = gateway(
        &format!("https://localhost:{}", up.port()),
        &format!("ca = \"{other}\""),
    );
    let reply = HttpClient::new().get(&gw.url("/x"), &[]).await;
    assert_eq!(reply.status.as_u16(), 502);
    assert_eq!(
        reply.json()["detail"],
        "the upstream's TLS certificate could not be verified"
    );
    assert_eq!(up.requests(), 0, "nothing goes up unverified");
    assert!(
        gw.wait_for_log("UnknownIssuer", 1, WAIT),
        "the reason is logged:\n{}",
        gw.logs()
    );
    // Never a fallback: the next request fails the same way.
    assert_eq!(status(&gw, "/y").await.0, 502);
    assert_eq!(up.requests(), 0);
    // Each request opened a connection whose handshake failed, and says why.
    assert_eq!(
        handshakes(&gw).await,
        counted(&[("failed", "unknown_issuer", 2)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_name_is_a_502() {
    let _watch = common::watchdog();
    let files = Files::new();
    let (up, ca) = backend(&files, &["other.test"]).await;
    let gw = gateway(
        &format!("https://localhost:{}", up.port()),
        &format!("ca = \"{ca}\""),
    );
    assert_eq!(status(&gw, "/x").await.0, 502);
    assert_eq!(up.requests(), 0);
    assert!(
        gw.wait_for_log("certificate not valid for name \"localhost\"", 1, WAIT),
        "the reason is logged:\n{}",
        gw.logs()
    );
    assert_eq!(
        handshakes(&gw).await,
        counted(&[("failed", "name_mismatch", 1)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sni_names_the_backend_where_the_url_has_an_address() {
    let _watch = common::watchdog();
    let files = Files::new();
    let (up, ca) = backend(&files, &["backend.test"]).await;
    let gw = gateway(
        &format!("https://127.0.0.1:{}", up.port()),
        &format!("ca = \"{ca}\"\nsni = \"backend.test\""),
    );
    assert_eq!(
        status(&gw, "/x").await,
        (200, "tls ok".into()),
        "{}",
        gw.logs()
    );
    assert_eq!(up.sni(), vec![Some("backend.test".to_string())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_goes_up_when_configured() {
    let _watch = common::watchdog();
    let files = Files::new();
    let server_ca = Ca::new("backend CA");
    let client_ca = Ca::new("client CA");
    let client: Leaf = client_ca.leaf(&["gateway.test"]);
    let up = TlsUpstream::start(
        &server_ca.leaf(&["localhost"]),
        ClientCerts::Required,
        Some(&client_ca),
    )
    .await;
    let ca = files.pem("backend-ca.pem", &server_ca.pem());
    let url = format!("https://localhost:{}", up.port());

    // Without one, a backend that requires it refuses the handshake: 502.
    let without = gateway(&url, &format!("ca = \"{ca}\""));
    assert_eq!(status(&without, "/x").await.0, 502);
    assert_eq!(up.requests(), 0);
    // TLS 1.3: our side of the handshake is done before the backend has checked our
    // (empty) certificate; its refusal arrives with the first read, as a failed request.
    assert_eq!(handshakes(&without).await, counted(&[("ok", "none", 1)]));
    drop(without);

    let gw = gateway(
        &url,
        &format!(
            "ca = \"{ca}\"\ncert = \"{}\"\nkey = \"{}\"",
            files.pem("client.pem", &client.cert),
            files.pem("client-key.pem", &client.key)
        ),
    );
    assert_eq!(
        status(&gw, "/x").await,
        (200, "tls ok".into()),
        "{}",
        gw.logs()
    );
    let presented = up.client_certs();
    let last = presented
        .last()
        .cloned()
        .flatten()
        .expect("a client certificate");
    let expected = rustls::pki_types::pem::PemObject::from_pem_slice(client.cert.as_bytes())
        .map(|c: rustls::pki_types::CertificateDer<'static>| c.to_vec())
        .expect("PEM");
    assert_eq!(last, expected, "the configured certificate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insecure_skip_verify_takes_any_certificate_and_says_so_loudly() {
    let _watch = common::watchdog();
    let files = Files::new();
    let (up, _) = backend(&files, &["not-this-name.test"]).await;
    let gw = gateway(
        &format!("https://localhost:{}", up.port()),
        "insecure_skip_verify = true",
    );
    let logs = gw.logs();
    let warning = logs
        .lines()
        .find(|l| l.contains("insecure_skip_verify"))
        .unwrap_or_else(|| panic!("a warning at start:\n{logs}"));
    assert!(
        warning.contains("WARN") && warning.contains("NOT verified"),
        "{warning}"
    );
    assert_eq!(status(&gw, "/x").await, (200, "tls ok".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_go_up_over_tls_whole_and_the_connection_is_kept() {
    let _watch = common::watchdog();
    let files = Files::new();
    let (up, ca) = backend(&files, &["localhost"]).await;
    let gw = gateway(
        &format!("https://localhost:{}", up.port()),
        &format!("ca = \"{ca}\""),
    );
    let client = HttpClient::new();
    // With a length, then chunked (streamed in pieces), each larger than a TLS record.
    let body: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let expected = format!("tls ok, {} bytes, sum {}", body.len(), checksum(&body));
    let reply = client
        .send("POST", &gw.url("/up"), &[], Bytes::from(body.clone()))
        .await;
    assert_eq!(reply.status.as_u16(), 200, "{}", gw.logs());
    assert_eq!(String::from_utf8_lossy(&reply.body), expected);

    let (tx, streamed) = channel_body();
    let sending = tokio::spawn({
        let body = body.clone();
        async move {
            for piece in body.chunks(7_000) {
                assert!(tx.send(Bytes::copy_from_slice(piece)).await);
            }
        }
    });
    let reply = client
        .try_send("POST", &gw.url("/up"), &[], streamed, WAIT)
        .await
        .expect("an answer");
    sending.await.unwrap();
    assert_eq!(reply.status.as_u16(), 200, "{}", gw.logs());
    assert_eq!(String::from_utf8_lossy(&reply.body), expected);
    assert_eq!(status(&gw, "/after").await.0, 200);
    assert_eq!(up.requests(), 3);
    assert_eq!(
        up.handshakes(),
        1,
        "the split connection came back whole to the pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_override_of_an_http_file_is_verified_against_the_system_roots() {
    let _watch = common::watchdog();
    let files = Files::new();
    let (up, _) = backend(&files, &["localhost"]).await;
    let url = format!("https://localhost:{}", up.port());
    let gw = Gateway::start_with(
        &format!(
            "workers = 1\n[upstream]\nurl = \"http://127.0.0.1:1\"\n{}",
            Store::Memory.toml()
        ),
        &["--upstream", &url],
        &[],
    );
    // The harness's CA is in no system store.
    assert_eq!(status(&gw, "/x").await.0, 502);
    assert_eq!(up.requests(), 0);
    assert!(
        gw.wait_for_log("UnknownIssuer", 1, WAIT),
        "verified, and refused:\n{}",
        gw.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_reads_the_ca_again_and_a_missing_one_keeps_the_old() {
    let _watch = common::watchdog();
    let files = Files::new();
    let (up, ca) = backend(&files, &["localhost"]).await;
    let other = files.pem("other-ca.pem", &Ca::new("another CA").pem());
    let body = |ca: &str| {
        format!(
            "workers = 1\n[upstream]\nurl = \"https://localhost:{}\"\nca = \"{ca}\"\n{}",
            up.port(),
            Store::Memory.toml()
        )
    };
    let gw = Gateway::start(&body(&other));
    assert_eq!(status(&gw, "/x").await.0, 502);

    gw.rewrite_config(&body(&ca));
    tokio::task::block_in_place(|| gw.reload(1));
    assert_eq!(
        status(&gw, "/x").await,
        (200, "tls ok".into()),
        "{}",
        gw.logs()
    );

    // A CA file that is gone: the reload is refused, naming it, and the old one serves,
    // on the connection it kept. (Counted from here: on a loaded machine the first
    // request's connection may have taken a retry.)
    let before = up.handshakes();
    gw.rewrite_config(&body(&toml_path(&files.dir.path().join("gone.pem"))));
    gw.signal("HUP");
    assert!(
        gw.wait_for_log("config reload rejected", 1, WAIT),
        "{}",
        gw.logs()
    );
    assert!(
        gw.logs().contains("upstream.ca: cannot read"),
        "{}",
        gw.logs()
    );
    assert_eq!(status(&gw, "/y").await.0, 200);
    assert_eq!(
        up.handshakes(),
        before,
        "the pool kept across the rejected reload"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_tls_connection_the_backend_closed_is_not_used_again() {
    let _watch = common::watchdog();
    let files = Files::new();
    let ca = Ca::new("backend CA");
    let up = TlsUpstream::start_with(
        &ca.leaf(&["localhost"]),
        ClientCerts::None,
        None,
        Some(Duration::from_millis(200)),
    )
    .await;
    let gw = gateway(
        &format!("https://localhost:{}", up.port()),
        &format!("ca = \"{}\"", files.pem("ca.pem", &ca.pem())),
    );
    assert_eq!(status(&gw, "/x").await.0, 200);
    // The backend closes the idle connection; the next request gets a new one, not a 502.
    assert!(
        up.wait_ended(1).await,
        "the backend never closed the idle connection"
    );
    assert_eq!(
        status(&gw, "/y").await,
        (200, "tls ok".into()),
        "{}",
        gw.logs()
    );
    assert_eq!(up.handshakes(), 2);
    assert_eq!(up.requests(), 2);
}
