//! The upstream side: an HTTP/1.1 client written for this one job, hop-by-hop stripping and
//! `X-Forwarded-*`. Bodies are never buffered: the client's request body streams to the
//! upstream and the upstream's response body streams back.
//!
//! Why not hyper's client: it runs each upstream connection as a task of its own, reached
//! through a channel, so every request costs two extra task wake-ups and a channel round
//! trip. Here the request's own task writes the request and reads the answer on a pooled
//! connection (one per worker thread's pool, so never shared across threads); measured, it
//! halves the user-space time of the upstream hop (docs/performance.md). The response head
//! is parsed with `httparse` (hyper's own parser) and the body framed per RFC 9112 §6:
//! `Content-Length`, `chunked`, or the connection's end.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH, HOST};
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::config::Upstream;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Hop-by-hop fields, RFC 9110 §7.6.1: meaningful for one connection only, never
/// forwarded. `Proxy-Connection` and `Keep-Alive` are the legacy ones the section names;
/// `Proxy-Authenticate`/`-Authorization` are hop-by-hop per RFC 9110 §11.7.
static HOP_BY_HOP: [HeaderName; 9] = [
    CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    http::header::TE,
    http::header::TRAILER,
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
    http::header::PROXY_AUTHENTICATE,
    http::header::PROXY_AUTHORIZATION,
];

/// Whether `name` is one of [`HOP_BY_HOP`]: one match on the lowercase name, where a
/// search of the list compares it with each.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "proxy-connection"
            | "keep-alive"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "proxy-authenticate"
            | "proxy-authorization"
    )
}

/// The most a response head (status line and fields) may take, and the most field lines
/// (room for `FEW_FIELDS` is made on the stack; more, up to `MAX_FIELDS`, on the heap).
const MAX_HEAD: usize = 64 * 1024;
const FEW_FIELDS: usize = 48;
const MAX_FIELDS: usize = 2048;
/// The most a chunk-size line or the trailer section may take.
const MAX_CHUNK_LINE: usize = 4096;
const MAX_TRAILERS: usize = 64 * 1024;
/// Idle connections kept per worker, and for how long.
const MAX_IDLE: usize = 256;
const IDLE_FOR: Duration = Duration::from_secs(60);
/// How much is read from the upstream at a time.
const READ_SIZE: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("upstream refused or unreachable: {0}")]
    Unreachable(String),
    #[error("upstream did not answer within {0:?}")]
    Timeout(Duration),
    #[error("upstream failed: {0}")]
    Failed(String),
    /// The client's request body could not be read as framed (a malformed chunk): the
    /// client's error (400), not the upstream's.
    #[error("the client's request body is malformed: {0}")]
    ClientBody(String),
    /// The client sent nothing more of its request body for `body_timeout` (408).
    #[error("the client's request body stalled for {0:?}")]
    ClientStalled(Duration),
    /// The upstream answered with a transfer coding this client cannot be sent (HTTP/1.0,
    /// HTTP/2): passing the bytes on without their coding would corrupt them.
    #[error("the upstream sent Transfer-Encoding {0:?}, which this client cannot take")]
    Coding(String),
}

impl ProxyError {
    /// Whether the client, not the upstream, is at fault.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            ProxyError::ClientBody(_) | ProxyError::ClientStalled(_)
        )
    }
}

/// What the upstream hop needs to know of the client side of a request.
pub struct Downstream<'a> {
    pub peer: &'a Peer,
    /// Whether the peer is a trusted proxy: its forwarding headers are kept and appended
    /// to, where an untrusted peer's are replaced.
    pub trusted: bool,
    /// The longest the client may pause between two reads of its request body.
    pub body_timeout: Duration,
}

/// One worker's way to the upstream: where it is, and the connections kept open to it.
pub struct Proxy {
    host: String,
    port: u16,
    /// The upstream's address, when the URL names one (no resolving per connection).
    addr: Option<SocketAddr>,
    authority: HeaderValue,
    base_path: String,
    timeout: Duration,
    connect_timeout: Duration,
    pool: Arc<Pool>,
}

/// Idle keep-alive connections, most recently used last.
struct Pool {
    idle: Mutex<VecDeque<(TcpStream, Instant)>>,
    /// The upstream's `timeout`: also the longest silence inside an answer's body.
    timeout: Duration,
}

impl Pool {
    fn take(&self) -> Option<TcpStream> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some((_, since)) = idle.front() {
            if since.elapsed() < IDLE_FOR {
                break;
            }
            idle.pop_front();
        }
        while let Some((conn, _)) = idle.pop_back() {
            if still_open(&conn) {
                return Some(conn);
            }
        }
        None
    }

    /// Close the connections idle too long or closed by the upstream (which would
    /// otherwise sit in CLOSE_WAIT until the next request comes).
    fn sweep(&self) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain(|(conn, since)| since.elapsed() < IDLE_FOR && still_open(conn));
    }

    fn put(&self, conn: TcpStream) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() >= MAX_IDLE {
            idle.pop_front();
        }
        idle.push_back((conn, Instant::now()));
    }
}

