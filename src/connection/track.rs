//! One connection's state ([`Track`]), shared by its I/O, its requests and the registry;
//! a request in flight on it ([`InFlight`]) and the answer's body that holds it
//! ([`Tracked`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use atomic_waker::AtomicWaker;
use hyper::body::{Body, Frame, SizeHint};

use super::clocks::clock_ms;
use super::registry::Closed;

/// One connection's state, shared by its I/O, its requests and the registry.
pub struct Track {
    pub(super) id: u64,
    /// Requests whose answer is not yet over.
    pub(super) in_flight: AtomicU32,
    /// Requests started on this connection (a request head seen before the last start
    /// belongs to an earlier request).
    pub(super) started: AtomicU64,
    /// When the connection last had nothing in flight (ms on [`clock_ms`]).
    pub(super) idle_since_ms: AtomicU64,
    /// Asked to close: 1 to make room (once idle), 2 to shut down (after what is in flight).
    pub(super) close: AtomicU8,
    /// The reason the gateway closed it, once: 0 for none yet, else its place in
    /// [`Closed::ALL`] plus one.
    closed_by: AtomicU8,
    /// Wakes the connection's task where it waits to read the next request: an idle
    /// connection asked to close sees it at once; a busy one when its task next runs (its
    /// answer's progress), which is soon enough for a shutdown that waits for it anyway.
    pub(super) reader: AtomicWaker,
    /// HTTP/2: answers whose next bytes are the client's to take, and since when (ms on
    /// [`clock_ms`]), by answer number. A client that takes nothing (a flow-control
    /// window left at 0) blocks no socket write, so only this shows it.
    pub(super) awaiting: Mutex<Vec<(u64, u64)>>,
    pub(super) next_answer: AtomicU64,
    /// Upgraded streams (tunnels) open on it: an HTTP/1.1 connection has at most one, an
    /// HTTP/2 connection one per extended CONNECT stream.
    tunnels: AtomicU32,
    /// Tells its tunnels that the shutdown grace is over ([`CLOSE_NOW`]).
    now: tokio::sync::Notify,
}

pub(super) const CLOSE_MAKE_ROOM: u8 = 1;
pub(super) const CLOSE_SHUTDOWN: u8 = 2;
/// The shutdown grace is over: its tunnels close now (requests are not waited for either).
pub(super) const CLOSE_NOW: u8 = 3;

impl Track {
    pub(super) fn new(id: u64) -> Track {
        Track {
            id,
            in_flight: AtomicU32::new(0),
            started: AtomicU64::new(0),
            idle_since_ms: AtomicU64::new(clock_ms()),
            close: AtomicU8::new(0),
            closed_by: AtomicU8::new(0),
            reader: AtomicWaker::new(),
            awaiting: Mutex::new(Vec::new()),
            next_answer: AtomicU64::new(0),
            tunnels: AtomicU32::new(0),
            now: tokio::sync::Notify::new(),
        }
    }

    /// Hold the connection for a tunnel over one of its streams (an upgrade): the
    /// connection counts as busy until the hold is dropped — no idle clock, no request
    /// head looked for in what the client sends — and the hold learns when the shutdown
    /// grace is over ([`Hold::closing`]).
    pub fn hold(self: &Arc<Self>) -> Hold {
        self.tunnels.fetch_add(1, Relaxed);
        Hold {
            _request: InFlight::new(self),
            track: self.clone(),
        }
    }

    /// Whether a tunnel is open on it.
    pub(super) fn tunnelled(&self) -> bool {
        self.tunnels.load(Relaxed) > 0
    }

    fn awaiting(&self) -> std::sync::MutexGuard<'_, Vec<(u64, u64)>> {
        self.awaiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Answer `n`'s next bytes wait for the client (from now), or (`false`) do not.
    pub(super) fn await_pull(&self, n: u64, waiting: bool) {
        let mut awaiting = self.awaiting();
        awaiting.retain(|(m, _)| *m != n);
        if waiting {
            awaiting.push((n, clock_ms()));
            drop(awaiting);
            // The connection's task arms its clock for it when it next waits to read.
            self.reader.wake();
        }
    }

    /// Since when the answer waiting longest for the client has waited, if one does.
    pub(super) fn oldest_awaiting(&self) -> Option<u64> {
        self.awaiting().iter().map(|(_, since)| *since).min()
    }

