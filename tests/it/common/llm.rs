//! What the settlement tests (issue 27) talk to: a scripted HTTP/1.1 backend whose
//! answer each request's query chooses (a status, a held head, a reported cost as a
//! header or a chunked trailer, an OpenAI-style JSON completion or server-sent event
//! stream with its usage), recording every request and the instant each body chunk was
//! written; and a client that reads an answer frame by frame, timing each.
//!
//! The backend writes its answers byte by byte as given (no HTTP library in between), so
//! a test knows exactly what went on the wire and when.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// The header (and trailer) the settlement tests' rules read a cost from.
pub const COST_HEADER: &str = "x-ratelimit-cost";

/// One request as a [`LlmBackend`] saw it, and what it wrote back.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The request target: path and query, as sent.
    pub target: String,
    pub body: Bytes,
    /// The answer's body bytes (de-chunked), each piece with the instant its write to
    /// the socket returned.
    pub written: Vec<(Instant, Bytes)>,
}

impl Seen {
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or_default()
    }

    /// Every body byte written, in order.
    pub fn body_written(&self) -> Vec<u8> {
        self.written.iter().flat_map(|(_, b)| b.to_vec()).collect()
    }
}

#[derive(Default)]
struct Shared {
    /// Requests whose head arrived (answered or not yet).
    arrived: AtomicUsize,
    /// Requests answered (or given up), in the order they were.
    seen: Mutex<Vec<Seen>>,
}

/// A scripted HTTP/1.1 backend (keep-alive, requests with `Content-Length` or chunked
/// bodies). Every answer is chosen by the request's query (any path):
///
/// - `status=<code>`: the answer's status (default 200).
/// - `hold=<ms>`: wait that long before the head; `hold=gate`: until [`LlmBackend::open`].
/// - `cost=<value>`: an `x-ratelimit-cost: <value>` header (the value as given).
/// - `trailer=<value>`: a chunked body of two chunks, declared `Trailer:
///   x-ratelimit-cost, x-other`, ending with the trailers `x-ratelimit-cost: <value>` and
///   `x-other: kept`.
/// - `usage=json&prompt=<p>&completion=<c>`: an OpenAI chat completion (JSON) whose
///   `usage` says `prompt_tokens` p, `completion_tokens` c and `total_tokens` p + c.
/// - `usage=sse&prompt=<p>&completion=<c>&chunks=<n>&gap=<ms>`: the same as a server-sent
///   event stream (chunked): `n` (default 5) chunks with `"usage": null`, `gap` ms (default
///   50) apart, then a chunk with the usage, then `data: [DONE]`; each event one write.
///   `usage=sse_none`: the same stream with no usage chunk.
/// - otherwise `ok\n`, `text/plain`.
pub struct LlmBackend {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    gate: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl LlmBackend {
    pub async fn start() -> LlmBackend {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the LLM backend");
        let addr = listener.local_addr().expect("backend addr");
        let shared = Arc::new(Shared::default());
        let (gate, _) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, shared.clone(), gate.clone()));
        LlmBackend {
            addr,
            shared,
            gate,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests whose head arrived so far, answered or held.
    pub fn arrived(&self) -> usize {
        self.shared.arrived.load(Ordering::SeqCst)
    }

    /// Requests answered (or given up) so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.shared
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The one answered request whose target is exactly `target`.
    pub fn only(&self, target: &str) -> Seen {
        let all: Vec<Seen> = self
            .seen()
            .into_iter()
            .filter(|s| s.target == target)
            .collect();
        assert_eq!(all.len(), 1, "requests for {target}: {all:?}");
        all.into_iter().next().expect("one")
    }

    /// Let every request held by `hold=gate` (and every later one) go on.
    pub fn open(&self) {
        self.gate.send_replace(true);
    }
}

impl Drop for LlmBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, gate: watch::Sender<bool>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                connections.spawn(serve(stream, shared.clone(), gate.subscribe()));
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// One request, read: its target and body.
struct Asked {
    target: String,
    body: Bytes,
}

/// Serve requests on one connection until it closes or a write fails.
async fn serve(mut stream: TcpStream, shared: Arc<Shared>, gate: watch::Receiver<bool>) {
    let mut buf = Vec::new();
    while let Some(asked) = read_request(&mut stream, &mut buf).await {
        shared.arrived.fetch_add(1, Ordering::SeqCst);
        let mut seen = Seen {
            target: asked.target.clone(),
            body: asked.body,
            written: Vec::new(),
        };
        let ok = answer(&mut stream, &asked.target, &gate, &mut seen).await;
        shared
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(seen);
        if !ok {
            return;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Read more into `buf`; false at the end of the stream (or after 30 s of silence).
async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 8192];
    match tokio::time::timeout(Duration::from_secs(30), stream.read(&mut chunk)).await {
        Ok(Ok(n)) if n > 0 => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
        _ => false,
    }
}

/// The next request on the connection (head and body), `None` when it closed.
async fn read_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Asked> {
    let end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i + 4;
        }
        if !fill(stream, buf).await {
            return None;
        }
    };
    let (target, length, chunked) = {
        let mut fields = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut fields);
        req.parse(&buf[..end]).ok()?;
        let target = req.path?.to_string();
        let value = |name: &str| {
            req.headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| String::from_utf8_lossy(h.value).trim().to_ascii_lowercase())
        };
        let length: usize = value("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let chunked = value("transfer-encoding").is_some_and(|v| v.contains("chunked"));
        (target, length, chunked)
    };
    buf.drain(..end);
    let body = if chunked {
        read_chunked(stream, buf).await?
    } else {
        while buf.len() < length {
            if !fill(stream, buf).await {
                return None;
            }
        }
        buf.drain(..length).collect()
    };
    Some(Asked {
        target,
        body: Bytes::from(body),
    })
}

