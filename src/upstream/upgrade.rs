//! Upgrades: a request that asks to switch protocols (HTTP/1.1 `Connection: upgrade` with
//! `Upgrade`, RFC 9110 §7.8; or HTTP/2's extended CONNECT, RFC 8441) goes up as an
//! HTTP/1.1 upgrade on a connection of its own, never a kept one; after the backend's
//! `101` that connection is the tunnel's ([`Upgraded`], handed over in the answer's
//! extensions as [`Switched`]) and never returns to the pool. An answer other than `101`
//! is an ordinary answer, with its body.
//!
//! `h2c` is never asked for on a client's behalf (dropped from `Upgrade`): an HTTP/2
//! connection tunnelled through the gateway would carry requests no rule sees ("h2c
//! smuggling"). A request whose only offer is `h2c` goes up as an ordinary request.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use http::header::{HeaderValue, CONNECTION, UPGRADE};
use http::{Method, Response, StatusCode, Version};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::body::{Http1Body, ResponseBody};
use super::head::{self, Answer};
use super::{Client, Downstream, Error, Malformed, Outbound, Stream};

static SEC_WEBSOCKET_KEY: http::HeaderName = http::HeaderName::from_static("sec-websocket-key");
static SEC_WEBSOCKET_ACCEPT: http::HeaderName =
    http::HeaderName::from_static("sec-websocket-accept");

/// What a client's request asks to upgrade to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upgrade {
    /// The `Upgrade` sent up (the client's offers, `h2c` left out), e.g. `websocket`.
    pub protocol: HeaderValue,
    /// Asked by HTTP/2's extended CONNECT (RFC 8441): the client is answered `200`, not
    /// `101`, and its WebSocket handshake has no key (the gateway makes one for the
    /// backend).
    pub extended: bool,
    /// Whether it is a WebSocket (`websocket`): its frames can be read and counted.
    pub websocket: bool,
}

impl Upgrade {
    /// What `parts` asks to upgrade to, if anything. HTTP/1.1: `Connection` lists
    /// `upgrade` and `Upgrade` offers a protocol other than `h2c`, on a request without a
    /// body (`bodiless`). HTTP/2: a CONNECT with `:protocol` (which hyper accepts only
    /// where the gateway enabled extended CONNECT).
    pub fn asked(parts: &http::request::Parts, bodiless: bool) -> Option<Upgrade> {
        if parts.version == Version::HTTP_2 {
            if parts.method != Method::CONNECT {
                return None;
            }
            let protocol = parts.extensions.get::<hyper::ext::Protocol>()?;
            let protocol = HeaderValue::from_str(protocol.as_str()).ok()?;
            let websocket = protocol.as_bytes().eq_ignore_ascii_case(b"websocket");
            return Some(Upgrade {
                protocol,
                extended: true,
                websocket,
            });
        }
        if parts.version != Version::HTTP_11
            || !bodiless
            || !super::forward::carries(&parts.headers, &CONNECTION)
        {
            return None;
        }
        let asks = parts
            .headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
        if !asks {
            return None;
        }
        let offers: Vec<&str> = parts
            .headers
            .get_all(UPGRADE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|p| !p.is_empty() && !p.eq_ignore_ascii_case("h2c"))
            .collect();
        if offers.is_empty() {
            return None;
        }
        let websocket = offers.iter().any(|p| p.eq_ignore_ascii_case("websocket"));
        let protocol = HeaderValue::from_str(&offers.join(", ")).ok()?;
        Some(Upgrade {
            protocol,
            extended: false,
            websocket,
        })
    }

    /// Whether `answered` (the `Upgrade` of a 101) is one of the protocols asked for.
    fn offered(&self, answered: &HeaderValue) -> bool {
        let Ok(answered) = answered.to_str() else {
            return false;
        };
        let answered = answered.trim();
        // A protocol may carry a version (`websocket`, `foo/2`): compared whole.
        self.protocol
            .to_str()
            .unwrap_or("")
            .split(',')
            .any(|p| p.trim().eq_ignore_ascii_case(answered))
    }
}

