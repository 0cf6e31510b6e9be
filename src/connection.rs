//! One client connection, from accept to close: which protocol it speaks, the clocks that
//! bound each of its silences, and the count that bounds how many there are. Both
//! listeners (the gateway's and the admin one) serve their connections through here.
//!
//! A perimeter must not be exhausted by clients that say nothing. Each way of saying
//! nothing has its clock (`[server]`, defaults in brackets; nginx's equivalents in
//! docs/operations.md):
//!
//! - `header_timeout` (default 10s): from accept to a complete request head — for HTTP/2, to the
//!   connection preface and the client's first SETTINGS frame; on the TLS listener the
//!   handshake counts in it ([`serve_tls`]). On a kept-alive HTTP/1
//!   connection it runs from the first byte of the next request. Past it the connection is
//!   closed, after a 408 where a head had started.
//! - `idle_timeout` (default 60s): a kept-alive HTTP/1 connection, or an HTTP/2 connection, with
//!   no request in flight (HTTP/2 gets a GOAWAY first).
//! - `body_timeout` (default 30s): the longest a response write may wait on a client that takes
//!   nothing (the connection is closed; the gap between reads of a request *body* is the
//!   upstream hop's, [`crate::upstream`], and answered 408).
//!
//! And their number: [`Registry`] holds every open connection of a listener. At
//! `max_connections` the accept loop stops taking connections from the listen backlog
//! (one accepted connection waits in the worker meanwhile), and the connections idle the
//! longest are closed to make room for it. An accept that fails (out of file descriptors)
//! makes room the same way and backs off; it is logged once a few seconds, with a count.
//!
//! A request head is bounded too (`max_header_bytes`, 431 beyond it: hyper for HTTP/1,
//! SETTINGS_MAX_HEADER_LIST_SIZE for HTTP/2; and an HTTP/1 head's fields by
//! `max_header_fields`, by default one per 32 bytes of that bound, [`default_max_fields`]),
//! and an HTTP/1 head with a bare CR is answered 400 at once: a CR not followed by LF is no line ending (RFC 9112 §2.2), and
//! the parser would otherwise wait for the LF that never comes.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use atomic_waker::AtomicWaker;
use bytes::{Buf, Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// How long a client connection may keep the gateway waiting, each a bound on one kind of
/// silence (nginx: `client_header_timeout`, `keepalive_timeout`, `client_body_timeout`,
/// `send_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From accept to a complete request head (an HTTP/2 preface and SETTINGS); on a
    /// kept-alive connection, from the next request's first byte to its complete head.
    pub header: Duration,
    /// A kept-alive or HTTP/2 connection with nothing in flight is closed after this.
    pub idle: Duration,
    /// The longest gap between two reads of a request body (408), and between two writes
    /// of a response the client does not take (the connection is closed).
    pub body: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            header: Duration::from_secs(10),
            idle: Duration::from_secs(60),
            body: Duration::from_secs(30),
        }
    }
}

/// HTTP/2's connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A SETTINGS frame larger than the default frame size is refused by the HTTP/2 side; the
/// preface reader hands it over without waiting for it.
const MAX_SETTINGS: usize = 16_384;
/// Connections closed at once to make room at `max_connections`, at most: one per 256 of
/// the bound (a search of the open connections finds a batch, as nginx drains up to 32).
const MAKE_ROOM_BATCH: usize = 16;
/// How long an accept loop backs off after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// At most one warning per this long for a full listener or failing accepts.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// After it is asked to close gracefully (HTTP/2 GOAWAY), a connection with nothing in
/// flight gets this long (for the GOAWAY to go out, and the client's PING answer).
const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// Concurrent HTTP/2 streams per connection (nginx's `http2_max_concurrent_streams`).
const MAX_STREAMS: u32 = 128;

/// Why the gateway closed a connection, as `ratewall_connections_closed_total` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Closed {
    HeaderTimeout = 1,
    IdleTimeout,
    BodyTimeout,
    SendTimeout,
    /// Idle, closed to make room at `max_connections` (or for lack of file descriptors).
    MakeRoom,
}

impl Closed {
    pub const ALL: [Closed; 5] = [
        Closed::HeaderTimeout,
        Closed::IdleTimeout,
        Closed::BodyTimeout,
        Closed::SendTimeout,
        Closed::MakeRoom,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Closed::HeaderTimeout => "header_timeout",
            Closed::IdleTimeout => "idle_timeout",
            Closed::BodyTimeout => "body_timeout",
            Closed::SendTimeout => "send_timeout",
            Closed::MakeRoom => "make_room",
        }
    }
}

/// The metrics of one listener's connections.
#[derive(Clone, Default)]
pub struct ConnectionMetrics {
    pub open: Gauge,
    /// One counter per [`Closed`] reason, in the order of [`Closed::ALL`].
    pub closed: [Counter; 5],
    pub accept_errors: Counter,
}

impl ConnectionMetrics {
    fn count(&self, why: Closed) {
        if let Some(c) = self.closed.get(why as usize - 1) {
            c.inc();
        }
    }
}

/// How a listener's connections are served: read from the live config at each accept,
/// so a reload changes them for new connections.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub timeouts: Timeouts,
    pub max_header_bytes: usize,
    /// HTTP/1: the most fields a head may have (`[server] max_header_fields`).
    pub max_header_fields: usize,
}

/// Descriptors kept for everything but client and upstream connections: listeners, Redis,
/// the event loops, log files.
pub const RESERVED_DESCRIPTORS: u64 = 64;

/// Raise the process's open-file limit to what it is allowed (the soft limit to the hard
/// one, as nginx's `worker_rlimit_nofile` and Go's runtime do), and warn when a
/// `max_connections` the operator set could still need more: each client connection can
/// hold one to its upstream too. (One left unset was derived to fit the hard limit, so
/// warns only where the raise fell short of it.)
pub fn raise_descriptor_limit(max_connections: usize, set: bool) {
    let limit = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => n,
        Err(e) => {
            tracing::debug!(error = %e, "cannot read or raise the open-file limit");
            return;
        }
    };
    let needed = (max_connections as u64)
        .saturating_mul(2)
        .saturating_add(RESERVED_DESCRIPTORS);
    if needed <= limit {
        tracing::debug!(
            max_connections,
            set,
            open_files_limit = limit,
            "max_connections fits the open-file limit"
        );
    } else if set {
        tracing::warn!(
            max_connections,
            open_files_limit = limit,
            "max_connections may need {needed} file descriptors (a client and an upstream connection each) but the process may open {limit}: raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower max_connections; past it, accepts fail and idle connections are closed to make room"
        );
    } else {
        // Derived from the hard limit, which the raise did not reach (macOS caps it).
        tracing::warn!(
            max_connections,
            open_files_limit = limit,
            "max_connections was derived from the hard open-file limit, but the process could raise its own only to {limit}: set max_connections to at most {} or raise the limit",
            limit.saturating_sub(RESERVED_DESCRIPTORS) / 2
        );
    }
}

