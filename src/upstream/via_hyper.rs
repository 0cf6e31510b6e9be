//! EXPERIMENT (issue 15, item 5), built only with `--features hyper-upstream`: the same
//! upstream client on hyper's `client::conn::http1` — a handshake over each `TcpStream`,
//! its `Connection` driven by a task of its own on the worker's runtime, requests sent
//! through `SendRequest` — with a per-worker pool of idle `SendRequest`s of its own (reused
//! when ready, the same `MAX_IDLE` and idle time), the same forwarding fields, and the same
//! clocks: connect, the answer's head within `timeout` of the request body having been
//! read whole, a stalled client body (408), a silent upstream inside a body. The reuse
//! rules hyper does not apply itself (a bodiless answer announcing a body; `Content-Length`
//! with `Transfer-Encoding`) are applied here, as are the transfer codings passed on.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, HOST, TRANSFER_ENCODING};
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::sync::Notify;

use super::body::Sending;
use super::forward::{self, strip_hop_by_hop, Downstream};
use super::head::{MAX_FIELDS, MAX_HEAD};
use super::pool::Address;
use super::{Error, Malformed};
use crate::config;

/// Idle connections kept per worker, and for how long (as the hand-written pool).
const MAX_IDLE: usize = 256;
const IDLE_FOR: Duration = Duration::from_secs(60);

/// One worker's way to the upstream, on hyper's HTTP/1 client connections.
pub struct Client {
    address: Address,
    authority: HeaderValue,
    base_path: String,
    timeout: Duration,
    connect_timeout: Duration,
    builder: http1::Builder,
    pool: Arc<Pool>,
}

/// Idle `SendRequest`s, most recently used last.
struct Pool {
    idle: Mutex<VecDeque<(SendRequest<UpBody>, Instant)>>,
    timeout: Duration,
}

impl Pool {
    fn take(&self) -> Option<SendRequest<UpBody>> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some((_, since)) = idle.front() {
            if since.elapsed() < IDLE_FOR {
                break;
            }
            idle.pop_front();
        }
        // Ready: hyper's connection task is idle and wants a request (one that closed, or
        // read bytes nobody asked for, is closed and never ready again).
        while let Some((sender, _)) = idle.pop_back() {
            if sender.is_ready() {
                return Some(sender);
            }
        }
        None
    }

    fn put(&self, sender: SendRequest<UpBody>) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() >= MAX_IDLE {
            idle.pop_front();
        }
        idle.push_back((sender, Instant::now()));
    }

    fn sweep(&self) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain(|(sender, since)| since.elapsed() < IDLE_FOR && !sender.is_closed());
    }
}

impl Client {
    pub fn new(cfg: &config::Upstream) -> Client {
        let host = cfg.url.host().unwrap_or("127.0.0.1");
        let port = cfg.url.port_u16().unwrap_or(80);
        let authority = match cfg.url.port() {
            Some(p) => format!("{host}:{}", p.as_str()),
            None => host.to_string(),
        };
        let authority = HeaderValue::from_str(&authority)
            .unwrap_or_else(|_| HeaderValue::from_static("127.0.0.1"));
        let mut builder = http1::Builder::new();
        // The hand-written client's limits: as many field lines, as large a head.
        builder.max_headers(MAX_FIELDS).max_buf_size(MAX_HEAD);
        Client {
            address: Address::new(host, port),
            authority,
            base_path: cfg.base_path.clone(),
            timeout: cfg.timeout,
            connect_timeout: cfg.connect_timeout,
            builder,
            pool: Arc::new(Pool {
                idle: Mutex::default(),
                timeout: cfg.timeout,
            }),
        }
    }

    pub fn sweep(&self) {
        self.pool.sweep();
    }

    pub async fn forward(
        &self,
        req: Request<Incoming>,
        down: &Downstream<'_>,
    ) -> Result<Response<ResponseBody>, Error> {
        let (mut parts, body) = req.into_parts();
        let host = forward::prepare(&mut parts, &self.authority);
        let sending = Sending::of(&body, &mut parts.headers);
        forward::into_map(&mut parts.headers, down, host.as_ref());
        if sending == Sending::Chunked {
            // hyper sends a GET's body of unknown length only when told to.
            let chunked = HeaderValue::from_static("chunked");
            parts.headers.insert(TRANSFER_ENCODING, chunked);
        }
        parts.uri = origin_form(std::mem::take(&mut parts.uri), &self.base_path)?;
        let client = std::mem::replace(&mut parts.version, Version::HTTP_11);
        let is_head = parts.method == Method::HEAD;
        let (body, upload) = UpBody::new(body, sending, down.body_timeout);
        let mut sender = match self.pool.take() {
            Some(sender) => sender,
            None => self.connect().await?,
        };
        let sent = sender.send_request(Request::from_parts(parts, body));
        let answer = self
            .await_head(sent, upload.as_deref(), down.body_timeout)
            .await?;
        self.answer(answer, sender, is_head, client)
    }

