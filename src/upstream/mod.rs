//! The upstream side: the pools a config names (`[[upstreams]]`, `[upstream]` as the pool
//! `default`) with their servers, how a server is picked and when it is left out, and an
//! HTTP/1.1 client written for this one job, hop-by-hop stripping and `X-Forwarded-*`.
//! Bodies are never buffered: the client's request body streams to the upstream and the
//! upstream's response body streams back.
//!
//! # A pool
//!
//! [`Pools`] holds one [`Pool`] per `PoolSettings` (`settings`), kept across a reload that
//! leaves its settings alone. A pool's servers are its `servers` entries, a host name's
//! every address one server (`pools`: re-resolved every `resolve_every`); each has one
//! [`Client`] per worker thread, so its kept connections are driven by the thread that
//! serves the request. [`Pool::forward`] picks a server (`balance`: round robin,
//! least requests, two random choices, consistent hashing), among those its health
//! lets take requests (`health`: passive ejection from the requests' own failures, active
//! checks from a task per pool), sends, and where an attempt failed before any answer in a
//! way that lets the request go again ([`Outbound::may_retry`]), tries another server, up
//! to `retries` more, within the pool's retry budget (`budget`). Each pool and server is
//! counted in the metrics `metrics` registers.
//!
//! # The client
//!
//! Why not hyper's client: it runs each upstream connection as a task of its own, reached
//! through a channel, so every request costs two extra task wake-ups and a channel round
//! trip. Here the request's own task writes the request and reads the answer on a kept
//! connection (one per worker thread's pool, so never shared across threads), for less CPU
//! per request than hyper's `client::conn::http1` on a pool of the same kind
//! (docs/performance.md has the comparison and its figures). The response head
//! is parsed with `httparse` (hyper's own parser) and the body framed per RFC 9112 §6:
//! `Content-Length`, `chunked`, or the connection's end.
//!
//! # HTTP/2
//!
//! A pool with `protocol` `h2`, `h2c` or `auto` speaks HTTP/2 to its servers through
//! hyper's `client::conn::http2` instead (`h2`): there one connection carries many
//! requests, so each server's few connections are shared by every worker, and the cost
//! argument above does not apply. A stream goes on the first connection with room under
//! the server's `SETTINGS_MAX_CONCURRENT_STREAMS` (read off the wire, `peer_settings`:
//! hyper does not expose it); the request is readied by the same [`Outbound`] and
//! `forward` code, and its answer is the same [`ResponseBody`] type, trailers passed both
//! ways. An `auto` server that chooses HTTP/1.1 in ALPN is spoken to on this client.
//! Upgrades always go HTTP/1.1.
//!
//! # How a request travels through it
//!
//! 1. [`Outbound::new`] takes the client's request once, whatever server gets it: its
//!    hop-by-hop fields are dropped and a `Host` ensured (`forward`). [`Client::send`]
//!    makes one attempt with it and what the gateway knows of the client
//!    ([`Downstream`]): its head is written as bytes (`head`) — the request line (the
//!    route's rewritten path, if any), the client's fields, the forwarding fields of this
//!    hop (`forward`), the body's framing.
//! 2. A connection comes from this worker's pool, if one is idle and clean, or is opened
//!    (`kept`): TCP, and for an `https://` upstream TLS over it, the backend's certificate
//!    verified (`tls`). Either is a `stream::Stream`, and all that follows is the same
//!    code for both.
//! 3. The head goes up, and the body after it as the client sends it (`body`), while the
//!    answer is awaited: an upstream may answer before it has read the whole body.
//! 4. The answer's head is read and parsed (`head`): its status and fields (hop-by-hop
//!    ones left out), how its body is framed, whether its connection can be used again.
//! 5. The answer goes back to the gateway with a [`ResponseBody`] that reads the rest from
//!    the connection as the client takes it, and puts the connection back in the pool
//!    once the body ended where its framing said (`kept` lists the rules).
//!
//! Anything that keeps a request from its answer's head is an [`Error`], which says the
//! status the client gets and whether the request may be sent again; a body that fails
//! later ends with a [`BodyError`].

mod balance;
mod body;
mod budget;
mod error;
mod forward;
mod h2;
mod head;
mod health;
mod kept;
mod metrics;
mod outage;
mod peer_settings;
mod pools;
#[cfg(test)]
pub(crate) mod served;
mod settings;
mod stream;
mod tls;
pub use tls::client_config;
mod upgrade;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::{Method, Response};
use tokio::io::AsyncWriteExt;