// ---------------------------------------------------------------------------------------
// Every open connection of a listener.

/// One connection's state, shared by its I/O, its requests and the registry.
pub struct Track {
    id: u64,
    /// Requests whose answer is not yet over.
    in_flight: AtomicU32,
    /// Requests started on this connection (a request head seen before the last start
    /// belongs to an earlier request).
    started: AtomicU64,
    /// When the connection last had nothing in flight (ms on [`clock_ms`]).
    idle_since_ms: AtomicU64,
    /// Asked to close: 1 to make room (once idle), 2 to shut down (after what is in flight).
    close: AtomicU8,
    /// The reason the gateway closed it, once.
    closed_by: AtomicU8,
    /// Wakes the connection's task where it waits to read the next request: an idle
    /// connection asked to close sees it at once; a busy one when its task next runs (its
    /// answer's progress), which is soon enough for a shutdown that waits for it anyway.
    reader: AtomicWaker,
    /// HTTP/2: answers whose next bytes are the client's to take, and since when (ms on
    /// [`clock_ms`]), by answer number. A client that takes nothing (a flow-control
    /// window left at 0) blocks no socket write, so only this shows it.
    awaiting: Mutex<Vec<(u64, u64)>>,
    next_answer: AtomicU64,
}

const CLOSE_MAKE_ROOM: u8 = 1;
const CLOSE_SHUTDOWN: u8 = 2;

impl Track {
    fn new(id: u64) -> Track {
        Track {
            id,
            in_flight: AtomicU32::new(0),
            started: AtomicU64::new(0),
            idle_since_ms: AtomicU64::new(clock_ms()),
            close: AtomicU8::new(0),
            closed_by: AtomicU8::new(0),
            reader: AtomicWaker::new(),
            awaiting: Mutex::new(Vec::new()),
            next_answer: AtomicU64::new(0),
        }
    }

    fn awaiting(&self) -> std::sync::MutexGuard<'_, Vec<(u64, u64)>> {
        self.awaiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Answer `n`'s next bytes wait for the client (from now), or (`false`) do not.
    fn await_pull(&self, n: u64, waiting: bool) {
        let mut awaiting = self.awaiting();
        awaiting.retain(|(m, _)| *m != n);
        if waiting {
            awaiting.push((n, clock_ms()));
            drop(awaiting);
            // The connection's task arms its clock for it when it next waits to read.
            self.reader.wake();
        }
    }

    /// Since when the answer waiting longest for the client has waited, if one does.
    fn oldest_awaiting(&self) -> Option<u64> {
        self.awaiting().iter().map(|(_, since)| *since).min()
    }

    fn idle(&self) -> bool {
        self.in_flight.load(Relaxed) == 0
    }

    /// Remember why the gateway closed the connection (the first reason given).
    pub fn closed(&self, why: Closed) {
        let _ = self
            .closed_by
            .compare_exchange(0, why as u8, Relaxed, Relaxed);
    }

    fn ask_to_close(&self, how: u8) {
        self.close.fetch_max(how, Relaxed);
        self.reader.wake();
    }
}

/// The clock connections' idle times are kept on: its start.
fn clock_start() -> std::time::Instant {
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    *START.get_or_init(std::time::Instant::now)
}

/// Milliseconds since [`clock_start`].
fn clock_ms() -> u64 {
    clock_start().elapsed().as_millis() as u64
}

/// The moment `ms` milliseconds after [`clock_start`], for a timer.
fn clock_instant(ms: u64) -> Instant {
    Instant::from_std(clock_start()) + Duration::from_millis(ms)
}

/// A request in flight on a connection, from its head to the end of its answer (the
/// answer's body holds it: [`Tracked`]).
pub struct InFlight(Arc<Track>);

impl InFlight {
    pub fn new(track: &Arc<Track>) -> InFlight {
        track.started.fetch_add(1, Relaxed);
        track.in_flight.fetch_add(1, Relaxed);
        InFlight(track.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Relaxed) == 1 {
            self.0.idle_since_ms.store(clock_ms(), Relaxed);
            // A connection asked to make room closes once idle: wake its reader to see it.
            if self.0.close.load(Relaxed) != 0 {
                self.0.reader.wake();
            }
        }
    }
}

/// An answer's body, holding its request's [`InFlight`] until the body is done with. Over
/// HTTP/2 it also tells the connection while its next bytes wait for the client to take
/// them (see `Track::await_pull`).
pub struct Tracked<B> {
    body: B,
    request: InFlight,
    /// HTTP/2: this answer's number on its connection.
    pulled: Option<u64>,
}

