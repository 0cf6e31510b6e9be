//! The decision API's JSON calls: `POST /v1/decide` (one decision or a list), `POST
//! /v1/settle`, `POST /v1/leases` and `PUT`/`DELETE /v1/leases/<id>` (docs/service.md
//! has every field). Each decision is the proxy's ([`crate::decide`]): a rule and a key
//! are a request that carries that key, decided by that rule alone; a described request
//! is decided by every rule whose match fits it, as the proxy would decide it.
//!
//! Every decision is answered 200, allowed or not; a malformed call is 400 (413 for a
//! body past `[decide] max_body`), problem+json naming the field.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::str::FromStr;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};

use super::answer::{self, Answer};
use super::grants;
use super::{json, problem, Ctx, Reply};
use crate::decide::{self, Decided, Rejection, Subject};
use crate::headers::Problem;
use crate::identity::{KeyKind, Requester};
use crate::limiter::Algorithm;
use crate::runtime::requests::FrontEndKind;
use crate::runtime::Live;

/// A malformed call: its status (400, 404, 413) and what is wrong, naming the field.
type Bad = Box<Problem>;

fn bad(detail: impl Into<String>) -> Bad {
    Box::new(Problem::new(StatusCode::BAD_REQUEST, detail.into()))
}

pub(super) async fn call(ctx: &Ctx, req: Request<Incoming>) -> Reply {
    match route(ctx, req).await {
        Ok(r) => r,
        Err(p) => problem(&p),
    }
}

async fn route(ctx: &Ctx, req: Request<Incoming>) -> Result<Reply, Bad> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (&method, path.as_str()) {
        (&Method::POST, "/v1/decide") => decide_call(ctx, req).await,
        (&Method::POST, "/v1/settle") => settle_call(ctx, req).await,
        (&Method::POST, "/v1/leases") => lease_call(ctx, req).await,
        (&Method::PUT | &Method::DELETE, p) if p.starts_with("/v1/leases/") => {
            let id = grants::parse(&p["/v1/leases/".len()..])
                .ok_or_else(|| not_found("no such lease (a lease is named by 32 hex digits)"))?;
            lease_update(ctx, &method, id).await
        }
        (_, p) if p.starts_with("/v1/leases/") => Err(Box::new(Problem::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "a lease takes PUT (renew) or DELETE (give back)",
        ))),
        (_, "/v1/decide" | "/v1/settle" | "/v1/leases") => Err(Box::new(Problem::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{path} takes POST"),
        ))),
        _ => Err(not_found("no such call: see docs/service.md")),
    }
}

fn not_found(detail: &'static str) -> Bad {
    Box::new(Problem::new(StatusCode::NOT_FOUND, detail))
}

/// The body, whole, up to `[decide] max_body`.
async fn body(live: &Live, req: Request<Incoming>) -> Result<Bytes, Bad> {
    let max = live.config.decide.as_ref().map_or(crate::config::decide::MAX_BODY, |d| d.max_body);
    let limit = usize::try_from(max).unwrap_or(usize::MAX);
    match Limited::new(req.into_body(), limit).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(Box::new(Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is over [decide] max_body ({max} bytes)"),
        ))),
        Err(e) => Err(bad(format!("the body could not be read: {e}"))),
    }
}

/// `bytes` as a `T`, or a 400 naming the field that is wrong (found by a second parse,
/// which tracks where it is: only a malformed call pays for that).
fn parse<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, Bad> {
    if let Ok(t) = serde_json::from_slice(bytes) {
        return Ok(t);
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let t = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let at = e.path().to_string();
        let inner = e.into_inner();
        match at.as_str() {
            // "?": where serde_path_to_error cannot say (a body cut short).
            "." | "?" => bad(format!("the body is not a call: {inner}")),
            at => bad(format!("{at}: {inner}")),
        }
    })?;
    // What the first parse refused, if not the value itself: something after it.
    de.end()
        .map_err(|e| bad(format!("the body is not a call: {e}")))?;
    Ok(t)
}

