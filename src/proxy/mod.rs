//! One request, top to bottom, in its [`RequestCtx`]: the phases of [`Gateway::handle`]
//! run in the order they are written below — screen its head (`screen.rs`), read what its
//! body asks a model for (`tokens.rs`), identify it (its [`Subject`]'s requester), decide
//! it ([`decide::decide`]: its route, the rules that apply and who it is under each, the
//! store's answer, one pure verdict), wait for the tokens it took ahead, ask its pool's
//! overload protection (`overload.rs`), forward it, respond (settle what the answer says,
//! `settle.rs`; tunnel an upgrade, `switched.rs`), and `finish`: the one place that writes
//! its access line, counts it and feeds the status page, all read off its
//! [`Disposition`].
//!
//! Every answer written here goes through [`problem`], which writes it as HTTP
//! (problem+json) or, to a gRPC call, as a gRPC answer ([`grpc`]). [`Gateway::admit`]
//! runs the phases up to forwarding (the part tested in process, with an injected clock
//! and no sockets). The live configuration each request runs on ([`Live`]) is swapped
//! whole on reload ([`crate::runtime::Current`]).

mod access;
mod answer;
mod body;
mod context;
mod ctx;
pub mod grpc;
mod overload;
pub mod screen;
mod settle;
mod switched;
mod tokens;

use std::sync::Arc;
use std::time::Instant;

use http::request::Parts;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::Either;
use hyper::body::Incoming;

use crate::config::{Config, Source};
use crate::decide::{self, Rejection, Subject};
use crate::headers::{self, Problem};
use crate::runtime::requests::{status_class, FrontEndKind};
use crate::runtime::Ended;
use crate::telemetry::disposition::Disposition;
use crate::telemetry::Gauged;
use crate::upstream::{self, Downstream};
use access::AccessLine;
use grpc::{Dialect, Origin};

pub use crate::runtime::{Current, Live, Metrics, ReloadError};
use answer::close_after;
pub use answer::problem;
pub use body::{Body, LeasedBody};
pub use context::Context;
pub use ctx::RequestCtx;

/// The request pipeline, on the configuration the runtime keeps current.
pub struct Gateway {
    /// Shared with the front-ends on listeners of their own ([`crate::front_end::Shared`]).
    current: Arc<Current>,
    metrics: Arc<Metrics>,
}

/// Whether a request's host is one the gateway would serve: a `Host` and authority that
/// are `uri-host [ ":" port ]` and agree (the screen's rule, for answers made before the
/// gateway proper, such as `redirect_https`'s 308, whose `Location` is built from it).
pub fn host_is_sound(version: http::Version, uri: &http::Uri, headers: &HeaderMap) -> bool {
    screen::host_problem(version, uri, headers).is_none()
}

