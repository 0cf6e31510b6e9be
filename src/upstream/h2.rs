//! HTTP/2 to a pool's servers (`protocol = "h2" | "h2c" | "auto"`), through hyper's
//! `client::conn::http2`.
//!
//! # Connections
//!
//! Each server has one [`Http2`]: a few connections shared by every worker (HTTP/2
//! multiplexes; one connection per worker would be many idle ones). A request takes a
//! stream on the first connection with room, as the server's own SETTINGS allow
//! (`SETTINGS_MAX_CONCURRENT_STREAMS`, read off the wire by `peer_settings`: hyper does
//! not say); where every connection is full, another is opened — one at a time per
//! server, so that a burst of requests fills the connection it waited for instead of
//! opening one each. A connection that fails, is closed, or sends GOAWAY takes no new
//! stream and goes; the next request opens its replacement. One with no stream for 60 s
//! (as an HTTP/1.1 connection is kept idle) is let go when a request next looks for room.
//!
//! Opening: TCP, TLS with ALPN `h2` (`h2`), `h2` then `http/1.1` (`auto`), or nothing
//! (`h2c`: prior knowledge, RFC 9113 §3.3), within `connect_timeout`; then hyper's
//! handshake, its connection driven by a task of its own, and the server's SETTINGS
//! awaited (within `connect_timeout` again). Where `auto`'s ALPN gives HTTP/1.1, that
//! connection carries the request on the worker's HTTP/1.1 client, and the server is
//! spoken HTTP/1.1 from then on (offering `http/1.1` alone) until a handshake fails.
//!
//! # A request
//!
//! The client's request as [`super::Outbound`] readied it (hop-by-hop fields gone, `Host`
//! ensured), its forwarding fields written by the same code as HTTP/1.1's
//! (`forward::fields`), `Host` as `:authority`, and `te: trailers` where the client sent
//! it. Its body streams up as the client sends it (h2's flow control paces it), its
//! trailers with it; the answer's body streams down, its trailers with it. The clocks
//! are HTTP/1.1's: the client may pause its body at most `body_timeout` (then 408), the
//! answer's head must come within `timeout` of the body's end (then 504), and the answer's
//! body may pause at most `timeout`.
//!
//! A stream the server refused unprocessed (REFUSED_STREAM, or after its GOAWAY) goes
//! again once on this server — a new connection, where the refusing one is going away —
//! if nothing of its body was taken; then, as any failure, to another server where the
//! pool allows it ([`super::Outbound::may_retry`]).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, HOST, TE};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, Uri, Version};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::Notify;

use super::body::{clean_trailers, RequestBody, Sending, Silence};
use super::forward::{self, MapFields};
use super::peer_settings::{PeerSettings, Watched};
use super::stream::Stream;
use super::{Alpn, Client, Downstream, Error, Outbound, Protocol, ResponseBody};

/// What an `auto` server chose in ALPN, as last seen.
const CHOSE_UNKNOWN: u8 = 0;
const CHOSE_H2: u8 = 1;
const CHOSE_HTTP1: u8 = 2;

/// How long a connection with no stream is kept (as HTTP/1.1's idle connections are).
const IDLE_FOR: Duration = Duration::from_secs(60);

/// One server's HTTP/2 side: its connections, shared by the workers.
pub(super) struct Http2 {
    /// Opens connections (its address, TLS, `Host`, base path and clocks are the server's).
    opener: Client,
    protocol: Protocol,
    scheme: Scheme,
    conns: Mutex<Vec<Arc<Conn>>>,
    /// Held while a connection is being opened: one at a time.
    opening: tokio::sync::Mutex<()>,
    /// `auto`: what the server chose in ALPN (`CHOSE_*`).
    chose: AtomicU8,
}

/// One HTTP/2 connection.
struct Conn {
    send: SendRequest<UpBody>,
    /// Streams the gateway has open on it.
    streams: AtomicU32,
    peer: Arc<PeerSettings>,
    /// It refused a stream or failed: no new stream goes on it.
    going: AtomicBool,
    /// When it was opened, and (ms after that) when its last stream ended.
    born: Instant,
    idle_from_ms: AtomicU64,
}

impl Conn {
    fn usable(&self) -> bool {
        !self.going.load(Relaxed) && !self.send.is_closed()
    }

