//! The gateway's upstream HTTP/1.1 client, end to end, against an upstream scripted byte
//! by byte.
//!
//! Each test runs the real `ratewall` binary (one worker, so one connection pool and
//! connection counts that mean something; the memory store; no rules) in front of a raw
//! TCP upstream. The upstream reads every request (its head, and its body by whatever
//! framing it arrives in), records what it read, and answers with exactly the bytes its
//! script gives, in as many writes as the script splits them into. The clients are raw TCP
//! too, so every byte of framing is visible on both sides.
//!
//! What is pinned, so that a rewrite of the upstream client keeps it:
//! - response framing: `Content-Length`, chunked (extensions, trailers, sizes split across
//!   reads), close-delimited, no body for HEAD, 204 and 304, 1xx before the answer, and
//!   `Transfer-Encoding` with `Content-Length` (RFC 9112 §6.3);
//! - connection reuse and its limits: one upstream connection for sequential requests,
//!   none reused after `Connection: close` or once the upstream closed it while idle;
//! - bad answers: malformed heads, bad chunk sizes, cut bodies, oversized heads, an
//!   upstream that hangs up or is too slow: 502/504 or a cut client connection, never a
//!   hang, never a desynchronised connection, and the gateway keeps serving;
//! - requests: body framing, the request line and the header lines as sent, and the
//!   `Host`/`X-Forwarded-*` fields the gateway sets;
//! - streaming: an 8 MB answer reaches the client before the upstream has sent all of it.
//! - an HTTP/1.0 backend: the client is answered in HTTP/1.1 and keeps its connection, a
//!   close-delimited body re-framed as chunked (close-delimited for an HTTP/1.0 client),
//!   as nginx does.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{upstream_and_store, Gateway, Store};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinSet;

/// The longest a test waits on the network for any one thing.
const WAIT: Duration = Duration::from_secs(10);
/// How long an upstream connection may sit waiting (for a request, a write, a go-ahead)
/// before the upstream gives up on it.
const UPSTREAM_IDLE: Duration = Duration::from_secs(30);
/// The largest head either side reads before calling it an error.
const MAX_HEAD: usize = 4 << 20;
/// What [`RawClient::answer`] says when nothing (or not all) came within [`WAIT`].
const TIMED_OUT: &str = "no whole answer within the wait";

// ---------------------------------------------------------------------------------------
// HTTP/1.1 on the wire, by hand

/// A TCP stream and what has been read from it but not yet consumed.
struct Wire {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Wire {
    fn new(stream: TcpStream) -> Wire {
        let _ = stream.set_nodelay(true);
        Wire {
            stream,
            buf: Vec::new(),
        }
    }

    /// Read once more into the buffer; false at the end of the stream.
    async fn fill(&mut self) -> Result<bool, String> {
        self.buf.reserve(64 * 1024);
        let n = self
            .stream
            .read_buf(&mut self.buf)
            .await
            .map_err(|e| format!("read failed: {e}"))?;
        Ok(n > 0)
    }

    /// A head, up to and including the blank line that ends it; `None` if the stream
    /// ended cleanly before its first byte.
    async fn head(&mut self) -> Result<Option<Vec<u8>>, String> {
        let mut from = 0;
        loop {
            if let Some(i) = find(&self.buf[from..], b"\r\n\r\n") {
                let end = from + i + 4;
                return Ok(Some(self.buf.drain(..end).collect()));
            }
            if self.buf.len() > MAX_HEAD {
                return Err(format!("a head longer than {MAX_HEAD} bytes"));
            }
            from = self.buf.len().saturating_sub(3);
            if !self.fill().await? {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(format!(
                        "the stream ended inside a head: {:?}",
                        String::from_utf8_lossy(&self.buf[..self.buf.len().min(200)])
                    ))
                };
            }
        }
    }

    /// One CRLF-terminated line, without its CRLF.
    async fn line(&mut self) -> Result<Vec<u8>, String> {
        let mut from = 0;
        loop {
            if let Some(i) = find(&self.buf[from..], b"\r\n") {
                let end = from + i;
                let line = self.buf[..end].to_vec();
                self.buf.drain(..end + 2);
                return Ok(line);
            }
            from = self.buf.len().saturating_sub(1);
            if !self.fill().await? {
                return Err("the stream ended inside a line".to_string());
            }
        }
    }

    /// Up to `max` bytes: what is buffered, or else one read's worth; empty at the end of
    /// the stream.
    async fn some(&mut self, max: usize) -> Result<Vec<u8>, String> {
        if self.buf.is_empty() && !self.fill().await? {
            return Ok(Vec::new());
        }
        let n = max.min(self.buf.len());
        Ok(self.buf.drain(..n).collect())
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A request or response head, as it was on the wire.
#[derive(Clone)]
struct Head {
    /// The request line or status line.
    start: String,
    /// The field lines in order: lowercased name, value without surrounding whitespace.
    fields: Vec<(String, Vec<u8>)>,
}

impl Head {
    fn parse(raw: &[u8]) -> Result<Head, String> {
        let text = raw.strip_suffix(b"\r\n\r\n").unwrap_or(raw);
        let mut lines = text
            .split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
        let start = lines.next().unwrap_or_default();
        let start = String::from_utf8(start.to_vec())
            .map_err(|_| format!("a start line that is not UTF-8: {start:?}"))?;
        let mut fields = Vec::new();
        for line in lines {
            let colon = line.iter().position(|&b| b == b':').ok_or_else(|| {
                format!(
                    "a field line without ':': {:?}",
                    String::from_utf8_lossy(line)
                )
            })?;
            let name = String::from_utf8_lossy(&line[..colon]).to_ascii_lowercase();
            fields.push((name, line[colon + 1..].trim_ascii().to_vec()));
        }
        Ok(Head { start, fields })
    }

    /// Every value of the field `name`, one per line, in order.
    fn all(&self, name: &str) -> Vec<&[u8]> {
        self.fields
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    /// The first value of the field `name`, as text.
    fn get(&self, name: &str) -> Option<String> {
        self.all(name)
            .first()
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    fn has(&self, name: &str) -> bool {
        !self.all(name).is_empty()
    }

    /// The status code of a status line.
    fn status(&self) -> Result<u16, String> {
        let mut parts = self.start.splitn(3, ' ');
        match (parts.next(), parts.next()) {
            (Some(v), Some(code)) if v.starts_with("HTTP/1.") && code.len() == 3 => code
                .parse()
                .map_err(|_| format!("a bad status line: {:?}", self.start)),
            _ => Err(format!("a bad status line: {:?}", self.start)),
        }
    }
}

impl std::fmt::Debug for Head {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fields: Vec<String> = self
            .fields
            .iter()
            .map(|(n, v)| format!("{n}: {}", lossy(v, 200)))
            .collect();
        f.debug_struct("Head")
            .field("start", &self.start)
            .field("fields", &fields)
            .finish()
    }
}

/// `bytes` as text, at most `max` bytes of them.
fn lossy(bytes: &[u8], max: usize) -> String {
    let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(max)]).into_owned();
    if bytes.len() > max {
        format!("{shown}... ({} bytes)", bytes.len())
    } else {
        shown
    }
}

/// How a message's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    None,
    Length(usize),
    Chunked,
    UntilClose,
}

fn is_chunked(head: &Head) -> Option<bool> {
    head.get("transfer-encoding")
        .map(|te| te.to_ascii_lowercase().trim_end().ends_with("chunked"))
}

fn content_length(head: &Head) -> Result<Option<usize>, String> {
    head.get("content-length")
        .map(|v| {
            v.parse()
                .map_err(|_| format!("a bad Content-Length: {v:?}"))
        })
        .transpose()
}

/// A request's framing (RFC 9112 §6.3: no framing fields, no body).
fn request_framing(head: &Head) -> Result<Framing, String> {
    match is_chunked(head) {
        Some(true) => Ok(Framing::Chunked),
        Some(false) => Err("a request Transfer-Encoding that is not chunked".to_string()),
        None => Ok(content_length(head)?.map_or(Framing::None, Framing::Length)),
    }
}

/// A response's framing (RFC 9112 §6.3).
fn response_framing(head: &Head, status: u16, head_request: bool) -> Result<Framing, String> {
    if head_request || status < 200 || status == 204 || status == 304 {
        return Ok(Framing::None);
    }
    match is_chunked(head) {
        Some(true) => Ok(Framing::Chunked),
        Some(false) => Ok(Framing::UntilClose),
        None => Ok(content_length(head)?.map_or(Framing::UntilClose, Framing::Length)),
    }
}

/// Reads a body piece by piece, as its framing says.
struct BodyReader {
    framing: Framing,
    /// Bytes left in the body (`Length`) or in the current chunk (`Chunked`).
    left: usize,
    /// A chunk's data was read and its CRLF was not.
    crlf_due: bool,
    done: bool,
    /// The trailer section's field lines of a chunked body.
    trailers: Vec<Vec<u8>>,
}

impl BodyReader {
    fn new(framing: Framing) -> BodyReader {
        BodyReader {
            framing,
            left: match framing {
                Framing::Length(n) => n,
                _ => 0,
            },
            crlf_due: false,
            done: framing == Framing::None,
            trailers: Vec::new(),
        }
    }