/// Whether an idle connection can take a request: the upstream has neither closed it nor
/// sent anything unasked. Bytes that arrive on an idle connection are no answer to any
/// request, and would be read as the answer to the next one (another client's): such a
/// connection is never used again.
///
/// Asked of the event loop's readiness, without the task's cooperative budget (which
/// would hide it): a read is tried only when the loop saw the socket readable, so a clean
/// connection costs no syscall. The loop's view is as fresh as its last turn (well under a
/// millisecond under load); bytes later than that, like bytes written after this check,
/// cannot be told from an answer (docs/operations.md). Asking the kernel every time (a
/// `recv` with `MSG_PEEK` per request) measured 5% fewer requests a second.
fn still_open(conn: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    // WouldBlock is the one good answer: 0 is the upstream's close, more a stray answer,
    // another error a broken socket.
    matches!(conn.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// How the request body goes upstream.
enum Sending {
    None,
    /// As it came: the client's `Content-Length` frames it.
    Length,
    /// Chunked (the client sent it chunked, or with no length known).
    Chunked,
}

impl Proxy {
    pub fn new(cfg: &Upstream) -> Proxy {
        let host = cfg.url.host().unwrap_or("127.0.0.1").to_string();
        let port = cfg.url.port_u16().unwrap_or(80);
        let addr = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, port));
        // The Host sent when the client gave none: host and port, never user info.
        let authority = match cfg.url.port() {
            Some(p) => format!("{host}:{}", p.as_str()),
            None => host.clone(),
        };
        let authority = HeaderValue::from_str(&authority)
            .unwrap_or_else(|_| HeaderValue::from_static("127.0.0.1"));
        Proxy {
            host,
            port,
            addr,
            authority,
            base_path: cfg.base_path.clone(),
            timeout: cfg.timeout,
            connect_timeout: cfg.connect_timeout,
            pool: Arc::new(Pool {
                idle: Mutex::default(),
                timeout: cfg.timeout,
            }),
        }
    }

    /// Close idle connections that expired or that the upstream closed.
    pub fn sweep(&self) {
        self.pool.sweep();
    }

    /// Send `req` upstream for the client `down` describes. The answer's head must arrive
    /// within `timeout` of the request having been sent in full: an upload takes as long
    /// as the client takes to send it, as long as it never pauses for `body_timeout`.
    pub async fn forward(
        &self,
        req: Request<Incoming>,
        down: &Downstream<'_>,
    ) -> Result<Response<ResponseBody>, ProxyError> {
        let (mut parts, body) = req.into_parts();
        let original_host = parts.headers.get(HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        let headers = &mut parts.headers;
        strip_hop_by_hop(headers);
        if !headers.contains_key(HOST) {
            headers.insert(
                HOST,
                original_host
                    .clone()
                    .unwrap_or_else(|| self.authority.clone()),
            );
        }

        let sending = if body.is_end_stream() {
            Sending::None
        } else if body.size_hint().exact().is_some() && headers.contains_key(CONTENT_LENGTH) {
            Sending::Length
        } else {
            headers.remove(CONTENT_LENGTH);
            Sending::Chunked
        };
        let head = self.request_head(
            &parts,
            matches!(sending, Sending::Chunked),
            down,
            original_host.as_ref(),
        )?;
        let is_head = parts.method == Method::HEAD;
        // A kept connection the upstream has closed, or that holds bytes nobody asked for,
        // is found out before it is used (`still_open`); one closed the very moment it is
        // used fails this request with a 502 rather than sending it twice.
        let mut conn = match self.pool.take() {
            Some(conn) => conn,
            None => self.connect().await?,
        };
        let answer = if matches!(sending, Sending::None) {
            let exchange = async {
                conn.write_all(&head)
                    .await
                    .map_err(|e| ProxyError::Failed(format!("writing the request: {e}")))?;
                let (parts, buf, framing) = read_head(&mut conn, is_head)
                    .await
                    .map_err(ProxyError::Failed)?;
                Ok::<_, ProxyError>((parts, buf, framing))
            };
            let (parts, buf, framing) = tokio::time::timeout(self.timeout, exchange)
                .await
                .map_err(|_| ProxyError::Timeout(self.timeout))??;
            ResponseBody::answer(parts, Conn::Whole(conn), None, buf, framing, self)
        } else {
            self.duplex(conn, head, body, sending, is_head, down.body_timeout)
                .await?
        };
        // The answer's hop-by-hop fields were left out as its head was read (`head_parts`);
        // a transfer coding other than chunked is passed on where the client can take it.
        pass_codings(answer, parts.version)
    }

    /// A request with a body: the body goes up while the answer is awaited, so an upstream
    /// that answers early (a 413, a 401) or streams its answer while it reads (an echo) is
    /// heard at once. An answer that comes before the whole body went up takes the rest of
    /// the upload along in its body (full duplex), and its connection is not kept.
    ///
    /// The clocks: while the body goes up, the client may pause at most `body_timeout`
    /// between two of its reads (then 408), and the upstream may take at most `timeout` to
    /// accept each write; once the body is all sent, the answer's head must come within
    /// `timeout` (then 504). A client whose body is malformed or stalls gets its answer
    /// at once, and the upstream connection, left mid-request, is closed.
    async fn duplex(
        &self,
        conn: TcpStream,
        head: Vec<u8>,
        body: Incoming,
        sending: Sending,
        is_head: bool,
        body_timeout: Duration,
    ) -> Result<Response<ResponseBody>, ProxyError> {
        let (mut rd, mut wr) = conn.into_split();
        let chunked = matches!(sending, Sending::Chunked);
        let write_timeout = self.timeout;
        let mut upload: Upload = Box::pin(async move {
            send(&mut wr, &head, body, chunked, body_timeout, write_timeout).await?;
            Ok(wr)
        });
        let mut uploaded: Option<Result<OwnedWriteHalf, UploadError>> = None;
        let answer = {
            let reading = read_head(&mut rd, is_head);
            tokio::pin!(reading);
            // Armed once the body is all sent (or could not be).
            let deadline = tokio::time::sleep(Duration::MAX / 4);
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    done = &mut upload, if uploaded.is_none() => {
                        match &done {
                            Err(UploadError::Client(e)) => {
                                return Err(ProxyError::ClientBody(e.clone()))
                            }
                            Err(UploadError::Stalled) => {
                                return Err(ProxyError::ClientStalled(body_timeout))
                            }
                            Ok(_) | Err(UploadError::Upstream(_)) => {}
                        }
                        uploaded = Some(done);
                        deadline
                            .as_mut()
                            .reset(tokio::time::Instant::now() + self.timeout);
                    }
                    answer = &mut reading => break answer,
                    () = &mut deadline => return Err(ProxyError::Timeout(self.timeout)),
                }
            }
        };
        let (parts, buf, framing) = match answer {
            Ok(answer) => answer,
            // No answer: a failed write (a reset, say) says most.
            Err(e) => {
                return Err(ProxyError::Failed(match uploaded {
                    Some(Err(UploadError::Upstream(wrote))) => wrote,
                    _ => e,
                }))
            }
        };
        let (conn, upload) = match uploaded {
            Some(Ok(wr)) => match rd.reunite(wr) {
                Ok(conn) => (Conn::Whole(conn), None),
                Err(e) => (Conn::Half(e.0), None),
            },
            Some(Err(_)) => (Conn::Half(rd), None),
            None => (Conn::Half(rd), Some(upload)),
        };
        Ok(ResponseBody::answer(
            parts, conn, upload, buf, framing, self,
        ))
    }

    async fn connect(&self) -> Result<TcpStream, ProxyError> {
        let addrs: Vec<SocketAddr> = match self.addr {
            Some(addr) => vec![addr],
            None => {
                let lookup = tokio::net::lookup_host((self.host.as_str(), self.port));
                match tokio::time::timeout(self.connect_timeout, lookup).await {
                    Err(_) => {
                        return Err(ProxyError::Unreachable(format!(
                            "resolving {} timed out after {:?}",
                            self.host, self.connect_timeout
                        )))
                    }
                    Ok(Err(e)) => {
                        return Err(ProxyError::Unreachable(format!(
                            "resolving {}: {e}",
                            self.host
                        )))
                    }
                    Ok(Ok(addrs)) => addrs.collect(),
                }
            }
        };
        // Each address gets its share of the connect timeout, so one that drops packets
        // does not keep the next from being tried.
        let each = self.connect_timeout / u32::try_from(addrs.len().max(1)).unwrap_or(u32::MAX);
        let mut why = format!("{} resolves to no address", self.host);
        for addr in addrs {
            match tokio::time::timeout(each, TcpStream::connect(addr)).await {
                Ok(Ok(conn)) => {
                    let _ = conn.set_nodelay(true);
                    return Ok(conn);
                }
                Ok(Err(e)) => why = format!("{addr}: {e}"),
                Err(_) => why = format!("{addr}: connect timed out after {each:?}"),
            }
        }
        Err(ProxyError::Unreachable(why))
    }

    /// `METHOD /base/path?query HTTP/1.1`, the fields, the forwarding fields (see
    /// [`forwarding`]) and the blank line. The forwarding fields are written here, not
    /// put in the header map first: no insertion, no growth of the map per request.
    fn request_head(
        &self,
        parts: &http::request::Parts,
        chunked: bool,
        down: &Downstream<'_>,
        host: Option<&HeaderValue>,
    ) -> Result<Vec<u8>, ProxyError> {
        let pq = parts.uri.path_and_query().map_or("/", PathAndQuery::as_str);
        let target_ok = pq.starts_with('/') || pq == "*";
        if !target_ok {
            return Err(ProxyError::Failed(format!(
                "cannot forward request target {pq:?}"
            )));
        }
        let fields: usize = parts
            .headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 4)
            .sum();
        let mut head = Vec::with_capacity(256 + self.base_path.len() + pq.len() + fields);
        head.extend_from_slice(parts.method.as_str().as_bytes());
        head.push(b' ');
        head.extend_from_slice(self.base_path.as_bytes());
        head.extend_from_slice(pq.as_bytes());
        head.extend_from_slice(b" HTTP/1.1\r\n");
        let mut kept = Kept::default();
        for (name, value) in &parts.headers {
            if let Some(field) = Forwarding::of(name) {
                if !down.trusted {
                    continue;
                }
                match field {
                    // Re-written below, the peer appended.
                    Forwarding::For | Forwarding::Forwarded => continue,
                    Forwarding::Proto => kept.proto = true,
                    Forwarding::Host => kept.host = true,
                    Forwarding::Other => {}
                }
            }
            field_line(&mut head, name.as_str(), &[value.as_bytes()]);
        }
        forwarding(&mut head, &parts.headers, down, host, kept);
        if chunked {
            head.extend_from_slice(b"transfer-encoding: chunked\r\n");
        }
        head.extend_from_slice(b"\r\n");
        Ok(head)
    }
}

