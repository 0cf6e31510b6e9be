//! The pools a config names, running: each pool's servers (a host name's every address
//! one server, resolved again every `resolve_every`), their health (passive, from the
//! requests' own outcomes; active, from a checker task per pool), the retry budget, and
//! the one thing the request path asks of them: [`Pool::forward`] — pick a server, send,
//! and where the attempt failed before any answer and the request may go again, another.
//!
//! Built once per config load and kept across reloads while a pool's settings are
//! unchanged ([`Pools::build`]): its kept-alive connections and its servers' health
//! survive. A reload that changes a pool builds it anew; requests in flight finish on the
//! old one, which goes once the last of them drops it (its tasks see that and stop).

use crate::overload::{Permit, Shed};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use http::Response;
use serde::Serialize;

use super::balance::{Balancer, Candidate, Candidates};
use super::budget::RetryBudget;
use super::health::{panic_pick, HealthEvent, HealthPolicy, HealthState, ServerHealth};
use super::metrics::{Attempt, PoolCounters, PoolMetrics, ServerCounters};
use super::{
    Client, Downstream, Error, OutageChange, OutageLog, Outbound, PoolSettings, ResponseBody,
    ServerSettings, Settings, TlsHandshakes, MAX_RETRIES,
};
use crate::telemetry::stats::Recent;

/// Every pool of a config, in its order (`Config.upstreams`): a route names its pool by
/// position.
pub struct Pools {
    list: Vec<Arc<Pool>>,
}

impl Pools {
    /// The pools `settings` describe, each taken from `old` where its settings are the
    /// same (connections and health kept), else built anew. Must run inside a tokio
    /// runtime for the pools' tasks (re-resolving, health checks) to start; without one
    /// (a `ratewall check`), none start.
    pub fn build(
        settings: &[PoolSettings],
        old: Option<&Pools>,
        workers: usize,
        metrics: &PoolMetrics,
        handshakes: impl Fn(bool) -> TlsHandshakes,
    ) -> Pools {
        let list: Vec<Arc<Pool>> = settings
            .iter()
            .map(|s| {
                let kept = old.and_then(|o| {
                    o.list
                        .iter()
                        .find(|p| p.settings == *s && p.workers == workers)
                });
                match kept {
                    Some(p) => p.clone(),
                    None => {
                        let https = s.servers.iter().any(|x| x.tls.is_some());
                        Pool::start(s.clone(), workers, metrics, handshakes(https))
                    }
                }
            })
            .collect();
        metrics.retain(
            settings
                .iter()
                .map(|s| {
                    let servers = s.servers.iter().map(ServerSettings::label).collect();
                    (s.name.clone(), servers)
                })
                .collect(),
        );
        Pools { list }
    }

    /// The pool at `index` in the config's `upstreams`.
    pub fn get(&self, index: usize) -> Option<&Arc<Pool>> {
        self.list.get(index)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.list.iter()
    }

    /// Close idle connections that expired or that their server closed.
    pub fn sweep(&self) {
        for pool in &self.list {
            for server in pool.servers.load().list.iter() {
                for client in server.clients.iter() {
                    client.sweep();
                }
            }
        }
    }

    /// What the status page shows of each pool, at `now`.
    pub fn status(&self) -> Vec<PoolStatus> {
        let now = Instant::now();
        self.list.iter().map(|p| p.status(now)).collect()
    }
}

/// One pool: its settings, its servers now, and what is shared across its requests.
pub struct Pool {
    pub settings: PoolSettings,
    servers: ArcSwap<ServerSet>,
    /// Its passive and active health rules, the same for each of its servers.
    policy: HealthPolicy,
    budget: RetryBudget,
    counters: PoolCounters,
    metrics: PoolMetrics,
    /// Whether the pool has a server to take requests, for the log: one line when it has
    /// none left, one when it has again.
    outage: OutageLog,
    /// Per-worker clients per server.
    workers: usize,
    /// `overload = { … }`: its concurrency limit and queue, if it has one.
    overload: Option<Arc<crate::overload::Overload>>,
    handshakes: TlsHandshakes,
}