    /// The next piece of the decoded body; `None` at its end.
    async fn next(&mut self, wire: &mut Wire) -> Result<Option<Vec<u8>>, String> {
        if self.done {
            return Ok(None);
        }
        match self.framing {
            Framing::None => {
                self.done = true;
                Ok(None)
            }
            Framing::Length(n) => {
                if self.left == 0 {
                    self.done = true;
                    return Ok(None);
                }
                let piece = wire.some(self.left).await?;
                if piece.is_empty() {
                    return Err(format!(
                        "the stream ended {} bytes short of Content-Length {n}",
                        self.left
                    ));
                }
                self.left -= piece.len();
                Ok(Some(piece))
            }
            Framing::UntilClose => {
                let piece = wire.some(usize::MAX).await?;
                if piece.is_empty() {
                    self.done = true;
                    return Ok(None);
                }
                Ok(Some(piece))
            }
            Framing::Chunked => {
                if self.left == 0 {
                    if self.crlf_due {
                        let end = wire.line().await?;
                        if !end.is_empty() {
                            return Err("chunk data not followed by CRLF".to_string());
                        }
                        self.crlf_due = false;
                    }
                    let size = chunk_size(&wire.line().await?)?;
                    if size == 0 {
                        loop {
                            let field = wire.line().await?;
                            if field.is_empty() {
                                break;
                            }
                            self.trailers.push(field);
                        }
                        self.done = true;
                        return Ok(None);
                    }
                    self.left = size;
                }
                let piece = wire.some(self.left).await?;
                if piece.is_empty() {
                    return Err("the stream ended inside a chunk".to_string());
                }
                self.left -= piece.len();
                self.crlf_due = self.left == 0;
                Ok(Some(piece))
            }
        }
    }

    /// The rest of the body, decoded.
    async fn rest(&mut self, wire: &mut Wire) -> Result<Vec<u8>, String> {
        let mut body = Vec::new();
        while let Some(piece) = self.next(wire).await? {
            body.extend_from_slice(&piece);
        }
        Ok(body)
    }
}

/// The size on a chunk's size line (extensions after `;` ignored).
fn chunk_size(line: &[u8]) -> Result<usize, String> {
    let hex = line.split(|&b| b == b';').next().unwrap_or_default();
    std::str::from_utf8(hex)
        .ok()
        .and_then(|h| usize::from_str_radix(h.trim(), 16).ok())
        .ok_or_else(|| format!("a bad chunk size line: {:?}", String::from_utf8_lossy(line)))
}

// ---------------------------------------------------------------------------------------
// The scripted upstream

/// One request as the upstream read it.
#[derive(Debug, Clone)]
struct Received {
    /// Which upstream connection carried it (0 for the first one accepted).
    conn: usize,
    head: Head,
    framing: Framing,
    /// The body, decoded from its framing.
    body: Vec<u8>,
}

impl Received {
    fn method(&self) -> &str {
        self.head.start.split(' ').next().unwrap_or_default()
    }

    fn target(&self) -> &str {
        self.head.start.split(' ').nth(1).unwrap_or_default()
    }
}

/// What the upstream does in answer to one request, in order.
enum Step {
    /// Write these bytes (one write call).
    Write(Vec<u8>),
    Sleep(Duration),
    /// Wait for the test's go-ahead.
    Wait(Arc<Notify>),
    /// Send FIN and drop the connection, reading nothing more from it.
    Close,
}

type Script = dyn Fn(&Received) -> Vec<Step> + Send + Sync;

