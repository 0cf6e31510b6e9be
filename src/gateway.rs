//! One request: identify -> match rules -> limit -> answer or forward. And the live
//! configuration each request runs on, swapped whole on reload.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::config::{
    Backend, Config, ConfigError, KeyKind, MissingKey, OnError, Rule, UnknownKeys,
};
use crate::headers::{self, Applied, Problem};
use crate::identity::{self, KeyError};
use crate::limiter::guard::{Answer, Limiter, Now};
use crate::limiter::lease::{Leases, Releasing};
use crate::limiter::memory::MemoryStore;
use crate::limiter::redis::{RedisClusterStore, RedisStore};
use crate::limiter::{
    Algorithm, Check, Decision, IdentityDigest, MonotonicClock, Quota, Store, StoreError,
};
use crate::metrics::{status_class, InFlight, Metrics, ReloadLabels, ReloadResult, RuleCounters};
use crate::proxy::{Downstream, Peer, Proxy, ProxyError, ResponseBody};
use crate::rules;

/// What a client receives: the upstream's streamed body, or one the gateway wrote.
pub type Body = Either<Upstream, Full<Bytes>>;

/// The upstream's response body, streamed through, holding the request's concurrency slots
/// until it ends: given back as the last frame is handed on (before the client can send
/// its next request), or when the client goes away.
pub struct Upstream {
    body: ResponseBody,
    leases: Option<Leases>,
    /// The leases' release in a shared store, and the last frame held back until it is
    /// done (`None` inside: the end of the body).
    releasing: Option<(Releasing, Option<hyper::body::Frame<Bytes>>)>,
}

impl Upstream {
    fn new(body: ResponseBody, leases: Option<Leases>) -> Upstream {
        Upstream {
            body,
            leases,
            releasing: None,
        }
    }
}