/// What the gateway decided about a request, before anything went upstream
/// ([`Gateway::admit`]): answered by the gateway (a bad request, a refusal, a denial, a
/// failed store), or to be forwarded; its context either way.
// Made once per request and matched at once: boxing the answer would cost more than the
// bytes it saves.
#[allow(clippy::large_enum_variant)]
pub enum Admission<'l> {
    Answer(Response<Body>, RequestCtx<'l>),
    Forward(RequestCtx<'l>),
}

impl Gateway {
    pub fn new(live: Live, source: Option<Source>, metrics: Arc<Metrics>) -> Gateway {
        let current = Arc::new(Current::new(live, source, metrics.clone()));
        Gateway::sharing(current, metrics)
    }

    /// The gateway on a [`Current`] the server shares with the other front-ends.
    pub fn sharing(current: Arc<Current>, metrics: Arc<Metrics>) -> Gateway {
        Gateway { current, metrics }
    }

    /// The configuration requests start on now.
    pub fn live(&self) -> Arc<Live> {
        self.current.live()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Re-read the config file ([`Current::reload`]).
    pub fn reload(&self) -> Result<(), ReloadError> {
        self.current.reload()
    }

    /// Serve one request, in its connection's context: its phases in the order they run,
    /// then `finish`.
    /// `conn` is borrowed: an `async fn`'s arguments are laid out twice in its future.
    pub async fn handle(&self, req: Request<Incoming>, conn: &Context) -> Response<Body> {
        let _in_flight = Gauged::new(&self.metrics.gateway.in_flight);
        let live = self.current.live();
        let line = AccessLine::start(&req, &conn.peer, &live.config);
        self.metrics
            .gateway
            .count_protocol(req.version(), conn.peer.tls.as_ref().map(|t| t.version));
        let (mut parts, body) = req.into_parts();
        self.drop_underscored(&live.config, &mut parts.headers);
        let mut ctx = RequestCtx::new(&live, Dialect::of(&parts.headers), line);
        // Read only where a rule the request meets reserves what its body asks for.
        let mut body = upstream::RequestBody::from(body);
        let resp = match self.admit_in(&mut ctx, &parts, conn, Some(&mut body)).await {
            Err(answer) => answer,
            // Boxed: most of this future's size, moved whole even for a 429.
            Ok(()) => Box::pin(self.forward(&mut ctx, parts, body, conn)).await,
        };
        self.finish(ctx, resp)
    }

    /// Everything a request goes through before it is forwarded: screened, matched,
    /// identified (from its parts and its connection's [`Context`]: the peer, the client
    /// certificate), limited, judged. No socket is touched: the store is asked, and
    /// nothing else happens outside the process.
    ///
    /// A gRPC call (by its `content-type`, [`Dialect::of`]) gets gRPC answers.
    pub async fn admit<'l>(&self, live: &'l Live, parts: &Parts, conn: &Context) -> Admission<'l> {
        let mut ctx = RequestCtx::new(live, Dialect::of(&parts.headers), None);
        match self.admit_in(&mut ctx, parts, conn, None).await {
            Ok(()) => Admission::Forward(ctx),
            Err(resp) => Admission::Answer(resp, ctx),
        }
    }

    /// The phases before forwarding: screen, read what the body asks for (`body`: still
    /// streaming from the client, read where a rule it meets reserves `max_tokens`),
    /// identify, decide. `Err`: the gateway's answer.
    async fn admit_in<'l>(
        &self,
        ctx: &mut RequestCtx<'l>,
        parts: &Parts,
        conn: &Context,
        body: Option<&mut upstream::RequestBody>,
    ) -> Result<(), Response<Body>> {
        self.screen(ctx, parts, conn)?;
        let subject = Subject {
            method: &parts.method,
            uri: &parts.uri,
            headers: &parts.headers,
            peer: conn.peer.ip(),
            client_cert: conn.client_cert.as_ref(),
        };
        let asked = self.read_asked(ctx, &subject, parts, body).await?;
        let live = ctx.live;
        let requester = subject.requester(&live.config);
        let decided = decide::decide(live, &subject, &requester, asked, &mut ctx.decided).await;
        // What it counts, as the decision returned it.
        let named = |index| decide::named(&live.config, &requester, index);
        let disposition = ctx.decided.disposition;
        let proxied = FrontEndKind::Proxy;
        (self.metrics).decided(live, proxied, disposition, &ctx.decided.counts, named);
        // Whoever decided, the access line names the key's label: looked up (a key's
        // digest, where no rule took it) only where an access line is written.
        if tracing::enabled!(target: "ratewall::access", tracing::Level::INFO) {
            ctx.label = requester.label().cloned();
        }
        decided.map_err(|r| rejected(ctx, r))
    }

    /// A client's fields with an underscore in their name are dropped unless
    /// `underscores_in_headers` (a backend may read `X_Api_Key` as `X-Api-Key`).
    fn drop_underscored(&self, cfg: &Config, headers: &mut HeaderMap) {
        if !cfg.server.underscores_in_headers {
            let dropped = screen::drop_underscored(headers);
            if dropped > 0 {
                self.metrics
                    .gateway
                    .underscore_fields_dropped
                    .inc_by(dropped);
            }
        }
    }

    /// Screen: a head the gateway will not pass on is answered 400 (or 501).
    // The answer is made once and returned at once: boxing it would cost an allocation
    // per refused request.
    #[allow(clippy::result_large_err)]
    fn screen(
        &self,
        ctx: &mut RequestCtx<'_>,
        parts: &Parts,
        conn: &Context,
    ) -> Result<(), Response<Body>> {
        let Some(p) = screen::problem(parts) else {
            return Ok(());
        };
        tracing::debug!(peer = %conn.peer.ip(), status = p.status.as_u16(), "malformed request refused");
        let not_implemented = p.status == StatusCode::NOT_IMPLEMENTED;
        ctx.decided
            .disposed(Disposition::Malformed { not_implemented });
        let mut resp = problem(p, ctx.config(), &[], ctx.dialect);
        if parts.version < http::Version::HTTP_2 {
            close_after(&mut resp);
        }
        Err(resp)
    }

    /// What the body asks a model for, read before anything is identified (identities are
    /// not held across a wait), where a rule the request meets reserves it.
    async fn read_asked(
        &self,
        ctx: &mut RequestCtx<'_>,
        subject: &Subject<'_>,
        parts: &Parts,
        body: Option<&mut upstream::RequestBody>,
    ) -> Result<Option<tokens::Asked>, Response<Body>> {
        let live = ctx.live;
        let Some(body) = body.filter(|_| decide::may_read_body(live, subject)) else {
            return Ok(None);
        };
        let timeout = live.config.server.timeouts.body;
        match tokens::read_into(body, parts, timeout).await {
            Ok(asked) => Ok(Some(asked)),
            Err(p) => {
                // The rest of the body is in an unknown state: nothing after it on this
                // connection can be trusted to start where a request starts.
                ctx.decided.disposed(Disposition::BodyUnread);
                let mut resp = problem(p, ctx.config(), &[], ctx.dialect);
                close_after(&mut resp);
                Err(resp)
            }
        }
    }

    /// Wait for the tokens taken ahead (`max_delay`), then forward: the upstream's answer with the
    /// rate-limit headers, or the gateway's answer to what went wrong.
    async fn forward(
        &self,
        ctx: &mut RequestCtx<'_>,
        mut parts: Parts,
        body: upstream::RequestBody,
        conn: &Context,
    ) -> Response<Body> {
        if !ctx.decided.waited.is_zero() {
            let _waiting = Gauged::new(&self.metrics.gateway.waiting);
            tokio::time::sleep(ctx.decided.waited).await;
        }
        ctx.decided.slots.clear();
        let live = ctx.live;
        let cfg = &*live.config;
        let peer = &conn.peer;
        let down = Downstream {
            peer,
            trusted: crate::identity::is_trusted(
                peer.ip().to_canonical(),
                &cfg.client_ip.trusted_proxies,
            ),
            body_timeout: cfg.server.timeouts.body,
        };
        let version = parts.version;
        let started = Instant::now();
        // Never without: a request is admitted with its destination, one of the config's
        // pools, and `live` is built from it.
        let Some((to, pool)) = ctx
            .decided
            .to
            .and_then(|to| Some((to, live.pools.get(to.pool)?)))
        else {
            drop(ctx.decided.leases.take());
            return self.upstream_failed(ctx, upstream::Error::NoServer, version, conn);
        };
        let target = to.target(cfg, &parts.uri);
        // The claims' headers come from the verified token only: a client's own copies
        // are dropped, whether or not the request carried a token.
        if let Some(jwt) = &cfg.jwt {
            for (_, header) in &jwt.verifier.settings.forward_claims {
                parts.headers.remove(header);
            }
            for (header, value) in std::mem::take(&mut ctx.decided.claims) {
                parts.headers.append(header, value);
            }
        }
        ctx.settled_fields(&mut parts.headers);
        // An upgrade goes up as one only where the client's side can switch too.
        let upgrade = upstream::Upgrade::asked(&parts, hyper::body::Body::is_end_stream(&body))
            .and_then(|asked| {
                let on = parts.extensions.remove::<hyper::upgrade::OnUpgrade>()?;
                Some((asked, on))
            });
        let mut out = upstream::Outbound::new(parts, body, target, &pool.default_host());
        if let Some((asked, _)) = &upgrade {
            out.upgrading(asked.clone());
        }
        ctx.settled_outbound(&mut out);
        let pick = upstream::Pick {
            hash: to.hash,
            worker: conn.worker,
        };
        let permit = match self.permit(ctx, pool).await {
            Ok(permit) => permit,
            Err(resp) => return resp,
        };
        let forwarded = pool.forward(&mut out, &down, pick).await;
        if let (Some(p), true) = (permit, forwarded.result.is_ok()) {
            p.answered();
        }
        ctx.server = forwarded.server;
        ctx.attempts = forwarded.attempts;
        let result = forwarded.result;
        self.count_upstream(&result, started);
        if let Err(e) = &result {
            count_rule_failures(ctx, e);
        }
        match result {
            Ok(resp) => self.respond(ctx, resp, upgrade, conn).await,
            Err(e) => {
                // The request is over: its leases are dropped here, giving its slots back.
                drop(ctx.decided.leases.take());
                ctx.unanswered().await;
                self.upstream_failed(ctx, e, version, conn)
            }
        }
    }

    /// The upstream answered: settle what its head says, tunnel an upgrade, and pass the
    /// answer on with the rate-limit headers, its body holding the request's leases.
    async fn respond(
        &self,
        ctx: &mut RequestCtx<'_>,
        mut resp: Response<upstream::ResponseBody>,
        upgrade: Option<(upstream::Upgrade, hyper::upgrade::OnUpgrade)>,
        conn: &Context,
    ) -> Response<Body> {
        ctx.count_passed();
        let meter = ctx.answered(&mut resp).await;
        if let Some((asked, on)) = upgrade {
            self.tunnel(ctx, conn, &mut resp, asked, on);
        }
        let leases = ctx.decided.leases.take();
        let cost_headers = &ctx.live.cost_headers;
        let screened = (!cost_headers.is_empty()).then(|| cost_headers.clone());
        let mut resp = resp.map(|body| {
            let body = LeasedBody::new(body, leases)
                .metered(meter)
                .screened(screened);
            Either::Left(body)
        });
        ctx.decorate(resp.headers_mut());
        ctx.upstream = true;
        resp
    }

    /// The request is over: count it, feed the status page and write its access line,
    /// all read off its context. A redirect (answered before the gateway proper) has its
    /// access line only.
    fn finish(&self, mut ctx: RequestCtx<'_>, mut resp: Response<Body>) -> Response<Body> {
        let status = resp.status().as_u16();
        let d = ctx.decided.disposition;
        // A gRPC answer of the gateway is an HTTP 200: it counts as the status it stands
        // for.
        let meant = match (ctx.dialect, ctx.upstream) {
            (Dialect::Grpc, false) => grpc::status_of(resp.headers())
                .map_or(status, |code| code.stands_for(d.passed_limits())),
            _ => status,
        };
        self.metrics.ended(&Ended {
            disposition: d,
            upstream: ctx.upstream,
            status: meant,
            took: ctx.started.elapsed(),
        });
        if ctx.dialect == Dialect::Grpc {
            self.grpc_answered(&mut resp, &mut ctx, status);
        } else if let Some(line) = ctx.line.take() {
            line.write(status, &ctx.entry());
        }
        resp
    }

    /// A gRPC call's answer: its status counted and logged now when its headers carry it
    /// (the gateway's answers, an upstream's Trailers-Only one), or else, for a passed-on
    /// answer, once its body ends with its trailers ([`grpc::Watch`]).
    fn grpc_answered(&self, resp: &mut Response<Body>, ctx: &mut RequestCtx<'_>, status: u16) {
        let origin = match ctx.upstream {
            true => Origin::Upstream,
            false => Origin::Gateway,
        };
        ctx.grpc_status = grpc::status_of(resp.headers());
        let line = ctx.line.take();
        match (ctx.grpc_status, resp.body_mut()) {
            (None, Either::Left(body)) => {
                let log = line.map(|l| l.defer(status, &ctx.entry()));
                body.watch(grpc::Watch::new(self.metrics.clone(), log));
            }
            (code, _) => {
                if let Some(code) = code {
                    self.metrics.gateway.count_grpc(code, origin);
                }
                if let Some(line) = line {
                    line.write(status, &ctx.entry());
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
        conn: &Context,
        answer: impl FnOnce(&Request<B>) -> Response<Body>,
    ) -> Response<Body> {
        let live = self.current.live();
        let line = AccessLine::start(req, &conn.peer, &live.config);
        let resp = answer(req);
        let mut ctx = RequestCtx::new(&live, Dialect::Http, line);
        match resp.status() {
            StatusCode::PERMANENT_REDIRECT => {
                self.metrics.gateway.https_redirects.inc();
                ctx.decided.disposed(Disposition::Redirected);
            }
            _ => {
                ctx.decided.disposed(Disposition::NotRedirected);
            }
        }
        self.finish(ctx, resp)
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
        ctx: &RequestCtx<'_>,
        e: upstream::Error,
        version: http::Version,
        conn: &Context,
    ) -> Response<Body> {
        let (status, detail) = (e.status(), e.detail());
        if e.is_client_error() {
            tracing::debug!(error = %e, status = status.as_u16(), peer = %conn.peer.addr, "client request failed");
        } else {
            // The pool logs its outages, once each (`upstream::Pool::forward`).
            tracing::debug!(error = %e, status = status.as_u16(), pool = ctx.pool(), "upstream failed");
        }
        let cfg = ctx.config();
        let p = Problem::new(status, detail);
        let mut resp = problem(p, cfg, &ctx.decided.applied, ctx.dialect);
        headers::add_shadow(resp.headers_mut(), cfg.response, &ctx.decided.shadow);
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

/// The answer to a request its decision did not let through: problem+json (or a gRPC
/// status) with its rules' fields where the decision shows them.
fn rejected(ctx: &RequestCtx<'_>, r: Rejection) -> Response<Body> {
    let cfg = ctx.config();
    let d = &ctx.decided;
    let applied: &[headers::Applied<'_>] = if r.shows_limits { &d.applied } else { &[] };
    let mut resp = problem(r.problem, cfg, applied, ctx.dialect);
    if r.shows_limits {
        headers::add_shadow(resp.headers_mut(), cfg.response, &d.shadow);
    }
    if r.close {
        close_after(&mut resp);
    }
    resp
}

/// A forwarded request the upstream did not answer (502, 504), counted under each rule
/// that let it through (each [`Applied`](headers::Applied) carries its rule's position).
fn count_rule_failures(ctx: &RequestCtx<'_>, e: &upstream::Error) {
    if e.is_client_error() {
        return;
    }
    let timeout = e.status() == StatusCode::GATEWAY_TIMEOUT;
    for a in ctx.decided.applied.iter().chain(&ctx.decided.shadow) {
        if let Some(c) = ctx.live.counters.get(a.index) {
            if timeout {
                c.upstream_timeout.inc();
            } else {
                c.upstream_error.inc();
            }
        }
    }
}
