//! bench/run's own load client and backends, where the usual tools do not reach:
//!
//! - `bench-ws-echo ADDR`: a WebSocket echo server (RFC 6455, no extensions), one thread.
//! - `bench-ws-load ADDR CONNECTIONS IN_FLIGHT SECS [SIZE] [PATH]`: WebSocket load, one
//!   thread; prints messages/s.
//! - `bench-h2-backend ADDR`: HTTP/1.1 and cleartext HTTP/2 (prior knowledge) on one port,
//!   one thread: `200 ok` to any request, and to a gRPC call one message back with
//!   `grpc-status: 0` in its trailers.
//! - `bench-knee-backend ADDR [PERMITS] [SLEEP_MS]`: bench/overload's backend, 16 requests
//!   served at once for 20 ms each by default, the rest waiting their turn (a knee at 16);
//!   `GET /max` says how many were inside.
//! - `bench-overload-load ADDR OUT.csv PHASES [CONNECTIONS] [GRACE_S]`: bench/overload's
//!   open-loop load, half free and half pro API keys, every request written to a CSV.
//!
//! Each is single-threaded (a current-thread runtime) so that `taskset` puts all of it on
//! the load CPU, beside the other load processes.

pub mod frame;
pub mod histogram;

/// A listener on `addr` with a backlog of 4,096 rather than tokio's 1,024: a peer that opens
/// connections in bursts (nginx's grpc_pass, one call per connection) finds room, rather
/// than a dropped SYN and a second's wait for its retransmit. The kernel cuts it to
/// `net.core.somaxconn`.
pub fn listen(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let addr: std::net::SocketAddr = addr
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(4096)
}
