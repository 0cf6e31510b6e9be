//! Whether a pool's server may take requests: the pure state of each server, moved by
//! what the runtime reports (a request failed or succeeded, an active check passed or
//! not) at the `Instant` it passes in, and the pool's rules over them.
//!
//! - Passive health is nginx's `max_fails`/`fail_timeout` with Envoy's outlier-detection
//!   doubling: `max_fails` failures within `fail_window` (counted from the first failure
//!   of the count) eject a server for `fail_timeout`, twice as long for each consecutive
//!   ejection (one right after a failed trial), up to [`MAX_EJECTION`]. Once an ejection
//!   ends, exactly one trial request is let through ([`ServerHealth::take`]; nginx lets
//!   one request through after `fail_timeout` the same way): its success brings the server
//!   back and forgets the ejections, its failure ejects it again for twice as long.
//! - Active checks are nginx's and HAProxy's `rise`/`fall`: `unhealthy` failed checks in a
//!   row take a server out, `healthy` passes in a row bring it back. A server takes
//!   requests only when both passive and active health say so.
//! - At most `max_ejected_percent` of a pool is ejected at once (Envoy's
//!   `max_ejection_percent`): an ejection past it is not made, though the failure counts
//!   (the next one ejects, once another server is back). With every server out, a pool
//!   still sends its requests somewhere: to the server that failed least recently
//!   ([`panic_pick`], after Envoy's panic threshold), rather than failing them all.
//!
//! Each server's state is shared by every worker thread. What a pick reads (whether the
//! server is in, the one trial) is in atomics; what a report changes is behind a mutex
//! held for a few integer operations, never across anything else. A report that changes
//! the server's state returns a [`HealthEvent`] for the runtime to log and count.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::AcqRel, Ordering::Acquire};
use std::sync::atomic::{Ordering::Relaxed, Ordering::Release};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{HealthCheck, Passive, MAX_EJECTION};

/// A pool's health rules: its `passive` settings and its active checks' streaks, the same
/// for each of its servers.
#[derive(Debug)]
pub struct HealthPolicy {
    /// 0: never ejected.
    max_fails: u32,
    fail_window: Duration,
    fail_timeout: Duration,
    max_ejected_percent: u8,
    /// `(healthy, unhealthy)` of the active checks, if the pool has them.
    checks: Option<(u32, u32)>,
    /// How long a trial request may go unreported before another is let through (the
    /// request was cancelled, say): the longest a request waits for its answer's head.
    trial_timeout: Duration,
    /// Held while an ejection is decided, so that two servers failing at once on two
    /// threads cannot both take the pool's last ejection.
    ejecting: Mutex<()>,
}

/// One server's health. Create one per server and keep it as long as the server is in
/// the pool (across re-resolves and unchanged reloads: the ejection history is in it).
#[derive(Debug)]
pub struct ServerHealth {
    /// What the `Instant`s are stored against, in ns (plus one, so 0 can mean none).
    epoch: Instant,
    /// 0: in the pool (passively). Else `t << 1 | trial`: ejected until `t` when `trial`
    /// is 0; when it is 1, the one trial request was let through and another may go at
    /// `t` (the trial's report is overdue then). One word, so that the trial is taken by
    /// one compare-and-swap and a new ejection can never be mistaken for the old one's
    /// trial.
    gate: AtomicU64,
    /// Taken out by active checks.
    checks_down: AtomicBool,
    /// When it last failed (a request or a check): the panic pick's measure. 0: never.
    last_failed: AtomicU64,
    trial_timeout: Duration,
    counts: Mutex<Counts>,
}

/// What a report changes: the failure count, the ejection streak, the checks' streaks.
#[derive(Debug, Default)]
struct Counts {
    fails: u32,
    /// When the first failure of `fails` happened.
    window_start: Option<Instant>,
    /// Ejections since the server last came back from one: the next one lasts
    /// `fail_timeout × 2^consecutive`.
    consecutive: u32,
    check_fails: u32,
    check_passes: u32,
}

