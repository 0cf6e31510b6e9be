//! The admin listener: `/metrics`, `/healthz`, `/readyz`, the admin API and the status page.
//!
//! | call | what |
//! | --- | --- |
//! | `GET /` | the status page (self-contained HTML; refreshes itself) |
//! | `GET /status.json` | what the status page shows, with no key material |
//! | `GET /metrics` | Prometheus metrics (OpenMetrics text) |
//! | `GET /healthz` | 200 while the process runs |
//! | `GET /readyz` | 200 while traffic is served as configured, else 503 |
//! | `GET /admin/stats` | the status page's data, with each limited key's hint and a token's claims |
//! | `GET /admin/top?minutes=5&n=20` | the most limited identities (tag + hint, label, a token's claims; never a key) |
//! | `GET /admin/state?rule=R&key=K` (or `ip=`, `header=`, nothing for `global`) | one identity's state |
//! | `POST /admin/reset?rule=R&key=K` (likewise) | forget one identity's state |
//! | `PUT /admin/keys/<sha256-hex>` `{"plan":"pro"}` | list an API key (by its digest) with a plan, at runtime |
//! | `POST /admin/keys` `{"key":"<raw>","plan":"pro"}` | the same by the raw key (hashed on arrival, never kept) |
//! | `DELETE /admin/keys/<sha256-hex>` | revoke a runtime key, from the next request on |
//! | `GET /admin/keys?plan=P&after=<hex>&limit=100` | listed keys' digests and plans, by digest, paginated (`next`) |
//!
//! Every `/admin/*` call needs `Authorization: Bearer <token>` (the scheme in any case,
//! RFC 9110 §11.1), read-only ones too: a state answer tells whether a key has a plan and
//! how much of it is left, which is what someone guessing keys wants to know. Without a
//! configured token they answer 403. A peer's failed calls are counted, logged now and
//! then, and slowed ([`guard`]: 429 once a small allowance is used up). The status page,
//! `/status.json` and `/metrics` stay readable without one, and carry no key material
//! (identities by hash, keys never by their characters).
//!
//! The identity is given raw (the key, the address) and hashed here, as on the request
//! path; answers name it by its hash only. The key calls are `admin/keys.rs`' (every
//! gateway sees a change within a second; see there).

mod guard;
mod keys;

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use serde::Serialize;

use crate::config::Config;
use crate::connection::{self, InFlight, Track, Tracked};
use crate::front_end::{bearer, constant_time_eq, Accepted, FrontEnd, Handler, Serves, Shared};
use crate::headers::ceil_secs;
use crate::identity;
use crate::identity::{IdentityDigest, KeyKind, Requester};
use crate::limiter::breaker::Health;
use crate::limiter::{Check, OnError, Quota};
use crate::rules::Rule;
use crate::runtime::requests::RuleCounters;
use crate::runtime::Live;
use crate::telemetry::stats::{TopEntry, Window, HISTORY_SECS, SAMPLE_SECS};
use guard::{Failure, Guard};

const STATUS_PAGE: &str = include_str!("status.html");

type Reply = Response<Full<Bytes>>;

/// A call the admin API refuses, turned into a JSON error reply by [`refused`].
type BadCall = (StatusCode, String);

fn refused((status, message): BadCall) -> Reply {
    let mut answer = error(status, &message);
    if status == StatusCode::UNAUTHORIZED {
        answer.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"ratewall admin\""),
        );
    }
    answer
}

/// Who a stats answer is for: anyone who can reach the admin listener (the status page),
/// or a holder of the admin token.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Audience {
    Public,
    Admin,
}

/// The admin front-end, as the server starts it (`[server] admin_listen`).
pub const FRONT_END: AdminFrontEnd = AdminFrontEnd;

/// Open connections the admin listener takes at most: enough for dashboards and scrapers,
/// and a bound of its own, so a flood of gateway clients never locks the operator out.
pub const ADMIN_MAX_CONNECTIONS: usize = 256;

