//! Every open connection of a listener ([`Registry`]), the bound on their number, and
//! why the gateway closed one ([`Closed`]).

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::clocks::clock_ms;
use super::metrics::ListenerMetrics;
use super::track::{Track, CLOSE_MAKE_ROOM, CLOSE_NOW, CLOSE_SHUTDOWN};

/// After the shutdown grace, how long tunnels get to send their close frames and end.
const TUNNEL_CLOSE: Duration = Duration::from_secs(1);

/// Connections closed at once to make room at `max_connections`, at most: one per 256 of
/// the bound (a search of the open connections finds a batch, as nginx drains up to 32).
const MAKE_ROOM_BATCH: usize = 16;
/// How long an accept loop backs off after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// At most one warning per this long for a full listener or failing accepts.
const WARN_EVERY: Duration = Duration::from_secs(10);

crate::telemetry::label_enum! {
    /// Why the gateway closed a connection, as `ratewall_connections_closed_total` counts it.
    pub enum Closed {
        HeaderTimeout,
        IdleTimeout,
        BodyTimeout,
        SendTimeout,
        /// Idle, closed to make room at `max_connections` (or for lack of file descriptors).
        MakeRoom,
    }
}

/// Every open connection of one listener, and the bound on their number.
pub struct Registry {
    listener: &'static str,
    max: usize,
    permits: Arc<Semaphore>,
    open: Mutex<HashMap<u64, Arc<Track>>>,
    next_id: AtomicU64,
    /// Set once shutdown began: new connections are asked to close at once.
    shutting_down: AtomicBool,
    drained: tokio::sync::Notify,
    metrics: ListenerMetrics,
    /// When a full listener / a failing accept was last logged (ms on [`clock_ms`]), and
    /// how many happened since.
    full_warned: AtomicU64,
    full_since: AtomicU64,
    accept_warned: AtomicU64,
    accept_since: AtomicU64,
}

impl Registry {
    pub fn new(listener: &'static str, max: usize, metrics: ListenerMetrics) -> Arc<Registry> {
        Arc::new(Registry {
            listener,
            max: max.max(1),
            permits: Arc::new(Semaphore::new(max.max(1))),
            open: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            drained: tokio::sync::Notify::new(),
            metrics,
            full_warned: AtomicU64::new(0),
            full_since: AtomicU64::new(0),
            accept_warned: AtomicU64::new(0),
            accept_since: AtomicU64::new(0),
        })
    }