    pub(super) fn idle(&self) -> bool {
        self.in_flight.load(Relaxed) == 0
    }

    /// Remember why the gateway closed the connection (the first reason given).
    pub fn closed(&self, why: Closed) {
        let _ = self
            .closed_by
            .compare_exchange(0, why as u8 + 1, Relaxed, Relaxed);
    }

    /// Why the gateway closed the connection, if it did.
    pub(super) fn closed_by(&self) -> Option<Closed> {
        let at = self.closed_by.load(Relaxed).checked_sub(1)?;
        Closed::ALL.get(usize::from(at)).copied()
    }

    /// Resolves once the connection is asked to close (to make room, or shutting down):
    /// what a connection that has not started serving yet waits on beside its start.
    pub(super) async fn asked_to_close(&self) {
        std::future::poll_fn(|cx| {
            self.reader.register(cx.waker());
            if self.close.load(Relaxed) != 0 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }

    pub(super) fn ask_to_close(&self, how: u8) {
        self.close.fetch_max(how, Relaxed);
        self.reader.wake();
        if how >= CLOSE_NOW {
            self.now.notify_waiters();
        }
    }
}

/// A tunnel's hold on its connection ([`Track::hold`]).
pub struct Hold {
    _request: InFlight,
    track: Arc<Track>,
}

impl Hold {
    /// A hold on a connection of its own, for a tunnel served outside any listener (tests).
    pub fn detached() -> Hold {
        Arc::new(Track::new(0)).hold()
    }

    /// Resolves once the shutdown grace is over: the tunnel is to close now.
    pub async fn closing(&self) {
        loop {
            // Registered before the check: a notice between the two is not missed.
            let notified = self.track.now.notified();
            if self.track.close.load(Relaxed) >= CLOSE_NOW {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.track.tunnels.fetch_sub(1, Relaxed);
    }
}

/// A request in flight on a connection, from its head to the end of its answer (the
/// answer's body holds it: [`Tracked`]).
pub struct InFlight(Arc<Track>);

impl InFlight {
    pub fn new(track: &Arc<Track>) -> InFlight {
        track.started.fetch_add(1, Relaxed);
        track.in_flight.fetch_add(1, Relaxed);
        InFlight(track.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Relaxed) == 1 {
            self.0.idle_since_ms.store(clock_ms(), Relaxed);
            // A connection asked to make room closes once idle: wake its reader to see it.
            if self.0.close.load(Relaxed) != 0 {
                self.0.reader.wake();
            }
        }
    }
}

/// An answer's body, holding its request's [`InFlight`] until the body is done with. Over
/// HTTP/2 it also tells the connection while its next bytes wait for the client to take
/// them (see `Track::await_pull`).
pub struct Tracked<B> {
    body: B,
    request: InFlight,
    /// HTTP/2: this answer's number on its connection.
    pulled: Option<u64>,
}

impl<B> Tracked<B> {
    /// `http2`: the answer goes out on an HTTP/2 stream.
    pub fn new(body: B, request: InFlight, http2: bool) -> Tracked<B> {
        let pulled = http2.then(|| {
            let n = request.0.next_answer.fetch_add(1, Relaxed);
            request.0.await_pull(n, true);
            n
        });
        Tracked {
            body,
            request,
            pulled,
        }
    }
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Some(n) = self.pulled {
            // A frame handed on: the next one is the client's to take. Pending: it waits on
            // the upstream (whose clock is the upstream hop's); the end: nothing waits.
            let waiting = matches!(polled, Poll::Ready(Some(Ok(_)))) && !self.body.is_end_stream();
            self.request.0.await_pull(n, waiting);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B> Drop for Tracked<B> {
    fn drop(&mut self) {
        if let Some(n) = self.pulled {
            self.request.0.await_pull(n, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first reason given is the one kept, whichever it is; none given, none kept.
    #[test]
    fn a_track_keeps_the_first_reason_it_was_closed_for() {
        assert_eq!(Track::new(1).closed_by(), None);
        for why in Closed::ALL {
            let track = Track::new(1);
            track.closed(why);
            track.closed(Closed::MakeRoom);
            assert_eq!(track.closed_by(), Some(why));
        }
    }
}