/// How long admin calls still under way get once the workers are done (scrapes and
/// status pages answer in milliseconds; idle admin connections close at once).
pub const ADMIN_GRACE: Duration = Duration::from_secs(1);

/// The admin listener: on `[server] admin_listen`, a bound of its own on its connections,
/// served by [`Admin`]; it keeps serving while the workers drain (their drain can be
/// watched), then gets [`ADMIN_GRACE`].
pub struct AdminFrontEnd;

impl FrontEnd for AdminFrontEnd {
    fn name(&self) -> &'static str {
        "admin"
    }

    fn listen(&self, config: &Config) -> Option<SocketAddr> {
        config.server.admin_listen
    }

    fn max_connections(&self, _: &Config) -> usize {
        ADMIN_MAX_CONNECTIONS
    }

    fn grace(&self, _: &Config) -> Duration {
        ADMIN_GRACE
    }

    fn handler(&self, shared: &Shared) -> Box<dyn Serves> {
        Box::new(Admin::new(shared.clone()))
    }
}

/// The admin listener's side of its connections: the status page's sampler and the
/// guard on the admin token, for as long as the listener serves. The listener itself is
/// the server's, the accept loop every listener runs with a connection bound of its own;
/// each connection gets the same handling as the gateway's (its timeouts, its head size
/// bound) and [`Admin::service`]. Cloned for each connection.
#[derive(Clone)]
pub struct Admin {
    shared: Shared,
    /// The failed calls of each peer.
    guard: Arc<Guard>,
    /// The status page's history: the counts sampled every few seconds.
    _sampler: Arc<AbortOnDrop>,
}

impl Admin {
    /// Start the sampler (on the current runtime).
    pub fn new(shared: Shared) -> Admin {
        let sampler = AbortOnDrop(tokio::spawn({
            let metrics = shared.metrics().clone();
            async move {
                let mut every = tokio::time::interval(std::time::Duration::from_secs(SAMPLE_SECS));
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    every.tick().await;
                    metrics.stats.sample();
                }
            }
        }));
        guard::count_from_zero(&shared.metrics().admin.auth_failures);
        Admin {
            shared,
            guard: Arc::new(guard::new_guard()),
            _sampler: Arc::new(sampler),
        }
    }

    /// The service of one connection from `peer`: its calls, each tracked as in flight
    /// until its answer's body is done.
    pub fn service(
        self,
        peer: SocketAddr,
        track: Arc<Track>,
    ) -> impl connection::Service<Tracked<Full<Bytes>>> {
        let (shared, guard) = (self.shared, self.guard);
        service_fn(move |req: Request<Incoming>| {
            let request = InFlight::new(&track);
            let http2 = req.version() == http::Version::HTTP_2;
            let (shared, guard) = (shared.clone(), guard.clone());
            async move {
                let answer = handle(&shared, &guard, peer, req).await;
                Ok::<_, Infallible>(answer.map(|body| Tracked::new(body, request, http2)))
            }
        })
    }
}