impl hyper::body::Body for Upstream {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        if this.releasing.is_none() {
            let polled = std::pin::Pin::new(&mut this.body).poll_frame(cx);
            let last = match polled {
                Poll::Ready(Some(Ok(frame))) if this.body.is_end_stream() => Some(frame),
                Poll::Ready(None) => None,
                Poll::Ready(Some(Err(e))) => {
                    this.leases = None;
                    return Poll::Ready(Some(Err(e)));
                }
                other => return other,
            };
            // The response is complete: the request is no longer in flight. Its slots
            // are given back before the last bytes go out.
            match this.leases.take().and_then(Leases::release) {
                Some(release) => this.releasing = Some((release, last)),
                None => return Poll::Ready(last.map(Ok)),
            }
        }
        match &mut this.releasing {
            Some((release, _)) => {
                if release.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            None => return Poll::Ready(None),
        }
        let last = this.releasing.take().and_then(|(_, last)| last);
        Poll::Ready(last.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        // Not while slots remain to give back: hyper then polls once more, and the
        // release runs before the response is over (an empty body included).
        self.leases.is_none() && self.releasing.is_none() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// One place in a rule's queue of requests waiting for reserved tokens (`max_waiting`).
struct WaitSlot<'a>(&'a AtomicU32);

impl<'a> WaitSlot<'a> {
    fn take(waiting: &'a AtomicU32, max: u32) -> Option<WaitSlot<'a>> {
        waiting
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| WaitSlot(waiting))
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Everything a request runs on. A request takes the current one when it starts and keeps
/// it to the end, so a reload never changes the rules under a request in flight.
pub struct Live {
    pub config: Arc<Config>,
    /// One upstream pool per worker thread: a request's upstream connection is driven by
    /// the thread that serves its client, so forwarding never wakes another thread.
    pub proxies: Arc<[Proxy]>,
    pub limiter: Arc<Limiter>,
    /// Whether the deny cache may be used under this config (see [`Limiter::decide`]).
    pub cache_denials: bool,
    /// `ratewall_requests_total` handles for each of `config.rules`, in order.
    pub counters: Vec<RuleCounters>,
    /// Per rule of `config.rules`: requests waiting on its `max_delay` now.
    waiting: Vec<AtomicU32>,
}

impl Live {
    /// Build what `config` needs, reusing `old`'s store and upstream pool where the
    /// config did not change them: limit state and pooled connections survive a reload.
    pub fn build(
        config: Config,
        old: Option<&Live>,
        metrics: &Arc<Metrics>,
    ) -> Result<Live, StoreError> {
        let limiter = match old {
            Some(o) if o.config.store == config.store => o.limiter.clone(),
            _ => {
                let store = match &config.store.backend {
                    Backend::Memory => Store::Memory(MemoryStore::bounded(
                        Arc::new(MonotonicClock::new()),
                        config.store.max_keys,
                        metrics.evictions("memory"),
                    )),
                    Backend::Redis { url } => Store::Redis(RedisStore::for_workers(
                        url,
                        &config.store.prefix,
                        config.store.timeout,
                        config.server.workers,
                    )?),
                    Backend::RedisCluster { nodes } => Store::RedisCluster(Box::new(
                        RedisClusterStore::new(nodes, &config.store.prefix, config.store.timeout)?,
                    )),
                };
                let s = &config.store;
                Limiter::new(
                    store,
                    s.on_error,
                    s.breaker_failures,
                    s.breaker_cooldown,
                    s.max_keys,
                    metrics.clone(),
                )
            }
        };
        let proxies = match old {
            Some(o)
                if o.config.upstream == config.upstream
                    && o.proxies.len() == config.server.workers.max(1) =>
            {
                o.proxies.clone()
            }
            _ => (0..config.server.workers.max(1))
                .map(|_| Proxy::new(&config.upstream))
                .collect(),
        };
        // In a cluster, rules on different identities mean refunds, and a refund can make
        // a remembered denial stale: cache only when every rule counts the same identity.
        let one_identity = config.rules.windows(2).all(|w| w[0].key == w[1].key);
        let cache_denials =
            !matches!(config.store.backend, Backend::RedisCluster { .. }) || one_identity;
        Ok(Live {
            counters: config
                .rules
                .iter()
                .map(|r| metrics.rule_counters(&r.name))
                .collect(),
            waiting: config.rules.iter().map(|_| AtomicU32::new(0)).collect(),
            config: Arc::new(config),
            proxies,
            limiter,
            cache_denials,
        })
    }
}

impl Live {
    /// This worker thread's upstream pool (the first one off the workers).
    pub fn proxy(&self) -> &Proxy {
        let n = crate::worker::current().unwrap_or(0);
        // Never empty: built with at least one pool.
        &self.proxies[n % self.proxies.len().max(1)]
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("no config file to reload from")]
    NoFile,
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

pub struct Gateway {
    live: ArcSwap<Live>,
    /// The file SIGHUP re-reads.
    config_path: Option<PathBuf>,
    metrics: Arc<Metrics>,
}

/// Why a request was answered before any limit was consulted.
enum Refusal {
    Missing(&'static str),
    Unknown,
    Malformed(KeyError),
}

/// How a request was answered, for the access log and the metrics.
struct Note<'a> {
    /// The rule that decided: the one that denied, or the one closest to denying.
    rule: Option<&'a str>,
    decision: &'static str,
    identity: Option<IdentityDigest>,
    /// Whether the upstream answered (rather than the gateway).
    upstream: bool,
    /// A rule that would have denied had it enforced (shadow mode, rollout).
    shadow_denied: Option<&'a str>,
    /// How long the request waited for reserved tokens.
    waited: Duration,
}

impl Note<'_> {
    fn gateway(decision: &'static str) -> Self {
        Note {
            rule: None,
            decision,
            identity: None,
            upstream: false,
            shadow_denied: None,
            waited: Duration::ZERO,
        }
    }
}

impl Gateway {
    pub fn new(live: Live, config_path: Option<PathBuf>, metrics: Arc<Metrics>) -> Gateway {
        Gateway {
            live: ArcSwap::from_pointee(live),
            config_path,
            metrics,
        }
    }

    /// The configuration requests start on now.
    pub fn live(&self) -> Arc<Live> {
        self.live.load_full()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Re-read the config file; on success new requests run on it, on failure nothing
    /// changes. Requests in flight finish on the configuration they started with.
    pub fn reload(&self) -> Result<(), ReloadError> {
        let result = self.try_reload();
        let outcome = if result.is_ok() {
            ReloadResult::Ok
        } else {
            ReloadResult::Rejected
        };
        self.metrics
            .reloads
            .get_or_create(&ReloadLabels { result: outcome })
            .inc();
        result
    }

    fn try_reload(&self) -> Result<(), ReloadError> {
        let path = self.config_path.as_ref().ok_or(ReloadError::NoFile)?;
        let config = Config::load(path)?;
        let old = self.live.load_full();
        if config.server.listen != old.config.server.listen
            || config.server.admin_listen != old.config.server.admin_listen
            || config.server.workers != old.config.server.workers
            || config.server.max_connections != old.config.server.max_connections
        {
            tracing::warn!(
                "listen addresses, workers or max_connections changed in the file; they take effect on restart only"
            );
        }
        if config.store != old.config.store {
            tracing::warn!("[store] changed: limits start from a fresh store");
        }
        let live = Live::build(config, Some(&old), &self.metrics)?;
        if !Arc::ptr_eq(&live.limiter, &old.limiter) {
            tokio::spawn({
                let limiter = live.limiter.clone();
                async move { limiter.warm().await }
            });
        }
        self.live.store(Arc::new(live));
        Ok(())
    }

    pub async fn handle(&self, req: Request<Incoming>, peer: &Peer) -> Response<Body> {
        let _in_flight = InFlight::new(&self.metrics.in_flight);
        let live = self.live.load_full();
        let logged = tracing::enabled!(target: "ratewall::access", tracing::Level::INFO);
        let started = logged.then(Instant::now);
        // Only what the access log needs, and only when it is on. Never the query string:
        // it may hold secrets.
        let line = logged.then(|| (req.method().clone(), req.uri().path().to_string()));
        let (resp, note) = self.serve(&live, req, peer).await;
        let status = resp.status().as_u16();
        self.metrics
            .count_response(status_class(status), note.upstream);
        if let Some((method, path)) = line {
            let id = note.identity.map(|d| d.hex()[..8].to_string());
            tracing::info!(
                target: "ratewall::access",
                method = %method,
                path = %path,
                status,
                rule = note.rule.unwrap_or("-"),
                decision = note.decision,
                shadow_denied = note.shadow_denied.unwrap_or("-"),
                waited_ms = note.waited.as_millis() as u64,
                id = id.as_deref().unwrap_or("-"),
                latency_us = started.map_or(0, |t| t.elapsed().as_micros() as u64),
            );
        }
        resp
    }

    async fn serve<'a>(
        &self,
        live: &'a Live,
        req: Request<Incoming>,
        peer: &Peer,
    ) -> (Response<Body>, Note<'a>) {
        let cfg = &*live.config;
        if let Some(p) = method_problem(req.method())
            .or_else(|| framing_problem(req.headers()))
            .or_else(|| host_problem(req.version(), req.uri(), req.headers()))
        {
            tracing::debug!(peer = %peer.addr, status = p.status.as_u16(), "malformed request refused");
            // Close the connection: after a request that is malformed or whose framing is
            // in doubt, nothing more on it can be trusted to start where a request starts.
            let mut resp = problem(p, cfg, &[]);
            if req.version() < http::Version::HTTP_2 {
                close_after(&mut resp);
            }
            return (resp, Note::gateway("bad_request"));
        }
        let path = rules::normalize_path(req.uri().path());
        let host = if cfg.index.uses_host {
            rules::request_host(req.uri(), req.headers())
        } else {
            None
        };
        // The rules that apply, by their position in the config (which their counters share).
        let matched = cfg.index.matching(req.method(), &path, host);
        if matched.is_empty() {
            return self
                .forward(live, req, peer, &[], &[], None, Note::gateway("unlimited"))
                .await;
        }
        let applied_rules: Vec<&Rule> = matched.iter().map(|&i| &cfg.rules[i]).collect();

        // The plan of the request's API key (one digest, only when keys are listed).
        let plan = plan(cfg, req.headers());
        let identities = match identify(cfg, &applied_rules, req.headers(), peer.ip(), plan) {
            Ok(ids) => ids,
            Err(refusal) => {
                let decision = match refusal {
                    Refusal::Malformed(_) => "bad_key",
                    Refusal::Missing(_) | Refusal::Unknown => "unauthorized",
                };
                return (refuse(refusal, cfg), Note::gateway(decision));
            }
        };
        // Each rule's quota for this request; whether it enforces for this identity; and,
        // where it may delay, a place among the requests waiting on it (none left: this
        // request is decided without waiting). A shadow check keeps its max_delay: it
        // reserves exactly as enforcement would, but nobody waits on it.
        let mut slots: Vec<Option<WaitSlot<'_>>> = Vec::with_capacity(applied_rules.len());
        let mut quotas: Vec<Quota> = Vec::with_capacity(applied_rules.len());
        let mut enforced: Vec<bool> = Vec::with_capacity(applied_rules.len());
        for ((rule, id), &i) in applied_rules.iter().zip(&identities).zip(&matched) {
            let mut q = *rule.quota_for(plan);
            let enforce = rule.enforces(id);
            let mut slot = None;
            if q.max_delay_us > 0 && enforce {
                slot = WaitSlot::take(&live.waiting[i], rule.max_waiting);
                if slot.is_none() {
                    q.max_delay_us = 0;
                }
            }
            slots.push(slot);
            quotas.push(q);
            enforced.push(enforce);
        }
        let checks: Vec<Check<'_>> = applied_rules
            .iter()
            .zip(&identities)
            .zip(quotas.iter().zip(&enforced))
            .map(|((rule, id), (quota, &enforce))| Check {
                shadow: !enforce,
                lease: if quota.algorithm == Algorithm::Concurrency {
                    live.limiter.next_lease()
                } else {
                    0
                },
                ..Check::new(id, &rule.name, quota)
            })
            .collect();

        let answer = match live.limiter.decide_now(&checks, live.cache_denials) {
            Now::Answered(answer) => answer,
            // Boxed: the shared store's call is the one large future on this path.
            Now::Ask { sent_us, started } => {
                Box::pin(
                    live.limiter
                        .ask(&checks, live.cache_denials, sent_us, started),
                )
                .await
            }
        };
        let (decisions, local): (Vec<Option<Decision>>, bool) = match answer {
            Answer::Store(d) => (d.into_iter().map(Some).collect(), false),
            Answer::Local(d) => (d.into_iter().map(Some).collect(), true),
            // Denied locally: only the denying rules are known (and shown).
            Answer::Cached(d) => (d, false),
            Answer::Failed(_) => {
                // A call that timed out may still have run: take back any lease it
                // could have written (a no-op where it did not).
                Leases::abandon(&live.limiter, &checks);
                for &i in &matched {
                    live.counters[i].error.inc();
                }
                let note = Note {
                    rule: applied_rules.first().map(|r| r.name.as_str()),
                    decision: "store_error",
                    identity: identities.first().copied(),
                    ..Note::gateway("store_error")
                };
                return match cfg.store.on_error {
                    OnError::Allow => self.forward(live, req, peer, &[], &[], None, note).await,
                    OnError::Deny | OnError::Local => {
                        let p = Problem::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "the rate-limit store is unavailable",
                        );
                        (problem(p.with_retry_after(1), cfg, &[]), note)
                    }
                };
            }
        };

        // The rules with a decision, as the headers show them: the enforcing ones, and
        // apart, the ones only watching. `index[j]` is the position of `applied[j]` among
        // the request's rules.
        let mut index = Vec::with_capacity(checks.len());
        let mut applied: Vec<Applied<'_>> = Vec::with_capacity(checks.len());
        let mut shadow: Vec<Applied<'_>> = Vec::new();
        let mut shadow_denied = None;
        for (k, (c, d)) in checks.iter().zip(&decisions).enumerate() {
            let Some(decision) = *d else { continue };
            if decision.retry_after_us == 0 || !decision.allowed {
                // Not waiting on this rule: its place in the queue is free again.
                slots[k] = None;
            }
            let counters = &live.counters[matched[k]];
            let a = Applied {
                rule: c.rule,
                quota: c.quota,
                decision,
            };
            if c.shadow {
                if decision.allowed && decision.retry_after_us > 0 {
                    // Would have waited for its tokens, not been denied.
                    counters.delayed.inc();
                } else if decision.allowed {
                    counters.allowed.inc();
                } else {
                    counters.shadow_denied.inc();
                    shadow_denied.get_or_insert(applied_rules[k].name.as_str());
                }
                shadow.push(a);
                continue;
            }
            if !decision.allowed {
                counters.denied.inc();
            } else if decision.retry_after_us > 0 {
                counters.delayed.inc();
            } else {
                counters.allowed.inc();
            }
            index.push(k);
            applied.push(a);
        }
        let denied = applied
            .iter()
            .position(|a| !a.decision.allowed)
            .map(|j| index[j]);
        self.metrics.stats.record(denied.is_none());
        if let Some(i) = denied {
            let id = identities[i].short_hex();
            self.metrics
                .stats
                .limited(id.as_str(), &applied_rules[i].name, || {
                    hint(cfg, applied_rules[i], req.headers(), peer.ip())
                });
            let note = Note {
                rule: Some(applied_rules[i].name.as_str()),
                decision: "denied",
                identity: Some(identities[i]),
                shadow_denied,
                ..Note::gateway("denied")
            };
            // The denying rules' jitter: the largest, drawn once.
            let jitter = applied
                .iter()
                .zip(&index)
                .filter(|(a, _)| !a.decision.allowed)
                .map(|(_, &k)| applied_rules[k].retry_jitter_us)
                .max()
                .unwrap_or(0);
            let mut resp = problem(
                Problem::too_many_requests(&applied, random_below(jitter)),
                cfg,
                &applied,
            );
            headers::add_shadow(resp.headers_mut(), cfg.response, &shadow);
            return (resp, note);
        }
        // The slots the request now holds: every enforcing concurrency check, and the
        // shadow ones that allowed (charged as if enforced).
        let leases = Leases::taken(&live.limiter, local, &checks, |k| {
            decisions[k].is_some_and(|d| d.allowed)
        });
        // The enforcing rule closest to denying speaks for the request.
        let closest = (0..applied.len())
            .min_by_key(|&j| applied[j].decision.remaining)
            .map(|j| index[j]);
        let mut note = Note {
            rule: closest.map(|k| applied_rules[k].name.as_str()),
            decision: "allowed",
            identity: closest.map(|k| identities[k]),
            shadow_denied,
            ..Note::gateway("allowed")
        };
        // Wait for the reserved tokens: the longest wait among the rules.
        let wait = applied
            .iter()
            .map(|a| a.decision.retry_after_us)
            .max()
            .unwrap_or(0);
        if wait > 0 {
            let _waiting = InFlight::new(&self.metrics.waiting);
            note.decision = "delayed";
            note.waited = Duration::from_micros(wait);
            tokio::time::sleep(note.waited).await;
        }
        drop(slots);
        self.forward(live, req, peer, &applied, &shadow, leases, note)
            .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn forward<'a>(
        &self,
        live: &Live,
        req: Request<Incoming>,
        peer: &Peer,
        applied: &[Applied<'_>],
        shadow: &[Applied<'_>],
        leases: Option<Leases>,
        mut note: Note<'a>,
    ) -> (Response<Body>, Note<'a>) {
        let started = Instant::now();
        let cfg = &live.config;
        let down = Downstream {
            peer,
            trusted: identity::is_trusted(peer.ip().to_canonical(), &cfg.client_ip.trusted_proxies),
            body_timeout: cfg.server.timeouts.body,
        };
        let version = req.version();
        let result = live.proxy().forward(req, &down).await;
        // A client's own failure (a malformed or stalled body) says nothing of the upstream.
        if !result.as_ref().is_err_and(ProxyError::is_client_error) {
            self.metrics
                .upstream_duration
                .observe(started.elapsed().as_secs_f64());
            let class = match &result {
                Ok(resp) => status_class(resp.status().as_u16()),
                Err(_) => "error",
            };
            self.metrics.count_upstream(class);
        }
        match result {
            Ok(resp) => {
                let mut resp = resp.map(|body| Either::Left(Upstream::new(body, leases)));
                headers::add_ratelimit(resp.headers_mut(), live.config.response, applied);
                headers::add_shadow(resp.headers_mut(), live.config.response, shadow);
                note.upstream = true;
                (resp, note)
            }
            Err(e) => {
                let (status, detail) = match e {
                    ProxyError::Timeout(_) => (
                        StatusCode::GATEWAY_TIMEOUT,
                        "the upstream did not answer in time",
                    ),
                    ProxyError::Unreachable(_) | ProxyError::Failed(_) => {
                        (StatusCode::BAD_GATEWAY, "the upstream could not be reached")
                    }
                    ProxyError::Coding(_) => (
                        StatusCode::BAD_GATEWAY,
                        "the upstream's answer uses a transfer coding this client cannot take",
                    ),
                    ProxyError::ClientBody(_) => {
                        (StatusCode::BAD_REQUEST, "the request body is malformed")
                    }
                    ProxyError::ClientStalled(_) => (
                        StatusCode::REQUEST_TIMEOUT,
                        "the request body stopped arriving",
                    ),
                };
                if e.is_client_error() {
                    tracing::debug!(error = %e, status = status.as_u16(), peer = %peer.addr, "client request failed");
                } else {
                    tracing::warn!(error = %e, status = status.as_u16(), "upstream failed");
                }
                // The request is over: `leases` are dropped here, giving its slots back.
                let mut resp = problem(Problem::new(status, detail), &live.config, applied);
                headers::add_shadow(resp.headers_mut(), live.config.response, shadow);
                if matches!(e, ProxyError::ClientStalled(_)) && version < http::Version::HTTP_2 {
                    self.metrics
                        .connections_closed
                        .get_or_create(&crate::metrics::ClosedLabels {
                            listener: "gateway",
                            reason: crate::connection::Closed::BodyTimeout.name(),
                        })
                        .inc();
                }
                if e.is_client_error() && version < http::Version::HTTP_2 {
                    // The rest of the body is in an unknown state: nothing after it on this
                    // connection can be trusted to start where a request starts.
                    close_after(&mut resp);
                }
                (resp, note)
            }
        }
    }
}

/// What an operator may see of a limited identity: enough to recognise it, never a whole
/// API key. Keys show their last 4 characters when they are long enough to keep the rest
/// secret; addresses show their network (/24, /48).
fn hint(cfg: &Config, rule: &Rule, headers: &HeaderMap, peer: IpAddr) -> String {
    let ip_hint = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            format!("ip {}.{}.{}.x", o[0], o[1], o[2])
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            format!("ip {:x}:{:x}:{:x}::/48", s[0], s[1], s[2])
        }
    };
    let client_ip = || identity::client_ip(peer, headers, &cfg.client_ip);
    let (name, label) = match &rule.key {
        KeyKind::Global => return "everyone".to_string(),
        KeyKind::ClientIp => return ip_hint(client_ip()),
        KeyKind::ApiKey => (&cfg.keys.header, "key"),
        KeyKind::Header(h) => (h, "header"),
    };
    match identity::api_key(headers, name) {
        Ok(Some(v)) if v.len() >= 12 => {
            let tail = String::from_utf8_lossy(&v[v.len() - 4..]).into_owned();
            format!("{label} …{tail}")
        }
        Ok(Some(v)) => format!("{label} ({} bytes)", v.len()),
        _ => ip_hint(client_ip()),
    }
}

/// Requests a front proxy and its upstream could read differently (request smuggling),
/// refused before anything else. hyper's HTTP/1 parser already answers 400 to conflicting
/// `Content-Length`s, `Transfer-Encoding` on HTTP/1.0 and codings that do not end in
/// `chunked`; and for `Transfer-Encoding` with `Content-Length` it does what RFC 9112 §6.3
/// asks of an intermediary that forwards such a message: it drops the `Content-Length`,
/// reads the body as chunked, and closes the connection after the answer, so nothing queued
/// behind the request is ever read. This refuses what it lets through:
/// - a `Transfer-Encoding` other than one plain `chunked` (`gzip, chunked`, repeated
///   lines): the only coding a proxy may pass on without knowing it (RFC 9112 §6.1);
/// - more than one `Host`: RFC 9112 §3.2 requires a 400.
fn framing_problem(headers: &HeaderMap) -> Option<Problem> {
    use http::header::{HOST, TRANSFER_ENCODING};
    let mut te = headers.get_all(TRANSFER_ENCODING).iter();
    match (te.next(), te.next()) {
        (None, _) => {}
        (Some(_), Some(_)) => {
            return Some(Problem::new(
                StatusCode::BAD_REQUEST,
                "Transfer-Encoding sent more than once",
            ));
        }
        (Some(v), None) => {
            if !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Some(Problem::new(
                    StatusCode::NOT_IMPLEMENTED,
                    "only Transfer-Encoding: chunked is supported",
                ));
            }
        }
    }
    if headers.get_all(HOST).iter().nth(1).is_some() {
        return Some(Problem::new(
            StatusCode::BAD_REQUEST,
            "more than one Host header",
        ));
    }
    None
}

/// Methods a rule's filter or the upstream could read differently from the gateway:
/// - a standard method spelled other than in upper case (`get`): methods are
///   case-sensitive (RFC 9110 §9.1), so `get` is not `GET` to a `methods = ["GET"]` filter,
///   yet some backends route it as `GET`; the ambiguity itself is refused (400), as nginx
///   does;
/// - `CONNECT`: a tunnel, not a request to forward (501).
fn method_problem(method: &http::Method) -> Option<Problem> {
    const STANDARD: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
    ];
    if *method == http::Method::CONNECT {
        return Some(Problem::new(
            StatusCode::NOT_IMPLEMENTED,
            "CONNECT is not supported: this gateway forwards requests, it does not open tunnels",
        ));
    }
    let name = method.as_str();
    let miscased = name.bytes().any(|b| b.is_ascii_lowercase())
        && STANDARD.iter().any(|s| s.eq_ignore_ascii_case(name));
    miscased.then(|| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "method names are case-sensitive: standard methods are upper case",
        )
    })
}

