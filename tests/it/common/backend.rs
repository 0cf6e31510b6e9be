//! Servers of a pool: real HTTP backends (hyper, HTTP/1.1 and h2c) in the test process
//! that can be bound to a chosen address, killed (every connection closed, the port
//! refusing) and started again on the same address; and a backend that resets every
//! connection once a request's head is in.
//!
//! Unlike [`super::Upstream`], a [`Backend`] records the request target exactly as it
//! arrived (path and query, percent-encodings and all), the method and the API key, and
//! says which backend answered in an `x-backend` response header.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};

/// One request as a [`Backend`] saw it.
#[derive(Debug, Clone)]
pub struct Hit {
    pub method: String,
    /// The request target as it arrived: path and query, bytes untouched.
    pub target: String,
    /// Body bytes read (all of them unless the backend cut the request short).
    pub body_len: usize,
}

impl Hit {
    /// The target's path, without the query.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or_default()
    }
}

/// What a [`Backend`] does with a request with a body (POST, PUT...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnBody {
    /// Read it whole, then answer.
    Read,
    /// Read its first chunk, signal [`Backend::cut`], then reset the connection (TCP RST)
    /// without answering: a server dying while a request body arrives.
    ResetAfterFirstChunk,
}

#[derive(Default)]
struct Shared {
    hits: Mutex<Vec<Hit>>,
    /// Requests whose head arrived, counted first.
    arrived: AtomicUsize,
    /// Requests being answered now.
    in_flight: AtomicUsize,
    /// Signalled when an [`OnBody::ResetAfterFirstChunk`] request is cut.
    cut: Notify,
}

/// A real HTTP backend. Paths: `/slow/<ms>...` answers that many ms after its body is
/// read; anything else at once. Every answer is 200 `ok <body length>` with an
/// `x-backend: <ip:port>` header.
pub struct Backend {
    pub addr: SocketAddr,
    on_body: OnBody,
    shared: Arc<Shared>,
    /// The accept loop, which owns every connection's task: aborting it closes them all.
    task: Option<JoinHandle<()>>,
}

/// A listener on `addr` (port 0: any free one), with SO_REUSEADDR so that a backend
/// started again on the port it had is not refused for its old connections.
pub fn listen_on(addr: SocketAddr) -> TcpListener {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4(),
        SocketAddr::V6(_) => TcpSocket::new_v6(),
    }
    .expect("socket");
    socket.set_reuseaddr(true).expect("SO_REUSEADDR");
    socket
        .bind(addr)
        .unwrap_or_else(|e| panic!("bind a backend on {addr}: {e}"));
    socket.listen(1024).expect("listen")
}

impl Backend {
    /// A backend on a free port of 127.0.0.1.
    pub async fn start() -> Backend {
        Self::start_on("127.0.0.1:0".parse().expect("addr"), OnBody::Read).await
    }

    /// A backend on `addr` (port 0: a free one).
    pub async fn start_on(addr: SocketAddr, on_body: OnBody) -> Backend {
        let listener = listen_on(addr);
        let addr = listener.local_addr().expect("backend addr");
        let shared = Arc::new(Shared::default());
        let task = tokio::spawn(accept_loop(listener, shared.clone(), on_body));
        Backend {
            addr,
            on_body,
            shared,
            task: Some(task),
        }
    }

    /// `http://ip:port`, as a pool's `servers` lists it (and the metrics label it).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What the `x-backend` header of its answers says.
    pub fn name(&self) -> String {
        self.addr.to_string()
    }

