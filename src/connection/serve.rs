//! Serving one accepted connection: its protocol told, then HTTP/1 or HTTP/2 under the
//! clocks, shut down gracefully when it is asked to close.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use hyper::body::Body;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};

use super::clocks::Guarded;
use super::head::{Head, Scan};
use super::protocol::{opening, Proto};
use super::registry::{Registered, Registry};
use super::track::Track;
use super::Settings;

/// What a connection's requests go to: hyper's service, answering every request (never an
/// error) with an [`ServedBody`], run on the connection's task.
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

/// The body of a response a connection serves (of an answer it writes).
pub trait ServedBody:
    Body<Data: Send, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + 'static
{
}

impl<B> ServedBody for B where
    B: Body<Data: Send, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + 'static
{
}

/// Serve one accepted connection until it ends. `service` makes the connection's
/// service from its [`Track`] (its requests hold an [`InFlight`](super::InFlight) each).
pub async fn serve<S, B>(
    stream: TcpStream,
    registry: &Arc<Registry>,
    permit: OwnedSemaphorePermit,
    settings: Settings,
    service: impl FnOnce(Arc<Track>) -> S,
) where
    S: Service<B>,
    B: ServedBody,
{
    let (registered, track, accepted) = admit(&stream, registry, permit);
    serve_io(stream, registered, accepted, settings, service(track)).await;
}

/// What every accepted connection starts with, cleartext or TLS: its place in `registry`
/// (holding `permit`), its [`Track`], and the instant it was accepted (its clocks count
/// from there); the socket set to send small writes at once (`TCP_NODELAY`).
pub(super) fn admit(
    stream: &TcpStream,
    registry: &Arc<Registry>,
    permit: OwnedSemaphorePermit,
) -> (Registered, Arc<Track>, Instant) {
    let registered = registry.register(permit);
    let track = registered.track.clone();
    let accepted = Instant::now();
    let _ = stream.set_nodelay(true);
    (registered, track, accepted)
}

/// After it is asked to close gracefully (HTTP/2 GOAWAY), a connection with nothing in
/// flight gets this long (for the GOAWAY to go out, and the client's PING answer).
pub(super) const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// Concurrent HTTP/2 streams per connection (nginx's `http2_max_concurrent_streams`).
const MAX_STREAMS: u32 = 128;

/// Serve a connection's stream (TCP, or TLS over it) from its first bytes: which protocol,
/// then HTTP/1 or HTTP/2 under the clocks. `accepted`: when the header clock started.
pub(super) async fn serve_io<IO, S, B>(
    mut stream: IO,
    registered: Registered,
    accepted: Instant,
    settings: Settings,
    service: S,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Service<B>,
    B: ServedBody,
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
        _registered: registered,
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
                .serve_connection(io, service)
                // An upgrade's stream outlives this: the tunnel holds it (and with it the
                // connection's place in the registry) until the tunnel ends.
                .with_upgrades();
            drive(conn, &track, |c| c.graceful_shutdown()).await;
        }
        Proto::H2 => {
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .max_concurrent_streams(MAX_STREAMS)
                .max_header_list_size(u32::try_from(settings.max_header_bytes).unwrap_or(u32::MAX))
                .timer(TokioTimer::new())
                // RFC 8441: WebSocket over HTTP/2 (a CONNECT with `:protocol`).
                .enable_connect_protocol()
                .serve_connection(io, service);
            drive(conn, &track, |c| c.graceful_shutdown()).await;
        }
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