/// The admin listener's connections: the admin API's, on the clocks and bounds of the
/// config live when each is accepted.
impl Handler for Admin {
    fn serve(&self, conn: Accepted<'_>) -> Option<impl Future<Output = ()> + Send + 'static> {
        let settings = self.shared.live().config.server.connections();
        let (stream, peer, registry, permit) =
            (conn.stream, conn.peer, conn.registry.clone(), conn.permit);
        let admin = self.clone();
        Some(async move {
            connection::serve(stream, &registry, permit, settings, |track| {
                admin.service(peer, track)
            })
            .await
        })
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn respond(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Reply {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn text(status: StatusCode, body: impl Into<String>) -> Reply {
    respond(status, "text/plain; charset=utf-8", body.into())
}

fn json(status: StatusCode, value: &impl Serialize) -> Reply {
    match serde_json::to_vec(value) {
        Ok(body) => respond(status, "application/json", body),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode: {e}\n"),
        ),
    }
}

fn error(status: StatusCode, message: &str) -> Reply {
    json(status, &serde_json::json!({ "error": message }))
}

async fn handle(shared: &Shared, guard: &Guard, peer: SocketAddr, req: Request<Incoming>) -> Reply {
    let path = req.uri().path();
    let method = req.method();
    if path.starts_with("/admin/") {
        if let Some(refusal) = guarded(shared, guard, peer.ip(), &req) {
            return refusal;
        }
        if path == "/admin/keys" || path.starts_with("/admin/keys/") {
            return keys::call(shared, peer.ip(), req).await;
        }
        let query = parse_query(req.uri().query().unwrap_or(""));
        return match (method, path) {
            (&Method::GET, "/admin/stats") => json(StatusCode::OK, &stats(shared, Audience::Admin)),
            (&Method::GET, "/admin/top") => {
                let minutes = number(&query, "minutes").unwrap_or(5).clamp(1, 10);
                let n = number(&query, "n").unwrap_or(20).clamp(1, 100) as usize;
                json(StatusCode::OK, &shared.metrics().stats.top(minutes, n))
            }
            (&Method::GET, "/admin/state") => identity_call(shared, &query, false).await,
            (&Method::POST, "/admin/reset") => identity_call(shared, &query, true).await,
            (_, "/admin/stats" | "/admin/top" | "/admin/state" | "/admin/reset") => {
                error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
            }
            _ => error(StatusCode::NOT_FOUND, "not found"),
        };
    }
    match (method, path) {
        (&Method::GET, "/") => respond(StatusCode::OK, "text/html; charset=utf-8", STATUS_PAGE),
        (&Method::GET, "/status.json") => json(StatusCode::OK, &stats(shared, Audience::Public)),
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") => readyz(shared).await,
        (&Method::GET, "/metrics") => respond(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            shared.metrics().encode(),
        ),
        (_, "/" | "/status.json" | "/healthz" | "/readyz" | "/metrics") => {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        }
        _ => error(StatusCode::NOT_FOUND, "not found"),
    }
}

/// 200 while traffic is served as configured: the store answers, or it fails and
/// `on_error` (allow, local) lets traffic through; 503 while `on_error = "deny"` turns
/// requests away. The body says which, and the breaker's state.
async fn readyz(shared: &Shared) -> Reply {
    let live = shared.live();
    let limiter = &live.limiter;
    let on_error = limiter.on_error();
    let breaker = match limiter.health() {
        Health::Open => "open",
        Health::Healthy | Health::Failing => "closed",
    };
    // The current primary, under Sentinel: `(redis_sentinel mymaster → 10.0.0.2:6379)`.
    let store = limiter.store();
    let named = match store.primary() {
        Some(_) => format!(" ({})", store.describe()),
        None => String::new(),
    };
    match limiter.ping().await {
        Ok(()) => text(
            StatusCode::OK,
            format!("ready: store answers{named}; breaker closed\n"),
        ),
        Err(e) => {
            let (status, verdict) = if on_error == OnError::Deny {
                (StatusCode::SERVICE_UNAVAILABLE, "not ready")
            } else {
                (StatusCode::OK, "ready")
            };
            text(
                status,
                format!(
                    "{verdict}: store failing ({e}){named}; breaker {breaker}; on_error = {}\n",
                    on_error.name()
                ),
            )
        }
    }
}

/// An admin call through the [`guard`]: `None` to serve it, or its refusal. A peer whose
/// failures used up its allowance is answered 429 (its token not checked); else the token
/// is checked, and a failure charged, counted and (now and then) logged with the peer —
/// never with the token.
fn guarded(shared: &Shared, guard: &Guard, peer: IpAddr, req: &Request<Incoming>) -> Option<Reply> {
    let now = guard.now_ms();
    let failure = match guard.charge(peer, now) {
        Err(wait_ms) => Err((Some(Failure::Throttled), wait_ms)),
        Ok(charged) => {
            let checked = authorized(shared, req);
            // Only failures are charged: a right token (or no token to guess) gives it back.
            if matches!(checked, Ok(()) | Err(None)) {
                guard.refund(charged, now);
            }
            checked.map_err(|f| (f, 0))
        }
    };
    let (why, wait_ms) = match failure {
        Ok(()) => return None,
        Err((Some(why), wait_ms)) => (why, wait_ms),
        // No token configured: nothing to guess.
        Err((None, _)) => {
            return Some(refused((
                StatusCode::FORBIDDEN,
                "admin calls are off: set [admin].token or RATEWALL_ADMIN_TOKEN".into(),
            )))
        }
    };
    guard::count(&shared.metrics().admin.auth_failures, why);
    if let Some(times) = guard.log_due(now) {
        tracing::warn!(
            %peer,
            reason = why.name(),
            times,
            "admin calls refused for their token (missing, wrong, or throttled after repeated failures)"
        );
    }
    Some(match why {
        Failure::Throttled => {
            let secs = wait_ms.div_ceil(1000).max(1);
            let mut answer = error(
                StatusCode::TOO_MANY_REQUESTS,
                &format!("too many failed admin calls from this address: retry in {secs} s"),
            );
            answer
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
            answer
        }
        _ => refused((
            StatusCode::UNAUTHORIZED,
            "a valid admin token is required".into(),
        )),
    })
}

/// Whether the call carries the admin token: `Ok`, or why not (`None`: no token is
/// configured, the admin API is off).
fn authorized(shared: &Shared, req: &Request<Incoming>) -> Result<(), Option<Failure>> {
    let live = shared.live();
    let token = live.config.admin.token.as_deref().ok_or(None)?;
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer(v.as_bytes()))
        .ok_or(Some(Failure::Missing))?;
    match constant_time_eq(given, token.as_bytes()) {
        true => Ok(()),
        false => Err(Some(Failure::Wrong)),
    }
}

#[derive(Serialize)]
struct StateAnswer<'a> {
    rule: &'a str,
    /// The identity's tag (8 hex digits keyed by the deployment's secret), as logs and
    /// /admin/top show it.
    identity: String,
    /// Its digest (32 hex digits): what its Redis keys are named by,
    /// `<prefix>:{<digest>}:<rule>`. For token holders, as Redis key names are.
    digest: String,
    /// Its API key's label, where the rule counts by a key listed with one.
    #[serde(skip_serializing_if = "Option::is_none")]
    label: Option<String>,
    algorithm: &'static str,
    limit: u64,
    window_s: u64,
    burst: u64,
    cost: u64,
    /// Requests (of cost 1) still allowed now.
    remaining: u64,
    /// Seconds, rounded up, until the full quota is back.
    reset_s: u64,
    /// Whether a request of the rule's cost would pass now.
    allowed_now: bool,
}

/// The rule and identity a `state` or `reset` call names, and its key's label if it has
/// one: the request path's own [`Requester::identify`], given a request that carries the
/// named key (`key=`, or `header=` for a `header:` rule) or comes from the named address
/// (`ip=`).
fn target<'c>(cfg: &'c Config, query: &[(String, Vec<u8>)]) -> Result<Target<'c>, BadCall> {
    let rule_name = param(query, "rule")
        .ok_or_else(|| (StatusCode::BAD_REQUEST, "rule= is required".to_string()))?;
    let rule = cfg
        .rules
        .iter()
        .find(|r| r.name.as_bytes() == rule_name)
        .ok_or_else(|| (StatusCode::NOT_FOUND, "no such rule".to_string()))?;
    let need = |name: &str| {
        param(query, name).filter(|v| !v.is_empty()).ok_or_else(|| {
            (
                StatusCode::BAD_REQUEST,
                format!("this rule counts by {name}: give {name}="),
            )
        })
    };
    let bad = |what: &str| (StatusCode::BAD_REQUEST, format!("{what} is not valid"));
    if let KeyKind::Jwt(_)
    | KeyKind::Combined(_)
    | KeyKind::Target
    | KeyKind::Credential(_)
    | KeyKind::Caller = &rule.key.kind
    {
        let (rule, digest, quota) = named_parts(rule, query)?;
        return Ok((rule, digest, quota, None));
    }
    let (peer, value) = match &rule.key.kind {
        KeyKind::Global => (IpAddr::from([0, 0, 0, 0]), None),
        KeyKind::ClientIp => {
            let ip = std::str::from_utf8(need("ip")?)
                .ok()
                .and_then(|s| s.trim().parse::<IpAddr>().ok())
                .ok_or_else(|| bad("ip="))?;
            (ip.to_canonical(), None)
        }
        KeyKind::ApiKey => (IpAddr::from([0, 0, 0, 0]), Some(need("key")?)),
        KeyKind::Header(_) => (IpAddr::from([0, 0, 0, 0]), Some(need("header")?)),
        KeyKind::ClientCert
        | KeyKind::Jwt(_)
        | KeyKind::Combined(_)
        | KeyKind::Target
        | KeyKind::Credential(_)
        | KeyKind::Caller => (IpAddr::from([0, 0, 0, 0]), None),
    };
    // `cert=`: the certificate's SHA-256 fingerprint, as `openssl x509 -fingerprint
    // -sha256` prints it (colons optional).
    let cert = match rule.key.kind {
        KeyKind::ClientCert => {
            Some(fingerprint(need("cert")?).ok_or_else(|| bad("cert= (64 hex digits)"))?)
        }
        _ => None,
    };
    let headers = match value {
        Some(v) => {
            identity::headers_naming(&rule.key.kind, &cfg.keys, v).ok_or_else(|| bad("the key"))?
        }
        None => http::HeaderMap::new(),
    };
    // The address is given as the client's own: no forwarding header is read for it.
    let direct = identity::ClientIp::default();
    let requester =
        Requester::new(&headers, peer, &cfg.keys, &direct).with_client_cert(cert.as_ref());
    let identity = requester
        .identify(&rule.key)
        .map_err(|r| (r.status(), r.to_string()))?;
    // Its `match` is not asked: an identity's state is the same on every path.
    let quota = rule.quota_for(requester.plan()).ok_or_else(|| {
        (
            StatusCode::NOT_FOUND,
            "this key's plan is exempt from the rule: nothing is counted for it".to_string(),
        )
    })?;
    let label = requester.label_of(&identity.source).map(|l| l.to_string());
    Ok((rule, identity.digest, quota, label))
}