/// A change of a server's state, for the runtime to log and count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthEvent {
    /// Ejected (passively) until `until`; `consecutive` is 1 for a first ejection, 2 for
    /// one right after a failed trial, and so on.
    Ejected { until: Instant, consecutive: u32 },
    /// Its trial succeeded: back in the pool, its ejection streak forgotten.
    Returned,
    /// `unhealthy` active checks failed in a row: taken out.
    CheckFailed,
    /// `healthy` active checks passed in a row: back in.
    CheckPassed,
}

impl HealthEvent {
    /// For logs and metrics: `ejected`, `returned`, `check_failed`, `check_passed`.
    pub fn name(&self) -> &'static str {
        match self {
            HealthEvent::Ejected { .. } => "ejected",
            HealthEvent::Returned => "returned",
            HealthEvent::CheckFailed => "check_failed",
            HealthEvent::CheckPassed => "check_passed",
        }
    }
}

/// A server's state as the status page shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthState {
    Healthy,
    /// Passively ejected until `until`.
    Ejected {
        until: Instant,
    },
    /// Its ejection ended: one trial request goes (or went) to it.
    Trial,
    /// Taken out by active checks: `failures` failed in a row so far (0 once one passed),
    /// `passes` passed in a row (it comes back at the pool's `healthy`). Shown before a
    /// passive state: a server failing its checks is out whatever its requests say.
    FailingChecks {
        failures: u32,
        passes: u32,
    },
}

impl HealthState {
    /// For the status page: `healthy`, `ejected`, `trial`, `failing_checks`.
    pub fn name(&self) -> &'static str {
        match self {
            HealthState::Healthy => "healthy",
            HealthState::Ejected { .. } => "ejected",
            HealthState::Trial => "trial",
            HealthState::FailingChecks { .. } => "failing_checks",
        }
    }
}

