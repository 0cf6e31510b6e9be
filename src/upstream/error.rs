//! What can go wrong on the way to the upstream and back, up to the answer's head, and
//! what each failure becomes: the status the client gets, the detail its problem+json
//! carries, whose fault it is, and whether the request may be sent again.
//!
//! Failures after the head (a body cut short, malformed or stalled) are the response
//! body's ([`super::BodyError`]): the answer has begun by then, and the client's connection
//! is cut instead.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use http::header::HeaderValue;
use http::{StatusCode, Uri};

use super::head::MAX_HEAD;

/// Why a request got no answer from the upstream.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // Opening a connection: nothing of the request was sent.
    /// The upstream's name did not resolve.
    #[error("resolving the upstream's name: {0}")]
    Resolve(#[source] io::Error),
    /// The upstream's name did not resolve within `connect_timeout`.
    #[error("resolving the upstream's name timed out after {0:?}")]
    ResolveTimeout(Duration),
    /// The upstream's name resolved to no address.
    #[error("the upstream's name resolves to no address")]
    NoAddress,
    /// The upstream refused the connection, or could not be reached (the last address
    /// tried, where the name has several).
    #[error("connecting to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    /// Connecting took longer than this address's share of `connect_timeout`.
    #[error("connecting to {addr} timed out after {after:?}")]
    ConnectTimeout { addr: SocketAddr, after: Duration },
    /// The TLS handshake with an `https://` upstream failed: its certificate did not
    /// verify for `name` (an unknown issuer, another name, expired), or the backend
    /// refused ours, or the connection broke. The source says which (`super::tls`).
    #[error("TLS handshake with {addr} for {name:?}: {source}")]
    Tls {
        addr: SocketAddr,
        name: String,
        #[source]
        source: io::Error,
    },
    /// The TLS handshake took longer than `connect_timeout`.
    #[error("TLS handshake with {addr} timed out after {after:?}")]
    TlsTimeout { addr: SocketAddr, after: Duration },
    /// The HTTP/2 connection could not be set up over the connection opened: hyper's
    /// handshake failed, or the upstream sent no SETTINGS (its connection preface, RFC
    /// 9113 §3.4) within `connect_timeout`. Nothing of the request was sent.
    #[error("HTTP/2 handshake with {addr}: {why}")]
    Http2Handshake { addr: SocketAddr, why: String },

    /// No server of the pool can take the request: every one is failing its health
    /// checks. No connection was tried.
    #[error("no server of the pool is available")]
    NoServer,

    // Sending the request.
    /// A request target that is neither a path nor `*` (nothing else can go upstream).
    #[error("cannot forward request target {0}")]
    Target(Uri),
    /// Writing the request failed: the upstream closed or reset the connection.
    /// `replayable`: see [`Error::retryable`].
    #[error("writing the request: {source}")]
    Write {
        #[source]
        source: io::Error,
        replayable: bool,
    },
    /// The upstream refused an HTTP/2 stream before processing it: `REFUSED_STREAM`, or a
    /// graceful GOAWAY that came before the stream (RFC 9113 §8.7, §6.8), or a connection
    /// that closed before the request was handed to it. Safe to send again.
    #[error("the upstream refused the HTTP/2 stream unprocessed: {0}")]
    Refused(#[source] hyper::Error),
    /// An HTTP/2 exchange failed before the answer's head: the stream was reset, or its
    /// connection failed under it. `replayable`: see [`Error::retryable`].
    #[error("HTTP/2 with the upstream: {source}")]
    Http2 {
        #[source]
        source: hyper::Error,
        replayable: bool,
    },
    /// The upstream took nothing of the request for this long.
    #[error("the upstream took none of the request for {0:?}")]
    WriteStalled(Duration),

    // The answer's head.
    /// No complete head within the upstream's `timeout` of the request being sent.
    #[error("the upstream did not answer within {0:?}")]
    Timeout(Duration),
    /// The upstream closed the connection before the first byte of a final answer.
    /// `replayable`: see [`Error::retryable`].
    #[error("the upstream closed the connection without answering")]
    Closed { replayable: bool },
    /// The upstream closed the connection part way through the answer's head.
    #[error("the upstream closed the connection inside the response head")]
    ClosedInHead,
    /// Reading the answer failed (a reset, say). `replayable`: see [`Error::retryable`].
    #[error("reading the answer: {source}")]
    Read {
        #[source]
        source: io::Error,
        replayable: bool,
    },
    /// The answer's head cannot be read as HTTP/1.1, or its framing cannot be trusted.
    #[error("malformed response head: {0}")]
    Malformed(#[from] Malformed),
    /// The answer carries a transfer coding (these) that the client cannot be sent: an
    /// HTTP/1.0 or HTTP/2 client, which has no transfer codings.
    #[error("the upstream sent Transfer-Encoding {0:?}, which this client cannot take")]
    Coding(HeaderValue),

    // The client's side.
    /// The client's request body could not be read as framed (a malformed chunk): the
    /// client's error, not the upstream's.
    #[error("the client's request body is malformed: {0}")]
    ClientBody(#[source] hyper::Error),
    /// The client sent nothing more of its request body for `body_timeout`.
    #[error("the client's request body stalled for {0:?}")]
    ClientStalled(Duration),
}

/// What is wrong with a response head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// Not HTTP/1.x as `httparse` reads it (the status line, a field line, their bytes).
    #[error("{0}")]
    Syntax(httparse::Error),
    #[error("larger than {MAX_HEAD} bytes")]
    TooLarge,
    #[error("bad status code {0}")]
    Status(u16),
    /// A 101 to a request that did not ask to upgrade, or one that names no protocol or
    /// another than the one asked for.
    #[error("the upstream switched protocols unasked, or to a protocol not asked for")]
    SwitchedProtocols,
    #[error("bad field name")]
    FieldName,
    #[error("bad field value")]
    FieldValue,
    #[error("bad Content-Length")]
    ContentLength,
    #[error("conflicting Content-Length values")]
    ConflictingLengths,
    /// `Transfer-Encoding` that is not text, or where `chunked` is not the last coding
    /// (RFC 9112 §6.1): no framing can be trusted.
    #[error("malformed Transfer-Encoding")]
    TransferEncoding,
    /// RFC 9112 §6.1: framing an HTTP/1.0 recipient cannot have asked for is faulty.
    #[error("Transfer-Encoding in an HTTP/1.0 response")]
    CodingInHttp10,
}

impl Error {
    /// The status the client is answered: 504 for an upstream too slow to answer, 400 and
    /// 408 for the client's own faults, 502 for everything else.
    pub fn status(&self) -> StatusCode {
        match self {
            Error::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Error::ClientBody(_) => StatusCode::BAD_REQUEST,
            Error::ClientStalled(_) => StatusCode::REQUEST_TIMEOUT,
            _ => StatusCode::BAD_GATEWAY,
        }
    }

    /// The `detail` of the problem+json answer: what the client may know, never the cause.
    pub fn detail(&self) -> &'static str {
        match self {
            Error::Timeout(_) => "the upstream did not answer in time",
            Error::NoServer => "no server of the upstream is available",
            Error::Coding(_) => {
                "the upstream's answer uses a transfer coding this client cannot take"
            }
            Error::ClientBody(_) => "the request body is malformed",
            Error::ClientStalled(_) => "the request body stopped arriving",
            Error::Tls { source, .. } if super::tls::is_certificate_error(source) => {
                "the upstream's TLS certificate could not be verified"
            }
            Error::Tls { .. } | Error::TlsTimeout { .. } => {
                "the TLS handshake with the upstream failed"
            }
            _ => "the upstream could not be reached",
        }
    }

    /// Whether the client, not the upstream, is at fault (its body malformed or stalled):
    /// such a failure says nothing of the upstream, and the client's connection, left in
    /// the middle of a body, cannot be trusted with another request.
    pub fn is_client_error(&self) -> bool {
        matches!(self, Error::ClientBody(_) | Error::ClientStalled(_))
    }

    /// Whether the same request may be sent again, whole and unchanged, on another
    /// connection (to this upstream or another). True exactly when:
    ///
    /// - no connection could be opened (resolving, connecting, the TLS or the HTTP/2
    ///   handshake failed or timed out): nothing of the request was sent; or
    /// - HTTP/2 says the stream was not processed ([`Error::Refused`]); or
    /// - the connection was closed or reset (a failed write, a read that ended or failed)
    ///   before the first byte of any answer (a 1xx counts) and before any byte of the
    ///   client's body was read — its head alone had gone up — and the method is
    ///   idempotent (RFC 9110 §9.2.2). The upstream may have read the request before it
    ///   closed: an upstream closing a kept connection just as a request arrives (its idle
    ///   timeout, RFC 9112 §9.3.1) may or may not have seen it. Only an idempotent request
    ///   may be sent twice for that.
    ///
    /// Never after a timeout (the upstream may still be working on it), a malformed
    /// answer, an answer begun, a client body partly read (it cannot be read again), or the
    /// client's own fault.
    pub fn retryable(&self) -> bool {
        match self {
            Error::Resolve(_)
            | Error::ResolveTimeout(_)
            | Error::NoAddress
            | Error::Connect { .. }
            | Error::ConnectTimeout { .. }
            | Error::Tls { .. }
            | Error::TlsTimeout { .. }
            | Error::Http2Handshake { .. }
            | Error::Refused(_) => true,
            Error::Write { replayable, .. }
            | Error::Http2 { replayable, .. }
            | Error::Closed { replayable }
            | Error::Read { replayable, .. } => *replayable,
            Error::Target(_)
            | Error::NoServer
            | Error::WriteStalled(_)
            | Error::Timeout(_)
            | Error::ClosedInHead
            | Error::Malformed(_)
            | Error::Coding(_)
            | Error::ClientBody(_)
            | Error::ClientStalled(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(kind: io::ErrorKind) -> io::Error {
        io::Error::from(kind)
    }

    fn addr() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 3000))
    }

    fn second() -> Duration {
        Duration::from_secs(1)
    }

    /// A `hyper::Error` as a client's malformed request makes one: hyper makes them only
    /// as it reads.
    async fn hyper_error() -> hyper::Error {
        use tokio::io::AsyncWriteExt;
        let (mut client, server) = tokio::io::duplex(1024);
        client
            .write_all(b"NOT HTTP\r\n\r\n")
            .await
            .expect("the pipe takes it");
        let service = hyper::service::service_fn(|_| async {
            let empty = http_body_util::Empty::<bytes::Bytes>::new();
            Ok::<_, std::convert::Infallible>(http::Response::new(empty))
        });
        hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(server), service)
            .await
            .expect_err("these bytes are not HTTP")
    }

    /// The upstream-side errors, each with whether it is retryable.
    fn upstream_errors() -> Vec<(Error, bool)> {
        use io::ErrorKind::{BrokenPipe, ConnectionRefused, ConnectionReset, NotFound};
        vec![
            (Error::Resolve(io(NotFound)), true),
            (Error::ResolveTimeout(second()), true),
            (Error::NoAddress, true),
            (
                Error::Connect {
                    addr: addr(),
                    source: io(ConnectionRefused),
                },
                true,
            ),
            (
                Error::ConnectTimeout {
                    addr: addr(),
                    after: second(),
                },
                true,
            ),
            (Error::Target(Uri::from_static("example.com:443")), false),
            (
                Error::Write {
                    source: io(BrokenPipe),
                    replayable: true,
                },
                true,
            ),
            (
                Error::Write {
                    source: io(BrokenPipe),
                    replayable: false,
                },
                false,
            ),
            (Error::WriteStalled(second()), false),
            (Error::Timeout(second()), false),
            (Error::Closed { replayable: true }, true),
            (Error::Closed { replayable: false }, false),
            (Error::ClosedInHead, false),
            (
                Error::Read {
                    source: io(ConnectionReset),
                    replayable: true,
                },
                true,
            ),
            (
                Error::Read {
                    source: io(ConnectionReset),
                    replayable: false,
                },
                false,
            ),
            (Error::Malformed(Malformed::TooLarge), false),
            (Error::Coding(HeaderValue::from_static("gzip")), false),
        ]
    }

    #[test]
    fn only_a_request_the_upstream_cannot_have_acted_on_or_an_idempotent_one_is_retryable() {
        for (e, retryable) in upstream_errors() {
            assert_eq!(e.retryable(), retryable, "{e:?}");
        }
        assert!(!Error::ClientStalled(second()).retryable());
    }

    #[test]
    fn each_error_is_answered_as_the_gateway_always_answered_it() {
        for (e, _) in upstream_errors() {
            let expected = match e {
                Error::Timeout(_) => (504, "the upstream did not answer in time"),
                Error::Coding(_) => (
                    502,
                    "the upstream's answer uses a transfer coding this client cannot take",
                ),
                _ => (502, "the upstream could not be reached"),
            };
            assert_eq!((e.status().as_u16(), e.detail()), expected, "{e:?}");
            assert!(!e.is_client_error(), "{e:?}");
        }
        let stalled = Error::ClientStalled(second());
        assert_eq!(
            (stalled.status().as_u16(), stalled.detail()),
            (408, "the request body stopped arriving")
        );
        assert!(stalled.is_client_error());
    }

    #[tokio::test]
    async fn a_malformed_client_body_is_the_clients_400_and_never_sent_again() {
        let e = Error::ClientBody(hyper_error().await);
        assert_eq!(
            (e.status().as_u16(), e.detail()),
            (400, "the request body is malformed")
        );
        assert!(e.is_client_error());
        assert!(!e.retryable());
    }
}