    async fn connect(&self) -> Result<SendRequest<UpBody>, Error> {
        let tcp = self.address.connect(self.connect_timeout).await?;
        let (sender, conn) = self
            .builder
            .handshake(TokioIo::new(tcp))
            .await
            .map_err(upstream_error)?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// The answer's head, within `timeout` of the request body having been read whole.
    async fn await_head(
        &self,
        sent: impl std::future::Future<Output = hyper::Result<Response<Incoming>>>,
        upload: Option<&Upload>,
        body_timeout: Duration,
    ) -> Result<Response<Incoming>, Error> {
        let result = match upload {
            None => tokio::time::timeout(self.timeout, sent)
                .await
                .map_err(|_| Error::Timeout(self.timeout))?,
            Some(up) => {
                tokio::pin!(sent);
                let deadline = tokio::time::sleep(Duration::MAX / 4);
                tokio::pin!(deadline);
                let mut armed = false;
                loop {
                    tokio::select! {
                        r = &mut sent => break r,
                        () = up.ended.notified(), if !armed => {
                            armed = true;
                            deadline.as_mut().reset(tokio::time::Instant::now() + self.timeout);
                        }
                        () = &mut deadline => return Err(Error::Timeout(self.timeout)),
                    }
                }
            }
        };
        result.map_err(|e| match upload.and_then(Upload::failure) {
            Some(Failure::Client(e)) => Error::ClientBody(e),
            Some(Failure::Stalled) => Error::ClientStalled(body_timeout),
            None => upstream_error(e),
        })
    }

    /// hyper's answer, with the reuse rules and transfer codings of the hand-written client.
    fn answer(
        &self,
        answer: Response<Incoming>,
        sender: SendRequest<UpBody>,
        is_head: bool,
        client: Version,
    ) -> Result<Response<ResponseBody>, Error> {
        let (mut parts, inner) = answer.into_parts();
        // hyper's client has no limit on the head's size (its server's `max_header_size`
        // has no client twin): `max_buf_size` is checked only when what was buffered does
        // not hold a whole head, so a head that arrives within a few reads passes at up to
        // about twice it. The hand-written client's limit is applied here, to the head as
        // hyper parsed it (the status line counted without its reason phrase).
        let head_len = parts
            .headers
            .iter()
            .fold(b"HTTP/1.1 200 \r\n\r\n".len(), |n, (k, v)| {
                n + k.as_str().len() + v.len() + 4
            });
        if head_len > MAX_HEAD {
            return Err(Malformed::TooLarge.into());
        }
        if parts.status == StatusCode::SWITCHING_PROTOCOLS {
            return Err(Malformed::SwitchedProtocols.into());
        }
        let bodiless = is_head
            || parts.status == StatusCode::NO_CONTENT
            || parts.status == StatusCode::NOT_MODIFIED;
        let coded = parts.headers.contains_key(TRANSFER_ENCODING);
        let length = parts.headers.get(CONTENT_LENGTH);
        let announced = coded || length.is_some_and(|l| l.as_bytes() != b"0");
        let mut reuse = !(bodiless && announced);
        if coded && length.is_some() {
            reuse = false;
            parts.headers.remove(CONTENT_LENGTH);
        }
        let codings = match coded && !bodiless {
            true => applied_codings(&parts.headers)?,
            false => None,
        };
        strip_hop_by_hop(&mut parts.headers);
        if let Some(codings) = codings {
            if client != Version::HTTP_11 {
                return Err(Error::Coding(codings));
            }
            parts.headers.insert(TRANSFER_ENCODING, codings);
        }
        let mut body = ResponseBody {
            inner,
            sender: reuse.then_some(sender),
            pool: self.pool.clone(),
            stall: None,
        };
        body.finish_if_done();
        Ok(Response::from_parts(parts, body))
    }
}

/// The request target in origin form, under the upstream's base path.
fn origin_form(uri: Uri, base_path: &str) -> Result<Uri, Error> {
    let pq = uri.path_and_query().map_or("/", PathAndQuery::as_str);
    if !(pq.starts_with('/') || pq == "*") {
        return Err(Error::Target(uri));
    }
    if base_path.is_empty() && uri.scheme().is_none() && uri.authority().is_none() {
        return Ok(uri);
    }
    let target = format!("{base_path}{pq}");
    Uri::try_from(target).map_err(|_| Error::Target(uri))
}

/// The codings other than the last `chunked`, as the client is to be told of them.
fn applied_codings(headers: &HeaderMap) -> Result<Option<HeaderValue>, Malformed> {
    let mut codings = Vec::new();
    for value in headers.get_all(TRANSFER_ENCODING) {
        let text = value.to_str().map_err(|_| Malformed::TransferEncoding)?;
        codings.extend(text.split(',').map(str::trim).filter(|c| !c.is_empty()));
    }
    let chunked = codings
        .last()
        .is_some_and(|c| c.eq_ignore_ascii_case("chunked"));
    let applied = &codings[..codings.len() - usize::from(chunked)];
    if applied.iter().any(|c| c.eq_ignore_ascii_case("chunked")) {
        return Err(Malformed::TransferEncoding);
    }
    if applied.is_empty() {
        return Ok(None);
    }
    HeaderValue::from_str(&applied.join(", "))
        .map(Some)
        .map_err(|_| Malformed::TransferEncoding)
}

/// hyper's error, as the nearest of the hand-written client's.
fn upstream_error(e: hyper::Error) -> Error {
    if e.is_parse_too_large() {
        Malformed::TooLarge.into()
    } else if e.is_parse() || e.is_parse_status() {
        Malformed::Syntax(httparse::Error::Status).into()
    } else if e.is_incomplete_message() {
        Error::Closed { replayable: false }
    } else {
        Error::Read {
            source: io::Error::other(e),
            replayable: false,
        }
    }
}

/// What the request body going up tells the request's task: that it was read whole, or
/// why it failed.
struct Upload {
    ended: Notify,
    failure: Mutex<Option<Failure>>,
}

enum Failure {
    Client(hyper::Error),
    Stalled,
}

impl Upload {
    fn failure(&self) -> Option<Failure> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// The client's request body as hyper's connection task reads it: each frame within
/// `body_timeout`, trailers left out.
pub struct UpBody {
    inner: Option<Incoming>,
    upload: Option<Arc<Upload>>,
    body_timeout: Duration,
    since: Option<tokio::time::Instant>,
    clock: Option<(tokio::time::Instant, Pin<Box<tokio::time::Sleep>>)>,
}

impl UpBody {
    fn new(
        body: Incoming,
        sending: Sending,
        body_timeout: Duration,
    ) -> (UpBody, Option<Arc<Upload>>) {
        let upload = (sending != Sending::None).then(|| {
            Arc::new(Upload {
                ended: Notify::new(),
                failure: Mutex::new(None),
            })
        });
        let body = UpBody {
            inner: (sending != Sending::None).then_some(body),
            upload: upload.clone(),
            body_timeout,
            since: None,
            clock: None,
        };
        (body, upload)
    }

