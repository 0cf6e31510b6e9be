//! A real HTTP client (hyper-util's pooled client, HTTP/1.1 or h2c), replies read whole,
//! and request bodies sent in chunks.

use std::net::IpAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Frame;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// A response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("json body")
    }
}

/// A request body of any kind the tests send.
pub type AnyBody = BoxBody<Bytes, std::io::Error>;

/// A whole body.
pub fn full(body: Bytes) -> AnyBody {
    Full::new(body).map_err(|never| match never {}).boxed()
}

/// A request body the test writes piece by piece while the request is in flight: each
/// `send` is one DATA frame / chunk, and dropping the sender ends the body.
pub struct BodySender(tokio::sync::mpsc::Sender<Bytes>);

struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}

/// A body fed by the returned sender.
pub fn channel_body() -> (BodySender, AnyBody) {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    (BodySender(tx), ChannelBody(rx).boxed())
}

impl BodySender {
    /// Hand one chunk to the client (waits while the previous one is not yet taken).
    /// False when the client no longer sends the body (the answer came first, or the
    /// request failed).
    pub async fn send(&self, chunk: Bytes) -> bool {
        self.0.send(chunk).await.is_ok()
    }
}

/// Render an error and its sources on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// A real HTTP client (hyper-util's pooled client), optionally from a chosen local address.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, AnyBody>,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    pub fn new() -> HttpClient {
        Self::from_addr(None)
    }

    /// Connect from `local` (any 127.0.0.0/8 address works on Linux loopback), so tests can
    /// be a peer other than 127.0.0.1.
    pub fn from_addr(local: Option<IpAddr>) -> HttpClient {
        let mut conn = HttpConnector::new();
        conn.set_local_address(local);
        HttpClient {
            inner: Client::builder(TokioExecutor::new()).build(conn),
        }
    }

    /// HTTP/2 with prior knowledge (cleartext h2c).
    pub fn h2() -> HttpClient {
        HttpClient {
            inner: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build(HttpConnector::new()),
        }
    }

    /// A GET that must be answered (any status) within 30 s; panics otherwise.
    pub async fn get(&self, url: &str, headers: &[(&str, &str)]) -> Reply {
        self.send("GET", url, headers, Bytes::new()).await
    }

    /// A request with a whole body that must be answered within 30 s; panics otherwise.
    pub async fn send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Reply {
        self.try_send(method, url, headers, full(body), Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("{method} {url}: {e}"))
    }

    /// A GET whose failures are results, not panics: connection errors, bodies cut short
    /// and answers that do not come `within` are what some tests look for.
    pub async fn try_get(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        within: Duration,
    ) -> Result<Reply, String> {
        self.try_send("GET", url, headers, full(Bytes::new()), within)
            .await
    }

    /// Send any request and read the whole reply, within `within`.
    pub async fn try_send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: AnyBody,
        within: Duration,
    ) -> Result<Reply, String> {
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(body).map_err(|e| e.to_string())?;
        let exchange = async {
            let resp = self
                .inner
                .request(req)
                .await
                .map_err(|e| format!("request failed: {}", error_chain(&e)))?;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| format!("{} body failed: {}", parts.status, error_chain(&e)))?
                .to_bytes();
            Ok(Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(within, exchange)
            .await
            .map_err(|_| format!("no answer within {within:?}"))?
    }

    /// `n` GETs in a row with API key `key`: their statuses.
    pub async fn statuses(&self, url: &str, key: &str, n: usize) -> Vec<u16> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(self.get(url, &[("x-api-key", key)]).await.status.as_u16());
        }
        out
    }

    /// GET `url` with `headers` every 50 ms until it answers `want`: how long that took,
    /// or `None` past `within`.
    pub async fn until_status(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        want: StatusCode,
        within: Duration,
    ) -> Option<Duration> {
        let start = Instant::now();
        while start.elapsed() < within {
            if self.get(url, headers).await.status == want {
                return Some(start.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }
}

/// `n` 200s then one 429: what a fresh key with a burst of `n` gets for `n + 1` requests.
pub fn burst_then_429(n: usize) -> Vec<u16> {
    let mut v = vec![200; n];
    v.push(429);
    v
}