/// A pool's overload protection as its callers meet it: the permit a request holds while
/// the backend has it, why one was shed, and the `Retry-After` of a shed request.
pub use crate::overload::{Permit, Shed, RETRY_AFTER as SHED_RETRY_AFTER};
pub use balance::{key_hash, Balancer, Candidate, Candidates, MAX_RING_POINTS, POINTS_PER_WEIGHT};
pub use body::{BodyError, RequestBody, ResponseBody};
pub use budget::{RetryBudget, MIN_RETRIES_PER_SECOND, RETRY_PERCENT, WINDOW_SECS};
pub use error::{Error, Malformed};
pub use forward::{is_hop_by_hop, ClientPeer, Downstream};
pub use health::{panic_pick, HealthEvent, HealthPolicy, HealthState, ServerHealth};
pub use metrics::{Attempt, PoolMetrics};
pub use outage::{OutageChange, OutageLog};
pub use pools::{Forwarded, Pick, Pool, PoolStatus, Pools, Server, ServerStatus};
pub use settings::{
    Balance, HealthCheck, Passive, PoolSettings, Protocol, ServerSettings, CONNECT_TIMEOUT,
    DEFAULT_POOL, FAIL_TIMEOUT, FAIL_WINDOW, MAX_EJECTED_PERCENT, MAX_EJECTION, MAX_FAILS,
    MAX_NAME, MAX_RETRIES, RESOLVE_EVERY, RETRIES, TIMEOUT,
};
pub use tls::{
    NoVerification, Tls, TlsError, TlsFailure, TlsHandshake, TlsHandshakes, TlsOptions,
    UpstreamTlsMetrics,
};
pub use upgrade::{Switched, Upgrade, Upgraded};

use body::{Conn, Http1Body, Sending, Upload, UploadError};
use kept::{Address, Kept};
use stream::{Stream, WriteSide};
use tls::Alpn;

/// How much is read from the upstream at a time.
const READ_SIZE: usize = 16 * 1024;

/// `[upstream]`, validated: where requests go and the clocks on the way.
#[derive(Debug, PartialEq)]
pub struct Settings {
    /// Scheme and authority of the backend, e.g. `http://127.0.0.1:3000`.
    pub url: http::Uri,
    /// TLS to the backend: set exactly when `url` is `https://`.
    pub tls: Option<Arc<Tls>>,
    /// Path the request path is appended to, without a trailing `/` (empty for `/`).
    pub base_path: String,
    /// The longest opening a connection may take (resolving included).
    pub connect_timeout: Duration,
    /// Counted from the request sent in full, the longest the answer's head may take (then
    /// 504); also the longest the upstream may stay silent inside an answer's body, or
    /// take nothing of an upload.
    pub timeout: Duration,
}

/// The TLS side for `url` with `options`: `None` for `http://`, where no TLS key may be
/// given.
pub fn tls_for(url: &http::Uri, options: TlsOptions) -> Result<Option<Arc<Tls>>, TlsError> {
    if url.scheme_str() != Some("https") {
        if options.any() {
            return Err(TlsError {
                key: "url",
                message: "TLS keys (ca, sni, cert, key, insecure_skip_verify) need an https:// url"
                    .into(),
            });
        }
        return Ok(None);
    }
    let host = url.host().unwrap_or_default();
    Ok(Some(Arc::new(Tls::new(options, host)?)))
}

/// One worker's way to the upstream: where it is, and the connections kept open to it.
pub struct Client {
    address: Address,
    /// TLS over each new connection, for an `https://` upstream.
    tls: Option<Arc<Tls>>,
    /// Where its handshakes are counted.
    tls_handshakes: TlsHandshakes,
    /// The `Host` sent when the client gave none: host and port, never user info.
    authority: HeaderValue,
    base_path: String,
    timeout: Duration,
    connect_timeout: Duration,
    kept: Arc<Kept>,
}

