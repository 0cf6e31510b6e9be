//! The clocks on a connection's silences: the client's stream wrapped so that each wait on
//! a read or a write runs against its deadline ([`Guarded`]), and the monotonic clock the
//! connections' idle times are kept on.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use super::head::{canned, head_bytes, Head, Scan};
use super::registry::{Closed, Registered};
use super::serve::CLOSE_GRACE;
use super::track::{Track, CLOSE_MAKE_ROOM};
use super::Settings;

/// The clock connections' idle times are kept on: its start.
fn clock_start() -> std::time::Instant {
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    *START.get_or_init(std::time::Instant::now)
}

/// Milliseconds since [`clock_start`].
pub(super) fn clock_ms() -> u64 {
    clock_start().elapsed().as_millis() as u64
}

/// The moment `ms` milliseconds after [`clock_start`], for a timer.
pub(super) fn clock_instant(ms: u64) -> Instant {
    Instant::from_std(clock_start()) + Duration::from_millis(ms)
}

/// The client's stream, with the clocks of [the connection module](super) on its reads and writes.
/// Bytes read before the protocol was known come first.
pub(super) struct Guarded<IO> {
    pub(super) prefix: Bytes,
    pub(super) io: IO,
    pub(super) track: Arc<Track>,
    /// The connection's place in its registry, given back when the stream is dropped: when
    /// hyper is done with it, or, for an upgraded connection, when its tunnel ends.
    pub(super) _registered: Registered,
    pub(super) settings: Settings,
    pub(super) h2: bool,
    /// HTTP/1: the head being read, if its first byte came.
    pub(super) head: Option<Head>,
    /// HTTP/1: how far the head being read has been scanned.
    pub(super) scan: Scan,
    pub(super) read_timer: Option<(Instant, Pin<Box<Sleep>>)>,
    /// Since when writes have made no progress, and the timer on it.
    pub(super) write_stalled: Option<Instant>,
    pub(super) write_timer: Option<(Instant, Pin<Box<Sleep>>)>,
    /// HTTP/2: when the idle connection was asked to go away.
    pub(super) goaway_at: Option<Instant>,
}

/// Whether `deadline` has passed, with a timer to wake the task at it. The timer is moved
/// only to an earlier time: a deadline that moves later (every request moves the idle one)
/// lets the armed timer fire early, and it is re-armed then — not reset per request.
pub(crate) fn expired(
    timer: &mut Option<(Instant, Pin<Box<Sleep>>)>,
    deadline: Instant,
    cx: &mut Context<'_>,
) -> bool {
    let (at, sleep) =
        timer.get_or_insert_with(|| (deadline, Box::pin(tokio::time::sleep_until(deadline))));
    if deadline < *at {
        *at = deadline;
        sleep.as_mut().reset(deadline);
    }
    if sleep.as_mut().poll(cx).is_pending() {
        return false;
    }
    if *at >= deadline {
        return true;
    }
    // It fired for an earlier deadline: wait for this one.
    *at = deadline;
    sleep.as_mut().reset(deadline);
    sleep.as_mut().poll(cx).is_ready()
}