/// Hosts that do not add up (RFC 9112 §3.2): an HTTP/1.1 request without `Host` (400,
/// whatever its target), and a request target with an authority (absolute form, or
/// HTTP/2's `:authority`) with a `Host` that names another host: rules match one and the
/// upstream would be told the other, so neither can be trusted (§3.2.2: the two must
/// agree).
fn host_problem(version: http::Version, uri: &http::Uri, headers: &HeaderMap) -> Option<Problem> {
    if version == http::Version::HTTP_11 && !headers.contains_key(http::header::HOST) {
        return Some(Problem::new(
            StatusCode::BAD_REQUEST,
            "an HTTP/1.1 request must carry a Host header",
        ));
    }
    let authority = uri.authority()?;
    let host = headers.get(http::header::HOST)?;
    if host
        .as_bytes()
        .eq_ignore_ascii_case(authority.as_str().as_bytes())
    {
        return None;
    }
    Some(Problem::new(
        StatusCode::BAD_REQUEST,
        "the Host header does not match the request target's authority",
    ))
}

/// The identity digest of the request under each rule, in order.
/// `plan`: the API key's plan, if it is listed (with `unknown = "reject"`, an unlisted key
/// is refused).
fn identify(
    cfg: &Config,
    rules: &[&Rule],
    headers: &HeaderMap,
    peer: IpAddr,
    plan: Option<&str>,
) -> Result<Vec<IdentityDigest>, Refusal> {
    let mut ip = None;
    let mut client_ip =
        || *ip.get_or_insert_with(|| identity::client_ip(peer, headers, &cfg.client_ip));
    // One digest of the API key, however many rules count by it.
    let mut key_digest = None;
    rules
        .iter()
        .map(|rule| {
            let (name, value) = match &rule.key {
                KeyKind::Global => return Ok(identity::digest_global()),
                KeyKind::ClientIp => return Ok(identity::digest_ip(client_ip())),
                KeyKind::ApiKey => (&cfg.keys.header, None),
                KeyKind::Header(h) => (h, Some(h)),
            };
            match identity::api_key(headers, name).map_err(Refusal::Malformed)? {
                Some(v) => match value {
                    Some(h) => Ok(identity::digest_header(h, v)),
                    None => {
                        if cfg.keys.unknown == UnknownKeys::Reject && plan.is_none() {
                            return Err(Refusal::Unknown);
                        }
                        Ok(*key_digest.get_or_insert_with(|| identity::digest_api_key(v)))
                    }
                },
                None => match rule.missing_key {
                    MissingKey::ClientIp => Ok(identity::digest_ip(client_ip())),
                    MissingKey::Reject => Err(Refusal::Missing(if value.is_some() {
                        "a header this rule counts by is missing"
                    } else {
                        "an API key is required"
                    })),
                },
            }
        })
        .collect()
}

