//! The TLS listener (`[server.tls]`) against the real binary: certificates made by the
//! harness's throw-away CA, a rustls client and curl.

use crate::common;

use std::time::Duration;

use common::*;

/// A gateway with a TLS listener on `tls_port` presenting `certs` (the first the
/// default), forwarding to `upstream`, with `extra` lines in `[server.tls]` and `rules`.
fn tls_gateway(
    certs: &[(std::path::PathBuf, std::path::PathBuf)],
    extra: &str,
    upstream: &Upstream,
    rules: &str,
) -> (Gateway, u16) {
    start_on_free_tls_port(|port| {
        format!(
            "{}{}{rules}",
            tls_table(port, certs, extra),
            upstream_and_store(&upstream.url(), &Store::Memory)
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sni_picks_the_certificate_and_the_first_is_the_default() {
    let _watch = common::watchdog();
    let pki = Pki::new("sni");
    let a = pki.server_cert("a", &["a.test"], 90);
    let b = pki.server_cert("b", &["*.b.test"], 90);
    let upstream = Upstream::start().await;
    let (gw, port) = tls_gateway(&[a.clone(), b.clone()], "", &upstream, "");
    let roots = [pki.ca_der()];
    let http1 = client_config(&roots, &[b"http/1.1"], None);
    let r = tls_get(port, "x.b.test", http1.clone(), "/hello", &[])
        .await
        .expect("x.b.test");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.server_cert,
        cert_der(&b.0),
        "the wildcard certificate for x.b.test"
    );
    let r = tls_get(port, "a.test", http1.clone(), "/", &[])
        .await
        .expect("a.test");
    assert_eq!(r.server_cert, cert_der(&a.0));
    // A name no certificate covers gets the default (and the client, rightly, refuses it).
    let e = tls_get(port, "c.test", http1, "/", &[]).await.unwrap_err();
    assert!(e.contains("handshake"), "{e}");
    // The status page lists both, by file name, with their names and expiry.
    let status = HttpClient::new()
        .get(&gw.admin_url("/status.json"), &[])
        .await
        .json();
    let certs = status["certificates"].as_array().expect("certificates");
    assert_eq!(certs.len(), 2, "{status}");
    assert_eq!(certs[0]["file"], "a.pem");
    assert_eq!(certs[0]["default"], true);
    assert_eq!(certs[1]["names"], serde_json::json!(["*.b.test"]));
    assert_eq!(certs[1]["state"], "valid");
    let left = certs[1]["expires_in_s"].as_i64().unwrap();
    assert!((89 * 86_400..=90 * 86_400).contains(&left), "{left}");
    assert!(
        !status
            .to_string()
            .contains(&pki.dir.path().display().to_string()),
        "no folder"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alpn_gives_http2_and_the_upstream_learns_the_scheme() {
    let _watch = common::watchdog();
    let pki = Pki::new("alpn");
    let cert = pki.server_cert("gw", &["gw.test"], 90);
    let upstream = Upstream::start().await;
    let (gw, port) = tls_gateway(&[cert], "", &upstream, "");
    let roots = [pki.ca_der()];
    let h2 = client_config(&roots, &[b"h2", b"http/1.1"], None);
    let r = tls_get(port, "gw.test", h2, "/two", &[]).await.expect("h2");
    assert_eq!(r.status, 200);
    assert_eq!(r.alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!(r.version, Some(rustls::ProtocolVersion::TLSv1_3));
    let h1 = client_config(&roots, &[b"http/1.1"], None);
    let r = tls_get(
        port,
        "gw.test",
        h1,
        "/one",
        &[("x-forwarded-proto", "http")],
    )
    .await
    .expect("http/1.1");
    assert_eq!(r.status, 200);
    assert_eq!(r.alpn.as_deref(), Some(&b"http/1.1"[..]));
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        assert_eq!(s.headers["x-forwarded-proto"], "https", "{}", s.path);
        let fwd = s.headers["forwarded"].to_str().unwrap();
        assert!(fwd.ends_with("proto=https"), "{fwd}");
    }
    // The access log and the metrics name the protocol and the TLS version.
    let logs = gw.logs();
    assert!(
        logs.contains(r#"path=/two protocol="HTTP/2" tls="TLSv1.3""#),
        "{logs}"
    );
    assert!(
        logs.contains(r#"path=/one protocol="HTTP/1.1" tls="TLSv1.3""#),
        "{logs}"
    );
    for (protocol, alpn) in [("HTTP/2", "h2"), ("HTTP/1.1", "http/1.1")] {
        let labels = [("protocol", protocol), ("tls", "TLSv1.3")];
        assert_eq!(
            metric(&gw, "ratewall_client_requests_total", &labels).await,
            1.0
        );
        let labels = [("version", "TLSv1.3"), ("alpn", alpn)];
        assert_eq!(
            metric(&gw, "ratewall_tls_connections_total", &labels).await,
            1.0
        );
    }
    assert_eq!(
        metric(&gw, "ratewall_tls_handshakes_total", &[("result", "ok")]).await,
        2.0
    );
    let expiry = metric(&gw, "ratewall_tls_certificate_expiry_seconds", &[]).await;
    assert!(
        (89.0 * 86_400.0..=90.0 * 86_400.0).contains(&expiry),
        "{expiry}"
    );
}

/// TLS 1.2 is spoken too (rustls' safe suites), for clients that have nothing newer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls12_clients_are_served() {
    let _watch = common::watchdog();
    let pki = Pki::new("v12");
    let cert = pki.server_cert("gw", &["gw.test"], 90);
    let upstream = Upstream::start().await;
    let (_gw, port) = tls_gateway(&[cert], "", &upstream, "");
    let mut store = rustls::RootCertStore::empty();
    store.add(pki.ca_der()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS12])
    .unwrap()
    .with_root_certificates(store)
    .with_no_client_auth();
    let r = tls_get(port, "gw.test", std::sync::Arc::new(config), "/", &[])
        .await
        .expect("TLS 1.2");
    assert_eq!(r.status, 200);
    assert_eq!(r.version, Some(rustls::ProtocolVersion::TLSv1_2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_speaks_http2_over_tls() {
    let _watch = common::watchdog();
    let pki = Pki::new("curl");
    let cert = pki.server_cert("gw", &["localhost"], 90);
    let upstream = Upstream::start().await;
    let (_gw, port) = tls_gateway(&[cert], "", &upstream, "");
    let out = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "--http2",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{http_version}",
        ])
        .arg("--cacert")
        .arg(&pki.ca_pem)
        .arg(format!("https://localhost:{port}/x"))
        .output()
        .await
        .expect("run curl (./scripts/test installs it, or: apt-get install curl)");
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        said,
        "200 2",
        "curl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A client that opens a connection and stalls in the handshake is closed at
/// header_timeout, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_handshake_is_closed_at_header_timeout() {
    let _watch = common::watchdog();
    let pki = Pki::new("stall");
    let cert = pki.server_cert("gw", &["gw.test"], 90);
    let upstream = Upstream::start().await;
    let (gw, port) = start_on_free_tls_port(|port| {
        format!(
            "header_timeout = \"1s\"\n{}{}",
            tls_table(port, std::slice::from_ref(&cert), ""),
            upstream_and_store(&upstream.url(), &Store::Memory)
        )
    });
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    // The first bytes of a ClientHello record, then nothing.
    use tokio::io::AsyncWriteExt;
    stream
        .write_all(&[0x16, 0x03, 0x01, 0x01, 0x00, 0x01])
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let (_, closed) = until_closed(&mut stream).await;
    // Closed (within WAIT), not before header_timeout; by it, as counted below.
    let took = closed.unwrap_or_else(|| panic!("not closed after {:?}", started.elapsed()));
    assert!(took >= Duration::from_millis(800), "closed after {took:?}");
    // Counted as the handshake's task ends, which may be a moment after the socket closed.
    let mut counted = 0.0;
    for _ in 0..100 {
        counted = metric(
            &gw,
            "ratewall_tls_handshakes_total",
            &[("result", "timeout")],
        )
        .await;
        if counted > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(counted, 1.0);
}

/// Certificates rotate on SIGHUP while clients keep connecting: every request of the load
/// succeeds, and connections after the reload get the new certificate. A bad file on a
/// later SIGHUP is refused with its reason, and the new certificate keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rotates_certificates_under_load_and_a_bad_file_keeps_the_old() {
    let _watch = common::watchdog();
    let pki = Pki::new("rotate");
    let old = pki.server_cert("old", &["gw.test"], 90);
    let upstream = Upstream::start().await;
    let body = |port: u16, certs: &[(std::path::PathBuf, std::path::PathBuf)]| {
        format!(
            "{}{}",
            tls_table(port, certs, ""),
            upstream_and_store(&upstream.url(), &Store::Memory)
        )
    };
    // The config names fixed file names; rotation replaces their contents.
    let (cert, key) = (pki.path("live.pem"), pki.path("live-key.pem"));
    std::fs::copy(&old.0, &cert).unwrap();
    std::fs::copy(&old.1, &key).unwrap();
    let live = (cert.clone(), key.clone());
    let (gw, port) = start_on_free_tls_port(|port| body(port, std::slice::from_ref(&live)));
    let config = client_config(&[pki.ca_der()], &[b"h2", b"http/1.1"], None);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let load: Vec<_> = (0..4)
        .map(|_| {
            let (config, stop, done) = (config.clone(), stop.clone(), done.clone());
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0u32, Vec::new());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match tls_get(port, "gw.test", config.clone(), "/", &[]).await {
                        Ok(r) if r.status == 200 => ok += 1,
                        Ok(r) => failed.push(format!("status {}", r.status)),
                        Err(e) => failed.push(e),
                    }
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                (ok, failed)
            })
        })
        .collect();
    // Until the load has made `n` more requests.
    let more = |n: usize| {
        let done = done.clone();
        async move {
            let from = done.load(std::sync::atomic::Ordering::Relaxed);
            let end = std::time::Instant::now() + Duration::from_secs(20);
            while done.load(std::sync::atomic::Ordering::Relaxed) < from + n {
                assert!(std::time::Instant::now() < end, "the load stalled");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    more(8).await;
    let new = pki.server_cert("new", &["gw.test"], 60);
    // The key first would leave a moment where the pair does not match: a reload then
    // would be refused, and the old pair keep serving. Both in place, then SIGHUP.
    std::fs::copy(&new.0, &cert).unwrap();
    std::fs::copy(&new.1, &key).unwrap();
    gw.reload(1);
    more(8).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for l in load {
        let (ok, failed) = l.await.unwrap();
        assert!(failed.is_empty(), "failed during rotation: {failed:?}");
        total += ok;
    }
    assert!(total > 10, "only {total} requests under load");
    // A client of its own: a resumed session would name the certificate of its first.
    let fresh = || client_config(&[pki.ca_der()], &[b"http/1.1"], None);
    let r = tls_get(port, "gw.test", fresh(), "/", &[]).await.unwrap();
    assert_eq!(
        r.server_cert,
        cert_der(&new.0),
        "the new certificate after SIGHUP"
    );
    assert!(
        gw.logs().contains("server.tls.certificates"),
        "{}",
        gw.logs()
    );

    // A key that does not match the certificate: refused, the new pair keeps serving.
    std::fs::copy(&old.1, &key).unwrap();
    gw.signal("HUP");
    assert!(
        gw.wait_for_log("config reload rejected", 1, Duration::from_secs(10)),
        "{}",
        gw.logs()
    );
    assert!(
        gw.logs().contains("the key does not match the certificate"),
        "{}",
        gw.logs()
    );
    let r = tls_get(port, "gw.test", fresh(), "/", &[]).await.unwrap();
    assert_eq!(r.server_cert, cert_der(&new.0));
    // A missing file: the same.
    std::fs::remove_file(&cert).unwrap();
    gw.signal("HUP");
    assert!(
        gw.wait_for_log("config reload rejected", 2, Duration::from_secs(10)),
        "{}",
        gw.logs()
    );
    let r = tls_get(port, "gw.test", config, "/", &[]).await.unwrap();
    assert_eq!(r.status, 200);
}

/// `ratewall check` on a config with `[server.tls]`.
fn check(body: &str) -> (bool, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("limits.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nlisten = \"127.0.0.1:1\"\n{body}[upstream]\nurl = \"http://127.0.0.1:2\"\n"
        ),
    )
    .unwrap();
    let out = std::process::Command::new(binary())
        .arg("check")
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_shows_certificates_and_their_expiry_and_warns_within_14_days() {
    let _watch = common::watchdog();
    let pki = Pki::new("check");
    let long = pki.server_cert("long", &["a.test", "*.a.test"], 90);
    let short = pki.server_cert("short", &["b.test"], 5);
    let (ok, out, err) = check(&tls_table(8443, &[long.clone(), short.clone()], ""));
    assert!(ok, "{out}{err}");
    assert!(out.contains("tls           listen 127.0.0.1:8443"), "{out}");
    assert!(
        out.contains(&format!(
            "{} (default): a.test, *.a.test; expires ",
            long.0.display()
        )),
        "{out}"
    );
    assert!(
        out.contains("(in 89 days)") || out.contains("(in 90 days)"),
        "{out}"
    );
    assert!(
        err.contains(&format!(
            "warning: certificate {} expires within 14 days",
            short.0.display()
        )),
        "{err}"
    );
    assert!(!err.contains(&long.0.display().to_string()), "{err}");
}

#[test]
fn check_refuses_unreadable_files_and_mismatched_keys() {
    let _watch = common::watchdog();
    let pki = Pki::new("bad");
    let a = pki.server_cert("a", &["a.test"], 90);
    let b = pki.server_cert("b", &["b.test"], 90);
    let (ok, _, err) = check(&tls_table(8443, &[(a.0.clone(), b.1.clone())], ""));
    assert!(!ok);
    assert!(err.contains("server.tls.certificates[0]"), "{err}");
    assert!(
        err.contains("the key does not match the certificate"),
        "{err}"
    );
    let missing = pki.path("nope.pem");
    let (ok, _, err) = check(&tls_table(8443, &[a.clone(), (missing, a.1.clone())], ""));
    assert!(!ok);
    assert!(err.contains("server.tls.certificates[1]"), "{err}");
    assert!(err.contains("cannot read"), "{err}");
    // A key file holding a certificate, not a key.
    let (ok, _, err) = check(&tls_table(8443, &[(a.0.clone(), a.0.clone())], ""));
    assert!(!ok);
    assert!(err.contains("no private key"), "{err}");
    let (ok, _, err) = check(&tls_table(8443, &[a], "client_auth = \"optional\"\n"));
    assert!(!ok);
    assert!(err.contains("client_auth needs client_ca"), "{err}");
}

/// mTLS with `client_auth = "required"`: a client without a certificate, or with one
/// from another CA, fails the handshake; with `key = "client_cert"` each certificate has
/// its own exact count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_client_certificates_are_each_limited_exactly() {
    let _watch = common::watchdog();
    let pki = Pki::new("mtls");
    let clients = Pki::new("clients");
    let strangers = Pki::new("strangers");
    let cert = pki.server_cert("gw", &["gw.test"], 90);
    let upstream = Upstream::start().await;
    let extra = format!("client_ca = \"{}\"\n", toml_path(&clients.ca_pem));
    let token = "tls-admin-token-0123456789abcdef";
    let (gw, port) = tls_gateway(
        &[cert],
        &extra,
        &upstream,
        &format!(
            "[admin]\ntoken = \"{token}\"\n{}",
            exact_rule("per-cert", "client_cert", "token_bucket", 3)
        ),
    );
    let roots = [pki.ca_der()];
    let (alice, bob) = (clients.client_cert("alice"), clients.client_cert("bob"));
    for (who, id) in [("alice", &alice), ("bob", &bob)] {
        let config = client_config(&roots, &[b"h2", b"http/1.1"], Some(id.clone()));
        let mut statuses = Vec::new();
        for _ in 0..5 {
            let r = tls_get(port, "gw.test", config.clone(), "/", &[])
                .await
                .expect(who);
            statuses.push(r.status.as_u16());
        }
        assert_eq!(statuses, [200, 200, 200, 429, 429], "{who}");
    }
    // No certificate, or one this CA did not sign: no connection at all. (TLS 1.3: the
    // server's refusal arrives after the client's handshake is done, with the first read.)
    for (what, id) in [
        ("none", None),
        ("stranger", Some(strangers.client_cert("eve"))),
    ] {
        let config = client_config(&roots, &[b"http/1.1"], id);
        let r = tls_get(port, "gw.test", config, "/", &[]).await;
        assert!(r.is_err(), "{what}: {r:?}");
    }
    assert_eq!(upstream.seen().len(), 6);
    assert!(
        metric(
            &gw,
            "ratewall_tls_handshakes_total",
            &[("result", "failed")]
        )
        .await
            >= 2.0
    );
    // The fingerprint never reaches the log.
    let fp: String = sha2_hex(&alice.chain[0]);
    assert!(!gw.logs().contains(&fp), "the raw fingerprint in the log");
    // The admin API finds a certificate's state by its fingerprint, as openssl prints it.
    let colons: Vec<String> = fp
        .as_bytes()
        .chunks(2)
        .map(|p| String::from_utf8_lossy(p).to_uppercase())
        .collect();
    let bearer = format!("Bearer {token}");
    let auth = [("authorization", bearer.as_str())];
    let state = HttpClient::new()
        .get(
            &gw.admin_url(&format!(
                "/admin/state?rule=per-cert&cert={}",
                colons.join(":")
            )),
            &auth,
        )
        .await;
    assert_eq!(state.status, 200, "{:?}", state.body);
    assert_eq!(state.json()["remaining"], 0, "{}", state.json());
    let state = HttpClient::new()
        .get(&gw.admin_url("/admin/state?rule=per-cert&cert=zz"), &auth)
        .await;
    assert_eq!(state.status, 400);
}

/// `client_auth = "optional"`: a client without a certificate is served, and the
/// `client_cert` rule applies its `missing_key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_client_certificates_fall_back_to_missing_key() {
    let _watch = common::watchdog();
    let pki = Pki::new("opt");
    let cert = pki.server_cert("gw", &["gw.test"], 90);
    let upstream = Upstream::start().await;
    let extra = format!(
        "client_ca = \"{}\"\nclient_auth = \"optional\"\n",
        toml_path(&pki.ca_pem)
    );
    let rules = "[[rules]]\nname = \"certs\"\nkey = \"client_cert\"\nrate = \"1/h\"\nburst = 2\nmatch = { path_prefix = \"/x\" }\n\
                 [[rules]]\nname = \"lenient\"\nkey = \"client_cert\"\nmissing_key = \"client_ip\"\nrate = \"1/h\"\nburst = 1\nmatch = { path_prefix = \"/lenient\" }\n";
    let (_gw, port) = tls_gateway(&[cert], &extra, &upstream, rules);
    let roots = [pki.ca_der()];
    let anonymous = client_config(&roots, &[b"http/1.1"], None);
    // The first rule (missing_key = "reject" by default) refuses a client without one.
    let r = tls_get(port, "gw.test", anonymous.clone(), "/x", &[])
        .await
        .unwrap();
    assert_eq!(r.status, 401);
    assert!(String::from_utf8_lossy(&r.body).contains("client certificate"));
    let with = client_config(&roots, &[b"http/1.1"], Some(pki.client_cert("carol")));
    let statuses: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(
                tls_get(port, "gw.test", with.clone(), "/x", &[])
                    .await
                    .unwrap()
                    .status
                    .as_u16(),
            );
        }
        v
    };
    assert_eq!(statuses, [200, 200, 429]);
    // missing_key = "client_ip": counted by address instead.
    for want in [200, 429] {
        let r = tls_get(port, "gw.test", anonymous.clone(), "/lenient", &[])
            .await
            .unwrap();
        assert_eq!(r.status, want);
    }
}

/// `(result, reason) -> count` pairs, as a map to compare with a scrape's.
fn counts(pairs: &[((&str, &str), u64)]) -> std::collections::BTreeMap<(String, String), u64> {
    pairs
        .iter()
        .map(|((a, b), n)| ((a.to_string(), b.to_string()), *n))
        .collect()
}

/// The non-zero handshake counts of the TLS listener by `(result, reason)`, once they are
/// `want` (each is counted as its connection's task ends, a moment after the client saw
/// it), or as they stand after 5 s.
async fn handshakes_become(
    gw: &Gateway,
    want: &[((&str, &str), u64)],
) -> std::collections::BTreeMap<(String, String), u64> {
    let want = counts(want);
    let client = HttpClient::new();
    let mut seen = Default::default();
    for _ in 0..250 {
        seen = Scrape::take(&client, gw).await.nonzero2(
            "ratewall_tls_handshakes_total",
            "result",
            "reason",
        );
        if seen == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    seen
}

/// A refused handshake is counted with its reason: bytes that are not TLS, a client
/// without the certificate mTLS requires, a client that does not trust our certificate
/// (rustls sends an `unknown_ca` alert and hangs up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_handshakes_are_counted_by_reason() {
    let _watch = common::watchdog();
    let pki = Pki::new("refused");
    let cert = pki.server_cert("gw", &["gw.test"], 90);
    let upstream = Upstream::start().await;
    let extra = format!(
        "client_ca = \"{}\"\nclient_auth = \"required\"\n",
        toml_path(&pki.ca_pem)
    );
    let (gw, port) = tls_gateway(&[cert], &extra, &upstream, "");
    // Every series at zero from the start.
    let scrape = Scrape::take(&HttpClient::new(), &gw).await;
    let name = "ratewall_tls_handshakes_total";
    for reason in [
        "protocol",
        "client_certificate",
        "not_tls",
        "alert",
        "other",
    ] {
        let labels = [("result", "failed"), ("reason", reason)];
        assert_eq!(scrape.find(name, &labels), Some(0.0), "{reason}");
    }
    for result in ["ok", "timeout", "closed", "shutdown"] {
        let labels = [("result", result), ("reason", "none")];
        assert_eq!(scrape.find(name, &labels), Some(0.0), "{result}");
    }

    // Plain HTTP to the TLS port: a 400 that says why (as nginx answers "The plain HTTP
    // request was sent to HTTPS port"), then closed; nothing forwarded.
    let (reply, closed) = raw_until_closed(
        port,
        b"GET / HTTP/1.1\r\nHost: gw.test\r\nx-api-key: k\r\n\r\n",
    )
    .await;
    assert!(closed.is_some(), "closed: {reply:?}");
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        reply.starts_with("HTTP/1.1 400 Bad Request\r\n"),
        "{reply:?}"
    );
    assert!(
        reply
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{reply:?}"
    );
    assert!(
        reply.contains("\r\ncontent-type: application/problem+json\r\n"),
        "{reply:?}"
    );
    let body = reply.split("\r\n\r\n").nth(1).unwrap_or_default();
    let problem: serde_json::Value = serde_json::from_str(body).expect("a problem+json body");
    assert_eq!(problem["status"], 400, "{reply:?}");
    assert_eq!(
        problem["detail"],
        "this port speaks TLS: send the request as https"
    );
    assert_eq!(
        upstream.arrived(),
        0,
        "plain HTTP on the TLS port reached the upstream"
    );
    let mut want = vec![(("failed", "not_tls"), 1)];
    assert_eq!(handshakes_become(&gw, &want).await, counts(&want));

    // No client certificate (TLS 1.3: the refusal comes with the client's first read).
    let roots = [pki.ca_der()];
    let anonymous = client_config(&roots, &[b"http/1.1"], None);
    let r = tls_get(port, "gw.test", anonymous, "/", &[]).await;
    assert!(r.is_err(), "{r:?}");
    want.push((("failed", "client_certificate"), 1));
    assert_eq!(handshakes_become(&gw, &want).await, counts(&want));

    // A client that trusts another CA refuses our certificate with an alert.
    let stranger = Pki::new("stranger");
    let config = client_config(&[stranger.ca_der()], &[b"http/1.1"], None);
    let e = handshake(port, "gw.test", config)
        .await
        .expect_err("our certificate is not trusted");
    assert!(e.to_string().contains("UnknownIssuer"), "{e}");
    want.push((("failed", "alert"), 1));
    assert_eq!(handshakes_become(&gw, &want).await, counts(&want));

    // One let in: ok, reason none.
    let alice = client_config(&roots, &[b"http/1.1"], Some(pki.client_cert("alice")));
    let r = tls_get(port, "gw.test", alice, "/", &[]).await.unwrap();
    assert_eq!(r.status, 200);
    want.push((("ok", "none"), 1));
    assert_eq!(handshakes_become(&gw, &want).await, counts(&want));
    assert_eq!(upstream.seen().len(), 1);
}

fn sha2_hex(der: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(der)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn client_cert_rules_need_client_certificates() {
    let _watch = common::watchdog();
    let pki = Pki::new("norules");
    let cert = pki.server_cert("gw", &["gw.test"], 90);
    let (ok, _, err) = check(&format!(
        "{}{}",
        tls_table(8443, &[cert], ""),
        exact_rule("c", "client_cert", "gcra", 1)
    ));
    assert!(!ok);
    assert!(err.contains("needs client certificates"), "{err}");
}

/// The status page, rendered by headless Chromium, lists the certificates with their
/// expiry, the one expiring within 14 days flagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_certificates_and_flags_one_expiring_soon() {
    let _watch = common::watchdog();
    let pki = Pki::new("page");
    let long = pki.server_cert("long", &["a.test"], 90);
    let short = pki.server_cert("short", &["b.test"], 5);
    let upstream = Upstream::start().await;
    let (gw, _) = tls_gateway(&[long, short], "", &upstream, "");
    // Chromium is required, not optional: `common::chromium` fails the test, saying how
    // to install it, where there is none (./scripts/test installs it).
    let dom = common::dump_dom(&gw.admin_url("/")).await;
    let at = dom
        .find("id=\"certificates\"")
        .expect("the certificates section");
    let section = &dom[at..at + dom[at..].find("</section>").unwrap()];
    assert!(!section.contains("TLS is not configured"), "{section}");
    assert!(section.contains("<code>long.pem</code>"), "{section}");
    assert!(section.contains("<code>short.pem</code>"), "{section}");
    assert!(section.contains("data-state=\"expiring\""), "{section}");
    assert_eq!(
        section.matches("data-state=\"valid\"").count(),
        1,
        "{section}"
    );
    assert!(
        section.contains("a.test") && section.contains("b.test"),
        "{section}"
    );
}

/// `redirect_https = true`: the cleartext listener answers every request with a 308 to
/// the same path and query on the TLS listener, and forwards nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirect_https_sends_cleartext_clients_to_the_tls_listener() {
    let _watch = common::watchdog();
    let pki = Pki::new("redirect");
    let cert = pki.server_cert("gw", &["gw.test"], 90);
    let upstream = Upstream::start().await;
    let (gw, port) = tls_gateway(&[cert], "redirect_https = true\n", &upstream, "");
    let r = raw_exchange(
        gw.port,
        b"POST /a/b?x=1 HTTP/1.1\r\nHost: gw.test:8080\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(r.status, 308, "{}", r.text);
    assert!(
        r.text
            .to_ascii_lowercase()
            .contains(&format!("location: https://gw.test:{port}/a/b?x=1\r\n")),
        "{}",
        r.text
    );
    // A host the gateway would refuse never becomes a Location: a path in the Host, and
    // userinfo in an absolute-form target, are 400s, not redirects to another site.
    for head in [
        &b"GET /x HTTP/1.1\r\nHost: evil.example/x\r\nConnection: close\r\n\r\n"[..],
        b"GET http://gw.test@evil.example/x HTTP/1.1\r\nHost: gw.test@evil.example\r\nConnection: close\r\n\r\n",
    ] {
        let r = raw_exchange(gw.port, head).await;
        assert_eq!(r.status, 400, "{}", r.text);
        assert!(
            !r.text.to_ascii_lowercase().contains("location:"),
            "{}",
            r.text
        );
    }
    // Logged and counted, though never admitted.
    assert!(
        gw.wait_for_log("decision=\"redirect\"", 1, Duration::from_secs(5)),
        "{}",
        gw.logs()
    );
    let logs = gw.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("ratewall::access") && l.contains("path=/a/b"))
        .unwrap_or_else(|| panic!("no access line for the redirect:\n{logs}"));
    for field in [
        "method=POST",
        "protocol=\"HTTP/1.1\" tls=\"-\" status=308",
        "host=\"gw.test:8080\"",
        "rule=\"-\" decision=\"redirect\"",
    ] {
        assert!(line.contains(field), "{field} in {line}");
    }
    assert!(!line.contains("a/b?x=1"), "never the query: {line}");
    let scrape = Scrape::take(&HttpClient::new(), &gw).await;
    assert_eq!(scrape.scalar("ratewall_https_redirects_total"), 1.0);
    // Over TLS the request is served, and not counted as a redirect.
    let config = client_config(&[pki.ca_der()], &[b"http/1.1"], None);
    let r = tls_get(port, "gw.test", config, "/a/b", &[]).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(upstream.seen().len(), 1);
    let scrape = Scrape::take(&HttpClient::new(), &gw).await;
    assert_eq!(scrape.scalar("ratewall_https_redirects_total"), 1.0);
    let logs = gw.logs();
    let served: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("ratewall::access") && l.contains("path=/a/b"))
        .collect();
    assert_eq!(served.len(), 2, "{logs}");
    assert!(served[1].contains("status=200"), "{}", served[1]);
}

