//! A connection to the upstream: plain TCP, or TLS over it (an `https://` upstream). One
//! enum rather than a generic client: the pool, the exchange and the body reader are the
//! same code for both, and the cleartext path pays one `match` for it, no allocation and
//! no indirection (the TLS state, large, is boxed so that the enum stays small).
//!
//! Writes to a TLS connection may stay in rustls' buffer until flushed: whoever writes a
//! request, or a piece of its body, flushes after it (a no-op on plain TCP).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, ReadHalf, WriteHalf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

pub(super) type Tls = Box<TlsStream<TcpStream>>;

pub(super) enum Stream {
    Plain(TcpStream),
    Tls(Tls),
}

/// The read side of a connection split for a full-duplex exchange.
pub(super) enum ReadSide {
    Plain(OwnedReadHalf),
    Tls(ReadHalf<Tls>),
}

/// The write side of a connection split for a full-duplex exchange.
pub(super) enum WriteSide {
    Plain(OwnedWriteHalf),
    Tls(WriteHalf<Tls>),
}

impl Stream {
    /// Whether TLS' ALPN agreed on HTTP/2 (`h2`); never for plain TCP, where HTTP/2 is
    /// spoken by prior knowledge (`h2c`) or not at all.
    pub(super) fn alpn_h2(&self) -> bool {
        match self {
            Stream::Plain(_) => false,
            Stream::Tls(tls) => tls.get_ref().1.alpn_protocol() == Some(b"h2"),
        }
    }

    /// Split for a request whose body goes up while the answer is read. Plain TCP splits
    /// without a lock; a TLS session is one state both ways, shared behind tokio's.
    pub(super) fn split(self) -> (ReadSide, WriteSide) {
        match self {
            Stream::Plain(tcp) => {
                let (r, w) = tcp.into_split();
                (ReadSide::Plain(r), WriteSide::Plain(w))
            }
            Stream::Tls(tls) => {
                let (r, w) = tokio::io::split(tls);
                (ReadSide::Tls(r), WriteSide::Tls(w))
            }
        }
    }
}

impl ReadSide {
    /// The whole connection again, or the read side back when `w` is not its other half.
    pub(super) fn reunite(self, w: WriteSide) -> Result<Stream, ReadSide> {
        match (self, w) {
            (ReadSide::Plain(r), WriteSide::Plain(w)) => match r.reunite(w) {
                Ok(tcp) => Ok(Stream::Plain(tcp)),
                Err(e) => Err(ReadSide::Plain(e.0)),
            },
            (ReadSide::Tls(r), WriteSide::Tls(w)) if r.is_pair_of(&w) => {
                Ok(Stream::Tls(r.unsplit(w)))
            }
            (r, _) => Err(r),
        }
    }
}

/// `AsyncRead` by delegation to each variant.
macro_rules! delegate_read {
    ($ty:ident) => {
        impl AsyncRead for $ty {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $ty::Plain(s) => Pin::new(s).poll_read(cx, buf),
                    $ty::Tls(s) => Pin::new(s).poll_read(cx, buf),
                }
            }
        }
    };
}

delegate_read!(Stream);
delegate_read!(ReadSide);

/// `AsyncWrite` by delegation to each variant, vectored writes included (a chunk's size
/// line, data and CRLF go in one).
macro_rules! delegate_write {
    ($ty:ident) => {
        impl AsyncWrite for $ty {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $ty::Plain(s) => Pin::new(s).poll_write(cx, buf),
                    $ty::Tls(s) => Pin::new(s).poll_write(cx, buf),
                }
            }

            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $ty::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
                    $ty::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
                }
            }

            fn is_write_vectored(&self) -> bool {
                match self {
                    $ty::Plain(s) => s.is_write_vectored(),
                    $ty::Tls(s) => s.is_write_vectored(),
                }
            }

            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $ty::Plain(s) => Pin::new(s).poll_flush(cx),
                    $ty::Tls(s) => Pin::new(s).poll_flush(cx),
                }
            }

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $ty::Plain(s) => Pin::new(s).poll_shutdown(cx),
                    $ty::Tls(s) => Pin::new(s).poll_shutdown(cx),
                }
            }
        }
    };
}

delegate_write!(Stream);
delegate_write!(WriteSide);
