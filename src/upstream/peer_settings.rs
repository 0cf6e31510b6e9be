//! What an HTTP/2 server allows its client: the `SETTINGS_MAX_CONCURRENT_STREAMS` of its
//! SETTINGS frames, read off the connection as hyper reads it. hyper keeps the value to
//! itself (a stream over it waits inside h2, on that connection, however many others
//! could take it); the pool needs it to know when a connection is full and another must
//! be opened.
//!
//! [`Watched`] passes every byte through unchanged and scans only the 9-byte frame
//! headers (RFC 9113 §4.1), skipping each payload by its length, and the 6-byte
//! parameters of SETTINGS frames (§6.5.1): a few integer steps per frame, nothing
//! buffered. The server's connection preface is a SETTINGS frame (§3.4): the first one
//! read says the connection is ready ([`PeerSettings::settled`]).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

use super::stream::Stream;

/// Frame type SETTINGS, and its ACK flag (RFC 9113 §6.5).
const SETTINGS: u8 = 0x4;
const ACK: u8 = 0x1;
/// `SETTINGS_MAX_CONCURRENT_STREAMS` (RFC 9113 §6.5.2).
const MAX_CONCURRENT_STREAMS: u16 = 0x3;

/// The server's settings the pool reads, shared between the connection's reader and the
/// requests choosing a connection.
#[derive(Default)]
pub(super) struct PeerSettings {
    /// Streams the server lets this client open at once: unlimited until it says (RFC
    /// 9113 §6.5.2's initial value).
    max_streams: AtomicU32,
    settled: AtomicBool,
    first: Notify,
}

impl PeerSettings {
    pub(super) fn new() -> Arc<PeerSettings> {
        Arc::new(PeerSettings {
            max_streams: AtomicU32::new(u32::MAX),
            ..PeerSettings::default()
        })
    }

    pub(super) fn max_streams(&self) -> u32 {
        self.max_streams.load(Relaxed)
    }

    /// Once the server's first SETTINGS frame has been read.
    pub(super) async fn settled(&self) {
        loop {
            let notified = self.first.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.settled.load(Relaxed) {
                return;
            }
            notified.await;
        }
    }

    fn set(&self, id: u16, value: u32) {
        if id == MAX_CONCURRENT_STREAMS {
            self.max_streams.store(value, Relaxed);
        }
    }

    fn frame_done(&self) {
        if !self.settled.swap(true, Relaxed) {
            self.first.notify_waiters();
        }
    }
}

/// Where the scan is in the byte stream from the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    /// Reading a frame header: this many of its 9 bytes so far.
    Header(usize),
    /// Skipping a payload of no interest: this many bytes left.
    Skip(u32),
    /// Inside a SETTINGS payload: this many bytes left, and this many of the current
    /// parameter's 6 so far.
    Settings(u32, usize),
}

/// The scanner: a frame header or a parameter being read, nothing more.
pub(super) struct Scan {
    at: At,
    head: [u8; 9],
    param: [u8; 6],
}

impl Scan {
    pub(super) fn new() -> Scan {
        Scan {
            at: At::Header(0),
            head: [0; 9],
            param: [0; 6],
        }
    }

    /// Scan the next `bytes` the server sent, telling `peer` what its SETTINGS say.
    pub(super) fn scan(&mut self, mut bytes: &[u8], peer: &PeerSettings) {
        while !bytes.is_empty() {
            match self.at {
                At::Header(have) => {
                    let take = (9 - have).min(bytes.len());
                    self.head[have..have + take].copy_from_slice(&bytes[..take]);
                    bytes = &bytes[take..];
                    if have + take < 9 {
                        self.at = At::Header(have + take);
                        continue;
                    }
                    let h = self.head;
                    let len = u32::from_be_bytes([0, h[0], h[1], h[2]]);
                    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                    let settings = h[3] == SETTINGS && h[4] & ACK == 0 && stream == 0;
                    self.at = match (settings, len) {
                        (true, 0) => {
                            peer.frame_done();
                            At::Header(0)
                        }
                        (true, n) => At::Settings(n, 0),
                        (false, 0) => At::Header(0),
                        (false, n) => At::Skip(n),
                    };
                }
                At::Skip(left) => {
                    let take = (left as usize).min(bytes.len());
                    bytes = &bytes[take..];
                    let left = left - take as u32;
                    self.at = if left == 0 {
                        At::Header(0)
                    } else {
                        At::Skip(left)
                    };
                }
                At::Settings(left, have) => {
                    let take = (6 - have).min(left as usize).min(bytes.len());
                    self.param[have..have + take].copy_from_slice(&bytes[..take]);
                    bytes = &bytes[take..];
                    let (left, have) = (left - take as u32, have + take);
                    if have == 6 {
                        let p = self.param;
                        let id = u16::from_be_bytes([p[0], p[1]]);
                        peer.set(id, u32::from_be_bytes([p[2], p[3], p[4], p[5]]));
                    }
                    self.at = match (left, have % 6) {
                        // A length not a multiple of 6 is h2's to refuse (FRAME_SIZE_ERROR).
                        (0, _) => {
                            peer.frame_done();
                            At::Header(0)
                        }
                        (left, have) => At::Settings(left, have),
                    };
                }
            }
        }
    }
}

/// A connection to an HTTP/2 server, its reads scanned for SETTINGS.
pub(super) struct Watched {
    io: Stream,
    scan: Scan,
    peer: Arc<PeerSettings>,
}

impl Watched {
    pub(super) fn new(io: Stream, peer: Arc<PeerSettings>) -> Watched {
        Watched {
            io,
            scan: Scan::new(),
            peer,
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            this.scan.scan(&buf.filled()[before..], &this.peer);
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame: its header (length, type, flags, stream) and payload.
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() as u32).to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn param(id: u16, value: u32) -> Vec<u8> {
        let mut p = id.to_be_bytes().to_vec();
        p.extend_from_slice(&value.to_be_bytes());
        p
    }

    #[test]
    fn max_concurrent_streams_is_read_across_any_split_and_updated() {
        let mut wire = Vec::new();
        let first = [param(0x4, 65_535), param(0x3, 2), param(0x5, 16_384)].concat();
        wire.extend(frame(SETTINGS, 0, 0, &first));
        // DATA and HEADERS frames are skipped whole, whatever their payload holds.
        wire.extend(frame(0x0, 0, 1, &frame(SETTINGS, 0, 0, &param(0x3, 99))));
        wire.extend(frame(SETTINGS, ACK, 0, &[]));
        let update = frame(SETTINGS, 0, 0, &param(0x3, 7));
        for step in 1..wire.len() + 1 {
            let peer = PeerSettings::new();
            let mut scan = Scan::new();
            assert_eq!(peer.max_streams(), u32::MAX, "unlimited until said");
            for piece in wire.chunks(step) {
                scan.scan(piece, &peer);
            }
            assert_eq!(peer.max_streams(), 2, "split every {step} bytes");
            assert!(peer.settled.load(Relaxed));
            scan.scan(&update, &peer);
            assert_eq!(peer.max_streams(), 7, "split every {step} bytes");
            assert_eq!(scan.at, At::Header(0));
        }
    }

    #[test]
    fn an_empty_settings_frame_settles_with_no_limit() {
        let peer = PeerSettings::new();
        Scan::new().scan(&frame(SETTINGS, 0, 0, &[]), &peer);
        assert!(peer.settled.load(Relaxed));
        assert_eq!(peer.max_streams(), u32::MAX);
    }
}
