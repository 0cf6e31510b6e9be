//! Prometheus metrics (`GET /metrics` on the admin listener) and the in-process stats the
//! status page and `/admin/*` read: per-second allowed/denied counts for the last minutes
//! and the top limited identities.
//!
//! Label sets are bounded: rule names (from the config), fixed enums, status classes.
//! Never an API key, never an IP.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// How a rule's decision on one request is counted (`decision=`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum DecisionLabel {
    /// The rule allowed the request (charged, or not charged because another rule denied).
    Allowed,
    /// The rule allowed the request after it waited for its tokens (`max_delay`).
    Delayed,
    /// The rule denied the request.
    Denied,
    /// A shadow rule would have denied it, but let it pass.
    ShadowDenied,
    /// The store failed; `on_error` answered.
    Error,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabels {
    pub rule: String,
    pub decision: DecisionLabel,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// No answer within `[store].timeout`.
    Timeout,
    /// Refused, dropped or otherwise unreachable.
    Connection,
    /// One key's data (wrong type, corrupt state).
    Data,
    /// Not tried: the circuit breaker is open.
    BreakerOpen,
    /// The memory store had no room for a new key (every key in the way is being denied).
    Full,
    /// Anything else the store answered unexpectedly.
    Other,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreErrorLabels {
    pub kind: StoreErrorKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreLabels {
    pub backend: &'static str,
}

/// An in-process store: `memory` (the configured backend) or `local` (the `on_error =
/// "local"` fallback).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MemoryLabels {
    pub store: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    /// `gateway` or `admin`.
    pub listener: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClosedLabels {
    pub listener: &'static str,
    /// The clock that ran out (`header_timeout`, `idle_timeout`, `body_timeout`,
    /// `send_timeout`), or `make_room` (idle, closed at `max_connections`).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EvictionLabels {
    pub store: &'static str,
    /// `expired` (equivalent to no entry), `lru` (live, not being denied) or `held`
    /// (being denied, when nothing else could make room).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabels {
    /// `2xx`..`5xx` from the upstream, or `error` (refused, timed out, reset).
    pub class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResponseLabels {
    /// The status class the client got.
    pub class: &'static str,
    /// Who answered: `upstream` or `gateway` (401, 429, 502, 503, 504...).
    pub source: &'static str,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ReloadResult {
    Ok,
    Rejected,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    pub result: ReloadResult,
}

/// Label values in snake_case, as Prometheus conventions have them.
macro_rules! label_values {
    ($($ty:ident { $($variant:ident => $name:literal),* })*) => {$(
        impl $ty {
            pub fn name(self) -> &'static str {
                match self { $($ty::$variant => $name),* }
            }
        }
        impl EncodeLabelValue for $ty {
            fn encode(&self, e: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
                std::fmt::Write::write_str(e, self.name())
            }
        }
    )*};
}

label_values! {
    DecisionLabel { Allowed => "allowed", Delayed => "delayed", Denied => "denied", ShadowDenied => "shadow_denied", Error => "error" }
    StoreErrorKind { Timeout => "timeout", Connection => "connection", Data => "data", BreakerOpen => "breaker_open", Full => "full", Other => "other" }
    ReloadResult { Ok => "ok", Rejected => "rejected" }
}

/// The classes [`status_class`] names, in order, and "error" (upstream failures).
const CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "error"];

fn class_index(class: &str) -> usize {
    CLASSES
        .iter()
        .position(|c| *c == class)
        .unwrap_or(CLASSES.len() - 1)
}

pub fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

pub struct Metrics {
    registry: Registry,
    pub requests: Family<RuleLabels, Counter>,
    pub responses: Family<ResponseLabels, Counter>,
    pub store_duration: Family<StoreLabels, Histogram>,
    pub store_errors: Family<StoreErrorLabels, Counter>,
    pub upstream_duration: Histogram,
    pub upstream_responses: Family<ClassLabels, Counter>,
    pub deny_cache_hits: Counter,
    pub breaker_open: Gauge,
    pub reloads: Family<ReloadLabels, Counter>,
    pub in_flight: Gauge,
    /// Requests waiting for reserved tokens (`max_delay`) now.
    pub waiting: Gauge,
    /// Keys the in-process stores hold, as of the last sweep.
    pub memory_keys: Family<MemoryLabels, Gauge>,
    /// Entries the in-process stores dropped to make room for new keys.
    pub memory_evictions: Family<EvictionLabels, Counter>,
    pub connections_open: Family<ListenerLabels, Gauge>,
    pub connections_closed: Family<ClosedLabels, Counter>,
    pub accept_errors: Family<ListenerLabels, Counter>,
    /// `responses` and `upstream_responses` handles, resolved on first use: counting a
    /// response then takes no lock and hashes no labels (a series still appears only once
    /// it has been counted).
    response_handles: [[std::sync::OnceLock<Counter>; 2]; 6],
    upstream_handles: [std::sync::OnceLock<Counter>; 6],
    pub stats: Stats,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("ratewall");
        let requests = Family::<RuleLabels, Counter>::default();
        registry.register(
            "requests",
            "Decisions by rule: allowed, delayed (allowed after waiting, max_delay), denied, shadow_denied (would have denied: shadow mode or outside enforce_percent), error (store failed)",
            requests.clone(),
        );
        let responses = Family::<ResponseLabels, Counter>::default();
        registry.register(
            "responses",
            "Responses sent to clients, by status class and by who answered (upstream or gateway)",
            responses.clone(),
        );
        let store_duration = Family::<StoreLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 0.5, 1.0,
            ])
        });
        registry.register(
            "store_call_duration_seconds",
            "Time of one store call (one per limited request), by backend",
            store_duration.clone(),
        );
        let store_errors = Family::<StoreErrorLabels, Counter>::default();
        registry.register(
            "store_errors",
            "Store calls that failed, by kind",
            store_errors.clone(),
        );
        let upstream_duration = Histogram::new([
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0,
        ]);
        registry.register(
            "upstream_duration_seconds",
            "Time until the upstream's response head (or its failure)",
            upstream_duration.clone(),
        );
        let upstream_responses = Family::<ClassLabels, Counter>::default();
        registry.register(
            "upstream_responses",
            "Upstream answers by status class, or error (refused, timed out, reset)",
            upstream_responses.clone(),
        );
        let deny_cache_hits = Counter::default();
        registry.register(
            "deny_cache_hits",
            "Requests denied from the local cache of denials, without a store call",
            deny_cache_hits.clone(),
        );
        let breaker_open = Gauge::default();
        registry.register(
            "store_breaker_open",
            "1 while the store's circuit breaker is open (on_error applied without trying the store)",
            breaker_open.clone(),
        );
        let reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "config_reloads",
            "Config reloads (SIGHUP) by result",
            reloads.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "in_flight_requests",
            "Requests being handled now",
            in_flight.clone(),
        );
        let waiting = Gauge::default();
        registry.register(
            "waiting_requests",
            "Requests waiting for their reserved tokens (max_delay) before they are forwarded",
            waiting.clone(),
        );
        let memory_keys = Family::<MemoryLabels, Gauge>::default();
        registry.register(
            "store_keys",
            "Keys the in-process store holds (store=memory: the memory backend; store=local: the on_error = \"local\" fallback), as of the last sweep",
            memory_keys.clone(),
        );
        let memory_evictions = Family::<EvictionLabels, Counter>::default();
        registry.register(
            "store_evictions",
            "Entries an in-process store dropped to make room for a new key at max_keys: reason=expired (already equivalent to none), lru (the least recently used not being denied), held (the least recently denied, when a shard held nothing else)",
            memory_evictions.clone(),
        );
        for store in ["memory", "local"] {
            let _ = memory_keys.get_or_create(&MemoryLabels { store });
            for reason in ["expired", "lru", "held"] {
                let _ = memory_evictions.get_or_create(&EvictionLabels { store, reason });
            }
        }
        let connections_open = Family::<ListenerLabels, Gauge>::default();
        registry.register(
            "connections",
            "Client connections open now, by listener",
            connections_open.clone(),
        );
        let connections_closed = Family::<ClosedLabels, Counter>::default();
        registry.register(
            "connections_closed",
            "Client connections the gateway closed, by listener and why: the clock that ran out (header_timeout, idle_timeout, body_timeout, send_timeout) or make_room (idle, closed at max_connections)",
            connections_closed.clone(),
        );
        let accept_errors = Family::<ListenerLabels, Counter>::default();
        registry.register(
            "accept_errors",
            "Failed accepts (out of file descriptors, say), by listener",
            accept_errors.clone(),
        );
        Metrics {
            connections_open,
            connections_closed,
            accept_errors,
            memory_keys,
            memory_evictions,
            response_handles: Default::default(),
            upstream_handles: Default::default(),
            waiting,
            registry,
            requests,
            responses,
            store_duration,
            store_errors,
            upstream_duration,
            upstream_responses,
            deny_cache_hits,
            breaker_open,
            reloads,
            in_flight,
            stats: Stats::new(),
        }
    }

    /// Count one response to a client, of `class` (see [`status_class`]), answered by the
    /// upstream or by the gateway.
    pub fn count_response(&self, class: &'static str, upstream: bool) {
        let source = if upstream { "upstream" } else { "gateway" };
        self.response_handles[class_index(class)][usize::from(upstream)]
            .get_or_init(|| {
                self.responses
                    .get_or_create(&ResponseLabels { class, source })
                    .clone()
            })
            .inc();
    }

    /// Count one upstream answer of `class`, or "error".
    pub fn count_upstream(&self, class: &'static str) {
        self.upstream_handles[class_index(class)]
            .get_or_init(|| {
                self.upstream_responses
                    .get_or_create(&ClassLabels { class })
                    .clone()
            })
            .inc();
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The connection metrics of one listener (`gateway` or `admin`), every series
    /// created now, at zero.
    pub fn connections(&self, listener: &'static str) -> crate::connection::ConnectionMetrics {
        let closed = crate::connection::Closed::ALL.map(|why| {
            self.connections_closed
                .get_or_create(&ClosedLabels {
                    listener,
                    reason: why.name(),
                })
                .clone()
        });
        crate::connection::ConnectionMetrics {
            open: self
                .connections_open
                .get_or_create(&ListenerLabels { listener })
                .clone(),
            closed,
            accept_errors: self
                .accept_errors
                .get_or_create(&ListenerLabels { listener })
                .clone(),
        }
    }

    /// The key count gauge of the in-process store `store`.
    pub fn store_keys(&self, store: &'static str) -> Gauge {
        self.memory_keys
            .get_or_create(&MemoryLabels { store })
            .clone()
    }

    /// One rule's decision counters, resolved once (at config load) so that counting a
    /// request allocates nothing and takes no lock.
    pub fn rule_counters(&self, rule: &str) -> RuleCounters {
        let counter = |decision| {
            self.requests
                .get_or_create(&RuleLabels {
                    rule: rule.to_string(),
                    decision,
                })
                .clone()
        };
        RuleCounters {
            allowed: counter(DecisionLabel::Allowed),
            delayed: counter(DecisionLabel::Delayed),
            denied: counter(DecisionLabel::Denied),
            shadow_denied: counter(DecisionLabel::ShadowDenied),
            error: counter(DecisionLabel::Error),
        }
    }
}