impl<B> Tracked<B> {
    /// `http2`: the answer goes out on an HTTP/2 stream.
    pub fn new(body: B, request: InFlight, http2: bool) -> Tracked<B> {
        let pulled = http2.then(|| {
            let n = request.0.next_answer.fetch_add(1, Relaxed);
            request.0.await_pull(n, true);
            n
        });
        Tracked {
            body,
            request,
            pulled,
        }
    }
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Some(n) = self.pulled {
            // A frame handed on: the next one is the client's to take. Pending: it waits on
            // the upstream (whose clock is the upstream hop's); the end: nothing waits.
            let waiting = matches!(polled, Poll::Ready(Some(Ok(_)))) && !self.body.is_end_stream();
            self.request.0.await_pull(n, waiting);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B> Drop for Tracked<B> {
    fn drop(&mut self) {
        if let Some(n) = self.pulled {
            self.request.0.await_pull(n, false);
        }
    }
}

/// Every open connection of one listener, and the bound on their number.
pub struct Registry {
    listener: &'static str,
    max: usize,
    permits: Arc<Semaphore>,
    open: Mutex<HashMap<u64, Arc<Track>>>,
    next_id: AtomicU64,
    /// Set once shutdown began: new connections are asked to close at once.
    shutting_down: AtomicBool,
    drained: tokio::sync::Notify,
    metrics: ConnectionMetrics,
    /// When a full listener / a failing accept was last logged (ms on [`clock_ms`]), and
    /// how many happened since.
    full_warned: AtomicU64,
    full_since: AtomicU64,
    accept_warned: AtomicU64,
    accept_since: AtomicU64,
}

impl Registry {
    pub fn new(listener: &'static str, max: usize, metrics: ConnectionMetrics) -> Arc<Registry> {
        Arc::new(Registry {
            listener,
            max: max.max(1),
            permits: Arc::new(Semaphore::new(max.max(1))),
            open: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            drained: tokio::sync::Notify::new(),
            metrics,
            full_warned: AtomicU64::new(0),
            full_since: AtomicU64::new(0),
            accept_warned: AtomicU64::new(0),
            accept_since: AtomicU64::new(0),
        })
    }

    /// Open connections now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Track>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more connection: at once, or once enough idle connections were
    /// closed to make room (or others ended).
    pub async fn admit(&self) -> OwnedSemaphorePermit {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return permit;
        }
        self.full_since.fetch_add(1, Relaxed);
        if self.due(&self.full_warned) {
            tracing::warn!(
                listener = self.listener,
                max_connections = self.max,
                times = self.full_since.swap(0, Relaxed),
                "max_connections reached: closing the longest idle connections to make room; new connections wait in the listen backlog"
            );
        }
        let batch = (self.max / 256).clamp(1, MAKE_ROOM_BATCH);
        loop {
            self.make_room(batch);
            let acquire = self.permits.clone().acquire_owned();
            tokio::select! {
                permit = acquire => {
                    // The semaphore is never closed.
                    if let Ok(p) = permit {
                        return p;
                    }
                }
                () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
            }
        }
    }

    /// An accept failed (out of file descriptors, say): make room, and log it now and then.
    pub async fn accept_failed(&self, e: &io::Error) {
        self.metrics.accept_errors.inc();
        self.accept_since.fetch_add(1, Relaxed);
        if self.due(&self.accept_warned) {
            tracing::warn!(
                listener = self.listener,
                error = %e,
                times = self.accept_since.swap(0, Relaxed),
                "accept failed; closing idle connections and retrying"
            );
        }
        self.make_room((self.max / 256).clamp(1, MAKE_ROOM_BATCH));
        tokio::time::sleep(ACCEPT_BACKOFF).await;
    }

    /// Whether a warning last given at `last` may be given again now (and mark it given).
    fn due(&self, last: &AtomicU64) -> bool {
        let now = clock_ms().max(1);
        let then = last.load(Relaxed);
        (then == 0 || now >= then + WARN_EVERY.as_millis() as u64)
            && last.compare_exchange(then, now, Relaxed, Relaxed).is_ok()
    }

    /// Have up to `n` connections on their way out to make room: ask that many of those
    /// idle the longest to close, less idle ones asked before that have not closed yet (on a
    /// loaded machine a closing connection can outlast the accept loop's backoff, and
    /// asking again would close one more than the new client needs).
    pub fn make_room(&self, n: usize) {
        let open = self.lock();
        let closing = open
            .values()
            .filter(|t| t.close.load(Relaxed) == CLOSE_MAKE_ROOM && t.idle())
            .count();
        let n = n.saturating_sub(closing);
        if n == 0 {
            return;
        }
        let mut idle: Vec<(u64, &Arc<Track>)> = open
            .values()
            .filter(|t| t.idle() && t.close.load(Relaxed) == 0)
            .map(|t| (t.idle_since_ms.load(Relaxed), t))
            .collect();
        if idle.len() > n {
            idle.select_nth_unstable_by_key(n, |(since, _)| *since);
            idle.truncate(n);
        }
        for (_, t) in idle {
            t.closed(Closed::MakeRoom);
            t.ask_to_close(CLOSE_MAKE_ROOM);
        }
    }

    /// Ask every connection to close: idle ones at once, busy ones after the requests in
    /// flight (HTTP/2: GOAWAY).
    pub fn shut_down(&self) {
        self.shutting_down.store(true, Relaxed);
        for t in self.lock().values() {
            t.ask_to_close(CLOSE_SHUTDOWN);
        }
    }

    /// Until every connection has closed.
    pub async fn drained(&self) {
        loop {
            let notified = self.drained.notified();
            if self.is_empty() {
                return;
            }
            notified.await;
        }
    }

    fn register(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Registered {
        let track = Arc::new(Track::new(self.next_id.fetch_add(1, Relaxed)));
        self.lock().insert(track.id, track.clone());
        if self.shutting_down.load(Relaxed) {
            track.ask_to_close(CLOSE_SHUTDOWN);
        }
        self.metrics.open.inc();
        Registered {
            registry: self.clone(),
            track,
            _permit: permit,
        }
    }
}

/// A connection's place in its registry, given back when the connection ends.
struct Registered {
    registry: Arc<Registry>,
    track: Arc<Track>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let r = &self.registry;
        let empty = {
            let mut open = r.lock();
            open.remove(&self.track.id);
            open.is_empty()
        };
        r.metrics.open.dec();
        if let Some(why) = Closed::ALL
            .iter()
            .find(|c| **c as u8 == self.track.closed_by.load(Relaxed))
        {
            r.metrics.count(*why);
        }
        if empty {
            r.drained.notify_waiters();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Serving one connection.

/// What a connection's requests go to: hyper's service, answering every request (never an
/// error) with an [`Answer`], run on the connection's task.
pub trait Service<B>:
    hyper::service::Service<
        http::Request<hyper::body::Incoming>,
        Response = http::Response<B>,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + Send
    + 'static
{
}

impl<S, B> Service<B> for S where
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<B>,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + Send
        + 'static
{
}

/// The body of an answer a connection writes.
pub trait Answer:
    Body<Data: Send, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + 'static
{
}

impl<B> Answer for B where
    B: Body<Data: Send, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + 'static
{
}

/// Serve one accepted connection until it ends. `service` makes the connection's
/// service from its [`Track`] (its requests hold an [`InFlight`] each).
pub async fn serve<S, B>(
    stream: TcpStream,
    registry: &Arc<Registry>,
    permit: OwnedSemaphorePermit,
    settings: Settings,
    service: impl FnOnce(Arc<Track>) -> S,
) where
    S: Service<B>,
    B: Answer,
{
    let registered = registry.register(permit);
    let track = registered.track.clone();
    let accepted = Instant::now();
    let _ = stream.set_nodelay(true);
    serve_io(stream, registered, accepted, settings, service(track)).await;
}

/// How a TLS handshake ended, for the metrics: done, or why not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handshake {
    Ok,
    /// Not done within `header_timeout`.
    Timeout,
    /// The client closed or the connection failed before it was done.
    Closed,
    /// Refused by TLS, for this reason.
    Failed(Refused),
    /// Asked to close (to make room, or shutting down) before it was done.
    Asked,
}

/// Why TLS refused a handshake on the listener, read from the `rustls::Error` inside the
/// handshake's `io::Error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Nothing in common with the client (version, cipher suite, ALPN protocol...), or a
    /// client that broke the protocol.
    Protocol,
    /// Under mTLS, no client certificate, or one that does not verify.
    ClientCertificate,
    /// Bytes that are not TLS (plain HTTP on the TLS port, say), or a message out of
    /// place.
    NotTls,
    /// The client ended the handshake with an alert (it refused our certificate, say).
    Alert,
    Other,
}

impl Refused {
    pub const ALL: [Refused; 5] = [
        Refused::Protocol,
        Refused::ClientCertificate,
        Refused::NotTls,
        Refused::Alert,
        Refused::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Refused::Protocol => "protocol",
            Refused::ClientCertificate => "client_certificate",
            Refused::NotTls => "not_tls",
            Refused::Alert => "alert",
            Refused::Other => "other",
        }
    }

    /// Why rustls refused the handshake. The listener verifies client certificates
    /// only, so a certificate error is always the client's.
    pub fn of(e: &rustls::Error) -> Refused {
        use rustls::Error as E;
        match e {
            E::PeerIncompatible(_) | E::PeerMisbehaved(_) | E::NoApplicationProtocol => {
                Refused::Protocol
            }
            E::NoCertificatesPresented
            | E::InvalidCertificate(_)
            | E::InvalidCertRevocationList(_) => Refused::ClientCertificate,
            E::InvalidMessage(_)
            | E::InappropriateMessage { .. }
            | E::InappropriateHandshakeMessage { .. } => Refused::NotTls,
            E::AlertReceived(_) => Refused::Alert,
            _ => Refused::Other,
        }
    }
}

impl Handshake {
    /// Every result and reason the metrics have a series for.
    pub const ALL: [Handshake; 9] = [
        Handshake::Ok,
        Handshake::Timeout,
        Handshake::Closed,
        Handshake::Failed(Refused::Protocol),
        Handshake::Failed(Refused::ClientCertificate),
        Handshake::Failed(Refused::NotTls),
        Handshake::Failed(Refused::Alert),
        Handshake::Failed(Refused::Other),
        Handshake::Asked,
    ];

