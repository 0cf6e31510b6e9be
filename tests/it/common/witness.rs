//! What the settlement attack tests (`settle_attacks.rs`) talk to: a scripted HTTP/1.1
//! backend that witnesses every request — its head counted the moment it is read, before
//! any body, with its fields; then its body and trailers, if they ever come whole — and
//! answers as the request's query says, byte by byte as given (no HTTP library in between,
//! like [`super::llm::LlmBackend`]), so that a test knows what reached the backend even
//! when the request never ended.
//!
//! The query (any path; a key may repeat):
//!
//! - `status=<code>`: the answer's status (default 200).
//! - `hold=<ms>`: wait that long (after reading the body) before the head; `hold=gate`:
//!   until [`Witness::open`].
//! - `hdr=<name>:<value>`: a field of the answer's head.
//! - `trl=<name>:<value>`: a trailer: the body is then chunked (two chunks), declared
//!   `Trailer: <names>`, its trailers after the last chunk.
//! - `gate=last`: (chunked answers) after the first chunk, signal
//!   [`Witness::before_last`] and wait for [`Witness::open`] before the rest.
//! - `reflect=1`: every request field named `x-…` (but `x-api-key`) is sent back as a
//!   field of the answer's head, and every request trailer as a trailer of the answer (a
//!   backend that echoes what it is sent, as many debugging and proxying services do).
//!
//! The answer's body says what arrived: one line `<name>: <value>` per request field, then
//! `--trailers--`, then one line per request trailer.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::{JoinHandle, JoinSet};

/// A request's fields (names lowercased, in order).
pub type Fields = Vec<(String, String)>;

/// One request as a [`Witness`] saw it.
#[derive(Debug, Clone)]
pub struct Witnessed {
    /// The request target: path and query, as sent.
    pub target: String,
    pub fields: Fields,
    /// Its body and trailers, once the body ended (`None`: it never did).
    pub body: Option<(Vec<u8>, Fields)>,
    /// Its answer was written whole.
    pub answered: bool,
}

impl Witnessed {
    /// The first value of field `name`, if the request had it.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Its `x-api-key`.
    pub fn key(&self) -> &str {
        self.field("x-api-key").unwrap_or_default()
    }

    /// Whether `name` came as a field or a trailer.
    pub fn carried(&self, name: &str) -> bool {
        self.field(name).is_some()
            || self
                .body
                .as_ref()
                .is_some_and(|(_, t)| t.iter().any(|(n, _)| n.eq_ignore_ascii_case(name)))
    }
}

#[derive(Default)]
struct Shared {
    /// Every request, from its head on (index: the order heads arrived).
    seen: Mutex<Vec<Witnessed>>,
    /// Signalled by a `gate=last` answer before its last chunk.
    before_last: Notify,
}

