//! One request, top to bottom: screen its head (`screen.rs`) -> the rules that apply and
//! who the request is under each (`limits.rs`) -> the store's answer -> one [`Verdict`]
//! ([`verdict`], pure) -> an answer written here, or the request forwarded upstream with
//! its `RateLimit-*` headers. Every answer written here goes through [`problem`], which
//! writes it as HTTP (problem+json) or, to a gRPC call, as a gRPC answer ([`grpc`]). [`Gateway::admit`] does everything up to forwarding (the
//! part tested in process, with an injected clock and no sockets); [`Gateway::handle`] is
//! the thin shell around it: admit, wait, forward or answer, record.
//!
//! The live configuration each request runs on ([`Live`]) is swapped whole on reload.

mod access;
mod admit;
pub mod all_metrics;
mod answer;
mod body;
mod context;
pub mod dashboards;
pub mod demand;
mod explain;
pub mod grpc;
pub mod jwks;
mod limits;
mod live;
pub mod metrics;
mod overload;
mod reserve;
mod route;
mod screen;
mod switched;
mod tokens;
pub mod verdict;

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::request::Parts;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::Either;
use hyper::body::Incoming;

use crate::config::{Config, ConfigError, Source};
use crate::headers::{self, Applied, Problem};
use crate::identity::{IdentityDigest, Requester};
use crate::limiter::guard::{Answer, Now};
use crate::limiter::lease::Leases;
use crate::limiter::{Check, Decision, StoreError};
use crate::settle::Settling;
use crate::telemetry::stats::{Named, Outcome};
use crate::telemetry::Gauged;
use crate::upstream::{self, ClientPeer, Downstream};
use access::AccessLine;
use grpc::{Dialect, Origin};
use limits::{split, Limit};
use live::WaitSlot;
use metrics::{status_class, RefusalReason, ReloadLabels, ReloadResult};
use route::Destination;
use verdict::{Ruled, Tally, Verdict};

pub use all_metrics::Metrics;
use answer::close_after;
pub use answer::problem;
pub use body::{Body, LeasedBody};
pub use context::Context;
pub use explain::explain;
pub use live::Live;

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
    /// The file SIGHUP re-reads, and the command line's or environment's overrides it
    /// keeps.
    source: Option<Source>,
    metrics: Arc<Metrics>,
}

/// Whether a request's host is one the gateway would serve: a `Host` and authority that
/// are `uri-host [ ":" port ]` and agree (the screen's rule, for answers made before the
/// gateway proper, such as `redirect_https`'s 308, whose `Location` is built from it).
pub fn host_is_sound(version: http::Version, uri: &http::Uri, headers: &HeaderMap) -> bool {
    screen::host_problem(version, uri, headers).is_none()
}

/// How a request was answered, for the access log and the metrics.
#[derive(Debug, Clone)]
pub struct Note<'l> {
    /// The rule that decided: the one that denied, or the one closest to denying.
    pub rule: Option<&'l str>,
    /// `allowed`, `delayed`, `denied`, `unlimited`, `store_error`, `unauthorized`,
    /// `bad_key`, `bad_request`, `redirect` (`redirect_https`), `shed` (overload).
    pub decision: &'static str,
    pub identity: Option<IdentityDigest>,
    /// The label of the request's API key, where it is listed with one.
    pub label: Option<Arc<str>>,
    /// Whether the upstream answered (rather than the gateway).
    pub upstream: bool,
    /// A rule that would have denied had it enforced (shadow mode, rollout).
    pub shadow_denied: Option<&'l str>,
    /// How long the request waited for reserved tokens.
    pub waited: Duration,
    /// The route it matched, and its pool (none for a request answered before routing,
    /// or that no route fits).
    pub route: Option<&'l str>,
    pub pool: Option<&'l str>,
    /// The server of its last attempt (its URL as the file writes it), and how many
    /// servers were tried.
    pub server: Option<Arc<str>>,
    pub attempts: u32,
    /// What an upgraded connection switched to, when it was one: `websocket`, or
    /// `other` for any other `Upgrade` token.
    pub upgrade: Option<&'static str>,
    /// A gRPC call's final `grpc-status`: the gateway's, or the upstream's (from its
    /// Trailers-Only headers, or its trailers: the line is then written when the body
    /// ends). None for other requests, and for a gRPC answer that carried none.
    pub grpc_status: Option<grpc::Code>,
}