/// A pool's servers at one moment, and the balancer over them (rebuilt with them).
struct ServerSet {
    list: Vec<Arc<Server>>,
    balancer: Balancer,
}

/// One server: an address of one of the pool's `servers`.
pub struct Server {
    /// Its `servers` entry's URL, as the file writes it (the metrics' label).
    pub label: Arc<str>,
    /// Which `servers` entry it comes from.
    entry: usize,
    /// What places it on a hashing pool's ring: its label, and the address it resolved
    /// to where its name gave several (every gateway resolving the same addresses places
    /// them alike).
    ring_key: Box<str>,
    /// The address it was resolved to; `None` for a name not resolved yet (each connection
    /// resolves it then).
    pub addr: Option<SocketAddr>,
    weight: u32,
    /// One per worker thread, each with its own kept connections.
    clients: Box<[Client]>,
    /// For a pool that speaks HTTP/2 (`protocol` h2, h2c, auto): its connections, shared
    /// by the workers.
    http2: Option<super::h2::Http2>,
    health: ServerHealth,
    in_flight: AtomicU32,
    counters: ServerCounters,
    /// Its answers' latencies over the last minute, for the status page.
    recent: Recent,
    /// Attempts sent to it since it was built.
    attempts: AtomicU64,
}

/// What became of a request sent to a pool.
pub struct Forwarded {
    pub result: Result<Response<ResponseBody>, Error>,
    /// The server of the last attempt (its label), if any was made.
    pub server: Option<Arc<str>>,
    /// How many servers were tried (0: none could be).
    pub attempts: u32,
}

/// How a pool picks for one request: the hash of its identity for `hash:` balancing, and
/// the worker thread serving it (whose kept connections it uses).
#[derive(Debug, Clone, Copy, Default)]
pub struct Pick {
    pub hash: Option<u64>,
    pub worker: usize,
}