/// The rest of a request body going up, and the write half once it is all sent.
type Upload =
    Pin<Box<dyn std::future::Future<Output = Result<OwnedWriteHalf, UploadError>> + Send>>;

/// Why a request body did not all go up, and whose fault that is.
#[derive(Debug)]
enum UploadError {
    /// The client's body could not be read as framed.
    Client(String),
    /// The client sent nothing for `body_timeout`.
    Stalled,
    /// Writing to the upstream failed, or it took nothing for `timeout`.
    Upstream(String),
}

/// Write the head and stream the body after it: each read of the client's body within
/// `body_timeout`, each write to the upstream within `write_timeout`.
async fn send<W: AsyncWrite + Unpin>(
    conn: &mut W,
    head: &[u8],
    mut body: Incoming,
    chunked: bool,
    body_timeout: Duration,
    write_timeout: Duration,
) -> Result<(), UploadError> {
    async fn write<W: AsyncWrite + Unpin>(
        conn: &mut W,
        buf: &mut impl Buf,
        within: Duration,
    ) -> Result<(), UploadError> {
        match tokio::time::timeout(within, conn.write_all_buf(buf)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(UploadError::Upstream(format!("writing the request: {e}"))),
            Err(_) => Err(UploadError::Upstream(format!(
                "the upstream took none of the request for {within:?}"
            ))),
        }
    }
    write(conn, &mut &head[..], write_timeout).await?;
    loop {
        let frame = match tokio::time::timeout(body_timeout, body.frame()).await {
            Err(_) => return Err(UploadError::Stalled),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(UploadError::Client(e.to_string())),
            Ok(Some(Ok(frame))) => frame,
        };
        // Trailers are not forwarded (a hop-by-hop `TE: trailers` never reaches here).
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        if chunked {
            // Size line, data and CRLF in one vectored write.
            let size = format!("{:x}\r\n", data.len());
            let mut chunk = size.as_bytes().chain(data).chain(&b"\r\n"[..]);
            write(conn, &mut chunk, write_timeout).await?;
        } else {
            write(conn, &mut &data[..], write_timeout).await?;
        }
    }
    if chunked {
        write(conn, &mut &b"0\r\n\r\n"[..], write_timeout).await?;
    }
    Ok(())
}

/// Read until a final (non-1xx) response head is complete. Returns it, what was read past
/// it, and how its body is framed.
async fn read_head<R: AsyncRead + Unpin>(
    conn: &mut R,
    is_head: bool,
) -> Result<(http::response::Parts, BytesMut, Framing), String> {
    let mut buf = BytesMut::with_capacity(READ_SIZE);
    loop {
        if !buf.is_empty() {
            match parse_head(&buf, is_head)? {
                Parsed::Partial if buf.len() >= MAX_HEAD => {
                    return Err(format!("response head larger than {MAX_HEAD} bytes"))
                }
                Parsed::Partial => {}
                Parsed::Interim(n) => {
                    buf.advance(n);
                    continue;
                }
                Parsed::Final(n, parts, framing) => {
                    buf.advance(n);
                    return Ok((parts, buf, framing));
                }
            }
        }
        buf.reserve(READ_SIZE);
        match tokio::io::AsyncReadExt::read_buf(conn, &mut buf).await {
            Ok(0) if buf.is_empty() => {
                return Err("the upstream closed the connection without answering".into())
            }
            Ok(0) => {
                return Err("the upstream closed the connection inside the response head".into())
            }
            Ok(_) => {}
            Err(e) => return Err(format!("reading the answer: {e}")),
        }
    }
}

enum Parsed {
    Partial,
    /// An informational (1xx) head of this many bytes, to skip.
    Interim(usize),
    Final(usize, http::response::Parts, Framing),
}

/// Parse one response head at the start of `buf`.
fn parse_head(buf: &[u8], is_head: bool) -> Result<Parsed, String> {
    let mut fields = [httparse::EMPTY_HEADER; FEW_FIELDS];
    match parse_head_into(buf, is_head, &mut fields) {
        Err(httparse::Error::TooManyHeaders) => {
            let mut fields = vec![httparse::EMPTY_HEADER; MAX_FIELDS];
            parse_head_into(buf, is_head, &mut fields)
        }
        other => other,
    }
    .map_err(|e| format!("malformed response head: {e}"))
    .and_then(|r| r)
}

/// [`parse_head`] with room for `fields.len()` field lines. `Err`: httparse's refusal.
fn parse_head_into<'b>(
    buf: &'b [u8],
    is_head: bool,
    fields: &mut [httparse::Header<'b>],
) -> Result<Result<Parsed, String>, httparse::Error> {
    let mut res = httparse::Response::new(fields);
    let n = match res.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(Ok(Parsed::Partial)),
        Err(e) => return Err(e),
    };
    Ok(head_parts(buf, n, &res, is_head))
}

