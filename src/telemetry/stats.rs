//! The in-process stats the status page shows (`/status.json`): how every request ended,
//! as totals and over the last ten minutes; the backend's and the store's latency and
//! errors over the last minute; the most limited identities; the config serving now and
//! the last reload.
//!
//! The request path only adds to atomics here (one per outcome, one per latency bucket):
//! no lock, no allocation. A sampler ([`Stats::sample`], every [`SAMPLE_SECS`], run by the
//! admin listener) copies those cumulative counts into a ring of [`HISTORY_SECS`]; a
//! window's counts are the difference of two samples, so the ring is all the history kept
//! and its memory is bounded whatever the traffic. The heavy hitters take a lock, on
//! denials only.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::identity::IdentityDigest;

/// Seconds of history kept for the status page's chart.
pub const HISTORY_SECS: u64 = 600;
/// Seconds between two samples of the counts: the chart's resolution.
pub const SAMPLE_SECS: u64 = 5;
/// Seconds over which latencies and error rates are shown.
pub const WINDOW_SECS: u64 = 60;
/// Identities tracked per minute by the space-saving top-k.
const TOP_K: usize = 64;

crate::telemetry::label_enum! {
    /// How a request ended, as an operator tells outcomes apart: one class per request, the
    /// same in `ratewall_request_duration_seconds{outcome}` and on the status page.
    pub enum Outcome {
        /// Forwarded, and the upstream answered (whatever its status).
        Allowed,
        /// 429: a rule denied it.
        Denied,
        /// 401 before any limit was consulted: no key, or an unknown one.
        Unauthorized,
        /// Refused before any limit was consulted as malformed: 400 (a malformed head or
        /// key), 501 (a tunnel).
        BadRequest,
        /// 404: no route matches it, and no pool `default` takes the rest.
        NoRoute,
        /// 503: the store failed and `on_error = "deny"`.
        StoreUnavailable,
        /// 503: shed by the pool's overload protection (its queue full, its place taken
        /// by a higher priority, or `max_wait` passed).
        Overloaded,
        /// 502: the upstream refused, reset, or answered something unreadable.
        UpstreamError,
        /// 504: the upstream did not answer within its `timeout`.
        UpstreamTimeout,
        /// 400 or 408 while forwarding: the client's body was malformed or stalled.
        ClientError,
    }
}

impl Outcome {
    /// A request the gateway answered without forwarding it, by the status it got.
    pub fn answered(status: u16) -> Outcome {
        match status {
            429 => Outcome::Denied,
            503 => Outcome::StoreUnavailable,
            401 => Outcome::Unauthorized,
            404 => Outcome::NoRoute,
            _ => Outcome::BadRequest,
        }
    }