/// A mutex whose holder panicked is still usable: what it guards is a few counters, each
/// update whole.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl HealthPolicy {
    /// The rules of a pool with `passive` settings, active checks `health` if any, and
    /// requests that wait at most `trial_timeout` for their answer's head (the pool's
    /// `connect_timeout + timeout`).
    pub fn new(
        passive: &Passive,
        health: Option<&HealthCheck>,
        trial_timeout: Duration,
    ) -> HealthPolicy {
        HealthPolicy {
            max_fails: passive.max_fails,
            fail_window: passive.fail_window,
            fail_timeout: passive.fail_timeout,
            max_ejected_percent: passive.max_ejected_percent.min(100),
            checks: health.map(|h| (h.healthy.max(1), h.unhealthy.max(1))),
            trial_timeout,
            ejecting: Mutex::new(()),
        }
    }

    /// How many of a pool of `servers` may be ejected at once: `max_ejected_percent` of
    /// them, rounded down (50% of 3 is 1).
    pub fn max_ejected(&self, servers: usize) -> usize {
        servers * usize::from(self.max_ejected_percent) / 100
    }

    /// A request to `servers[i]` failed at `now` (refused, reset, timed out, or a status
    /// `fail_on_status` lists). `servers` is the whole pool, for its ejection cap.
    ///
    /// Counted within `fail_window`; the `max_fails`-th ejects the server unless the pool
    /// has its most ejected already. A failure after its ejection ended (its trial's)
    /// ejects it again at once, for twice as long; one during an ejection (a request sent
    /// before it) changes nothing but the server's last failure.
    pub fn failed<S: AsRef<ServerHealth>>(
        &self,
        servers: &[S],
        i: usize,
        now: Instant,
    ) -> Option<HealthEvent> {
        let server = servers.get(i)?.as_ref();
        server.last_failed.fetch_max(server.ns(now), Relaxed);
        if self.max_fails == 0 {
            return None;
        }
        let mut counts = lock(&server.counts);
        let gate = server.gate.load(Acquire);
        if gate != 0 {
            if gate & 1 == 1 || server.ns(now) >= gate >> 1 {
                return Some(self.eject(server, &mut counts, now));
            }
            return None;
        }
        let window_over = counts
            .window_start
            .is_none_or(|start| now.saturating_duration_since(start) >= self.fail_window);
        if counts.fails == 0 || window_over {
            counts.fails = 1;
            counts.window_start = Some(now);
        } else {
            counts.fails = counts.fails.saturating_add(1);
        }
        if counts.fails < self.max_fails {
            return None;
        }
        // The cap: counted and decided under one lock, the ejection made before it is
        // let go. Servers in trial count as ejected (they are not back yet).
        let _deciding = lock(&self.ejecting);
        let ejected = servers
            .iter()
            .filter(|s| s.as_ref().gate.load(Acquire) != 0)
            .count();
        if ejected >= self.max_ejected(servers.len()) {
            return None;
        }
        Some(self.eject(server, &mut counts, now))
    }

    /// Ejects `server` from `now`, for `fail_timeout` doubled per consecutive ejection.
    fn eject(&self, server: &ServerHealth, counts: &mut Counts, now: Instant) -> HealthEvent {
        counts.consecutive = counts.consecutive.saturating_add(1);
        counts.fails = 0;
        counts.window_start = None;
        let until = now + self.ejection(counts.consecutive);
        server.gate.store(server.ns(until) << 1, Release);
        HealthEvent::Ejected {
            until,
            consecutive: counts.consecutive,
        }
    }

    /// How long the `consecutive`-th ejection in a row lasts: `fail_timeout × 2^(n-1)`, at
    /// most [`MAX_EJECTION`].
    pub fn ejection(&self, consecutive: u32) -> Duration {
        let doublings = consecutive.saturating_sub(1).min(31);
        self.fail_timeout
            .saturating_mul(1 << doublings)
            .min(MAX_EJECTION)
    }

    /// A request to `server` succeeded at `now` (an answer whose status is not a failure).
    /// Its failures are forgotten; after its ejection ended (its trial's answer), it is
    /// back in the pool and its ejection streak is forgotten too.
    pub fn succeeded(&self, server: &ServerHealth, now: Instant) -> Option<HealthEvent> {
        let mut counts = lock(&server.counts);
        counts.fails = 0;
        counts.window_start = None;
        let gate = server.gate.load(Acquire);
        if gate == 0 || (gate & 1 == 0 && server.ns(now) < gate >> 1) {
            return None;
        }
        server.gate.store(0, Release);
        counts.consecutive = 0;
        Some(HealthEvent::Returned)
    }

    /// An active check of `server` passed (`pass`) or failed at `now`. Nothing for a pool
    /// without checks.
    pub fn checked(&self, server: &ServerHealth, pass: bool, now: Instant) -> Option<HealthEvent> {
        let (healthy, unhealthy) = self.checks?;
        let mut counts = lock(&server.counts);
        let down = server.checks_down.load(Acquire);
        if pass {
            counts.check_fails = 0;
            counts.check_passes = counts.check_passes.saturating_add(1);
            if down && counts.check_passes >= healthy {
                server.checks_down.store(false, Release);
                return Some(HealthEvent::CheckPassed);
            }
        } else {
            server.last_failed.fetch_max(server.ns(now), Relaxed);
            counts.check_passes = 0;
            counts.check_fails = counts.check_fails.saturating_add(1);
            if !down && counts.check_fails >= unhealthy {
                server.checks_down.store(true, Release);
                return Some(HealthEvent::CheckFailed);
            }
        }
        None
    }
}

impl ServerHealth {
    /// A server of a pool with `policy`, in the pool (no check has failed yet), known
    /// from `now`.
    pub fn new(policy: &HealthPolicy, now: Instant) -> ServerHealth {
        ServerHealth {
            epoch: now,
            gate: AtomicU64::new(0),
            checks_down: AtomicBool::new(false),
            last_failed: AtomicU64::new(0),
            trial_timeout: policy.trial_timeout,
            counts: Mutex::new(Counts::default()),
        }
    }