fn head_parts(
    buf: &[u8],
    n: usize,
    res: &httparse::Response<'_, '_>,
    is_head: bool,
) -> Result<Parsed, String> {
    let code = res.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| format!("bad status code {code}"))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        // Never asked for: `Upgrade` is hop-by-hop and not forwarded.
        return Err("the upstream switched protocols unasked".into());
    }
    if status.is_informational() {
        return Ok(Parsed::Interim(n));
    }
    let version = match res.version {
        Some(1) => Version::HTTP_11,
        _ => Version::HTTP_10,
    };
    let mut headers = HeaderMap::with_capacity(res.headers.len());
    // The values are slices of one copy of the head, not a copy each.
    let raw = Bytes::copy_from_slice(&buf[..n]);
    let mut length: Option<u64> = None;
    let mut transfer_coded = false;
    // The transfer codings, in the order they were applied, across every field line.
    let mut codings: Vec<&str> = Vec::new();
    let (mut saw_close, mut saw_keep_alive) = (false, false);
    // Fields the `Connection` header names: hop-by-hop too, removed once all are in (no
    // allocation for the usual `Connection: keep-alive`).
    let mut named: Vec<&str> = Vec::new();
    for f in res.headers.iter() {
        let name = HeaderName::from_bytes(f.name.as_bytes())
            .map_err(|_| format!("bad field name {:?}", f.name))?;
        // `f.value` lies inside `buf[..n]`, as its copy's slice does inside `raw`.
        let at = (f.value.as_ptr() as usize).wrapping_sub(buf.as_ptr() as usize);
        let value = raw
            .get(at..at.saturating_add(f.value.len()))
            .map(|v| raw.slice_ref(v))
            .ok_or_else(|| format!("bad value of {}", f.name))
            .and_then(|v| {
                HeaderValue::from_maybe_shared(v).map_err(|_| format!("bad value of {}", f.name))
            })?;
        if name == CONTENT_LENGTH {
            let text = std::str::from_utf8(f.value).unwrap_or("");
            for part in text.split(',') {
                let part = part.trim();
                let n = (!part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
                    .then(|| part.parse::<u64>().ok())
                    .flatten()
                    .ok_or_else(|| format!("bad Content-Length {text:?}"))?;
                if length.is_some_and(|l| l != n) {
                    return Err("conflicting Content-Length values".into());
                }
                length = Some(n);
            }
        } else if name == http::header::TRANSFER_ENCODING {
            transfer_coded = true;
            let text = std::str::from_utf8(f.value)
                .map_err(|_| "Transfer-Encoding is not text".to_string())?;
            codings.extend(text.split(',').map(str::trim).filter(|c| !c.is_empty()));
        } else if name == CONNECTION {
            let text = std::str::from_utf8(f.value).unwrap_or("");
            for token in text.split(',').map(str::trim) {
                saw_close |= token.eq_ignore_ascii_case("close");
                saw_keep_alive |= token.eq_ignore_ascii_case("keep-alive");
                // Every option names a field to drop, `close` included (§7.6.1); the
                // hop-by-hop ones (`keep-alive`, say) are left out below anyway.
                if !token.is_empty()
                    && !HOP_BY_HOP
                        .iter()
                        .any(|h| token.eq_ignore_ascii_case(h.as_str()))
                {
                    named.push(token);
                }
            }
        }
        // Hop-by-hop fields (RFC 9110 §7.6.1) are read for framing, never passed on.
        if !is_hop_by_hop(&name) {
            headers.append(name, value);
        }
    }
    for token in named {
        if let Ok(name) = HeaderName::from_bytes(token.as_bytes()) {
            headers.remove(name);
        }
    }
    // `close` wins in any order; HTTP/1.0 keeps the connection only when asked to.
    let mut close = saw_close || (version == Version::HTTP_10 && !saw_keep_alive);
    if transfer_coded && version == Version::HTTP_10 {
        // RFC 9112 §6.1: framing an HTTP/1.0 recipient cannot have asked for is faulty.
        return Err("Transfer-Encoding in an HTTP/1.0 response".into());
    }
    // Only the last coding says whether the body is chunked, and chunked is applied at
    // most once, last (RFC 9112 §6.1): anything else cannot be framed or passed on.
    let chunked = codings
        .last()
        .is_some_and(|c| c.eq_ignore_ascii_case("chunked"));
    let applied = &codings[..codings.len() - usize::from(chunked)];
    if applied.iter().any(|c| c.eq_ignore_ascii_case("chunked")) {
        return Err(format!(
            "malformed Transfer-Encoding {:?}: chunked is not the last coding",
            codings.join(", ")
        ));
    }
    let bodiless =
        is_head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    // An answer that has no body but says it has one: whatever the upstream writes after
    // it cannot be told from the next answer, so its connection is not used again.
    if bodiless && (transfer_coded || length.is_some_and(|n| n > 0)) {
        close = true;
    }
    let framing = if bodiless {
        Framing::Length(0)
    } else if transfer_coded {
        // RFC 9112 §6.3: Transfer-Encoding wins over Content-Length, and a response with
        // both may be an attack on a later answer: that connection is not used again.
        if length.is_some() {
            close = true;
            headers.remove(CONTENT_LENGTH);
        }
        if chunked {
            Framing::Chunked(Chunk::Size)
        } else {
            Framing::UntilClose
        }
    } else {
        match length {
            Some(n) => Framing::Length(n),
            None => Framing::UntilClose,
        }
    };
    if matches!(framing, Framing::UntilClose) {
        close = true;
    }
    let mut parts = Response::new(()).into_parts().0;
    parts.status = status;
    parts.version = version;
    parts.headers = headers;
    if close {
        parts.extensions.insert(Close);
    }
    if !bodiless && !applied.is_empty() {
        // The body is still coded (gzip, say) once its chunked framing is read: the
        // codings go on with it, or the client gets bytes it cannot decode (`pass_codings`).
        let joined = applied.join(", ");
        let value = HeaderValue::from_str(&joined)
            .map_err(|_| format!("bad Transfer-Encoding {joined:?}"))?;
        parts.extensions.insert(Codings(value));
    }
    // A reason phrase of the upstream's own is passed on as it was.
    if let Some(reason) = res.reason.filter(|r| Some(*r) != status.canonical_reason()) {
        if let Ok(reason) = hyper::ext::ReasonPhrase::try_from(reason.as_bytes()) {
            parts.extensions.insert(reason);
        }
    }
    Ok(Parsed::Final(n, parts, framing))
}

/// Marks an answer whose connection must not be used again.
#[derive(Clone, Copy)]
struct Close;

/// The transfer codings (other than chunked) the upstream applied to an answer's body.
#[derive(Clone)]
struct Codings(HeaderValue);

/// An answer whose body carries transfer codings other than chunked (`Transfer-Encoding:
/// gzip, chunked`) keeps them for an HTTP/1.1 client: the codings are named again and
/// hyper frames the still-coded bytes as chunked after them. HTTP/1.0 has no transfer
/// codings and HTTP/2 forbids them: such a client gets a 502 rather than bytes that are
/// not what the upstream's fields describe.
fn pass_codings(
    mut answer: Response<ResponseBody>,
    client: Version,
) -> Result<Response<ResponseBody>, ProxyError> {
    let Some(Codings(codings)) = answer.extensions_mut().remove::<Codings>() else {
        return Ok(answer);
    };
    if client != Version::HTTP_11 {
        // Dropping the answer closes its connection: its body is never read.
        return Err(ProxyError::Coding(
            String::from_utf8_lossy(codings.as_bytes()).into_owned(),
        ));
    }
    answer
        .headers_mut()
        .insert(http::header::TRANSFER_ENCODING, codings);
    Ok(answer)
}

/// How the rest of a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// This many bytes left.
    Length(u64),
    Chunked(Chunk),
    /// Until the upstream closes the connection.
    UntilClose,
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk's data: this many bytes left.
    Data(u64),
    /// After a chunk's data: its CRLF.
    DataEnd,
    /// After the last chunk: the trailer section, up to its blank line.
    Trailers,
}