    /// A request forwarded: the upstream's answer, or the gateway's status when
    /// forwarding failed.
    pub fn forwarded(upstream_answered: bool, status: u16) -> Outcome {
        match (upstream_answered, status) {
            (true, _) => Outcome::Allowed,
            (false, 504) => Outcome::UpstreamTimeout,
            (false, 502) => Outcome::UpstreamError,
            (false, _) => Outcome::ClientError,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

const OUTCOMES: usize = Outcome::ALL.len();

/// Latency buckets: bucket `i` holds what took at most `10 µs × 2^(i/3)` (26 % apart), the
/// last one everything longer (about 2.8 min and over).
const BUCKETS: usize = 72;
const BUCKET_BASE_S: f64 = 1e-5;

fn bucket_of(secs: f64) -> usize {
    if secs <= BUCKET_BASE_S || secs.is_nan() {
        return 0;
    }
    let i = ((secs / BUCKET_BASE_S).log2() * 3.0).ceil();
    (i as usize).min(BUCKETS - 1)
}

fn bucket_upper(i: usize) -> f64 {
    BUCKET_BASE_S * 2f64.powf(i as f64 / 3.0)
}

/// Cumulative latency counts, by bucket.
struct Latencies([AtomicU64; BUCKETS]);

impl Latencies {
    fn new() -> Latencies {
        Latencies(std::array::from_fn(|_| AtomicU64::new(0)))
    }

    fn observe(&self, d: Duration) {
        self.0[bucket_of(d.as_secs_f64())].fetch_add(1, Relaxed);
    }

    fn load(&self) -> [u64; BUCKETS] {
        std::array::from_fn(|i| self.0[i].load(Relaxed))
    }
}

/// The last minute's latencies of one thing the status page lists (an upstream server):
/// six ten-second slots of buckets, each reused once its ten seconds are a minute old.
/// Adding is two atomic operations; the slot a new period takes is emptied first (a count
/// added by another thread in that instant may be lost: this is a display, not a metric).
pub struct Recent {
    slots: [Slot; RECENT_SLOTS],
    epoch: Instant,
}

const RECENT_SLOTS: usize = 6;
const RECENT_SLOT_SECS: u64 = WINDOW_SECS / RECENT_SLOTS as u64;

struct Slot {
    /// The period it holds (seconds since `epoch` / [`RECENT_SLOT_SECS`]), plus one: 0 for
    /// none yet.
    period: AtomicU64,
    buckets: Latencies,
}

impl Default for Recent {
    fn default() -> Recent {
        Recent::since(Instant::now())
    }
}

impl Recent {
    /// Counting from `epoch` (tests give their own).
    pub fn since(epoch: Instant) -> Recent {
        Recent {
            slots: std::array::from_fn(|_| Slot {
                period: AtomicU64::new(0),
                buckets: Latencies::new(),
            }),
            epoch,
        }
    }

    fn period(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_secs() / RECENT_SLOT_SECS
    }

    /// Something took `took`, at `now`.
    pub fn observe(&self, now: Instant, took: Duration) {
        let p = self.period(now);
        let slot = &self.slots[(p % RECENT_SLOTS as u64) as usize];
        let held = slot.period.load(Relaxed);
        if held != p + 1
            && slot
                .period
                .compare_exchange(held, p + 1, Relaxed, Relaxed)
                .is_ok()
        {
            for b in &slot.buckets.0 {
                b.store(0, Relaxed);
            }
        }
        slot.buckets.observe(took);
    }

    /// What was observed over the minute up to `now` (its current slot included).
    pub fn window(&self, now: Instant) -> Latency {
        let p = self.period(now);
        let mut sum = [0u64; BUCKETS];
        for slot in &self.slots {
            let held = slot.period.load(Relaxed);
            if held == 0 || held - 1 + (RECENT_SLOTS as u64) <= p || held - 1 > p {
                continue;
            }
            for (s, n) in sum.iter_mut().zip(slot.buckets.load()) {
                *s += n;
            }
        }
        Latency::of(&sum)
    }
}

/// The cumulative counts at one moment.
#[derive(Clone)]
struct Sample {
    /// Unix seconds.
    t: u64,
    outcomes: [u64; OUTCOMES],
    upstream: [u64; BUCKETS],
    store: [u64; BUCKETS],
    store_calls: u64,
    store_errors: u64,
}

impl Sample {
    fn zero(t: u64) -> Sample {
        Sample {
            t,
            outcomes: [0; OUTCOMES],
            upstream: [0; BUCKETS],
            store: [0; BUCKETS],
            store_calls: 0,
            store_errors: 0,
        }
    }
}

fn minus<const N: usize>(a: &[u64; N], b: &[u64; N]) -> [u64; N] {
    std::array::from_fn(|i| a[i].saturating_sub(b[i]))
}

/// Outcome counts by name, as `/status.json` gives them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Outcomes {
    pub allowed: u64,
    pub denied: u64,
    pub unauthorized: u64,
    pub bad_request: u64,
    pub no_route: u64,
    pub store_unavailable: u64,
    pub overloaded: u64,
    pub upstream_error: u64,
    pub upstream_timeout: u64,
    pub client_error: u64,
}

impl Outcomes {
    fn of(c: &[u64; OUTCOMES]) -> Outcomes {
        let n = |o: Outcome| c[o.index()];
        Outcomes {
            allowed: n(Outcome::Allowed),
            denied: n(Outcome::Denied),
            unauthorized: n(Outcome::Unauthorized),
            bad_request: n(Outcome::BadRequest),
            no_route: n(Outcome::NoRoute),
            store_unavailable: n(Outcome::StoreUnavailable),
            overloaded: n(Outcome::Overloaded),
            upstream_error: n(Outcome::UpstreamError),
            upstream_timeout: n(Outcome::UpstreamTimeout),
            client_error: n(Outcome::ClientError),
        }
    }
}

/// One point of the chart: what ended in the `step` seconds up to `t`.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// Unix seconds at the end of the interval.
    pub t: u64,
    /// Its length in seconds, at least 1 (what ended within the second of the point
    /// before is counted in that one).
    pub step: u64,
    #[serde(flatten)]
    pub counts: Outcomes,
}

/// Latency over a window: how many were timed, and their median and 99th percentile
/// (the upper bound of the bucket each falls in: at most 26 % high).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Latency {
    pub count: u64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

impl Latency {
    fn of(buckets: &[u64; BUCKETS]) -> Latency {
        let count: u64 = buckets.iter().sum();
        let quantile = |q: f64| {
            if count == 0 {
                return None;
            }
            // The smallest bucket whose cumulative count reaches q of the total.
            let rank = ((q * count as f64).ceil() as u64).max(1);
            let mut seen = 0;
            buckets.iter().enumerate().find_map(|(i, n)| {
                seen += n;
                (seen >= rank).then(|| (bucket_upper(i) * 1e6).round() / 1e3)
            })
        };
        Latency {
            count,
            p50_ms: quantile(0.5),
            p99_ms: quantile(0.99),
        }
    }
}

/// The last minute (or since start, if shorter), as the status page shows it.
#[derive(Clone, Debug, Serialize)]
pub struct Window {
    /// Seconds the window spans.
    pub secs: u64,
    pub outcomes: Outcomes,
    /// The upstream's answers (time to their head), failures apart.
    pub upstream: Latency,
    /// Store calls (all of a request's rules at once).
    pub store: Latency,
    /// Store calls that failed, and those not tried because the breaker was open.
    pub store_errors: u64,
    /// `store_errors` over the calls made and not made.
    pub store_error_rate: Option<f64>,
}

/// A config load: at start, or a reload (accepted or rejected).
#[derive(Clone, Debug, Serialize)]
pub struct Load {
    /// Unix seconds.
    pub at: u64,
    pub accepted: bool,
    /// Why a reload was rejected.
    pub error: Option<String>,
    /// The SHA-256 (hex) of the config file it read, where it could be read.
    pub sha256: Option<String>,
}

/// Counts since start, the sampled history, the heavy hitters, the config loads.
pub struct Stats {
    started: Instant,
    /// Unix seconds when `started` was taken, so the page can show wall-clock times.
    started_unix: u64,
    outcomes: [AtomicU64; OUTCOMES],
    upstream: Latencies,
    store: Latencies,
    store_calls: AtomicU64,
    store_errors: AtomicU64,
    samples: Mutex<VecDeque<Sample>>,
    top: Mutex<VecDeque<(u64, SpaceSaving)>>,
    /// The config serving now, and the last reload.
    loads: Mutex<(Option<Load>, Option<Load>)>,
}

impl Stats {
    pub fn new() -> Stats {
        let started_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut samples = VecDeque::with_capacity((HISTORY_SECS / SAMPLE_SECS) as usize + 2);
        // Everything is counted from here: the first interval starts at zero.
        samples.push_back(Sample::zero(started_unix));
        Stats {
            started: Instant::now(),
            started_unix,
            outcomes: std::array::from_fn(|_| AtomicU64::new(0)),
            upstream: Latencies::new(),
            store: Latencies::new(),
            store_calls: AtomicU64::new(0),
            store_errors: AtomicU64::new(0),
            samples: Mutex::new(samples),
            top: Mutex::new(VecDeque::new()),
            loads: Mutex::new((None, None)),
        }
    }

