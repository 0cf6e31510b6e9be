//! The one harness of the tests in `tests/it/`: real processes and real clients, each
//! helper written once. Everything binds to 127.0.0.1 and is killed (or aborted) on drop.
//!
//! - [`redis_server`]: a `redis-server` on a free port (again on another when it was taken
//!   meanwhile, as the gateway's start does; [`sentinel`] and [`nginx`] too), a Redis
//!   Cluster (with or without replicas), and what the tests read from them (INFO
//!   counters, TTLs, Redis' clock). No
//!   server the harness starts writes anything to disk (`--save ""`, `--appendonly no`,
//!   `--dir` in a temporary directory).
//! - [`sentinel`]: Redis under Sentinel: a primary, two replicas and three sentinels,
//!   the primary killed (SIGKILL) and its successor waited for.
//! - [`jwt`]: signing keys made here (openssl, rcgen), tokens signed with them, their
//!   public keys as PEM and JWKS, and a JWKS served over https that can be changed and
//!   stopped.
//! - [`keys`]: the Redis key layout of CONTRACT.md (`<prefix>:{<identity-hash>}:<rule>`),
//!   computed here with `sha2`, not with the crate's digest functions under test.
//! - [`llm`]: a scripted HTTP/1.1 backend for settlements (statuses, held heads, a
//!   reported cost as a header or a trailer, OpenAI-style JSON and server-sent event
//!   answers with their usage, each body write timed), and a client reading an answer
//!   frame by frame.
//! - [`gateway`]: the `ratewall` binary on a generated config, and config snippets.
//! - [`grpc`]: gRPC's own server and client (grpcio, Python scripts in `tests/it/py/`),
//!   raw bytes both ways, each call's outcome in the client's own words.
//! - [`knee`]: a backend whose latency grows with its concurrency past a knee (a
//!   semaphore of places and a sleep), counting the most requests it held at once.
//! - [`upstream`]: an HTTP upstream in the test process that records what it saw.
//! - [`backend`]: a pool's servers: bound where a test says, killed and started again on
//!   the same address, recording request targets byte for byte; one that resets; and a
//!   dead one, [`RefusingPort`]: a port held (bound, never listening) that refuses.
//! - [`browser`]: a page's DOM as headless Chromium renders it.
//! - [`tls_upstream`]: an https upstream in the test process, with certificates made by
//!   the harness (rcgen), counting handshakes, SNI and client certificates.
//! - [`nginx`]: a real nginx backend on a free port, in its own temporary prefix.
//! - [`client`]: a real HTTP client (HTTP/1.1 or h2c), replies read whole, streamed bodies.
//! - [`raw`]: raw TCP exchanges for bytes no well-behaved client would send.
//! - [`headers`]: the RateLimit Structured Field headers, parsed.
//! - [`metrics`]: `/metrics` parsed with `prometheus-parse`.
//! - [`tls`]: a throw-away CA (rcgen), server and client certificates as PEM files, a
//!   `[server.tls]` table, and a rustls client (HTTP/1.1 or HTTP/2 by ALPN).
//! - [`seed`]: property runs: the saved regressions, a fixed seed, a fresh one on CI
//!   (`RATEWALL_FRESH_SEED=1`), each seed printed with its replay (`proptest_seeds!`).
//! - [`serial`]: a lock for tests whose bounds are timed, so that they do not run beside
//!   each other's load.
//! - [`watchdog`]: a time budget for every test; a hung one ends the run, named.
//! - [`witness`]: a scripted backend counting request heads the moment they arrive (before
//!   any body), with their fields, bodies and trailers; costs as fields and trailers, a
//!   gate before the last chunk, and an echo of what it was sent.
//! - [`early`]: clients that leave once their request reached the backend (FIN, RST,
//!   HTTP/2 RST_STREAM, a body cut short, broken or stalled).
//! - [`gzip_backend`]: an OpenAI-compatible backend that gzips its answers (Python).
//! - [`websocket`]: a WebSocket echo backend and client (Python's `websockets`, run as
//!   subprocesses), RFC 6455 frames by hand, and a raw upgrade backend.

pub mod backend;
pub mod browser;
pub mod client;
pub mod early;
pub mod gateway;
pub mod grpc;
pub mod gzip_backend;
pub mod headers;
pub mod jwt;
pub mod keys;
pub mod knee;
pub mod llm;
pub mod metrics;
pub mod nginx;
pub mod raw;
pub mod redis_server;
pub mod seed;
pub mod sentinel;
pub mod serial;
pub mod tls;
pub mod tls_upstream;
pub mod upstream;
pub mod watchdog;
pub mod websocket;
pub mod witness;

pub use backend::*;
pub use browser::*;
pub use client::*;
pub use gateway::*;
pub use headers::*;
pub use keys::*;
pub use metrics::*;
pub use nginx::*;
pub use raw::*;
pub use redis_server::*;
pub use sentinel::*;
pub use serial::*;
pub use tls::*;
pub use upstream::*;
pub use watchdog::watchdog;
pub use websocket::*;

use std::net::TcpListener as StdListener;
use std::time::{Duration, Instant};

/// A port that was free a moment ago (anyone's by the time it is used: a server started
/// on it checks that it is the one answering, and starts again on another if not; a dead
/// upstream is a [`RefusingPort`], held).
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port on 127.0.0.1")
}

/// Wait until something accepts on `port` (at most `within`).
pub fn wait_for_port(port: u16, within: Duration) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// A test that cannot run on this machine (something the test needs and `./scripts/test`
/// cannot install) says so on the terminal, past libtest's capture of a passing test's
/// output, and returns; with `RATEWALL_NO_SKIP=1` (`.ci/run` sets it) it fails instead, so
/// that CI never passes a test it did not run. (What `./scripts/test` installs —
/// Chromium, curl, nginx, redis-server — is never skipped: a test without it fails.)
pub fn skip(why: &str) {
    use std::io::Write;
    let test = std::thread::current()
        .name()
        .unwrap_or("(a test)")
        .to_string();
    assert!(
        std::env::var("RATEWALL_NO_SKIP").map_or(true, |v| v.trim() != "1"),
        "{test} cannot run here, and RATEWALL_NO_SKIP=1 forbids skipping it: {why}"
    );
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// Count statuses.
pub fn tally(
    statuses: impl IntoIterator<Item = http::StatusCode>,
) -> std::collections::HashMap<u16, usize> {
    let mut m = std::collections::HashMap::new();
    for s in statuses {
        *m.entry(s.as_u16()).or_insert(0) += 1;
    }
    m
}