/// `ratewall_requests_total` for one rule, one handle per decision (handles share the
/// registered counters).
#[derive(Clone)]
pub struct RuleCounters {
    pub allowed: Counter,
    pub delayed: Counter,
    pub denied: Counter,
    pub shadow_denied: Counter,
    pub error: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// A guard that holds a gauge one higher until dropped (requests in flight, waiting).
pub struct Gauged<'a>(&'a Gauge);

impl<'a> Gauged<'a> {
    pub fn new(g: &'a Gauge) -> Self {
        g.inc();
        Gauged(g)
    }
}

impl Drop for Gauged<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

// ---------------------------------------------------------------------------------------

/// Seconds of history kept for the status page's chart.
pub const HISTORY_SECS: u64 = 600;
/// Identities tracked per minute by the space-saving top-k.
const TOP_K: usize = 64;

/// Requests limited, per second, for the last [`HISTORY_SECS`], and the most limited
/// identities per minute for the last 10 minutes. Bounded memory whatever the traffic.
pub struct Stats {
    started: Instant,
    /// Unix seconds when `started` was taken, so the page can show wall-clock times.
    started_unix: u64,
    seconds: Mutex<VecDeque<Second>>,
    top: Mutex<VecDeque<(u64, SpaceSaving)>>,
    /// Requests since start that the rules allowed / denied, for exact totals.
    pub allowed: AtomicI64,
    pub denied: AtomicI64,
}

