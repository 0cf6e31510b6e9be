//! The decision service (issue 44): ratewall's limits for whoever asks, on a listener of
//! its own (`[decide] listen`, loopback by default; never the proxy's), HTTP/1.1 and h2,
//! cleartext or TLS with `[server.tls]`'s certificates (`[decide] tls = true`).
//!
//! | call | what |
//! | --- | --- |
//! | `POST /v1/decide` | one decision, or a list of them (`api.rs`): a rule and a key, or a described request |
//! | `POST /v1/settle` | a reservation settled at its real cost, or refunded |
//! | `POST /v1/leases`, `PUT` / `DELETE /v1/leases/<id>` | a concurrency slot held, renewed, given back |
//! | `GET`/`POST /v1/forward-auth` | the request a proxy describes (`forward_auth.rs`) |
//! | gRPC `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` | Envoy's rate limit service (`rls/`) |
//!
//! Every call but forward-auth needs `Authorization: Bearer <[decide] token>`, or a
//! client certificate the TLS handshake verified against `[server.tls] client_ca`: 401
//! (with a challenge) for a missing or wrong token, 403 where neither a token nor client
//! certificates are configured. Forward-auth is called by a proxy that passes its
//! client's own `Authorization` on: it is believed from `[client_ip] trusted_proxies`
//! or a verified client certificate alone.
//!
//! Every decision runs the proxy's own core ([`crate::decide`]): the same rules,
//! identities, plans and store keys, counted in the same series, and apart by front-end
//! in `ratewall_decisions_total{frontend}`.

mod answer;
mod api;
pub mod forward_auth;
mod grants;
pub mod rls;

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;

use crate::config::Config;
use crate::connection::{self, InFlight, Track, Tracked};
use crate::front_end::{Accepted, FrontEnd, Handler, Serves, Shared};
use crate::headers::Problem;
use crate::identity::failures::{Allowance, Failures};
use crate::runtime::{Live, Metrics};
use grants::Grants;

/// A decision service answer's body: whole, or (gRPC) with trailers.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

pub type Reply = Response<Body>;

/// The decision service, as the server starts it (`[decide] listen`).
pub const FRONT_END: DecideFrontEnd = DecideFrontEnd;

/// Open connections the decision listener keeps at most: applications keep a few
/// connections each, and a proxy's pool some more.
pub const MAX_CONNECTIONS: usize = 4096;

/// Failed calls (a missing or wrong token) a peer may make at once, then one more per
/// [`GUESS_EVERY_MS`]: the admin token's allowance.
pub const GUESSES: u64 = 10;
pub const GUESS_EVERY_MS: u64 = 1_000;

/// How long calls still under way get once the workers are done.
pub const GRACE: Duration = Duration::from_secs(2);

pub struct DecideFrontEnd;

impl FrontEnd for DecideFrontEnd {
    fn name(&self) -> &'static str {
        "decide"
    }

    fn listen(&self, config: &Config) -> Option<SocketAddr> {
        config.decide.as_ref().map(|d| d.listen)
    }

    fn max_connections(&self, _: &Config) -> usize {
        MAX_CONNECTIONS
    }

    fn grace(&self, _: &Config) -> Duration {
        GRACE
    }

    fn handler(&self, shared: &Shared) -> Box<dyn Serves> {
        Box::new(Ctx::new(shared.clone()))
    }
}

/// What every call of the decision service runs on: the configuration and metrics the
/// proxy shares, and the reservations and leases handed out (held in this process until
/// settled, given back or lapsed). Cloned for each connection.
#[derive(Clone)]
pub struct Ctx {
    shared: Shared,
    grants: Arc<Grants>,
    /// The failed calls of each peer (a wrong or missing token).
    guard: Arc<Failures>,
}

impl Ctx {
    /// Start the upkeep of the reservations and leases (on the current runtime).
    pub fn new(shared: Shared) -> Ctx {
        Ctx {
            shared,
            grants: Grants::start(),
            guard: Arc::new(Failures::new(Allowance {
                burst: GUESSES,
                every_ms: GUESS_EVERY_MS,
            })),
        }
    }

    /// The configuration calls start on now.
    pub fn live(&self) -> Arc<Live> {
        self.shared.live()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        self.shared.metrics()
    }

    /// The service of one connection from `peer` (`client_cert`: the SHA-256 of the
    /// certificate its TLS handshake verified).
    fn service(
        self,
        peer: SocketAddr,
        client_cert: Option<[u8; 32]>,
        track: Arc<Track>,
    ) -> impl connection::Service<Tracked<Body>> {
        service_fn(move |req: Request<Incoming>| {
            let request = InFlight::new(&track);
            let http2 = req.version() == http::Version::HTTP_2;
            let ctx = self.clone();
            async move {
                let answer = ctx.handle(peer, client_cert, req).await;
                Ok::<_, Infallible>(answer.map(|body| Tracked::new(body, request, http2)))
            }
        })
    }