impl<'l> Note<'l> {
    fn gateway(decision: &'static str) -> Self {
        Note {
            rule: None,
            decision,
            identity: None,
            label: None,
            upstream: false,
            shadow_denied: None,
            waited: Duration::ZERO,
            route: None,
            pool: None,
            server: None,
            attempts: 0,
            upgrade: None,
            grpc_status: None,
        }
    }

    /// This note, for a request going to `to`.
    fn to(self, to: &Destination, cfg: &'l Config) -> Self {
        Note {
            route: to.route_name(cfg),
            pool: to.pool_name(cfg),
            ..self
        }
    }
}

/// What the gateway decided about a request, before anything went upstream.
// Made once per request and matched at once: boxing the answer would cost more than the
// bytes it saves.
#[allow(clippy::large_enum_variant)]
pub enum Admission<'l> {
    /// Answered by the gateway: a bad request, a refusal, a denial, a failed store.
    Answer(Response<Body>, Note<'l>),
    /// To be forwarded.
    Forward(Pass<'l>),
}

/// A request let through: what its answer carries, what it holds, how long it waits.
pub struct Pass<'l> {
    /// The enforcing rules' decisions (`RateLimit-*`), and apart, the watching ones'
    /// (`RateLimit-Shadow`).
    pub applied: Vec<Applied<'l>>,
    pub shadow: Vec<Applied<'l>>,
    /// Its concurrency slots, given back when its response ends.
    leases: Option<Leases>,
    /// Its places in the queues of the rules it waits on, held while it waits.
    slots: Vec<WaitSlot<'l>>,
    /// Where it goes.
    pub to: Destination,
    /// Whether it is a gRPC call: the gateway's answers to it, if forwarding fails, are
    /// gRPC answers.
    pub dialect: Dialect,
    pub note: Note<'l>,
    /// The rules with a WebSocket limit (`messages`, `bytes`) that let it through: each
    /// one's position, who the request is under it, and how long it may hold a client back
    /// (its `max_delay`, µs). Used only where the request upgrades.
    messages: Vec<(usize, IdentityDigest, u64)>,
    /// The headers its verified token's claims give the backend (`[jwt] forward_claims`).
    claims: Vec<(http::HeaderName, http::HeaderValue)>,
    /// The charges of its rules that settle once the answer is known (`charge`,
    /// `cost_header`, `cost_from`); none for rules whose charge stands as taken.
    settling: Option<Settling>,
    /// Its place in an overloaded pool's queue (`gateway/overload.rs`).
    priority: u32,
}