/// The upstream's response body, read from its connection as the client takes it. The
/// connection goes back to the pool when the body ended cleanly and can carry another
/// request; a body dropped early takes its connection with it.
///
/// An upstream that sends nothing of the body for `timeout` (as nginx's
/// `proxy_read_timeout`: between two reads) fails it: the client's connection is cut, and
/// neither the client nor the upstream connection is held by a silent upstream.
pub struct ResponseBody {
    conn: Option<Conn>,
    /// The rest of the request body, still going up (an early answer).
    upload: Option<Upload>,
    buf: BytesMut,
    framing: Framing,
    reuse: bool,
    pool: Arc<Pool>,
    /// While the body waits on the upstream: since when, and the clock on it (boxed: most
    /// answers never wait, and this body is moved whole through every layer).
    stall: Option<Box<Stall>>,
}

struct Stall {
    since: tokio::time::Instant,
    clock: Option<(tokio::time::Instant, Pin<Box<tokio::time::Sleep>>)>,
}

/// The connection an answer is read from: whole (and maybe kept), or the read half of one
/// whose write half carries an upload (never kept).
enum Conn {
    Whole(TcpStream),
    Half(OwnedReadHalf),
}

impl ResponseBody {
    fn answer(
        mut parts: http::response::Parts,
        conn: Conn,
        upload: Option<Upload>,
        buf: BytesMut,
        framing: Framing,
        proxy: &Proxy,
    ) -> Response<ResponseBody> {
        let reuse = parts.extensions.remove::<Close>().is_none();
        let mut body = ResponseBody {
            conn: Some(conn),
            upload,
            buf,
            framing,
            reuse,
            pool: proxy.pool.clone(),
            stall: None,
        };
        body.finish_if_done();
        Response::from_parts(parts, body)
    }

    /// Once the body is over, give the connection back (or close it), and drop what is
    /// left of an upload.
    fn finish_if_done(&mut self) {
        if self.framing == Framing::Length(0) {
            self.framing = Framing::Done;
        }
        if self.framing != Framing::Done {
            return;
        }
        self.upload = None;
        if let Some(Conn::Whole(conn)) = self.conn.take() {
            // Bytes past the end of the answer would be read as the next one: never reuse.
            if self.reuse && self.buf.is_empty() {
                self.pool.put(conn);
            }
        }
    }

    /// Read more from the upstream into `buf`; `Ok(0)` at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        match self.conn.as_mut() {
            None => Poll::Ready(Ok(0)),
            Some(Conn::Whole(conn)) => loop {
                self.buf.reserve(READ_SIZE);
                match conn.try_read_buf(&mut self.buf) {
                    Ok(n) => return Poll::Ready(Ok(n)),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        ready!(conn.poll_read_ready(cx))?;
                    }
                    Err(e) => return Poll::Ready(Err(e)),
                }
            },
            Some(Conn::Half(half)) => {
                let mut chunk = [0u8; 8192];
                let mut read = ReadBuf::new(&mut chunk);
                ready!(Pin::new(half).poll_read(cx, &mut read))?;
                self.buf.extend_from_slice(read.filled());
                Poll::Ready(Ok(read.filled().len()))
            }
        }
    }

    /// The next frame already in `buf`, or what to do about it.
    fn next_in_buffer(&mut self) -> Result<Option<Frame<Bytes>>, BodyError> {
        loop {
            match self.framing {
                Framing::Done => return Ok(None),
                Framing::Length(0) => {
                    self.framing = Framing::Done;
                    return Ok(None);
                }
                Framing::Length(left) | Framing::Chunked(Chunk::Data(left)) => {
                    if self.buf.is_empty() {
                        return Err(BodyError::NeedMore);
                    }
                    let take = (self.buf.len() as u64).min(left) as usize;
                    let data = self.buf.split_to(take).freeze();
                    let left = left - take as u64;
                    self.framing = match self.framing {
                        Framing::Length(_) => Framing::Length(left),
                        _ if left == 0 => Framing::Chunked(Chunk::DataEnd),
                        _ => Framing::Chunked(Chunk::Data(left)),
                    };
                    return Ok(Some(Frame::data(data)));
                }
                Framing::UntilClose => {
                    if self.buf.is_empty() {
                        return Err(BodyError::NeedMore);
                    }
                    return Ok(Some(Frame::data(self.buf.split().freeze())));
                }
                Framing::Chunked(Chunk::DataEnd) => {
                    if self.buf.len() < 2 {
                        return Err(BodyError::NeedMore);
                    }
                    if &self.buf[..2] != b"\r\n" {
                        return Err(BodyError::Bad("chunk data not followed by CRLF"));
                    }
                    self.buf.advance(2);
                    self.framing = Framing::Chunked(Chunk::Size);
                }
                Framing::Chunked(Chunk::Size) => {
                    let Some(end) = find(&self.buf, b"\r\n") else {
                        return Err(if self.buf.len() > MAX_CHUNK_LINE {
                            BodyError::Bad("chunk-size line too long")
                        } else {
                            BodyError::NeedMore
                        });
                    };
                    let size = chunk_size(&self.buf[..end])?;
                    self.buf.advance(end + 2);
                    self.framing = Framing::Chunked(if size == 0 {
                        Chunk::Trailers
                    } else {
                        Chunk::Data(size)
                    });
                }
                Framing::Chunked(Chunk::Trailers) => {
                    // The trailer section: fields up to a blank line, passed on as
                    // trailers (hyper sends them to clients that can take them).
                    if self.buf.starts_with(b"\r\n") {
                        self.buf.advance(2);
                        self.framing = Framing::Done;
                        return Ok(None);
                    }
                    let Some(end) = find(&self.buf, b"\r\n\r\n") else {
                        return Err(if self.buf.len() > MAX_TRAILERS {
                            BodyError::Bad("trailer section too long")
                        } else {
                            BodyError::NeedMore
                        });
                    };
                    let section = self.buf.split_to(end + 4);
                    self.framing = Framing::Done;
                    return Ok(trailers(&section)?.map(Frame::trailers));
                }
            }
        }
    }
}

/// A trailer section's fields; `None` when none is worth passing on.
fn trailers(section: &[u8]) -> Result<Option<HeaderMap>, BodyError> {
    let mut fields = [httparse::EMPTY_HEADER; FEW_FIELDS];
    let parsed = httparse::parse_headers(section, &mut fields);
    let Ok(httparse::Status::Complete((_, fields))) = parsed else {
        return Err(BodyError::Bad("malformed trailer section"));
    };
    let mut map = HeaderMap::new();
    for f in fields {
        let name = HeaderName::from_bytes(f.name.as_bytes());
        let value = HeaderValue::from_bytes(f.value);
        if let (Ok(name), Ok(value)) = (name, value) {
            map.append(name, value);
        }
    }
    // Framing and routing fields never belong in trailers (RFC 9110 §6.5.1).
    strip_hop_by_hop(&mut map);
    for name in [CONTENT_LENGTH, HOST, http::header::CONTENT_TYPE] {
        map.remove(name);
    }
    Ok((!map.is_empty()).then_some(map))
}