/// A raw TCP upstream on 127.0.0.1 that answers each request as its script says; after the
/// steps it reads the connection's next request, unless a step closed it.
struct ScriptedUpstream {
    addr: std::net::SocketAddr,
    accepted: Arc<AtomicUsize>,
    received: Arc<Mutex<Vec<Received>>>,
    /// Requests whose steps have all run (a `Close` included).
    played: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl ScriptedUpstream {
    async fn start(script: impl Fn(&Received) -> Vec<Step> + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the upstream");
        let addr = listener.local_addr().expect("upstream address");
        let accepted = Arc::new(AtomicUsize::new(0));
        let received = Arc::new(Mutex::new(Vec::new()));
        let played = Arc::new(AtomicUsize::new(0));
        let script: Arc<Script> = Arc::new(script);
        let (count, log, done) = (accepted.clone(), received.clone(), played.clone());
        let task = tokio::spawn(async move {
            // Dropped (aborting every connection) when the upstream is.
            let mut conns = JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let conn = count.fetch_add(1, Ordering::SeqCst);
                conns.spawn(serve_upstream_conn(
                    Wire::new(stream),
                    conn,
                    script.clone(),
                    log.clone(),
                    done.clone(),
                ));
                while conns.try_join_next().is_some() {}
            }
        });
        ScriptedUpstream {
            addr,
            accepted,
            received,
            played,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many connections the upstream has accepted.
    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Wait until the steps of `n` requests in all have run (at most 10 s).
    async fn wait_played(&self, n: usize) {
        let end = Instant::now() + Duration::from_secs(10);
        while self.played.load(Ordering::SeqCst) < n {
            assert!(
                Instant::now() < end,
                "the upstream's script never ran to its end"
            );
            tokio::time::sleep(ms(10)).await;
        }
    }
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_upstream_conn(
    mut wire: Wire,
    conn: usize,
    script: Arc<Script>,
    received: Arc<Mutex<Vec<Received>>>,
    played: Arc<AtomicUsize>,
) {
    loop {
        let Ok(Ok(Some(raw))) = tokio::time::timeout(UPSTREAM_IDLE, wire.head()).await else {
            return;
        };
        let Ok(head) = Head::parse(&raw) else { return };
        let Ok(framing) = request_framing(&head) else {
            return;
        };
        let mut reader = BodyReader::new(framing);
        let Ok(Ok(body)) = tokio::time::timeout(UPSTREAM_IDLE, reader.rest(&mut wire)).await else {
            return;
        };
        let request = Received {
            conn,
            head,
            framing,
            body,
        };
        let steps = script(&request);
        received.lock().unwrap().push(request);
        for step in steps {
            match step {
                Step::Write(bytes) => {
                    let write = tokio::time::timeout(UPSTREAM_IDLE, wire.stream.write_all(&bytes));
                    if !matches!(write.await, Ok(Ok(()))) {
                        return;
                    }
                }
                Step::Sleep(d) => tokio::time::sleep(d).await,
                Step::Wait(go) => {
                    let _ = tokio::time::timeout(UPSTREAM_IDLE, go.notified()).await;
                }
                Step::Close => {
                    let _ = wire.stream.shutdown().await;
                    played.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
        }
        played.fetch_add(1, Ordering::SeqCst);
    }
}

/// A whole `200 OK` with a `Content-Length` body.
fn ok(body: &[u8]) -> Vec<u8> {
    let mut r = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
    r.extend_from_slice(body);
    r
}

/// `len` bytes that differ with `seed`, so that one answer is never taken for another.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31).wrapping_add(usize::from(seed) * 7) % 251) as u8)
        .collect()
}

/// `bytes` as writes of `size` bytes with a short pause before each.
fn in_pieces(bytes: &[u8], size: usize) -> Vec<Step> {
    bytes
        .chunks(size)
        .flat_map(|piece| {
            [
                Step::Sleep(Duration::from_millis(5)),
                Step::Write(piece.to_vec()),
            ]
        })
        .collect()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

// ---------------------------------------------------------------------------------------
// The gateway and a raw client

/// The gateway in front of `upstream`: one worker, the memory store, no rules, connect
/// timeout 1 s and an answer timeout of a minute ([`SLOW_TIMEOUT`]): an answer within
/// [`WAIT`] did not come from that clock, however loaded the machine.
fn gateway(upstream: &ScriptedUpstream) -> Gateway {
    gateway_with_timeout(upstream, SLOW_TIMEOUT)
}

/// The answer timeout of [`gateway`], far past [`WAIT`].
const SLOW_TIMEOUT: &str = "60s";

/// The same with the upstream answer timeout `timeout`.
fn gateway_with_timeout(upstream: &ScriptedUpstream, timeout: &str) -> Gateway {
    Gateway::start(&format!(
        "workers = 1\n[upstream]\nurl = \"{}\"\nconnect_timeout = \"1s\"\ntimeout = \"{timeout}\"\n{}",
        upstream.url(),
        Store::Memory.toml()
    ))
}

fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: upstream.test\r\n\r\n").into_bytes()
}

/// A response as the raw client read it.
struct Answer {
    status: u16,
    head: Head,
    body: Vec<u8>,
    /// The 1xx status codes that came before it.
    informational: Vec<u16>,
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answer")
            .field("status", &self.status)
            .field("head", &self.head)
            .field("body", &lossy(&self.body, 300))
            .field("informational", &self.informational)
            .finish()
    }
}

/// One client connection to the gateway, speaking HTTP/1.1 by hand.
struct RawClient {
    wire: Wire,
}

impl RawClient {
    async fn connect(port: u16) -> RawClient {
        let stream = tokio::time::timeout(WAIT, TcpStream::connect(("127.0.0.1", port)))
            .await
            .expect("connect to the gateway within the wait")
            .expect("connect to the gateway");
        RawClient {
            wire: Wire::new(stream),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        tokio::time::timeout(WAIT, self.wire.stream.write_all(bytes))
            .await
            .expect("the gateway takes the request within the wait")
            .expect("write to the gateway");
    }

    /// The head of the next final answer (1xx skipped, but listed), and a reader for its
    /// body.
    async fn answer_head(
        &mut self,
        head_request: bool,
    ) -> Result<(u16, Head, Vec<u16>, BodyReader), String> {
        let mut informational = Vec::new();
        loop {
            let raw = self
                .wire
                .head()
                .await?
                .ok_or("the gateway closed the connection before an answer")?;
            let head = Head::parse(&raw)?;
            let status = head.status()?;
            if (100..200).contains(&status) {
                informational.push(status);
                continue;
            }
            let framing = response_framing(&head, status, head_request)?;
            return Ok((status, head, informational, BodyReader::new(framing)));
        }
    }

    /// The next whole answer. An error if the connection failed or ended inside it, or
    /// ([`TIMED_OUT`]) if it was not all there within [`WAIT`].
    async fn answer(&mut self, head_request: bool) -> Result<Answer, String> {
        let read = async {
            let (status, head, informational, mut body) = self.answer_head(head_request).await?;
            let body = body.rest(&mut self.wire).await?;
            Ok(Answer {
                status,
                head,
                body,
                informational,
            })
        };
        tokio::time::timeout(WAIT, read)
            .await
            .unwrap_or_else(|_| Err(TIMED_OUT.to_string()))
    }

    /// Send `request` and read its answer, which must come whole.
    async fn exchange(&mut self, request: &[u8]) -> Answer {
        self.send(request).await;
        let line = request.split(|&b| b == b'\r').next().unwrap_or_default();
        let line = String::from_utf8_lossy(line).into_owned();
        self.answer(request.starts_with(b"HEAD "))
            .await
            .unwrap_or_else(|e| panic!("{line}: {e}"))
    }
}

/// `GET path` on a new client connection answers 200 with `body`: the gateway still serves.
async fn still_serves(gw: &Gateway, path: &str, body: &[u8]) {
    let a = RawClient::connect(gw.port).await.exchange(&get(path)).await;
    assert_eq!(a.status, 200, "the gateway stopped serving: {a:?}");
    assert_eq!(a.body, body, "the gateway stopped serving: {a:?}");
}

// ---------------------------------------------------------------------------------------
// Response framing and connection reuse

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_body_arrives_intact_and_the_upstream_connection_is_reused() {
    let _watch = common::watchdog();
    const LEN: usize = 100 * 1024;
    let up = ScriptedUpstream::start(|req| {
        let seed: u8 = req.target().trim_start_matches("/r/").parse().unwrap_or(0);
        let mut steps = vec![Step::Write(
            format!("HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {LEN}\r\n\r\n")
                .into_bytes(),
        )];
        steps.extend(in_pieces(&pattern(seed, LEN), 30_011));
        steps
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    for seed in 0..5u8 {
        let a = client.exchange(&get(&format!("/r/{seed}"))).await;
        assert_eq!(a.status, 200, "request {seed}: {:?}", a.head);
        assert_eq!(a.body.len(), LEN, "request {seed}: body length");
        assert!(
            a.body == pattern(seed, LEN),
            "request {seed}: the body's bytes differ"
        );
    }
    let received = up.received();
    assert_eq!(received.len(), 5);
    assert_eq!(
        up.accepted(),
        1,
        "5 sequential requests took {} upstream connections",
        up.accepted()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_body_with_extensions_and_trailers_arrives_as_exactly_its_bytes() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| {
        if req.target() != "/chunked" {
            return vec![Step::Write(ok(b"next"))];
        }
        // Heads, size lines, data and the trailer section all split across writes; the
        // second chunk's size line "10" is cut between its digits.
        let parts: [&[u8]; 8] = [
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-",
            b"Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n5;foo=bar\r\nhel",
            b"lo\r\n1",
            b"0;a=1;b=\"x y\"\r\n01234567",
            b"89abcdef\r",
            b"\n3\r\n!!!\r\n0\r\nX-Check",
            b"sum: abc\r\nX-Other: 1\r\n",
            b"\r\n",
        ];
        parts
            .iter()
            .flat_map(|p| [Step::Sleep(ms(20)), Step::Write(p.to_vec())])
            .collect()
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    let a = client.exchange(&get("/chunked")).await;
    assert_eq!(a.status, 200, "{:?}", a.head);
    assert_eq!(
        String::from_utf8_lossy(&a.body),
        "hello0123456789abcdef!!!",
        "the body, and nothing of the framing"
    );
    // The trailer section was consumed with the body: the next answer is its own.
    let a = client.exchange(&get("/next")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"next"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_delimited_body_arrives_intact_and_the_next_request_gets_a_new_connection() {
    let _watch = common::watchdog();
    const LEN: usize = 50 * 1024;
    let up = ScriptedUpstream::start(|req| {
        if req.target() != "/until-close" {
            return vec![Step::Write(ok(b"next"))];
        }
        // Neither Content-Length nor Transfer-Encoding: the body ends when the
        // connection does.
        let mut steps = vec![Step::Write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n".to_vec(),
        )];
        steps.extend(in_pieces(&pattern(9, LEN), 7_001));
        steps.push(Step::Sleep(ms(50)));
        steps.push(Step::Close);
        steps
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    let a = client.exchange(&get("/until-close")).await;
    assert_eq!(a.status, 200, "{:?}", a.head);
    assert_eq!(a.body.len(), LEN);
    assert!(a.body == pattern(9, LEN), "the body's bytes differ");
    let a = client.exchange(&get("/next")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"next"[..]));
    assert_eq!(
        up.accepted(),
        2,
        "the closed connection cannot carry the next request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_close_from_the_upstream_is_honoured_with_a_fresh_connection() {
    let _watch = common::watchdog();
    // The upstream says `Connection: close` but leaves the socket open: only the header
    // tells the gateway not to send anything more on it.
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/closing" => vec![Step::Write(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 7\r\n\r\nclosing".to_vec(),
        )],
        _ => vec![Step::Write(ok(b"next"))],
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    let a = client.exchange(&get("/closing")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"closing"[..]));
    assert!(
        a.head
            .get("connection")
            .is_none_or(|c| !c.eq_ignore_ascii_case("close")),
        "the upstream's hop-by-hop Connection reached the client: {:?}",
        a.head
    );
    // The client's own connection stays open and carries the next request.
    let a = client.exchange(&get("/next")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"next"[..]));
    let received = up.received();
    assert_eq!(received.len(), 2);
    assert_ne!(
        received[0].conn, received[1].conn,
        "the request after `Connection: close` went on the same upstream connection"
    );
    assert_eq!(up.accepted(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_answer_has_no_body_and_the_connections_stay_in_step() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.method() {
        // The length a GET would have; no body follows, and the socket stays open.
        "HEAD" => vec![Step::Write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1234\r\n\r\n".to_vec(),
        )],
        _ => vec![Step::Write(ok(b"after head"))],
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    let start = Instant::now();
    let a = client
        .exchange(b"HEAD /doc HTTP/1.1\r\nHost: upstream.test\r\n\r\n")
        .await;
    // Not a wait for 1234 bytes of body until the answer timeout (a minute).
    assert!(
        start.elapsed() < WAIT,
        "the HEAD answer took {:?}",
        start.elapsed()
    );
    assert_eq!(a.status, 200, "{:?}", a.head);
    assert_eq!(
        a.head.get("content-length").as_deref(),
        Some("1234"),
        "a HEAD answer keeps the length a GET would have (RFC 9110 §9.3.2): {:?}",
        a.head
    );
    // Nothing after the head: the next answer on the connection must parse as its own.
    let a = client.exchange(&get("/after")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"after head"[..]));
    let received = up.received();
    assert_eq!(
        received.iter().map(Received::method).collect::<Vec<_>>(),
        ["HEAD", "GET"]
    );
    // A HEAD answer that announces a body (its Content-Length) has an ambiguous end: a
    // faulty upstream could still write that body, which the next request on the
    // connection would read as its answer. Its connection is not used again.
    assert_eq!(
        up.accepted(),
        2,
        "the upstream connection is not reused after a HEAD answer announcing a body"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_content_and_not_modified_have_no_body_and_the_connection_stays_in_step() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/204" => vec![Step::Write(
            b"HTTP/1.1 204 No Content\r\nX-Kind: none\r\n\r\n".to_vec(),
        )],
        // A 304's Content-Length is the representation's, not a body's (RFC 9110 §8.6).
        "/304" => vec![Step::Write(
            b"HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nContent-Length: 1234\r\n\r\n".to_vec(),
        )],
        _ => vec![Step::Write(ok(b"after"))],
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    let a = client.exchange(&get("/204")).await;
    assert_eq!(a.status, 204, "{:?}", a.head);
    assert_eq!(a.head.get("x-kind").as_deref(), Some("none"));
    let a = client.exchange(&get("/after")).await;
    assert_eq!(
        (a.status, &a.body[..]),
        (200, &b"after"[..]),
        "after the 204"
    );
    let a = client
        .exchange(b"GET /304 HTTP/1.1\r\nHost: upstream.test\r\nIf-None-Match: \"v1\"\r\n\r\n")
        .await;
    assert_eq!(a.status, 304, "{:?}", a.head);
    assert_eq!(a.head.get("etag").as_deref(), Some("\"v1\""));
    let a = client.exchange(&get("/after")).await;
    assert_eq!(
        (a.status, &a.body[..]),
        (200, &b"after"[..]),
        "after the 304"
    );
    assert_eq!(up.received().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn informational_answers_before_the_final_one_leave_the_final_answer_intact() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/hints" => vec![
            Step::Write(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec()),
            Step::Sleep(ms(30)),
            Step::Write(
                b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload; as=style\r\n\r\n"
                    .to_vec(),
            ),
            Step::Sleep(ms(30)),
            Step::Write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Final: yes\r\n\r\nfinal".to_vec(),
            ),
        ],
        _ => vec![Step::Write(ok(b"next"))],
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    let a = client.exchange(&get("/hints")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"final"[..]), "{a:?}");
    assert_eq!(a.head.get("x-final").as_deref(), Some("yes"));
    assert!(
        a.informational.iter().all(|s| [100, 103].contains(s)),
        "only the upstream's own 1xx may be passed on: {:?}",
        a.informational
    );
    let a = client.exchange(&get("/next")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"next"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_with_content_length_is_read_as_chunked_or_refused_never_desynchronised() {
    let _watch = common::watchdog();
    // RFC 9112 §6.3: Transfer-Encoding overrides Content-Length. Read by the
    // Content-Length, the body would be "5\r\n" and the rest would pass for the next
    // answer on the connection.
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/both" => vec![Step::Write(
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
        )],
        _ => vec![Step::Write(ok(b"second"))],
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    client.send(&get("/both")).await;
    let closing = match client.answer(false).await {
        Ok(a) if a.status == 502 => a.head.get("connection").as_deref() == Some("close"),
        Ok(a) => {
            assert_eq!(a.status, 200, "{a:?}");
            assert_eq!(
                String::from_utf8_lossy(&a.body),
                "hello",
                "the body was not decoded as chunked: {a:?}"
            );
            a.head.get("connection").as_deref() == Some("close")
        }
        Err(e) => panic!("neither the chunked body nor a 502: {e}"),
    };
    // On the same client connection if it stays open: bytes of the first answer past
    // its own framing would be read as the start of this one.
    if closing {
        client = RawClient::connect(gw.port).await;
    }
    let a = client.exchange(&get("/second")).await;
    assert_eq!(
        (a.status, String::from_utf8_lossy(&a.body).as_ref()),
        (200, "second"),
        "the next request got another answer than its own"
    );
}

// ---------------------------------------------------------------------------------------
// Bad answers

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_response_heads_are_502_and_the_gateway_keeps_serving() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| {
        let bytes: &[u8] = match req.target() {
            "/garbage" => b"this is not HTTP at all\r\n\r\n",
            "/binary" => b"\x00\x01\x02\xff\xfe\r\n\r\n",
            "/bad-code" => b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\nok",
            "/long-code" => b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\nok",
            "/bad-version" => b"HTTP/9.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            "/bad-field" => b"HTTP/1.1 200 OK\r\nBad Name: x\r\nContent-Length: 2\r\n\r\nok",
            "/no-colon" => b"HTTP/1.1 200 OK\r\nNoColonHere\r\nContent-Length: 2\r\n\r\nok",
            "/bad-length" => b"HTTP/1.1 200 OK\r\nContent-Length: twelve\r\n\r\nok",
            _ => return vec![Step::Write(ok(b"fine"))],
        };
        // The socket stays open: the parser alone must notice.
        vec![Step::Write(bytes.to_vec())]
    })
    .await;
    let gw = gateway(&up);
    for path in [
        "/garbage",
        "/binary",
        "/bad-code",
        "/long-code",
        "/bad-version",
        "/bad-field",
        "/no-colon",
        "/bad-length",
    ] {
        let start = Instant::now();
        let a = RawClient::connect(gw.port).await.exchange(&get(path)).await;
        assert_eq!(a.status, 502, "{path}: {a:?}");
        // At once, not at the answer timeout (a minute).
        assert!(
            start.elapsed() < WAIT,
            "{path}: 502 after {:?}",
            start.elapsed()
        );
        still_serves(&gw, "/fine", b"fine").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chunk_size_never_reaches_the_client_as_a_whole_answer() {
    let _watch = common::watchdog();
    // The head is fine, so the answer may have begun; the client must then see it cut,
    // never completed as if the body were whole.
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/bad-chunk" => vec![Step::Write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
        )],
        "/bad-later-chunk" => vec![
            Step::Write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n".to_vec(),
            ),
            Step::Sleep(ms(50)),
            Step::Write(b"-1\r\nx\r\n0\r\n\r\n".to_vec()),
        ],
        _ => vec![Step::Write(ok(b"fine"))],
    })
    .await;
    let gw = gateway(&up);
    for path in ["/bad-chunk", "/bad-later-chunk"] {
        let mut client = RawClient::connect(gw.port).await;
        client.send(&get(path)).await;
        match client.answer(false).await {
            Ok(a) => assert_eq!(
                a.status, 502,
                "{path}: a broken body passed as whole: {a:?}"
            ),
            Err(e) => assert_ne!(e, TIMED_OUT, "{path}: the client was left hanging"),
        }
        still_serves(&gw, "/fine", b"fine").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_body_cut_short_never_reaches_the_client_as_whole() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/cut" => vec![
            Step::Write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n".to_vec()),
            Step::Write(pattern(1, 100)),
            Step::Sleep(ms(50)),
            Step::Close,
        ],
        _ => vec![Step::Write(ok(b"fine"))],
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    client.send(&get("/cut")).await;
    match client.answer(false).await {
        Ok(a) => assert_eq!(a.status, 502, "a cut body passed as whole: {a:?}"),
        Err(e) => assert_ne!(e, TIMED_OUT, "the client was left hanging"),
    }
    still_serves(&gw, "/fine", b"fine").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_after_a_whole_answer_are_never_taken_for_the_next_answer() {
    let _watch = common::watchdog();
    // A second, unasked-for answer right behind the first, in the same write.
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/first" => vec![Step::Write(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirstHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nevil!"
                .to_vec(),
        )],
        _ => vec![Step::Write(ok(b"second"))],
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    let a = client.exchange(&get("/first")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"first"[..]));
    // A moment for the gateway to put the first connection back in its pool (real time on
    // purpose: nothing shows when it has), where the next request would find it.
    tokio::time::sleep(ms(100)).await;
    let a = client.exchange(&get("/second")).await;
    assert_eq!(
        (a.status, String::from_utf8_lossy(&a.body).as_ref()),
        (200, "second"),
        "the second request got another answer than its own"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_closing_without_an_answer_is_a_quick_502() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/vanish" => vec![Step::Close],
        _ => vec![Step::Write(ok(b"fine"))],
    })
    .await;
    // The upstream timeout is a minute: the 502 must come from the closed connection.
    let gw = gateway(&up);
    let start = Instant::now();
    let a = RawClient::connect(gw.port)
        .await
        .exchange(&get("/vanish"))
        .await;
    assert_eq!(a.status, 502, "{a:?}");
    assert!(start.elapsed() < WAIT, "502 after {:?}", start.elapsed());
    assert!(up.received().iter().any(|r| r.target() == "/vanish"));
    still_serves(&gw, "/fine", b"fine").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connection_closed_by_the_upstream_does_not_fail_the_next_request() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/one" => vec![Step::Write(ok(b"one")), Step::Sleep(ms(200)), Step::Close],
        _ => vec![Step::Write(ok(b"two"))],
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    let a = client.exchange(&get("/one")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"one"[..]));
    // The pooled upstream connection goes stale meanwhile: the upstream closed it.
    up.wait_played(1).await;
    let a = client.exchange(&get("/two")).await;
    assert_eq!(
        (a.status, &a.body[..]),
        (200, &b"two"[..]),
        "a stale pooled connection failed the request: {a:?}"
    );
    assert_eq!(up.accepted(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_head_over_64_kib_is_502_and_the_gateway_keeps_serving() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/big-head" => {
            let mut head = b"HTTP/1.1 200 OK\r\nX-Big: ".to_vec();
            head.extend(std::iter::repeat_n(b'a', 100 * 1024));
            head.extend_from_slice(b"\r\nContent-Length: 2\r\n\r\nok");
            vec![Step::Write(head)]
        }
        _ => vec![Step::Write(ok(b"fine"))],
    })
    .await;
    let gw = gateway(&up);
    let start = Instant::now();
    let mut client = RawClient::connect(gw.port).await;
    let a = client.exchange(&get("/big-head")).await;
    assert_eq!(
        a.status, 502,
        "status {}, head of {:?}",
        a.status, a.head.start
    );
    // At once, not at the answer timeout (a minute).
    assert!(start.elapsed() < WAIT, "after {:?}", start.elapsed());
    still_serves(&gw, "/fine", b"fine").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_head_of_a_megabyte_is_502_and_the_gateway_keeps_serving() {
    let _watch = common::watchdog();
    // Far beyond any head buffer, and sent without its end: a client without a limit
    // would wait (and buffer) until the upstream timeout.
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/huge-head" => {
            let mut steps = vec![Step::Write(b"HTTP/1.1 200 OK\r\n".to_vec())];
            let line = format!("X-Filler: {}\r\n", "b".repeat(8 * 1024)).into_bytes();
            for _ in 0..128 {
                steps.push(Step::Write(line.clone()));
            }
            steps
        }
        _ => vec![Step::Write(ok(b"fine"))],
    })
    .await;
    let gw = gateway(&up);
    let start = Instant::now();
    let a = RawClient::connect(gw.port)
        .await
        .exchange(&get("/huge-head"))
        .await;
    assert_eq!(a.status, 502, "{:?}", a.head);
    // At once, not at the answer timeout (a minute).
    assert!(start.elapsed() < WAIT, "502 after {:?}", start.elapsed());
    still_serves(&gw, "/fine", b"fine").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_with_many_header_lines_passes_whole() {
    let _watch = common::watchdog();
    // 150 short `Set-Cookie` lines: under 4 KiB of head in all.
    let up = ScriptedUpstream::start(|_| {
        let mut r = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..150 {
            r.extend_from_slice(format!("Set-Cookie: c{i}=v\r\n").as_bytes());
        }
        r.extend_from_slice(b"Content-Length: 2\r\n\r\nok");
        vec![Step::Write(r)]
    })
    .await;
    let gw = gateway(&up);
    let a = RawClient::connect(gw.port)
        .await
        .exchange(&get("/cookies"))
        .await;
    assert_eq!(
        (a.status, &a.body[..]),
        (200, &b"ok"[..]),
        "{:?}",
        a.head.start
    );
    assert_eq!(
        a.head.all("set-cookie").len(),
        150,
        "every Set-Cookie line arrives"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_slower_than_the_timeout_is_504() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/slow" => vec![
            Step::Sleep(Duration::from_secs(2)),
            Step::Write(ok(b"late")),
        ],
        _ => vec![Step::Write(ok(b"fast"))],
    })
    .await;
    let gw = gateway_with_timeout(&up, "300ms");
    let mut client = RawClient::connect(gw.port).await;
    let start = Instant::now();
    let a = client.exchange(&get("/slow")).await;
    let took = start.elapsed();
    // A 504, not the upstream's 200 two seconds in: the timeout's; and not before it.
    assert_eq!(a.status, 504, "{a:?}");
    assert!(took >= ms(250), "504 after {took:?} with a 300 ms timeout");
    let a = client.exchange(&get("/fast")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"fast"[..]));
}