impl<IO: AsyncRead + AsyncWrite + Unpin> Guarded<IO> {
    /// Nothing to read while a request is in flight: watch what the client owes it (over
    /// HTTP/2, taking the answer), and keep the idle clock armed for when it is done.
    fn pending_busy(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Once the answer is done, hyper may not read again until the client writes: this
        // is then the connection's last word on what wakes it, so a request to close (to
        // make room, or shutting down) must find this task.
        self.track.reader.register(cx.waker());
        // HTTP/2: an answer the client has taken nothing of for body_timeout
        // ends the connection (HTTP/1's blocks a write: `written`).
        let since = match self.h2 {
            true => self.track.oldest_awaiting(),
            false => None,
        };
        if let Some(since) = since {
            let deadline = clock_instant(since) + self.settings.timeouts.body;
            if expired(&mut self.read_timer, deadline, cx) {
                self.track.closed(Closed::SendTimeout);
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client took nothing of an answer for body_timeout",
                )));
            }
        } else {
            // The idle clock, armed ahead: once the answer is done, hyper does
            // not read again until the client writes, so this timer (due no
            // later than the idle deadline to come) is what wakes the
            // connection to start it. Re-armed only when it fires.
            let idle = self.settings.timeouts.idle;
            match &self.read_timer {
                None => {
                    let since = self.track.idle_since_ms.load(Relaxed);
                    let _ = expired(&mut self.read_timer, clock_instant(since) + idle, cx);
                }
                // It came while the answer was still going (a long request): a
                // full idle period from now, so that one is still armed.
                Some((_, sleep)) if sleep.is_elapsed() => {
                    let _ = expired(&mut self.read_timer, Instant::now() + idle, cx);
                }
                // Armed, for this task: nothing to do per request.
                Some(_) => {}
            }
        }
        Poll::Pending
    }

    /// Nothing to read and nothing in flight: the connection's clocks (header, idle, a
    /// close request's grace) run.
    fn pending_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.track.reader.register(cx.waker());
        if self.h2 {
            if let Some(at) = self.goaway_at {
                if expired(&mut self.read_timer, at + CLOSE_GRACE, cx) {
                    return Poll::Ready(Ok(()));
                }
                return Poll::Pending;
            }
        }
        let (deadline, why) = self.deadline();
        if !expired(&mut self.read_timer, deadline, cx) {
            return Poll::Pending;
        }
        match (why, self.current_head(), self.h2) {
            (Closed::HeaderTimeout, Some(_), false) => self.refuse(408, Some(why)),
            (_, _, true) => {
                // GOAWAY first: the connection's task sees the close request.
                self.track.closed(why);
                self.goaway_at = Some(Instant::now());
                self.track.close.fetch_max(CLOSE_MAKE_ROOM, Relaxed);
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            _ => {
                self.track.closed(why);
                Poll::Ready(Ok(()))
            }
        }
    }

    /// The head being read now (HTTP/1), if its first byte came since the last request.
    fn current_head(&self) -> Option<Head> {
        self.head
            .filter(|h| h.request == self.track.started.load(Relaxed))
    }

    /// When the silence the connection is in now ends it, and why. Only while nothing is
    /// in flight: then the client owes the next request.
    fn deadline(&mut self) -> (Instant, Closed) {
        let request = self.track.started.load(Relaxed);
        match self.head.as_mut().filter(|h| h.request == request) {
            Some(h) => (
                *h.since.get_or_insert_with(Instant::now) + self.settings.timeouts.header,
                Closed::HeaderTimeout,
            ),
            None => {
                let since = clock_instant(self.track.idle_since_ms.load(Relaxed));
                (since + self.settings.timeouts.idle, Closed::IdleTimeout)
            }
        }
    }

    /// Answer `status` and end the connection (a best-effort write: a few hundred bytes
    /// into an idle socket's buffer). `why`: the clock that ran out, if one did.
    fn refuse(&mut self, status: u16, why: Option<Closed>) -> Poll<io::Result<()>> {
        if let Some(why) = why {
            self.track.closed(why);
        }
        try_write(&mut self.io, &canned(status));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("request head refused with {status}"),
        )))
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for Guarded<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let idle = this.track.idle();
        if idle && !this.h2 && this.track.close.load(Relaxed) != 0 {
            // Asked to close, with nothing in flight (between requests, or part way through
            // a head): the end of the stream. (HTTP/2 is shut down with a GOAWAY by the
            // connection's task.)
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = if this.prefix.is_empty() {
            read_flushing(&mut this.io, cx, buf)
        } else {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            Poll::Ready(Ok(()))
        };
        match polled {
            Poll::Ready(Ok(())) => {
                let got = &buf.filled()[before..];
                if idle && !this.h2 && !got.is_empty() {
                    let bare_cr = head_bytes(&mut this.head, &mut this.scan, &this.track, got);
                    if bare_cr.is_err() {
                        return this.refuse(400, None);
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if idle => this.pending_idle(cx),
            Poll::Pending => this.pending_busy(cx),
            other => other,
        }
    }
}

impl<IO> Guarded<IO> {
    /// A write's outcome, through the send clock: a client that takes nothing for
    /// `body_timeout` is cut off.
    fn written<T>(
        &mut self,
        polled: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.write_stalled = None;
            return polled;
        }
        let since = *self.write_stalled.get_or_insert_with(Instant::now);
        if expired(
            &mut self.write_timer,
            since + self.settings.timeouts.body,
            cx,
        ) {
            self.track.closed(Closed::SendTimeout);
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took nothing of the response for body_timeout",
            )));
        }
        Poll::Pending
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Guarded<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.written(polled, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.written(polled, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.written(polled, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A read of `io` that, when nothing has come, sends what the protocol below queued to
/// send while reading: over TLS 1.2, the `no_renegotiation` alert rustls answers a
/// renegotiation ClientHello with. tokio-rustls writes it only with the next write, and
/// nothing else is written while the client waits for its new handshake: without this it
/// would hang until a clock ran out. (A no-op on TCP.)
pub(super) fn read_flushing<IO: AsyncRead + AsyncWrite + Unpin>(
    io: &mut IO,
    cx: &mut Context<'_>,
    buf: &mut ReadBuf<'_>,
) -> Poll<io::Result<()>> {
    let polled = Pin::new(&mut *io).poll_read(cx, buf);
    if polled.is_pending() {
        let _ = Pin::new(io).poll_flush(cx);
    }
    polled
}

/// Write `bytes` if the stream takes them now, without waiting: a best effort, for the
/// last words of a connection about to be closed (over TLS, rustls takes them whole into
/// its buffer and sends what the socket takes).
pub(super) fn try_write<IO: AsyncWrite + Unpin>(stream: &mut IO, bytes: &[u8]) {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut written = 0;
    while written < bytes.len() {
        match Pin::new(&mut *stream).poll_write(&mut cx, &bytes[written..]) {
            Poll::Ready(Ok(n)) if n > 0 => written += n,
            _ => break,
        }
    }
    let _ = Pin::new(stream).poll_flush(&mut cx);
}
