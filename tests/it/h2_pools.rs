//! Pools that speak HTTP/2 to their servers (`protocol = "h2c" | "h2" | "auto"`), end to
//! end: the real binary in front of hyper HTTP/2 servers in the test process, cleartext
//! (prior knowledge) and over TLS (ALPN), with certificates made here.
//!
//! What is pinned: requests and their forwarding fields arrive (`Host` as `:authority`,
//! `te: trailers` kept); bodies stream both ways, and trailers pass both ways; a server
//! that allows 2 streams gets more connections under 10 requests at once, and few
//! otherwise; a server killed and started again is reconnected to; `auto` speaks h2 to a
//! server that offers it and HTTP/1.1 to one that does not; a 64 MiB body passes in
//! bounded memory; the config refuses a protocol its servers' schemes cannot carry.

use crate::common;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use common::tls_upstream::{checksum, write_pem, Ca};
use common::{toml_path, AnyBody, Gateway, HttpClient, Store};
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What the backend speaks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Speaks {
    /// HTTP/2 with prior knowledge, cleartext.
    H2c,
    /// TLS, ALPN `h2` only.
    H2Tls,
    /// TLS, ALPN `http/1.1` only, HTTP/1.1.
    Http1Tls,
}

/// What the backend saw.
#[derive(Default)]
struct Seen {
    connections: AtomicUsize,
    requests: AtomicUsize,
    heads: Mutex<Vec<Head>>,
}

/// `:authority` (or `Host`), `te`, `x-forwarded-for`, the version, of one request.
type Head = (String, Option<String>, Option<String>, http::Version);

/// An HTTP/2 (or, for `Http1Tls`, HTTP/1.1) backend in the test process.
///
/// - `/echo`: the request body streamed back as it comes, its trailers as the answer's.
/// - `/count`: the request body read to its end; answers `<n> bytes, sum <checksum>` and
///   the trailers `x-count: <n>` and `grpc-status: 0`.
/// - `/slow`: answers after 300 ms.
/// - anything else: `ok <version>`.
struct H2Backend {
    addr: SocketAddr,
    seen: Arc<Seen>,
    task: JoinHandle<()>,
}

impl Drop for H2Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl H2Backend {
    async fn start(speaks: Speaks, max_streams: Option<u32>, tls: Option<&Ca>) -> H2Backend {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Self::on(listener, speaks, max_streams, tls)
    }

    fn on(
        listener: TcpListener,
        speaks: Speaks,
        max_streams: Option<u32>,
        tls: Option<&Ca>,
    ) -> H2Backend {
        let addr = listener.local_addr().expect("addr");
        let acceptor = tls.map(|ca| {
            let leaf = ca.leaf(&["localhost"]);
            let chain = rustls::pki_types::pem::PemObject::pem_slice_iter(leaf.cert.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .expect("leaf PEM");
            let key = rustls::pki_types::pem::PemObject::from_pem_slice(leaf.key.as_bytes())
                .expect("key PEM");
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mut config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .expect("versions")
                .with_no_client_auth()
                .with_single_cert(chain, key)
                .expect("server cert");
            config.alpn_protocols = match speaks {
                Speaks::Http1Tls => vec![b"http/1.1".to_vec()],
                _ => vec![b"h2".to_vec()],
            };
            tokio_rustls::TlsAcceptor::from(Arc::new(config))
        });
        let seen = Arc::new(Seen::default());
        let task = tokio::spawn(serve(listener, speaks, max_streams, acceptor, seen.clone()));
        H2Backend { addr, seen, task }
    }

    fn connections(&self) -> usize {
        self.seen.connections.load(SeqCst)
    }

    fn requests(&self) -> usize {
        self.seen.requests.load(SeqCst)
    }
}

async fn serve(
    listener: TcpListener,
    speaks: Speaks,
    max_streams: Option<u32>,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    seen: Arc<Seen>,
) {
    // The connections die with the server: aborting it kills them all (a killed backend).
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        while connections.try_join_next().is_some() {}
        seen.connections.fetch_add(1, SeqCst);
        let (acceptor, seen) = (acceptor.clone(), seen.clone());
        connections.spawn(async move {
            let service = service_fn(move |req| answer(req, seen.clone()));
            let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
            h2.max_concurrent_streams(max_streams);
            match (acceptor, speaks) {
                (None, _) => {
                    let _ = h2.serve_connection(TokioIo::new(tcp), service).await;
                }
                (Some(acceptor), Speaks::Http1Tls) => {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                }
                (Some(acceptor), _) => {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let _ = h2.serve_connection(TokioIo::new(tls), service).await;
                }
            }
        });
    }
}