enum BodyError {
    NeedMore,
    Bad(&'static str),
}

fn find(buf: &[u8], what: &[u8]) -> Option<usize> {
    buf.windows(what.len()).position(|w| w == what)
}

/// A chunk-size line: hex digits, then optional whitespace and `;` extensions (ignored).
fn chunk_size(line: &[u8]) -> Result<u64, BodyError> {
    let end = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    let rest = line[end..].trim_ascii_start();
    if end == 0 || !(rest.is_empty() || rest[0] == b';') {
        return Err(BodyError::Bad("bad chunk size"));
    }
    let digits = &line[..end];
    let digits = &digits[digits.iter().take_while(|&&b| b == b'0').count()..];
    if digits.len() > 15 {
        return Err(BodyError::Bad("chunk size too large"));
    }
    let mut size = 0u64;
    for &b in digits {
        // Hex digits only (checked above), at most 15 of them: no overflow.
        size = size * 16 + u64::from((b as char).to_digit(16).unwrap_or(0));
    }
    Ok(size)
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = &mut *self;
        // The rest of an upload goes up while the answer comes down. Its end (sent, or
        // failed: the upstream stopped reading) changes nothing about the answer.
        if let Some(upload) = this.upload.as_mut() {
            if upload.as_mut().poll(cx).is_ready() {
                this.upload = None;
            }
        }
        loop {
            match this.next_in_buffer() {
                Ok(Some(frame)) => {
                    this.finish_if_done();
                    return Poll::Ready(Some(Ok(frame)));
                }
                Ok(None) => {
                    this.finish_if_done();
                    return Poll::Ready(None);
                }
                Err(BodyError::Bad(why)) => {
                    this.conn = None;
                    this.framing = Framing::Done;
                    return Poll::Ready(Some(Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("upstream response body: {why}"),
                    ))));
                }
                Err(BodyError::NeedMore) => {}
            }
            let filled = match this.poll_fill(cx) {
                Poll::Ready(filled) => {
                    if let Some(stall) = this.stall.as_mut() {
                        stall.since = tokio::time::Instant::now();
                    }
                    filled
                }
                Poll::Pending => {
                    let timeout = this.pool.timeout;
                    let stall = this.stall.get_or_insert_with(|| {
                        Box::new(Stall {
                            since: tokio::time::Instant::now(),
                            clock: None,
                        })
                    });
                    if crate::connection::expired(&mut stall.clock, stall.since + timeout, cx) {
                        this.conn = None;
                        this.framing = Framing::Done;
                        return Poll::Ready(Some(Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("the upstream sent nothing of its body for {timeout:?}"),
                        ))));
                    }
                    return Poll::Pending;
                }
            };
            match filled {
                Ok(0) if this.framing == Framing::UntilClose => {
                    this.conn = None;
                    this.framing = Framing::Done;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    this.conn = None;
                    this.framing = Framing::Done;
                    return Poll::Ready(Some(Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the upstream closed the connection inside the response body",
                    ))));
                }
                Ok(_) => {}
                Err(e) => {
                    this.conn = None;
                    this.framing = Framing::Done;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing == Framing::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

/// Remove the hop-by-hop fields, and every field the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages have none: one pass over the names instead of a lookup for each.
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    if headers.contains_key(CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .collect();
        for name in &named {
            headers.remove(name);
        }
    }
    for name in HOP_BY_HOP.iter() {
        headers.remove(name);
    }
}

/// A client connection's peer, with its address as the forwarding headers show it:
/// rendered once per connection, not once per request.
#[derive(Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// `10.0.0.1` or `::1`, as `X-Forwarded-For` and `X-Real-IP` carry it.
    forwarded: HeaderValue,
    /// `10.0.0.1` or `"[::1]"`, as a `Forwarded` node (RFC 7239 §6: an IPv6 address is
    /// bracketed and quoted).
    node: Bytes,
    /// `for=<node>;proto=http`: the `Forwarded` element of this hop, what an untrusted
    /// peer's request carries.
    element: HeaderValue,
}

impl Peer {
    pub fn new(addr: SocketAddr) -> Peer {
        let ip = addr.ip().to_canonical();
        let text = ip.to_string();
        let node = match ip {
            IpAddr::V4(_) => text.clone(),
            IpAddr::V6(_) => format!("\"[{text}]\""),
        };
        // An address's text is always a valid header value.
        let value = |s: String| {
            HeaderValue::from_maybe_shared(Bytes::from(s))
                .unwrap_or_else(|_| HeaderValue::from_static("unknown"))
        };
        Peer {
            addr,
            forwarded: value(text),
            element: value(format!("for={node};proto=http")),
            node: Bytes::from(node),
        }
    }

    pub fn ip(&self) -> IpAddr {
        self.addr.ip()
    }
}

/// The forwarding fields a request came with, as [`forwarding`] treats them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Forwarding {
    For,
    Forwarded,
    Proto,
    Host,
    /// `X-Real-IP` and every other `X-Forwarded-*`.
    Other,
}

impl Forwarding {
    fn of(name: &HeaderName) -> Option<Forwarding> {
        let n = name.as_str();
        Some(match n {
            "x-forwarded-for" => Forwarding::For,
            "forwarded" => Forwarding::Forwarded,
            "x-forwarded-proto" => Forwarding::Proto,
            "x-forwarded-host" => Forwarding::Host,
            "x-real-ip" => Forwarding::Other,
            _ if n.starts_with("x-forwarded-") => Forwarding::Other,
            _ => return None,
        })
    }
}

/// Which forwarding fields a trusted proxy set itself.
#[derive(Default)]
struct Kept {
    proto: bool,
    host: bool,
}

/// `name: part1part2...\r\n`.
fn field_line(head: &mut Vec<u8>, name: &str, parts: &[&[u8]]) {
    head.extend_from_slice(name.as_bytes());
    head.extend_from_slice(b": ");
    for p in parts {
        head.extend_from_slice(p);
    }
    head.extend_from_slice(b"\r\n");
}

/// `name: <its values, joined>, <element>` on one line.
fn appended_line(head: &mut Vec<u8>, headers: &HeaderMap, name: &HeaderName, element: &[&[u8]]) {
    head.extend_from_slice(name.as_str().as_bytes());
    head.extend_from_slice(b": ");
    for v in headers.get_all(name) {
        head.extend_from_slice(v.as_bytes());
        head.extend_from_slice(b", ");
    }
    for p in element {
        head.extend_from_slice(p);
    }
    head.extend_from_slice(b"\r\n");
}