// ---------------------------------------------------------------------------------------
// Requests as they reach the upstream

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_arrive_with_their_exact_bytes_and_framing() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| {
        vec![Step::Write(
            ok(format!("got {}", req.body.len()).as_bytes()),
        )]
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;

    // A Content-Length body, written in pieces.
    let cl_body = pattern(3, 10_000);
    client
        .send(b"POST /cl HTTP/1.1\r\nHost: upstream.test\r\nContent-Type: application/octet-stream\r\nContent-Length: 10000\r\n\r\n")
        .await;
    for piece in cl_body.chunks(3_333) {
        // Pacing on purpose: the pieces arrive as separate reads.
        tokio::time::sleep(ms(5)).await;
        client.send(piece).await;
    }
    let a = client.answer(false).await.expect("answer to the CL body");
    assert_eq!((a.status, &a.body[..]), (200, &b"got 10000"[..]));

    // A chunked body with an extension and a trailer, the chunks in separate writes.
    let big = pattern(4, 4096);
    client
        .send(b"POST /chunked HTTP/1.1\r\nHost: upstream.test\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n")
        .await;
    tokio::time::sleep(ms(20)).await;
    client.send(b"1000\r\n").await;
    client.send(&big).await;
    client.send(b"\r\n").await;
    tokio::time::sleep(ms(20)).await;
    client.send(b"0\r\nX-Trailer: t\r\n\r\n").await;
    let a = client
        .answer(false)
        .await
        .expect("answer to the chunked body");
    assert_eq!((a.status, &a.body[..]), (200, &b"got 4101"[..]));

    // An empty body, then none: nothing of the earlier bodies may spill into them.
    let a = client
        .exchange(b"PUT /empty HTTP/1.1\r\nHost: upstream.test\r\nContent-Length: 0\r\n\r\n")
        .await;
    assert_eq!((a.status, &a.body[..]), (200, &b"got 0"[..]));
    let a = client.exchange(&get("/after")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"got 0"[..]));

    let received = up.received();
    let targets: Vec<_> = received.iter().map(Received::target).collect();
    assert_eq!(targets, ["/cl", "/chunked", "/empty", "/after"]);
    for r in &received {
        assert!(
            !(r.head.has("content-length") && r.head.has("transfer-encoding")),
            "{}: both Content-Length and Transfer-Encoding: {:?}",
            r.target(),
            r.head
        );
    }
    assert_eq!(received[0].framing, Framing::Length(10_000));
    assert!(received[0].body == cl_body, "the CL body's bytes differ");
    let mut chunked_body = b"hello".to_vec();
    chunked_body.extend_from_slice(&big);
    assert!(
        matches!(
            received[1].framing,
            Framing::Chunked | Framing::Length(4101)
        ),
        "the chunked body reached the upstream as {:?}",
        received[1].framing
    );
    assert!(
        received[1].body == chunked_body,
        "the chunked body's bytes differ"
    );
    assert!(
        matches!(received[2].framing, Framing::Length(0) | Framing::None),
        "{:?}",
        received[2].framing
    );
    assert!(received[2].body.is_empty());
    assert!(
        matches!(received[3].framing, Framing::Length(0) | Framing::None),
        "a GET without a body reached the upstream as {:?}",
        received[3].framing
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_line_and_header_lines_arrive_as_sent_with_forwarding_fields() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|_| vec![Step::Write(ok(b"seen"))]).await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    let patch = b"PATCH /a/b?x=1&y=%20 HTTP/1.1\r\nHost: app.example:8443\r\n\
        X-Multi: one\r\nX-Other: between\r\nX-Multi: two\r\n\
        X-Bytes: caf\xc3\xa9\t\"q\" ;, =x\r\nX-Forwarded-For: 10.1.2.3\r\n\
        Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        .to_vec();
    let a = client.exchange(&patch).await;
    assert_eq!(a.status, 200, "{a:?}");
    let others: [&[u8]; 3] = [
        b"DELETE /items/7?force=true HTTP/1.1\r\nHost: app.example\r\n\r\n",
        b"OPTIONS /a%2Fb/~c;p=1?q=a+b&q=%C3%A9 HTTP/1.1\r\nHost: app.example\r\n\r\n",
        b"GET /x?empty=&flag HTTP/1.1\r\nHost: app.example\r\n\r\n",
    ];
    for request in others {
        let a = client.exchange(request).await;
        assert_eq!(a.status, 200, "{a:?}");
    }

    let received = up.received();
    let lines: Vec<_> = received.iter().map(|r| r.head.start.as_str()).collect();
    assert_eq!(
        lines,
        [
            "PATCH /a/b?x=1&y=%20 HTTP/1.1",
            "DELETE /items/7?force=true HTTP/1.1",
            "OPTIONS /a%2Fb/~c;p=1?q=a+b&q=%C3%A9 HTTP/1.1",
            "GET /x?empty=&flag HTTP/1.1",
        ]
    );
    let h = &received[0].head;
    assert_eq!(
        h.all("x-multi"),
        [&b"one"[..], &b"two"[..]],
        "both X-Multi lines, in order: {h:?}"
    );
    assert_eq!(h.all("x-other"), [&b"between"[..]]);
    assert_eq!(
        h.all("x-bytes"),
        [&b"caf\xc3\xa9\t\"q\" ;, =x"[..]],
        "the value's bytes"
    );
    assert_eq!(h.get("content-type").as_deref(), Some("application/json"));
    assert_eq!(received[0].body, b"{}");
    assert_eq!(
        h.all("host"),
        [&b"app.example:8443"[..]],
        "the client's Host, once"
    );
    assert_eq!(
        h.get("x-forwarded-host").as_deref(),
        Some("app.example:8443")
    );
    assert_eq!(h.get("x-forwarded-proto").as_deref(), Some("http"));
    // No trusted proxies: what the client said of its forwarding is replaced by the peer.
    assert_eq!(
        h.all("x-forwarded-for"),
        [&b"127.0.0.1"[..]],
        "an untrusted peer's X-Forwarded-For is replaced, on one line"
    );
    assert_eq!(h.get("x-real-ip").as_deref(), Some("127.0.0.1"));
    assert_eq!(
        h.get("forwarded").as_deref(),
        Some("for=127.0.0.1;proto=http")
    );
    let h = &received[1].head;
    assert_eq!(h.get("host").as_deref(), Some("app.example"));
    assert_eq!(h.get("x-forwarded-for").as_deref(), Some("127.0.0.1"));
    assert_eq!(h.get("x-forwarded-host").as_deref(), Some("app.example"));
}