/// What [`target`] finds: the rule, the identity's digest, its quota, its key's label.
type Target<'c> = (&'c Rule, IdentityDigest, &'c Quota, Option<String>);

/// The identity of a rule counting by a token claim or a combination, named part by
/// part as the rule's `key` writes them (`jwt:org_id=acme&header:x-project=p1`; for a
/// single claim, `jwt:sub=alice`): a claim's text, a header's value, `api_key=`,
/// `client_ip=`, `client_cert=` (its SHA-256). No token is verified: the caller names
/// the identity. Its plan is `plan=`, where given.
fn named_parts<'c>(
    rule: &'c Rule,
    query: &[(String, Vec<u8>)],
) -> Result<(&'c Rule, IdentityDigest, &'c Quota), BadCall> {
    let one = |kind: &KeyKind| {
        let name = kind.to_string();
        let value = param(query, &name)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| {
                (
                    StatusCode::BAD_REQUEST,
                    format!("this rule counts by {}: give {name}=", rule.key.kind),
                )
            })?;
        identity::digest_part(kind, value)
            .ok_or_else(|| (StatusCode::BAD_REQUEST, format!("{name}= is not valid")))
    };
    let digest = match &rule.key.kind {
        KeyKind::Combined(parts) => {
            let digests = parts.iter().map(one).collect::<Result<Vec<_>, _>>()?;
            identity::digest_combined(&digests)
        }
        kind => one(kind)?,
    };
    let plan = param(query, "plan").and_then(|p| std::str::from_utf8(p).ok());
    let quota = rule.quota_for(plan).ok_or_else(|| {
        (
            StatusCode::NOT_FOUND,
            "this plan is exempt from the rule: nothing is counted for it".to_string(),
        )
    })?;
    Ok((rule, digest, quota))
}

