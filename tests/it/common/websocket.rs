//! WebSocket ends for the upgrade tests: a real WebSocket echo backend and a real client
//! (Python's `websockets`, run as subprocesses: `tests/it/py/ws_echo.py`, `ws_client.py`,
//! each saying what it saw in JSON lines), RFC 6455 frames written and read by hand for
//! what no client library sends (an unmasked client frame, frames over an HTTP/2 stream),
//! and a raw upgrade backend for protocols other than WebSocket.
//!
//! Every process is killed when its value is dropped (`kill_on_drop`), and each Python
//! script also exits when its standard input ends, so none outlives a failed test.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};

use super::raw::WAIT;

/// A script of `tests/it/py/`.
fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/py")
        .join(name)
}

/// `python3 <script> <args>`, its stdin and stdout piped and its stderr kept in a file
/// (read into failure messages), killed on drop.
fn python(name: &str, args: &[String]) -> (Child, tempfile::NamedTempFile) {
    let stderr = tempfile::NamedTempFile::new().expect("a file for stderr");
    let child = Command::new("python3")
        .arg(script(name))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(stderr.reopen().expect("reopen stderr file"))
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("run python3 {name}: {e}"));
    (child, stderr)
}

fn stderr_of(file: &tempfile::NamedTempFile) -> String {
    std::fs::read_to_string(file.path()).unwrap_or_default()
}

