//! Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService`), its one
//! method `ShouldRateLimit`, served by hand on the decision listener: gRPC over the same
//! hyper connection as every other call (HTTP/2, cleartext or TLS), no gRPC framework.
//!
//! A call is one framed protobuf message (gRPC over HTTP/2, "Length-Prefixed-Message":
//! a compressed-flag byte, a 4-byte big-endian length, the message), decoded with the
//! messages prost generated from envoyproxy's own protos (`generated.rs`,
//! `scripts/gen-rls`). Its domain and descriptors are matched to limits
//! (`matching.rs`, on the tree `[[descriptors]]` and `[decide] envoy_config` compiled),
//! and the rules they name are decided by the proxy's own core, [`decide::decide_rules`],
//! as one request: all or nothing, each descriptor's identity made into the request its
//! rule reads (the `remote_address` entry as the client's address, an entry named as the
//! rule's header as that header, or the descriptor's digest). The answer is one framed
//! `RateLimitResponse` and `grpc-status: 0` in the trailers; a call that cannot be
//! answered gets a Trailers-Only answer with its status (docs/rls.md has the table).

pub mod generated;
mod matching;

use std::net::IpAddr;
use std::str::FromStr;

use bytes::{BufMut, Bytes, BytesMut};
use http::{header, HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use prost::Message;

use super::{Body, Ctx, Reply};
use crate::config::{Limit, Unit, REMOTE_ADDRESS};
use crate::decide::{self, Decided};
use crate::headers::{self, Applied, ResponseStyle};
use crate::identity::{KeyKind, Requester};
use crate::limiter::Algorithm;
use crate::runtime::requests::FrontEndKind;
use crate::runtime::Live;
use generated::envoy::config::core::v3::HeaderValue as EnvoyHeader;
use generated::envoy::service::ratelimit::v3::rate_limit_response::{
    rate_limit, Code as RlsCode, DescriptorStatus, RateLimit,
};
use generated::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use matching::{Applies, Ask, Entry, Slot};

/// The gRPC method's path.
pub const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");

/// The gRPC statuses this service answers a call with (grpc/doc/statuscodes.md), by
/// number. (The gateway's whole vocabulary is `telemetry::grpc::Code`; `service` keeps to
/// ten sibling modules, and these few are all a rate limit service call can end in.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Code {
    Cancelled = 1,
    /// A malformed call: its frame, its message, its domain or descriptors.
    InvalidArgument = 3,
    /// A message larger than `[decide] max_body`.
    ResourceExhausted = 8,
    /// A compressed message.
    Unimplemented = 12,
    /// The store failed and `on_error = "deny"`.
    Unavailable = 14,
    /// A rule refused the key the descriptor gives (`[keys] unknown = "reject"`).
    Unauthenticated = 16,
}

impl Code {
    /// The code of a refusal answered with HTTP `status` (a key the rule does not know,
    /// the key directory unreachable, a malformed key).
    fn of_refusal(status: StatusCode) -> Code {
        match status.as_u16() {
            401 | 403 => Code::Unauthenticated,
            503 => Code::Unavailable,
            _ => Code::InvalidArgument,
        }
    }
}

/// A call that gets no `RateLimitResponse`: its gRPC status and why.
#[derive(Debug)]
struct Status {
    code: Code,
    message: String,
}

impl Status {
    fn new(code: Code, message: impl Into<String>) -> Status {
        Status {
            code,
            message: message.into(),
        }
    }

    /// A Trailers-Only answer (gRPC over HTTP/2, "Responses"): HTTP 200, and the status
    /// in the one HEADERS frame that ends the stream. The message is the service's own
    /// words, never a descriptor's value; anything outside printable ASCII is written `?`.
    fn reply(&self) -> Reply {
        let mut r = Response::new(super::full(Bytes::new()));
        let h = r.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert(GRPC_STATUS.clone(), HeaderValue::from(self.code as u16));
        let printable: String = self
            .message
            .chars()
            .map(|c| if (' '..='~').contains(&c) && c != '%' { c } else { '?' })
            .collect();
        if let Ok(v) = HeaderValue::from_str(&printable) {
            h.insert(GRPC_MESSAGE.clone(), v);
        }
        r
    }
}

/// Answer one `ShouldRateLimit` call.
pub async fn call(ctx: &Ctx, req: Request<Incoming>) -> Reply {
    match answer(ctx, req).await {
        Ok(r) => r,
        Err(s) => s.reply(),
    }
}