/// A scripted HTTP/1.1 backend that counts heads as they arrive (see the module).
pub struct Witness {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    gate: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Witness {
    pub async fn start() -> Witness {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the witness backend");
        let addr = listener.local_addr().expect("witness addr");
        let shared = Arc::new(Shared::default());
        let (gate, _) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, shared.clone(), gate.clone()));
        Witness {
            addr,
            shared,
            gate,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request whose head arrived.
    pub fn seen(&self) -> Vec<Witnessed> {
        self.shared
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Heads that carried API key `key`.
    pub fn heads_of(&self, key: &str) -> usize {
        self.seen().iter().filter(|w| w.key() == key).count()
    }

    /// Wait until `n` heads of API key `key` have arrived (at most `within`); whether
    /// they did.
    pub async fn wait_heads_of(&self, key: &str, n: usize, within: Duration) -> bool {
        let end = Instant::now() + within;
        while self.heads_of(key) < n {
            if Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }

    /// Resolves when a `gate=last` answer has written its first chunk and waits.
    pub async fn before_last(&self) {
        self.shared.before_last.notified().await
    }

    /// Let every `hold=gate` and `gate=last` answer (and every later one) go on.
    pub fn open(&self) {
        self.gate.send_replace(true);
    }
}

impl Drop for Witness {
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

/// Serve requests on one connection until it closes or a write fails.
async fn serve(mut stream: TcpStream, shared: Arc<Shared>, gate: watch::Receiver<bool>) {
    let mut buf = Vec::new();
    loop {
        let Some((target, fields, framing)) = read_head(&mut stream, &mut buf).await else {
            return;
        };
        let index = {
            let mut seen = shared.seen.lock().unwrap_or_else(|p| p.into_inner());
            seen.push(Witnessed {
                target: target.clone(),
                fields: fields.clone(),
                body: None,
                answered: false,
            });
            seen.len() - 1
        };
        let Some((body, trailers)) = read_body(&mut stream, &mut buf, framing).await else {
            return;
        };
        let record = |f: &mut dyn FnMut(&mut Witnessed)| {
            let mut seen = shared.seen.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(w) = seen.get_mut(index) {
                f(w);
            }
        };
        record(&mut |w| w.body = Some((body.clone(), trailers.clone())));
        let ok = answer(&mut stream, &target, &fields, &trailers, &shared, &gate).await;
        if !ok {
            return;
        }
        record(&mut |w| w.answered = true);
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Read more into `buf`; false at the end of the stream (or after 30 s of silence).
async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 16 * 1024];
    match tokio::time::timeout(Duration::from_secs(30), stream.read(&mut chunk)).await {
        Ok(Ok(n)) if n > 0 => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
        _ => false,
    }
}

/// How a request's body is framed.
#[derive(Clone, Copy)]
enum Framing {
    Length(usize),
    Chunked,
}

/// The next request head on the connection: target, fields, framing; `None` when the
/// connection closed.
async fn read_head(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, Fields, Framing)> {
    let end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i + 4;
        }
        if !fill(stream, buf).await {
            return None;
        }
    };
    let mut parsed = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut parsed);
    req.parse(&buf[..end]).ok()?;
    let target = req.path?.to_string();
    let fields: Fields = req
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).trim().to_string(),
            )
        })
        .collect();
    let value = |name: &str| {
        fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.to_ascii_lowercase())
    };
    let framing = if value("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        Framing::Chunked
    } else {
        Framing::Length(
            value("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        )
    };
    buf.drain(..end);
    Some((target, fields, framing))
}

/// A request's body and trailers; `None` when the connection ended first.
async fn read_body(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    framing: Framing,
) -> Option<(Vec<u8>, Fields)> {
    let length = match framing {
        Framing::Chunked => return read_chunked(stream, buf).await,
        Framing::Length(n) => n,
    };
    while buf.len() < length {
        if !fill(stream, buf).await {
            return None;
        }
    }
    Some((buf.drain(..length).collect(), Vec::new()))
}

/// One line (without its CRLF), read from `buf`.
async fn line(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    let end = loop {
        if let Some(i) = find(buf, b"\r\n") {
            break i;
        }
        if !fill(stream, buf).await {
            return None;
        }
    };
    let l = String::from_utf8_lossy(&buf[..end]).into_owned();
    buf.drain(..end + 2);
    Some(l)
}

/// A chunked body, de-chunked, and its trailer fields.
async fn read_chunked(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(Vec<u8>, Fields)> {
    let mut body = Vec::new();
    loop {
        let size_line = line(stream, buf).await?;
        let size = usize::from_str_radix(size_line.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            let mut trailers = Vec::new();
            loop {
                let l = line(stream, buf).await?;
                if l.is_empty() {
                    return Some((body, trailers));
                }
                if let Some((n, v)) = l.split_once(':') {
                    trailers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
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

/// The query's parameters in order (no percent-decoding: the tests write plain values).
fn query(target: &str) -> Vec<(String, String)> {
    target
        .split_once('?')
        .map(|(_, q)| q)
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// One chunk of a chunked body.
fn chunk(data: &[u8]) -> Vec<u8> {
    let mut c = format!("{:x}\r\n", data.len()).into_bytes();
    c.extend_from_slice(data);
    c.extend_from_slice(b"\r\n");
    c
}

async fn write(stream: &mut TcpStream, bytes: &[u8]) -> bool {
    stream.write_all(bytes).await.is_ok() && stream.flush().await.is_ok()
}

/// Answer one request as its query says; false when the connection is no longer usable.
async fn answer(
    stream: &mut TcpStream,
    target: &str,
    fields: &Fields,
    trailers: &Fields,
    shared: &Shared,
    gate: &watch::Receiver<bool>,
) -> bool {
    let q = query(target);
    let one = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let all = |k: &str| -> Vec<(String, String)> {
        q.iter()
            .filter(|(n, _)| n == k)
            .filter_map(|(_, v)| v.split_once(':'))
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    };
    match one("hold") {
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
    let status: u16 = one("status").and_then(|v| v.parse().ok()).unwrap_or(200);
    let reflect = one("reflect") == Some("1");
    let mut head_fields = all("hdr");
    let mut tail = all("trl");
    if reflect {
        head_fields.extend(
            fields
                .iter()
                .filter(|(n, _)| n.starts_with("x-") && n != "x-api-key")
                .cloned(),
        );
        tail.extend(trailers.iter().cloned());
    }
    let mut body = String::new();
    for (n, v) in fields {
        body.push_str(&format!("{n}: {v}\n"));
    }
    body.push_str("--trailers--\n");
    for (n, v) in trailers {
        body.push_str(&format!("{n}: {v}\n"));
    }
    let reason = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Whatever");
    let mut head = format!("HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain\r\n");
    for (n, v) in &head_fields {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    let gated = one("gate") == Some("last");
    if tail.is_empty() && !gated {
        head.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
        let mut out = head.into_bytes();
        out.extend_from_slice(body.as_bytes());
        return write(stream, &out).await;
    }
    head.push_str("transfer-encoding: chunked\r\n");
    if !tail.is_empty() {
        let names: Vec<&str> = tail.iter().map(|(n, _)| n.as_str()).collect();
        head.push_str(&format!("trailer: {}\r\n", names.join(", ")));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend(chunk(body.as_bytes()));
    if !write(stream, &out).await {
        return false;
    }
    if gated {
        shared.before_last.notify_one();
        let mut gate = gate.clone();
        let _ = tokio::time::timeout(Duration::from_secs(30), gate.wait_for(|open| *open)).await;
    }
    let mut end = chunk(b"the end\n");
    end.extend_from_slice(b"0\r\n");
    for (n, v) in &tail {
        end.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
    }
    end.extend_from_slice(b"\r\n");
    write(stream, &end).await
}