    /// `t` in ns since `epoch`, plus one (0 is kept for "none"); times before `epoch` are
    /// `epoch`'s.
    fn ns(&self, t: Instant) -> u64 {
        let ns = t.saturating_duration_since(self.epoch).as_nanos();
        (ns.min(u128::from(u64::MAX >> 2)) as u64) + 1
    }

    fn instant(&self, ns: u64) -> Instant {
        self.epoch + Duration::from_nanos(ns.saturating_sub(1))
    }

    /// Whether a pick may choose it at `now`: in the pool by both passive and active
    /// health, or its ejection over and its trial not yet let through. Reads two atomics.
    /// A pick that chose it calls [`take`](Self::take).
    pub fn available(&self, now: Instant) -> bool {
        if self.checks_down.load(Acquire) {
            return false;
        }
        let gate = self.gate.load(Acquire);
        gate == 0 || self.ns(now) >= gate >> 1
    }

    /// Whether the request a pick chose it for may go to it at `now`: always while it is
    /// in the pool; after its ejection, for exactly one request (of however many threads
    /// picked it at once), and again only if that one is not reported within the trial
    /// timeout. `false`: pick another server.
    pub fn take(&self, now: Instant) -> bool {
        if self.checks_down.load(Acquire) {
            return false;
        }
        let now_ns = self.ns(now);
        let mut gate = self.gate.load(Acquire);
        loop {
            if gate == 0 {
                return true;
            }
            if now_ns < gate >> 1 {
                return false;
            }
            let trial = (self.ns(now + self.trial_timeout) << 1) | 1;
            match self.gate.compare_exchange(gate, trial, AcqRel, Acquire) {
                Ok(_) => return true,
                Err(changed) => gate = changed,
            }
        }
    }

    /// Its state at `now`, for the status page.
    pub fn state(&self, now: Instant) -> HealthState {
        if self.checks_down.load(Acquire) {
            let counts = lock(&self.counts);
            return HealthState::FailingChecks {
                failures: counts.check_fails,
                passes: counts.check_passes,
            };
        }
        match self.gate.load(Acquire) {
            0 => HealthState::Healthy,
            gate if gate & 1 == 0 && self.ns(now) < gate >> 1 => HealthState::Ejected {
                until: self.instant(gate >> 1),
            },
            _ => HealthState::Trial,
        }
    }

    /// When it last failed (a request or a check), if ever.
    pub fn last_failed(&self) -> Option<Instant> {
        match self.last_failed.load(Relaxed) {
            0 => None,
            ns => Some(self.instant(ns)),
        }
    }
}

impl AsRef<ServerHealth> for ServerHealth {
    fn as_ref(&self) -> &ServerHealth {
        self
    }
}