/// A SHA-256 fingerprint in hex, colons allowed.
fn fingerprint(text: &[u8]) -> Option<identity::ClientCert> {
    identity::parse_fingerprint(text).map(identity::ClientCert)
}

/// `/admin/state` (`reset` false: look, charge nothing) and `/admin/reset` (`reset` true).
async fn identity_call(shared: &Shared, query: &[(String, Vec<u8>)], reset: bool) -> Reply {
    let live = shared.live();
    let (rule, digest, quota, label) = match target(&live.config, query) {
        Ok(t) => t,
        Err(r) => return refused(r),
    };
    let check = Check::new(&digest, &rule.name, quota);
    let id = digest.tag().as_str().to_string();
    if reset {
        return match live.limiter.reset(&check).await {
            Ok(()) => {
                tracing::info!(rule = %rule.name, id = %id, "admin reset an identity's state");
                json(
                    StatusCode::OK,
                    &serde_json::json!({ "rule": rule.name, "identity": id, "digest": digest.hex(), "reset": true }),
                )
            }
            Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &format!("store: {e}")),
        };
    }
    match live.limiter.peek(std::slice::from_ref(&check)).await {
        Ok(d) => {
            let Some(d) = d.first() else {
                return error(StatusCode::BAD_GATEWAY, "the store gave no answer");
            };
            json(
                StatusCode::OK,
                &StateAnswer {
                    rule: &rule.name,
                    identity: id,
                    digest: digest.hex(),
                    label,
                    algorithm: quota.algorithm.name(),
                    limit: quota.rate.count,
                    // A calendar rule's: the period open now.
                    window_s: ceil_secs(quota.window_us_at(crate::limiter::unix_now_us())),
                    burst: quota.burst,
                    cost: quota.cost,
                    remaining: d.remaining,
                    reset_s: ceil_secs(d.reset_us),
                    allowed_now: d.allowed,
                },
            )
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &format!("store: {e}")),
    }
}

