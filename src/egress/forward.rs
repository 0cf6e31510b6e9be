//! An egress call on its way: an absolute-form call sent to its target (over TLS where
//! the target says `tls = true`) and its answer streamed back, or a `CONNECT` tunnel's
//! bytes copied both ways. The rate limits' slots (`max_in_flight`) are held until the
//! answer's body ends, or the tunnel does.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::{full, problem, refused, strip_hop_by_hop, Call, Reply};
use crate::headers::Problem;
use crate::connection::Hold;
use crate::limiter::lease::Leases;

/// Send `req` (its hop-by-hop fields taken off, its Host the call's: as the rules read
/// it) to `addr` (the address `call`'s host resolved to), within `timeout` for the
/// connection and the answer's head; the answer, its body streamed.
pub(super) async fn call(
    mut req: Request<Incoming>,
    call: &Call<'_>,
    addr: SocketAddr,
    timeout: Duration,
    leases: Option<Leases>,
) -> Reply {
    // Origin-form to the target, with the Host the call named.
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
    *req.uri_mut() = match Uri::try_from(path) {
        Ok(uri) => uri,
        Err(_) => return problem(&Problem::new(StatusCode::BAD_REQUEST, "the call's path is not valid")),
    };
    let sent = tokio::time::timeout(timeout, send(req, call, addr)).await;
    let mut answer = match sent {
        Ok(Ok(answer)) => answer,
        Ok(Err(p)) => return problem(&p),
        Err(_) => {
            return problem(&Problem::new(
                StatusCode::GATEWAY_TIMEOUT,
                format!("{} did not answer within [egress] timeout ({timeout:?})", call.host),
            ))
        }
    };
    strip_hop_by_hop(answer.headers_mut());
    // The slots are held until the body ends (or is dropped: the caller left).
    answer.map(|body| {
        body.map_frame(move |frame| {
            let _held = &leases;
            frame
        })
        .map_err(Into::into)
        .boxed_unsync()
    })
}

async fn send(
    req: Request<Incoming>,
    call: &Call<'_>,
    addr: SocketAddr,
) -> Result<Response<Incoming>, Box<Problem>> {
    let bad_gateway = |what: String| refused(StatusCode::BAD_GATEWAY, what);
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| bad_gateway(format!("cannot connect to {} ({addr}): {e}", call.host)))?;
    let _ = tcp.set_nodelay(true);
    let client = call.target.tls_client.as_ref().filter(|_| call.tls);
    match client {
        None => exchange(TokioIo::new(tcp), req, &call.host).await,
        Some(config) => {
            let name = ServerName::try_from(call.host.clone())
                .map_err(|e| bad_gateway(format!("{} is not a TLS server name: {e}", call.host)))?;
            let tls = tokio_rustls::TlsConnector::from(config.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| bad_gateway(format!("TLS with {} failed: {e}", call.host)))?;
            exchange(TokioIo::new(tls), req, &call.host).await
        }
    }
}

/// One HTTP/1.1 exchange on a connection of its own.
async fn exchange<IO>(io: IO, req: Request<Incoming>, host: &str) -> Result<Response<Incoming>, Box<Problem>>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let bad_gateway = |what: String| refused(StatusCode::BAD_GATEWAY, what);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| bad_gateway(format!("{host}: {e}")))?;
    tokio::spawn(async move {
        // Ends with the answer's body, or when the target closes.
        let _ = conn.await;
    });
    sender
        .send_request(req)
        .await
        .map_err(|e| bad_gateway(format!("{host} did not answer: {e}")))
}

/// `CONNECT`: connect to `addr`, answer 200, then copy bytes both ways until either side
/// ends, no byte passes for `idle`, or the gateway closes the connection (its shutdown's
/// grace ran out). The slots and the connection's hold are kept until the tunnel ends.
pub(super) async fn tunnel(
    req: Request<Incoming>,
    addr: SocketAddr,
    idle: Duration,
    timeout: Duration,
    (leases, hold): (Option<Leases>, Hold),
) -> Reply {
    let connected = tokio::time::timeout(timeout, TcpStream::connect(addr)).await;
    let target = match connected {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            return problem(&Problem::new(StatusCode::BAD_GATEWAY, format!("cannot connect to {addr}: {e}")))
        }
        Err(_) => {
            return problem(&Problem::new(StatusCode::GATEWAY_TIMEOUT, format!("{addr} did not accept in time")))
        }
    };
    let _ = target.set_nodelay(true);
    tokio::spawn(async move {
        let Ok(upgraded) = hyper::upgrade::on(req).await else {
            return;
        };
        let _held = leases;
        let seen = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let mut client = Watched::new(TokioIo::new(upgraded), &seen, started);
        let mut target = Watched::new(target, &seen, started);
        let copy = tokio::io::copy_bidirectional(&mut client, &mut target);
        tokio::pin!(copy);
        loop {
            let since = Duration::from_millis(seen.load(Ordering::Relaxed));
            let quiet_until = started + since + idle;
            tokio::select! {
                _ = &mut copy => return,
                () = hold.closing() => return,
                () = tokio::time::sleep_until(quiet_until.into()) => {
                    let last = Duration::from_millis(seen.load(Ordering::Relaxed));
                    if started + last + idle <= Instant::now() {
                        return;
                    }
                }
            }
        }
    });
    let mut r = Response::new(full(""));
    *r.status_mut() = StatusCode::OK;
    r
}

/// A stream that notes when a byte last went either way (ms since `started`).
struct Watched<S> {
    inner: S,
    seen: Arc<AtomicU64>,
    started: Instant,
}

impl<S> Watched<S> {
    fn new(inner: S, seen: &Arc<AtomicU64>, started: Instant) -> Self {
        Watched {
            inner,
            seen: seen.clone(),
            started,
        }
    }

    fn note(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.seen.store(ms, Ordering::Relaxed);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.note();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.note();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