/// The server a pool with no server available sends a request to: the one that failed
/// least recently (one that never failed first; the first of equals). `None` only for an
/// empty pool. Envoy's panic threshold: better one request to a server that may have
/// recovered than every request refused.
pub fn panic_pick<S: AsRef<ServerHealth>>(servers: &[S]) -> Option<usize> {
    (0..servers.len()).min_by_key(|&i| servers[i].as_ref().last_failed())
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);
    /// The trial timeout of the tests' pools.
    const TRIAL: Duration = Duration::from_secs(31);

    fn policy() -> HealthPolicy {
        let checks = HealthCheck {
            healthy: 2,
            unhealthy: 3,
            ..HealthCheck::default()
        };
        HealthPolicy::new(&Passive::default(), Some(&checks), TRIAL)
    }

    fn pool(policy: &HealthPolicy, n: usize, t0: Instant) -> Vec<ServerHealth> {
        (0..n).map(|_| ServerHealth::new(policy, t0)).collect()
    }

    /// `failed` at each of `at` (seconds after `t0`), the events.
    fn fail_at(
        p: &HealthPolicy,
        servers: &[ServerHealth],
        i: usize,
        t0: Instant,
        at: &[u32],
    ) -> Vec<Option<HealthEvent>> {
        at.iter()
            .map(|&s| p.failed(servers, i, t0 + s * S))
            .collect()
    }

    #[test]
    fn three_failures_within_the_window_eject() {
        let (p, t0) = (policy(), Instant::now());
        let servers = pool(&p, 3, t0);
        let events = fail_at(&p, &servers, 0, t0, &[0, 4, 9]);
        let until = t0 + 19 * S;
        assert_eq!(
            events,
            [
                None,
                None,
                Some(HealthEvent::Ejected {
                    until,
                    consecutive: 1
                })
            ]
        );
        assert!(!servers[0].available(t0 + 9 * S));
        assert!(!servers[0].take(t0 + 18 * S));
        assert_eq!(
            servers[0].state(t0 + 10 * S),
            HealthState::Ejected { until }
        );
        assert_eq!(servers[0].state(t0 + 10 * S).name(), "ejected");
        assert!(servers[1].available(t0 + 10 * S));
        // A failure during the ejection (a request sent before it) changes nothing.
        assert_eq!(p.failed(&servers, 0, t0 + 12 * S), None);
        assert_eq!(
            servers[0].state(t0 + 12 * S),
            HealthState::Ejected { until }
        );
    }

    #[test]
    fn failures_spread_over_more_than_the_window_do_not_eject() {
        let (p, t0) = (policy(), Instant::now());
        let servers = pool(&p, 3, t0);
        assert_eq!(fail_at(&p, &servers, 0, t0, &[0, 15, 30]), [None; 3]);
        // The window runs from the count's first failure: 0, 5 and 10 are not within it,
        // and the count starts again at 10.
        assert_eq!(fail_at(&p, &servers, 1, t0, &[0, 5, 10, 12]), [None; 4]);
        assert!(p.failed(&servers, 1, t0 + 13 * S).is_some());
        // A success forgets the failures.
        assert_eq!(fail_at(&p, &servers, 2, t0, &[0, 1]), [None; 2]);
        assert_eq!(p.succeeded(&servers[2], t0 + 2 * S), None);
        assert_eq!(fail_at(&p, &servers, 2, t0, &[3, 4]), [None; 2]);
        assert!(servers[2].available(t0 + 5 * S));
    }

    #[test]
    fn consecutive_ejections_double_up_to_the_cap() {
        let (p, t0) = (policy(), Instant::now());
        let servers = pool(&p, 2, t0);
        fail_at(&p, &servers, 0, t0, &[0, 0]);
        let mut now = t0;
        let mut lengths = Vec::new();
        let mut event = p.failed(&servers, 0, now);
        for _ in 0..7 {
            let Some(HealthEvent::Ejected { until, consecutive }) = event else {
                panic!("not ejected: {event:?}");
            };
            assert_eq!(consecutive as usize, lengths.len() + 1);
            lengths.push((until - now).as_secs());
            now = until;
            assert_eq!(servers[0].state(now), HealthState::Trial);
            assert!(servers[0].take(now));
            event = p.failed(&servers, 0, now + S);
            now += S;
        }
        assert_eq!(lengths, [10, 20, 40, 80, 160, 300, 300]);
        // A successful trial forgets the streak: the next ejection is 10 s again.
        let Some(HealthEvent::Ejected { until, .. }) = event else {
            panic!()
        };
        assert!(servers[0].take(until));
        assert_eq!(
            p.succeeded(&servers[0], until + S),
            Some(HealthEvent::Returned)
        );
        assert_eq!(servers[0].state(until + S), HealthState::Healthy);
        let again = fail_at(&p, &servers, 0, until, &[2, 3, 4]);
        assert_eq!(
            again[2],
            Some(HealthEvent::Ejected {
                until: until + 14 * S,
                consecutive: 1
            })
        );
    }

    #[test]
    fn one_trial_only() {
        let (p, t0) = (policy(), Instant::now());
        let servers = pool(&p, 2, t0);
        let ejected = fail_at(&p, &servers, 0, t0, &[0, 1, 2]);
        assert!(ejected[2].is_some());
        let end = t0 + 12 * S;
        let s = &servers[0];
        assert!(!s.available(end - Duration::from_nanos(1)));
        assert!(s.available(end));
        assert!(s.take(end));
        // The trial is out: nobody else gets the server.
        assert!(!s.available(end));
        assert!(!s.take(end));
        assert!(!s.take(end + 30 * S));
        assert_eq!(s.state(end + S), HealthState::Trial);
        // A trial nobody reported (cancelled): another goes after the trial timeout.
        assert!(s.take(end + TRIAL));
        assert!(!s.take(end + TRIAL));
        // Many threads picking it at once: one gets it.
        let ejected = fail_at(&p, &servers, 1, t0, &[0, 1, 2]);
        assert!(ejected[2].is_none(), "the cap keeps the second in");
        assert_eq!(p.succeeded(s, end + TRIAL), Some(HealthEvent::Returned));
        let ejected = fail_at(&p, &servers, 1, t0, &[50, 51, 52]);
        assert!(ejected[2].is_some());
        let end = t0 + 62 * S;
        let taken = std::thread::scope(|scope| {
            let takers: Vec<_> = (0..8)
                .map(|_| scope.spawn(|| servers[1].take(end)))
                .collect();
            takers
                .into_iter()
                .map(|t| t.join().unwrap_or(false))
                .filter(|&taken| taken)
                .count()
        });
        assert_eq!(taken, 1);
    }

    #[test]
    fn the_pool_keeps_most_of_its_servers() {
        let (p, t0) = (policy(), Instant::now());
        // 50% of 3: one ejected; the second's failures count but do not eject it.
        let three = pool(&p, 3, t0);
        assert!(fail_at(&p, &three, 0, t0, &[0, 1, 2])[2].is_some());
        assert_eq!(fail_at(&p, &three, 1, t0, &[5, 6, 7, 8]), [None; 4]);
        assert!(three[1].available(t0 + 8 * S));
        // Once the first is back, the second's next failure within its window ejects it.
        assert!(three[0].take(t0 + 12 * S));
        assert_eq!(
            p.succeeded(&three[0], t0 + 12 * S),
            Some(HealthEvent::Returned)
        );
        assert!(matches!(
            p.failed(&three, 1, t0 + 12 * S),
            Some(HealthEvent::Ejected { .. })
        ));
        // 50% of 4: two.
        let four = pool(&p, 4, t0);
        for i in 0..3 {
            fail_at(&p, &four, i, t0, &[0, 1]);
        }
        let third: Vec<_> = (0..3).map(|i| p.failed(&four, i, t0 + 2 * S)).collect();
        assert!(third[0].is_some() && third[1].is_some() && third[2].is_none());
        // A trial's failure ejects again even at the cap (the server was never back).
        assert!(four[0].take(t0 + 12 * S));
        assert!(p.failed(&four, 0, t0 + 13 * S).is_some());
        // 0% or max_fails 0: never ejected.
        for passive in [
            Passive {
                max_ejected_percent: 0,
                ..Passive::default()
            },
            Passive {
                max_fails: 0,
                ..Passive::default()
            },
        ] {
            let p = HealthPolicy::new(&passive, None, TRIAL);
            let servers = pool(&p, 4, t0);
            let events = fail_at(&p, &servers, 0, t0, &[0, 0, 0, 0, 0]);
            assert_eq!(events, [None; 5]);
        }
    }

    #[test]
    fn ejections_race_for_the_pools_last_slot() {
        let (p, t0) = (policy(), Instant::now());
        let servers = pool(&p, 4, t0);
        for i in 0..4 {
            fail_at(&p, &servers, i, t0, &[0, 0]);
        }
        let ejected = std::thread::scope(|scope| {
            let racers: Vec<_> = (0..4)
                .map(|i| {
                    let (p, servers) = (&p, &servers);
                    scope.spawn(move || p.failed(servers, i, t0 + S).is_some())
                })
                .collect();
            racers
                .into_iter()
                .map(|r| r.join().unwrap_or(false))
                .filter(|&ejected| ejected)
                .count()
        });
        assert_eq!(ejected, 2);
    }

    #[test]
    fn panic_picks_the_least_recently_failed() {
        let t0 = Instant::now();
        let lenient = HealthPolicy::new(
            &Passive {
                max_fails: 100,
                ..Passive::default()
            },
            None,
            TRIAL,
        );
        let servers = pool(&lenient, 3, t0);
        assert_eq!(panic_pick(&servers), Some(0));
        for (i, at) in [(0, 5u32), (1, 2), (2, 9)] {
            lenient.failed(&servers, i, t0 + at * S);
        }
        assert_eq!(panic_pick(&servers), Some(1));
        assert_eq!(servers[1].last_failed(), Some(t0 + 2 * S));
        lenient.failed(&servers, 1, t0 + 10 * S);
        assert_eq!(panic_pick(&servers), Some(0));
        // One that never failed goes first.
        let mut four = pool(&lenient, 3, t0);
        four.push(ServerHealth::new(&lenient, t0));
        for (i, s) in four.iter().enumerate().take(3) {
            lenient.failed(&four, i, t0 + S);
            assert!(s.last_failed().is_some());
        }
        assert_eq!(panic_pick(&four), Some(3));
        assert_eq!(panic_pick::<ServerHealth>(&[]), None);
    }

    #[test]
    fn active_checks_take_streaks() {
        let (p, t0) = (policy(), Instant::now());
        let s = ServerHealth::new(&p, t0);
        let check = |pass| p.checked(&s, pass, t0);
        // unhealthy = 3 in a row: a pass between failures restarts the streak.
        assert_eq!([false, false, true, false, false].map(check), [None; 5]);
        assert!(s.available(t0));
        assert_eq!(check(false), Some(HealthEvent::CheckFailed));
        assert!(!s.available(t0) && !s.take(t0));
        assert_eq!(
            s.state(t0),
            HealthState::FailingChecks {
                failures: 3,
                passes: 0
            }
        );
        assert_eq!(check(false), None);
        // healthy = 2 in a row.
        assert_eq!([true, false, true].map(check), [None; 3]);
        assert_eq!(
            s.state(t0),
            HealthState::FailingChecks {
                failures: 0,
                passes: 1
            }
        );
        assert_eq!(check(true), Some(HealthEvent::CheckPassed));
        assert!(s.available(t0));
        assert_eq!(s.state(t0), HealthState::Healthy);
        // Without checks, nothing.
        let unchecked = HealthPolicy::new(&Passive::default(), None, TRIAL);
        let s = ServerHealth::new(&unchecked, t0);
        for _ in 0..5 {
            assert_eq!(unchecked.checked(&s, false, t0), None);
        }
        assert!(s.available(t0));
    }

    #[test]
    fn both_kinds_of_health_must_agree() {
        let (p, t0) = (policy(), Instant::now());
        let servers = pool(&p, 2, t0);
        // Ejected, checks passing: out until its trial.
        fail_at(&p, &servers, 0, t0, &[0, 0, 0]);
        p.checked(&servers[0], true, t0);
        assert!(!servers[0].available(t0 + S));
        // Its ejection over but its checks failing: out, and no trial is taken.
        for _ in 0..3 {
            p.checked(&servers[0], false, t0 + S);
        }
        assert!(!servers[0].available(t0 + 11 * S));
        assert!(!servers[0].take(t0 + 11 * S));
        for _ in 0..2 {
            p.checked(&servers[0], true, t0 + 12 * S);
        }
        assert_eq!(servers[0].state(t0 + 12 * S), HealthState::Trial);
        assert!(servers[0].take(t0 + 12 * S));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Fail(usize),
            Succeed(usize),
            Take(usize),
            Check(usize, bool),
        }

        fn ops(n: usize) -> impl Strategy<Value = Vec<(u64, Op)>> {
            let op = prop_oneof![
                4 => (0..n).prop_map(Op::Fail),
                2 => (0..n).prop_map(Op::Succeed),
                2 => (0..n).prop_map(Op::Take),
                1 => ((0..n), any::<bool>()).prop_map(|(i, p)| Op::Check(i, p)),
            ];
            // Gaps in ms: bursts, a few seconds, past an ejection.
            let gap = prop_oneof![Just(0u64), 1u64..3_000, 3_000u64..400_000];
            prop::collection::vec((gap, op), 1..300)
        }

        crate::proptest_seeds! {
            #![cases(200)]

            /// On any timeline: the pool never has more than its cap ejected; each
            /// ejection lasts `fail_timeout × 2^(n-1)` (at most 300 s) with `n` counting
            /// up from 1 after each return; a trial is let through once per ejection
            /// (again only after the trial timeout); what a pick sees agrees with the
            /// state the status page shows.
            #[test]
            fn health_keeps_its_promises(n in 1usize..6, percent in 0u8..=100, ops in ops(5)) {
                let passive = Passive { max_ejected_percent: percent, ..Passive::default() };
                let p = HealthPolicy::new(&passive, Some(&HealthCheck::default()), TRIAL);
                let t0 = Instant::now();
                let servers = pool(&p, n, t0);
                let mut streak = vec![0u32; n];
                let mut last_trial: Vec<Option<Instant>> = vec![None; n];
                let mut now = t0;
                for (gap, op) in ops {
                    now += Duration::from_millis(gap);
                    let event = match op {
                        Op::Fail(i) if i < n => p.failed(&servers, i, now),
                        Op::Succeed(i) if i < n => p.succeeded(&servers[i], now),
                        Op::Check(i, pass) if i < n => p.checked(&servers[i], pass, now),
                        Op::Take(i) if i < n => {
                            let trial = !matches!(servers[i].state(now), HealthState::Healthy);
                            let available = servers[i].available(now);
                            let taken = servers[i].take(now);
                            prop_assert_eq!(taken, available);
                            if taken && trial {
                                if let Some(t) = last_trial[i] {
                                    prop_assert!(now >= t + TRIAL, "a second trial {:?} after the first", now - t);
                                }
                                last_trial[i] = Some(now);
                                prop_assert!(!servers[i].take(now));
                            }
                            None
                        }
                        _ => None,
                    };
                    match (event, &op) {
                        (Some(HealthEvent::Ejected { until, consecutive }), Op::Fail(i)) => {
                            streak[*i] += 1;
                            last_trial[*i] = None;
                            prop_assert_eq!(consecutive, streak[*i]);
                            let want = (10u64 << (consecutive - 1).min(20)).min(300);
                            prop_assert_eq!(until - now, Duration::from_secs(want));
                        }
                        (Some(HealthEvent::Returned), Op::Succeed(i)) => {
                            streak[*i] = 0;
                            last_trial[*i] = None;
                        }
                        (Some(HealthEvent::CheckFailed | HealthEvent::CheckPassed), Op::Check(..)) | (None, _) => {}
                        (e, op) => prop_assert!(false, "{:?} from {:?}", e, op),
                    }
                    let ejected = servers.iter().filter(|s| s.gate.load(Relaxed) != 0).count();
                    prop_assert!(ejected <= p.max_ejected(n), "{} of {} ejected at {}%", ejected, n, percent);
                    for s in &servers {
                        let state = s.state(now);
                        match state {
                            HealthState::Healthy => prop_assert!(s.available(now)),
                            HealthState::Ejected { until } => {
                                prop_assert!(!s.available(now));
                                prop_assert!(until > now);
                            }
                            HealthState::FailingChecks { .. } => prop_assert!(!s.available(now)),
                            HealthState::Trial => {}
                        }
                    }
                }
            }
        }
    }
}