impl Pool {
    /// Build the pool for `settings` and start its tasks.
    fn start(
        settings: PoolSettings,
        workers: usize,
        metrics: &PoolMetrics,
        handshakes: TlsHandshakes,
    ) -> Arc<Pool> {
        if let Some(tls) = settings
            .servers
            .iter()
            .filter_map(|s| s.tls.as_ref())
            .find(|t| t.options().insecure_skip_verify)
        {
            tracing::warn!(
                pool = settings.name.as_str(),
                tls = %tls.describe(),
                "INSECURE: insecure_skip_verify = true: the backend's TLS certificate is NOT verified; anyone on the path can pose as the backend. For a test bench only: give the backend's CA as ca instead"
            );
        }
        let workers = workers.max(1);
        let overload = settings
            .overload
            .map(|o| crate::overload::Overload::new(o, &settings.name, &metrics.overload));
        let pool = Arc::new(Pool {
            overload,
            counters: metrics.pool(&settings.name),
            metrics: metrics.clone(),
            budget: RetryBudget::new(Instant::now()),
            policy: HealthPolicy::new(
                &settings.passive,
                settings.health.as_ref(),
                settings.connect_timeout + settings.timeout,
            ),
            outage: OutageLog::default(),
            workers,
            handshakes,
            servers: ArcSwap::from_pointee(ServerSet {
                list: Vec::new(),
                balancer: Balancer::new(&settings.balance, []),
            }),
            settings,
        });
        let first: Vec<Arc<Server>> = (0..pool.settings.servers.len())
            .map(|entry| pool.server(entry, literal_address(&pool.settings.servers[entry])))
            .collect();
        pool.install(first);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            if pool
                .settings
                .servers
                .iter()
                .any(|s| literal_address(s).is_none())
            {
                rt.spawn(resolve_loop(Arc::downgrade(&pool)));
            }
            if pool.settings.health.is_some() {
                rt.spawn(check_loop(Arc::downgrade(&pool)));
            }
        }
        pool
    }

    /// A server for `servers[entry]` at `addr`, its series created.
    fn server(&self, entry: usize, addr: Option<SocketAddr>) -> Arc<Server> {
        let s = &self.settings.servers[entry];
        let settings = Settings {
            url: s.url.clone(),
            tls: s.tls.clone(),
            base_path: s.base_path.clone(),
            connect_timeout: self.settings.connect_timeout,
            timeout: self.settings.timeout,
        };
        let label: Arc<str> = s.label().into();
        let counters = self.metrics.server(&self.settings.name, &label);
        let ring_key = match (addr, literal_address(s)) {
            (Some(a), None) => format!("{label}@{a}"),
            _ => label.to_string(),
        }
        .into_boxed_str();
        let protocol = self.settings.protocol;
        let http2 = protocol.is_http2().then(|| {
            let opener = Client::at(&settings, addr, self.handshakes.clone());
            super::h2::Http2::new(opener, protocol)
        });
        Arc::new(Server {
            http2,
            ring_key,
            clients: (0..self.workers)
                .map(|_| Client::at(&settings, addr, self.handshakes.clone()))
                .collect(),
            label,
            entry,
            addr,
            weight: s.weight,
            health: ServerHealth::new(&self.policy, Instant::now()),
            in_flight: AtomicU32::new(0),
            counters,
            recent: Recent::default(),
            attempts: AtomicU64::new(0),
        })
    }

    /// Its overload protection, if it has one.
    pub fn overload(&self) -> Option<&Arc<crate::overload::Overload>> {
        self.overload.as_ref()
    }

    /// A request's place with the pool's overload protection, at `priority`: its permit
    /// (none needed where the pool has no protection), or why it was shed.
    pub async fn admit(&self, priority: u32) -> Result<Option<Permit>, Shed> {
        match &self.overload {
            Some(overload) => overload.admit(priority).await.map(Some),
            None => Ok(None),
        }
    }

    /// The `Host` a request that names none is sent with: the first server's authority.
    pub fn default_host(&self) -> http::HeaderValue {
        let set = self.servers.load();
        match set.list.first().and_then(|s| s.clients.first()) {
            Some(c) => c.authority().clone(),
            None => http::HeaderValue::from_static("localhost"),
        }
    }

    /// Make `list` the pool's servers.
    fn install(&self, list: Vec<Arc<Server>>) {
        let balancer = Balancer::new(
            &self.settings.balance,
            list.iter().map(|s| (&*s.ring_key, s.weight)),
        );
        let entries: Vec<usize> = list.iter().map(|s| s.entry).collect();
        self.servers.store(Arc::new(ServerSet { list, balancer }));
        for entry in entries {
            self.count_healthy(entry);
        }
    }

    /// Send `out` to one of the pool's servers, and to others where an attempt failed
    /// before any answer in a way that lets the request go again ([`Outbound::may_retry`]),
    /// up to `retries` more, within the retry budget. Each attempt's outcome counts for its
    /// server's health.
    pub async fn forward(
        &self,
        out: &mut Outbound,
        down: &Downstream<'_>,
        pick: Pick,
    ) -> Forwarded {
        let set = self.servers.load_full();
        // One reading of the clock for the budget, the choice and the first attempt's
        // start; the next is where the attempt ends.
        let mut now = Instant::now();
        self.budget.request(now);
        // The servers tried, in order: at most `MAX_RETRIES + 1` (config refuses more).
        let mut tried = [0usize; MAX_RETRIES as usize + 1];
        let mut n = 0;
        let Some(mut k) = self.choose(&set, pick.hash, &[], now) else {
            self.counters.no_server.inc();
            self.log_outage(self.outage.failed(&Error::NoServer), Some(&Error::NoServer));
            return Forwarded {
                result: Err(Error::NoServer),
                server: None,
                attempts: 0,
            };
        };
        loop {
            tried[n] = k;
            n += 1;
            let tried = &tried[..n];
            let server = &set.list[k];
            let result;
            (result, now) = server.send(out, down, pick.worker, now).await;
            self.record(&set, k, &result, now);
            let e = match result {
                Ok(resp) => {
                    self.log_outage(self.outage.answered(), None);
                    return Forwarded {
                        result: Ok(resp),
                        server: Some(server.label.clone()),
                        attempts: tried.len() as u32,
                    };
                }
                Err(e) => e,
            };
            // Another server, if the request may go again, has retries left, and a server
            // that takes requests is there to take it: only then is the budget asked.
            let retries = (self.settings.retries as usize).min(MAX_RETRIES as usize);
            let next = (tried.len() <= retries && out.may_retry(&e))
                .then(|| self.choose(&set, pick.hash, tried, now))
                .flatten();
            if let Some(n) = next {
                if self.budget.try_retry(now) {
                    self.counters.retries.inc();
                    tracing::debug!(pool = self.settings.name.as_str(), server = &*server.label, error = %e, "retrying on another server");
                    k = n;
                    continue;
                }
                self.counters.budget_exhausted.inc();
            }
            // The pool's outage is logged when it has no server left to answer (or its one
            // server fails): one server failing among others that answer is that server's
            // ejection, logged as such, not an outage of the pool.
            let left = set.list.iter().any(|s| s.health.available(now));
            if !e.is_client_error() && (set.list.len() == 1 || !left) {
                self.log_outage(self.outage.failed(&e), Some(&e));
            }
            return Forwarded {
                result: Err(e),
                server: Some(server.label.clone()),
                attempts: tried.len() as u32,
            };
        }
    }

    /// The server for the next attempt: among those not `tried` that take requests now,
    /// as the balancer picks. Where none does and nothing was tried yet, the panic rule:
    /// the ejected server that failed least recently (servers failing their health
    /// checks are never picked; with all of them failing, none is).
    fn choose(
        &self,
        set: &ServerSet,
        hash: Option<u64>,
        tried: &[usize],
        now: Instant,
    ) -> Option<usize> {
        let mut view = View {
            servers: &set.list,
            tried,
            taken_elsewhere: 0,
            now,
        };
        for _ in 0..set.list.len().min(64) {
            let k = set.balancer.pick(&view, hash, crate::random::bits())?;
            // A server back from its ejection takes one trial request: another request
            // picking it at the same moment goes elsewhere.
            if set.list[k].health.take(now) {
                return Some(k);
            }
            if k >= 64 {
                // Beyond what the view can mark: let the panic rule below decide.
                break;
            }
            view.taken_elsewhere |= 1 << k;
        }
        if !tried.is_empty() {
            return None;
        }
        // The panic rule: no server is available, so the one that failed least recently is
        // tried — among those whose health checks pass: when every one's fail, no server is
        // left (then 502 at once, no connection tried).
        let checked: Vec<(usize, &Arc<Server>)> = set
            .list
            .iter()
            .enumerate()
            .filter(|(_, s)| !matches!(s.health.state(now), HealthState::FailingChecks { .. }))
            .collect();
        let servers: Vec<&Arc<Server>> = checked.iter().map(|(_, s)| *s).collect();
        panic_pick(&servers).map(|i| checked[i].0)
    }

    /// Count an attempt's outcome, as of `now` (when it ended), in its server's metrics and
    /// health.
    fn record(
        &self,
        set: &ServerSet,
        k: usize,
        result: &Result<Response<ResponseBody>, Error>,
        now: Instant,
    ) {
        let server = &set.list[k];
        let failed = match result {
            Ok(resp) => self
                .settings
                .passive
                .fail_on_status
                .contains(&resp.status()),
            // The client's fault says nothing of the server, nor does a target that cannot
            // go upstream or a coding the client cannot take.
            Err(e) if e.is_client_error() => return,
            Err(e) => !matches!(e, Error::Target(_) | Error::Coding(_)),
        };
        let event = if failed {
            // The policy holds the pool to max_ejected_percent.
            self.policy.failed(&set.list, k, now)
        } else {
            self.policy.succeeded(&server.health, now)
        };
        self.on_event(server, event);
    }

    fn on_event(&self, server: &Server, event: Option<HealthEvent>) {
        let Some(event) = event else { return };
        let pool = self.settings.name.as_str();
        match event {
            HealthEvent::Ejected { until, consecutive } => {
                server.counters.ejections.inc();
                self.count_healthy(server.entry);
                // Whole seconds, rounded up: an ejection of 10 s reads 10s, not 9s.
                let secs = until
                    .saturating_duration_since(Instant::now())
                    .as_millis()
                    .div_ceil(1000);
                tracing::warn!(
                    pool,
                    server = &*server.label,
                    address = server.addr.map(tracing::field::display),
                    ejected_for = %humantime::format_duration(Duration::from_secs(secs.max(1) as u64)),
                    consecutive,
                    "upstream server ejected after max_fails failures within fail_window; it gets one trial request when its ejection ends"
                );
            }
            HealthEvent::Returned => {
                self.count_healthy(server.entry);
                tracing::info!(
                    pool,
                    server = &*server.label,
                    address = server.addr.map(tracing::field::display),
                    "upstream server takes requests again"
                );
            }
            HealthEvent::CheckFailed => {
                self.count_healthy(server.entry);
                tracing::warn!(pool, server = &*server.label, address = server.addr.map(tracing::field::display), "upstream server failing its health checks: out of the pool until it passes them again");
            }
            HealthEvent::CheckPassed => {
                self.count_healthy(server.entry);
                tracing::info!(
                    pool,
                    server = &*server.label,
                    address = server.addr.map(tracing::field::display),
                    "upstream server passes its health checks again"
                );
            }
        }
    }

    /// Set the healthy gauge of `servers[entry]`: how many of its addresses take requests.
    fn count_healthy(&self, entry: usize) {
        let set = self.servers.load();
        let now = Instant::now();
        let of_entry = set.list.iter().filter(|s| s.entry == entry);
        let healthy = of_entry.clone().filter(|s| s.health.available(now)).count();
        if let Some(first) = set.list.iter().find(|s| s.entry == entry) {
            first.counters.healthy.set(healthy as i64);
        }
    }

    fn log_outage(&self, change: Option<OutageChange>, error: Option<&Error>) {
        let pool = self.settings.name.as_str();
        match change {
            None => {}
            Some(OutageChange::Failing) => tracing::warn!(
                pool,
                error = error.map(tracing::field::display),
                "upstream pool failing: its requests get 502 or 504 until it answers again (logged once; the count of failures comes then)"
            ),
            Some(OutageChange::Recovered { failures, down_for }) => {
                let down_for = humantime::format_duration(Duration::from_millis(
                    down_for.as_millis() as u64,
                ))
                .to_string();
                tracing::info!(pool, failures, down_for = down_for.as_str(), "upstream pool answers again")
            }
        }
    }

    fn status(&self, now: Instant) -> PoolStatus {
        let set = self.servers.load();
        let windows: Vec<crate::telemetry::stats::Latency> =
            set.list.iter().map(|s| s.recent.window(now)).collect();
        let total: u64 = windows.iter().map(|w| w.count).sum();
        let unix_now = SystemTime::now();
        PoolStatus {
            name: self.settings.name.clone(),
            balance: self.settings.balance.name(),
            servers: set
                .list
                .iter()
                .zip(windows)
                .map(|(s, w)| {
                    let state = s.health.state(now);
                    let until = |t: Instant| {
                        (unix_now + t.saturating_duration_since(now))
                            .duration_since(SystemTime::UNIX_EPOCH)
                            .map_or(0, |d| d.as_secs())
                    };
                    let (ejected_until, failing_checks) = match state {
                        HealthState::Ejected { until: t } => (Some(until(t)), 0),
                        HealthState::FailingChecks { failures, .. } => (None, failures),
                        HealthState::Healthy | HealthState::Trial => (None, 0),
                    };
                    let name = state.name();
                    ServerStatus {
                        server: s.label.to_string(),
                        address: s.addr.map(|a| a.to_string()),
                        state: name,
                        ejected_until,
                        failing_checks,
                        in_flight: s.in_flight.load(Relaxed),
                        attempts: s.attempts.load(Relaxed),
                        share: (total > 0).then(|| w.count as f64 / total as f64),
                        last_minute: w,
                    }
                })
                .collect(),
            overload: self.overload.as_ref().map(|o| o.status()),
        }
    }
}