/// The next JSON line of `lines`, within `within`; `None` at the end of the stream or
/// when the time is up.
async fn next_json(
    lines: &mut tokio::io::Lines<BufReader<ChildStdout>>,
    within: Duration,
) -> Option<Value> {
    let line = tokio::time::timeout(within, lines.next_line())
        .await
        .ok()?
        .ok()??;
    Some(serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
}

// ---------------------------------------------------------------------------------------
// The echo backend

/// `ws_echo.py`: a WebSocket echo server on a free port, and what it said so far.
pub struct EchoServer {
    pub port: u16,
    events: Arc<Mutex<Vec<Value>>>,
    stderr: tempfile::NamedTempFile,
    reader: JoinHandle<()>,
    // Dropped last: the server ends with them.
    _stdin: ChildStdin,
    _child: Child,
}

impl EchoServer {
    pub async fn start() -> EchoServer {
        let (mut child, stderr) = python("ws_echo.py", &[]);
        let stdin = child.stdin.take().expect("stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let port = next_json(&mut lines, Duration::from_secs(20))
            .await
            .and_then(|v| v["listening"].as_u64())
            .unwrap_or_else(|| panic!("ws_echo.py did not start:\n{}", stderr_of(&stderr)));
        let events = Arc::new(Mutex::new(Vec::new()));
        let kept = events.clone();
        let reader = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    kept.lock().unwrap_or_else(|p| p.into_inner()).push(v);
                }
            }
        });
        EchoServer {
            port: u16::try_from(port).expect("a port"),
            events,
            stderr,
            reader,
            _stdin: stdin,
            _child: child,
        }
    }

    /// `http://127.0.0.1:<port>`, as a pool's servers name it.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn events(&self) -> Vec<Value> {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The handshakes it accepted, as `{"opened": path, "key": bool}`, once there are at
    /// least `n` (at most [`WAIT`]: its lines come on a pipe of their own, maybe after the
    /// messages a test already got back).
    pub async fn opened(&self, n: usize) -> Vec<Value> {
        let end = Instant::now() + WAIT;
        loop {
            let opened: Vec<Value> = self
                .events()
                .into_iter()
                .filter(|e| e.get("opened").is_some())
                .collect();
            if opened.len() >= n || Instant::now() >= end {
                return opened;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The sockets that ended on `path`, as `{"closed": path, "received", "code", "reason"}`.
    pub fn closed(&self, path: &str) -> Vec<Value> {
        self.events()
            .into_iter()
            .filter(|e| e["closed"] == path)
            .collect()
    }

    /// The end of the one socket on `path`, once it came (at most [`WAIT`]).
    pub async fn wait_closed(&self, path: &str) -> Value {
        let end = Instant::now() + WAIT;
        loop {
            if let Some(e) = self.closed(path).pop() {
                return e;
            }
            assert!(
                Instant::now() < end,
                "the echo server saw no end of {path}: {:?}\n{}",
                self.events(),
                stderr_of(&self.stderr)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

// ---------------------------------------------------------------------------------------
// The client

/// `ws_client.py`: one WebSocket client connection, driven a command at a time.
pub struct WsClient {
    stdin: ChildStdin,
    lines: tokio::io::Lines<BufReader<ChildStdout>>,
    stderr: tempfile::NamedTempFile,
    /// What it said on opening: `{"open": true, "extensions": [...], "subprotocol": ...}`.
    pub hello: Value,
    _child: Child,
}

impl WsClient {
    /// Open `url` (`ws://...`) with `headers`; it must open.
    pub async fn open(url: &str, headers: &[(&str, &str)]) -> WsClient {
        Self::try_open(url, headers, &[])
            .await
            .unwrap_or_else(|refused| panic!("{url} did not open: {refused}"))
    }

    /// Open `url` with `headers` and `flags` (`--deflate`, `--subprotocol NAME`): the
    /// client, or what it said instead (`{"open": false, "status": 429, "headers": {...}}`).
    pub async fn try_open(
        url: &str,
        headers: &[(&str, &str)],
        flags: &[&str],
    ) -> Result<WsClient, Value> {
        let mut args = vec![url.to_string()];
        for (name, value) in headers {
            args.push("--header".into());
            args.push(format!("{name}:{value}"));
        }
        args.extend(flags.iter().map(|f| f.to_string()));
        let (mut child, stderr) = python("ws_client.py", &args);
        let stdin = child.stdin.take().expect("stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let hello = next_json(&mut lines, Duration::from_secs(20))
            .await
            .unwrap_or_else(|| panic!("ws_client.py said nothing:\n{}", stderr_of(&stderr)));
        if hello["open"] != true {
            return Err(hello);
        }
        Ok(WsClient {
            stdin,
            lines,
            stderr,
            hello,
            _child: child,
        })
    }

    /// Run one command (see `ws_client.py`) that may take `takes`; its answer.
    pub async fn call(&mut self, command: Value, takes: Duration) -> Value {
        let mut line = command.to_string();
        line.push('\n');
        self.stdin
            .write_all(line.as_bytes())
            .await
            .expect("write to ws_client.py");
        self.stdin.flush().await.expect("flush");
        next_json(&mut self.lines, takes + WAIT)
            .await
            .unwrap_or_else(|| {
                panic!(
                    "ws_client.py did not answer {command}:\n{}",
                    stderr_of(&self.stderr)
                )
            })
    }

    /// Send a text message.
    pub async fn send(&mut self, text: &str) -> Value {
        self.call(json!({ "send": text }), Duration::ZERO).await
    }

    /// The next message (or `{"timeout": true}` after `within`, or `{"closed": ...}`).
    pub async fn recv(&mut self, within: Duration) -> Value {
        self.call(json!({ "recv": within.as_secs_f64() }), within)
            .await
    }

    /// Send `text` and read the next message: it must be `text` again.
    pub async fn echo(&mut self, text: &str) {
        assert_eq!(self.send(text).await, json!({ "sent": true }));
        let back = self.recv(WAIT).await;
        assert_eq!(back, json!({ "text": text }), "the echo of {text:?}");
    }

    /// Start the closing handshake; the close the client got back.
    pub async fn close(&mut self, code: u16, reason: &str) -> Value {
        let answer = self
            .call(json!({ "close": code, "reason": reason }), WAIT)
            .await;
        answer["closed"].clone()
    }

    /// Wait up to `within` for the socket to end: `{"closed": ..., "after_ms": t}` or
    /// `{"timeout": true}`.
    pub async fn wait_closed(&mut self, within: Duration) -> Value {
        self.call(json!({ "wait_closed": within.as_secs_f64() }), within)
            .await
    }

    /// Send `rate` text frames a second for `seconds` (or until closed), reading the
    /// echoes: `{"sent", "echoed", "closed", "elapsed_ms"}`.
    pub async fn pace(&mut self, rate: u32, seconds: f64) -> Value {
        let takes = Duration::from_secs_f64(seconds + 2.0);
        self.call(json!({ "pace": rate, "seconds": seconds }), takes)
            .await
    }
}

// ---------------------------------------------------------------------------------------
// Raw handshakes and frames (RFC 6455 §4, §5)

/// RFC 6455 §1.3's sample nonce, and the accept it gives.
pub const SAMPLE_KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
pub const SAMPLE_ACCEPT: &str = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=";

pub const TEXT: u8 = 0x1;
pub const BINARY: u8 = 0x2;
pub const CLOSE: u8 = 0x8;

/// A WebSocket handshake for `path`, with `extra` header lines (each ending in `\r\n`).
/// Its `Connection` is Firefox's, `keep-alive, Upgrade` (the Python client sends
/// `Upgrade` alone, as Chrome does).
pub fn ws_handshake(path: &str, extra: &str) -> Vec<u8> {
    format!(
        "GET {path} HTTP/1.1\r\nHost: ws.test\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {SAMPLE_KEY}\r\n{extra}\r\n"
    )
    .into_bytes()
}

/// One whole frame (FIN set) of `opcode`, masked with `mask` when given.
pub fn frame(opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut f = vec![0x80 | opcode];
    let masked = if mask.is_some() { 0x80 } else { 0 };
    match payload.len() {
        n if n < 126 => f.push(masked | n as u8),
        n if n <= 0xffff => {
            f.push(masked | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(masked | 127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    match mask {
        Some(key) => {
            f.extend_from_slice(&key);
            f.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
        }
        None => f.extend_from_slice(payload),
    }
    f
}

/// A close frame's payload: the code, then the reason.
pub fn close_payload(code: u16, reason: &str) -> Vec<u8> {
    let mut p = code.to_be_bytes().to_vec();
    p.extend_from_slice(reason.as_bytes());
    p
}

/// A frame as read (unmasked if it was masked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub fin: bool,
    pub opcode: u8,
    pub masked: bool,
    pub payload: Vec<u8>,
}

impl Frame {
    /// A close frame's code and reason.
    pub fn close(&self) -> Option<(u16, String)> {
        (self.opcode == CLOSE && self.payload.len() >= 2).then(|| {
            (
                u16::from_be_bytes([self.payload[0], self.payload[1]]),
                String::from_utf8_lossy(&self.payload[2..]).into_owned(),
            )
        })
    }
}

/// Reads HTTP/1 heads and WebSocket frames from one stream, keeping what it read past
/// each.
pub struct Reader<S> {
    pub io: S,
    buf: Vec<u8>,
}

impl<S: AsyncRead + Unpin> Reader<S> {
    pub fn new(io: S) -> Reader<S> {
        Reader {
            io,
            buf: Vec::new(),
        }
    }

    /// Read more; false at the end of the stream (or an error).
    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 16 * 1024];
        match self.io.read(&mut chunk).await {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }

    /// An answer's head (through its empty line), within [`WAIT`].
    pub async fn head(&mut self) -> String {
        let read = async {
            loop {
                if let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head: Vec<u8> = self.buf.drain(..end + 4).collect();
                    return String::from_utf8_lossy(&head).into_owned();
                }
                assert!(
                    self.fill().await,
                    "closed before a whole head: {:?}",
                    String::from_utf8_lossy(&self.buf)
                );
            }
        };
        tokio::time::timeout(WAIT, read)
            .await
            .expect("a head within the wait")
    }

    /// The next frame, within [`WAIT`]; `None` if the stream ended first.
    pub async fn frame(&mut self) -> Option<Frame> {
        let read = async {
            loop {
                if let Some((frame, used)) = parse_frame(&self.buf) {
                    self.buf.drain(..used);
                    return Some(frame);
                }
                if !self.fill().await {
                    return None;
                }
            }
        };
        tokio::time::timeout(WAIT, read)
            .await
            .expect("a frame or the end within the wait")
    }

    /// Bytes until `n` are in, within [`WAIT`] (fewer if the stream ended).
    pub async fn bytes(&mut self, n: usize) -> Vec<u8> {
        let read = async {
            while self.buf.len() < n && self.fill().await {}
            let n = n.min(self.buf.len());
            self.buf.drain(..n).collect()
        };
        tokio::time::timeout(WAIT, read)
            .await
            .expect("the bytes within the wait")
    }

    /// Until the stream ends: what came meanwhile, and how long it took (`None`: it did
    /// not end within [`WAIT`]).
    pub async fn until_end(&mut self) -> (Vec<u8>, Option<Duration>) {
        let start = Instant::now();
        let ended = tokio::time::timeout(WAIT, async { while self.fill().await {} })
            .await
            .is_ok();
        (
            std::mem::take(&mut self.buf),
            ended.then(|| start.elapsed()),
        )
    }
}

/// The first frame in `buf` and its length in bytes, if it is all there.
fn parse_frame(buf: &[u8]) -> Option<(Frame, usize)> {
    let (b0, b1) = (*buf.first()?, *buf.get(1)?);
    let masked = b1 & 0x80 != 0;
    let (len, mut at) = match b1 & 0x7f {
        126 => (
            u64::from(u16::from_be_bytes([*buf.get(2)?, *buf.get(3)?])),
            4,
        ),
        127 => (u64::from_be_bytes(buf.get(2..10)?.try_into().ok()?), 10),
        n => (u64::from(n), 2),
    };
    let key = if masked {
        let k: [u8; 4] = buf.get(at..at + 4)?.try_into().ok()?;
        at += 4;
        Some(k)
    } else {
        None
    };
    let end = at + usize::try_from(len).ok()?;
    let mut payload = buf.get(at..end)?.to_vec();
    if let Some(k) = key {
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= k[i % 4];
        }
    }
    let frame = Frame {
        fin: b0 & 0x80 != 0,
        opcode: b0 & 0x0f,
        masked,
        payload,
    };
    Some((frame, end))
}

/// A new connection to `port`, `request` sent: its reader.
pub async fn send_raw(port: u16, request: &[u8]) -> Reader<TcpStream> {
    let mut s = super::raw::connect(port).await;
    s.write_all(request).await.expect("send");
    Reader::new(s)
}

// ---------------------------------------------------------------------------------------
// A raw upgrade backend

/// What a [`RawBackend`] answers.
#[derive(Clone, Copy, Debug)]
pub enum Answer {
    /// `101` switching to this `Upgrade` with [`GREETING`] in the same write (bytes of
    /// the new protocol right behind the head, as servers that speak first send them),
    /// then an echo of every byte; a read that ends in `close\n` is echoed and the
    /// connection closed.
    Switch(&'static str),
    /// An ordinary `200` with the body `ok`.
    Ok,
}

/// What a [`RawBackend`] that switched says first.
pub const GREETING: &[u8] = b"hello from the backend\n";

#[derive(Default)]
struct RawShared {
    /// Each request head, lowercased.
    heads: Mutex<Vec<String>>,
    /// Connections whose client side ended (EOF) after a switch.
    ends: AtomicUsize,
    ended: Notify,
}

/// An upgrade backend speaking raw bytes (for protocols that are not WebSocket), that
/// records every request head it read.
pub struct RawBackend {
    pub addr: SocketAddr,
    shared: Arc<RawShared>,
    task: JoinHandle<()>,
}

impl RawBackend {
    pub async fn start(answer: Answer) -> RawBackend {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a raw backend");
        let addr = listener.local_addr().expect("its address");
        let shared = Arc::new(RawShared::default());
        let kept = shared.clone();
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        connections.spawn(raw_serve(stream, kept.clone(), answer));
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        RawBackend { addr, shared, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request head so far, lowercased.
    pub fn heads(&self) -> Vec<String> {
        self.shared
            .heads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Switched connections whose client side has ended.
    pub fn ends(&self) -> usize {
        self.shared.ends.load(Ordering::SeqCst)
    }

    /// Until `n` switched connections have seen their client side end (at most `within`):
    /// whether they did.
    pub async fn wait_ends(&self, n: usize, within: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.shared.ended.notified();
                if self.ends() >= n {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(within, wait).await.is_ok()
    }
}

impl Drop for RawBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn raw_serve(stream: TcpStream, shared: Arc<RawShared>, answer: Answer) {
    let _ = stream.set_nodelay(true);
    let mut r = Reader::new(stream);
    let read = async {
        loop {
            if let Some(end) = r.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head: Vec<u8> = r.buf.drain(..end + 4).collect();
                return Some(String::from_utf8_lossy(&head).to_ascii_lowercase());
            }
            if !r.fill().await {
                return None;
            }
        }
    };
    let Ok(Some(head)) = tokio::time::timeout(WAIT, read).await else {
        return;
    };
    shared
        .heads
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(head);
    let protocol = match answer {
        Answer::Ok => {
            let _ =
                r.io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
            // Kept until the gateway is done with it.
            while r.fill().await {}
            return;
        }
        Answer::Switch(p) => p,
    };
    let mut switched = format!(
        "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n\r\n"
    )
    .into_bytes();
    switched.extend_from_slice(GREETING);
    if r.io.write_all(&switched).await.is_err() {
        return;
    }
    loop {
        if !r.buf.is_empty() {
            let got = std::mem::take(&mut r.buf);
            if r.io.write_all(&got).await.is_err() {
                return;
            }
            if got.ends_with(b"close\n") {
                // Closed by the backend: the gateway is to end the tunnel.
                return;
            }
        }
        if !r.fill().await {
            shared.ends.fetch_add(1, Ordering::SeqCst);
            shared.ended.notify_waiters();
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------
// WebSocket over HTTP/2 (RFC 8441)

/// A WebSocket over an HTTP/2 extended CONNECT: the answer's head, and its stream.
pub struct H2Socket {
    pub status: http::StatusCode,
    pub headers: http::HeaderMap,
    /// The upgraded stream; frames written on it must be masked (the backend's
    /// WebSocket is an HTTP/1.1 one, and the gateway passes frames unchanged).
    pub stream: Reader<hyper_util::rt::TokioIo<hyper::upgrade::Upgraded>>,
    /// The connection's task, aborted on drop.
    conn: JoinHandle<hyper::Result<()>>,
}

impl Drop for H2Socket {
    fn drop(&mut self) {
        self.conn.abort();
    }
}

/// On a new cleartext HTTP/2 connection to `port` (prior knowledge), a `CONNECT` with
/// `:protocol = websocket` to `path` and `headers`, once the gateway's SETTINGS have said
/// it takes one (RFC 8441 §3: `SETTINGS_ENABLE_CONNECT_PROTOCOL`; panics if they do not).
/// A `200` comes with its stream; another answer is the error.
pub async fn h2_websocket(
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<H2Socket, (http::StatusCode, http::HeaderMap)> {
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let tcp = super::raw::connect(port).await;
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .expect("an HTTP/2 handshake");
    // The connection is driven here until the gateway's SETTINGS are in.
    let mut conn = Box::pin(conn);
    let settings = async {
        while !conn.is_extended_connect_protocol_enabled() {
            tokio::select! {
                ended = conn.as_mut() => panic!("the connection ended: {ended:?}"),
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    };
    tokio::time::timeout(WAIT, settings)
        .await
        .expect("SETTINGS_ENABLE_CONNECT_PROTOCOL from the gateway");
    let conn = tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method(http::Method::CONNECT)
        .uri(format!("http://127.0.0.1:{port}{path}"))
        .header("sec-websocket-version", "13");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let mut req = req
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("a request");
    req.extensions_mut()
        .insert(hyper::ext::Protocol::from_static("websocket"));
    let mut resp = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("an answer within the wait")
        .expect("an answer");
    let (status, headers) = (resp.status(), resp.headers().clone());
    if status != http::StatusCode::OK {
        conn.abort();
        return Err((status, headers));
    }
    let upgraded = hyper::upgrade::on(&mut resp)
        .await
        .unwrap_or_else(|e| panic!("no stream for a {status}: {e}"));
    Ok(H2Socket {
        status,
        headers,
        stream: Reader::new(TokioIo::new(upgraded)),
        conn,
    })
}