/// A chunked request body, de-chunked (extensions and trailers read and dropped).
async fn read_chunked(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = loop {
            if let Some(i) = find(buf, b"\r\n") {
                break i;
            }
            if !fill(stream, buf).await {
                return None;
            }
        };
        let line = String::from_utf8_lossy(&buf[..line_end]).to_string();
        let size = usize::from_str_radix(line.split(';').next()?.trim(), 16).ok()?;
        buf.drain(..line_end + 2);
        if size == 0 {
            // Trailer fields, then the empty line.
            loop {
                let i = loop {
                    if let Some(i) = find(buf, b"\r\n") {
                        break i;
                    }
                    if !fill(stream, buf).await {
                        return None;
                    }
                };
                buf.drain(..i + 2);
                if i == 0 {
                    return Some(body);
                }
            }
        }
        while buf.len() < size + 2 {
            if !fill(stream, buf).await {
                return None;
            }
        }
        body.extend(buf.drain(..size));
        buf.drain(..2);
    }
}

/// The query's parameters (no percent-decoding: the tests write plain values).
fn query(target: &str) -> HashMap<String, String> {
    target
        .split_once('?')
        .map(|(_, q)| q)
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The head of an answer: status line, `fields`, and the empty line.
fn head(status: u16, fields: &[(&str, String)]) -> Vec<u8> {
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Whatever");
    let mut h = format!("HTTP/1.1 {status} {reason}\r\n");
    for (k, v) in fields {
        h.push_str(&format!("{k}: {v}\r\n"));
    }
    h.push_str("\r\n");
    h.into_bytes()
}

/// One chunk of a chunked body.
fn chunk(data: &[u8]) -> Vec<u8> {
    let mut c = format!("{:x}\r\n", data.len()).into_bytes();
    c.extend_from_slice(data);
    c.extend_from_slice(b"\r\n");
    c
}

/// An OpenAI chat completion's usage object.
pub fn usage_json(prompt: u64, completion: u64) -> String {
    format!(
        r#"{{"prompt_tokens":{prompt},"completion_tokens":{completion},"total_tokens":{}}}"#,
        prompt + completion
    )
}

/// The body of an OpenAI chat completion (JSON) reporting this usage.
pub fn completion_json(prompt: u64, completion: u64) -> String {
    format!(
        r#"{{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"test-model","choices":[{{"index":0,"message":{{"role":"assistant","content":"Hello there."}},"finish_reason":"stop"}}],"usage":{}}}"#,
        usage_json(prompt, completion)
    )
}

/// The events of a streamed chat completion: `chunks` content events with `"usage":
/// null`, then (when `usage` is given) one with the usage, then `data: [DONE]`.
pub fn sse_events(chunks: usize, usage: Option<(u64, u64)>) -> Vec<String> {
    let mut events: Vec<String> = (0..chunks)
        .map(|i| {
            format!(
                "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"test-model\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token {i} \"}},\"finish_reason\":null}}],\"usage\":null}}\n\n"
            )
        })
        .collect();
    if let Some((p, c)) = usage {
        events.push(format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"test-model\",\"choices\":[],\"usage\":{}}}\n\n",
            usage_json(p, c)
        ));
    }
    events.push("data: [DONE]\n\n".to_string());
    events
}

/// Write `bytes`; record `data` (the body bytes they carry) as written now.
async fn write(stream: &mut TcpStream, bytes: &[u8], data: &[u8], seen: &mut Seen) -> bool {
    if stream.write_all(bytes).await.is_err() || stream.flush().await.is_err() {
        return false;
    }
    if !data.is_empty() {
        seen.written
            .push((Instant::now(), Bytes::copy_from_slice(data)));
    }
    true
}