    async fn handle(
        &self,
        peer: SocketAddr,
        client_cert: Option<[u8; 32]>,
        mut req: Request<Incoming>,
    ) -> Reply {
        if req.uri().path() == "/v1/forward-auth" {
            return match *req.method() {
                Method::GET | Method::POST | Method::HEAD => {
                    // A proxy that proved itself with a client certificate is believed as
                    // one from `trusted_proxies` is.
                    if let Some(fp) = client_cert {
                        req.extensions_mut()
                            .insert(crate::identity::ClientCert(fp));
                    }
                    forward_auth::call(self, peer, req).await.map(boxed)
                }
                _ => problem(&Problem::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "forward-auth takes GET or POST",
                )),
            };
        }
        if let Err(p) = self.authorized(peer.ip(), client_cert, &req) {
            return problem(&p);
        }
        if req.uri().path() == rls::PATH {
            return rls::call(self, req).await;
        }
        api::call(self, req).await
    }

    /// Whether a call may be answered: the bearer token, or a verified client
    /// certificate. A peer's failed calls are slowed as the admin API's are (a small
    /// allowance, then 429): a guesser gets one guess a second.
    fn authorized(
        &self,
        peer: IpAddr,
        client_cert: Option<[u8; 32]>,
        req: &Request<Incoming>,
    ) -> Result<(), Box<Problem>> {
        let live = self.live();
        let Some(decide) = &live.config.decide else {
            return Err(Box::new(Problem::new(StatusCode::FORBIDDEN, "[decide] is not configured")));
        };
        if client_cert.is_some() {
            return Ok(());
        }
        let Some(token) = &decide.token_sha256 else {
            return Err(Box::new(Problem::new(
                StatusCode::FORBIDDEN,
                "the decision service needs [decide] token (or RATEWALL_DECIDE_TOKEN), or client certificates",
            )));
        };
        let now = self.guard.now_ms();
        let charged = self.guard.charge(peer, now).map_err(|wait_ms| {
            Box::new(
                Problem::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too many calls with a wrong token from this address",
                )
                .with_retry_after(wait_ms.div_ceil(1000).max(1)),
            )
        })?;
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| crate::front_end::bearer(v.as_bytes()));
        let challenge = Some(HeaderValue::from_static(
            "Bearer realm=\"ratewall decide\"",
        ));
        let detail = match given {
            Some(t) if crate::front_end::same_digest(&crate::identity::sha256(t), token) => {
                self.guard.refund(charged, now);
                return Ok(());
            }
            Some(_) => "the bearer token is not the decision service's",
            None => "Authorization: Bearer <[decide] token> is required",
        };
        if let Some(times) = self.guard.log_due(now) {
            tracing::warn!(%peer, times, "decision service calls refused for their token (missing or wrong)");
        }
        Err(Box::new(
            Problem::new(StatusCode::UNAUTHORIZED, detail).with_challenge(challenge),
        ))
    }
}

/// The decision listener's connections, on the clocks and bounds of the config live when
/// each is accepted; TLS with `[server.tls]`'s certificates where `[decide] tls = true`.
impl Handler for Ctx {
    fn serve(&self, conn: Accepted<'_>) -> Option<impl Future<Output = ()> + Send + 'static> {
        let live = self.live();
        let settings = live.config.server.connections();
        let tls = match (&live.config.decide, &live.config.server.tls) {
            (Some(d), Some(t)) if d.tls => Some(t.server_config.clone()),
            // TLS asked for, and `[server.tls]` taken out by a reload: no cleartext in its
            // place.
            (Some(d), None) if d.tls => return None,
            _ => None,
        };
        drop(live);
        let ctx = self.clone();
        let metrics = self.metrics().clone();
        let (stream, peer, registry, permit) =
            (conn.stream, conn.peer, conn.registry.clone(), conn.permit);
        Some(async move {
            match tls {
                None => {
                    connection::serve(stream, &registry, permit, settings, |track| {
                        ctx.service(peer, None, track)
                    })
                    .await
                }
                Some(config) => {
                    connection::serve_tls(
                        stream,
                        config,
                        &registry,
                        permit,
                        settings,
                        |outcome, session| metrics.connection.tls_handshake(outcome, session),
                        |track, session| ctx.service(peer, session.client_cert, track),
                    )
                    .await
                }
            }
        })
    }
}

/// The access line of one decision made here, with the proxy's fields (target
/// `ratewall::access`): `frontend` says who asked (`decide`, `rls`, `forward_auth`),
/// `method` and `path` what was decided (a described request's, or the call's own),
/// `status` what the proxy would have answered. Never the key, never the query.
pub fn access_line(
    frontend: &'static str,
    method: &str,
    path: &dyn std::fmt::Display,
    client_ip: Option<IpAddr>,
    d: &crate::decide::Decided<'_>,
    status: u16,
) {
    if !tracing::enabled!(target: "ratewall::access", tracing::Level::INFO) {
        return;
    }
    let id = d.identity.map(|i| i.tag());
    tracing::info!(
        target: "ratewall::access",
        frontend,
        method,
        path = %path,
        status,
        client_ip = client_ip.map(tracing::field::display),
        rule = d.rule.unwrap_or("-"),
        decision = d.disposition.decision(),
        shadow_denied = d.shadow_denied.unwrap_or("-"),
        waited_ms = d.waited.as_millis() as u64,
        id = id.as_ref().map_or("-", |h| h.as_str()),
        dry_run = d.dry_run,
    );
}

/// A whole body.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed_unsync()
}

fn boxed(body: Full<Bytes>) -> Body {
    body.boxed_unsync()
}

/// `p` as problem+json.
pub fn problem(p: &Problem) -> Reply {
    let mut r = Response::new(full(p.body.clone()));
    *r.status_mut() = p.status;
    p.headers(r.headers_mut());
    r
}

/// `value` as JSON, with `status`.
pub fn json(status: StatusCode, value: &impl serde::Serialize) -> Reply {
    match serde_json::to_vec(value) {
        Ok(b) => json_bytes(status, b),
        Err(e) => problem(&Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode the answer: {e}"),
        )),
    }
}

/// An answer of JSON already written.
pub fn json_bytes(status: StatusCode, body: Vec<u8>) -> Reply {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}