impl Outbound {
    /// Make this request the HTTP/1.1 upgrade `upgrade` asks for: an extended CONNECT goes
    /// up as a `GET`, with a `Sec-WebSocket-Key` of the gateway's for a WebSocket (RFC
    /// 8441 §5: the HTTP/2 client sends none).
    pub fn upgrading(&mut self, upgrade: Upgrade) {
        if upgrade.extended {
            self.parts.method = Method::GET;
            self.parts.version = Version::HTTP_11;
            if upgrade.websocket && !self.parts.headers.contains_key(&SEC_WEBSOCKET_KEY) {
                self.parts
                    .headers
                    .insert(SEC_WEBSOCKET_KEY.clone(), websocket_key());
            }
        }
        self.upgrade = Some(upgrade);
    }

    /// Whether this request asks to upgrade (it goes HTTP/1.1, whatever its pool speaks).
    pub fn is_upgrade(&self) -> bool {
        self.upgrade.is_some()
    }
}

/// A random `Sec-WebSocket-Key`: 16 bytes, base64 (RFC 6455 §4.1). A nonce, not a secret.
fn websocket_key() -> HeaderValue {
    let mut bytes = [0u8; 16];
    for half in bytes.chunks_mut(8) {
        half.copy_from_slice(&crate::random::bits().to_le_bytes());
    }
    HeaderValue::from_str(&base64(&bytes)).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Standard base64 with padding.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> shift) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The upstream connection a `101` switched, with the bytes the backend sent past its
/// head: the tunnel's, read and written like any stream.
pub struct Upgraded {
    stream: Stream,
    early: BytesMut,
}