    /// How a handshake that returned `e` ended: refused by TLS (the `rustls::Error` it
    /// carries says why), or closed under it.
    fn failed(e: &io::Error) -> Handshake {
        let tls = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        match (tls, e.kind()) {
            (Some(tls), _) => Handshake::Failed(Refused::of(tls)),
            (None, io::ErrorKind::InvalidData) => Handshake::Failed(Refused::Other),
            (None, _) => Handshake::Closed,
        }
    }

    /// The `result` label.
    pub fn name(self) -> &'static str {
        match self {
            Handshake::Ok => "ok",
            Handshake::Timeout => "timeout",
            Handshake::Closed => "closed",
            Handshake::Failed(_) => "failed",
            Handshake::Asked => "shutdown",
        }
    }

    /// The `reason` label: why a failed one failed, `none` for the others.
    pub fn reason(self) -> &'static str {
        match self {
            Handshake::Failed(why) => why.name(),
            _ => "none",
        }
    }
}

/// Serve one connection accepted on the TLS listener: the handshake (within
/// `header_timeout`, counted from accept, and ended early when the connection is asked to
/// close), then the connection as [`serve`] would, over TLS. `handshake` hears how the
/// handshake ended; `service` makes the connection's service from its [`Track`] and what
/// the handshake agreed.
pub async fn serve_tls<S, B>(
    stream: TcpStream,
    config: Arc<rustls::ServerConfig>,
    registry: &Arc<Registry>,
    permit: OwnedSemaphorePermit,
    settings: Settings,
    handshake: impl FnOnce(Handshake, Option<&crate::tls::Session>),
    service: impl FnOnce(Arc<Track>, crate::tls::Session) -> S,
) where
    S: Service<B>,
    B: Answer,
{
    let registered = registry.register(permit);
    let track = registered.track.clone();
    let accepted = Instant::now();
    let _ = stream.set_nodelay(true);
    let deadline = accepted + settings.timeouts.header;
    let accept = tokio::time::timeout_at(deadline, async move {
        if sends_plain_http(&stream).await {
            return Ok(Start::PlainHttp(stream));
        }
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        acceptor.accept(stream).await.map(Start::Tls)
    });
    let asked_to_close = std::future::poll_fn(|cx| {
        track.reader.register(cx.waker());
        if track.close.load(Relaxed) != 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    });
    let stream = tokio::select! {
        done = accept => match done {
            Ok(Ok(Start::Tls(stream))) => stream,
            Ok(Ok(Start::PlainHttp(stream))) => {
                handshake(Handshake::Failed(Refused::NotTls), None);
                answer_plain_http(stream, deadline).await;
                return;
            }
            Ok(Err(e)) => {
                let why = Handshake::failed(&e);
                tracing::debug!(error = %e, "TLS handshake failed");
                handshake(why, None);
                return;
            }
            Err(_) => {
                track.closed(Closed::HeaderTimeout);
                handshake(Handshake::Timeout, None);
                return;
            }
        },
        () = asked_to_close => {
            handshake(Handshake::Asked, None);
            return;
        }
    };
    let session = crate::tls::Session::of(stream.get_ref().1);
    handshake(Handshake::Ok, Some(&session));
    serve_io(
        stream,
        registered,
        accepted,
        settings,
        service(track, session),
    )
    .await;
}

/// How a connection to the TLS listener starts: a TLS handshake done, or plain HTTP.
/// Held only between the handshake and the connection's service, which keeps the TLS
/// stream as large anyway: boxing it would add an allocation per connection for nothing.
#[allow(clippy::large_enum_variant)]
enum Start {
    Tls(tokio_rustls::server::TlsStream<TcpStream>),
    PlainHttp(TcpStream),
}