// ---------------------------------------------------------------------------------------
// Streaming

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_answer_streams_to_the_client_before_the_upstream_has_sent_it_all() {
    let _watch = common::watchdog();
    const MB: usize = 1 << 20;
    const LEN: usize = 8 * MB;
    let go = Arc::new(Notify::new());
    let upstream_go = go.clone();
    let up = ScriptedUpstream::start(move |_| {
        let body = pattern(8, LEN);
        vec![
            Step::Write(format!("HTTP/1.1 200 OK\r\nContent-Length: {LEN}\r\n\r\n").into_bytes()),
            Step::Write(body[..MB].to_vec()),
            // The rest only once the client has read the first megabyte.
            Step::Wait(upstream_go.clone()),
            Step::Write(body[MB..].to_vec()),
        ]
    })
    .await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    client.send(&get("/big")).await;
    let first = async {
        let (status, _, _, mut reader) = client.answer_head(false).await?;
        let mut body = Vec::new();
        while body.len() < MB {
            let piece = reader
                .next(&mut client.wire)
                .await?
                .ok_or("the body ended early")?;
            body.extend_from_slice(&piece);
        }
        Ok::<_, String>((status, reader, body))
    };
    let (status, mut reader, mut body) = tokio::time::timeout(WAIT, first)
        .await
        .expect("the first megabyte reached the client while the upstream held back the rest")
        .expect("the first megabyte");
    assert_eq!(status, 200);
    go.notify_one();
    let rest = tokio::time::timeout(WAIT, reader.rest(&mut client.wire))
        .await
        .expect("the rest within the wait")
        .expect("the rest");
    body.extend_from_slice(&rest);
    assert_eq!(body.len(), LEN);
    assert!(body == pattern(8, LEN), "the body's bytes differ");
}