#[derive(Serialize)]
struct RuleView<'a> {
    name: &'a str,
    algorithm: &'static str,
    rate: String,
    burst: Option<u64>,
    cost: u64,
    key: String,
    applies_to: String,
    plans: Vec<String>,
    /// How it acts: enforced, shadow, rollout, delay, concurrency leases, jitter.
    behaviour: String,
    /// What it decided since start (`ratewall_requests_total`), and how many of the
    /// requests it let through the upstream did not answer.
    outcomes: RuleOutcomes,
    /// Since start: the 429s it gave and the p95 of the waits they told
    /// (`ratewall_denial_retry_seconds`).
    time_to_reset: TimeToReset,
    /// Admitted requests that left their identity 80% or more used
    /// (`ratewall_near_limit_total`), since start.
    near_limit: u64,
    /// The good-client SLO since start (`ratewall_plan_requests_total`).
    slo: Slo,
}

#[derive(Serialize)]
struct TimeToReset {
    denials: u64,
    /// Seconds, estimated from the histogram's buckets (1 ms × 2^i) as Prometheus'
    /// `histogram_quantile` does; null before any denial.
    p95_s: Option<f64>,
}

/// Requests from identities within their plan under the rule: served (no 429), limited
/// (a 429), and the served share (null before any).
#[derive(Serialize)]
struct Slo {
    served: u64,
    limited: u64,
    served_share: Option<f64>,
}

#[derive(Serialize)]
struct RuleOutcomes {
    allowed: u64,
    delayed: u64,
    denied: u64,
    shadow_denied: u64,
    /// Requests this rule would have let through that another rule denied: charged
    /// nothing here, and not among `allowed`.
    denied_by_other: u64,
    /// 401: the rule's key missing or unknown.
    refused: u64,
    /// 400: the rule's key malformed.
    bad_key: u64,
    store_error: u64,
    upstream_error: u64,
    upstream_timeout: u64,
}