    /// Unix seconds now, on the clock the history uses.
    pub fn now(&self) -> u64 {
        self.started_unix + self.started.elapsed().as_secs()
    }

    /// Seconds since the process started.
    pub fn uptime(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// Count one request, ended as `outcome`.
    pub fn ended(&self, outcome: Outcome) {
        self.outcomes[outcome.index()].fetch_add(1, Relaxed);
    }

    /// Time one answer of the upstream (to its head).
    pub fn upstream_answered(&self, took: Duration) {
        self.upstream.observe(took);
    }

    /// Time one store call; `failed` if it did.
    pub fn store_called(&self, took: Duration, failed: bool) {
        self.store.observe(took);
        self.store_calls.fetch_add(1, Relaxed);
        if failed {
            self.store_errors.fetch_add(1, Relaxed);
        }
    }

    /// A store call not made: the breaker is open.
    pub fn store_skipped(&self) {
        self.store_calls.fetch_add(1, Relaxed);
        self.store_errors.fetch_add(1, Relaxed);
    }

    /// Requests by outcome since start.
    pub fn totals(&self) -> Outcomes {
        Outcomes::of(&std::array::from_fn(|i| self.outcomes[i].load(Relaxed)))
    }

    fn current(&self, t: u64) -> Sample {
        Sample {
            t,
            outcomes: std::array::from_fn(|i| self.outcomes[i].load(Relaxed)),
            upstream: self.upstream.load(),
            store: self.store.load(),
            store_calls: self.store_calls.load(Relaxed),
            store_errors: self.store_errors.load(Relaxed),
        }
    }

    /// Keep the counts as they are now in the ring (run every [`SAMPLE_SECS`]); samples
    /// older than [`HISTORY_SECS`] go.
    pub fn sample(&self) {
        let t = self.now();
        let now = self.current(t);
        let mut ring = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let len = ring.len();
        match ring.back_mut() {
            // Two in the same second: the later one stands (the first, at start, stays).
            Some(last) if last.t == t && len > 1 => *last = now,
            _ => ring.push_back(now),
        }
        while ring.len() > 2 && ring[1].t + HISTORY_SECS <= t {
            ring.pop_front();
        }
    }

    /// The chart: outcomes per interval between samples over the last [`HISTORY_SECS`],
    /// the last interval ending now.
    pub fn history(&self) -> Vec<Point> {
        let t = self.now();
        let now = self.current(t);
        let ring = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(u64, u64, [u64; OUTCOMES])> = Vec::with_capacity(ring.len());
        let mut prev = ring.front();
        for s in ring.iter().skip(1).chain(std::iter::once(&now)) {
            if let Some(p) = prev {
                if s.t + HISTORY_SECS > t && (s.t > p.t || s.outcomes != p.outcomes) {
                    let counts = minus(&s.outcomes, &p.outcomes);
                    match out.last_mut() {
                        // What ended in the second of the point before (after its sample,
                        // or up to now) is counted in it: a point of no length is drawn
                        // nowhere, and its requests would be missing from the chart.
                        Some((last, _, sum)) if *last == s.t => {
                            for (n, c) in sum.iter_mut().zip(counts) {
                                *n += c;
                            }
                        }
                        // The first, within the second the process started: one second.
                        _ => out.push((s.t, s.t.saturating_sub(p.t).max(1), counts)),
                    }
                }
            }
            prev = Some(s);
        }
        out.into_iter()
            .map(|(t, step, counts)| Point {
                t,
                step,
                counts: Outcomes::of(&counts),
            })
            .collect()
    }

    /// The last [`WINDOW_SECS`] (from the newest sample at least that old, or from start).
    pub fn window(&self) -> Window {
        let t = self.now();
        let now = self.current(t);
        let ring = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let from = ring
            .iter()
            .rev()
            .find(|s| s.t + WINDOW_SECS <= t)
            .or(ring.front())
            .cloned()
            .unwrap_or_else(|| Sample::zero(self.started_unix));
        drop(ring);
        let calls = now.store_calls.saturating_sub(from.store_calls);
        let errors = now.store_errors.saturating_sub(from.store_errors);
        Window {
            secs: t.saturating_sub(from.t),
            outcomes: Outcomes::of(&minus(&now.outcomes, &from.outcomes)),
            upstream: Latency::of(&minus(&now.upstream, &from.upstream)),
            store: Latency::of(&minus(&now.store, &from.store)),
            store_errors: errors,
            store_error_rate: (calls > 0).then(|| errors as f64 / calls as f64),
        }
    }

    /// The config loaded at start.
    pub fn started_with(&self, sha256: Option<String>) {
        let mut loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
        loads.0 = Some(Load {
            at: self.now(),
            accepted: true,
            error: None,
            sha256,
        });
    }

    /// A reload: accepted (it serves now) or rejected (with why).
    pub fn reloaded(&self, result: Result<(), String>, sha256: Option<String>) {
        let load = Load {
            at: self.now(),
            accepted: result.is_ok(),
            error: result.err(),
            sha256,
        };
        let mut loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
        if load.accepted {
            loads.0 = Some(load.clone());
        }
        loads.1 = Some(load);
    }

    /// The config serving now (when it was loaded), and the last reload, if any.
    pub fn loads(&self) -> (Option<Load>, Option<Load>) {
        self.loads.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Count one denial of the identity `who` under `rule`. `named` is only called when
    /// the identity is new to the current minute's heavy hitters, and its tag made only
    /// when the list is read: a key hammering past its limit costs no allocation and no
    /// keyed hash per denial.
    pub fn limited(&self, who: IdentityDigest, rule: &str, named: impl FnOnce() -> Named) {
        let minute = self.now() / 60;
        let mut top = self.top.lock().unwrap_or_else(|p| p.into_inner());
        if top.back().is_none_or(|(m, _)| *m != minute) {
            top.push_back((minute, SpaceSaving::default()));
            while top.front().is_some_and(|(m, _)| m + 10 <= minute) {
                top.pop_front();
            }
        }
        if let Some((_, s)) = top.back_mut() {
            s.add(who, rule, named);
        }
    }

    /// The most limited identities over the last `minutes` minutes, most first.
    pub fn top(&self, minutes: u64, n: usize) -> Vec<TopEntry> {
        let now = self.now() / 60;
        let top = self.top.lock().unwrap_or_else(|p| p.into_inner());
        // By identity and rule; named as the newest minute names it (a key relabelled
        // meanwhile is one row, with its label now).
        let mut merged: HashMap<(IdentityDigest, &str), (&Limited, u64, u64)> = HashMap::new();
        for (_, s) in top.iter().filter(|(m, _)| m + minutes > now) {
            for e in &s.entries {
                let c = merged
                    .entry((e.who.digest, e.who.rule.as_str()))
                    .or_insert((&e.who, 0, 0));
                c.0 = &e.who;
                c.1 += e.denied;
                c.2 += e.error;
            }
        }
        let mut out: Vec<TopEntry> = merged
            .into_values()
            .map(|(who, denied, error)| TopEntry {
                who: who.clone(),
                denied,
                error,
            })
            .collect();
        out.sort_by(|a, b| {
            b.denied
                .cmp(&a.denied)
                .then_with(|| a.who.digest.0.cmp(&b.who.digest.0))
        });
        out.truncate(n);
        out
    }
}

impl Default for Stats {
    fn default() -> Self {
        Self::new()
    }
}

/// One limited identity: its digest (shown as its tag, `id`), what an operator
/// recognises it by, the rule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Limited {
    #[serde(rename = "id", serialize_with = "as_tag")]
    pub digest: IdentityDigest,
    #[serde(flatten)]
    pub named: Named,
    pub rule: String,
}

/// What an operator recognises a limited identity by, beside its tag.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Named {
    /// Its kind and, for token holders, a part of it (`key …9f3e`, `ip 192.0.2.x`).
    pub hint: String,
    /// Its API key's label, where it is counted by a key listed with one: an operator's
    /// name for a customer, shown on the public page too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// The claim values of a token it is counted by (`sub=alice`): for admin views only,
    /// taken off the public page's copy (see `admin::stats`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claims: Option<String>,
}

/// The keyed tag of `digest`, made as the list is read (the secret may have come after
/// the denial).
fn as_tag<S: serde::Serializer>(digest: &IdentityDigest, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(digest.tag().as_str())
}

#[derive(Clone, Debug, Serialize)]
pub struct TopEntry {
    #[serde(flatten)]
    pub who: Limited,
    /// Denials counted (space-saving: may over-count by at most `error`).
    pub denied: u64,
    pub error: u64,
}

/// The space-saving heavy-hitters sketch (Metwally et al.): `TOP_K` counters; a new item
/// when full replaces the smallest, inheriting its count as its possible error.
#[derive(Default)]
struct SpaceSaving {
    entries: Vec<TopEntry>,
}

impl SpaceSaving {
    fn add(&mut self, who: IdentityDigest, rule: &str, named: impl FnOnce() -> Named) {
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.who.digest == who && e.who.rule == rule)
        {
            e.denied += 1;
            return;
        }
        let who = Limited {
            digest: who,
            named: named(),
            rule: rule.to_string(),
        };
        if self.entries.len() < TOP_K {
            self.entries.push(TopEntry {
                who,
                denied: 1,
                error: 0,
            });
            return;
        }
        if let Some(min) = self.entries.iter_mut().min_by_key(|e| e.denied) {
            let floor = min.denied;
            *min = TopEntry {
                who,
                denied: floor + 1,
                error: floor,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(s: &mut SpaceSaving, w: Limited) {
        s.add(w.digest, &w.rule, || w.named.clone());
    }

    fn who(i: u32) -> Limited {
        let mut digest = [0u8; 16];
        digest[..4].copy_from_slice(&i.to_be_bytes());
        Limited {
            digest: IdentityDigest(digest),
            named: Named::default(),
            rule: "api".into(),
        }
    }

    #[test]
    fn recent_keeps_one_minute_of_latencies() {
        let t0 = Instant::now();
        let r = Recent::since(t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        for _ in 0..99 {
            r.observe(at(1), Duration::from_millis(1));
        }
        r.observe(at(1), Duration::from_secs(1));
        let w = r.window(at(5));
        assert_eq!(w.count, 100);
        assert!(w.p50_ms.unwrap() >= 1.0 && w.p50_ms.unwrap() < 1.3, "{w:?}");
        assert!(
            w.p99_ms.unwrap() < 1.3,
            "the 100th is above the 99th: {w:?}"
        );
        // 40 s on, another 10 arrive: 110 in the minute.
        for _ in 0..10 {
            r.observe(at(41), Duration::from_millis(5));
        }
        assert_eq!(r.window(at(45)).count, 110);
        // A minute after the first slot, it is gone; its slot is reused.
        assert_eq!(r.window(at(61)).count, 10);
        r.observe(at(62), Duration::from_millis(2));
        assert_eq!(r.window(at(62)).count, 11);
        assert_eq!(r.window(at(200)).count, 0);
    }

    #[test]
    fn space_saving_keeps_the_heavy_hitters() {
        let mut s = SpaceSaving::default();
        // Three heavy identities among a flood of one-off ones.
        for round in 0..1_000u32 {
            for heavy in 0..3 {
                add(&mut s, who(heavy));
            }
            add(&mut s, who(1_000 + round));
        }
        assert_eq!(s.entries.len(), TOP_K);
        let mut top: Vec<&TopEntry> = s.entries.iter().collect();
        top.sort_by_key(|e| std::cmp::Reverse(e.denied));
        let ids: Vec<IdentityDigest> = top[..3].iter().map(|e| e.who.digest).collect();
        assert_eq!(ids.len(), 3);
        for heavy in 0..3 {
            assert!(ids.contains(&who(heavy).digest));
        }
        for e in &top[..3] {
            assert!(e.denied >= 1_000 && e.denied - e.error <= 1_000);
        }
    }

    #[test]
    fn outcomes_count_exactly_in_totals_history_and_window() {
        let st = Stats::new();
        for _ in 0..7 {
            st.ended(Outcome::Allowed);
        }
        for _ in 0..3 {
            st.ended(Outcome::Denied);
            let w = who(9);
            st.limited(w.digest, &w.rule, || w.named.clone());
        }
        st.ended(Outcome::StoreUnavailable);
        st.ended(Outcome::Overloaded);
        st.ended(Outcome::Overloaded);
        st.sample();
        st.ended(Outcome::UpstreamTimeout);
        let want = Outcomes {
            allowed: 7,
            denied: 3,
            store_unavailable: 1,
            overloaded: 2,
            upstream_timeout: 1,
            ..Outcomes::default()
        };
        assert_eq!(st.totals(), want);
        let h = st.history();
        // The page draws a point over its `step` seconds: one of none would be lost.
        assert!(h.iter().all(|p| p.step >= 1), "{h:?}");
        let ends: Vec<u64> = h.iter().map(|p| p.t).collect();
        assert!(
            ends.windows(2).all(|w| w[0] < w[1]),
            "one point a second at most: {h:?}"
        );
        let sum = |f: fn(&Outcomes) -> u64| h.iter().map(|p| f(&p.counts)).sum::<u64>();
        assert_eq!(sum(|o| o.allowed), 7, "{h:?}");
        assert_eq!(sum(|o| o.denied), 3, "{h:?}");
        assert_eq!(sum(|o| o.upstream_timeout), 1, "{h:?}");
        assert_eq!(sum(|o| o.overloaded), 2, "{h:?}");
        assert_eq!(st.window().outcomes, want);
        let top = st.top(5, 10);
        assert_eq!(top.len(), 1);
        assert_eq!((top[0].denied, top[0].error), (3, 0));
    }

    /// An identity limited in two minutes is one row of the list, its denials summed and
    /// named as the newer minute names it (a key relabelled meanwhile).
    #[test]
    fn the_top_is_one_row_an_identity_named_as_last_seen() {
        let st = Stats::new();
        let minute = st.now() / 60;
        let named = |label: &str| {
            let mut s = SpaceSaving::default();
            for _ in 0..2 {
                s.add(who(1).digest, "api", || Named {
                    label: Some(label.into()),
                    ..Named::default()
                });
            }
            s
        };
        {
            let mut top = st.top.lock().unwrap();
            top.push_back((minute - 1, named("Old Name")));
            top.push_back((minute, named("New Name")));
        }
        let top = st.top(5, 10);
        assert_eq!(top.len(), 1, "{top:?}");
        assert_eq!(top[0].denied, 4);
        assert_eq!(top[0].who.named.label.as_deref(), Some("New Name"));
    }

    #[test]
    fn buckets_bound_their_values_within_26_percent() {
        for us in [1u64, 10, 11, 95, 1_000, 12_345, 250_000, 3_000_000] {
            let s = us as f64 / 1e6;
            let i = bucket_of(s);
            assert!(bucket_upper(i) >= s * 0.999_999, "{us} µs in bucket {i}");
            if i > 0 {
                assert!(
                    bucket_upper(i) <= s.max(BUCKET_BASE_S) * 1.26 + 1e-12,
                    "{us} µs"
                );
            }
        }
        assert_eq!(bucket_of(1e9), BUCKETS - 1);
    }

    #[test]
    fn percentiles_come_from_the_window_s_buckets() {
        let mut b = [0u64; BUCKETS];
        // 98 fast (1 ms), 2 slow (300 ms): the median is fast, the 99th slow.
        b[bucket_of(0.001)] = 98;
        b[bucket_of(0.3)] = 2;
        let l = Latency::of(&b);
        assert_eq!(l.count, 100);
        let (p50, p99) = (l.p50_ms.unwrap_or(0.0), l.p99_ms.unwrap_or(0.0));
        assert!((1.0..1.27).contains(&p50), "{l:?}");
        assert!((300.0..378.0).contains(&p99), "{l:?}");
        assert_eq!(Latency::of(&[0; BUCKETS]).p99_ms, None);
    }

    #[test]
    fn store_error_rate_counts_calls_made_and_skipped() {
        let st = Stats::new();
        st.store_called(Duration::from_micros(100), false);
        st.store_called(Duration::from_millis(50), true);
        st.store_skipped();
        st.store_skipped();
        let w = st.window();
        assert_eq!(w.store.count, 2);
        assert_eq!(w.store_errors, 3);
        assert_eq!(w.store_error_rate, Some(0.75));
    }
}