// ---------------------------------------------------------------------------------------
// Early answers to uploads, and idle connections the upstream closed

/// An upstream that answers each connection's request as soon as its head is in, without
/// reading the body; then either closes (`close`) or holds the connection unread.
async fn early_answerer(
    answer: &'static [u8],
    close: bool,
) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut wire = Wire::new(stream);
                if !matches!(wire.head().await, Ok(Some(_))) {
                    return;
                }
                let _ = wire.stream.write_all(answer).await;
                if !close {
                    tokio::time::sleep(WAIT).await;
                }
            });
        }
    });
    (url, task)
}

/// Send a request with a 20 MB body (written on its own task), and read the answer's head.
async fn upload_and_read_head(port: u16) -> Result<(Head, Duration), String> {
    let stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let (mut rd, mut wr) = stream.into_split();
    let writer = tokio::spawn(async move {
        let head =
            "POST /upload HTTP/1.1\r\nHost: upstream.test\r\nContent-Length: 20000000\r\n\r\n";
        if wr.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..(20_000_000 / chunk.len() + 1) {
            if wr.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let start = Instant::now();
    let mut buf = Vec::new();
    let head = tokio::time::timeout(WAIT, async {
        loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                return Head::parse(&buf[..i + 4]);
            }
            let mut chunk = [0u8; 4096];
            match rd.read(&mut chunk).await {
                Ok(0) | Err(_) => return Err("closed before an answer".to_string()),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .map_err(|_| TIMED_OUT.to_string())??;
    writer.abort();
    Ok((head, start.elapsed()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_before_the_whole_upload_reaches_the_client_at_once() {
    let _watch = common::watchdog();
    const TOO_LARGE: &[u8] =
        b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    // The upstream that answers and closes, and the one that answers and stops reading.
    for close in [true, false] {
        let (url, upstream) = early_answerer(TOO_LARGE, close).await;
        let gw = Gateway::start(&format!(
            "workers = 1\n[upstream]\nurl = \"{url}\"\nconnect_timeout = \"1s\"\n\
             timeout = \"{SLOW_TIMEOUT}\"\n{}",
            Store::Memory.toml()
        ));
        let (head, took) = upload_and_read_head(gw.port)
            .await
            .unwrap_or_else(|e| panic!("close = {close}: {e}"));
        assert_eq!(head.status(), Ok(413), "close = {close}: {head:?}");
        assert!(
            took < WAIT,
            "close = {close}: the 413 came after {took:?} (the answer timeout is a minute)"
        );
        upstream.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_the_upstream_closed_is_closed_without_waiting_for_traffic() {
    let _watch = common::watchdog();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let gw = Gateway::start(&format!(
        "workers = 1\n{}",
        upstream_and_store(&url, &Store::Memory)
    ));
    let client = tokio::spawn(async move {
        RawClient::connect(gw.port)
            .await
            .exchange(&get("/one"))
            .await;
        gw
    });
    let (stream, _) = tokio::time::timeout(WAIT, listener.accept())
        .await
        .expect("the gateway connects")
        .expect("accept");
    let mut wire = Wire::new(stream);
    assert!(matches!(wire.head().await, Ok(Some(_))));
    wire.stream.write_all(&ok(b"one")).await.expect("answer");
    let _gw = client.await.expect("client");
    // The upstream ends its side, as one does after its keep-alive timeout; the gateway
    // must close the connection too (not hold it in CLOSE_WAIT until the next request).
    wire.stream.shutdown().await.expect("shutdown");
    let closed = tokio::time::timeout(WAIT, async {
        let mut rest = [0u8; 64];
        loop {
            match wire.stream.read(&mut rest).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the gateway kept the closed connection open for {WAIT:?}"
    );
}

/// The body of a chunked message (`wire` holds everything after its head), or `None` while
/// it is not complete.
fn dechunk(wire: &[u8]) -> Option<Vec<u8>> {
    let (mut at, mut body) = (0, Vec::new());
    loop {
        let line_end = at + find(&wire[at..], b"\r\n")?;
        let size = chunk_size(&wire[at..line_end]).ok()?;
        at = line_end + 2;
        if size == 0 {
            return wire[at..].starts_with(b"\r\n").then_some(body);
        }
        if wire.len() < at + size + 2 {
            return None;
        }
        body.extend_from_slice(&wire[at..at + size]);
        at += size + 2;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_answers_while_it_reads_streams_both_ways() {
    let _watch = common::watchdog();
    const SIZE: usize = 8 << 20;
    // The upstream echoes the body back, chunk by chunk, as it reads it.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let upstream = tokio::spawn(async move {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let mut wire = Wire::new(stream);
        if !matches!(wire.head().await, Ok(Some(_))) {
            return;
        }
        let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
        if wire.stream.write_all(head).await.is_err() {
            return;
        }
        let mut echoed = 0;
        while echoed < SIZE {
            if wire.buf.is_empty() && !matches!(wire.fill().await, Ok(true)) {
                return;
            }
            let piece: Vec<u8> = wire.buf.drain(..).collect();
            echoed += piece.len();
            let mut chunk = format!("{:x}\r\n", piece.len()).into_bytes();
            chunk.extend_from_slice(&piece);
            chunk.extend_from_slice(b"\r\n");
            if wire.stream.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = wire.stream.write_all(b"0\r\n\r\n").await;
    });
    let gw = Gateway::start(&format!(
        "workers = 1\n{}",
        upstream_and_store(&url, &Store::Memory)
    ));
    let sent = pattern(7, SIZE);
    let stream = TcpStream::connect(("127.0.0.1", gw.port))
        .await
        .expect("connect");
    let (mut rd, mut wr) = stream.into_split();
    let body = sent.clone();
    let writer = tokio::spawn(async move {
        let head =
            format!("POST /echo HTTP/1.1\r\nHost: upstream.test\r\nContent-Length: {SIZE}\r\n\r\n");
        wr.write_all(head.as_bytes()).await.expect("request head");
        for piece in body.chunks(64 * 1024) {
            wr.write_all(piece).await.expect("request body");
        }
        wr
    });
    let mut got = Vec::new();
    let echoed = tokio::time::timeout(WAIT, async {
        loop {
            if let Some(i) = find(&got, b"\r\n\r\n") {
                if let Some(body) = dechunk(&got[i + 4..]) {
                    return Ok((Head::parse(&got[..i + 4])?, body));
                }
            }
            let mut chunk = vec![0u8; 64 * 1024];
            match rd.read(&mut chunk).await {
                Ok(0) => return Err("closed before the whole echo".to_string()),
                Ok(n) => got.extend_from_slice(&chunk[..n]),
                Err(e) => return Err(e.to_string()),
            }
        }
    })
    .await
    .expect("the echo came back in time (both ways at once)");
    let (head, body) = echoed.expect("an answer");
    assert_eq!(head.status(), Ok(200));
    assert!(
        body == sent,
        "the echo differs: {} bytes of {SIZE}",
        body.len()
    );
    let _ = writer.await;
    upstream.abort();
}

// ---------------------------------------------------------------------------------------
// The perimeter (issue "Hold the perimeter"): what a client or a faulty upstream must not
// be able to do through the upstream hop.

/// The gateway's metrics, as text.
async fn metrics_text(gw: &Gateway) -> String {
    let mut client = RawClient::connect(gw.admin_port).await;
    let a = client
        .exchange(b"GET /metrics HTTP/1.1\r\nHost: admin\r\n\r\n")
        .await;
    String::from_utf8_lossy(&a.body).into_owned()
}

/// A 204 that says it has a body (`Content-Length: 12`) has no body, but a faulty upstream
/// may still write one — or a whole second answer — a moment later. Reused, its connection
/// would hand that to the next client as its own answer; it is never reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bodiless_answer_that_announces_a_body_leaves_no_stray_answer_for_another_client() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/no-content" => vec![
            Step::Write(b"HTTP/1.1 204 No Content\r\nContent-Length: 12\r\n\r\n".to_vec()),
            Step::Sleep(ms(300)),
            Step::Write(ok(b"stray answer")),
        ],
        _ => vec![Step::Write(ok(b"mine"))],
    })
    .await;
    let gw = gateway(&up);
    let a = RawClient::connect(gw.port)
        .await
        .exchange(&get("/no-content"))
        .await;
    assert_eq!(a.status, 204, "{a:?}");
    // Another client, well inside the 300 ms.
    let b = RawClient::connect(gw.port).await.exchange(&get("/b")).await;
    assert_eq!(
        (b.status, String::from_utf8_lossy(&b.body).as_ref()),
        (200, "mine"),
        "another client's request got the stray answer"
    );
    assert_eq!(up.accepted(), 2, "the 204's connection was not used again");
}

/// Bytes an upstream writes on an idle pooled connection, answering nothing, are never
/// read as another request's answer: the connection is discarded when it is next taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_written_on_an_idle_pooled_connection_are_never_taken_for_an_answer() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/first" => vec![
            Step::Write(ok(b"first")),
            Step::Sleep(ms(100)),
            Step::Write(ok(b"stray answer")),
        ],
        _ => vec![Step::Write(ok(b"mine"))],
    })
    .await;
    let gw = gateway(&up);
    let a = RawClient::connect(gw.port)
        .await
        .exchange(&get("/first"))
        .await;
    assert_eq!((a.status, &a.body[..]), (200, &b"first"[..]));
    // The stray answer lands on the idle connection 100 ms later; then another client.
    up.wait_played(1).await;
    let b = RawClient::connect(gw.port).await.exchange(&get("/b")).await;
    assert_eq!(
        (b.status, String::from_utf8_lossy(&b.body).as_ref()),
        (200, "mine"),
        "another client's request got the stray answer"
    );
    assert_eq!(
        up.accepted(),
        2,
        "the connection with unread bytes was not used"
    );
}

/// A malformed chunked request body is the client's mistake: 400, counted as a gateway
/// answer, not as an upstream failure (502); and the connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_chunked_request_body_is_a_400_not_an_upstream_failure() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|_| vec![Step::Write(ok(b"fine"))]).await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    client
        .send(
            b"POST /upload HTTP/1.1\r\nHost: upstream.test\r\nTransfer-Encoding: chunked\r\n\r\n\
              zz\r\nhello\r\n0\r\n\r\n",
        )
        .await;
    let a = client.answer(false).await.expect("an answer");
    assert_eq!(a.status, 400, "{a:?}");
    assert_eq!(a.head.get("connection").as_deref(), Some("close"), "{a:?}");
    assert!(
        matches!(client.wire.head().await, Ok(None) | Err(_)),
        "the connection is closed after it"
    );
    let m = metrics_text(&gw).await;
    assert!(
        // The series exists from start, at 0 (alerts on it answer 0, not nothing).
        m.contains("ratewall_upstream_responses_total{class=\"error\"} 0\n"),
        "counted as an upstream failure:\n{m}"
    );
    assert!(
        m.contains("ratewall_responses_total{class=\"4xx\",source=\"gateway\"} 1"),
        "counted as the gateway's 4xx:\n{m}"
    );
    still_serves(&gw, "/fine", b"fine").await;
}

/// The upstream's `timeout` is for its answer: it starts once the request is all sent. An
/// upload slower than it (2.4 s against 1 s) is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_slower_than_the_upstream_timeout_is_answered() {
    let _watch = common::watchdog();
    const LEN: usize = 64 * 1024;
    let up = ScriptedUpstream::start(|req| {
        vec![Step::Write(
            ok(format!("got {}", req.body.len()).as_bytes()),
        )]
    })
    .await;
    let gw = gateway_with_timeout(&up, "1s");
    let mut client = RawClient::connect(gw.port).await;
    let body = pattern(3, LEN);
    client
        .send(
            format!("POST /up HTTP/1.1\r\nHost: upstream.test\r\nContent-Length: {LEN}\r\n\r\n")
                .as_bytes(),
        )
        .await;
    for piece in body.chunks(LEN / 16) {
        // Real time on purpose: a slow upload, each pause well inside the clock.
        tokio::time::sleep(ms(150)).await;
        client.send(piece).await;
    }
    let a = client.answer(false).await.expect("an answer");
    assert_eq!(
        (a.status, String::from_utf8_lossy(&a.body).as_ref()),
        (200, format!("got {LEN}").as_str()),
        "{a:?}"
    );
    assert_eq!(up.received()[0].body, body, "the upload arrived whole");
}

/// A client that stops sending its body for `body_timeout` gets a 408 and its connection
/// is closed; the upstream connection, left in the middle of a request, is dropped, not
/// pooled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_gets_408_and_its_upstream_connection_is_dropped() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|_| vec![Step::Write(ok(b"fine"))]).await;
    let gw = Gateway::start(&format!(
        "workers = 1\nbody_timeout = \"1s\"\n{}",
        upstream_and_store(&up.url(), &Store::Memory)
    ));
    let mut client = RawClient::connect(gw.port).await;
    client
        .send(b"POST /up HTTP/1.1\r\nHost: upstream.test\r\nContent-Length: 10000\r\n\r\n")
        .await;
    client.send(&[b'x'; 100]).await;
    let start = Instant::now();
    let a = client.answer(false).await.expect("an answer");
    let took = start.elapsed();
    // A 408 is body_timeout's (an upstream timeout would be a 504), not before it.
    assert_eq!(a.status, 408, "{a:?}");
    assert!(took >= ms(900), "408 after {took:?}");
    assert!(
        matches!(client.wire.head().await, Ok(None) | Err(_)),
        "the client connection is closed after the 408"
    );
    // The next request needs a new upstream connection: the stalled one was dropped.
    still_serves(&gw, "/after", b"fine").await;
    assert_eq!(
        up.accepted(),
        2,
        "the half-sent upstream connection was not reused"
    );
    assert!(
        metrics_text(&gw).await.contains(
            "ratewall_connections_closed_total{listener=\"gateway\",reason=\"body_timeout\"} 1"
        ),
        "counted as a body_timeout close"
    );
}

/// `Transfer-Encoding: gzip, chunked` from the upstream: an HTTP/1.1 client gets the
/// coding named and the still-coded bytes, chunked; an HTTP/1.0 client, which cannot be
/// sent a transfer coding, gets a 502 — never the coded bytes with no coding named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_codings_reach_an_http11_client_intact_and_others_get_502() {
    let _watch = common::watchdog();
    let coded = pattern(9, 3_000);
    let mut answer =
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
            .to_vec();
    for piece in coded.chunks(1_000) {
        answer.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        answer.extend_from_slice(piece);
        answer.extend_from_slice(b"\r\n");
    }
    answer.extend_from_slice(b"0\r\n\r\n");
    let up = ScriptedUpstream::start(move |req| match req.target() {
        "/coded" => vec![Step::Write(answer.clone())],
        _ => vec![Step::Write(ok(b"fine"))],
    })
    .await;
    let gw = gateway(&up);
    let a = RawClient::connect(gw.port)
        .await
        .exchange(&get("/coded"))
        .await;
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(
        a.head.get("transfer-encoding").as_deref(),
        Some("gzip, chunked"),
        "the coding is named: {a:?}"
    );
    assert!(a.body == coded, "the coded bytes arrive as they were");
    let mut old = RawClient::connect(gw.port).await;
    old.send(b"GET /coded HTTP/1.0\r\nHost: upstream.test\r\n\r\n")
        .await;
    let a = old.answer(false).await.expect("an answer");
    assert_eq!(a.status, 502, "an HTTP/1.0 client: {a:?}");
    // HTTP/2 has no transfer codings either.
    let h2 = common::HttpClient::h2();
    let r = h2
        .get(&format!("http://127.0.0.1:{}/coded", gw.port), &[])
        .await;
    assert_eq!(r.status.as_u16(), 502, "an HTTP/2 client");
    still_serves(&gw, "/fine", b"fine").await;
}

/// An upstream that sends a head and part of a body, then nothing, is cut off after its
/// `timeout` (between two reads, as nginx's `proxy_read_timeout`): neither the client nor
/// the upstream connection is held by it for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_silent_in_the_middle_of_its_body_is_cut_off_at_its_timeout() {
    let _watch = common::watchdog();
    let up = ScriptedUpstream::start(|req| match req.target() {
        "/hang" => vec![
            Step::Write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nfirst bytes".to_vec()),
            Step::Sleep(Duration::from_secs(20)),
        ],
        _ => vec![Step::Write(ok(b"fine"))],
    })
    .await;
    let gw = gateway_with_timeout(&up, "1s");
    let mut client = RawClient::connect(gw.port).await;
    client.send(&get("/hang")).await;
    let start = Instant::now();
    let (status, _, _, mut body) = client.answer_head(false).await.expect("a head");
    assert_eq!(status, 200);
    let rest = body.rest(&mut client.wire).await;
    let took = start.elapsed();
    assert!(
        rest.is_err(),
        "the body was cut short, not passed as whole: {rest:?}"
    );
    // Not before its 1 s timeout, and well before the upstream's 20 s of silence end.
    assert!(took >= ms(900) && took < WAIT, "cut after {took:?}");
    still_serves(&gw, "/fine", b"fine").await;
}