/// The backend as the last minute saw it: `idle` (nothing forwarded), `healthy` (every
/// request answered), `down` (none answered), else `failing`.
fn upstream_health(w: &Window) -> &'static str {
    let answered = w.upstream.count;
    let failed = w.outcomes.upstream_error + w.outcomes.upstream_timeout;
    match (answered, failed) {
        (0, 0) => "idle",
        (_, 0) => "healthy",
        (0, _) => "down",
        _ => "failing",
    }
}

fn stats(shared: &Shared, audience: Audience) -> serde_json::Value {
    let live = shared.live();
    let cfg = &live.config;
    let st = &shared.metrics().stats;
    let rules: Vec<RuleView<'_>> = cfg
        .rules
        .iter()
        .zip(&live.counters)
        .map(|(r, c)| rule_view(&live, r, c))
        .collect();
    let mut top = st.top(10, 20);
    if audience == Audience::Public {
        redact(&mut top);
    }
    let window = st.window();
    let (serving, last_reload) = st.loads();
    serde_json::json!({
        "now": st.now(),
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_s": st.uptime(),
        "history_s": HISTORY_SECS,
        "sample_s": SAMPLE_SECS,
        "rules": rules,
        "totals": st.totals(),
        "history": st.history(),
        "window": window,
        "top": top,
        "store": store(&live),
        "upstream": {
            "health": upstream_health(&window),
        },
        // Each pool with each server's state, share and latency over the last minute.
        "pools": live.pools.status(),
        "config": {
            "serving": serving,
            "last_reload": last_reload,
        },
        // `null` without `[server.tls]`.
        "certificates": cfg.server.tls.as_ref().map(certificates),
        // How many API keys are listed: at runtime (/admin/keys) and in the config.
        // Counts only, never a digest.
        "keys": {
            "runtime": cfg.keys.directory().len(),
            "config": cfg.keys.static_entries().count(),
        },
    })
}

/// One rule as the status page shows it: its settings and what it counted since start.
fn rule_view<'a>(live: &'a Live, r: &'a Rule, c: &RuleCounters) -> RuleView<'a> {
    let cfg = &live.config;
    RuleView {
        outcomes: RuleOutcomes {
            allowed: c.allowed.get(),
            delayed: c.delayed.get(),
            denied: c.denied.get(),
            shadow_denied: c.shadow_denied.get(),
            denied_by_other: c.denied_by_other.get(),
            refused: c.refused.get(),
            bad_key: c.bad_key.get(),
            store_error: c.error.get(),
            upstream_error: c.upstream_error.get(),
            upstream_timeout: c.upstream_timeout.get(),
        },
        time_to_reset: TimeToReset {
            denials: c.dashboard.retry.count(),
            // To the millisecond the buckets count in.
            p95_s: c
                .dashboard
                .retry
                .quantile_s(0.95)
                .map(|s| (s * 1e3).round() / 1e3),
        },
        near_limit: c.dashboard.near_limit.get(),
        slo: Slo {
            served: c.dashboard.served.get(),
            limited: c.dashboard.limited.get(),
            served_share: c.dashboard.served_share(),
        },
        name: &r.name,
        algorithm: r.quota.algorithm.name(),
        rate: match r.quota.algorithm {
            crate::limiter::Algorithm::Concurrency => r.quota.to_string(),
            _ => r.quota.rate.to_string(),
        },
        burst: r.quota.algorithm.has_burst().then_some(r.quota.burst),
        cost: r.quota.cost,
        key: r.key.kind.to_string(),
        applies_to: cfg.applies_to(r),
        plans: {
            let mut p: Vec<String> = r.plans.iter().map(|(n, q)| format!("{n}: {q}")).collect();
            p.sort();
            p
        },
        behaviour: r.behaviour(live.limiter.store().kind().is_shared()),
    }
}