    /// No stream on it for `IDLE_FOR`: let go (its last handle dropped, hyper ends it).
    fn stale(&self) -> bool {
        self.streams.load(Relaxed) == 0
            && self.ms().saturating_sub(self.idle_from_ms.load(Relaxed))
                >= IDLE_FOR.as_millis() as u64
    }

    fn ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }
}

/// A stream taken on a connection, given back when dropped (the answer's body ended, or
/// the exchange failed).
pub(super) struct Slot(Arc<Conn>);

impl Drop for Slot {
    fn drop(&mut self) {
        if self.0.streams.fetch_sub(1, Relaxed) == 1 {
            self.0.idle_from_ms.store(self.0.ms(), Relaxed);
        }
    }
}

/// What a request gets to go on.
enum Way {
    Stream(Slot),
    /// `auto`: the server chose HTTP/1.1 on this new connection.
    Http1(Stream),
}

impl Http2 {
    pub(super) fn new(opener: Client, protocol: Protocol) -> Http2 {
        let scheme = match protocol {
            Protocol::H2c => Scheme::HTTP,
            _ => Scheme::HTTPS,
        };
        Http2 {
            opener,
            protocol,
            scheme,
            conns: Mutex::new(Vec::new()),
            opening: tokio::sync::Mutex::new(()),
            chose: AtomicU8::new(CHOSE_UNKNOWN),
        }
    }

    /// One attempt at `out` on this server; `http1` is this worker's HTTP/1.1 client, for
    /// an `auto` server that chose HTTP/1.1.
    pub(super) async fn send(
        &self,
        out: &mut Outbound,
        down: &Downstream<'_>,
        http1: &Client,
    ) -> Result<Response<ResponseBody>, Error> {
        if self.chose.load(Relaxed) == CHOSE_HTTP1 {
            let sent = http1.send(out, down).await;
            if let Err(Error::Tls { .. }) = &sent {
                // Refused, maybe for offering HTTP/1.1 alone: ALPN decides again.
                self.chose.store(CHOSE_UNKNOWN, Relaxed);
            }
            return sent;
        }
        let mut again = true;
        loop {
            let slot = match self.way().await? {
                Way::Stream(slot) => slot,
                Way::Http1(conn) => return http1.send_on(out, down, Some(conn)).await,
            };
            match self.exchange(slot, out, down).await {
                Err(e @ Error::Refused(_)) if again && out.may_retry(&e) => {
                    tracing::debug!(error = %e, "HTTP/2 stream refused: sending it again on a new stream");
                    again = false;
                }
                sent => return sent,
            }
        }
    }

    /// A health check: `GET path` on a connection of its own, closed after, within
    /// `timeout`; the answer's status.
    pub(super) async fn probe(
        &self,
        path: &str,
        timeout: Duration,
        http1: &Client,
    ) -> Result<u16, Error> {
        let probe = async {
            if self.chose.load(Relaxed) == CHOSE_HTTP1 {
                let (conn, _) = http1.open(Alpn::Http1).await?;
                return http1.probe_on(conn, path).await;
            }
            let conn = match self.open().await? {
                Opened::Http2(conn) => conn,
                Opened::Http1(conn) => return http1.probe_on(conn, path).await,
            };
            let uri = Uri::builder()
                .scheme(self.scheme.clone())
                .authority(self.opener.authority.as_bytes())
                .path_and_query(format!("{}{path}", self.opener.base_path))
                .build()
                .map_err(|_| Error::Target(Uri::from_static("/")))?;
            let req = Request::get(uri)
                .header(http::header::USER_AGENT, "ratewall-health-check")
                .body(UpBody::empty())
                .map_err(|_| Error::Target(Uri::from_static("/")))?;
            let mut send = conn.send.clone();
            let resp = send
                .send_request(req)
                .await
                .map_err(|source| Error::Http2 {
                    source,
                    replayable: false,
                })?;
            Ok(resp.status().as_u16())
        };
        tokio::time::timeout(timeout, probe)
            .await
            .unwrap_or(Err(Error::Timeout(timeout)))
    }

    /// A stream on a connection with room, opening one where none has.
    async fn way(&self) -> Result<Way, Error> {
        if let Some(slot) = self.take() {
            return Ok(Way::Stream(slot));
        }
        // One opening at a time; a wait longer than an opening may take opens its own.
        let connect_timeout = self.opener.connect_timeout;
        let _gate = tokio::time::timeout(connect_timeout, self.opening.lock())
            .await
            .ok();
        if let Some(slot) = self.take() {
            return Ok(Way::Stream(slot));
        }
        match self.open().await? {
            Opened::Http1(conn) => Ok(Way::Http1(conn)),
            Opened::Http2(conn) => {
                conn.streams.fetch_add(1, Relaxed);
                let slot = Slot(conn.clone());
                let mut conns = self.conns.lock().unwrap_or_else(PoisonError::into_inner);
                conns.push(conn);
                Ok(Way::Stream(slot))
            }
        }
    }