/// The balancer's view of a pool's servers for one pick: available where their health
/// says so, and neither tried already by this request nor just found taken (a trial).
struct View<'a> {
    servers: &'a [Arc<Server>],
    tried: &'a [usize],
    /// Servers (by bit, the first 64) whose trial another request took.
    taken_elsewhere: u64,
    now: Instant,
}

impl Candidates for View<'_> {
    fn len(&self) -> usize {
        self.servers.len()
    }

    fn candidate(&self, i: usize) -> Candidate {
        let s = &self.servers[i];
        let taken = i < 64 && self.taken_elsewhere & (1 << i) != 0;
        Candidate {
            available: !taken && !self.tried.contains(&i) && s.health.available(self.now),
            in_flight: s.in_flight.load(Relaxed),
            weight: s.weight,
        }
    }
}

impl AsRef<ServerHealth> for Arc<Server> {
    fn as_ref(&self) -> &ServerHealth {
        &self.health
    }
}

impl Server {
    /// One attempt on this server, from `worker`'s kept connections, `started` now: its
    /// result, and when it ended.
    async fn send(
        &self,
        out: &mut Outbound,
        down: &Downstream<'_>,
        worker: usize,
        started: Instant,
    ) -> (Result<Response<ResponseBody>, Error>, Instant) {
        let client = &self.clients[worker % self.clients.len().max(1)];
        self.attempts.fetch_add(1, Relaxed);
        let result = {
            // Given back however the attempt ends: a client that goes away drops it.
            let _in_flight = InFlight::new(&self.in_flight);
            // An upgrade goes over HTTP/1.1, whatever the pool speaks.
            match &self.http2 {
                Some(h2) if !out.is_upgrade() => h2.send(out, down, client).await,
                _ => client.send(out, down).await,
            }
        };
        let ended = Instant::now();
        let took = ended.saturating_duration_since(started);
        let how = match &result {
            Ok(resp) => Some(Attempt::Answered(resp.status().as_u16())),
            Err(e) if e.is_client_error() => None,
            Err(e) if e.status() == http::StatusCode::GATEWAY_TIMEOUT => Some(Attempt::Timeout),
            Err(_) => Some(Attempt::Error),
        };
        if let Some(how) = how {
            self.counters.attempted(how, took);
            if matches!(how, Attempt::Answered(_)) {
                self.recent.observe(ended, took);
            }
        }
        (result, ended)
    }
}