/// Whether the connection's first byte starts an HTTP/1 request (a method's capital
/// letter) rather than a TLS record (0x16, a handshake): `curl http://` to the TLS port.
/// Waits for that byte; a connection that fails or ends first is left to the handshake.
async fn sends_plain_http(stream: &TcpStream) -> bool {
    let mut first = [0u8; 1];
    matches!(stream.peek(&mut first).await, Ok(1) if first[0].is_ascii_uppercase())
}

/// What the TLS listener answers plain HTTP, as nginx and Go's servers answer it: a 400
/// that says why, then close. No request is read beyond what has arrived (taken off the
/// socket so that closing does not reset the answer away), none is served.
const PLAIN_HTTP_ANSWER: &[u8] = b"HTTP/1.1 400 Bad Request\r\n\
content-type: application/problem+json\r\n\
content-length: 116\r\n\
connection: close\r\n\r\n\
{\"type\":\"about:blank\",\"title\":\"Bad Request\",\"status\":400,\"detail\":\"this port speaks TLS: send the request as https\"}";

async fn answer_plain_http(mut stream: TcpStream, deadline: Instant) {
    use tokio::io::AsyncWriteExt;
    let mut scrap = [0u8; 4096];
    for _ in 0..16 {
        match stream.try_read(&mut scrap) {
            Ok(n) if n > 0 => continue,
            _ => break,
        }
    }
    let _ = tokio::time::timeout_at(deadline, async {
        stream.write_all(PLAIN_HTTP_ANSWER).await?;
        stream.shutdown().await
    })
    .await;
}

/// Serve a connection's stream (TCP, or TLS over it) from its first bytes: which protocol,
/// then HTTP/1 or HTTP/2 under the clocks. `accepted`: when the header clock started.
async fn serve_io<IO, S, B>(
    mut stream: IO,
    registered: Registered,
    accepted: Instant,
    settings: Settings,
    service: S,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Service<B>,
    B: Answer,
{
    let track = registered.track.clone();
    let Some((proto, prefix)) =
        opening(&mut stream, &track, accepted + settings.timeouts.header).await
    else {
        return;
    };
    let io = Guarded {
        prefix: prefix.freeze(),
        io: stream,
        track: track.clone(),
        settings,
        h2: proto == Proto::H2,
        head: (proto == Proto::H1).then_some(Head {
            since: Some(accepted),
            request: 0,
        }),
        scan: Scan::Line,
        read_timer: None,
        write_stalled: None,
        write_timer: None,
        goaway_at: None,
    };
    let io = TokioIo::new(io);
    match proto {
        Proto::H1 => {
            // The head's clocks are this module's: hyper's runs from the end of the previous
            // answer and sends no 408.
            let conn = hyper::server::conn::http1::Builder::new()
                .max_header_size(settings.max_header_bytes)
                .max_headers(settings.max_header_fields)
                .timer(TokioTimer::new())
                .header_read_timeout(None)
                .serve_connection(io, service);
            drive(conn, &track, |c| c.graceful_shutdown()).await;
        }
        Proto::H2 => {
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .max_concurrent_streams(MAX_STREAMS)
                .max_header_list_size(u32::try_from(settings.max_header_bytes).unwrap_or(u32::MAX))
                .timer(TokioTimer::new())
                .serve_connection(io, service);
            drive(conn, &track, |c| c.graceful_shutdown()).await;
        }
    }
    drop(registered);
}

/// How many fields an HTTP/1 request head may have unless `[server] max_header_fields`
/// says: one per [`BYTES_PER_FIELD`] of `max_header_bytes` (1,024 at the default 32 KiB),
/// and never fewer than hyper's own 100. Past it, 431, as past `max_header_bytes`. Not one
/// per byte the bound allows by default: hyper parses into an array of this many entries
/// (64 bytes each), allocated for every parse of a head, so the count is bounded by the
/// size it is taken from; an operator whose clients send many tiny fields raises it.
pub fn default_max_fields(max_header_bytes: usize) -> usize {
    (max_header_bytes / BYTES_PER_FIELD).max(100)
}

/// The request head bytes that allow one more field ([`default_max_fields`]).
const BYTES_PER_FIELD: usize = 32;

/// Which protocol the client speaks, and the bytes read to tell: the HTTP/2 preface, or
/// the start of an HTTP/1 head, by `header_deadline`. `None`: the connection is over (the
/// client closed or stayed silent, or it was asked to close before saying anything whole).
async fn opening<IO: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut IO,
    track: &Track,
    header_deadline: Instant,
) -> Option<(Proto, BytesMut)> {
    let mut prefix = BytesMut::with_capacity(1024);
    let read = tokio::time::timeout_at(header_deadline, preface(stream, &mut prefix));
    let asked_to_close = std::future::poll_fn(|cx| {
        track.reader.register(cx.waker());
        if track.close.load(Relaxed) != 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    });
    tokio::select! {
        read = read => match read {
            Ok(Ok(Some(proto))) => Some((proto, prefix)),
            // The client closed, or the read failed: nothing to answer.
            Ok(Ok(None) | Err(_)) => None,
            Err(_) => {
                track.closed(Closed::HeaderTimeout);
                // Some of a head, but not the whole HTTP/2 preface: an HTTP/1 head started.
                if !prefix.is_empty() && prefix.len() < PREFACE.len() {
                    try_write(stream, &canned(408));
                }
                None
            }
        },
        // To make room, or shutting down: a connection that has said nothing whole yet.
        () = asked_to_close => None,
    }
}

/// Poll a connection to its end, shutting it down gracefully when asked to close.
async fn drive<C, E>(conn: C, track: &Track, shut: impl Fn(Pin<&mut C>))
where
    C: std::future::Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    tokio::pin!(conn);
    let mut shutting = false;
    let mut grace: Option<Pin<Box<Sleep>>> = None;
    let result = std::future::poll_fn(|cx| {
        if !shutting && track.close.load(Relaxed) != 0 {
            shutting = true;
            shut(conn.as_mut());
            grace = Some(Box::pin(tokio::time::sleep(CLOSE_GRACE)));
        }
        if let Poll::Ready(r) = conn.as_mut().poll(cx) {
            return Poll::Ready(r.map_err(|e| e.to_string()));
        }
        // Asked to close and not done within the grace (a request still in flight at
        // shutdown is the server's grace to bound, not this one's: only idle ones).
        match grace.as_mut() {
            Some(g) if track.idle() => match g.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Ok(())),
                Poll::Pending => Poll::Pending,
            },
            _ => Poll::Pending,
        }
    })
    .await;
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proto {
    H1,
    H2,
}

