//! Overload protection for a pool (`overload = { … }`): a limit on the requests in flight
//! to its backend, adapted to the backend's latency ([`limit::Gradient`]) or fixed
//! (`max_concurrency`), and the queue of those waiting beyond it ([`queue::Queue`]):
//! highest priority first (a plan's `priority`), first come first served within one, at
//! most `max_queue` of them for at most `max_wait` each. A request past those is *shed*:
//! the gateway answers it 503 with `Retry-After`, the backend never sees it.
//!
//! A request holds a [`Permit`] from the moment it is let through until its answer's head
//! arrives (or its forwarding fails); the permit's drop gives the place to the next waiter,
//! on every path — answered, failed, the client gone. A waiter whose client leaves is taken
//! out of the queue by its future's drop. Memory is bounded by `max_queue` waiters.
//!
//! **A share kept for higher priorities** (`reserve_for_higher`, default 25%): the queue
//! orders waiters, but once lower-priority requests hold every place, a higher one could
//! only wait for one of them to end — a slow backend's free requests would starve the pro
//! ones. So the requests of a priority and those below it may hold at most the limit less
//! that share, and less it again for each further priority above them that the config
//! names: with priorities 0 and 10 and a limit of 16, priority 0 holds at most 12 and
//! priority 10 may take all 16; with 0, 10 and 20, priority 0 holds at most 9, 0 and 10
//! together at most 12. A request of the highest priority a config names is then never
//! kept waiting by lower ones past that share: it finds a place within `max_wait` unless
//! requests of its own priority (or higher) fill the backend.
//!
//! The gateway asks only after the rate limits admitted the request
//! (`proxy/overload.rs`): a shed request is "unanswered by the backend", as a 502 is,
//! and its settling charges are refunded as a 502's are.

pub mod limit;
pub mod metrics;
pub mod queue;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::oneshot;

pub use limit::Adaptive;
use limit::Gradient;
pub use metrics::OverloadMetrics;
use metrics::{PoolHandles, PriorityHandles};
use queue::{Place, Pushed, Queue};

/// `min_limit`'s default.
pub const MIN_LIMIT: u32 = 4;
/// `max_limit`'s default.
pub const MAX_LIMIT: u32 = 1000;
/// `probe_interval`'s default.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(30);
/// `max_queue`'s default.
pub const MAX_QUEUE: u32 = 1000;
/// `max_wait`'s default.
pub const MAX_WAIT: Duration = Duration::from_secs(2);
/// `reserve_for_higher`'s default, percent of the limit.
pub const RESERVE_FOR_HIGHER: u8 = 25;
/// A shed request's `Retry-After`, seconds.
pub const RETRY_AFTER: u64 = 1;

/// How the limit is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limiting {
    /// `adaptive = true`.
    Adaptive(Adaptive),
    /// `max_concurrency = N`.
    Fixed(u32),
}

/// A pool's `overload`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub limiting: Limiting,
    /// At most this many wait (0: none; a request finding no room is shed at once).
    pub max_queue: u32,
    /// The longest one waits.
    pub max_wait: Duration,
    /// The share of the limit (percent) each priority keeps for the priorities above it
    /// (`reserve_for_higher`): see [`Overload`].
    pub reserve_for_higher: u8,
}

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// The queue was full of requests of its priority or higher.
    Full,
    /// A request of higher priority took its place in the full queue.
    Evicted,
    /// It waited `max_wait`.
    Waited,
}

impl Shed {
    /// The 503's `detail`.
    pub fn detail(self) -> &'static str {
        match self {
            Shed::Full => "the backend is at its concurrency limit and the queue is full",
            Shed::Evicted => {
                "the backend is at its concurrency limit and a request of higher priority took this one's place"
            }
            Shed::Waited => "the backend is at its concurrency limit and the request waited max_wait",
        }
    }
}

/// One pool's limit and queue.
pub struct Overload {
    settings: Settings,
    pool: String,
    state: Mutex<State>,
    handles: PoolHandles,
    metrics: OverloadMetrics,
}