    /// Every request answered or cut so far.
    pub fn hits(&self) -> Vec<Hit> {
        self.shared
            .hits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many requests answered or cut so far have a path starting with `prefix`.
    pub fn count(&self, prefix: &str) -> usize {
        self.hits()
            .iter()
            .filter(|h| h.path().starts_with(prefix))
            .count()
    }

    /// Requests whose head arrived, answered or not.
    pub fn arrived(&self) -> usize {
        self.shared.arrived.load(Ordering::SeqCst)
    }

    /// Requests being answered now.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Resolves once a request was cut ([`OnBody::ResetAfterFirstChunk`]); a permit is
    /// kept if that came first.
    pub async fn cut(&self) {
        self.shared.cut.notified().await
    }

    /// Kill it as a crashed process dies: the port stops accepting and every connection
    /// is closed at once, requests in flight unanswered.
    pub async fn kill(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }

    /// Start it again on the same address (a fresh record of requests).
    pub async fn restart(&mut self) {
        self.kill().await;
        *self = Backend::start_on(self.addr, self.on_body).await;
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, on_body: OnBody) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                connections.spawn(serve(stream, shared.clone(), on_body));
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve(stream: TcpStream, shared: Arc<Shared>, on_body: OnBody) {
    let _ = stream.set_nodelay(true);
    if on_body == OnBody::ResetAfterFirstChunk {
        // Closed with a RST, not a FIN, when the connection is dropped below.
        let _ = stream.set_zero_linger();
    }
    let name = stream
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let cut = Arc::new(Notify::new());
    let svc = {
        let (shared, cut) = (shared.clone(), cut.clone());
        service_fn(move |req: Request<Incoming>| {
            let (shared, cut, name) = (shared.clone(), cut.clone(), name.clone());
            async move { Ok::<_, Infallible>(answer(req, &shared, on_body, &cut, &name).await) }
        })
    };
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::select! {
        _ = conn => {}
        // Dropping the connection drops the socket: a RST (linger 0).
        _ = cut.notified() => {}
    }
}

async fn answer(
    req: Request<Incoming>,
    shared: &Shared,
    on_body: OnBody,
    cut: &Notify,
    name: &str,
) -> Response<Full<Bytes>> {
    shared.arrived.fetch_add(1, Ordering::SeqCst);
    shared.in_flight.fetch_add(1, Ordering::SeqCst);
    let method = req.method().to_string();
    let target = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let mut body = req.into_body();
    let mut body_len = 0;
    let mut cut_now = false;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        if let Some(d) = frame.data_ref() {
            body_len += d.len();
            if on_body == OnBody::ResetAfterFirstChunk && body_len > 0 {
                cut_now = true;
                break;
            }
        }
    }
    let hit = Hit {
        method,
        target,
        body_len,
    };
    let slow = hit
        .path()
        .strip_prefix("/slow/")
        .and_then(|rest| rest.split('/').next())
        .and_then(|ms| ms.parse::<u64>().ok());
    shared
        .hits
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(hit);
    if cut_now {
        shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        cut.notify_one();
        shared.cut.notify_one();
        // The connection is dropped while this answer waits.
        std::future::pending::<()>().await;
    }
    if let Some(ms) = slow {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    shared.in_flight.fetch_sub(1, Ordering::SeqCst);
    let mut resp = Response::new(Full::new(Bytes::from(format!("ok {body_len}\n"))));
    if let Ok(v) = http::HeaderValue::from_str(name) {
        resp.headers_mut().insert("x-backend", v);
    }
    resp
}

/// A server that accepts every connection, reads until a request's head is in, then
/// resets the connection (TCP RST) without answering: a backend that fails every request
/// after it was sent.
pub struct Resetter {
    pub addr: SocketAddr,
    /// Connections whose request head arrived before the reset.
    resets: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Resetter {
    pub async fn start() -> Resetter {
        let listener = listen_on("127.0.0.1:0".parse().expect("addr"));
        let addr = listener.local_addr().expect("resetter addr");
        let resets = Arc::new(AtomicUsize::new(0));
        let counted = resets.clone();
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((mut stream, _)) = accepted else { continue };
                        let counted = counted.clone();
                        connections.spawn(async move {
                            let _ = stream.set_zero_linger();
                            let mut got = Vec::new();
                            let mut buf = [0u8; 4096];
                            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                                match tokio::time::timeout(
                                    Duration::from_secs(10),
                                    stream.read(&mut buf),
                                )
                                .await
                                {
                                    Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
                                    _ => return,
                                }
                            }
                            counted.fetch_add(1, Ordering::SeqCst);
                            drop(stream);
                        });
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        Resetter { addr, resets, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests that arrived and were reset.
    pub fn resets(&self) -> usize {
        self.resets.load(Ordering::SeqCst)
    }
}

impl Drop for Resetter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A port of 127.0.0.1 held and refusing: a socket bound to it that never listens. While
/// it lives no other process can take the port (a port merely free a moment ago could be
/// anyone's by the time it is dialled), and a connection to it is refused at once (Linux
/// answers the SYN with a reset: no listening socket), as to a server that is down.
pub struct RefusingPort {
    pub port: u16,
    _socket: socket2::Socket,
}

impl RefusingPort {
    pub fn new() -> RefusingPort {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("a TCP socket");
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        socket.bind(&any.into()).expect("bind 127.0.0.1:0");
        let port = socket
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .map(|a| a.port())
            .expect("the bound port");
        RefusingPort {
            port,
            _socket: socket,
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Default for RefusingPort {
    fn default() -> RefusingPort {
        RefusingPort::new()
    }
}