// ---------------------------------------------------------------------------------------
// An HTTP/1.0 backend
//
// The gateway answers in its own version (RFC 9110 §6.2), whatever the backend spoke: an
// HTTP/1.1 client gets `HTTP/1.1` and keeps its connection; a body the backend delimits
// by closing its connection is re-framed as chunked for that client; the backend's
// connection of such an answer is never used again. An HTTP/1.0 client gets what HTTP/1.0
// allows: a `Content-Length` answer on a kept connection if it asked for keep-alive, a
// close-delimited one otherwise (hyper writes such a client's status line as `HTTP/1.0`).
//
// nginx (1.x, `proxy_pass`, defaults) does the same, checked by hand against a raw
// HTTP/1.0 backend: `HTTP/1.1 200 OK`, `Transfer-Encoding: chunked` and `Connection:
// keep-alive` for the close-delimited answer to an HTTP/1.1 client; `Content-Length`
// passed through; HEAD and 204 without a body on the kept connection; an HTTP/1.0 client
// gets the close-delimited body and `Connection: close`. nginx's status line says
// `HTTP/1.1` to an HTTP/1.0 client too (its own version; RFC 9110 §6.2 allows either).

/// A raw HTTP/1.0 backend as old servers are: one answer per connection, then its end.
/// `/until-close` has no length (`body` until the close), `/length` a `Content-Length`,
/// `/204` and `/304` no body, and a HEAD answer the length a GET would have.
async fn http10_backend(body: Vec<u8>) -> ScriptedUpstream {
    ScriptedUpstream::start(move |req| {
        let mut answer = match (req.method(), req.target()) {
            ("HEAD", _) => b"HTTP/1.0 200 OK\r\nContent-Length: 1234\r\n\r\n".to_vec(),
            (_, "/204") => b"HTTP/1.0 204 No Content\r\nX-Kind: none\r\n\r\n".to_vec(),
            (_, "/304") => b"HTTP/1.0 304 Not Modified\r\nETag: \"v1\"\r\n\r\n".to_vec(),
            (_, "/length") => {
                let mut a = format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n", body.len())
                    .into_bytes();
                a.extend_from_slice(&body);
                a
            }
            _ => b"HTTP/1.0 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n".to_vec(),
        };
        let mut steps = Vec::new();
        if req.target() == "/until-close" && req.method() == "GET" {
            steps.push(Step::Write(std::mem::take(&mut answer)));
            steps.extend(in_pieces(&body, 7_001));
        } else {
            steps.push(Step::Write(answer));
        }
        steps.push(Step::Close);
        steps
    })
    .await
}