/// The most limited identities as the public status page shows them.
fn redact(top: &mut [TopEntry]) {
    for t in top {
        // A key's hint shows its last characters: key material, for token holders
        // only. Its id stays: the identity's tag, keyed by the deployment's secret
        // (identity::tag), the same in the access log and the admin API, on every
        // gateway and across restarts, and nothing without the secret: no address is
        // found again by hashing them all. An address's network is shown to token
        // holders only too: beside the tag, its /24 would leave 256 addresses to try.
        if t.who.named.hint != "everyone" {
            let kind = t.who.named.hint.split(' ').next().unwrap_or("key");
            t.who.named.hint = kind.to_string();
        }
        // A token's claim values say who the user is (`sub=alice`): token holders
        // only. A key's label is the operator's name for a customer: shown.
        t.who.named.claims = None;
    }
}

/// The store as the status page shows it.
fn store(live: &Live) -> serde_json::Value {
    let health = match live.limiter.health() {
        Health::Healthy => "healthy",
        Health::Failing => "failing",
        Health::Open => "breaker open",
    };
    serde_json::json!({
        "backend": live.limiter.store().kind().name(),
        // The store as named on the page: `redis_sentinel mymaster → 10.0.0.2:6379`
        // under Sentinel, else the backend.
        "described": live.limiter.store().describe(),
        // The node calls go to now, where it can change (Sentinel); else null.
        "primary": live.limiter.store().primary(),
        "health": health,
        "on_error": live.config.store.on_error.name(),
        // `local_share = "auto"`'s N: the gateways seen writing their heartbeat (the
        // last count, kept while the store fails); null where none is written.
        "gateways_seen": live.limiter.gateways().beating().then(|| live.limiter.gateways().seen()),
    })
}

/// The TLS listener's certificates as the status page shows them: the file's name (not
/// its folder), the names it covers, when it expires. No key material.
fn certificates(tls: &crate::tls::Settings) -> serde_json::Value {
    let soon = i64::try_from(crate::tls::EXPIRY_WARNING.as_secs()).unwrap_or(i64::MAX);
    tls.certificates
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let left = c.expires_in();
            serde_json::json!({
                "file": c.cert_path.file_name().map(|f| f.to_string_lossy().into_owned()),
                "names": c.names,
                "default": i == 0,
                "not_after": c.not_after_text(),
                "expires_in_s": left,
                "state": if left < 0 { "expired" } else if left < soon { "expiring" } else { "valid" },
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------

/// `a=1&b=x%20y` -> pairs, values percent-decoded to bytes (API keys may hold anything).
fn parse_query(q: &str) -> Vec<(String, Vec<u8>)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (
                String::from_utf8_lossy(&percent_decode(k)).into_owned(),
                percent_decode(v),
            )
        })
        .collect()
}

fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let hex = |c: u8| (c as char).to_digit(16);
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    out
}

fn param<'q>(query: &'q [(String, Vec<u8>)], name: &str) -> Option<&'q [u8]> {
    query
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_slice())
}

fn number(query: &[(String, Vec<u8>)], name: &str) -> Option<u64> {
    std::str::from_utf8(param(query, name)?).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_decode_to_bytes() {
        let q = parse_query("rule=api&key=a%2Bb%20c+d%ff&x");
        assert_eq!(param(&q, "rule"), Some(&b"api"[..]));
        assert_eq!(param(&q, "key"), Some(&b"a+b c d\xff"[..]));
        assert_eq!(param(&q, "x"), Some(&b""[..]));
        assert_eq!(percent_decode("%"), b"%");
        assert_eq!(percent_decode("%4"), b"%4");
        assert_eq!(percent_decode("%zz"), b"%zz");
    }

    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        assert_eq!(bearer(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"BEARER   abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearerabc"), None);
        assert_eq!(bearer(b"Bearer "), None);
        assert_eq!(bearer(b"abc"), None);
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(constant_time_eq(b"secret-token-123", b"secret-token-123"));
        assert!(!constant_time_eq(b"secret-token-12", b"secret-token-123"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