/// One attempt in flight on a server, counted while it lives.
struct InFlight<'a>(&'a AtomicU32);

impl<'a> InFlight<'a> {
    fn new(n: &'a AtomicU32) -> InFlight<'a> {
        n.fetch_add(1, Relaxed);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// A server entry's address when its URL gives one (no resolving).
fn literal_address(s: &ServerSettings) -> Option<SocketAddr> {
    let host = s.url.host()?.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = host.parse().ok()?;
    let port = s
        .url
        .port_u16()
        .unwrap_or(if s.tls.is_some() { 443 } else { 80 });
    Some(SocketAddr::new(ip, port))
}

/// Resolve the pool's host names again every `resolve_every`, each address a server: one
/// whose address stays keeps its connections and health; one no longer resolved goes
/// (its requests in flight finish). A failed lookup keeps what the last one gave.
async fn resolve_loop(pool: Weak<Pool>) {
    let mut first = true;
    loop {
        let every = match pool.upgrade() {
            Some(p) => {
                p.resolve(first).await;
                p.settings.resolve_every
            }
            None => return,
        };
        first = false;
        tokio::time::sleep(every).await;
    }
}

impl Pool {
    async fn resolve(&self, first: bool) {
        let current = self.servers.load_full();
        let mut next: Vec<Arc<Server>> = Vec::new();
        for (entry, s) in self.settings.servers.iter().enumerate() {
            if let Some(addr) = literal_address(s) {
                next.extend(
                    current
                        .list
                        .iter()
                        .filter(|x| x.entry == entry && x.addr == Some(addr))
                        .cloned(),
                );
                continue;
            }
            let host = s.url.host().unwrap_or_default().to_string();
            let port = s
                .url
                .port_u16()
                .unwrap_or(if s.tls.is_some() { 443 } else { 80 });
            let lookup = tokio::net::lookup_host((host.as_str(), port));
            let mut addrs: Vec<SocketAddr> = match tokio::time::timeout(
                self.settings.connect_timeout,
                lookup,
            )
            .await
            {
                Ok(Ok(a)) => a.collect(),
                Ok(Err(e)) => {
                    tracing::warn!(pool = self.settings.name.as_str(), server = s.label().as_str(), error = %e, "resolving an upstream server's name failed: its last addresses stay");
                    Vec::new()
                }
                Err(_) => {
                    tracing::warn!(
                        pool = self.settings.name.as_str(),
                        server = s.label().as_str(),
                        "resolving an upstream server's name timed out: its last addresses stay"
                    );
                    Vec::new()
                }
            };
            addrs.sort();
            addrs.dedup();
            let old: Vec<&Arc<Server>> = current.list.iter().filter(|x| x.entry == entry).collect();
            if addrs.is_empty() {
                next.extend(old.into_iter().cloned());
                continue;
            }
            for addr in addrs {
                match old.iter().find(|x| x.addr == Some(addr)) {
                    Some(kept) => next.push(Arc::clone(kept)),
                    None => next.push(self.server(entry, Some(addr))),
                }
            }
        }
        let same = next.len() == current.list.len()
            && next
                .iter()
                .zip(&current.list)
                .all(|(a, b)| Arc::ptr_eq(a, b));
        if !same {
            if !first {
                tracing::info!(
                    pool = self.settings.name.as_str(),
                    servers = next.len(),
                    "upstream pool's addresses changed"
                );
            }
            self.install(next);
        }
    }
}

/// The pool's active health checks: every `interval`, a `GET path` to each server at
/// once, each within `timeout`, on a connection of its own (never a request's).
async fn check_loop(pool: Weak<Pool>) {
    loop {
        let interval = {
            let Some(p) = pool.upgrade() else { return };
            let Some(check) = p.settings.health.clone() else {
                return;
            };
            let set = p.servers.load_full();
            let mut probes = tokio::task::JoinSet::new();
            for (k, server) in set.list.iter().enumerate() {
                let server = Arc::clone(server);
                let check = check.clone();
                probes.spawn(async move {
                    let probed = match &server.http2 {
                        None => server.clients[0].probe(&check.path, check.timeout).await,
                        Some(h2) => {
                            h2.probe(&check.path, check.timeout, &server.clients[0])
                                .await
                        }
                    };
                    let passed = match probed {
                        Ok(status) => check.expect.contains(&status),
                        Err(_) => false,
                    };
                    (k, passed)
                });
            }
            while let Some(done) = probes.join_next().await {
                let Ok((k, passed)) = done else { continue };
                let server = &set.list[k];
                let event = p.policy.checked(&server.health, passed, Instant::now());
                p.on_event(server, event);
            }
            check.interval
        };
        tokio::time::sleep(interval).await;
    }
}

/// A pool on the status page.
#[derive(Debug, Clone, Serialize)]
pub struct PoolStatus {
    pub name: String,
    pub balance: String,
    pub servers: Vec<ServerStatus>,
    /// Its overload protection now: limit, in flight, queued, shed (none without one).
    pub overload: Option<crate::overload::OverloadStatus>,
}

/// A server on the status page.
#[derive(Debug, Clone, Serialize)]
pub struct ServerStatus {
    /// The URL as the file writes it.
    pub server: String,
    /// The address it was resolved to (none for a name not resolved yet).
    pub address: Option<String>,
    /// `healthy`, `ejected`, `trial` (its ejection over, one request to prove it) or
    /// `failing_checks`.
    pub state: &'static str,
    /// Unix seconds its ejection ends, while `ejected`.
    pub ejected_until: Option<u64>,
    /// Health checks failed in a row, while `failing_checks`.
    pub failing_checks: u32,
    pub in_flight: u32,
    /// Attempts sent to it since it was built (or since the pool was).
    pub attempts: u64,
    /// Its share of the pool's answered attempts over the last minute.
    pub share: Option<f64>,
    /// Its answers over the last minute: count, p50, p99.
    pub last_minute: crate::telemetry::stats::Latency,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pools_of(text: &str) -> Vec<PoolSettings> {
        let cfg = crate::config::Config::parse(
            &format!("[server]\nlisten = \"127.0.0.1:1\"\n{text}"),
            std::path::Path::new("t.toml"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        cfg.upstreams
    }

    const A: &str =
        "[[upstreams]]\nname = \"a\"\nservers = [\"http://127.0.0.1:2\", \"http://127.0.0.1:3\"]\n";
    const B: &str = "[[upstreams]]\nname = \"b\"\nservers = [\"http://127.0.0.1:4\"]\n";

    #[test]
    fn a_reload_keeps_an_unchanged_pool_whole_and_builds_a_changed_one_anew() {
        let metrics = PoolMetrics::register(&mut prometheus_client::registry::Registry::default());
        let handshakes = |_| TlsHandshakes::default();
        let first = Pools::build(&pools_of(&format!("{A}{B}")), None, 2, &metrics, handshakes);
        // An ejection in `a` (its health is the pool's), and a connection count in `b`.
        let a = first.get(0).expect("a").clone();
        let now = Instant::now();
        let set = a.servers.load_full();
        for _ in 0..3 {
            a.policy.failed(&set.list, 0, now);
        }
        assert!(
            !set.list[0].health.available(now),
            "ejected after max_fails"
        );

        // `b` changes (another server); `a` does not.
        let b2 = "[[upstreams]]\nname = \"b\"\nservers = [\"http://127.0.0.1:5\"]\n";
        let second = Pools::build(
            &pools_of(&format!("{A}{b2}")),
            Some(&first),
            2,
            &metrics,
            handshakes,
        );
        assert!(
            Arc::ptr_eq(second.get(0).expect("a"), &a),
            "the same pool: connections and health kept"
        );
        assert!(!second.get(0).expect("a").servers.load().list[0]
            .health
            .available(now));
        assert!(!Arc::ptr_eq(
            second.get(1).expect("b"),
            first.get(1).expect("b")
        ));
        assert_eq!(
            &*second.get(1).expect("b").servers.load().list[0].label,
            "http://127.0.0.1:5"
        );

        // A worker count that changed builds every pool anew (one client per worker).
        let third = Pools::build(
            &pools_of(&format!("{A}{b2}")),
            Some(&second),
            3,
            &metrics,
            handshakes,
        );
        assert!(!Arc::ptr_eq(third.get(0).expect("a"), &a));
    }

    #[test]
    fn each_server_has_one_client_per_worker_and_its_series_at_zero() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = PoolMetrics::register(&mut registry);
        let pools = Pools::build(&pools_of(A), None, 4, &metrics, |_| {
            TlsHandshakes::default()
        });
        let set = pools.get(0).expect("a").servers.load_full();
        assert_eq!(set.list.len(), 2);
        assert!(set.list.iter().all(|s| s.clients.len() == 4));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        for server in ["http://127.0.0.1:2", "http://127.0.0.1:3"] {
            let healthy = format!("upstream_server_healthy{{pool=\"a\",server=\"{server}\"}} 1");
            assert!(text.contains(&healthy), "{text}");
            let errors = format!(
                "upstream_server_requests_total{{pool=\"a\",server=\"{server}\",outcome=\"error\"}} 0"
            );
            assert!(text.contains(&errors), "{text}");
        }
        assert!(
            text.contains("upstream_retries_total{pool=\"a\"} 0"),
            "{text}"
        );
    }
}
