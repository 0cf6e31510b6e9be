//! A real HTTP upstream (hyper, HTTP/1.1 and h2c) in the test process, that records what
//! it saw of every request.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// What the upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub headers: HeaderMap,
    pub body_len: usize,
    /// [`fnv1a`] of the body's first [`HASHED`] bytes, to check a body arrived intact
    /// without keeping it (a debug build hashes a byte at a time: huge bodies are only
    /// counted).
    pub body_hash: u64,
}

/// FNV-1a, 64 bits, continued from `hash` (start with [`FNV_START`]).
pub fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

pub const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// How much of a body [`Seen::body_hash`] covers.
pub const HASHED: usize = 4 << 20;

#[derive(Default)]
struct Shared {
    seen: Mutex<Vec<Seen>>,
    /// Requests whose head has arrived, counted before anything else is done with them.
    arrived: AtomicUsize,
    /// Signalled by `/stream` when the first body chunk arrives.
    first_chunk: tokio::sync::Notify,
}

/// A real HTTP upstream in this test process. Paths:
/// `/slow/<ms>` answers after that many ms; `/stream` signals [`Upstream::first_chunk`]
/// once the request body's first chunk is in (then reads the rest); `/hold/<ms>` waits
/// that long before it reads the body at all; `/reset` sends its head and part of a
/// declared body, then fails the connection; `/big/<n>` answers `n` bytes; anything else
/// answers 200 "ok <body length>" after reading the body.
pub struct Upstream {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let shared = Arc::new(Shared::default());
        let accepting = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let shared = accepting.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let shared = shared.clone();
                        async move { Ok::<_, Infallible>(upstream_answer(req, &shared).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Upstream { addr, shared, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The requests answered so far (recorded once their body is read).
    pub fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// How many requests have arrived (head in), answered or not.
    pub fn arrived(&self) -> usize {
        self.shared.arrived.load(Ordering::SeqCst)
    }

    /// Wait until `n` requests in all have arrived (at most `within`): whether they did.
    pub async fn wait_arrived(&self, n: usize, within: Duration) -> bool {
        let end = Instant::now() + within;
        while self.arrived() < n {
            if Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// Resolves once a `/stream` request's first body chunk is in (a permit is kept if it
    /// came first).
    pub async fn first_chunk(&self) {
        self.shared.first_chunk.notified().await
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A body that sends one chunk, then fails: the connection is cut mid-response.
pub struct ResetBody {
    sent: bool,
}

impl hyper::body::Body for ResetBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        if self.sent {
            std::task::Poll::Ready(Some(Err(std::io::Error::other(
                "upstream cut the response",
            ))))
        } else {
            self.sent = true;
            std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from_static(
                b"partial",
            )))))
        }
    }
}

type UpstreamBody = http_body_util::Either<Full<Bytes>, ResetBody>;

fn ms_after(path: &str, prefix: &str) -> Option<u64> {
    path.strip_prefix(prefix).and_then(|m| m.parse().ok())
}

async fn upstream_answer(req: Request<Incoming>, shared: &Shared) -> Response<UpstreamBody> {
    shared.arrived.fetch_add(1, Ordering::SeqCst);
    let path = req.uri().path().to_string();
    let headers = req.headers().clone();
    if let Some(ms) = ms_after(&path, "/hold/") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let mut body = req.into_body();
    let (mut body_len, mut body_hash) = (0, FNV_START);
    let mut notified = false;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        if let Some(d) = frame.data_ref() {
            if body_len < HASHED {
                body_hash = fnv1a(body_hash, &d[..d.len().min(HASHED - body_len)]);
            }
            body_len += d.len();
            if path == "/stream" && !notified && body_len > 0 {
                shared.first_chunk.notify_one();
                notified = true;
            }
        }
    }
    if let Some(ms) = ms_after(&path, "/slow/") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let big: Option<usize> = path.strip_prefix("/big/").and_then(|n| n.parse().ok());
    let reset = path == "/reset";
    shared.seen.lock().unwrap().push(Seen {
        path,
        headers,
        body_len,
        body_hash,
    });
    if let Some(n) = big {
        return Response::new(http_body_util::Either::Left(Full::new(Bytes::from(vec![
            b'x';
            n
        ]))));
    }
    if reset {
        let mut resp = Response::new(http_body_util::Either::Right(ResetBody { sent: false }));
        resp.headers_mut()
            .insert("content-length", http::HeaderValue::from_static("1000"));
        return resp;
    }
    let mut resp = Response::new(http_body_util::Either::Left(Full::new(Bytes::from(
        format!("ok {body_len}\n"),
    ))));
    resp.headers_mut()
        .insert("x-upstream", http::HeaderValue::from_static("yes"));
    // A hop-by-hop header the gateway must not pass back.
    resp.headers_mut().insert(
        "connection",
        http::HeaderValue::from_static("x-upstream-hop"),
    );
    resp.headers_mut()
        .insert("x-upstream-hop", http::HeaderValue::from_static("1"));
    resp
}