impl<'l> Pass<'l> {
    fn unlimited(note: Note<'l>, to: Destination, dialect: Dialect) -> Pass<'l> {
        Pass {
            applied: Vec::new(),
            shadow: Vec::new(),
            leases: None,
            slots: Vec::new(),
            to,
            dialect,
            note,
            messages: Vec::new(),
            claims: Vec::new(),
            settling: None,
            priority: 0,
        }
    }

    /// The upstream answered: count each rule's pass (allowed, or delayed where it waited),
    /// enforcing or watching. Counted only now: a request the backend never answered is
    /// that rule's 502 or 504, not its pass, so no rule counts more passes than the
    /// requests that passed.
    fn count_passed(&self, live: &Live) {
        for a in self.applied.iter().chain(&self.shadow) {
            let Some(c) = live.counters.get(a.index) else {
                continue;
            };
            if !a.decision.allowed {
                // A watching rule that would have denied: its shadow_denied is counted.
                continue;
            }
            if a.decision.retry_after_us > 0 {
                c.delayed.inc();
            } else {
                c.allowed.inc();
            }
        }
    }

    /// How long the request waits for its reserved tokens before it is forwarded.
    pub fn wait(&self) -> Duration {
        self.note.waited
    }

    /// The rate-limit headers the upstream's answer gets.
    pub fn decorate(&self, headers: &mut HeaderMap, cfg: &Config) {
        headers::add_ratelimit(headers, cfg.response, &self.applied);
        headers::add_shadow(headers, cfg.response, &self.shadow);
    }
}

impl Gateway {
    pub fn new(live: Live, source: Option<Source>, metrics: Arc<Metrics>) -> Gateway {
        metrics.stats.started_with(live.config.sha256.clone());
        Gateway {
            live: ArcSwap::from_pointee(live),
            source,
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
            .gateway
            .reloads
            .get_or_create(&ReloadLabels { result: outcome })
            .inc();
        let sha256 = match &result {
            Ok(()) => self.live.load().config.sha256.clone(),
            // What the rejected file holds, where it can be read.
            Err(_) => self
                .source
                .as_ref()
                .and_then(|s| std::fs::read(&s.path).ok())
                .map(|bytes| crate::config::sha256_hex(&bytes)),
        };
        let shown = result.as_ref().map(|_| ()).map_err(ToString::to_string);
        self.metrics.stats.reloaded(shown, sha256);
        result
    }

    fn try_reload(&self) -> Result<(), ReloadError> {
        let source = self.source.as_ref().ok_or(ReloadError::NoFile)?;
        let config = source.load()?;
        let old = self.live.load_full();
        let (s, o) = (&config.server, &old.config.server);
        if s.listen != o.listen
            || s.admin_listen != o.admin_listen
            || s.workers != o.workers
            || s.max_connections != o.max_connections
            || s.backlog != o.backlog
            || s.shutdown_grace != o.shutdown_grace
            || s.tls.as_ref().map(|t| t.listen) != o.tls.as_ref().map(|t| t.listen)
        {
            tracing::warn!(
                "listen addresses ([server.tls] listen included: a TLS listener is added or removed only by a restart), workers, max_connections, backlog or shutdown_grace changed in the file; they take effect on restart only"
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

    /// Serve one request, in its context (built at its connection): admit it, then answer
    /// or forward it, and record how it went.
    /// `ctx` is borrowed: an `async fn`'s arguments are laid out twice in its future.
    pub async fn handle(&self, req: Request<Incoming>, ctx: &Context) -> Response<Body> {
        let started = Instant::now();
        let _in_flight = Gauged::new(&self.metrics.gateway.in_flight);
        let live = self.live.load_full();
        let log = AccessLine::start(&req, &ctx.peer, &live.config);
        self.metrics
            .gateway
            .count_protocol(req.version(), ctx.peer.tls.as_ref().map(|t| t.version));
        let (mut parts, body) = req.into_parts();
        if !live.config.server.underscores_in_headers {
            let dropped = screen::drop_underscored(&mut parts.headers);
            if dropped > 0 {
                self.metrics
                    .gateway
                    .underscore_fields_dropped
                    .inc_by(dropped);
            }
        }
        let dialect = Dialect::of(&parts.headers);
        // Read only where a rule the request meets reserves what its body asks for.
        let mut body = upstream::RequestBody::from(body);
        let (mut resp, mut note, forwarded) = match self
            .admit_as(&live, &parts, ctx, dialect, Some(&mut body))
            .await
        {
            Admission::Answer(resp, note) => (resp, note, false),
            Admission::Forward(pass) => {
                // Boxed: most of this future's size, moved whole even for a 429.
                let forward = self.forward(&live, Request::from_parts(parts, body), ctx, pass);
                let (resp, note) = Box::pin(forward).await;
                (resp, note, true)
            }
        };
        let status = resp.status().as_u16();
        // A gRPC answer of the gateway is an HTTP 200: it counts as the status it stands for.
        let meant = match (dialect, note.upstream) {
            (Dialect::Grpc, false) => {
                grpc::status_of(resp.headers()).map_or(status, |code| code.stands_for(forwarded))
            }
            _ => status,
        };
        self.metrics
            .gateway
            .count_response(status_class(meant), note.upstream);
        let outcome = match (forwarded, note.decision) {
            // Shed by the pool's overload protection: a 503 (or gRPC 14) of its own kind.
            (_, "shed") => Outcome::Overloaded,
            (true, _) => Outcome::forwarded(note.upstream, meant),
            (false, _) => Outcome::answered(meant),
        };
        self.metrics
            .gateway
            .count_outcome(outcome, started.elapsed());
        self.metrics.stats.ended(outcome);
        if dialect == Dialect::Grpc {
            self.grpc_answered(&mut resp, &mut note, log.map(|l| (l, status)));
        } else if let Some(log) = log {
            log.write(status, &note);
        }
        resp
    }

    /// A gRPC call's answer: its status counted and logged now when its headers carry it
    /// (the gateway's answers, an upstream's Trailers-Only one), or else, for a passed-on
    /// answer, once its body ends with its trailers ([`grpc::Watch`]).
    fn grpc_answered(
        &self,
        resp: &mut Response<Body>,
        note: &mut Note<'_>,
        log: Option<(AccessLine, u16)>,
    ) {
        let origin = match note.upstream {
            true => Origin::Upstream,
            false => Origin::Gateway,
        };
        note.grpc_status = grpc::status_of(resp.headers());
        match (note.grpc_status, resp.body_mut()) {
            (None, Either::Left(body)) => {
                let log = log.map(|(l, status)| l.defer(status, note));
                body.watch(grpc::Watch::new(self.metrics.clone(), log));
            }
            (status, _) => {
                if let Some(code) = status {
                    self.metrics.gateway.count_grpc(code, origin);
                }
                if let Some((log, status)) = log {
                    log.write(status, note);
                }
            }
        }
    }

    /// Answer a request on the cleartext listener with `answer`'s response, the 308 to
    /// the TLS listener (`redirect_https`), without admitting it: no rule is consulted and
    /// nothing is forwarded, but it has its access line (decision `redirect`, or
    /// `bad_request` for the 400 of a request that names no host to redirect to) and a 308
    /// counts in `ratewall_https_redirects_total`.
    pub fn redirect<B>(
        &self,
        req: &Request<B>,
        ctx: &Context,
        answer: impl FnOnce(&Request<B>) -> Response<Body>,
    ) -> Response<Body> {
        let log = AccessLine::start(req, &ctx.peer, &self.live.load().config);
        let resp = answer(req);
        let decision = match resp.status() {
            StatusCode::PERMANENT_REDIRECT => {
                self.metrics.gateway.https_redirects.inc();
                "redirect"
            }
            _ => "bad_request",
        };
        if let Some(log) = log {
            log.write(resp.status().as_u16(), &Note::gateway(decision));
        }
        resp
    }

    /// Everything a request goes through before it is forwarded: screened, matched,
    /// identified (from its parts and its [`Context`]: the peer, the client certificate),
    /// limited, judged. No socket is touched: the store is asked, and nothing else happens
    /// outside the process.
    ///
    /// A gRPC call (by its `content-type`, [`Dialect::of`]) gets gRPC answers.
    pub async fn admit<'l>(&self, live: &'l Live, parts: &Parts, ctx: &Context) -> Admission<'l> {
        self.admit_as(live, parts, ctx, Dialect::of(&parts.headers), None)
            .await
    }

    /// [`Gateway::admit`], the request's dialect already known; `body`: its body, still
    /// streaming from the client, read (and left as it goes up) where a rule it meets
    /// reserves what it asks for (`reserve = "max_tokens"`).
    async fn admit_as<'l>(
        &self,
        live: &'l Live,
        parts: &Parts,
        ctx: &Context,
        dialect: Dialect,
        body: Option<&mut upstream::RequestBody>,
    ) -> Admission<'l> {
        let cfg = &*live.config;
        let peer = ctx.peer.ip();
        if let Some(p) = screen::problem(parts) {
            tracing::debug!(%peer, status = p.status.as_u16(), "malformed request refused");
            self.metrics
                .gateway
                .count_refusal(RefusalReason::of_status(p.status.as_u16()));
            let mut resp = problem(p, cfg, &[], dialect);
            if parts.version < http::Version::HTTP_2 {
                close_after(&mut resp);
            }
            return Admission::Answer(resp, Note::gateway("bad_request"));
        }
        // Read before anything is identified (identities are not held across a wait).
        let asked = match body {
            Some(body) if limits::may_read_body(live, parts) => {
                match tokens::read_into(body, parts, cfg.server.timeouts.body).await {
                    Ok(asked) => Some(asked),
                    Err(p) => {
                        // The rest of the body is in an unknown state: nothing after it on
                        // this connection can be trusted to start where a request starts.
                        let mut resp = problem(p, cfg, &[], dialect);
                        close_after(&mut resp);
                        return Admission::Answer(resp, Note::gateway("bad_request"));
                    }
                }
            }
            _ => None,
        };
        let requester = Requester::new(&parts.headers, peer, &cfg.keys, &cfg.client_ip)
            .with_client_cert(ctx.client_cert.as_ref())
            .with_jwt(cfg.jwt.as_ref().map(|j| &*j.verifier))
            .counting_failures();
        let mut admission = self.admit_by(live, parts, dialect, &requester, asked).await;
        // Whoever decided, the access line names the key's label: looked up (a key's
        // digest, where no rule took it) only where an access line is written.
        if tracing::enabled!(target: "ratewall::access", tracing::Level::INFO) {
            let note = match &mut admission {
                Admission::Answer(_, note) => note,
                Admission::Forward(pass) => &mut pass.note,
            };
            note.label = requester.label().cloned();
        }
        admission
    }