async fn answer(ctx: &Ctx, req: Request<Incoming>) -> Result<Reply, Status> {
    let grpc = req
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if !grpc {
        // gRPC over HTTP/2: a request of another content type gets 415.
        let mut r = Status::new(Code::InvalidArgument, "content-type is not application/grpc").reply();
        *r.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return Ok(r);
    }
    let live = ctx.live();
    let max = live
        .config
        .decide
        .as_ref()
        .map_or(crate::config::decide::MAX_BODY, |d| d.max_body);
    let limit = usize::try_from(max).unwrap_or(usize::MAX);
    let body = Limited::new(req.into_body(), limit.saturating_add(5))
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                Status::new(Code::ResourceExhausted, format!("the message is larger than [decide] max_body ({max} bytes)"))
            } else {
                Status::new(Code::Cancelled, "the call's body could not be read")
            }
        })?
        .to_bytes();
    let message = unframe(&body)?;
    let request = RateLimitRequest::decode(message)
        .map_err(|e| Status::new(Code::InvalidArgument, format!("not a RateLimitRequest: {e}")))?;
    let response = should_rate_limit(ctx, &live, &request).await?;
    Ok(framed(&response))
}

/// The one message of a unary call: uncompressed (no `grpc-encoding` is accepted), its
/// length exactly what follows.
fn unframe(body: &[u8]) -> Result<&[u8], Status> {
    let Some((head, message)) = body.split_first_chunk::<5>() else {
        return Err(Status::new(Code::InvalidArgument, "the call carries no whole gRPC message"));
    };
    match head[0] {
        0 => {}
        1 => return Err(Status::new(Code::Unimplemented, "compressed messages are not accepted: send them uncompressed")),
        _ => return Err(Status::new(Code::InvalidArgument, "the message's compressed-flag is neither 0 nor 1")),
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len != message.len() {
        return Err(Status::new(
            Code::InvalidArgument,
            "a ShouldRateLimit call is one message, its length as its prefix says",
        ));
    }
    Ok(message)
}

/// `response` as the call's answer: one framed message, then `grpc-status: 0` in the
/// trailers.
fn framed(response: &RateLimitResponse) -> Reply {
    let len = response.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    // Encoding into a buffer of the message's own length cannot fail.
    let _ = response.encode(&mut buf);
    let mut trailers = HeaderMap::new();
    trailers.insert(GRPC_STATUS.clone(), HeaderValue::from_static("0"));
    let body: Body = Full::new(buf.freeze())
        .with_trailers(std::future::ready(Some(Ok(trailers))))
        .boxed_unsync();
    let mut r = Response::new(body);
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    r
}

/// One call decided: every descriptor's limit found, the rules among them decided as one
/// request (in rounds where the core cannot take them at once: `matching::rounds`), and
/// the answer: `overall_code`, one status per descriptor, the `RateLimit` fields and,
/// where over the limit, `Retry-After`.
async fn should_rate_limit(
    ctx: &Ctx,
    live: &Live,
    req: &RateLimitRequest,
) -> Result<RateLimitResponse, Status> {
    let cfg = &*live.config;
    if req.domain.is_empty() || req.descriptors.is_empty() {
        return Err(Status::new(
            Code::InvalidArgument,
            "a call names its domain and at least one descriptor",
        ));
    }
    let entries: Vec<Vec<Entry<'_>>> = req
        .descriptors
        .iter()
        .map(|d| d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect())
        .collect();
    let found: Vec<Option<&Limit>> = entries
        .iter()
        .map(|e| matching::find(&cfg.descriptors, &req.domain, e))
        .collect();
    let applies = matching::settle(&found);
    // Envoy: 0 means 1.
    let call_cost = u64::from(req.hits_addend).max(1);
    let mut statuses: Vec<DescriptorStatus> = vec![ok(); req.descriptors.len()];
    let mut over = false;
    let mut retry_after = None;
    let mut asks = Vec::new();
    // The descriptor of each ask.
    let mut of = Vec::new();
    for (i, a) in applies.iter().enumerate() {
        let cost = req.descriptors[i].hits_addend.map_or(call_cost, |c| c.max(1));
        let unit = found[i].and_then(|l| l.unit);
        match *a {
            Applies::Nothing => {}
            Applies::Unlimited => statuses[i].limit_remaining = u32::MAX,
            Applies::Blocked => {
                over = true;
                retry_after = Some(unit.map_or(1, unit_secs));
                statuses[i] = status(RlsCode::OverLimit, current(String::new(), 0, unit), 0, 0);
            }
            Applies::Rule(rule) => {
                let r = &cfg.rules[rule];
                let never = r.quota.algorithm != Algorithm::Concurrency && cost > r.quota.burst;
                // (`Mode`'s default is to enforce: a watching rule goes to the core, which
                // answers OK and counts the would-be denial.)
                if never && r.mode == Default::default() {
                    // More than the rule ever allows at once: denied, nothing asked.
                    over = true;
                    let q = headers::advertised(&r.quota).0;
                    statuses[i] = status(RlsCode::OverLimit, current(r.name.clone(), q, unit), 0, 0);
                    continue;
                }
                let writes = identity(cfg, rule, &req.domain, &entries[i])
                    .map_err(|m| Status::new(Code::InvalidArgument, format!("descriptors[{i}]: {m}")))?;
                asks.push(Ask { rule, cost, writes });
                of.push(i);
            }
        }
    }
    let mut shown: Vec<Applied<'_>> = Vec::new();
    for round in matching::rounds(&asks) {
        let mut fields = HeaderMap::new();
        let mut peer = IpAddr::from([127, 0, 0, 1]);
        for &k in &round {
            match &asks[k].writes {
                Some((Slot::Header(name), v)) => {
                    let v = HeaderValue::from_str(v).map_err(|_| {
                        Status::new(Code::InvalidArgument, format!("descriptors[{}]: a value no header can carry", of[k]))
                    })?;
                    fields.insert(name.clone(), v);
                }
                Some((Slot::Peer, v)) => peer = IpAddr::from_str(v).unwrap_or(peer),
                None => {}
            }
        }
        let requester = Requester::new(&fields, peer, &cfg.keys, &cfg.client_ip);
        let mut d = Decided {
            cost: std::num::NonZeroU64::new(asks[round[0]].cost),
            // Once a descriptor is over the limit the call is: the rest only looked at.
            dry_run: over,
            ..Decided::default()
        };
        let rules: Vec<usize> = round.iter().map(|&k| asks[k].rule).collect();
        let result = decide::decide_rules(live, rules, &requester, None, &mut d).await;
        if !d.dry_run {
            let named = |i| decide::named(cfg, &requester, i);
            ctx.metrics()
                .decided(live, FrontEndKind::Rls, d.disposition, &d.counts, named);
            if result.is_ok() {
                d.count_passed(live);
            }
        }
        match &result {
            Ok(()) => {}
            Err(r) if r.problem.status == StatusCode::TOO_MANY_REQUESTS => {
                over = true;
                retry_after = retry_after.max(r.problem.retry_after);
            }
            // `on_error = "deny"`: Envoy's `failure_mode_deny` decides what its client sees.
            Err(r) if r.problem.status == StatusCode::SERVICE_UNAVAILABLE => {
                return Err(Status::new(Code::Unavailable, "the rate-limit store is unavailable"))
            }
            Err(r) => {
                let why = r.problem.detail.as_deref().unwrap_or("refused");
                return Err(Status::new(Code::of_refusal(r.problem.status), why.to_string()));
            }
        }
        for &k in &round {
            let i = of[k];
            let unit = found[i].and_then(|l| l.unit);
            let rule = asks[k].rule;
            let enforced = d.applied.iter().find(|a| a.index == rule);
            let watched = d.shadow.iter().find(|a| a.index == rule);
            if let Some(a) = enforced.or(watched) {
                let code = if a.decision.allowed || enforced.is_none() {
                    RlsCode::Ok
                } else {
                    RlsCode::OverLimit
                };
                // In requests (hits), as Envoy counts: the rule's own quota, not the
                // call's cost's, and what is left of it.
                let q = headers::advertised(&cfg.rules[rule].quota).0;
                let limit = current(a.rule.to_string(), q, unit);
                statuses[i] = status(code, limit, a.decision.remaining, a.decision.reset_us);
            }
        }
        shown.extend(d.applied.iter().copied());
    }
    let mut response = RateLimitResponse {
        overall_code: if over { RlsCode::OverLimit } else { RlsCode::Ok } as i32,
        statuses,
        ..Default::default()
    };
    let mut fields = HeaderMap::new();
    headers::add_ratelimit(&mut fields, ResponseStyle::Draft, &shown);
    if over {
        fields.insert(header::RETRY_AFTER, HeaderValue::from(retry_after.unwrap_or(1).max(1)));
    }
    response.response_headers_to_add = fields
        .iter()
        .filter_map(|(k, v)| {
            Some(EnvoyHeader {
                key: k.as_str().to_owned(),
                value: v.to_str().ok()?.to_owned(),
                ..Default::default()
            })
        })
        .collect();
    Ok(response)
}

/// What the identity of descriptor `entries` under rule `rule` writes into the round's
/// request, as the rule reads a request (checked at load: `config/descriptors.rs`).
fn identity(
    cfg: &crate::config::Config,
    rule: usize,
    domain: &str,
    entries: &[Entry<'_>],
) -> Result<Option<(Slot, String)>, String> {
    let named = |name: &str| {
        entries
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| (*v).to_owned())
    };
    Ok(match &cfg.rules[rule].key.kind {
        KeyKind::Global => None,
        KeyKind::ClientIp => {
            let v = named(REMOTE_ADDRESS).ok_or("no remote_address entry")?;
            let ip = IpAddr::from_str(v.trim()).map_err(|_| "remote_address is not an IP address")?;
            Some((Slot::Peer, ip.to_canonical().to_string()))
        }
        KeyKind::ApiKey => {
            let h = &cfg.keys.header;
            let v = named(h.as_str()).ok_or("no entry named as [keys] header")?;
            Some((Slot::Header(h.clone()), v))
        }
        KeyKind::Header(h) => {
            let v = named(h.as_str()).unwrap_or_else(|| matching::digest_hex(domain, entries));
            Some((Slot::Header(h.clone()), v))
        }
        _ => return Err("its rule counts by what a descriptor cannot say".into()),
    })
}

fn ok() -> DescriptorStatus {
    DescriptorStatus {
        code: RlsCode::Ok as i32,
        ..Default::default()
    }
}

fn status(code: RlsCode, limit: RateLimit, remaining: u64, reset_us: u64) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        current_limit: Some(limit),
        limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(prost_types::Duration {
            seconds: i64::try_from(reset_us / 1_000_000).unwrap_or(i64::MAX),
            nanos: i32::try_from(reset_us % 1_000_000 * 1_000).unwrap_or(0),
        }),
        ..Default::default()
    }
}

