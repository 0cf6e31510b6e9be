//! Which protocol a client speaks, told from its first bytes: the HTTP/2 preface and
//! SETTINGS, or the start of an HTTP/1 head.

use std::io;
use std::task::Poll;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::clocks::{read_flushing, try_write};
use super::head::canned;
use super::registry::Closed;
use super::track::Track;

/// HTTP/2's connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A SETTINGS frame larger than the default frame size is refused by the HTTP/2 side; the
/// preface reader hands it over without waiting for it.
const MAX_SETTINGS: usize = 16_384;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Proto {
    H1,
    H2,
}

/// Read until the protocol is known: HTTP/2 once the preface and the client's first
/// SETTINGS frame are in, HTTP/1 at the first byte that is not the preface's. `None`: the
/// client closed first. Read through [`read_flushing`]: a TLS client may ask to
/// renegotiate before it says anything.
async fn preface<IO: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut IO,
    buf: &mut BytesMut,
) -> io::Result<Option<Proto>> {
    loop {
        let n = buf.len().min(PREFACE.len());
        if buf[..n] != PREFACE[..n] {
            return Ok(Some(Proto::H1));
        }
        if buf.len() >= PREFACE.len() + 9 {
            let f = &buf[PREFACE.len()..];
            let length = (usize::from(f[0]) << 16) | (usize::from(f[1]) << 8) | usize::from(f[2]);
            // Not SETTINGS, or too large to wait for: HTTP/2 will refuse it.
            if f[3] != 0x4 || length > MAX_SETTINGS || f.len() >= 9 + length {
                return Ok(Some(Proto::H2));
            }
        }
        let mut chunk = [0u8; 2048];
        let n = std::future::poll_fn(|cx| {
            let mut read = ReadBuf::new(&mut chunk);
            match read_flushing(&mut *stream, cx, &mut read) {
                Poll::Ready(Ok(())) => Poll::Ready(Ok(read.filled().len())),
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            }
        })
        .await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Which protocol the client speaks, and the bytes read to tell: the HTTP/2 preface, or
/// the start of an HTTP/1 head, by `header_deadline`. `None`: the connection is over (the
/// client closed or stayed silent, or it was asked to close before saying anything whole).
pub(super) async fn opening<IO: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut IO,
    track: &Track,
    header_deadline: Instant,
) -> Option<(Proto, BytesMut)> {
    let mut prefix = BytesMut::with_capacity(1024);
    let read = tokio::time::timeout_at(header_deadline, preface(stream, &mut prefix));
    let asked_to_close = track.asked_to_close();
    tokio::select! {
        read = read => match read {
            Ok(Ok(Some(proto))) => Some((proto, prefix)),
            // The client closed, or the read failed: nothing to answer.
            Ok(Ok(None) | Err(_)) => None,
            Err(_) => {
                track.closed(Closed::HeaderTimeout);
                // Some of a head, but not the whole HTTP/2 preface: an HTTP/1 head started.
                if !prefix.is_empty() && prefix.len() < PREFACE.len() {
                    try_write(stream, &canned(408));
                }
                None
            }
        },
        // To make room, or shutting down: a connection that has said nothing whole yet.
        () = asked_to_close => None,
    }
}
