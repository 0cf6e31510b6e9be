//! bench/run's own load client and backends, where the usual tools do not reach:
//!
//! - `bench-ws-echo ADDR`: a WebSocket echo server (RFC 6455, no extensions), one thread.
//! - `bench-ws-load ADDR CONNECTIONS IN_FLIGHT SECS [SIZE] [PATH]`: WebSocket load, one
//!   thread; prints messages/s.
//! - `bench-h2-backend ADDR`: HTTP/1.1 and cleartext HTTP/2 (prior knowledge) on one port,
//!   one thread: `200 ok` to any request, and to a gRPC call one message back with
//!   `grpc-status: 0` in its trailers.
//!
//! Each is single-threaded (a current-thread runtime) so that `taskset` puts all of it on
//! the load CPU, beside the other load processes.

pub mod frame;
pub mod histogram;