/// Answer one request as its query says; false when the connection is no longer usable.
async fn answer(
    stream: &mut TcpStream,
    target: &str,
    gate: &watch::Receiver<bool>,
    seen: &mut Seen,
) -> bool {
    let q = query(target);
    let num = |k: &str, default: u64| q.get(k).and_then(|v| v.parse().ok()).unwrap_or(default);
    match q.get("hold").map(String::as_str) {
        Some("gate") => {
            let mut gate = gate.clone();
            let _ =
                tokio::time::timeout(Duration::from_secs(60), gate.wait_for(|open| *open)).await;
        }
        Some(ms) => {
            let ms = ms.parse().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        None => {}
    }
    let status = num("status", 200) as u16;
    let mut fields: Vec<(&str, String)> = Vec::new();
    if let Some(cost) = q.get("cost") {
        fields.push((COST_HEADER, cost.clone()));
    }
    let (prompt, completion) = (num("prompt", 0), num("completion", 0));
    match q.get("usage").map(String::as_str) {
        Some("json") => {
            let body = completion_json(prompt, completion);
            fields.push(("content-type", "application/json".into()));
            fields.push(("content-length", body.len().to_string()));
            let mut out = head(status, &fields);
            out.extend_from_slice(body.as_bytes());
            write(stream, &out, body.as_bytes(), seen).await
        }
        Some(kind @ ("sse" | "sse_none")) => {
            let usage = (kind == "sse").then_some((prompt, completion));
            let events = sse_events(num("chunks", 5) as usize, usage);
            let gap = Duration::from_millis(num("gap", 50));
            fields.push(("content-type", "text/event-stream".into()));
            fields.push(("cache-control", "no-cache".into()));
            fields.push(("transfer-encoding", "chunked".into()));
            if !write(stream, &head(status, &fields), b"", seen).await {
                return false;
            }
            let last = events.len() - 1;
            for (i, e) in events.iter().enumerate() {
                if i > 0 {
                    tokio::time::sleep(gap).await;
                }
                let mut out = chunk(e.as_bytes());
                if i == last {
                    out.extend_from_slice(b"0\r\n\r\n");
                }
                if !write(stream, &out, e.as_bytes(), seen).await {
                    return false;
                }
            }
            true
        }
        _ if q.contains_key("trailer") => {
            let cost = &q["trailer"];
            fields.push(("content-type", "text/plain".into()));
            fields.push(("transfer-encoding", "chunked".into()));
            fields.push(("trailer", format!("{COST_HEADER}, x-other")));
            if !write(stream, &head(status, &fields), b"", seen).await {
                return false;
            }
            for part in [&b"part one\n"[..], b"part two\n"] {
                if !write(stream, &chunk(part), part, seen).await {
                    return false;
                }
            }
            let end = format!("0\r\n{COST_HEADER}: {cost}\r\nx-other: kept\r\n\r\n");
            write(stream, end.as_bytes(), b"", seen).await
        }
        _ => {
            let body = b"ok\n";
            fields.push(("content-type", "text/plain".into()));
            fields.push(("content-length", body.len().to_string()));
            let mut out = head(status, &fields);
            out.extend_from_slice(body);
            write(stream, &out, body, seen).await
        }
    }
}

// ---------------------------------------------------------------------------------------

/// An answer read frame by frame: each data frame with the instant it arrived, and the
/// trailers, if any came.
#[derive(Debug)]
pub struct Streamed {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub frames: Vec<(Instant, Bytes)>,
    pub trailers: Option<HeaderMap>,
}

impl Streamed {
    /// The whole body.
    pub fn body(&self) -> Vec<u8> {
        self.frames.iter().flat_map(|(_, b)| b.to_vec()).collect()
    }

    /// When the body's first `n` bytes had all arrived.
    pub fn arrived_by(&self, n: usize) -> Option<Instant> {
        let mut got = 0;
        for (at, b) in &self.frames {
            got += b.len();
            if got >= n {
                return Some(*at);
            }
        }
        None
    }
}

/// Which HTTP a [`stream_get`] speaks to the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Http {
    /// HTTP/1.1.
    One,
    /// HTTP/2 with prior knowledge (h2c).
    Two,
}

/// A GET on a connection of its own, read frame by frame (hyper's client; within 30 s).
pub async fn stream_get(port: u16, path: &str, headers: &[(&str, &str)], http: Http) -> Streamed {
    let exchange = async {
        let tcp = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect to the gateway");
        let _ = tcp.set_nodelay(true);
        let io = TokioIo::new(tcp);
        let mut req = Request::builder()
            .method("GET")
            .uri(format!("http://127.0.0.1:{port}{path}"));
        if http == Http::One {
            // A connection's own client writes no `Host` of its own (HTTP/2: the
            // `:authority` comes from the URI).
            req = req.header("host", format!("127.0.0.1:{port}"));
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Empty::<Bytes>::new()).expect("request");
        let resp = match http {
            Http::One => {
                let (mut send, conn) = hyper::client::conn::http1::handshake(io)
                    .await
                    .expect("HTTP/1.1 handshake");
                tokio::spawn(conn);
                send.send_request(req).await.expect("the answer's head")
            }
            Http::Two => {
                let (mut send, conn) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                        .await
                        .expect("h2c handshake");
                tokio::spawn(conn);
                send.send_request(req).await.expect("the answer's head")
            }
        };
        let (parts, mut body) = resp.into_parts();
        let mut frames = Vec::new();
        let mut trailers = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.expect("the answer's body");
            let at = Instant::now();
            match frame.into_data() {
                Ok(data) => frames.push((at, data)),
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers = Some(t);
                    }
                }
            }
        }
        Streamed {
            status: parts.status,
            headers: parts.headers,
            frames,
            trailers,
        }
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .unwrap_or_else(|_| panic!("GET {path}: no whole answer within 30 s"))
}