/// `current_limit`: `n` per `unit` (UNKNOWN where the rule's period is none of Envoy's).
fn current(name: String, n: u64, unit: Option<Unit>) -> RateLimit {
    let unit = match unit {
        None => rate_limit::Unit::Unknown,
        Some(Unit::Second) => rate_limit::Unit::Second,
        Some(Unit::Minute) => rate_limit::Unit::Minute,
        Some(Unit::Hour) => rate_limit::Unit::Hour,
        Some(Unit::Day) => rate_limit::Unit::Day,
        Some(Unit::Week) => rate_limit::Unit::Week,
        Some(Unit::Month) => rate_limit::Unit::Month,
    };
    RateLimit {
        name,
        requests_per_unit: u32::try_from(n).unwrap_or(u32::MAX),
        unit: unit as i32,
    }
}

/// A unit's length in seconds, as a blocked descriptor's `Retry-After` (a month: 31 days).
fn unit_secs(u: Unit) -> u64 {
    match u {
        Unit::Second => 1,
        Unit::Minute => 60,
        Unit::Hour => 3_600,
        Unit::Day => 86_400,
        Unit::Week => 604_800,
        Unit::Month => 2_678_400,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_read_whole_or_refused_with_a_status() {
        let msg = RateLimitRequest {
            domain: "d".into(),
            ..Default::default()
        }
        .encode_to_vec();
        let mut framed = vec![0, 0, 0, 0, u8::try_from(msg.len()).unwrap()];
        framed.extend_from_slice(&msg);
        assert_eq!(unframe(&framed).unwrap(), &msg[..]);
        let code = |b: &[u8]| unframe(b).unwrap_err().code;
        assert_eq!(code(&[0, 0, 0]), Code::InvalidArgument);
        assert_eq!(code(&[1, 0, 0, 0, 0]), Code::Unimplemented);
        assert_eq!(code(&[2, 0, 0, 0, 0]), Code::InvalidArgument);
        assert_eq!(code(&[0, 0, 0, 0, 9, 1]), Code::InvalidArgument);
        assert_eq!(code(&framed[..framed.len() - 1]), Code::InvalidArgument);
    }

    #[test]
    fn a_status_message_stays_printable() {
        let r = Status::new(Code::InvalidArgument, "bad\u{7}é%").reply();
        assert_eq!(r.headers()["grpc-status"], "3");
        assert_eq!(r.headers()["grpc-message"], "bad???");
    }
}