    /// A stream on the first open connection with room, if any (the ones gone dropped).
    fn take(&self) -> Option<Slot> {
        let mut conns = self.conns.lock().unwrap_or_else(PoisonError::into_inner);
        conns.retain(|c| c.usable() && !c.stale());
        // Counted under the lock: two requests never both take a connection's last room.
        let conn = conns
            .iter()
            .find(|c| c.streams.load(Relaxed) < c.peer.max_streams())?;
        conn.streams.fetch_add(1, Relaxed);
        Some(Slot(conn.clone()))
    }

    /// A new connection: HTTP/2, or for `auto` what ALPN chose.
    async fn open(&self) -> Result<Opened, Error> {
        let alpn = match self.protocol {
            Protocol::Auto => Alpn::Auto,
            _ => Alpn::H2,
        };
        let (io, addr) = self.opener.open(alpn).await?;
        if self.protocol == Protocol::Auto {
            if !io.alpn_h2() {
                self.chose.store(CHOSE_HTTP1, Relaxed);
                return Ok(Opened::Http1(io));
            }
            self.chose.store(CHOSE_H2, Relaxed);
        } else if self.protocol == Protocol::H2 && !io.alpn_h2() {
            // A server that offers no ALPN at all: rustls lets the handshake through.
            return Err(Error::Http2Handshake {
                addr,
                why: "the server did not agree to h2 in ALPN".into(),
            });
        }
        let peer = PeerSettings::new();
        let io = TokioIo::new(Watched::new(io, peer.clone()));
        let handshake = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .handshake::<_, UpBody>(io);
        let timeout = self.opener.connect_timeout;
        let (send, connection) = match tokio::time::timeout(timeout, handshake).await {
            Ok(Ok(pair)) => pair,
            Ok(Err(e)) => {
                return Err(Error::Http2Handshake {
                    addr,
                    why: e.to_string(),
                })
            }
            Err(_) => {
                return Err(Error::ConnectTimeout {
                    addr,
                    after: timeout,
                })
            }
        };
        let conn = Arc::new(Conn {
            send,
            streams: AtomicU32::new(0),
            peer: peer.clone(),
            going: AtomicBool::new(false),
            born: Instant::now(),
            idle_from_ms: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&conn);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(upstream = %addr, error = %e, "HTTP/2 connection to the upstream failed");
            }
            if let Some(conn) = weak.upgrade() {
                conn.going.store(true, Relaxed);
            }
        });
        // Its SETTINGS say how many streams it takes: known before the first goes on it.
        if tokio::time::timeout(timeout, peer.settled()).await.is_err() {
            conn.going.store(true, Relaxed);
            return Err(Error::ConnectTimeout {
                addr,
                after: timeout,
            });
        }
        Ok(Opened::Http2(conn))
    }

    /// One exchange on `slot`'s connection.
    async fn exchange(
        &self,
        slot: Slot,
        out: &mut Outbound,
        down: &Downstream<'_>,
    ) -> Result<Response<ResponseBody>, Error> {
        let (req, upload) = self.request(out, down)?;
        let replayable = upload.is_none() && out.parts.method.is_idempotent();
        out.sending_now();
        let mut send = slot.0.send.clone();
        let answer = send.send_request(req);
        tokio::pin!(answer);
        let timeout = self.opener.timeout;
        // Armed once the body is all sent (at once without one).
        let deadline = tokio::time::sleep(match upload {
            None => timeout,
            Some(_) => Duration::MAX / 4,
        });
        tokio::pin!(deadline);
        let answer = loop {
            let changed = async {
                match &upload {
                    Some(u) => u.changed.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                answer = &mut answer => break answer,
                () = &mut deadline => return Err(Error::Timeout(timeout)),
                () = changed => {
                    let Some(u) = &upload else { continue };
                    if let Some(fault) = u.fault() {
                        return Err(fault);
                    }
                    if u.ended.load(Relaxed) {
                        deadline.as_mut().reset(tokio::time::Instant::now() + timeout);
                    }
                }
            }
        };
        match answer {
            Ok(resp) => {
                let (mut parts, body) = resp.into_parts();
                // None should come over HTTP/2 (RFC 9113 §8.2.2); none goes on.
                forward::strip_hop_by_hop(&mut parts.headers);
                // The client is answered in its own version (as for HTTP/1.1 upstreams).
                parts.version = Version::HTTP_11;
                let body = Http2Body {
                    body,
                    slot: Some(slot),
                    timeout,
                    silence: Silence::default(),
                };
                Ok(Response::from_parts(parts, ResponseBody::http2(body)))
            }
            Err(source) => {
                if let Some(fault) = upload.as_ref().and_then(|u| u.fault()) {
                    return Err(fault);
                }
                if refused(&source) {
                    slot.0.going.store(true, Relaxed);
                    return Err(Error::Refused(source));
                }
                Err(Error::Http2 { source, replayable })
            }
        }
    }

    /// `out` as an HTTP/2 request, with what watches its body going up (none without one).
    fn request(
        &self,
        out: &mut Outbound,
        down: &Downstream<'_>,
    ) -> Result<(Request<UpBody>, Option<Arc<Upload>>), Error> {
        let pq = out.target.as_deref().unwrap_or_else(|| {
            out.parts
                .uri
                .path_and_query()
                .map_or("/", PathAndQuery::as_str)
        });
        let asterisk = pq == "*" && out.parts.method == Method::OPTIONS;
        if !(pq.starts_with('/') || asterisk) {
            return Err(Error::Target(out.parts.uri.clone()));
        }
        let base = &self.opener.base_path;
        let path = if base.is_empty() {
            PathAndQuery::try_from(pq)
        } else {
            PathAndQuery::try_from(format!("{base}{pq}"))
        }
        .map_err(|_| Error::Target(out.parts.uri.clone()))?;
        let host = match out.default_host {
            true => None,
            false => out.parts.headers.get(HOST),
        };
        // The client's `Host` where it is an authority, else the server's.
        let authority = host
            .and_then(|h| Authority::try_from(h.as_bytes()).ok())
            .map_or_else(|| Authority::try_from(self.opener.authority.as_bytes()), Ok)
            .map_err(|_| Error::Target(out.parts.uri.clone()))?;
        let uri = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(authority)
            .path_and_query(path)
            .build()
            .map_err(|_| Error::Target(out.parts.uri.clone()))?;
        let mut fields = MapFields::with_capacity(out.parts.headers.len() + 6);
        let host = out.asked.as_ref();
        forward::fields(&mut fields, &out.parts.headers, down, host);
        let mut headers = fields.map;
        if out.te_trailers {
            headers.insert(TE, HeaderValue::from_static("trailers"));
        }
        let (body, upload) = match (out.sending, out.body.take()) {
            (Sending::None, _) | (_, None) => (UpBody::empty(), None),
            (_, Some(body)) => {
                let upload = Arc::new(Upload::new(down.body_timeout));
                (
                    UpBody::new(body, upload.clone(), out.screened.clone()),
                    Some(upload),
                )
            }
        };
        let mut req = Request::new(body);
        *req.method_mut() = out.parts.method.clone();
        *req.uri_mut() = uri;
        *req.version_mut() = Version::HTTP_2;
        *req.headers_mut() = headers;
        Ok((req, upload))
    }
}