struct State {
    control: Control,
    in_flight: u32,
    /// Requests in flight per priority (the priorities seen, few).
    held: Vec<(u32, u32)>,
    /// The priorities the config names, highest first ([`Overload::levels`]).
    levels: Vec<u32>,
    /// `reserve_for_higher`, percent.
    for_higher: u8,
    queue: Queue<Waiter>,
    /// Requests shed since the pool was built (the status page).
    shed: u64,
    /// Handles per priority, found once each.
    priorities: Vec<(u32, PriorityHandles)>,
}

enum Control {
    Fixed(u32),
    Adaptive(Box<Gradient>),
}

impl Control {
    fn limit(&self) -> u32 {
        match self {
            Control::Fixed(n) => *n,
            Control::Adaptive(g) => g.limit(),
        }
    }
}

struct Waiter {
    tx: oneshot::Sender<Permit>,
}

/// What the status page shows of a pool's protection.
#[derive(Debug, Clone, Serialize)]
pub struct OverloadStatus {
    /// `adaptive` or `fixed`.
    pub mode: &'static str,
    pub limit: u32,
    pub in_flight: u32,
    pub queued: u32,
    pub shed: u64,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic never happens under this lock; were one to, the state is still whole.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A number in [0, 1) for a probe's jitter.
fn jitter() -> f64 {
    (crate::random::bits() >> 11) as f64 / (1u64 << 53) as f64
}

impl Overload {
    pub fn new(settings: Settings, pool: &str, metrics: &OverloadMetrics) -> Arc<Overload> {
        let control = match settings.limiting {
            Limiting::Fixed(n) => Control::Fixed(n),
            Limiting::Adaptive(a) => {
                Control::Adaptive(Box::new(Gradient::new(a, Instant::now(), jitter())))
            }
        };
        let handles = metrics.pool(pool);
        handles.limit.set(i64::from(control.limit()));
        Arc::new(Overload {
            state: Mutex::new(State {
                control,
                in_flight: 0,
                held: Vec::new(),
                levels: Vec::new(),
                for_higher: settings.reserve_for_higher,
                queue: Queue::new(settings.max_queue as usize),
                shed: 0,
                priorities: Vec::new(),
            }),
            settings,
            pool: pool.to_string(),
            handles,
            metrics: metrics.clone(),
        })
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The priorities the config names (its plans' `priority`, and 0): each below the
    /// highest keeps a share of the limit for those above it (see the module).
    pub fn levels(&self, priorities: &[u32]) {
        let mut levels = priorities.to_vec();
        levels.sort_unstable_by(|a, b| b.cmp(a));
        levels.dedup();
        lock(&self.state).levels = levels;
    }

    /// A permit for a request of `priority`: at once where the limit has room and nobody
    /// waits, else once its turn comes in the queue; or why it is shed. Dropping the
    /// future (the client left) takes it out of the queue.
    pub async fn admit(self: &Arc<Self>, priority: u32) -> Result<Permit, Shed> {
        let since = Instant::now();
        let (place, rx, handles) = {
            let mut s = lock(&self.state);
            let handles = s.handles(&self.metrics, &self.pool, priority);
            // At once where it fits and nobody it would overtake waits.
            if s.fits(priority) && !s.queue.waits_at_or_above(priority) {
                let permit = s.grant(self, priority);
                drop(s);
                handles.wait.observe(0.0);
                return Ok(permit);
            }
            let (tx, rx) = oneshot::channel();
            let place = match s.queue.push(priority, Waiter { tx }) {
                Pushed::Queued(place) => place,
                Pushed::Evicted(place, evicted, at) => {
                    // Its sender dropped: its future wakes and answers `Evicted`.
                    drop(evicted);
                    let h = s.handles(&self.metrics, &self.pool, at.priority());
                    h.queue_length.dec();
                    h.shed.inc();
                    s.shed += 1;
                    place
                }
                Pushed::Full(_) => {
                    handles.shed.inc();
                    s.shed += 1;
                    return Err(Shed::Full);
                }
            };
            handles.queue_length.inc();
            (place, rx, handles)
        };
        let mut waiting = Waiting {
            overload: self,
            place,
            handles: &handles,
            rx: Some(rx),
        };
        let outcome = match waiting.rx.as_mut() {
            Some(rx) => tokio::time::timeout(self.settings.max_wait, rx).await,
            None => return Err(Shed::Waited),
        };
        match outcome {
            Ok(Ok(permit)) => {
                waiting.rx = None;
                handles.wait.observe(since.elapsed().as_secs_f64());
                Ok(permit)
            }
            Ok(Err(_)) => {
                waiting.rx = None;
                Err(Shed::Evicted)
            }
            Err(_) => waiting.timed_out(since).await,
        }
    }

    /// What the status page shows.
    pub fn status(&self) -> OverloadStatus {
        let s = lock(&self.state);
        OverloadStatus {
            mode: match s.control {
                Control::Fixed(_) => "fixed",
                Control::Adaptive(_) => "adaptive",
            },
            limit: s.control.limit(),
            in_flight: s.in_flight,
            queued: s.queue.len() as u32,
            shed: s.shed,
        }
    }

    /// A permit's end: its sample (if it was answered) counted, its place given to the
    /// waiters that now fit, highest priority first. The permits are sent after the lock
    /// is let go: one whose waiter is gone comes back and is dropped, ending in turn.
    fn release(self: &Arc<Self>, priority: u32, sample: Option<(Duration, u32)>) {
        let mut granted = Vec::new();
        {
            let mut s = lock(&self.state);
            s.in_flight = s.in_flight.saturating_sub(1);
            if let Some((_, n)) = s.held.iter_mut().find(|(p, _)| *p == priority) {
                *n = n.saturating_sub(1);
            }
            if let (Some((rtt, at)), Control::Adaptive(g)) = (sample, &mut s.control) {
                g.sample(Instant::now(), rtt, at, jitter());
                self.handles.limit.set(i64::from(g.limit()));
            }
            // The highest waiter that fits: one of a priority whose share is full does
            // not keep a higher one waiting, nor a lower one that still has room.
            while s.in_flight < s.control.limit() {
                let State {
                    queue,
                    control,
                    in_flight,
                    held,
                    levels,
                    for_higher,
                    ..
                } = &mut *s;
                let fits = |p: u32| fits(control.limit(), *in_flight, held, levels, *for_higher, p);
                let Some((place, waiter)) = queue.pop_first_where(fits) else {
                    break;
                };
                s.handles(&self.metrics, &self.pool, place.priority())
                    .queue_length
                    .dec();
                granted.push((waiter, s.grant(self, place.priority())));
            }
            self.handles.in_flight.set(i64::from(s.in_flight));
        }
        for (waiter, permit) in granted {
            // A waiter gone since: the permit comes back, and its drop releases it.
            let _ = waiter.tx.send(permit);
        }
    }
}

/// Whether a request of `priority` fits: the limit has room, and each share it counts in
/// (see the module) too. A request of priority `p` counts in the share of every level
/// `q ≥ p` below the highest: the requests at or below `q` hold less than the limit less
/// the share kept for higher priorities (`for_higher`) once for each level above `q`.
fn fits(
    limit: u32,
    in_flight: u32,
    held: &[(u32, u32)],
    levels: &[u32],
    for_higher: u8,
    priority: u32,
) -> bool {
    if in_flight >= limit {
        return false;
    }
    if for_higher == 0 {
        return true;
    }
    let groups = levels.iter().copied().filter(|&q| q > priority);
    std::iter::once(priority).chain(groups).all(|q| {
        let above = levels.iter().filter(|&&l| l > q).count();
        if above == 0 {
            return true;
        }
        let mut share = u64::from(limit);
        for _ in 0..above {
            share = share * u64::from(100 - for_higher.min(100)) / 100;
        }
        let at_or_below: u64 = held
            .iter()
            .filter(|(p, _)| *p <= q)
            .map(|(_, n)| u64::from(*n))
            .sum();
        at_or_below < share.max(1)
    })
}

impl State {
    /// Whether a request of `priority` fits now.
    fn fits(&self, priority: u32) -> bool {
        fits(
            self.control.limit(),
            self.in_flight,
            &self.held,
            &self.levels,
            self.for_higher,
            priority,
        )
    }

    /// One more in flight, at `priority`, as a permit of `overload`.
    fn grant(&mut self, overload: &Arc<Overload>, priority: u32) -> Permit {
        self.in_flight += 1;
        match self.held.iter_mut().find(|(p, _)| *p == priority) {
            Some((_, n)) => *n += 1,
            None => self.held.push((priority, 1)),
        }
        overload.handles.in_flight.set(i64::from(self.in_flight));
        Permit {
            overload: overload.clone(),
            started: Instant::now(),
            in_flight: self.in_flight,
            priority,
            answered: false,
        }
    }

    fn handles(&mut self, m: &OverloadMetrics, pool: &str, priority: u32) -> PriorityHandles {
        if let Some((_, h)) = self.priorities.iter().find(|(p, _)| *p == priority) {
            return h.clone();
        }
        let h = m.priority(pool, priority);
        // Bounded by the priorities a config names (plus those of configs before it).
        if self.priorities.len() < 256 {
            self.priorities.push((priority, h.clone()));
        }
        h
    }
}

/// A request's place in the queue while it waits; its drop (the client gone) takes it
/// out, or, where its permit came meanwhile, gives that back.
struct Waiting<'a> {
    overload: &'a Arc<Overload>,
    place: Place,
    handles: &'a PriorityHandles,
    rx: Option<oneshot::Receiver<Permit>>,
}

impl Waiting<'_> {
    /// `max_wait` passed: shed, unless its permit came at the same moment. A waiter no
    /// longer in the queue was taken out under the lock by [`Overload::release`], whose
    /// permit is on its way (sent just after the lock is let go), or by an eviction, whose
    /// sender is already dropped: either way the answer is there at once, and it is
    /// awaited rather than read now — reading it now could find the permit not yet sent
    /// and shed a request that was granted its place, uncounted.
    async fn timed_out(&mut self, since: Instant) -> Result<Permit, Shed> {
        {
            let mut s = lock(&self.overload.state);
            if s.queue.remove(self.place).is_some() {
                self.handles.queue_length.dec();
                self.handles.shed.inc();
                s.shed += 1;
                return Err(Shed::Waited);
            }
        }
        let Some(rx) = self.rx.as_mut() else {
            return Err(Shed::Waited);
        };
        let granted = rx.await;
        self.rx = None;
        match granted {
            Ok(permit) => {
                self.handles.wait.observe(since.elapsed().as_secs_f64());
                Ok(permit)
            }
            // Evicted, and counted as shed then.
            Err(_) => Err(Shed::Evicted),
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.rx.is_none() {
            return;
        }
        {
            let mut s = lock(&self.overload.state);
            if s.queue.remove(self.place).is_some() {
                self.handles.queue_length.dec();
            }
        }
        // Outside the lock: a permit sent meanwhile is dropped with the receiver, and its
        // drop releases it.
        self.rx = None;
    }
}

/// A place among the pool's requests in flight, held until the answer's head (see
/// [`Permit::answered`]); its drop gives it back.
pub struct Permit {
    overload: Arc<Overload>,
    started: Instant,
    /// The requests in flight when it was granted, itself included.
    in_flight: u32,
    /// Its request's priority (its share is given back on its drop).
    priority: u32,
    answered: bool,
}

impl Permit {
    /// The backend's answer head arrived: the time since the permit was granted is the
    /// controller's latency sample. The place is given back.
    pub fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let sample = self
            .answered
            .then(|| (self.started.elapsed(), self.in_flight));
        self.overload.release(self.priority, sample);
    }
}

#[cfg(test)]
mod tests;