/// Read until the protocol is known: HTTP/2 once the preface and the client's first
/// SETTINGS frame are in, HTTP/1 at the first byte that is not the preface's. `None`: the
/// client closed first. Read through [`read_flushing`]: a TLS client may ask to
/// renegotiate before it says anything.
async fn preface<IO: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut IO,
    buf: &mut BytesMut,
) -> io::Result<Option<Proto>> {
    loop {
        let n = buf.len().min(PREFACE.len());
        if buf[..n] != PREFACE[..n] {
            return Ok(Some(Proto::H1));
        }
        if buf.len() >= PREFACE.len() + 9 {
            let f = &buf[PREFACE.len()..];
            let length = (usize::from(f[0]) << 16) | (usize::from(f[1]) << 8) | usize::from(f[2]);
            // Not SETTINGS, or too large to wait for: HTTP/2 will refuse it.
            if f[3] != 0x4 || length > MAX_SETTINGS || f.len() >= 9 + length {
                return Ok(Some(Proto::H2));
            }
        }
        let mut chunk = [0u8; 2048];
        let n = std::future::poll_fn(|cx| {
            let mut read = ReadBuf::new(&mut chunk);
            match read_flushing(&mut *stream, cx, &mut read) {
                Poll::Ready(Ok(())) => Poll::Ready(Ok(read.filled().len())),
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            }
        })
        .await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A read of `io` that, when nothing has come, sends what the protocol below queued to
/// send while reading: over TLS 1.2, the `no_renegotiation` alert rustls answers a
/// renegotiation ClientHello with. tokio-rustls writes it only with the next write, and
/// nothing else is written while the client waits for its new handshake: without this it
/// would hang until a clock ran out. (A no-op on TCP.)
fn read_flushing<IO: AsyncRead + AsyncWrite + Unpin>(
    io: &mut IO,
    cx: &mut Context<'_>,
    buf: &mut ReadBuf<'_>,
) -> Poll<io::Result<()>> {
    let polled = Pin::new(&mut *io).poll_read(cx, buf);
    if polled.is_pending() {
        let _ = Pin::new(io).poll_flush(cx);
    }
    polled
}

/// Write `bytes` if the stream takes them now, without waiting: a best effort, for the
/// last words of a connection about to be closed (over TLS, rustls takes them whole into
/// its buffer and sends what the socket takes).
fn try_write<IO: AsyncWrite + Unpin>(stream: &mut IO, bytes: &[u8]) {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut written = 0;
    while written < bytes.len() {
        match Pin::new(&mut *stream).poll_write(&mut cx, &bytes[written..]) {
            Poll::Ready(Ok(n)) if n > 0 => written += n,
            _ => break,
        }
    }
    let _ = Pin::new(stream).poll_flush(&mut cx);
}

/// A response the gateway writes straight to the socket, where no HTTP layer is left to
/// (a head that never completed, or that cannot be parsed).
fn canned(status: u16) -> Vec<u8> {
    let (reason, detail) = match status {
        408 => (
            "Request Timeout",
            "the request head did not arrive within header_timeout",
        ),
        _ => (
            "Bad Request",
            "a bare CR in the request head: lines end with CRLF",
        ),
    };
    let body = format!(
        "{{\"type\":\"about:blank\",\"title\":\"{reason}\",\"status\":{status},\"detail\":\"{detail}\"}}"
    );
    format!(
        "HTTP/1.1 {status} {reason}\r\nconnection: close\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The head of the request being read: since when, and for which request.
#[derive(Debug, Clone, Copy)]
struct Head {
    /// Since when (`None`: its first byte came in the last read, and the head may well be
    /// whole already; the clock is read only if it waits for more).
    since: Option<Instant>,
    /// [`Track::started`] when its first byte came: a later start means it was read.
    request: u64,
}

/// The client's stream, with the clocks of [the module](self) on its reads and writes.
/// Bytes read before the protocol was known come first.
struct Guarded<IO> {
    prefix: Bytes,
    io: IO,
    track: Arc<Track>,
    settings: Settings,
    h2: bool,
    /// HTTP/1: the head being read, if its first byte came.
    head: Option<Head>,
    /// HTTP/1: how far the head being read has been scanned.
    scan: Scan,
    read_timer: Option<(Instant, Pin<Box<Sleep>>)>,
    /// Since when writes have made no progress, and the timer on it.
    write_stalled: Option<Instant>,
    write_timer: Option<(Instant, Pin<Box<Sleep>>)>,
    /// HTTP/2: when the idle connection was asked to go away.
    goaway_at: Option<Instant>,
}

/// Whether `deadline` has passed, with a timer to wake the task at it. The timer is moved
/// only to an earlier time: a deadline that moves later (every request moves the idle one)
/// lets the armed timer fire early, and it is re-armed then — not reset per request.
pub(crate) fn expired(
    timer: &mut Option<(Instant, Pin<Box<Sleep>>)>,
    deadline: Instant,
    cx: &mut Context<'_>,
) -> bool {
    let (at, sleep) =
        timer.get_or_insert_with(|| (deadline, Box::pin(tokio::time::sleep_until(deadline))));
    if deadline < *at {
        *at = deadline;
        sleep.as_mut().reset(deadline);
    }
    if sleep.as_mut().poll(cx).is_pending() {
        return false;
    }
    if *at >= deadline {
        return true;
    }
    // It fired for an earlier deadline: wait for this one.
    *at = deadline;
    sleep.as_mut().reset(deadline);
    sleep.as_mut().poll(cx).is_ready()
}

impl<IO: AsyncRead + AsyncWrite + Unpin> Guarded<IO> {
    /// Nothing to read while a request is in flight: watch what the client owes it (over
    /// HTTP/2, taking the answer), and keep the idle clock armed for when it is done.
    fn pending_busy(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Once the answer is done, hyper may not read again until the client writes: this
        // is then the connection's last word on what wakes it, so a request to close (to
        // make room, or shutting down) must find this task.
        self.track.reader.register(cx.waker());
        // HTTP/2: an answer the client has taken nothing of for body_timeout
        // ends the connection (HTTP/1's blocks a write: `written`).
        let since = match self.h2 {
            true => self.track.oldest_awaiting(),
            false => None,
        };
        if let Some(since) = since {
            let deadline = clock_instant(since) + self.settings.timeouts.body;
            if expired(&mut self.read_timer, deadline, cx) {
                self.track.closed(Closed::SendTimeout);
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client took nothing of an answer for body_timeout",
                )));
            }
        } else {
            // The idle clock, armed ahead: once the answer is done, hyper does
            // not read again until the client writes, so this timer (due no
            // later than the idle deadline to come) is what wakes the
            // connection to start it. Re-armed only when it fires.
            let idle = self.settings.timeouts.idle;
            match &self.read_timer {
                None => {
                    let since = self.track.idle_since_ms.load(Relaxed);
                    let _ = expired(&mut self.read_timer, clock_instant(since) + idle, cx);
                }
                // It came while the answer was still going (a long request): a
                // full idle period from now, so that one is still armed.
                Some((_, sleep)) if sleep.is_elapsed() => {
                    let _ = expired(&mut self.read_timer, Instant::now() + idle, cx);
                }
                // Armed, for this task: nothing to do per request.
                Some(_) => {}
            }
        }
        Poll::Pending
    }

    /// Nothing to read and nothing in flight: the connection's clocks (header, idle, a
    /// close request's grace) run.
    fn pending_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.track.reader.register(cx.waker());
        if self.h2 {
            if let Some(at) = self.goaway_at {
                if expired(&mut self.read_timer, at + CLOSE_GRACE, cx) {
                    return Poll::Ready(Ok(()));
                }
                return Poll::Pending;
            }
        }
        let (deadline, why) = self.deadline();
        if !expired(&mut self.read_timer, deadline, cx) {
            return Poll::Pending;
        }
        match (why, self.current_head(), self.h2) {
            (Closed::HeaderTimeout, Some(_), false) => self.refuse(408, Some(why)),
            (_, _, true) => {
                // GOAWAY first: the connection's task sees the close request.
                self.track.closed(why);
                self.goaway_at = Some(Instant::now());
                self.track.close.fetch_max(CLOSE_MAKE_ROOM, Relaxed);
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            _ => {
                self.track.closed(why);
                Poll::Ready(Ok(()))
            }
        }
    }

    /// The head being read now (HTTP/1), if its first byte came since the last request.
    fn current_head(&self) -> Option<Head> {
        self.head
            .filter(|h| h.request == self.track.started.load(Relaxed))
    }

    /// When the silence the connection is in now ends it, and why. Only while nothing is
    /// in flight: then the client owes the next request.
    fn deadline(&mut self) -> (Instant, Closed) {
        let request = self.track.started.load(Relaxed);
        match self.head.as_mut().filter(|h| h.request == request) {
            Some(h) => (
                *h.since.get_or_insert_with(Instant::now) + self.settings.timeouts.header,
                Closed::HeaderTimeout,
            ),
            None => {
                let since = clock_instant(self.track.idle_since_ms.load(Relaxed));
                (since + self.settings.timeouts.idle, Closed::IdleTimeout)
            }
        }
    }

    /// Answer `status` and end the connection (a best-effort write: a few hundred bytes
    /// into an idle socket's buffer). `why`: the clock that ran out, if one did.
    fn refuse(&mut self, status: u16, why: Option<Closed>) -> Poll<io::Result<()>> {
        if let Some(why) = why {
            self.track.closed(why);
        }
        try_write(&mut self.io, &canned(status));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("request head refused with {status}"),
        )))
    }
}

