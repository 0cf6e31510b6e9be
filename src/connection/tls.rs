//! The TLS listener's side of a connection: its handshake (bounded by `header_timeout`),
//! how a handshake ended for the metrics ([`Handshake`]: its [`HandshakeResult`] and, if
//! refused, why, [`Refused`]), and the answer to plain HTTP sent to the TLS port.

use std::io;
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::registry::{Closed, Registry};
use super::serve::{admit, serve_io, ServedBody, Service};
use super::track::Track;
use super::Settings;

/// How a TLS handshake ended, for the metrics: done, or why not. Its labels are
/// [`HandshakeResult`] and, for a failed one, [`Refused`].
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

crate::telemetry::label_enum! {
    /// A [`Handshake`]'s `result` label.
    pub enum HandshakeResult {
        Ok,
        Timeout,
        Closed,
        Failed,
        /// [`Handshake::Asked`].
        Shutdown,
    }
}

crate::telemetry::label_enum! {
    /// Why TLS refused a handshake on the listener, read from the `rustls::Error` inside
    /// the handshake's `io::Error`.
    pub enum Refused {
        /// Nothing in common with the client (version, cipher suite, ALPN protocol...), or
        /// a client that broke the protocol.
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
}

impl Refused {
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
    /// Every result and reason the metrics have a series for: ok, timeout, closed, each
    /// refusal (from [`Refused::ALL`], not listed again), shutdown.
    pub const ALL: [Handshake; 4 + Refused::ALL.len()] = {
        let mut all = [Handshake::Asked; 4 + Refused::ALL.len()];
        all[0] = Handshake::Ok;
        all[1] = Handshake::Timeout;
        all[2] = Handshake::Closed;
        let mut i = 0;
        while i < Refused::ALL.len() {
            all[3 + i] = Handshake::Failed(Refused::ALL[i]);
            i += 1;
        }
        all
    };

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
    pub fn result(self) -> HandshakeResult {
        match self {
            Handshake::Ok => HandshakeResult::Ok,
            Handshake::Timeout => HandshakeResult::Timeout,
            Handshake::Closed => HandshakeResult::Closed,
            Handshake::Failed(_) => HandshakeResult::Failed,
            Handshake::Asked => HandshakeResult::Shutdown,
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
/// close), then the connection as [`serve`](super::serve()) would, over TLS. `handshake` hears how the
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
    B: ServedBody,
{
    let (registered, track, accepted) = admit(&stream, registry, permit);
    let deadline = accepted + settings.timeouts.header;
    let accept = tokio::time::timeout_at(deadline, async move {
        if sends_plain_http(&stream).await {
            return Ok(Start::PlainHttp(stream));
        }
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        acceptor.accept(stream).await.map(Start::Tls)
    });
    let asked_to_close = track.asked_to_close();
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
            assert_eq!((h.result().name(), h.reason()), (result, reason), "{e:?}");
        }
    }
}