    /// Open connections now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Track>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more connection: at once, or once enough idle connections were
    /// closed to make room (or others ended).
    pub async fn admit(&self) -> OwnedSemaphorePermit {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return permit;
        }
        self.full_since.fetch_add(1, Relaxed);
        if self.due(&self.full_warned) {
            tracing::warn!(
                listener = self.listener,
                max_connections = self.max,
                times = self.full_since.swap(0, Relaxed),
                "max_connections reached: closing the longest idle connections to make room; new connections wait in the listen backlog"
            );
        }
        let batch = (self.max / 256).clamp(1, MAKE_ROOM_BATCH);
        loop {
            self.make_room(batch);
            let acquire = self.permits.clone().acquire_owned();
            tokio::select! {
                permit = acquire => {
                    // The semaphore is never closed.
                    if let Ok(p) = permit {
                        return p;
                    }
                }
                () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
            }
        }
    }

    /// An accept failed (out of file descriptors, say): make room, and log it now and then.
    pub async fn accept_failed(&self, e: &io::Error) {
        self.metrics.accept_errors.inc();
        self.accept_since.fetch_add(1, Relaxed);
        if self.due(&self.accept_warned) {
            tracing::warn!(
                listener = self.listener,
                error = %e,
                times = self.accept_since.swap(0, Relaxed),
                "accept failed; closing idle connections and retrying"
            );
        }
        self.make_room((self.max / 256).clamp(1, MAKE_ROOM_BATCH));
        tokio::time::sleep(ACCEPT_BACKOFF).await;
    }

    /// Whether a warning last given at `last` may be given again now (and mark it given).
    fn due(&self, last: &AtomicU64) -> bool {
        let now = clock_ms().max(1);
        let then = last.load(Relaxed);
        (then == 0 || now >= then + WARN_EVERY.as_millis() as u64)
            && last.compare_exchange(then, now, Relaxed, Relaxed).is_ok()
    }

    /// Have up to `n` connections on their way out to make room: ask that many of those
    /// idle the longest to close, less idle ones asked before that have not closed yet (on a
    /// loaded machine a closing connection can outlast the accept loop's backoff, and
    /// asking again would close one more than the new client needs).
    pub fn make_room(&self, n: usize) {
        let open = self.lock();
        let closing = open
            .values()
            .filter(|t| t.close.load(Relaxed) == CLOSE_MAKE_ROOM && t.idle())
            .count();
        let n = n.saturating_sub(closing);
        if n == 0 {
            return;
        }
        let mut idle: Vec<(u64, &Arc<Track>)> = open
            .values()
            .filter(|t| t.idle() && t.close.load(Relaxed) == 0)
            .map(|t| (t.idle_since_ms.load(Relaxed), t))
            .collect();
        if idle.len() > n {
            idle.select_nth_unstable_by_key(n, |(since, _)| *since);
            idle.truncate(n);
        }
        for (_, t) in idle {
            t.closed(Closed::MakeRoom);
            t.ask_to_close(CLOSE_MAKE_ROOM);
        }
    }

    /// Ask every connection to close: idle ones at once, busy ones after the requests in
    /// flight (HTTP/2: GOAWAY).
    pub fn shut_down(&self) {
        self.shutting_down.store(true, Relaxed);
        for t in self.lock().values() {
            t.ask_to_close(CLOSE_SHUTDOWN);
        }
    }

    /// The shutdown grace is over: tell every tunnel (an upgraded connection, or an
    /// HTTP/2 stream) to close now — a WebSocket with a close frame to both ends — and give
    /// them up to a second to do it. Returns at once where none is open.
    pub async fn close_tunnels(&self) {
        let told = self
            .lock()
            .values()
            .filter(|t| t.tunnelled())
            .inspect(|t| t.ask_to_close(CLOSE_NOW))
            .count();
        if told > 0 {
            let _ = tokio::time::timeout(TUNNEL_CLOSE, self.drained()).await;
        }
    }

    /// Until every connection has closed.
    pub async fn drained(&self) {
        loop {
            let notified = self.drained.notified();
            if self.is_empty() {
                return;
            }
            notified.await;
        }
    }

    pub(super) fn register(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Registered {
        let track = Arc::new(Track::new(self.next_id.fetch_add(1, Relaxed)));
        self.lock().insert(track.id, track.clone());
        if self.shutting_down.load(Relaxed) {
            track.ask_to_close(CLOSE_SHUTDOWN);
        }
        self.metrics.open.inc();
        Registered {
            registry: self.clone(),
            track,
            _permit: permit,
        }
    }
}

/// A connection's place in its registry, given back when the connection ends.
pub(super) struct Registered {
    registry: Arc<Registry>,
    pub(super) track: Arc<Track>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let r = &self.registry;
        let empty = {
            let mut open = r.lock();
            open.remove(&self.track.id);
            open.is_empty()
        };
        r.metrics.open.dec();
        if let Some(why) = self.track.closed_by() {
            r.metrics.count(why);
        }
        if empty {
            r.drained.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asked twice for room before the first connection asked has closed (the accept
    /// loop's backoff on a loaded machine), the registry still closes only one: the one
    /// idle the longest. Once that one has closed, the next ask picks the next.
    #[tokio::test]
    async fn make_room_asks_again_only_once_the_one_asked_has_closed() {
        let registry = Registry::new("test", 3, ListenerMetrics::default());
        let mut held = Vec::new();
        for idle_since in [30, 10, 20] {
            let permit = registry.permits.clone().try_acquire_owned().expect("room");
            let r = registry.register(permit);
            r.track.idle_since_ms.store(idle_since, Relaxed);
            held.push(r);
        }
        let asked = |held: &[Registered]| -> Vec<u64> {
            held.iter()
                .filter(|r| r.track.close.load(Relaxed) == CLOSE_MAKE_ROOM)
                .map(|r| r.track.idle_since_ms.load(Relaxed))
                .collect()
        };
        registry.make_room(1);
        registry.make_room(1);
        assert_eq!(asked(&held), [10], "the longest idle, and only it");
        held.remove(1); // it closes
        registry.make_room(1);
        assert_eq!(asked(&held), [20]);
    }
}