/// Where a scan of a request head is (HTTP/1 line endings are CRLF, or a lone LF, which
/// parsers accept; a CR is always followed by LF).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scan {
    /// Inside a line.
    Line,
    /// After a CR inside a line.
    Cr,
    /// At the start of a line.
    LineStart,
    /// After a CR at the start of a line.
    LineStartCr,
    /// Past the empty line that ends the head: what follows is a body.
    Done,
}

impl Scan {
    /// The state after `b`; `None` at a bare CR.
    fn next(self, b: u8) -> Option<Scan> {
        Some(match (self, b) {
            (Scan::Done, _) => Scan::Done,
            (Scan::Cr, b'\n') => Scan::LineStart,
            (Scan::LineStartCr, b'\n') | (Scan::LineStart, b'\n') => Scan::Done,
            (Scan::Cr | Scan::LineStartCr, _) => return None,
            (Scan::LineStart, b'\r') => Scan::LineStartCr,
            (_, b'\r') => Scan::Cr,
            (_, b'\n') => Scan::LineStart,
            _ => Scan::Line,
        })
    }
}

/// HTTP/1 head bytes just read (`track`'s connection, nothing in flight): note when the
/// head started, and find a bare CR before the head's end. `Err`: a CR followed by
/// anything but LF.
fn head_bytes(
    head: &mut Option<Head>,
    scan: &mut Scan,
    track: &Track,
    bytes: &[u8],
) -> Result<(), ()> {
    let request = track.started.load(Relaxed);
    if head.is_none_or(|h| h.request != request) {
        *head = Some(Head {
            since: None,
            request,
        });
        *scan = Scan::Line;
    }
    scan_head(scan, bytes)
}