impl Client {
    /// The client for `cfg` connecting to `addr`, one of the addresses its host name
    /// resolved to (the name still goes in `Host` and TLS' SNI); `None`: each new
    /// connection resolves the name, or uses the address the URL gives.
    pub fn at(
        cfg: &Settings,
        addr: Option<std::net::SocketAddr>,
        tls_handshakes: TlsHandshakes,
    ) -> Client {
        let host = cfg.url.host().unwrap_or("127.0.0.1");
        let default_port = if cfg.tls.is_some() { 443 } else { 80 };
        let port = cfg.url.port_u16().unwrap_or(default_port);
        let authority = match cfg.url.port() {
            Some(p) => format!("{host}:{}", p.as_str()),
            None => host.to_string(),
        };
        let authority = HeaderValue::from_str(&authority)
            .unwrap_or_else(|_| HeaderValue::from_static("127.0.0.1"));
        Client {
            address: match addr {
                Some(addr) => Address::resolved(host, addr),
                None => Address::new(host, port),
            },
            tls: cfg.tls.clone(),
            tls_handshakes,
            authority,
            base_path: cfg.base_path.clone(),
            timeout: cfg.timeout,
            connect_timeout: cfg.connect_timeout,
            kept: Arc::new(Kept::new(cfg.timeout)),
        }
    }

    /// Close idle connections that expired or that the upstream closed.
    pub fn sweep(&self) {
        self.kept.sweep();
    }

    /// The `Host` this server is sent when the client named none.
    pub fn authority(&self) -> &HeaderValue {
        &self.authority
    }

    /// One attempt at `out` on this server. The answer's head must arrive within
    /// `timeout` of the request having been sent in full: an upload takes as long as the
    /// client takes to send it, as long as it never pauses for `body_timeout`. Where no
    /// connection could be opened, `out` keeps its body, and [`Outbound::may_retry`] says
    /// whether another server may be tried.
    pub async fn send(
        &self,
        out: &mut Outbound,
        down: &Downstream<'_>,
    ) -> Result<Response<ResponseBody>, Error> {
        if out.upgrade.is_some() {
            return self.upgrade(out, down).await;
        }
        self.send_on(out, down, None).await
    }

    /// [`Client::send`] on `fresh`, a connection just opened for it, where one is given
    /// (an `auto` pool's server that chose HTTP/1.1 in ALPN: `h2`).
    async fn send_on(
        &self,
        out: &mut Outbound,
        down: &Downstream<'_>,
        fresh: Option<Stream>,
    ) -> Result<Response<ResponseBody>, Error> {
        let chunked = out.sending == Sending::Chunked;
        if out.default_host {
            out.parts
                .headers
                .insert(http::header::HOST, self.authority.clone());
        }
        let going = Outgoing {
            head: head::request(
                &out.parts,
                &self.base_path,
                chunked,
                down,
                out.asked.as_ref(),
                out.target.as_deref(),
            )?,
            is_head: out.parts.method == Method::HEAD,
            // Only an idempotent request may go again after its connection failed under
            // it (`Error::retryable`).
            replayable: out.parts.method.is_idempotent(),
        };
        // A kept connection the upstream has closed, or that holds bytes nobody asked for,
        // is found out before it is used (`kept`); one closed the very moment it is used
        // fails this attempt, which goes again only where `Error::retryable` allows.
        let conn = match fresh.or_else(|| self.kept.take()) {
            Some(conn) => conn,
            None => self.open(Alpn::Http1).await?.0,
        };
        out.sending_now();
        let answer = if out.sending == Sending::None {
            self.exchange(conn, going).await?
        } else {
            // From here on the body is this attempt's: no other can send it again.
            let Some(body) = out.body.take() else {
                return Err(Error::Closed { replayable: false });
            };
            self.duplex(conn, going, body, chunked, down.body_timeout)
                .await?
        };
        // The answer's hop-by-hop fields were left out as its head was read; a transfer
        // coding other than chunked is passed on where the client can take it.
        head::pass_codings(answer, out.parts.version)
    }

    /// A health check: `GET path` on a connection of its own (closed after), within
    /// `timeout` in all; the answer's status.
    pub async fn probe(&self, path: &str, timeout: Duration) -> Result<u16, Error> {
        let probe = async { self.probe_on(self.open(Alpn::Http1).await?.0, path).await };
        tokio::time::timeout(timeout, probe)
            .await
            .unwrap_or(Err(Error::Timeout(timeout)))
    }

    /// A health check's `GET path` over HTTP/1.1 on `conn`, closed after.
    async fn probe_on(&self, mut conn: Stream, path: &str) -> Result<u16, Error> {
        let host = self.authority.to_str().unwrap_or("127.0.0.1");
        let head = format!(
            "GET {}{path} HTTP/1.1\r\nhost: {host}\r\nuser-agent: ratewall-health-check\r\nconnection: close\r\n\r\n",
            self.base_path
        );
        let written = match conn.write_all(head.as_bytes()).await {
            Ok(()) => conn.flush().await,
            e => e,
        };
        written.map_err(|source| Error::Write {
            source,
            replayable: false,
        })?;
        let (parts, _, _) = head::read(&mut conn, false, false).await?;
        Ok(parts.status.as_u16())
    }