enum Opened {
    Http2(Arc<Conn>),
    /// `auto`, and ALPN chose HTTP/1.1.
    Http1(Stream),
}

/// Whether the server refused the stream before processing it (RFC 9113 §8.7): reset
/// with REFUSED_STREAM, or cut by a GOAWAY without error that came before it (§6.8: the
/// streams after its last one were not processed), or never handed to a connection that
/// had closed.
fn refused(e: &hyper::Error) -> bool {
    if e.is_canceled() {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h2) = s.downcast_ref::<h2::Error>() {
            return h2.reason() == Some(h2::Reason::REFUSED_STREAM)
                || (h2.is_go_away()
                    && h2.is_remote()
                    && h2.reason() == Some(h2::Reason::NO_ERROR));
        }
        source = s.source();
    }
    false
}

/// A request body on its way up: what became of it, for the exchange to answer by.
pub(super) struct Upload {
    body_timeout: Duration,
    /// Every byte and the trailers were handed on.
    ended: AtomicBool,
    fault: Mutex<Option<Error>>,
    /// Woken when it ended or failed.
    changed: Notify,
}

impl Upload {
    fn new(body_timeout: Duration) -> Upload {
        Upload {
            body_timeout,
            ended: AtomicBool::new(false),
            fault: Mutex::new(None),
            changed: Notify::new(),
        }
    }

