//! Decisions -> response headers and problem+json bodies.
//!
//! Draft style follows draft-ietf-httpapi-ratelimit-headers, with -11's field syntax
//! (docs/reference.md says why, and what of -12 could be read):
//! `RateLimit-Policy` and `RateLimit` are Structured Field lists (RFC 9651) with one item
//! per applied rule, named by the rule (a Structured Field string, since rule names are
//! restricted to `[A-Za-z0-9_.-]`, no escaping is needed). `q` is the quota in the draft's
//! default unit, requests — of the rule's `cost`: a rule whose requests take 10 tokens of
//! 30 advertises 3 — and `w` the window it is granted in, in whole seconds; `r` is how many
//! such requests are available now and `t` the seconds, rounded up, until all of the
//! rule's tokens are back. The draft mandates no algorithm; each advertises what a client
//! may really use ([`advertised`]):
//!
//! - a window (`sliding_window`, `fixed_window`): `q` is the rule's N (over its cost), `w`
//!   its period; for a calendar rate (`"N/month"`), the length of the period open now,
//!   by this machine's clock (a 30- or 31-day month, a 23- or 25-hour day across a DST
//!   change), and `t` counts to its end;
//! - a bucket (`token_bucket`, `gcra`): `q` is the **burst** (over the cost) — what may pass
//!   at once, the most `r` can ever be — and `w` the time the rate takes to refill it from
//!   empty (`burst / rate`, rounded up to a whole second, the draft's `w` being an integer).
//!   A client that spends all of `q` and waits `w` finds `q` again: it is never promised
//!   more than it gets, and `r` never exceeds `q`. (Advertising the rate as `q=N;w=P`
//!   instead would show `r` above `q` and hide the burst.)
//!
//! Legacy style is the earlier drafts' `RateLimit-Limit`/`-Remaining`/`-Reset`, for the
//! one rule closest to denying, with the same `q` as its limit.
//!
//! A concurrency limit is a quota of the unit the draft names `concurrent-requests`
//! (`qu="concurrent-requests"`): no window and no reset, so its items carry neither `w`
//! nor `t`. Rules that do not enforce for a request (shadow mode, or an identity outside
//! `enforce_percent`) are not the client's limits: they are reported in
//! `RateLimit-Shadow`, an operator's note shaped like `RateLimit`, with a `denied` flag
//! where the rule would have denied.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::StatusCode;

use crate::limiter::{unix_now_us, Algorithm, Decision, Quota};

/// Which rate-limit headers answers carry (`[response] headers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponseStyle {
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers).
    #[default]
    Draft,
    /// `RateLimit-Limit`, `-Remaining`, `-Reset` of the earlier drafts.
    Legacy,
    Both,
    None,
}

pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub static RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
pub static RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
pub static RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
pub static RATELIMIT_SHADOW: HeaderName = HeaderName::from_static("ratelimit-shadow");

/// Microseconds to whole seconds, rounded up.
pub fn ceil_secs(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// The quota a rule advertises (`q`, in requests of the rule's cost) and the window it is
/// granted in (`w`, whole seconds; `None` for a concurrency limit): see the module's docs.
pub fn advertised(quota: &Quota) -> (u64, Option<u64>) {
    let cost = quota.cost.max(1);
    match quota.algorithm {
        Algorithm::Concurrency => (quota.burst, None),
        Algorithm::TokenBucket | Algorithm::Gcra => {
            // q requests take q * cost tokens, which come back at count per period:
            // q * cost * period / count, rounded up.
            let q = quota.burst / cost;
            let period_us = quota.rate.period.as_micros();
            let count = u128::from(quota.rate.count.max(1));
            let refill_us = (u128::from(q * cost) * period_us).div_ceil(count);
            let secs = refill_us.div_ceil(1_000_000).max(1);
            (q, Some(u64::try_from(secs).unwrap_or(u64::MAX)))
        }
        Algorithm::SlidingWindow | Algorithm::FixedWindow => {
            // A calendar window is the period open now: this month's days, a 23-hour day.
            let secs = match quota.calendar {
                Some(_) => ceil_secs(quota.window_us_at(unix_now_us())),
                None => quota.rate.period.as_secs(),
            };
            (quota.rate.count / cost, Some(secs.max(1)))
        }
    }
}

/// What a decision has left, in requests of the rule's cost (the unit of `q`).
pub fn available(a: &Applied<'_>) -> u64 {
    match a.quota.algorithm {
        Algorithm::Concurrency => a.decision.remaining,
        _ => a.decision.remaining / a.quota.cost.max(1),
    }
}

/// One applied rule's outcome, as the headers need it.
#[derive(Clone, Copy)]
pub struct Applied<'a> {
    pub rule: &'a str,
    /// The rule's position in the config: where its counters are.
    pub index: usize,
    pub quota: Quota,
    pub decision: Decision,
}