#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Second {
    /// Unix seconds.
    pub t: u64,
    pub allowed: u64,
    pub denied: u64,
}

/// One limited identity: its digest (short hex), a hint an operator can recognise, the rule.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Limited {
    pub id: String,
    pub hint: String,
    pub rule: String,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct TopEntry {
    #[serde(flatten)]
    pub who: Limited,
    /// Denials counted (space-saving: may over-count by at most `error`).
    pub denied: u64,
    pub error: u64,
}

impl Stats {
    fn new() -> Stats {
        Stats {
            started: Instant::now(),
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            seconds: Mutex::new(VecDeque::with_capacity(HISTORY_SECS as usize + 1)),
            top: Mutex::new(VecDeque::new()),
            allowed: AtomicI64::new(0),
            denied: AtomicI64::new(0),
        }
    }

    /// Unix seconds now, on the clock the history uses.
    pub fn now(&self) -> u64 {
        self.now_unix()
    }

    fn now_unix(&self) -> u64 {
        self.started_unix + self.started.elapsed().as_secs()
    }

    /// Count one request the rules allowed or denied.
    pub fn record(&self, allowed: bool) {
        let t = self.now_unix();
        if allowed {
            self.allowed.fetch_add(1, Relaxed);
        } else {
            self.denied.fetch_add(1, Relaxed);
        }
        let mut secs = self.seconds.lock().unwrap_or_else(|p| p.into_inner());
        match secs.back_mut() {
            Some(s) if s.t == t => {
                if allowed {
                    s.allowed += 1
                } else {
                    s.denied += 1
                }
            }
            _ => {
                secs.push_back(Second {
                    t,
                    allowed: u64::from(allowed),
                    denied: u64::from(!allowed),
                });
                while secs.front().is_some_and(|s| s.t + HISTORY_SECS <= t) {
                    secs.pop_front();
                }
            }
        }
    }