/// The forwarding fields the upstream gets. From a trusted proxy they tell a story that
/// began before it: `X-Forwarded-Proto` and `X-Forwarded-Host` are kept as that proxy set
/// them (and written here only where it did not), `X-Real-IP` as it came, and the peer is
/// appended to `X-Forwarded-For` and, where the proxy sent one, to `Forwarded` (RFC 7239
/// §7.1) — so the two chains agree, and a `Forwarded: proto=https` is never contradicted
/// by an `X-Forwarded-Proto` written here. From any other peer nothing it says about
/// itself is believed: every `X-Forwarded-*`, `Forwarded` and `X-Real-IP` field it sent
/// was left out, and each is written anew from what the gateway itself saw (the peer,
/// `http`, the `Host`).
fn forwarding(
    head: &mut Vec<u8>,
    headers: &HeaderMap,
    down: &Downstream<'_>,
    host: Option<&HeaderValue>,
    kept: Kept,
) {
    let peer = down.peer;
    if down.trusted {
        appended_line(
            head,
            headers,
            &X_FORWARDED_FOR,
            &[peer.forwarded.as_bytes()],
        );
        if headers.contains_key(http::header::FORWARDED) {
            appended_line(
                head,
                headers,
                &http::header::FORWARDED,
                &[b"for=", &peer.node],
            );
        }
        if !kept.proto {
            field_line(head, "x-forwarded-proto", &[b"http"]);
        }
        if let Some(host) = host.filter(|_| !kept.host) {
            field_line(head, "x-forwarded-host", &[host.as_bytes()]);
        }
        return;
    }
    field_line(head, "x-forwarded-for", &[peer.forwarded.as_bytes()]);
    field_line(head, "x-real-ip", &[peer.forwarded.as_bytes()]);
    field_line(head, "x-forwarded-proto", &[b"http"]);
    field_line(head, "forwarded", &[peer.element.as_bytes()]);
    if let Some(host) = host {
        field_line(head, "x-forwarded-host", &[host.as_bytes()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test_pool() -> Pool {
        Pool {
            idle: Mutex::default(),
            timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named_fields() {
        let mut h = HeaderMap::new();
        h.insert(
            CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret-Hop , close"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert("x-end-to-end", HeaderValue::from_static("kept"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h["x-end-to-end"], "kept");
    }

    #[test]
    fn the_hop_by_hop_match_is_the_list() {
        for name in &HOP_BY_HOP {
            assert!(is_hop_by_hop(name), "{name}");
        }
        for name in ["host", "content-length", "x-connection", "tee", "upgrades"] {
            assert!(!is_hop_by_hop(&HeaderName::from_static(name)), "{name}");
        }
    }

    /// The head `request_head` writes for `request` from `peer`, trusted or not.
    fn forwarded_head(request: Request<()>, peer: &str, trusted: bool) -> String {
        let proxy = Proxy::new(&Upstream {
            url: "http://127.0.0.1:3000".parse().unwrap(),
            base_path: String::new(),
            connect_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
        });
        let (parts, ()) = request.into_parts();
        let peer = Peer::new(peer.parse().unwrap());
        let down = Downstream {
            peer: &peer,
            trusted,
            body_timeout: Duration::from_secs(1),
        };
        let host = parts.headers.get(HOST).cloned();
        let head = proxy
            .request_head(&parts, false, &down, host.as_ref())
            .unwrap();
        String::from_utf8(head).unwrap()
    }

    #[test]
    fn forwarding_fields_are_appended_from_trusted_peers_and_replaced_from_others() {
        let request = || {
            Request::get("/x")
                .header("host", "app.test")
                .header("x-forwarded-for", "1.1.1.1")
                .header("x-forwarded-for", "2.2.2.2")
                .header("x-forwarded-proto", "https")
                .header("forwarded", "for=1.1.1.1;proto=https")
                .header("x-forwarded-port", "443")
                .header("x-real-ip", "1.1.1.1")
                .header("x-other", "kept")
                .body(())
                .unwrap()
        };
        assert_eq!(
            forwarded_head(request(), "[::ffff:10.0.0.1]:4000", true),
            "GET /x HTTP/1.1\r\nhost: app.test\r\nx-forwarded-proto: https\r\n\
             x-forwarded-port: 443\r\nx-real-ip: 1.1.1.1\r\nx-other: kept\r\n\
             x-forwarded-for: 1.1.1.1, 2.2.2.2, 10.0.0.1\r\n\
             forwarded: for=1.1.1.1;proto=https, for=10.0.0.1\r\n\
             x-forwarded-host: app.test\r\n\r\n"
        );
        assert_eq!(
            forwarded_head(request(), "[2001:db8::7]:4000", false),
            "GET /x HTTP/1.1\r\nhost: app.test\r\nx-other: kept\r\n\
             x-forwarded-for: 2001:db8::7\r\nx-real-ip: 2001:db8::7\r\n\
             x-forwarded-proto: http\r\nforwarded: for=\"[2001:db8::7]\";proto=http\r\n\
             x-forwarded-host: app.test\r\n\r\n"
        );
        // A trusted proxy that sent no Forwarded gets none: its chain is X-Forwarded-For.
        let plain = Request::get("/").header("host", "a").body(()).unwrap();
        let head = forwarded_head(plain, "127.0.0.1:1", true);
        assert!(!head.contains("forwarded:"), "{head}");
        assert!(head.contains("x-forwarded-for: 127.0.0.1\r\n"), "{head}");
    }

    fn head(text: &str, is_head: bool) -> Result<(usize, http::response::Parts, Framing), String> {
        match parse_head(text.as_bytes(), is_head)? {
            Parsed::Final(n, parts, framing) => Ok((n, parts, framing)),
            Parsed::Interim(n) => Err(format!("interim of {n}")),
            Parsed::Partial => Err("partial".into()),
        }
    }

    #[test]
    fn response_framing_follows_rfc_9112() {
        let (_, p, f) = head("HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n", false).unwrap();
        assert_eq!((p.status, f), (StatusCode::OK, Framing::Length(12)));
        assert!(p.extensions.get::<Close>().is_none());
        // Repeated equal lengths are one length; different ones are an error.
        let (_, _, f) = head("HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n", false).unwrap();
        assert_eq!(f, Framing::Length(5));
        assert!(head(
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            false
        )
        .is_err());
        assert!(head("HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", false).is_err());
        assert!(head("HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\n", false).is_err());
        // Chunked wins over a length, and the connection is not reused after it.
        let (_, p, f) = head(
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!(f, Framing::Chunked(Chunk::Size));
        assert!(p.extensions.get::<Close>().is_some());
        assert!(p.headers.get(CONTENT_LENGTH).is_none());
        // A coding other than chunked last: read until close, the coding kept.
        let (_, p, f) = head("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", false).unwrap();
        assert_eq!(f, Framing::UntilClose);
        assert!(p.extensions.get::<Close>().is_some());
        assert_eq!(
            p.extensions.get::<Codings>().map(|c| c.0.clone()),
            Some(HeaderValue::from_static("gzip"))
        );
        // Chunked last: the other codings are kept for the client, across field lines.
        let (_, p, f) = head(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: br, chunked\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!(f, Framing::Chunked(Chunk::Size));
        assert_eq!(
            p.extensions.get::<Codings>().map(|c| c.0.clone()),
            Some(HeaderValue::from_static("gzip, br"))
        );
        assert!(p.extensions.get::<Close>().is_none());
        // Chunked applied, then something over it: no framing can be trusted.
        assert!(head(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
            false
        )
        .is_err());
        assert!(head(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n",
            false
        )
        .is_err());
        // No framing at all: until close.
        let (_, _, f) = head("HTTP/1.1 200 OK\r\n\r\n", false).unwrap();
        assert_eq!(f, Framing::UntilClose);
        // No body: HEAD, 204, 304, whatever the fields say; and a connection that carried
        // one that said it had a body is not used again (what follows is ambiguous).
        for (text, is_head, reuse) in [
            ("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", true, true),
            ("HTTP/1.1 204 No Content\r\n\r\n", false, true),
            (
                "HTTP/1.1 304 Not Modified\r\nContent-Length: 0\r\n\r\n",
                false,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n",
                true,
                false,
            ),
            (
                "HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n",
                false,
                false,
            ),
            (
                "HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
                false,
                false,
            ),
        ] {
            let (_, p, f) = head(text, is_head).unwrap();
            assert_eq!(f, Framing::Length(0), "{text}");
            assert_eq!(p.extensions.get::<Close>().is_none(), reuse, "{text}");
        }
        for (text, is_head) in [
            ("HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n", true),
            (
                "HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n",
                false,
            ),
            (
                "HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
                false,
            ),
        ] {
            assert_eq!(head(text, is_head).unwrap().2, Framing::Length(0), "{text}");
        }
        // Connection: close and HTTP/1.0 (unless keep-alive) end the connection.
        let (_, p, _) = head(
            "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            false,
        )
        .unwrap();
        assert!(p.extensions.get::<Close>().is_some());
        let (_, p, _) = head("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", false).unwrap();
        assert!(p.extensions.get::<Close>().is_some());
        let (_, p, _) = head(
            "HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 0\r\n\r\n",
            false,
        )
        .unwrap();
        assert!(p.extensions.get::<Close>().is_none());
    }

    #[test]
    fn interim_answers_are_skipped_and_bad_heads_refused() {
        assert!(matches!(
            parse_head(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n", false),
            Ok(Parsed::Interim(25))
        ));
        assert!(matches!(
            parse_head(b"HTTP/1.1 200 OK\r\nA: b", false),
            Ok(Parsed::Partial)
        ));
        assert!(parse_head(b"HTTP/1.1 101 Switching Protocols\r\n\r\n", false).is_err());
        assert!(parse_head(b"garbage\r\n\r\n", false).is_err());
        assert!(parse_head(b"HTTP/1.1 999x OK\r\n\r\n", false).is_err());
    }

    /// Feed `wire` to a body in pieces of `step` bytes, as reads would; the body bytes out.
    fn decode(framing: Framing, wire: &[u8], step: usize) -> Result<Vec<u8>, &'static str> {
        let (pool, mut out) = (Arc::new(test_pool()), Vec::new());
        let mut body = ResponseBody {
            conn: None,
            upload: None,
            buf: BytesMut::new(),
            framing,
            reuse: false,
            pool,
            stall: None,
        };
        let mut pieces = wire.chunks(step.max(1));
        loop {
            match body.next_in_buffer() {
                Ok(Some(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        out.extend_from_slice(&data);
                    }
                }
                Ok(None) => return Ok(out),
                Err(BodyError::Bad(why)) => return Err(why),
                Err(BodyError::NeedMore) => match pieces.next() {
                    Some(p) => body.buf.extend_from_slice(p),
                    None => return Err("ended early"),
                },
            }
        }
    }

    #[test]
    fn chunked_bodies_decode_across_any_split() {
        let wire = b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n";
        for step in 1..wire.len() + 1 {
            assert_eq!(
                decode(Framing::Chunked(Chunk::Size), wire, step).as_deref(),
                Ok(&b"hello, world"[..]),
                "split every {step} bytes"
            );
        }
        assert_eq!(
            decode(Framing::Length(5), b"hello", 2).as_deref(),
            Ok(&b"hello"[..])
        );
        for bad in [
            &b"zz\r\nhello\r\n0\r\n\r\n"[..],
            b"5\r\nhelloXX0\r\n\r\n",
            b"\r\n",
        ] {
            assert!(
                decode(Framing::Chunked(Chunk::Size), bad, 3).is_err(),
                "{bad:?}"
            );
        }
        // A size too large for 15 hex digits is refused, not wrapped.
        assert!(decode(Framing::Chunked(Chunk::Size), b"1000000000000000\r\n", 64).is_err());
    }

    #[test]
    fn chunk_sizes_are_hex_digits_then_only_extensions() {
        let size = |line: &[u8]| chunk_size(line).ok();
        assert_eq!(size(b"1f"), Some(31));
        assert_eq!(
            size(b"0000000000000002"),
            Some(2),
            "leading zeros are not a size"
        );
        assert_eq!(size(b"2 ;name=value"), Some(2));
        assert_eq!(size(b"2;a;b=\"c\""), Some(2));
        for bad in [
            &b"+2"[..],
            b"-2",
            b"2 junk",
            b"",
            b" 2",
            b"0x2",
            b"fffffffffffffffff",
        ] {
            assert_eq!(size(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn trailers_are_passed_on_without_framing_fields() {
        let wire = b"2\r\nok\r\n0\r\nx-checksum: abc\r\ncontent-length: 9\r\n\r\n";
        let mut body = ResponseBody {
            conn: None,
            upload: None,
            buf: BytesMut::from(&wire[..]),
            framing: Framing::Chunked(Chunk::Size),
            reuse: false,
            pool: Arc::new(test_pool()),
            stall: None,
        };
        let data = body
            .next_in_buffer()
            .ok()
            .flatten()
            .and_then(|f| f.into_data().ok());
        assert_eq!(data.as_deref(), Some(&b"ok"[..]));
        let trailers = body
            .next_in_buffer()
            .ok()
            .flatten()
            .and_then(|f| f.into_trailers().ok());
        let trailers = trailers.expect("a trailers frame");
        assert_eq!(trailers["x-checksum"], "abc");
        assert!(trailers.get(CONTENT_LENGTH).is_none());
        assert!(body.is_end_stream());
    }

    #[test]
    fn connection_rules_and_reason_phrases() {
        // `close` wins whatever the order, on either version.
        for text in [
            "HTTP/1.0 200 OK\r\nConnection: close, keep-alive\r\nContent-Length: 0\r\n\r\n",
            "HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 0\r\n\r\n",
        ] {
            assert!(
                head(text, false)
                    .unwrap()
                    .1
                    .extensions
                    .get::<Close>()
                    .is_some(),
                "{text}"
            );
        }
        // Transfer-Encoding in an HTTP/1.0 answer is faulty framing.
        assert!(head(
            "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            false
        )
        .is_err());
        // An own reason phrase is kept; the standard one needs nothing.
        let (_, p, _) = head(
            "HTTP/1.1 599 Custom Thing\r\nContent-Length: 0\r\n\r\n",
            false,
        )
        .unwrap();
        let reason = p
            .extensions
            .get::<hyper::ext::ReasonPhrase>()
            .expect("reason");
        assert_eq!(reason.as_bytes(), b"Custom Thing");
        let (_, p, _) = head("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", false).unwrap();
        assert!(p.extensions.get::<hyper::ext::ReasonPhrase>().is_none());
    }

    #[test]
    fn an_answers_hop_by_hop_fields_are_left_out_as_it_is_parsed() {
        // Every Connection option names a field to drop, whichever side of it that field
        // stands and whatever its case: `close` and `keep-alive` too.
        let (_, p, _) = head(
            "HTTP/1.1 200 OK\r\nX-Early: 1\r\nClose: secret\r\nConnection: close, X-EARLY\r\n\
             Connection: x-late ,\r\nKeep-Alive: timeout=5\r\nX-Late: 2\r\nTE: trailers\r\n\
             Upgrade: h2c\r\nTrailer: x\r\nProxy-Authenticate: Basic\r\nX-Kept: 3\r\n\
             Content-Length: 0\r\n\r\n",
            false,
        )
        .unwrap();
        let names: Vec<&str> = p.headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-kept", "content-length"]);
        assert!(p.extensions.get::<Close>().is_some());
    }
}