/// One decision asked for: a rule and a key, or a described request. The rule and key
/// borrowed from the body where they have no escapes (most do not).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Ask<'a> {
    #[serde(borrow)]
    rule: Option<Cow<'a, str>>,
    #[serde(borrow)]
    key: Option<Cow<'a, str>>,
    cost: Option<u64>,
    request: Option<Described>,
    #[serde(default)]
    dry_run: bool,
}

/// A request as the proxy would see it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Described {
    #[serde(default = "get")]
    method: String,
    host: Option<String>,
    path: String,
    #[serde(default)]
    headers: BTreeMap<String, Values>,
    client_ip: Option<IpAddr>,
}

fn get() -> String {
    "GET".to_string()
}

/// A header's value, or its values in order.
#[derive(Deserialize)]
#[serde(untagged)]
enum Values {
    One(String),
    Many(Vec<String>),
}

async fn decide_call(ctx: &Ctx, req: Request<Incoming>) -> Result<Reply, Bad> {
    let live = ctx.live();
    let bytes = body(&live, req).await?;
    let batch = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[');
    if !batch {
        let ask: Ask = parse(&bytes)?;
        let call = prepare(&live, &ask)?;
        let answer = decide_one(ctx, &live, &ask, call).await;
        return Ok(answer::one(&answer));
    }
    let asks: Vec<Ask> = parse(&bytes)?;
    let most = live.config.decide.as_ref().map_or(crate::config::decide::MAX_BATCH, |d| d.max_batch);
    if asks.len() > most {
        return Err(bad(format!(
            "a batch is at most [decide] max_batch ({most}) decisions; this one has {}",
            asks.len()
        )));
    }
    // Each checked before any is decided: a malformed one fails the whole call, and
    // nothing was charged.
    let calls = (asks.iter().enumerate())
        .map(|(i, ask)| prepare(&live, ask).map_err(|p| at_index(i, p)))
        .collect::<Result<Vec<_>, Bad>>()?;
    // Decided together: their store calls go out at once (pipelined on one connection
    // to Redis), and are answered in order.
    let decided = (asks.iter().zip(calls)).map(|(ask, call)| decide_one(ctx, &live, ask, call));
    let answers = futures_util::future::join_all(decided).await;
    Ok(answer::list(&answers))
}

/// `p`, for the batch's `i`th call.
fn at_index(i: usize, p: Bad) -> Bad {
    match &p.detail {
        Some(d) => Box::new(Problem::new(p.status, format!("[{i}].{d}"))),
        None => p,
    }
}

/// A call checked: everything [`decide_one`] needs, found before any call is decided.
enum Prepared {
    /// A rule (its position) and a key, as a request that carries the key.
    Keyed(usize, Keyed),
    /// A described request, and the address it came from.
    Described(Request<()>, IpAddr),
}

/// `ask` checked: its shape, its cost, its key, its described request.
fn prepare(live: &Live, ask: &Ask) -> Result<Prepared, Bad> {
    match (shape(live, ask)?, &ask.request) {
        (Some(index), _) => {
            check_cost(live, index, ask.cost.unwrap_or(1))?;
            Ok(Prepared::Keyed(index, Keyed::of(live, index, ask.key.as_deref())?))
        }
        (None, Some(described)) => {
            let peer = described.client_ip.unwrap_or(IpAddr::from([127, 0, 0, 1]));
            Ok(Prepared::Described(Request::try_from(described)?, peer))
        }
        (None, None) => Err(bad("rule: give a rule (and its key) or a request")),
    }
}

/// What a call names, checked: its rule's position where it names one.
fn shape(live: &Live, ask: &Ask) -> Result<Option<usize>, Bad> {
    if ask.cost == Some(0) {
        return Err(bad("cost: at least 1 (a question that charges nothing is dry_run = true)"));
    }
    match (&ask.rule, &ask.key, &ask.request) {
        (Some(_), _, Some(_)) => Err(bad(
            "rule: give a rule (and its key) or a request, not both",
        )),
        (None, None, None) => Err(bad("rule: give a rule (and its key) or a request")),
        (None, Some(_), None) => Err(bad("rule: a key needs the rule it is counted by")),
        (None, _, Some(_)) if ask.cost.is_some() => Err(bad(
            "cost: for a rule and its key; a described request costs what its rules say",
        )),
        (None, _, Some(_)) => Ok(None),
        (Some(rule), _, None) => rule_named(live, rule).map(Some),
    }
}

/// The position of the rule `name`, or a 400 naming the rules there are.
pub(super) fn rule_named(live: &Live, name: &str) -> Result<usize, Bad> {
    let rules = &live.config.rules;
    rules.iter().position(|r| r.name == name).ok_or_else(|| {
        let names: Vec<&str> = rules.iter().map(|r| r.name.as_str()).collect();
        bad(format!(
            "rule: no rule is named {name:?}; the rules are {}",
            names.join(", ")
        ))
    })
}

async fn decide_one<'l>(ctx: &Ctx, live: &'l Live, ask: &Ask<'_>, call: Prepared) -> Answer<'l> {
    let mut d = Decided {
        dry_run: ask.dry_run,
        cost: ask.cost.and_then(std::num::NonZeroU64::new),
        ..Decided::default()
    };
    match call {
        Prepared::Keyed(index, key) => {
            let requester = key.requester(live);
            let result = decide::decide_rules(live, vec![index], &requester, None, &mut d).await;
            count(ctx, live, &requester, &d, &result);
            let status = result.as_ref().map_or_else(|r| r.problem.status.as_u16(), |()| 200);
            let rule = &live.config.rules[index].name;
            let path = format_args!("/v1/decide rule={rule}");
            super::access_line("decide", "POST", &path, None, &d, status);
            answered(ctx, live, d, result)
        }
        Prepared::Described(req, peer) => {
            let subject = Subject {
                method: req.method(),
                uri: req.uri(),
                headers: req.headers(),
                peer,
                client_cert: None,
            };
            let requester = subject.requester(&live.config);
            let result = decide::decide(live, &subject, &requester, None, &mut d).await;
            count(ctx, live, &requester, &d, &result);
            let status = result.as_ref().map_or_else(|r| r.problem.status.as_u16(), |()| 200);
            let ip = Some(requester.client_ip());
            let (method, path) = (req.method().as_str(), req.uri().path());
            super::access_line("decide", method, &path, ip, &d, status);
            answered(ctx, live, d, result)
        }
    }
}

/// A cost that no quota of the rule could ever take is refused: it would be denied
/// forever.
fn check_cost(live: &Live, index: usize, cost: u64) -> Result<(), Bad> {
    let rule = &live.config.rules[index];
    let most = rule.largest_burst();
    if rule.quota.algorithm != Algorithm::Concurrency && cost > most {
        return Err(bad(format!(
            "cost: {cost} is more than rule {:?} ever allows at once (its burst, {most})",
            rule.name
        )));
    }
    Ok(())
}

/// A key for a rule, as a request that carries it: the header the rule counts by, or
/// the address.
pub(super) struct Keyed {
    headers: HeaderMap,
    peer: IpAddr,
}

impl Keyed {
    pub(super) fn of(live: &Live, index: usize, key: Option<&str>) -> Result<Keyed, Bad> {
        let rule = &live.config.rules[index];
        let mut headers = HeaderMap::new();
        let mut peer = IpAddr::from([127, 0, 0, 1]);
        let needs = |what: &str| bad(format!("key: rule {:?} counts by {what}: give it as key", rule.name));
        match &rule.key.kind {
            KeyKind::Global => {}
            KeyKind::ApiKey => {
                let k = key.ok_or_else(|| needs("an API key"))?;
                headers.insert(live.config.keys.header.clone(), value(k)?);
            }
            KeyKind::Header(name) => {
                let k = key.ok_or_else(|| needs("a header's value"))?;
                headers.insert(name.clone(), value(k)?);
            }
            KeyKind::ClientIp => {
                let k = key.ok_or_else(|| needs("a client address"))?;
                peer = IpAddr::from_str(k.trim())
                    .map_err(|_| bad(format!("key: {k:?} is not an IP address (rule {:?} counts by client_ip)", rule.name)))?
                    .to_canonical();
            }
            kind => {
                return Err(bad(format!(
                    "rule: rule {:?} counts by {kind}: describe the request instead (request, with its headers)",
                    rule.name
                )))
            }
        }
        Ok(Keyed { headers, peer })
    }

    /// Who the key is, read with the config's keys (plans, the runtime directory).
    pub(super) fn requester<'a>(&'a self, live: &'a Live) -> Requester<'a> {
        let cfg = &live.config;
        Requester::new(&self.headers, self.peer, &cfg.keys, &cfg.client_ip)
    }
}

/// A key as a header value: printable, or a 400.
fn value(k: &str) -> Result<HeaderValue, Bad> {
    HeaderValue::from_str(k).map_err(|_| bad("key: not a valid header value (printable ASCII or UTF-8 without control characters)"))
}

impl TryFrom<&Described> for Request<()> {
    type Error = Bad;

    fn try_from(d: &Described) -> Result<Request<()>, Bad> {
        let method = Method::from_bytes(d.method.as_bytes())
            .map_err(|_| bad(format!("request.method: {:?} is not an HTTP method", d.method)))?;
        if !d.path.starts_with('/') {
            return Err(bad("request.path: starts with / (and may carry ?query)"));
        }
        let uri = Uri::from_str(&d.path)
            .map_err(|e| bad(format!("request.path: not a valid path: {e}")))?;
        // What the proxy's screen refuses before any rule (`decide::head`): so is it here.
        let path = uri.path();
        if let Some(p) = decide::head::path_problem(path).or_else(|| decide::head::parameter_problem(path)) {
            return Err(bad(format!("request.path: {}", p.detail.unwrap_or_default())));
        }
        let mut req = Request::new(());
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        let headers = req.headers_mut();
        for (name, values) in &d.headers {
            let n = HeaderName::from_str(name)
                .map_err(|_| bad(format!("request.headers.{name}: not a header name")))?;
            let values = match values {
                Values::One(v) => std::slice::from_ref(v),
                Values::Many(v) => v.as_slice(),
            };
            for v in values {
                let v = HeaderValue::from_str(v)
                    .map_err(|_| bad(format!("request.headers.{name}: not a valid header value")))?;
                headers.append(n.clone(), v);
            }
        }
        if let Some(host) = &d.host {
            let v = HeaderValue::from_str(host)
                .map_err(|_| bad("request.host: not a valid host"))?;
            headers.insert(http::header::HOST, v);
        }
        let host = headers.get(http::header::HOST);
        if host.is_some_and(|h| !decide::head::is_host_and_port(h.as_bytes())) {
            return Err(bad(
                "request.host: not a host and optional port (RFC 9110 §7.2): no userinfo, path or other characters",
            ));
        }
        Ok(req)
    }
}

/// What a decision counts, handed to the metrics as the proxy hands its own; its passes
/// counted at once (there is no answer to wait for).
fn count<'a>(
    ctx: &Ctx,
    live: &'a Live,
    requester: &Requester<'a>,
    d: &Decided<'_>,
    result: &Result<(), Rejection>,
) {
    if d.dry_run {
        return;
    }
    let named = |i| decide::named(&live.config, requester, i);
    (ctx.metrics()).decided(live, FrontEndKind::Decide, d.disposition, &d.counts, named);
    if result.is_ok() {
        d.count_passed(live);
    }
}