fn get_10(path: &str, keep_alive: bool) -> Vec<u8> {
    let ka = if keep_alive {
        "Connection: keep-alive\r\n"
    } else {
        ""
    };
    format!("GET {path} HTTP/1.0\r\nHost: upstream.test\r\n{ka}\r\n").into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http10_backend_keeps_the_http11_clients_connection_and_its_bytes() {
    let _watch = common::watchdog();
    const LEN: usize = 40 * 1024;
    let body = pattern(3, LEN);
    let up = http10_backend(body.clone()).await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    // Close-delimited upstream: chunked to the client, every byte, the connection kept.
    for round in 0..2 {
        let a = client.exchange(&get("/until-close")).await;
        assert_eq!(a.head.start, "HTTP/1.1 200 OK", "round {round}: {a:?}");
        assert_eq!(
            a.head.get("transfer-encoding").as_deref(),
            Some("chunked"),
            "round {round}: re-framed for the client: {a:?}"
        );
        assert!(!a.head.has("content-length"), "{a:?}");
        assert!(
            a.head
                .get("connection")
                .is_none_or(|c| !c.eq_ignore_ascii_case("close")),
            "round {round}: the client's connection is not closed: {a:?}"
        );
        assert!(a.body == body, "round {round}: the body's bytes differ");
    }
    // A length from the backend is passed through, on the same client connection.
    let a = client.exchange(&get("/length")).await;
    assert_eq!(a.head.start, "HTTP/1.1 200 OK", "{a:?}");
    assert_eq!(a.head.get("content-length"), Some(LEN.to_string()), "{a:?}");
    assert!(!a.head.has("transfer-encoding"), "{a:?}");
    assert!(a.body == body, "the body's bytes differ");
    // Each answer ended its backend connection: none was used twice.
    let received = up.received();
    assert_eq!(received.len(), 3);
    assert_eq!(up.accepted(), 3, "an HTTP/1.0 connection was reused");
    still_serves_on(&mut client, &up).await;
}

/// One more request on `client`'s connection: it is still open and in step.
async fn still_serves_on(client: &mut RawClient, up: &ScriptedUpstream) {
    let before = up.received().len();
    let a = client.exchange(&get("/length")).await;
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(up.received().len(), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http10_backends_head_204_and_304_have_no_body_and_keep_the_connection() {
    let _watch = common::watchdog();
    let up = http10_backend(b"body".to_vec()).await;
    let gw = gateway(&up);
    let mut client = RawClient::connect(gw.port).await;
    let a = client
        .exchange(b"HEAD /doc HTTP/1.1\r\nHost: upstream.test\r\n\r\n")
        .await;
    assert_eq!(a.head.start, "HTTP/1.1 200 OK", "{a:?}");
    assert_eq!(
        a.head.get("content-length").as_deref(),
        Some("1234"),
        "{a:?}"
    );
    assert!(!a.head.has("transfer-encoding"), "{a:?}");
    let a = client.exchange(&get("/204")).await;
    assert_eq!(a.head.start, "HTTP/1.1 204 No Content", "{a:?}");
    assert_eq!(a.head.get("x-kind").as_deref(), Some("none"));
    assert!(
        !a.head.has("transfer-encoding") && !a.head.has("content-length"),
        "{a:?}"
    );
    let a = client.exchange(&get("/304")).await;
    assert_eq!(a.head.start, "HTTP/1.1 304 Not Modified", "{a:?}");
    assert!(!a.head.has("transfer-encoding"), "{a:?}");
    // Nothing was sent after those heads: the next answer on the connection is its own.
    let a = client.exchange(&get("/length")).await;
    assert_eq!((a.status, &a.body[..]), (200, &b"body"[..]), "{a:?}");
    assert_eq!(up.accepted(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http10_client_behind_an_http10_backend_gets_what_http10_allows() {
    let _watch = common::watchdog();
    let body = pattern(5, 20 * 1024);
    let up = http10_backend(body.clone()).await;
    let gw = gateway(&up);
    // Keep-alive asked for, and a length to keep it with: the connection stays.
    let mut client = RawClient::connect(gw.port).await;
    client.send(&get_10("/length", true)).await;
    let a = client.answer(false).await.expect("an answer");
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.head.get("content-length"), Some(body.len().to_string()));
    assert!(a.body == body, "the body's bytes differ");
    // No length: no chunked for HTTP/1.0, the body ends with the connection.
    client.send(&get_10("/until-close", true)).await;
    let a = client.answer(false).await.expect("an answer, to the close");
    assert!(a.head.start.starts_with("HTTP/1."), "{a:?}");
    assert_eq!(a.status, 200, "{a:?}");
    assert!(
        !a.head.has("transfer-encoding"),
        "no chunked to HTTP/1.0: {a:?}"
    );
    assert!(a.body == body, "the body's bytes differ");
    assert!(
        matches!(client.wire.head().await, Ok(None) | Err(_)),
        "the connection ended with the body"
    );
    // Without keep-alive: the same body, close-delimited.
    let mut client = RawClient::connect(gw.port).await;
    client.send(&get_10("/until-close", false)).await;
    let a = client.answer(false).await.expect("an answer, to the close");
    assert!(!a.head.has("transfer-encoding"), "{a:?}");
    assert!(a.body == body, "the body's bytes differ");
}

/// HTTP/2 frames every body itself: a close-delimited answer arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http10_backends_close_delimited_answer_reaches_an_http2_client_whole() {
    let _watch = common::watchdog();
    let body = pattern(7, 30 * 1024);
    let up = http10_backend(body.clone()).await;
    let gw = gateway(&up);
    let h2 = common::HttpClient::h2();
    for _ in 0..2 {
        let r = h2
            .get(&format!("http://127.0.0.1:{}/until-close", gw.port), &[])
            .await;
        assert_eq!(r.status.as_u16(), 200);
        assert!(r.body == body, "the body's bytes differ");
    }
}