/// Run `scan` over `bytes` up to the head's end: [`Scan::next`] byte by byte, but jumping
/// from one line ending to the next (only they, and the byte after a CR, change it).
fn scan_head(scan: &mut Scan, bytes: &[u8]) -> Result<(), ()> {
    let mut at = 0;
    while *scan != Scan::Done && at < bytes.len() {
        if matches!(*scan, Scan::Cr | Scan::LineStartCr) {
            *scan = scan.next(bytes[at]).ok_or(())?;
            at += 1;
            continue;
        }
        let Some(i) = memchr::memchr2(b'\r', b'\n', &bytes[at..]) else {
            if *scan == Scan::LineStart {
                *scan = Scan::Line;
            }
            break;
        };
        if i > 0 && *scan == Scan::LineStart {
            *scan = Scan::Line;
        }
        *scan = scan.next(bytes[at + i]).ok_or(())?;
        at += i + 1;
    }
    Ok(())
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for Guarded<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let idle = this.track.idle();
        if idle && !this.h2 && this.track.close.load(Relaxed) != 0 {
            // Asked to close, with nothing in flight (between requests, or part way through
            // a head): the end of the stream. (HTTP/2 is shut down with a GOAWAY by the
            // connection's task.)
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = if this.prefix.is_empty() {
            read_flushing(&mut this.io, cx, buf)
        } else {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            Poll::Ready(Ok(()))
        };
        match polled {
            Poll::Ready(Ok(())) => {
                let got = &buf.filled()[before..];
                if idle && !this.h2 && !got.is_empty() {
                    let bare_cr = head_bytes(&mut this.head, &mut this.scan, &this.track, got);
                    if bare_cr.is_err() {
                        return this.refuse(400, None);
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if idle => this.pending_idle(cx),
            Poll::Pending => this.pending_busy(cx),
            other => other,
        }
    }
}

impl<IO> Guarded<IO> {
    /// A write's outcome, through the send clock: a client that takes nothing for
    /// `body_timeout` is cut off.
    fn written<T>(
        &mut self,
        polled: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.write_stalled = None;
            return polled;
        }
        let since = *self.write_stalled.get_or_insert_with(Instant::now);
        if expired(
            &mut self.write_timer,
            since + self.settings.timeouts.body,
            cx,
        ) {
            self.track.closed(Closed::SendTimeout);
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took nothing of the response for body_timeout",
            )));
        }
        Poll::Pending
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Guarded<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.written(polled, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.written(polled, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.written(polled, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_handshake_is_counted_by_what_rustls_said() {
        use rustls::{AlertDescription, CertificateError, Error as E, InvalidMessage};
        let refused = |e: rustls::Error| io::Error::new(io::ErrorKind::InvalidData, e);
        let cases = [
            (
                refused(E::InvalidMessage(InvalidMessage::InvalidContentType)),
                "failed",
                "not_tls",
            ),
            (
                refused(E::NoCertificatesPresented),
                "failed",
                "client_certificate",
            ),
            (
                refused(E::InvalidCertificate(CertificateError::UnknownIssuer)),
                "failed",
                "client_certificate",
            ),
            (
                refused(E::AlertReceived(AlertDescription::UnknownCA)),
                "failed",
                "alert",
            ),
            (refused(E::NoApplicationProtocol), "failed", "protocol"),
            (refused(E::DecryptError), "failed", "other"),
            (
                io::Error::new(io::ErrorKind::InvalidData, "not from rustls"),
                "failed",
                "other",
            ),
            (
                io::Error::from(io::ErrorKind::UnexpectedEof),
                "closed",
                "none",
            ),
        ];
        for (e, result, reason) in cases {
            let h = Handshake::failed(&e);
            assert_eq!((h.name(), h.reason()), (result, reason), "{e:?}");
        }
    }

    /// Asked twice for room before the first connection asked has closed (the accept
    /// loop's backoff on a loaded machine), the registry still closes only one: the one
    /// idle the longest. Once that one has closed, the next ask picks the next.
    #[tokio::test]
    async fn make_room_asks_again_only_once_the_one_asked_has_closed() {
        let registry = Registry::new(
            "test",
            3,
            crate::gateway::Metrics::new().connections("test"),
        );
        let mut held = Vec::new();
        for idle_since in [30, 10, 20] {
            let permit = registry.permits.clone().try_acquire_owned().expect("room");
            let r = registry.register(permit);
            r.track.idle_since_ms.store(idle_since, Relaxed);
            held.push(r);
        }
        let asked = |held: &[Registered]| -> Vec<u64> {
            held.iter()
                .filter(|r| r.track.close.load(Relaxed) == CLOSE_MAKE_ROOM)
                .map(|r| r.track.idle_since_ms.load(Relaxed))
                .collect()
        };
        registry.make_room(1);
        registry.make_room(1);
        assert_eq!(asked(&held), [10], "the longest idle, and only it");
        held.remove(1); // it closes
        registry.make_room(1);
        assert_eq!(asked(&held), [20]);
    }

    fn scan(bytes: &[u8]) -> Option<Scan> {
        bytes.iter().try_fold(Scan::Line, |s, &b| s.next(b))
    }

    #[test]
    fn a_head_scan_finds_bare_crs_and_stops_at_the_head_end() {
        assert_eq!(scan(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"), Some(Scan::Done));
        assert_eq!(scan(b"GET / HTTP/1.1\nHost: a\n\n"), Some(Scan::Done));
        assert_eq!(scan(b"GET / HTTP/1.1\r\nHost: a\r\n\n"), Some(Scan::Done));
        assert_eq!(
            scan(b"GET / HTTP/1.1\r\nHost: a\r\n"),
            Some(Scan::LineStart)
        );
        assert_eq!(
            scan(b"GET / HTTP/1.1\r"),
            Some(Scan::Cr),
            "a CR may end a read"
        );
        for bare in [
            &b"GET / HTTP/1.1\rHost: a\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: a\r\r",
            b"GET / HTTP/1.1\r\nHost: a\rb\r\n\r\n",
            b"GET / HTTP/1.1\r\n\rX",
        ] {
            assert_eq!(scan(bare), None, "{:?}", String::from_utf8_lossy(bare));
        }
        // After the head, a body's bytes are not looked at.
        assert_eq!(
            scan(b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\n\r\rx"),
            Some(Scan::Done)
        );
    }

    /// The jumping scan agrees with the byte-by-byte one on any bytes, however they are
    /// split across reads.
    #[test]
    fn the_fast_head_scan_is_the_byte_scan() {
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for _ in 0..20_000 {
            let len = (next() % 40) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| [b'a', b'b', b'\r', b'\n', b':'][(next() % 5) as usize])
                .collect();
            let slow = scan(&bytes);
            let mut fast = Scan::Line;
            let mut result = Ok(());
            let mut rest = &bytes[..];
            while !rest.is_empty() && result.is_ok() {
                let take = 1 + (next() as usize % rest.len());
                result = scan_head(&mut fast, &rest[..take]);
                rest = &rest[take..];
            }
            match slow {
                None => assert!(result.is_err(), "{bytes:?}"),
                Some(state) => assert_eq!((result, fast), (Ok(()), state), "{bytes:?}"),
            }
        }
    }

    #[test]
    fn canned_answers_are_whole_http_responses() {
        for status in [400u16, 408] {
            let bytes = canned(status);
            let mut fields = [httparse::EMPTY_HEADER; 8];
            let mut resp = httparse::Response::new(&mut fields);
            let n = match resp.parse(&bytes) {
                Ok(httparse::Status::Complete(n)) => n,
                other => panic!("{status}: {other:?}"),
            };
            assert_eq!(resp.code, Some(status));
            let length: usize = resp
                .headers
                .iter()
                .find(|h| h.name == "content-length")
                .and_then(|h| std::str::from_utf8(h.value).ok()?.parse().ok())
                .expect("a content-length");
            assert_eq!(bytes.len() - n, length);
            let body: serde_json::Value = serde_json::from_slice(&bytes[n..]).expect("json");
            assert_eq!(body["status"], status);
        }
    }
}
