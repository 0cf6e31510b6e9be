//! The connections to the upstream: opened where none is idle, kept after an answer whose
//! end was certain, and checked before they are used again.
//!
//! A connection goes back to the pool only when its answer's body ended where its framing
//! said, with no byte read past that end ([`super::ResponseBody`]), and the answer did not
//! end its connection: not `Connection: close` or an HTTP/1.0 answer without keep-alive,
//! not a body delimited by the connection's end, not `Content-Length` with
//! `Transfer-Encoding`, not a 204, 304 or HEAD answer that announces a body (what the
//! upstream writes after it cannot be told from the next answer: `super::head`'s `Close`).
//! A connection whose request body was not all sent never comes back. When one is taken,
//! it is used only if the upstream has neither closed it nor written on it since
//! ([`still_open`]).

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;

use super::stream::Stream;
use super::Error;

/// Idle connections kept per worker, and for how long.
const MAX_IDLE: usize = 256;
const IDLE_FOR: Duration = Duration::from_secs(60);

/// Idle keep-alive connections, most recently used last.
pub(super) struct Kept {
    idle: Mutex<VecDeque<(Stream, Instant)>>,
    /// The upstream's `timeout`: also the longest silence inside an answer's body.
    pub(super) timeout: Duration,
}

impl Kept {
    pub(super) fn new(timeout: Duration) -> Kept {
        Kept {
            idle: Mutex::default(),
            timeout,
        }
    }

    /// The most recently used idle connection that can take a request, if any.
    pub(super) fn take(&self) -> Option<Stream> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some((_, since)) = idle.front() {
            if since.elapsed() < IDLE_FOR {
                break;
            }
            idle.pop_front();
        }
        while let Some((mut conn, _)) = idle.pop_back() {
            if still_open(&mut conn) {
                return Some(conn);
            }
        }
        None
    }

    /// Close the connections idle too long or closed by the upstream (which would
    /// otherwise sit in CLOSE_WAIT until the next request comes).
    pub(super) fn sweep(&self) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain_mut(|(conn, since)| since.elapsed() < IDLE_FOR && still_open(conn));
    }

    /// Keep `conn` for another request; the connection idle longest makes room.
    pub(super) fn put(&self, conn: Stream) {
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
/// `recv` with `MSG_PEEK` per request) costs a syscall per request (docs/performance.md,
/// "The perimeter's cost").
///
/// A TLS connection is read through TLS, with a waker that does nothing (nobody waits on
/// an idle connection): that too costs no syscall unless the loop saw the socket readable
/// (tokio asks its readiness first; the budget is set aside here too), and it also sees plaintext rustls decrypted but
/// nobody read, which the socket's readiness cannot show. Records of TLS's own (a session
/// ticket, a key update) are taken in and leave the connection usable; application data,
/// the backend's `close_notify`, its close or a broken record do not.
fn still_open(conn: &mut Stream) -> bool {
    match conn {
        Stream::Plain(tcp) => {
            let mut probe = [0u8; 1];
            // WouldBlock is the one good answer: 0 is the upstream's close, more a stray
            // answer, another error a broken socket.
            matches!(tcp.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        }
        Stream::Tls(tls) => {
            let mut probe = [0u8; 1];
            let mut read = ReadBuf::new(&mut probe);
            let mut cx = Context::from_waker(Waker::noop());
            // Outside the cooperative budget, like the plain check: a spent budget would
            // read as "nothing there".
            let look = std::future::poll_fn(|cx| Pin::new(&mut *tls).poll_read(cx, &mut read));
            let look = std::pin::pin!(tokio::task::unconstrained(look));
            matches!(look.poll(&mut cx), Poll::Pending)
        }
    }
}

/// Where new connections go: the upstream's name and port, and its address when the URL
/// names one (no resolving per connection).
pub(super) struct Address {
    host: String,
    port: u16,
    addr: Option<SocketAddr>,
}

impl Address {
    pub(super) fn new(host: &str, port: u16) -> Address {
        let addr = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, port));
        Address {
            host: host.to_string(),
            port,
            addr,
        }
    }

    /// `host` (for `Host` and SNI), at `addr`, one of the addresses it resolved to.
    pub(super) fn resolved(host: &str, addr: SocketAddr) -> Address {
        Address {
            host: host.to_string(),
            port: addr.port(),
            addr: Some(addr),
        }
    }

    /// A new connection and the address it went to, within `timeout` (resolving
    /// included).
    pub(super) async fn connect(
        &self,
        timeout: Duration,
    ) -> Result<(TcpStream, SocketAddr), Error> {
        let addrs: Vec<SocketAddr> = match self.addr {
            Some(addr) => vec![addr],
            None => {
                let lookup = tokio::net::lookup_host((self.host.as_str(), self.port));
                match tokio::time::timeout(timeout, lookup).await {
                    Err(_) => return Err(Error::ResolveTimeout(timeout)),
                    Ok(Err(e)) => return Err(Error::Resolve(e)),
                    Ok(Ok(addrs)) => addrs.collect(),
                }
            }
        };
        // Each address gets its share of the connect timeout, so one that drops packets
        // does not keep the next from being tried.
        let each = timeout / u32::try_from(addrs.len().max(1)).unwrap_or(u32::MAX);
        let mut why = Error::NoAddress;
        for addr in addrs {
            match tokio::time::timeout(each, TcpStream::connect(addr)).await {
                Ok(Ok(conn)) => {
                    let _ = conn.set_nodelay(true);
                    return Ok((conn, addr));
                }
                Ok(Err(source)) => why = Error::Connect { addr, source },
                Err(_) => why = Error::ConnectTimeout { addr, after: each },
            }
        }
        Err(why)
    }
}