/// A client that comes back resumes its session (a ticket), also after a reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_resume_across_connections_and_reloads() {
    let _watch = common::watchdog();
    let pki = Pki::new("resume");
    let cert = pki.server_cert("gw", &["gw.test"], 90);
    let upstream = Upstream::start().await;
    let (gw, port) = tls_gateway(&[cert], "", &upstream, "");
    let mut configs = Vec::new();
    for v in [&rustls::version::TLS13, &rustls::version::TLS12] {
        let mut store = rustls::RootCertStore::empty();
        store.add(pki.ca_der()).unwrap();
        let config = std::sync::Arc::new(
            rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_protocol_versions(&[v])
            .unwrap()
            .with_root_certificates(store)
            .with_no_client_auth(),
        );
        let kind = |s: &tokio_rustls::client::TlsStream<tokio::net::TcpStream>| {
            s.get_ref().1.handshake_kind()
        };
        // TLS 1.3 tickets come after the handshake: read what the server sent.
        let first = async {
            let mut s = handshake(port, "gw.test", config.clone()).await.unwrap();
            use tokio::io::AsyncWriteExt;
            s.write_all(b"GET / HTTP/1.1\r\nhost: gw.test\r\nconnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut out = Vec::new();
            use tokio::io::AsyncReadExt;
            let _ = s.read_to_end(&mut out).await;
            kind(&s)
        };
        assert_eq!(first.await, Some(rustls::HandshakeKind::Full), "{v:?}");
        let again = handshake(port, "gw.test", config.clone()).await.unwrap();
        assert_eq!(kind(&again), Some(rustls::HandshakeKind::Resumed), "{v:?}");
        configs.push(config);
    }
    gw.rewrite_config(&format!(
        "{}\n[log]\nclient_ip = false\n",
        std::fs::read_to_string(&gw.config)
            .unwrap()
            .split_once("[server.tls]")
            .map(|(_, rest)| format!("[server.tls]{rest}"))
            .unwrap()
    ));
    gw.reload(1);
    // TLS 1.3: a ticket from before the reload still resumes (one ticketer per process).
    let after = handshake(port, "gw.test", configs[0].clone())
        .await
        .unwrap();
    assert_eq!(
        after.get_ref().1.handshake_kind(),
        Some(rustls::HandshakeKind::Resumed)
    );
}
