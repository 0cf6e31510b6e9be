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
//!
//! # Files
//!
//! In the order a connection meets them:
//!
//! - `registry.rs`: [`Registry`], every open connection of a listener, `max_connections`,
//!   making room, and why the gateway closed one ([`Closed`]).
//! - `track.rs`: one connection's state ([`Track`]), its requests in flight ([`InFlight`])
//!   and the answer bodies that hold them ([`Tracked`]).
//! - `tls.rs`: the TLS listener's handshake ([`serve_tls`]), how it ended ([`Handshake`]),
//!   and the 400 for plain HTTP on the TLS port.
//! - `serve.rs`: [`serve()`] a connection: its protocol, then hyper's HTTP/1 or HTTP/2,
//!   shut down gracefully when it is asked to close.
//! - `protocol.rs`: which protocol the client speaks, from its first bytes.
//! - `clocks.rs`: the stream with the clocks on its reads and writes, and the clock the
//!   idle times are kept on.
//! - `head.rs`: an HTTP/1 head as it arrives: its bare-CR scan, its field bound, the answers
//!   written straight to the socket.
//! - `descriptors.rs`: the open-file limit raised to fit `max_connections`.
//!
//! And what they all count into: `metrics.rs`, the connections' and the TLS listener's
//! metrics, registered by [`ConnectionMetrics::register`], and each listener's handles on
//! them ([`ListenerMetrics`]).

mod clocks;
mod descriptors;
mod head;
pub mod metrics;
mod protocol;
mod registry;
mod serve;
mod tls;
mod track;

use std::time::Duration;

pub(crate) use clocks::expired;
pub use descriptors::{raise_descriptor_limit, RESERVED_DESCRIPTORS};
pub use head::default_max_fields;
pub use metrics::{ConnectionMetrics, ListenerMetrics};
pub use registry::{Closed, Registry};
pub use serve::{serve, ServedBody, Service};
pub use tls::{serve_tls, Handshake, HandshakeResult, Refused};
pub use track::{Hold, InFlight, Track, Tracked};

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

/// How a listener's connections are served: read from the live config at each accept,
/// so a reload changes them for new connections.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub timeouts: Timeouts,
    pub max_header_bytes: usize,
    /// HTTP/1: the most fields a head may have (`[server] max_header_fields`).
    pub max_header_fields: usize,
}