/// The plan the request's API key maps to, if any.
fn plan<'c>(cfg: &'c Config, headers: &HeaderMap) -> Option<&'c str> {
    let keys = &cfg.keys;
    if keys.is_empty() {
        return None;
    }
    let key = identity::api_key(headers, &keys.header).ok().flatten()?;
    keys.plan_of(key)
}

/// A uniformly random number of µs in `0..=max` (0 for 0): jitter, not secrecy.
fn random_below(max: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    if max == 0 {
        return 0;
    }
    // Each RandomState has fresh keys; hashing nothing with them gives 64 random bits.
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    // Multiply-shift: unbiased enough for spreading retries.
    ((u128::from(bits) * (u128::from(max) + 1)) >> 64) as u64
}

fn refuse(refusal: Refusal, cfg: &Config) -> Response<Body> {
    let p = match refusal {
        Refusal::Missing(why) => Problem::new(StatusCode::UNAUTHORIZED, why),
        Refusal::Unknown => Problem::new(StatusCode::UNAUTHORIZED, "the API key is not known"),
        Refusal::Malformed(e) => Problem::new(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    problem(p, cfg, &[])
}

/// Ask hyper to close the client connection once `resp` is sent (HTTP/1).
fn close_after<B>(resp: &mut Response<B>) {
    resp.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
}

/// A response the gateway writes itself.
pub fn problem(p: Problem, cfg: &Config, applied: &[Applied<'_>]) -> Response<Body> {
    let mut resp = Response::new(Either::Right(Full::new(p.body.clone())));
    *resp.status_mut() = p.status;
    p.headers(resp.headers_mut());
    headers::add_ratelimit(resp.headers_mut(), cfg.response, applied);
    resp
}