    /// A new connection and the address it went to: TCP, and TLS over it for an
    /// `https://` upstream offering `alpn`, each within `connect_timeout`.
    async fn open(&self, alpn: Alpn) -> Result<(Stream, std::net::SocketAddr), Error> {
        let (tcp, addr) = self.address.connect(self.connect_timeout).await?;
        let conn = match &self.tls {
            None => Stream::Plain(tcp),
            Some(tls) => {
                tls.handshake(tcp, addr, self.connect_timeout, &self.tls_handshakes, alpn)
                    .await?
            }
        };
        Ok((conn, addr))
    }

    /// A request without a body: the head goes up, and the answer's head must come back
    /// within `timeout`.
    async fn exchange(
        &self,
        mut conn: Stream,
        out: Outgoing,
    ) -> Result<Response<ResponseBody>, Error> {
        let replayable = out.replayable;
        let exchange = async {
            // The flush: TLS may hold the head in its buffer (nothing on plain TCP).
            let written = match conn.write_all(&out.head).await {
                Ok(()) => conn.flush().await,
                e => e,
            };
            written.map_err(|source| Error::Write { source, replayable })?;
            head::read(&mut conn, out.is_head, replayable).await
        };
        let (parts, buf, framing) = tokio::time::timeout(self.timeout, exchange)
            .await
            .unwrap_or(Err(Error::Timeout(self.timeout)))?;
        let conn = Conn::Whole(conn);
        Ok(Http1Body::answer(
            parts, conn, None, buf, framing, &self.kept,
        ))
    }

    /// A request with a body: the body goes up while the answer is awaited, so an upstream
    /// that answers early (a 413, a 401) or streams its answer while it reads (an echo) is
    /// heard at once. An answer that comes before the whole body went up takes the rest of
    /// the upload along in its body (full duplex), and its connection is not kept.
    ///
    /// The clocks: while the body goes up, the client may pause at most `body_timeout`
    /// between two of its reads (then 408), and the upstream may take at most `timeout` to
    /// accept each write; once the body is all sent, the answer's head must come within
    /// `timeout` (then 504). A client whose body is malformed or stalls gets its answer at
    /// once, and the upstream connection, left mid-request, is closed.
    async fn duplex(
        &self,
        conn: Stream,
        out: Outgoing,
        body: RequestBody,
        chunked: bool,
        body_timeout: Duration,
    ) -> Result<Response<ResponseBody>, Error> {
        let (mut rd, mut wr) = conn.split();
        let (timeout, replayable) = (self.timeout, out.replayable);
        let mut upload: Upload = Box::pin(async move {
            let head = out.head;
            body::send(
                &mut wr,
                &head,
                body,
                chunked,
                body_timeout,
                timeout,
                replayable,
            )
            .await?;
            Ok(wr)
        });
        let mut uploaded: Option<Result<WriteSide, UploadError>> = None;
        let answer = {
            // Some of the body may have been read by the time the answer fails: the
            // request cannot go again then (a failed write of its head says so instead).
            let reading = head::read(&mut rd, out.is_head, false);
            tokio::pin!(reading);
            // Armed once the body is all sent (or could not be).
            let deadline = tokio::time::sleep(Duration::MAX / 4);
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    done = &mut upload, if uploaded.is_none() => {
                        let done = match done {
                            Err(UploadError::Client(e)) => return Err(Error::ClientBody(e)),
                            Err(UploadError::Stalled) => {
                                return Err(Error::ClientStalled(body_timeout))
                            }
                            done => done,
                        };
                        uploaded = Some(done);
                        deadline.as_mut().reset(tokio::time::Instant::now() + timeout);
                    }
                    answer = &mut reading => break answer,
                    () = &mut deadline => return Err(Error::Timeout(timeout)),
                }
            }
        };
        let (parts, buf, framing) = match answer {
            Ok(answer) => answer,
            // No answer: a failed write (a reset, say) says most.
            Err(e) => {
                return Err(match uploaded {
                    Some(Err(UploadError::Upstream(wrote))) => wrote,
                    _ => e,
                })
            }
        };
        let (conn, upload) = match uploaded {
            Some(Ok(wr)) => match rd.reunite(wr) {
                Ok(conn) => (Conn::Whole(conn), None),
                Err(rd) => (Conn::Half(rd), None),
            },
            Some(Err(_)) => (Conn::Half(rd), None),
            None => (Conn::Half(rd), Some(upload)),
        };
        Ok(Http1Body::answer(
            parts, conn, upload, buf, framing, &self.kept,
        ))
    }
}