    /// The 404 of a request no route fits when no pool `default` takes the rest: never
    /// forwarded, counted (`ratewall_refusals_total{reason="no_route"}`) and logged.
    fn no_route<'l>(&self, cfg: &Config, parts: &Parts, dialect: Dialect) -> Admission<'l> {
        tracing::debug!(method = %parts.method, path = parts.uri.path(), "no route matches the request");
        self.metrics.gateway.count_refusal(RefusalReason::NoRoute);
        let p = Problem::new(StatusCode::NOT_FOUND, "no route matches this request");
        Admission::Answer(problem(p, cfg, &[], dialect), Note::gateway("no_route"))
    }

    /// A denied request's 429, and the counts it adds.
    #[allow(clippy::too_many_arguments)]
    fn deny<'l>(
        &self,
        live: &'l Live,
        requester: &Requester<'_>,
        limits: &[Limit<'l, '_>],
        decisions: &[Option<Decision>],
        by: usize,
        jitter_us: u64,
        to: &Destination,
        dialect: Dialect,
    ) -> Admission<'l> {
        let cfg = &*live.config;
        let shadow_denied = tally(live, limits, decisions, true);
        let (applied, shadow) = split(limits, decisions);
        let limit = &limits[by];
        self.metrics
            .stats
            .limited(limit.identity.digest, &limit.rule.name, || {
                let source = &limit.identity.source;
                Named {
                    hint: limit.identity.hint(),
                    label: requester.label_of(source).map(|l| l.to_string()),
                    claims: requester.claims_of(source),
                }
            });
        let note = Note {
            rule: Some(limit.rule.name.as_str()),
            identity: Some(limit.identity.digest),
            shadow_denied,
            ..Note::gateway("denied").to(to, cfg)
        };
        let p = Problem::too_many_requests(&applied, crate::random::up_to(jitter_us));
        let waits_ms = p.retry_after_ms.unwrap_or(0);
        self.metrics
            .gateway
            .dashboards
            .denied(live, limits, decisions, by, waits_ms);
        let mut resp = problem(p, cfg, &applied, dialect);
        headers::add_shadow(resp.headers_mut(), cfg.response, &shadow);
        Admission::Answer(resp, note)
    }

    /// An admitted request's pass, and the counts it adds.
    #[allow(clippy::too_many_arguments)]
    fn pass<'l>(
        &self,
        live: &'l Live,
        limits: Vec<Limit<'l, '_>>,
        decisions: &[Option<Decision>],
        verdict: Verdict,
        leases: Option<Leases>,
        local: bool,
        to: Destination,
    ) -> Pass<'l> {
        let shadow_denied = tally(live, &limits, decisions, false);
        self.metrics
            .gateway
            .dashboards
            .admitted(live, &limits, decisions);
        let (applied, shadow) = split(&limits, decisions);
        let settling = self.reserve(live, &limits, decisions, local);
        let ruled: Vec<Ruled> = limits.iter().map(Limit::ruled).collect();
        let closest = verdict::closest(&ruled, decisions).map(|k| &limits[k]);
        let (decision, waited) = match verdict {
            Verdict::Delay(us) => ("delayed", Duration::from_micros(us)),
            _ => ("allowed", Duration::ZERO),
        };
        let note = Note {
            rule: closest.map(|l| l.rule.name.as_str()),
            identity: closest.map(|l| l.identity.digest),
            shadow_denied,
            waited,
            ..Note::gateway(decision).to(&to, &live.config)
        };
        let messages = limits
            .iter()
            .filter(|l| l.enforced && (l.rule.messages.is_some() || l.rule.bytes.is_some()))
            .map(|l| (l.index, l.identity.digest, l.quota.max_delay_us))
            .collect();
        // Waiting on a rule holds its place in that rule's queue; the others are free.
        let slots = limits
            .into_iter()
            .zip(decisions)
            .filter(|(_, d)| d.is_some_and(|d| d.allowed && d.retry_after_us > 0))
            .filter_map(|(l, _)| l.slot)
            .collect();
        Pass {
            applied,
            shadow,
            leases,
            slots,
            to,
            dialect: Dialect::Http,
            note,
            messages,
            claims: Vec::new(),
            settling,
            priority: 0,
        }
    }

    /// Wait for the reserved tokens, then forward: the upstream's answer with the
    /// rate-limit headers, or the gateway's answer to what went wrong.
    async fn forward<'l>(
        &self,
        live: &'l Live,
        req: Request<upstream::RequestBody>,
        ctx: &Context,
        mut pass: Pass<'l>,
    ) -> (Response<Body>, Note<'l>) {
        let peer = &ctx.peer;
        if !pass.note.waited.is_zero() {
            let _waiting = Gauged::new(&self.metrics.gateway.waiting);
            tokio::time::sleep(pass.note.waited).await;
        }
        pass.slots.clear();
        let cfg = &*live.config;
        let down = Downstream {
            peer,
            trusted: crate::identity::is_trusted(
                peer.ip().to_canonical(),
                &cfg.client_ip.trusted_proxies,
            ),
            body_timeout: cfg.server.timeouts.body,
        };
        let version = req.version();
        let started = Instant::now();
        let Some(pool) = live.pools.get(pass.to.pool) else {
            // Never: a destination's pool is one of the config's, and `live` is built from it.
            drop(pass.leases.take());
            let resp = self.upstream_failed(cfg, upstream::Error::NoServer, version, peer, &pass);
            return (resp, pass.note);
        };
        let target = pass.to.target(cfg, req.uri());
        // An upgrade goes up as one only where the client's side can switch too.
        let (mut parts, body) = req.into_parts();
        // The claims' headers come from the verified token only: a client's own copies
        // are dropped, whether or not the request carried a token.
        if let Some(jwt) = &cfg.jwt {
            for (_, header) in &jwt.verifier.settings.forward_claims {
                parts.headers.remove(header);
            }
            for (header, value) in std::mem::take(&mut pass.claims) {
                parts.headers.append(header, value);
            }
        }
        pass.settled_fields(live, &mut parts.headers);
        let upgrade = upstream::Upgrade::asked(&parts, hyper::body::Body::is_end_stream(&body))
            .and_then(|asked| {
                let on = parts.extensions.remove::<hyper::upgrade::OnUpgrade>()?;
                Some((asked, on))
            });
        let req = Request::from_parts(parts, body);
        let mut out = upstream::Outbound::new(req, target, &pool.default_host());
        if let Some((asked, _)) = &upgrade {
            out.upgrading(asked.clone());
        }
        pass.settled_outbound(live, &mut out);
        let pick = upstream::Pick {
            hash: pass.to.hash,
            worker: ctx.worker,
        };
        let permit = match self.permit(live, pool, &mut pass).await {
            Ok(permit) => permit,
            Err(resp) => return (resp, pass.note),
        };
        let forwarded = pool.forward(&mut out, &down, pick).await;
        if let (Some(p), true) = (permit, forwarded.result.is_ok()) {
            p.answered();
        }
        pass.note.server = forwarded.server;
        pass.note.attempts = forwarded.attempts;
        let result = forwarded.result;
        self.count_upstream(&result, started);
        if let Err(e) = &result {
            count_rule_failures(live, &pass, e);
        }
        match result {
            Ok(mut resp) => {
                pass.count_passed(live);
                let meter = pass.answered(live, &mut resp).await;
                if let Some((asked, on)) = upgrade {
                    self.tunnel(live, ctx, &mut pass, &mut resp, asked, on);
                }
                let leases = pass.leases.take();
                let screened = (!live.cost_headers.is_empty()).then(|| live.cost_headers.clone());
                let mut resp = resp.map(|body| {
                    let body = LeasedBody::new(body, leases)
                        .metered(meter)
                        .screened(screened);
                    Either::Left(body)
                });
                pass.decorate(resp.headers_mut(), cfg);
                pass.note.upstream = true;
                (resp, pass.note)
            }
            Err(e) => {
                // The request is over: its leases are dropped here, giving its slots back.
                drop(pass.leases.take());
                pass.unanswered().await;
                let resp = self.upstream_failed(cfg, e, version, peer, &pass);
                (resp, pass.note)
            }
        }
    }

    fn count_upstream(
        &self,
        result: &Result<Response<upstream::ResponseBody>, upstream::Error>,
        started: Instant,
    ) {
        // A client's own failure (a malformed or stalled body) says nothing of the upstream.
        if result.as_ref().is_err_and(upstream::Error::is_client_error) {
            return;
        }
        let took = started.elapsed();
        self.metrics
            .gateway
            .upstream_duration
            .observe(took.as_secs_f64());
        let class = match result {
            Ok(resp) => {
                self.metrics.stats.upstream_answered(took);
                status_class(resp.status().as_u16())
            }
            Err(_) => "error",
        };
        self.metrics.gateway.count_upstream(class);
    }

    /// The gateway's answer when forwarding failed: the upstream's fault (502, 504) or
    /// the client's (400, 408).
    fn upstream_failed(
        &self,
        cfg: &Config,
        e: upstream::Error,
        version: http::Version,
        peer: &ClientPeer,
        pass: &Pass<'_>,
    ) -> Response<Body> {
        let (status, detail) = (e.status(), e.detail());
        if e.is_client_error() {
            tracing::debug!(error = %e, status = status.as_u16(), peer = %peer.addr, "client request failed");
        } else {
            // The pool logs its outages, once each (`upstream::Pool::forward`).
            tracing::debug!(error = %e, status = status.as_u16(), pool = pass.note.pool, "upstream failed");
        }
        let p = Problem::new(status, detail);
        let mut resp = problem(p, cfg, &pass.applied, pass.dialect);
        headers::add_shadow(resp.headers_mut(), cfg.response, &pass.shadow);
        if matches!(e, upstream::Error::ClientStalled(_)) && version < http::Version::HTTP_2 {
            self.metrics
                .connection
                .connections_closed
                .get_or_create(&crate::connection::metrics::ClosedLabels {
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
        resp
    }
}

impl Verdict {
    /// The access log's `decision` for a request this verdict answers.
    fn decision(self) -> &'static str {
        match self {
            Verdict::Forward => "allowed",
            Verdict::Delay(_) => "delayed",
            Verdict::Deny { .. } => "denied",
            Verdict::Unlimited | Verdict::Unavailable => "store_error",
            Verdict::Refuse(r) => r.decision(),
        }
    }
}

impl Limit<'_, '_> {
    fn ruled(&self) -> Ruled {
        Ruled {
            enforced: self.enforced,
            jitter_us: self.rule.retry_jitter_us,
        }
    }
}

/// Ask the store about every limit at once, and judge its answer: the decisions (none if
/// the store failed), the verdict, and the concurrency slots the request now holds.
async fn consult(
    live: &Live,
    limits: &[Limit<'_, '_>],
) -> (Option<Vec<Option<Decision>>>, Verdict, Option<Leases>, bool) {
    let checks: Vec<Check<'_>> = limits.iter().map(Limit::check).collect();
    let answer = match live.limiter.decide_now(&checks, live.cache_denials) {
        Now::Answered(answer) => answer,
        Now::Ask(asking) => live.limiter.ask(&checks, live.cache_denials, asking).await,
    };
    let decisions = verdict::decisions(&answer);
    let local = matches!(answer, Answer::Local(_));
    let ruled: Vec<Ruled> = limits.iter().map(Limit::ruled).collect();
    let v = verdict::judge(&ruled, decisions.as_deref(), live.config.store.on_error);
    let leases = match (&decisions, v) {
        // A call that timed out may still have run: take back any lease it could have
        // written (a no-op where it did not).
        (None, _) => {
            Leases::abandon(&live.limiter, &checks);
            None
        }
        // Every enforcing concurrency check of a request let through took its slot, and
        // the watching ones that allowed (charged as if enforced).
        (Some(d), Verdict::Forward | Verdict::Delay(_)) => {
            Leases::taken(&live.limiter, local, &checks, |k| {
                d[k].is_some_and(|d| d.allowed)
            })
        }
        _ => None,
    };
    (decisions, v, leases, local)
}

/// Count each rule's decision (`denied`: another rule, or this one, denied the request);
/// the first watching rule that would have denied. The passes (allowed, delayed) count
/// once the upstream has answered ([`Pass::count_passed`]).
fn tally<'l>(
    live: &Live,
    limits: &[Limit<'l, '_>],
    decisions: &[Option<Decision>],
    denied: bool,
) -> Option<&'l str> {
    let mut shadow_denied = None;
    for (l, d) in limits.iter().zip(decisions) {
        let Some(d) = d else { continue };
        let Some(counters) = live.counters.get(l.index) else {
            continue;
        };
        match Tally::of(l.enforced, d, denied) {
            Tally::Allowed | Tally::Delayed => {}
            Tally::DeniedByOther => {
                counters.denied_by_other.inc();
            }
            Tally::Denied => {
                counters.denied.inc();
            }
            Tally::ShadowDenied => {
                shadow_denied.get_or_insert(l.rule.name.as_str());
                counters.shadow_denied.inc();
            }
        }
    }
    shadow_denied
}