impl AsyncRead for Upgraded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.early.is_empty() {
            let n = this.early.len().min(buf.remaining());
            buf.put_slice(&this.early[..n]);
            this.early.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Upgraded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// A `101`'s connection in its answer's extensions, to be taken once by the tunnel (an
/// extension must be `Clone`: the clones share the one connection).
#[derive(Clone)]
pub struct Switched(Arc<Mutex<Option<Upgraded>>>);

impl Switched {
    /// The switched connection, the first time it is asked for.
    pub fn take(&self) -> Option<Upgraded> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl Client {
    /// One attempt at an upgrade: its head (with `Connection: upgrade` and the `Upgrade`
    /// asked for) on a new connection, and the answer's head within `timeout`. A `101` that
    /// switches to a protocol asked for comes back with an empty body and its connection
    /// in [`Switched`]; any other answer as usual (its connection is not kept).
    pub(super) async fn upgrade(
        &self,
        out: &mut Outbound,
        down: &Downstream<'_>,
    ) -> Result<Response<ResponseBody>, Error> {
        let Some(upgrade) = out.upgrade.clone() else {
            return Err(Error::Closed { replayable: false });
        };
        if out.default_host {
            out.parts
                .headers
                .insert(http::header::HOST, self.authority.clone());
        }
        let mut bytes = head::request(
            &out.parts,
            &self.base_path,
            false,
            down,
            out.asked.as_ref(),
            out.target.as_deref(),
        )?;
        // The head ends with an empty line: the upgrade's fields go before it.
        bytes.truncate(bytes.len().saturating_sub(2));
        head::field_line(&mut bytes, "connection", &[b"upgrade"]);
        head::field_line(&mut bytes, "upgrade", &[upgrade.protocol.as_bytes()]);
        bytes.extend_from_slice(b"\r\n");
        let replayable = out.parts.method.is_idempotent();
        let mut conn = self.open(super::tls::Alpn::Http1).await?.0;
        out.sending_now();
        let exchange = async {
            let written = match conn.write_all(&bytes).await {
                Ok(()) => conn.flush().await,
                e => e,
            };
            written.map_err(|source| Error::Write { source, replayable })?;
            head::read_as(&mut conn, false, replayable, true).await
        };
        let answer = tokio::time::timeout(self.timeout, exchange)
            .await
            .unwrap_or(Err(Error::Timeout(self.timeout)))?;
        match answer {
            Answer::Switched(mut parts, early) => {
                let switched_to = parts.headers.get(UPGRADE).cloned();
                if !switched_to.is_some_and(|p| upgrade.offered(&p)) {
                    return Err(Malformed::SwitchedProtocols.into());
                }
                if upgrade.extended {
                    // RFC 8441 §5: the HTTP/2 client is answered 200, without the accept
                    // of a key it never sent, nor the HTTP/1.1 upgrade's own fields.
                    parts.status = StatusCode::OK;
                    parts.headers.remove(UPGRADE);
                    parts.headers.remove(&SEC_WEBSOCKET_ACCEPT);
                } else {
                    parts
                        .headers
                        .insert(CONNECTION, HeaderValue::from_static("upgrade"));
                }
                let io = Upgraded {
                    stream: conn,
                    early,
                };
                parts
                    .extensions
                    .insert(Switched(Arc::new(Mutex::new(Some(io)))));
                Ok(Response::from_parts(parts, Http1Body::none(&self.kept)))
            }
            Answer::Final(mut parts, buf, framing) => {
                // Declined: an ordinary answer, whose connection goes no further.
                parts.extensions.insert(head::Close);
                let resp = Http1Body::answer(
                    parts,
                    super::body::Conn::Whole(conn),
                    None,
                    buf,
                    framing,
                    &self.kept,
                );
                head::pass_codings(resp, out.parts.version)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(req: http::request::Builder) -> http::request::Parts {
        req.body(()).unwrap().into_parts().0
    }

    #[test]
    fn base64_is_standard_with_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        // RFC 6455 §1.3's example nonce.
        assert_eq!(base64(b"the sample nonce"), "dGhlIHNhbXBsZSBub25jZQ==");
        assert_eq!(websocket_key().len(), 24);
    }

    #[test]
    fn an_upgrade_is_asked_by_connection_and_upgrade_without_a_body() {
        let ws = || {
            http::Request::get("/chat")
                .header("connection", "keep-alive, Upgrade")
                .header("upgrade", "websocket")
        };
        let asked = Upgrade::asked(&parts(ws()), true).expect("asked");
        assert!(asked.websocket && !asked.extended);
        assert_eq!(asked.protocol, "websocket");
        // With a body, or without `Connection: upgrade`, it is an ordinary request.
        assert_eq!(Upgrade::asked(&parts(ws()), false), None);
        let no_connection = http::Request::get("/").header("upgrade", "websocket");
        assert_eq!(Upgrade::asked(&parts(no_connection), true), None);
        // h2c is never asked for: alone, no upgrade; among others, left out.
        let h2c = http::Request::get("/")
            .header("connection", "upgrade, http2-settings")
            .header("upgrade", "h2c");
        assert_eq!(Upgrade::asked(&parts(h2c), true), None);
        let mixed = http::Request::get("/")
            .header("connection", "upgrade")
            .header("upgrade", "H2C, foo/2");
        let asked = Upgrade::asked(&parts(mixed), true).expect("foo/2 asked");
        assert_eq!(asked.protocol, "foo/2");
        assert!(!asked.websocket);
        assert!(asked.offered(&HeaderValue::from_static("FOO/2")));
        assert!(!asked.offered(&HeaderValue::from_static("h2c")));
        // HTTP/1.0 has no upgrade.
        let old = ws().version(Version::HTTP_10);
        assert_eq!(Upgrade::asked(&parts(old), true), None);
    }

    #[test]
    fn an_extended_connect_is_an_upgrade_and_a_plain_connect_is_not() {
        let connect = || {
            http::Request::connect("https://example.test/chat")
                .version(Version::HTTP_2)
                .body(())
                .unwrap()
        };
        assert_eq!(Upgrade::asked(&connect().into_parts().0, false), None);
        let mut req = connect();
        req.extensions_mut()
            .insert(hyper::ext::Protocol::from_static("websocket"));
        let asked = Upgrade::asked(&req.into_parts().0, false).expect("asked");
        assert!(asked.extended && asked.websocket);
    }
}