    /// The client's fault, if its body failed (taken: the exchange answers it once).
    fn fault(&self) -> Option<Error> {
        self.fault
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    fn failed(&self, e: Error) {
        *self.fault.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
        self.changed.notify_one();
    }
}

/// The client's request body as it goes up an HTTP/2 stream: data and trailers as they
/// come, under the client's `body_timeout` (a pause that long fails it: 408).
pub(super) struct UpBody {
    body: Option<RequestBody>,
    upload: Option<Arc<Upload>>,
    /// Names its trailers lose beside the hop-by-hop and forwarding ones
    /// ([`Outbound::screening`]).
    screened: Option<Arc<[HeaderName]>>,
    /// Since when the client has been awaited, and the clock on it.
    silence: Silence,
}

impl UpBody {
    fn empty() -> UpBody {
        UpBody {
            body: None,
            upload: None,
            screened: None,
            silence: Silence::default(),
        }
    }

    fn new(body: RequestBody, upload: Arc<Upload>, screened: Option<Arc<[HeaderName]>>) -> UpBody {
        UpBody {
            body: Some(body),
            upload: Some(upload),
            screened,
            silence: Silence::default(),
        }
    }

    fn end(&mut self) {
        self.body = None;
        if let Some(u) = self.upload.take() {
            u.ended.store(true, Relaxed);
            u.changed.notify_one();
        }
    }
}

/// Why a request body stopped going up (hyper resets the stream with it).
#[derive(Debug, thiserror::Error)]
#[error("the client's request body failed")]
pub(super) struct ClientBodyFailed;

impl Body for UpBody {
    type Data = Bytes;
    type Error = ClientBodyFailed;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyFailed>>> {
        let this = &mut *self;
        let Some(body) = this.body.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.silence.heard_until_asked();
                let frame = match frame.into_trailers() {
                    Ok(mut trailers) => {
                        clean_trailers(&mut trailers);
                        forward::screen_request_trailers(&mut trailers, this.screened.as_deref());
                        Frame::trailers(trailers)
                    }
                    Err(frame) => frame,
                };
                if this.body.as_ref().is_some_and(Body::is_end_stream) {
                    this.end();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.end();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.body = None;
                if let Some(u) = this.upload.take() {
                    u.failed(Error::ClientBody(e));
                }
                Poll::Ready(Some(Err(ClientBodyFailed)))
            }
            Poll::Pending => {
                let Some(timeout) = this.upload.as_ref().map(|u| u.body_timeout) else {
                    return Poll::Pending;
                };
                // Counted from the first poll that found nothing: while h2 waits for the
                // server's window it does not poll, and that is not the client's pause.
                if this.silence.past(timeout, cx) {
                    this.body = None;
                    if let Some(u) = this.upload.take() {
                        u.failed(Error::ClientStalled(timeout));
                    }
                    return Poll::Ready(Some(Err(ClientBodyFailed)));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        match &self.body {
            Some(b) => b.size_hint(),
            None => SizeHint::with_exact(0),
        }
    }
}

/// An HTTP/2 upstream's answer body: data and trailers as the stream gives them, its
/// stream counted on its connection until it ends, under the clock on the upstream's
/// silences (`timeout`).
pub(super) struct Http2Body {
    body: Incoming,
    slot: Option<Slot>,
    timeout: Duration,
    silence: Silence,
}

impl Body for Http2Body {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        if this.slot.is_none() && this.body.is_end_stream() {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.silence.heard();
                if this.body.is_end_stream() {
                    this.slot = None;
                }
                let frame = match frame.into_trailers() {
                    Ok(mut trailers) => {
                        clean_trailers(&mut trailers);
                        Frame::trailers(trailers)
                    }
                    Err(frame) => frame,
                };
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.slot = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.slot = None;
                Poll::Ready(Some(Err(io::Error::other(e))))
            }
            Poll::Pending => {
                let timeout = this.timeout;
                if this.silence.past(timeout, cx) {
                    this.slot = None;
                    let stalled = super::BodyError::Stalled(timeout);
                    return Poll::Ready(Some(Err(stalled.into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