/// A client's request made ready to go upstream, once for all its attempts: hop-by-hop
/// fields gone, a `Host` ensured, its body's framing chosen; the body itself until an
/// attempt sends it.
pub struct Outbound {
    parts: http::request::Parts,
    /// The host the client asked for, which `X-Forwarded-Host` carries.
    asked: Option<HeaderValue>,
    sending: Sending,
    /// Until an attempt takes it to send it.
    body: Option<RequestBody>,
    /// The path and query to send, where a route rewrote them.
    target: Option<String>,
    /// Whether its `Host` is the server's (the client named none): set per attempt.
    default_host: bool,
    /// What it asks to upgrade to, if it does ([`Outbound::upgrading`]).
    upgrade: Option<Upgrade>,
    /// Whether the client said `TE: trailers`: hop-by-hop, so never sent over HTTP/1.1,
    /// but the one `TE` HTTP/2 allows (RFC 9113 §8.2.2), which gRPC servers require.
    te_trailers: bool,
    /// Set once an attempt has a connection to a server and starts sending on it: from
    /// then on a backend may have received the request ([`Outbound::reaching`]).
    reached: Option<Arc<AtomicBool>>,
    /// Names the request's trailers lose on the way up beside the hop-by-hop and framing
    /// ones ([`Outbound::screening`]).
    screened: Option<Arc<[HeaderName]>>,
}

impl Outbound {
    /// A request (its head and its body, as the proxy holds them) to go to `target` (the
    /// route's rewrite of its path, if any); `default_host` is the `Host` sent when the
    /// client named none.
    pub fn new(
        mut parts: http::request::Parts,
        body: RequestBody,
        target: Option<String>,
        default_host: &HeaderValue,
    ) -> Outbound {
        let te_trailers = forward::carries(&parts.headers, &http::header::TE)
            && parts
                .headers
                .get_all(http::header::TE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(','))
                .any(|t| t.trim().eq_ignore_ascii_case("trailers"));
        let (asked, host_given) = forward::prepare(&mut parts, default_host);
        let sending = Sending::of(&body, &mut parts.headers);
        Outbound {
            // A request that names no host is sent each server's own.
            default_host: !host_given && asked.is_none(),
            parts,
            asked,
            sending,
            body: Some(body),
            target,
            upgrade: None,
            te_trailers,
            reached: None,
            screened: None,
        }
    }

    /// Tell `flag` when an attempt starts sending the request to a server (a connection
    /// to it open): what a settlement by status needs to know — a request that never
    /// reached a backend (none could be reached) is given back, one that may have is not.
    /// A stream an HTTP/2 server refused unprocessed still counts as reached: stricter.
    pub fn reaching(&mut self, flag: Arc<AtomicBool>) {
        self.reached = Some(flag);
    }

    /// Drop `names` from the request's trailers too (a cost header: a client's own copy
    /// never reaches a backend that could echo it back as a cost).
    pub fn screening(&mut self, names: Arc<[HeaderName]>) {
        self.screened = Some(names);
    }

    /// An attempt has a connection and starts sending on it.
    fn sending_now(&self) {
        if let Some(flag) = &self.reached {
            flag.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Whether, after an attempt failed with `e`, the request may go to another server:
    /// `e` allows it ([`Error::retryable`]: nothing was sent, or an idempotent request's
    /// head alone went up before a reset), and none of its body was taken — a request
    /// with a body goes again only when no connection could be opened for it.
    pub fn may_retry(&self, e: &Error) -> bool {
        e.retryable() && (self.sending == Sending::None || self.body.is_some())
    }

    /// Whether the request has a body (a retry can be made only before it is taken).
    pub fn has_body(&self) -> bool {
        self.sending != Sending::None
    }
}

/// A request on its way up: its head as bytes, and what reading the answer needs of it.
struct Outgoing {
    head: Vec<u8>,
    /// A HEAD request: its answer has no body, whatever its fields say.
    is_head: bool,
    /// Whether the request may go again should its connection fail before any answer
    /// ([`Error::retryable`]).
    replayable: bool,
}