type Answer = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

async fn answer(
    req: Request<Incoming>,
    seen: Arc<Seen>,
) -> Result<Response<Answer>, std::convert::Infallible> {
    seen.requests.fetch_add(1, SeqCst);
    let header = |n: &str| {
        req.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let authority = req
        .uri()
        .authority()
        .map(|a| a.to_string())
        .or_else(|| header("host"))
        .unwrap_or_default();
    seen.heads.lock().unwrap().push((
        authority,
        header("te"),
        header("x-forwarded-for"),
        req.version(),
    ));
    let full = |s: String| Full::new(Bytes::from(s)).map_err(|n| match n {}).boxed();
    let resp = match req.uri().path() {
        "/echo" => Response::new(req.into_body().boxed()),
        "/count" => {
            let mut body = req.into_body();
            let (mut n, mut sum) = (0u64, 0u64);
            while let Some(Ok(frame)) = body.frame().await {
                if let Ok(data) = frame.into_data() {
                    // The weighted sum of `checksum`, computed as the bytes stream by.
                    for b in data.iter() {
                        n += 1;
                        sum = sum.wrapping_add(n * u64::from(*b));
                    }
                }
            }
            let mut trailers = HeaderMap::new();
            trailers.insert("x-count", n.to_string().parse().unwrap());
            trailers.insert("grpc-status", "0".parse().unwrap());
            let frames = Frames::of(vec![
                Frame::data(Bytes::from(format!("{n} bytes, sum {sum}"))),
                Frame::trailers(trailers),
            ]);
            Response::new(frames.map_err(|n| match n {}).boxed())
        }
        "/slow" => {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Response::new(full("slow ok".into()))
        }
        _ => Response::new(full(format!("ok {:?}", req.version()))),
    };
    Ok(resp)
}

/// A body of frames given in advance: data, then trailers.
struct Frames(VecDeque<Frame<Bytes>>);

impl Frames {
    fn of(frames: Vec<Frame<Bytes>>) -> Frames {
        Frames(frames.into())
    }
}

impl hyper::body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(Ok))
    }
}

/// `n` bytes of a pattern, made as they are sent, in 64 KiB frames.
struct Generated {
    left: usize,
    sent: usize,
}

impl hyper::body::Body for Generated {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = self.left.min(64 * 1024);
        let start = self.sent;
        let chunk: Vec<u8> = (start..start + n).map(|i| (i % 251) as u8).collect();
        self.left -= n;
        self.sent += n;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(chunk)))))
    }
}

/// A gateway with one pool `protocol` of `servers` (and `extra` keys), two workers, no
/// rule.
fn gateway(protocol: &str, servers: &[String], extra: &str) -> Gateway {
    gateway_with("", protocol, servers, extra)
}

/// The same, with `server` keys in `[server]`.
fn gateway_with(server: &str, protocol: &str, servers: &[String], extra: &str) -> Gateway {
    let list: Vec<String> = servers.iter().map(|s| format!("\"{s}\"")).collect();
    let timeout = match extra.lines().any(|l| l.starts_with("timeout ")) {
        true => "",
        false => "timeout = \"5s\"\n",
    };
    Gateway::start(&format!(
        "workers = 2\n{server}[[upstreams]]\nname = \"default\"\nservers = [{}]\nprotocol = \"{protocol}\"\nconnect_timeout = \"2s\"\n{timeout}retries = 0\n{extra}\n{}",
        list.join(", "),
        Store::Memory.toml()
    ))
}