/// A forwarded request the upstream did not answer (502, 504), counted under each rule
/// that let it through (each [`Applied`] carries its rule's position).
fn count_rule_failures(live: &Live, pass: &Pass<'_>, e: &upstream::Error) {
    if e.is_client_error() {
        return;
    }
    let timeout = e.status() == StatusCode::GATEWAY_TIMEOUT;
    for a in pass.applied.iter().chain(&pass.shadow) {
        if let Some(c) = live.counters.get(a.index) {
            if timeout {
                c.upstream_timeout.inc();
            } else {
                c.upstream_error.inc();
            }
        }
    }
}

/// The store failed: forward unlimited or answer 503, as `on_error` said.
fn store_failed<'l>(
    live: &'l Live,
    limits: &[Limit<'l, '_>],
    verdict: Verdict,
    to: Destination,
    dialect: Dialect,
) -> Admission<'l> {
    for l in limits {
        live.counters[l.index].error.inc();
    }
    let note = Note {
        rule: limits.first().map(|l| l.rule.name.as_str()),
        identity: limits.first().map(|l| l.identity.digest),
        ..Note::gateway("store_error").to(&to, &live.config)
    };
    if verdict == Verdict::Unlimited {
        return Admission::Forward(Pass::unlimited(note, to, dialect));
    }
    let p = Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the rate-limit store is unavailable",
    );
    let resp = problem(p.with_retry_after(1), &live.config, &[], dialect);
    Admission::Answer(resp, note)
}

/// The answer to a request refused before any limit: its status and reason, and a bearer
/// token's challenge (`WWW-Authenticate`) where a token was missing or did not verify.
fn refused(refusal: crate::identity::Refusal) -> Problem {
    let p = Problem::new(refusal.status(), refusal.to_string()).with_challenge(refusal.challenge());
    match refusal {
        crate::identity::Refusal::KeysUnavailable => p.with_retry_after(1),
        crate::identity::Refusal::Throttled(ms) => p.with_retry_after(ms.div_ceil(1000).max(1)),
        _ => p,
    }
}