/// The caller's view of a decision; its reservation held where a rule settles.
fn answered<'l>(
    ctx: &Ctx,
    live: &'l Live,
    mut d: Decided<'l>,
    result: Result<(), Rejection>,
) -> Answer<'l> {
    let mut a = answer::view(&d, &result);
    if let Some(settling) = d.settling.take() {
        let within = d
            .applied
            .iter()
            .chain(&d.shadow)
            .filter_map(|x| live.config.rules.get(x.index))
            .filter(|r| r.settle.is_some())
            .map(|r| r.settle_within)
            .min()
            .unwrap_or_default();
        match ctx.grants.reserve(settling, within) {
            Ok(id) => a.reservation = Some(grants::name(id)),
            Err(grants::Full) => {
                a.detail = Some("too many reservations are held: this one stands as charged".into())
            }
        }
    }
    // A described request's concurrency slot is given back at once: a slot held past the
    // call is a lease (`POST /v1/leases`).
    drop(d.leases.take());
    a
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Settle {
    reservation: String,
    cost: Option<u64>,
    #[serde(default)]
    refund: bool,
}

#[derive(Serialize)]
struct Settled {
    settled: bool,
    reservation: String,
}

async fn settle_call(ctx: &Ctx, req: Request<Incoming>) -> Result<Reply, Bad> {
    let live = ctx.live();
    let bytes = body(&live, req).await?;
    let s: Settle = parse(&bytes)?;
    let cost = match (s.cost, s.refund) {
        (Some(_), true) => return Err(bad("cost: give a cost or refund = true, not both")),
        (None, false) => return Err(bad("cost: give the real cost, or refund = true")),
        (Some(c), false) => Some(c),
        (None, true) => None,
    };
    let id = grants::parse(&s.reservation)
        .ok_or_else(|| bad("reservation: 32 hex digits, as /v1/decide gave it"))?;
    let Some(settling) = ctx.grants.take_reservation(id) else {
        return Err(not_found(
            "no such reservation: never given, settled already, or past its rule's settle_within (it stands as charged)",
        ));
    };
    if !settling.settle_all(cost).await {
        return Err(Box::new(
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the rate-limit store did not take the settlement: the reservation stands as charged",
            )
            .with_retry_after(1),
        ));
    }
    Ok(json(
        StatusCode::OK,
        &Settled {
            settled: true,
            reservation: s.reservation,
        },
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseAsk {
    rule: String,
    key: Option<String>,
}

async fn lease_call(ctx: &Ctx, req: Request<Incoming>) -> Result<Reply, Bad> {
    let live = ctx.live();
    let bytes = body(&live, req).await?;
    let ask: LeaseAsk = parse(&bytes)?;
    let index = rule_named(&live, &ask.rule)?;
    let rule = &live.config.rules[index];
    if rule.quota.algorithm != Algorithm::Concurrency {
        return Err(bad(format!(
            "rule: rule {:?} is not a concurrency limit (max_in_flight): a lease is a slot of one",
            rule.name
        )));
    }
    let key = Keyed::of(&live, index, ask.key.as_deref())?;
    let requester = key.requester(&live);
    let mut d = Decided::default();
    let result = decide::decide_rules(&live, vec![index], &requester, None, &mut d).await;
    count(ctx, &live, &requester, &d, &result);
    let mut a = answer::view(&d, &result);
    if let (Ok(()), Some(leases)) = (&result, d.leases.take()) {
        let ttl = lease_ttl(&live, index);
        match ctx.grants.lease(leases.renewed_by_holder(), ttl) {
            Ok(id) => {
                a.lease = Some(grants::name(id));
                a.ttl = Some(ttl.as_secs().max(1));
            }
            Err(grants::Full) => {
                return Err(Box::new(
                    Problem::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "too many leases are held: none was taken",
                    )
                    .with_retry_after(1),
                ))
            }
        }
    }
    Ok(answer::one(&a))
}

/// How long a lease of the rule at `index` lives unrenewed: the rule's `lease_ttl`, the
/// TTL its slot has in a shared store too.
fn lease_ttl(live: &Live, index: usize) -> std::time::Duration {
    std::time::Duration::from_micros(live.config.rules[index].quota.lease_us)
}

#[derive(Serialize)]
struct LeaseState {
    lease: String,
    held: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    ttl: Option<u64>,
}

async fn lease_update(ctx: &Ctx, method: &Method, id: u128) -> Result<Reply, Bad> {
    let Some(held) = ctx.grants.take_lease(id) else {
        return Err(not_found(
            "no such lease: never given, given back already, or past its TTL (its slot is free)",
        ));
    };
    let name = grants::name(id);
    if method == Method::DELETE {
        // Given back: its slot is free from now on (in the shared store, once the
        // release has run).
        if let Some(releasing) = held.leases.release() {
            releasing.await;
        }
        return Ok(json(StatusCode::OK, &LeaseState { lease: name, held: false, ttl: None }));
    }
    if !held.leases.renew().await {
        // Lapsed in the store already (its TTL passed there): the slot is gone.
        drop(held);
        return Err(not_found("the lease lapsed in the store before it was renewed"));
    }
    let ttl = held.ttl.as_secs().max(1);
    ctx.grants.put_back(id, held);
    Ok(json(StatusCode::OK, &LeaseState { lease: name, held: true, ttl: Some(ttl) }))
}