/// TLS keys for a pool whose servers' certificates `ca` signed.
fn ca_key(ca: &Ca, dir: &tempfile::TempDir) -> String {
    format!(
        "ca = \"{}\"\n",
        toml_path(&write_pem(dir.path(), "ca.pem", &ca.pem()))
    )
}

/// An h2c client's request with data frames and trailers; the answer read whole, its
/// trailers apart.
async fn with_trailers(
    url: &str,
    chunks: &[&str],
    trailers: &[(&str, &str)],
) -> (u16, Bytes, HeaderMap) {
    let mut frames: Vec<Frame<Bytes>> = chunks
        .iter()
        .map(|c| Frame::data(Bytes::copy_from_slice(c.as_bytes())))
        .collect();
    let mut map = HeaderMap::new();
    for (k, v) in trailers {
        map.insert(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    frames.push(Frame::trailers(map));
    let body: AnyBody = Frames::of(frames).map_err(|n| match n {}).boxed();
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<AnyBody>();
    let req = Request::post(url)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("answered in time")
        .expect("answered");
    let status = resp.status().as_u16();
    let collected = resp.into_body().collect().await.expect("the whole body");
    let trailers = collected.trailers().cloned().unwrap_or_default();
    (status, collected.to_bytes(), trailers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_pool_forwards_requests_with_their_fields_over_http2() {
    let _watch = common::watchdog();
    let backend = H2Backend::start(Speaks::H2c, None, None).await;
    let g = gateway("h2c", &[format!("http://{}", backend.addr)], "");
    let client = HttpClient::new();
    for _ in 0..5 {
        let r = client.get(&g.url("/hello"), &[("host", "app.test")]).await;
        assert_eq!(r.status, 200, "{}", g.logs());
        assert_eq!(r.body, "ok HTTP/2.0");
    }
    let heads = backend.seen.heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 5);
    for (authority, te, xff, version) in heads {
        assert_eq!(authority, "app.test", "Host goes as :authority");
        assert_eq!(te, None, "no TE asked, none sent");
        assert_eq!(xff.as_deref(), Some("127.0.0.1"));
        assert_eq!(version, http::Version::HTTP_2);
    }
    assert_eq!(
        backend.connections(),
        1,
        "one connection for requests in a row, across workers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_stream_and_trailers_pass_both_ways_through_h2c_and_h2_pools() {
    let _watch = common::watchdog();
    let ca = Ca::new("h2 test CA");
    let dir = tempfile::tempdir().unwrap();
    let h2c = H2Backend::start(Speaks::H2c, None, None).await;
    let h2 = H2Backend::start(Speaks::H2Tls, None, Some(&ca)).await;
    let pools = [
        gateway("h2c", &[format!("http://{}", h2c.addr)], ""),
        gateway(
            "h2",
            &[format!("https://localhost:{}", h2.addr.port())],
            &ca_key(&ca, &dir),
        ),
    ];
    for g in &pools {
        // Trailers both ways: the client's go up, and the echo sends them back down.
        let (status, body, trailers) = with_trailers(
            &g.url("/echo"),
            &["hello, ", "world"],
            &[("grpc-status", "0"), ("x-checksum", "abc")],
        )
        .await;
        assert_eq!(status, 200, "{}", g.logs());
        assert_eq!(body, "hello, world");
        assert_eq!(
            trailers.get("grpc-status").map(|v| v.as_bytes()),
            Some(&b"0"[..]),
            "{trailers:?}"
        );
        assert_eq!(
            trailers.get("x-checksum").map(|v| v.as_bytes()),
            Some(&b"abc"[..])
        );
        // The answer's own trailers come down, after a body read to its end.
        let (status, body, trailers) = with_trailers(&g.url("/count"), &["abc"], &[]).await;
        assert_eq!(status, 200);
        assert_eq!(body, format!("3 bytes, sum {}", checksum(b"abc")));
        assert_eq!(
            trailers.get("x-count").map(|v| v.as_bytes()),
            Some(&b"3"[..])
        );
    }
    let te: Vec<Option<String>> = h2c
        .seen
        .heads
        .lock()
        .unwrap()
        .iter()
        .map(|h| h.1.clone())
        .collect();
    assert!(
        te.iter().all(|t| t.as_deref() == Some("trailers")),
        "te: trailers kept for gRPC: {te:?}"
    );
    assert_eq!(h2.connections(), 1, "one TLS connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_streams_up_and_its_echo_comes_down_piece_by_piece() {
    let _watch = common::watchdog();
    let backend = H2Backend::start(Speaks::H2c, None, None).await;
    let g = gateway("h2c", &[format!("http://{}", backend.addr)], "");
    let (tx, body) = common::channel_body();
    let req = Request::post(g.url("/echo")).body(body).unwrap();
    let client =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http::<AnyBody>();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("the head comes while the body is still open")
        .expect("answered");
    assert_eq!(resp.status(), 200, "{}", g.logs());
    let mut body = resp.into_body();
    let mut got = Vec::new();
    for i in 0..3 {
        // Each piece comes back before the next is sent: nothing waits for the whole.
        let piece = format!("piece {i};");
        assert!(tx.send(Bytes::from(piece.clone())).await);
        while !String::from_utf8_lossy(&got).ends_with(&piece) {
            let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
                .await
                .expect("the echo streams back")
                .expect("a frame")
                .expect("a good frame");
            if let Ok(data) = frame.into_data() {
                got.extend_from_slice(&data);
            }
        }
    }
    drop(tx);
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("a good frame").into_data() {
            got.extend_from_slice(&data);
        }
    }
    assert_eq!(String::from_utf8_lossy(&got), "piece 0;piece 1;piece 2;");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_allowing_two_streams_gets_more_connections_under_ten_requests_at_once() {
    let _watch = common::watchdog();
    let backend = H2Backend::start(Speaks::H2c, Some(2), None).await;
    let g = gateway("h2c", &[format!("http://{}", backend.addr)], "");
    let client = HttpClient::new();
    // One first, so that the connection and its SETTINGS are there.
    assert_eq!(
        client.get(&g.url("/hello"), &[]).await.status,
        200,
        "{}",
        g.logs()
    );
    let calls: Vec<_> = (0..10)
        .map(|_| {
            let (client, url) = (client.clone(), g.url("/slow"));
            tokio::spawn(async move { client.get(&url, &[]).await.status.as_u16() })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap(), 200, "{}", g.logs());
    }
    let n = backend.connections();
    assert!((2..=10).contains(&n), "connections opened: {n}");
    assert_eq!(backend.requests(), 11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_and_started_again_is_connected_to_anew() {
    let _watch = common::watchdog();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let backend = H2Backend::on(listener, Speaks::H2c, None, None);
    let g = gateway("h2c", &[format!("http://{addr}")], "max_fails = 0\n");
    let client = HttpClient::new();
    assert_eq!(
        client.get(&g.url("/a"), &[]).await.status,
        200,
        "{}",
        g.logs()
    );
    // Killed: its listener and every connection go at once (the task's abort lands in a
    // moment: bound again as soon as the port is free).
    drop(backend);
    let listener = loop {
        match TcpListener::bind(addr).await {
            Ok(l) => break l,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let again = H2Backend::on(listener, Speaks::H2c, None, None);
    let mut ok = 0;
    for _ in 0..20 {
        if client.get(&g.url("/b"), &[]).await.status == 200 {
            ok += 1;
        }
    }
    assert!(
        ok >= 19,
        "answered after the restart: {ok} of 20\n{}",
        g.logs()
    );
    assert!(again.connections() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_speaks_h2_to_a_server_that_offers_it_and_http1_to_one_that_does_not() {
    let _watch = common::watchdog();
    let ca = Ca::new("auto test CA");
    let dir = tempfile::tempdir().unwrap();
    let client = HttpClient::new();
    for (speaks, want) in [
        (Speaks::H2Tls, "ok HTTP/2.0"),
        (Speaks::Http1Tls, "ok HTTP/1.1"),
    ] {
        let backend = H2Backend::start(speaks, None, Some(&ca)).await;
        let g = gateway(
            "auto",
            &[format!("https://localhost:{}", backend.addr.port())],
            &ca_key(&ca, &dir),
        );
        for _ in 0..3 {
            let r = client.get(&g.url("/hello"), &[]).await;
            assert_eq!(r.status, 200, "{}", g.logs());
            assert_eq!(r.body, want);
        }
        // A body goes up either way.
        let r = client
            .send("POST", &g.url("/count"), &[], Bytes::from_static(b"xyz"))
            .await;
        assert_eq!(r.body, format!("3 bytes, sum {}", checksum(b"xyz")));
        assert!(
            backend.connections() <= 3,
            "kept connections: {}",
            backend.connections()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_body_streams_through_an_h2c_pool_in_bounded_memory() {
    let _watch = common::watchdog();
    let backend = H2Backend::start(Speaks::H2c, None, None).await;
    let g = gateway("h2c", &[format!("http://{}", backend.addr)], "");
    let client = HttpClient::new();
    assert_eq!(client.get(&g.url("/warm"), &[]).await.status, 200);
    let before = g.rss_kib();
    const N: usize = 64 << 20;
    let body: AnyBody = Generated { left: N, sent: 0 }.boxed();
    let r = client
        .try_send(
            "POST",
            &g.url("/count"),
            &[],
            body,
            Duration::from_secs(120),
        )
        .await
        .expect("answered");
    assert_eq!(r.status, 200, "{}", g.logs());
    let expected: Vec<u8> = (0..N).map(|i| (i % 251) as u8).collect();
    assert_eq!(r.body, format!("{N} bytes, sum {}", checksum(&expected)));
    let grew = g.rss_kib().saturating_sub(before);
    assert!(
        grew < 32 * 1024,
        "the gateway's RSS grew {grew} KiB for a 64 MiB body"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clocks_hold_over_http2_a_stalled_upload_is_408_and_a_slow_answer_504() {
    let _watch = common::watchdog();
    let backend = H2Backend::start(Speaks::H2c, None, None).await;
    let g = gateway_with(
        "body_timeout = \"1s\"\n",
        "h2c",
        &[format!("http://{}", backend.addr)],
        "",
    );
    // The client sends a piece of its body, then nothing: 408, the stream reset.
    let (tx, body) = common::channel_body();
    assert!(tx.send(Bytes::from_static(b"a piece, then nothing")).await);
    let client = HttpClient::new();
    let started = std::time::Instant::now();
    let r = client
        .try_send("POST", &g.url("/count"), &[], body, Duration::from_secs(10))
        .await
        .expect("answered");
    // A 408 is body_timeout's (the pool's answer timeout, 5 s, would be a 504); not before
    // it.
    assert_eq!(r.status, 408, "{}", g.logs());
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    drop(tx);
    // The connection is still good for the next request.
    assert_eq!(client.get(&g.url("/hello"), &[]).await.status, 200);

    // An answer slower than `timeout`: 504.
    let slow = gateway(
        "h2c",
        &[format!("http://{}", backend.addr)],
        "timeout = \"100ms\"\n",
    );
    let r = client.get(&slow.url("/slow"), &[]).await;
    assert_eq!(r.status, 504, "{}", slow.logs());
}

#[test]
fn a_protocol_its_servers_cannot_carry_is_refused_naming_the_key() {
    let _watch = common::watchdog();
    use ratewall::config::{Config, ConfigError};
    for (body, key, message) in [
        (
            "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\nprotocol = \"h2\"\n",
            "upstreams[0].protocol",
            "protocol \"h2\" is HTTP/2 over TLS and needs https:// servers: \"http://10.0.0.1\" is not one (for cleartext HTTP/2, use \"h2c\")",
        ),
        (
            "[upstream]\nprotocol = \"h2c\"\n[[upstreams]]\nname = \"a\"\nservers = [\"https://10.0.0.1\"]\ninsecure_skip_verify = true\n",
            "upstream.protocol",
            "protocol \"h2c\" is HTTP/2 over cleartext TCP and needs http:// servers: \"https://10.0.0.1\" is not one (for HTTP/2 over TLS, use \"h2\")",
        ),
        (
            "[upstream]\nurl = \"http://10.0.0.1\"\nprotocol = \"auto\"\n",
            "upstream.protocol",
            "protocol \"auto\" lets TLS' ALPN choose h2 or HTTP/1.1 and needs https:// servers: \"http://10.0.0.1\" is not one",
        ),
        (
            "[upstream]\nurl = \"http://10.0.0.1\"\nprotocol = \"http2\"\n",
            "upstream.protocol",
            "unknown variant `http2`, expected one of `http1`, `h2`, `h2c`, `auto`",
        ),
    ] {
        let text = format!("[server]\nlisten = \"127.0.0.1:1\"\n{body}");
        match Config::parse(&text, std::path::Path::new("t.toml")) {
            Err(ConfigError::Invalid { key: k, message: m, .. }) => {
                assert_eq!(k, key, "{body}");
                assert!(m.starts_with(message), "{m}\n{body}");
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("accepted: {body}"),
        }
    }
    // Inherited, and shown by `ratewall check`.
    let cfg = Config::parse(
        "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nprotocol = \"h2c\"\n[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\n[[upstreams]]\nname = \"b\"\nservers = [\"http://10.0.0.2\"]\nprotocol = \"http1\"\n",
        std::path::Path::new("t.toml"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.upstreams[0].protocol, ratewall::upstream::Protocol::H2c);
    assert_eq!(
        cfg.upstreams[1].protocol,
        ratewall::upstream::Protocol::Http1
    );
    let shown = ratewall::cli::describe(&cfg);
    assert!(shown.contains("protocol h2c, round_robin"), "{shown}");
    assert!(shown.contains("protocol http1, round_robin"), "{shown}");
}

/// Trailers are screened like headers (issue 42): a client's HTTP/2 request trailers
/// lose every name the gateway strips or sets in a head — the forwarding fields, the
/// claims' headers (`[jwt] forward_claims`), the cost headers — on their way to an h2c
/// backend, which echoes what it got as its answer's trailers; other trailers pass.
/// Before, `x-user-id` and `x-forwarded-for` reached the backend as the client wrote them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_trailers_lose_what_a_head_may_not_carry() {
    let _watch = common::watchdog();
    let backend = H2Backend::start(Speaks::H2c, None, None).await;
    let config = format!(
        "workers = 2\n[[upstreams]]\nname = \"default\"\nservers = [\"http://{}\"]\nprotocol = \"h2c\"\n\
         connect_timeout = \"2s\"\ntimeout = \"5s\"\nretries = 0\n\
         [jwt]\nalgorithms = [\"HS256\"]\nsecret_env = \"JWT_TEST_SECRET\"\n\
         forward_claims = {{ sub = \"x-user-id\" }}\n\
         [[rules]]\nname = \"api\"\nkey = \"global\"\nrate = \"1000/s\"\ncost_header = \"x-ratelimit-cost\"\n{}",
        backend.addr,
        Store::Memory.toml()
    );
    let g = Gateway::start_with(
        &config,
        &[],
        &[("JWT_TEST_SECRET", "a-secret-of-at-least-thirty-two-bytes!")],
    );
    let (status, body, trailers) = with_trailers(
        &g.url("/echo"),
        &["hello"],
        &[
            ("x-user-id", "someone-else"),
            ("x-forwarded-for", "6.6.6.6"),
            ("x-real-ip", "6.6.6.6"),
            ("forwarded", "for=6.6.6.6"),
            ("x-forwarded-host", "evil.test"),
            ("x-checksum", "abc"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{}", g.logs());
    assert_eq!(body, "hello");
    for gone in [
        "x-user-id",
        "x-forwarded-for",
        "x-real-ip",
        "forwarded",
        "x-forwarded-host",
    ] {
        assert!(
            trailers.get(gone).is_none(),
            "{gone} reached the backend as a trailer: {trailers:?}"
        );
    }
    assert_eq!(
        trailers.get("x-checksum").map(|v| v.as_bytes()),
        Some(&b"abc"[..]),
        "other trailers pass: {trailers:?}"
    );
}