    fn end(&self) {
        if let Some(upload) = &self.upload {
            upload.ended.notify_one();
        }
    }

    fn fail(&self, failure: Failure) -> io::Error {
        if let Some(upload) = &self.upload {
            *upload
                .failure
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(failure);
        }
        io::Error::other("the client's request body failed")
    }
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        loop {
            let Some(inner) = this.inner.as_mut() else {
                return Poll::Ready(None);
            };
            match Pin::new(&mut *inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let ended = inner.is_end_stream();
                    this.since = None;
                    if ended {
                        this.end();
                    }
                    if frame.is_trailers() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(None) => {
                    this.end();
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    return Poll::Ready(Some(Err(this.fail(Failure::Client(e)))));
                }
                Poll::Pending => {
                    let now = tokio::time::Instant::now();
                    let since = *this.since.get_or_insert(now);
                    let deadline = since + this.body_timeout;
                    if crate::connection::expired(&mut this.clock, deadline, cx) {
                        return Poll::Ready(Some(Err(this.fail(Failure::Stalled))));
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Incoming::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Incoming::size_hint)
    }
}

/// The upstream's answer body, as hyper's connection task hands it over: its connection
/// goes back to the pool once it ended (where reuse is allowed); cut after `timeout` of
/// silence.
pub struct ResponseBody {
    inner: Incoming,
    sender: Option<SendRequest<UpBody>>,
    pool: Arc<Pool>,
    stall: Option<Box<Stall>>,
}

struct Stall {
    since: tokio::time::Instant,
    clock: Option<(tokio::time::Instant, Pin<Box<tokio::time::Sleep>>)>,
}

impl ResponseBody {
    fn finish_if_done(&mut self) {
        if self.inner.is_end_stream() {
            if let Some(sender) = self.sender.take() {
                self.pool.put(sender);
            }
        }
    }
}

/// A trailer section without framing and routing fields; `None` when nothing is left.
fn trailers(mut map: HeaderMap) -> Option<HeaderMap> {
    strip_hop_by_hop(&mut map);
    for name in [CONTENT_LENGTH, HOST, CONTENT_TYPE] {
        map.remove(name);
    }
    (!map.is_empty()).then_some(map)
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(stall) = this.stall.as_mut() {
                        stall.since = tokio::time::Instant::now();
                    }
                    let frame = match frame.into_trailers() {
                        Ok(map) => match trailers(map) {
                            Some(map) => Frame::trailers(map),
                            None => continue,
                        },
                        Err(frame) => frame,
                    };
                    this.finish_if_done();
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(None) => {
                    if let Some(sender) = this.sender.take() {
                        this.pool.put(sender);
                    }
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    this.sender = None;
                    return Poll::Ready(Some(Err(io::Error::other(e))));
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
                        this.sender = None;
                        return Poll::Ready(Some(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the upstream sent nothing of its body in time",
                        ))));
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