    /// Count one denial of the identity shown as `id` under `rule`. `hint` is only made
    /// when the identity is new to the current minute's heavy hitters: a key hammering
    /// past its limit costs no allocation per denial.
    pub fn limited(&self, id: &str, rule: &str, hint: impl FnOnce() -> String) {
        let minute = self.now_unix() / 60;
        let mut top = self.top.lock().unwrap_or_else(|p| p.into_inner());
        if top.back().is_none_or(|(m, _)| *m != minute) {
            top.push_back((minute, SpaceSaving::default()));
            while top.front().is_some_and(|(m, _)| m + 10 <= minute) {
                top.pop_front();
            }
        }
        if let Some((_, s)) = top.back_mut() {
            s.add(id, rule, hint);
        }
    }

    /// Per-second counts of the last `secs` seconds that had traffic.
    pub fn history(&self, secs: u64) -> Vec<Second> {
        let now = self.now_unix();
        let s = self.seconds.lock().unwrap_or_else(|p| p.into_inner());
        s.iter().filter(|s| s.t + secs > now).copied().collect()
    }

    /// The most limited identities over the last `minutes` minutes, most first.
    pub fn top(&self, minutes: u64, n: usize) -> Vec<TopEntry> {
        let now = self.now_unix() / 60;
        let top = self.top.lock().unwrap_or_else(|p| p.into_inner());
        let mut merged: HashMap<&Limited, (u64, u64)> = HashMap::new();
        for (m, s) in top.iter().filter(|(m, _)| m + minutes > now) {
            let _ = m;
            for e in &s.entries {
                let c = merged.entry(&e.who).or_default();
                c.0 += e.denied;
                c.1 += e.error;
            }
        }
        let mut out: Vec<TopEntry> = merged
            .into_iter()
            .map(|(who, (denied, error))| TopEntry {
                who: who.clone(),
                denied,
                error,
            })
            .collect();
        out.sort_by(|a, b| {
            b.denied
                .cmp(&a.denied)
                .then_with(|| a.who.id.cmp(&b.who.id))
        });
        out.truncate(n);
        out
    }
}

/// The space-saving heavy-hitters sketch (Metwally et al.): `TOP_K` counters; a new item
/// when full replaces the smallest, inheriting its count as its possible error.
#[derive(Default)]
struct SpaceSaving {
    entries: Vec<TopEntry>,
}

impl SpaceSaving {
    fn add(&mut self, id: &str, rule: &str, hint: impl FnOnce() -> String) {
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.who.id == id && e.who.rule == rule)
        {
            e.denied += 1;
            return;
        }
        let who = Limited {
            id: id.to_string(),
            hint: hint(),
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
        s.add(&w.id, &w.rule, || w.hint.clone());
    }

    fn who(i: u32) -> Limited {
        Limited {
            id: format!("{i:08x}"),
            hint: String::new(),
            rule: "api".into(),
        }
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
        let ids: Vec<&str> = top[..3].iter().map(|e| e.who.id.as_str()).collect();
        assert_eq!(ids.len(), 3);
        for heavy in 0..3 {
            assert!(ids.contains(&who(heavy).id.as_str()));
        }
        for e in &top[..3] {
            assert!(e.denied >= 1_000 && e.denied - e.error <= 1_000);
        }
    }

    #[test]
    fn stats_count_exactly_and_top_merges_minutes() {
        let st = Stats::new();
        for _ in 0..7 {
            st.record(true);
        }
        for _ in 0..3 {
            st.record(false);
            let w = who(9);
            st.limited(&w.id, &w.rule, || w.hint.clone());
        }
        let h = st.history(60);
        assert_eq!(h.iter().map(|s| s.allowed).sum::<u64>(), 7);
        assert_eq!(h.iter().map(|s| s.denied).sum::<u64>(), 3);
        let top = st.top(5, 10);
        assert_eq!(top.len(), 1);
        assert_eq!((top[0].denied, top[0].error), (3, 0));
    }

    #[test]
    fn metrics_encode_with_the_prefix_and_no_identities() {
        let m = Metrics::new();
        m.rule_counters("api").denied.inc();
        let text = m.encode();
        assert!(
            text.contains("ratewall_requests_total{rule=\"api\",decision=\"denied\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE ratewall_upstream_duration_seconds histogram"),
            "{text}"
        );
        assert!(text.contains("ratewall_in_flight_requests 0"), "{text}");
    }
}