/// Add the RateLimit headers for `applied` in `style`.
pub fn add_ratelimit(headers: &mut HeaderMap, style: ResponseStyle, applied: &[Applied<'_>]) {
    if applied.is_empty() {
        return;
    }
    if matches!(style, ResponseStyle::Draft | ResponseStyle::Both) {
        // A value this thread made a moment ago is used again.
        scratch(|policy, state| {
            write_draft(applied, policy, state);
            insert(headers, &RATELIMIT_POLICY, &POLICIES, policy);
            insert(headers, &RATELIMIT, &STATES, state);
        });
    }
    if matches!(style, ResponseStyle::Legacy | ResponseStyle::Both) {
        // The rule closest to denying: fewest left, then the longest wait.
        let Some(a) = applied.iter().min_by_key(|a| {
            (
                a.decision.allowed,
                available(a),
                std::cmp::Reverse(a.decision.reset_us),
            )
        }) else {
            return;
        };
        headers.insert(
            RATELIMIT_LIMIT.clone(),
            HeaderValue::from(advertised(&a.quota).0),
        );
        headers.insert(RATELIMIT_REMAINING.clone(), HeaderValue::from(available(a)));
        headers.insert(
            RATELIMIT_RESET.clone(),
            HeaderValue::from(ceil_secs(a.decision.reset_us)),
        );
    }
}

/// The `RateLimit-Policy` and `RateLimit` field values for `applied` (not empty), written
/// into `policy` and `state`: by hand, not with `write!`, as this runs for every limited
/// response.
pub fn write_draft(applied: &[Applied<'_>], policy: &mut Vec<u8>, state: &mut Vec<u8>) {
    for (i, a) in applied.iter().enumerate() {
        if i > 0 {
            policy.extend_from_slice(b", ");
            state.extend_from_slice(b", ");
        }
        item(policy, a.rule);
        item(state, a.rule);
        let (q, w) = advertised(&a.quota);
        param(policy, b";q=", q);
        param(state, b";r=", available(a));
        let Some(w) = w else {
            policy.extend_from_slice(b";qu=\"concurrent-requests\"");
            continue;
        };
        param(policy, b";w=", w);
        param(state, b";t=", ceil_secs(a.decision.reset_us));
    }
}

/// `RateLimit-Shadow` for the rules that watched but did not enforce: one item per rule,
/// `r` and `t` as in `RateLimit`, and `denied` where the rule would have denied.
pub fn add_shadow(headers: &mut HeaderMap, style: ResponseStyle, shadow: &[Applied<'_>]) {
    if shadow.is_empty() || style == ResponseStyle::None {
        return;
    }
    scratch(|v, _| {
        for (i, a) in shadow.iter().enumerate() {
            if i > 0 {
                v.extend_from_slice(b", ");
            }
            item(v, a.rule);
            param(v, b";r=", available(a));
            if a.quota.algorithm != Algorithm::Concurrency {
                param(v, b";t=", ceil_secs(a.decision.reset_us));
            }
            if !a.decision.allowed {
                v.extend_from_slice(b";denied");
            }
        }
        insert(headers, &RATELIMIT_SHADOW, &SHADOWS, v);
    });
}

/// A field value or a body being written.
type Line = Vec<u8>;

thread_local! {
    /// Two buffers this thread writes field values and bodies in, kept from one request to
    /// the next: a value equal to one made a moment ago (most are, see [`Recent`]) then
    /// costs no allocation at all.
    static SCRATCH: Cell<(Line, Line)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// `write`, given two empty buffers of this thread's (new ones where a caller up the
/// stack holds them).
fn scratch<R>(write: impl FnOnce(&mut Line, &mut Line) -> R) -> R {
    let (mut a, mut b) = SCRATCH.try_with(Cell::take).unwrap_or_default();
    a.clear();
    b.clear();
    let r = write(&mut a, &mut b);
    let _ = SCRATCH.try_with(|s| s.set((a, b)));
    r
}

/// A list item named by its rule: a Structured Field string (rule names need no escapes).
fn item(out: &mut Line, rule: &str) {
    out.push(b'"');
    out.extend_from_slice(rule.as_bytes());
    out.push(b'"');
}

/// An integer parameter, `key` including its `;` and `=`.
fn param(out: &mut Line, key: &[u8], n: u64) {
    out.extend_from_slice(key);
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

fn insert(
    headers: &mut HeaderMap,
    name: &HeaderName,
    recent: &'static Local<HeaderValue>,
    value: &[u8],
) {
    // Rule names and integers only: always a valid header value.
    if let Some(v) = made(recent, value, |b| HeaderValue::from_bytes(b).ok()) {
        headers.insert(name.clone(), v);
    }
}

/// How many values [`Recent`] keeps of each kind.
const RECENT: usize = 4;

/// The last values of one kind (a field's, a body's) a thread made: one that repeats (the
/// same policy, a fresh identity's full allowance, the same denial within a second) is
/// shared, a reference count instead of an allocation and a check of every byte. Only the
/// exact bytes match; the oldest gives way.
struct Recent<T> {
    values: [Option<T>; RECENT],
    next: usize,
}

type Local<T> = std::thread::LocalKey<RefCell<Recent<T>>>;

thread_local! {
    static POLICIES: RefCell<Recent<HeaderValue>> = const { RefCell::new(Recent::new()) };
    static STATES: RefCell<Recent<HeaderValue>> = const { RefCell::new(Recent::new()) };
    static SHADOWS: RefCell<Recent<HeaderValue>> = const { RefCell::new(Recent::new()) };
    static RETRY_AFTERS: RefCell<Recent<HeaderValue>> = const { RefCell::new(Recent::new()) };
    static BODIES: RefCell<Recent<Bytes>> = const { RefCell::new(Recent::new()) };
}

impl<T> Recent<T> {
    const fn new() -> Self {
        Recent {
            values: [None, None, None, None],
            next: 0,
        }
    }
}

/// What `make` makes of `bytes`, or the equal value this thread made last (see [`Recent`]).
fn made<T: Clone + AsRef<[u8]>>(
    recent: &'static Local<T>,
    bytes: &[u8],
    make: fn(&[u8]) -> Option<T>,
) -> Option<T> {
    let shared = recent.try_with(|r| {
        let mut r = r.try_borrow_mut().ok()?;
        if let Some(v) = r.values.iter().flatten().find(|v| v.as_ref() == bytes) {
            return Some(v.clone());
        }
        let v = make(bytes)?;
        let at = r.next;
        r.next = (at + 1) % RECENT;
        if let Some(slot) = r.values.get_mut(at) {
            *slot = Some(v.clone());
        }
        Some(v)
    });
    match shared {
        Ok(Some(v)) => Some(v),
        _ => make(bytes),
    }
}

/// `Retry-After` for a denial: the longest wait among the denying rules, plus `jitter_us`
/// (the rules' `retry_jitter`, drawn by the caller), whole seconds, rounded up, at least 1.
pub fn retry_after_secs(applied: &[Applied<'_>], jitter_us: u64) -> u64 {
    ceil_secs(retry_wait_us(applied, jitter_us)).max(1)
}

/// The wait of a denial in µs: the longest among the denying rules, plus `jitter_us`.
fn retry_wait_us(applied: &[Applied<'_>], jitter_us: u64) -> u64 {
    applied
        .iter()
        .filter(|a| !a.decision.allowed)
        .map(|a| a.decision.retry_after_us)
        .max()
        .unwrap_or(0)
        .saturating_add(jitter_us)
}

/// The fields of a problem+json body, in the contract's order.
#[derive(serde::Serialize)]
struct ProblemBody<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    title: &'a str,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a str>,
    #[serde(rename = "violated-policies", skip_serializing_if = "Option::is_none")]
    violated_policies: Option<Vec<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after: Option<u64>,
}

impl ProblemBody<'_> {
    fn to_bytes(&self) -> Bytes {
        // Serialising plain strings and integers cannot fail.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }
}

/// A 429 body up to its violated policies' names.
const QUOTA_EXCEEDED_HEAD: &[u8] = br#"{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Too Many Requests","status":429,"violated-policies":["#;

/// A problem+json answer (RFC 9457), and what a gRPC answer of it needs
/// (`proxy::grpc::trailers_only`).
pub struct Problem {
    pub status: StatusCode,
    pub body: Bytes,
    /// Its `detail` (a gRPC answer's `grpc-message`); none for a denial, whose body names
    /// the violated policies instead.
    pub detail: Option<Cow<'static, str>>,
    /// `Retry-After`, whole seconds.
    pub retry_after: Option<u64>,
    /// The same wait in ms, unrounded (a denial's) where known: `grpc-retry-pushback-ms`.
    pub retry_after_ms: Option<u64>,
    /// `WWW-Authenticate`, for a bearer token's 401 (RFC 6750 §3).
    pub challenge: Option<HeaderValue>,
}

impl Problem {
    pub fn new(status: StatusCode, detail: impl Into<Cow<'static, str>>) -> Problem {
        let detail = detail.into();
        let body = ProblemBody {
            kind: "about:blank",
            title: status.canonical_reason().unwrap_or("Error"),
            status: status.as_u16(),
            detail: Some(&detail),
            violated_policies: None,
            retry_after: None,
        };
        Problem {
            status,
            body: body.to_bytes(),
            detail: Some(detail),
            retry_after: None,
            retry_after_ms: None,
            challenge: None,
        }
    }

    /// The 429 of the contract, naming the rules that denied. `jitter_us` is added to the
    /// wait (`retry_jitter`; 0 for none).
    pub fn too_many_requests(applied: &[Applied<'_>], jitter_us: u64) -> Problem {
        let wait_us = retry_wait_us(applied, jitter_us);
        let retry_after = ceil_secs(wait_us).max(1);
        // Written by hand, as serde_json would write `ProblemBody` (a test holds the two
        // together): every denial pays for it. Rule names need no escapes in JSON strings.
        let body = scratch(|body, _| {
            body.extend_from_slice(QUOTA_EXCEEDED_HEAD);
            for (i, a) in applied.iter().filter(|a| !a.decision.allowed).enumerate() {
                if i > 0 {
                    body.push(b',');
                }
                item(body, a.rule);
            }
            body.extend_from_slice(b"],\"retry_after\":");
            body.extend_from_slice(itoa::Buffer::new().format(retry_after).as_bytes());
            body.push(b'}');
            made(&BODIES, body, |b| Some(Bytes::copy_from_slice(b)))
        });
        Problem {
            status: StatusCode::TOO_MANY_REQUESTS,
            body: body.unwrap_or_default(),
            detail: None,
            retry_after: Some(retry_after),
            retry_after_ms: Some(wait_us.div_ceil(1000).max(1)),
            challenge: None,
        }
    }

    pub fn with_retry_after(mut self, secs: u64) -> Problem {
        self.retry_after = Some(secs);
        self.retry_after_ms = Some(secs.saturating_mul(1000));
        self
    }

    pub fn with_challenge(mut self, challenge: Option<HeaderValue>) -> Problem {
        self.challenge = challenge;
        self
    }

    pub fn headers(&self, headers: &mut HeaderMap) {
        if let Some(c) = &self.challenge {
            headers.insert(http::header::WWW_AUTHENTICATE, c.clone());
        }
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(s) = self.retry_after {
            let mut secs = itoa::Buffer::new();
            let v = made(&RETRY_AFTERS, secs.format(s).as_bytes(), |b| {
                HeaderValue::from_bytes(b).ok()
            });
            headers.insert(RETRY_AFTER, v.unwrap_or_else(|| HeaderValue::from(s)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;
    use crate::limiter::Rate;
    use std::num::NonZeroU64;
    use std::time::Duration;

    fn quota(count: u64, secs: u64) -> Quota {
        Quota::new(
            Algorithm::TokenBucket,
            Rate::every(count, Duration::from_secs(secs)),
            None,
            NonZeroU64::MIN,
        )
        .unwrap()
    }

    fn d(allowed: bool, remaining: u64, retry_after_us: u64, reset_us: u64) -> Decision {
        Decision {
            allowed,
            remaining,
            retry_after_us,
            reset_us,
            window: 0,
        }
    }

    /// `name`'s rule (the first in the config) with `quota`, which decided `decision`.
    fn rule(name: &str, quota: Quota, decision: Decision) -> Applied<'_> {
        Applied {
            rule: name,
            index: 0,
            quota,
            decision,
        }
    }

    fn quota_of(algorithm: Algorithm, count: u64, secs: u64, burst: Option<u64>) -> Quota {
        costing(algorithm, count, secs, burst, 1)
    }

    fn costing(
        algorithm: Algorithm,
        count: u64,
        secs: u64,
        burst: Option<u64>,
        cost: u64,
    ) -> Quota {
        let rate = Rate::every(count, Duration::from_secs(secs));
        Quota::new(
            algorithm,
            rate,
            burst.and_then(NonZeroU64::new),
            NonZeroU64::new(cost).unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn a_calendar_window_advertises_the_length_of_the_period_open_now() {
        let zone = crate::limiter::calendar::zone("Europe/Berlin").unwrap();
        let q = Quota::new(
            Algorithm::FixedWindow,
            Rate::parse("100/month").unwrap(),
            None,
            NonZeroU64::new(2).unwrap(),
        )
        .unwrap()
        .in_zone(zone, 1);
        let before = ceil_secs(q.window_us_at(unix_now_us()));
        let (count, w) = advertised(&q);
        let after = ceil_secs(q.window_us_at(unix_now_us()));
        assert_eq!(count, 50);
        let w = w.unwrap();
        assert!(
            w == before || w == after,
            "{w} is neither {before} nor {after}"
        );
        // A month in Berlin: 28 to 31 days, give or take a DST hour.
        assert!(
            (28 * 86_400 - 3600..=31 * 86_400 + 3600).contains(&w),
            "{w}"
        );
    }

    #[test]
    fn a_bucket_advertises_its_burst_and_the_time_to_refill_it() {
        use Algorithm::*;
        for alg in [TokenBucket, Gcra] {
            // 10/s, burst 20: 20 at once, back in 2 s.
            assert_eq!(advertised(&quota_of(alg, 10, 1, Some(20))), (20, Some(2)));
            // 1/m, burst 30: 30 tokens, back in 30 minutes.
            assert_eq!(
                advertised(&quota_of(alg, 1, 60, Some(30))),
                (30, Some(1800))
            );
            // The same at cost 10 (the shipped `exports`): 3 requests, back in 30 minutes.
            assert_eq!(
                advertised(&costing(alg, 1, 60, Some(30), 10)),
                (3, Some(1800))
            );
            // A burst the cost does not divide: 2 requests of 10 from 25 tokens, whose 20
            // tokens come back in 20 minutes.
            assert_eq!(
                advertised(&costing(alg, 1, 60, Some(25), 10)),
                (2, Some(1200))
            );
            // 3/s, burst 5: back in 5/3 s, rounded up: never promised sooner than it is.
            assert_eq!(advertised(&quota_of(alg, 3, 1, Some(5))), (5, Some(2)));
            // No burst: N at once, back in the period.
            assert_eq!(advertised(&quota_of(alg, 100, 60, None)), (100, Some(60)));
            // A burst smaller than N: refilled within the period.
            assert_eq!(advertised(&quota_of(alg, 100, 60, Some(10))), (10, Some(6)));
        }
        for alg in [SlidingWindow, FixedWindow] {
            assert_eq!(advertised(&quota_of(alg, 300, 60, None)), (300, Some(60)));
            assert_eq!(advertised(&costing(alg, 300, 60, None, 7)), (42, Some(60)));
        }
    }

    #[test]
    fn quotas_and_what_is_left_count_requests_of_the_rules_cost() {
        // Exports: 30 tokens, 10 a request. After one, 20 tokens: 2 more requests.
        let q = costing(Algorithm::TokenBucket, 1, 60, Some(30), 10);
        let applied = [rule("exports", q, d(true, 20, 0, 600_000_000))];
        let mut h = HeaderMap::new();
        add_ratelimit(&mut h, ResponseStyle::Both, &applied);
        add_shadow(&mut h, ResponseStyle::Draft, &applied);
        assert_eq!(h[&RATELIMIT_POLICY], "\"exports\";q=3;w=1800");
        assert_eq!(h[&RATELIMIT], "\"exports\";r=2;t=600");
        assert_eq!(h[&RATELIMIT_LIMIT], "3");
        assert_eq!(h[&RATELIMIT_REMAINING], "2");
        assert_eq!(h[&RATELIMIT_SHADOW], "\"exports\";r=2;t=600");
        // 15 tokens: one request of 10, not one and a half.
        let applied = [Applied {
            decision: d(true, 15, 0, 900_000_000),
            ..applied[0]
        }];
        let mut h = HeaderMap::new();
        add_ratelimit(&mut h, ResponseStyle::Draft, &applied);
        assert_eq!(h[&RATELIMIT], "\"exports\";r=1;t=900");
    }

    #[test]
    fn a_bucket_never_shows_more_left_than_its_quota() {
        // A full bucket's `r` is its burst: `q`, never above it. After one request, 19.
        let q = quota_of(Algorithm::TokenBucket, 10, 1, Some(20));
        let full = [rule("api", q, d(true, 20, 0, 0))];
        let mut h = HeaderMap::new();
        add_ratelimit(&mut h, ResponseStyle::Draft, &full);
        assert_eq!(h[&RATELIMIT], "\"api\";r=20;t=0");
        let applied = [rule("api", q, d(true, 19, 0, 100_000))];
        let mut h = HeaderMap::new();
        add_ratelimit(&mut h, ResponseStyle::Both, &applied);
        assert_eq!(h[&RATELIMIT_POLICY], "\"api\";q=20;w=2");
        assert_eq!(h[&RATELIMIT], "\"api\";r=19;t=1");
        assert_eq!(h[&RATELIMIT_LIMIT], "20");
        assert_eq!(h[&RATELIMIT_REMAINING], "19");
    }

    #[test]
    fn draft_headers_list_every_rule() {
        let (a, b) = (quota(10, 1), quota(100, 60));
        let applied = [
            rule("api", a, d(true, 7, 0, 300_000)),
            rule("ip", b, d(true, 99, 0, 600_001)),
        ];
        let mut h = HeaderMap::new();
        add_ratelimit(&mut h, ResponseStyle::Draft, &applied);
        assert_eq!(h[&RATELIMIT_POLICY], "\"api\";q=10;w=1, \"ip\";q=100;w=60");
        assert_eq!(h[&RATELIMIT], "\"api\";r=7;t=1, \"ip\";r=99;t=1");
        assert!(h.get(&RATELIMIT_LIMIT).is_none());
    }

    #[test]
    fn concurrency_is_a_quota_of_concurrent_requests_without_window() {
        let (a, c) = (
            quota(10, 1),
            Quota::concurrency(NonZeroU64::new(5).unwrap(), Duration::from_secs(10)),
        );
        let applied = [
            rule("api", a, d(true, 7, 0, 300_000)),
            rule("conc", c, d(true, 2, 0, 0)),
        ];
        let mut h = HeaderMap::new();
        add_ratelimit(&mut h, ResponseStyle::Draft, &applied);
        assert_eq!(
            h[&RATELIMIT_POLICY],
            "\"api\";q=10;w=1, \"conc\";q=5;qu=\"concurrent-requests\""
        );
        assert_eq!(h[&RATELIMIT], "\"api\";r=7;t=1, \"conc\";r=2");
        // Both parse as Structured Field lists.
        for name in [&RATELIMIT_POLICY, &RATELIMIT] {
            let v = h[name].to_str().unwrap();
            assert!(sfv::Parser::parse_list(v.as_bytes()).is_ok(), "{v}");
        }
    }

    #[test]
    fn shadow_rules_go_to_their_own_header_with_a_denied_flag() {
        let (a, c) = (
            quota(10, 1),
            Quota::concurrency(NonZeroU64::new(5).unwrap(), Duration::from_secs(10)),
        );
        let shadow = [
            rule("watch", a, d(false, 0, 100_000, 1_000_000)),
            rule("conc", c, d(true, 4, 0, 0)),
        ];
        let mut h = HeaderMap::new();
        add_shadow(&mut h, ResponseStyle::Draft, &shadow);
        let v = h[&RATELIMIT_SHADOW].to_str().unwrap();
        assert_eq!(v, "\"watch\";r=0;t=1;denied, \"conc\";r=4");
        assert!(sfv::Parser::parse_list(v.as_bytes()).is_ok(), "{v}");
        let mut none = HeaderMap::new();
        add_shadow(&mut none, ResponseStyle::None, &shadow);
        assert!(none.is_empty());
    }

    #[test]
    fn jitter_is_added_before_rounding() {
        let a = quota(1, 10);
        let applied = [rule("api", a, d(false, 0, 2_000_000, 10_000_000))];
        assert_eq!(retry_after_secs(&applied, 0), 2);
        assert_eq!(retry_after_secs(&applied, 1), 3);
        assert_eq!(retry_after_secs(&applied, 3_000_000), 5);
    }

    #[test]
    fn legacy_headers_name_the_rule_closest_to_denying() {
        let (a, b) = (quota(10, 1), quota(100, 60));
        let applied = [
            rule("api", a, d(true, 7, 0, 300_000)),
            rule("ip", b, d(true, 2, 0, 59_000_000)),
        ];
        let mut h = HeaderMap::new();
        add_ratelimit(&mut h, ResponseStyle::Legacy, &applied);
        assert_eq!(h[&RATELIMIT_LIMIT], "100");
        assert_eq!(h[&RATELIMIT_REMAINING], "2");
        assert_eq!(h[&RATELIMIT_RESET], "59");
        assert!(h.get(&RATELIMIT).is_none());
        let mut h = HeaderMap::new();
        add_ratelimit(&mut h, ResponseStyle::None, &applied);
        assert!(h.is_empty());
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        let a = quota(10, 1);
        let mk = |us| [rule("api", a, d(false, 0, us, 1))];
        assert_eq!(retry_after_secs(&mk(1), 0), 1);
        assert_eq!(retry_after_secs(&mk(0), 0), 1);
        assert_eq!(retry_after_secs(&mk(1_000_001), 0), 2);
        let p = Problem::too_many_requests(&mk(2_500_000), 0);
        let v: serde_json::Value = serde_json::from_slice(&p.body).unwrap();
        assert_eq!(v["retry_after"], 3);
        assert_eq!(p.retry_after_ms, Some(2500), "the wait in ms, unrounded");
        assert_eq!(
            Problem::too_many_requests(&mk(1), 0).retry_after_ms,
            Some(1)
        );
        assert_eq!(
            Problem::too_many_requests(&mk(2_500_001), 0).retry_after_ms,
            Some(2501)
        );
        assert_eq!(
            Problem::too_many_requests(&mk(2_000_000), 400).retry_after_ms,
            Some(2001)
        );
        assert_eq!(v["violated-policies"][0], "api");
        assert_eq!(v["status"], 429);
        assert_eq!(
            std::str::from_utf8(&p.body).unwrap(),
            r#"{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Too Many Requests","status":429,"violated-policies":["api"],"retry_after":3}"#
        );
    }

    #[test]
    fn the_429_body_is_what_serde_json_writes() {
        let (a, b) = (quota(10, 1), quota(100, 60));
        let applied = [
            rule("per-key.v2", a, d(false, 0, 1_500_000, 1)),
            rule("ip", b, d(true, 5, 0, 1)),
            rule("global_all", b, d(false, 0, 61_000_000, 1)),
        ];
        let p = Problem::too_many_requests(&applied, 0);
        let expected = ProblemBody {
            kind: "https://iana.org/assignments/http-problem-types#quota-exceeded",
            title: "Too Many Requests",
            status: 429,
            detail: None,
            violated_policies: Some(vec!["per-key.v2", "global_all"]),
            retry_after: Some(61),
        };
        assert_eq!(p.body, expected.to_bytes());
    }
}
