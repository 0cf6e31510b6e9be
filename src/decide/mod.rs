//! The decision core: a request described as a [`Subject`] (method, URI, a view of its
//! headers, its peer and TLS client certificate; what its body asks a model for) in,
//! the decision out, in a [`Decided`]: its route and pool, who it is under each rule
//! that applies, the store's answers, one pure [`Verdict`], the `RateLimit` fields its
//! answer carries, what it holds (concurrency leases, its place in a rule's queue, the
//! settlement its charges wait for). No socket, no body, no hyper type: the proxy builds
//! a subject from a request's head, and any other front-end builds one its own way and
//! calls the same [`decide`].
//!
//! In the order a decision runs: the route (`route.rs`; a 404 where none fits), the
//! rules that fit (`limits.rs`), those that need no credential first where a token must
//! be verified (`first.rs`), the store asked and its answer judged (`ask.rs`, the pure
//! verdict in `verdict.rs`), and for a request let through, its settlement held
//! (`settling.rs`) and its overload priority.
//!
//! The core counts nothing itself: what a decision counts (each rule's share of the
//! request, the dashboards' judgement, a denial's heavy hitter) is returned in
//! [`Decided::counts`], one event the caller hands to [`crate::runtime::Metrics::decided`].

mod ask;
mod first;
pub mod head;
pub mod limits;
pub mod route;
mod settling;
pub mod verdict;

use std::net::IpAddr;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};

use crate::config::Config;
use crate::headers::{Applied, Problem};
use crate::identity::{ClientCert, IdentityDigest, Refusal, Requester};
/// What a request let through holds until its answer ends: its concurrency leases.
pub use crate::limiter::lease::{Leases, Releasing};
use crate::limiter::Decision;
use crate::runtime::requests::DecisionLabel;
use crate::runtime::{Counts, Judgement, Live, WaitSlot};
use crate::settle::max_tokens::Asked;
use crate::settle::Settling;
use crate::telemetry::stats::Named;
use crate::telemetry::Disposition;
use ask::{consult, tally};
use first::{credential_free, give_back, judge, merge, needs_token, refused_by_other};
pub use limits::{forwarded_host, matching, may_read_body};
use limits::{split, Limit, Refused};
pub use route::Destination;
pub use settling::unreadable;
use verdict::Verdict;

/// A request as the decision sees it.
#[derive(Clone, Copy)]
pub struct Subject<'a> {
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
    /// The client's address as the connection saw it (trusted proxies' forwarding
    /// fields are read from `headers` by the rules that count by the client IP).
    pub peer: IpAddr,
    /// The client certificate a TLS handshake verified, if one was presented.
    pub client_cert: Option<&'a ClientCert>,
}

impl<'a> Subject<'a> {
    /// Who the request is, as the rules of `cfg` read it: its keys, its token, its
    /// certificate, its address.
    pub fn requester(&self, cfg: &'a Config) -> Requester<'a> {
        Requester::new(self.headers, self.peer, &cfg.keys, &cfg.client_ip)
            .with_client_cert(self.client_cert)
            .with_jwt(cfg.jwt.as_ref().map(|j| &*j.verifier))
            .counting_failures()
    }
}

/// What a decision found, filled in as it runs; what a request let through carries to
/// its answer.
pub struct Decided<'l> {
    /// How the request was disposed of, as far as it has come.
    pub disposition: Disposition,
    /// The rule that decided: the one that denied, or the one closest to denying.
    pub rule: Option<&'l str>,
    pub identity: Option<IdentityDigest>,
    /// A rule that would have denied had it enforced (shadow mode, rollout).
    pub shadow_denied: Option<&'l str>,
    /// How long the request waits for the tokens it took ahead (`max_delay`) before it goes on.
    pub waited: Duration,
    /// Where it goes, once a route (or the pool `default`) took it.
    pub to: Option<Destination>,
    /// The enforcing rules' decisions (`RateLimit-*`), and apart, the watching ones'
    /// (`RateLimit-Shadow`).
    pub applied: Vec<Applied<'l>>,
    pub shadow: Vec<Applied<'l>>,
    /// Its concurrency slots, given back when its answer ends.
    pub leases: Option<Leases>,
    /// Its places in the queues of the rules it waits on, held while it waits.
    pub slots: Vec<WaitSlot<'l>>,
    /// The rules with a WebSocket limit (`messages`, `bytes`) that let it through: each
    /// one's position, who the request is under it, and how long it may hold a client
    /// back (its `max_delay`, µs). Used only where the request upgrades.
    pub messages: Vec<(usize, IdentityDigest, u64)>,
    /// The headers its verified token's claims give the backend (`[jwt] forward_claims`).
    pub claims: Vec<(HeaderName, HeaderValue)>,
    /// The charges of its rules that settle once the answer is known (`charge`,
    /// `cost_header`, `cost_from`); none for rules whose charge stands as taken.
    pub settling: Option<Settling>,
    /// Its place in an overloaded pool's queue.
    pub priority: u32,
    /// What the decision counts, for whoever asked for it to hand to the runtime's
    /// metrics ([`crate::runtime::Metrics::decided`]).
    pub counts: Counts<'l>,
    /// Set by the caller before deciding: ask what the store would answer, charging
    /// nothing, holding nothing (the decision API's `dry_run`).
    pub dry_run: bool,
    /// Set by the caller before deciding: the cost to charge under every rule, in place
    /// of each rule's own (the decision API's `cost`; at least 1).
    pub cost: Option<std::num::NonZeroU64>,
}

impl Default for Decided<'_> {
    fn default() -> Self {
        Decided {
            // Until a rule or a refusal says otherwise (a request no rule disposed of
            // was let through unlimited).
            disposition: Disposition::Unlimited,
            rule: None,
            identity: None,
            shadow_denied: None,
            waited: Duration::ZERO,
            to: None,
            applied: Vec::new(),
            shadow: Vec::new(),
            leases: None,
            slots: Vec::new(),
            messages: Vec::new(),
            claims: Vec::new(),
            settling: None,
            priority: 0,
            counts: Counts::default(),
            dry_run: false,
            cost: None,
        }
    }
}

impl<'l> Decided<'l> {
    /// Disposed of as `d`.
    pub fn disposed(&mut self, d: Disposition) -> &mut Self {
        self.disposition = d;
        self
    }

    /// Count its passes under each rule that let it through (allowed, or delayed where
    /// it waited): once its answer is known (the proxy's, once the upstream answered; a
    /// decision service's, at once).
    pub fn count_passed(&self, live: &Live) {
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

    /// Decided by `rule` (its name), for `identity`.
    fn by(&mut self, rule: Option<&'l str>, identity: Option<IdentityDigest>) {
        self.rule = rule;
        self.identity = identity;
    }
}

/// The answer a decision gives a request it does not let through, for the front-end to
/// write its own way (problem+json, a gRPC status, a denial of a protocol of its own).
pub struct Rejection {
    pub problem: Problem,
    /// Whether the answer shows the request's rules: their `RateLimit` fields
    /// ([`Decided::applied`]) and, apart, the watching ones' ([`Decided::shadow`]).
    pub shows_limits: bool,
    /// Whether the client's connection must close after it (the rest of the request's
    /// body was never read).
    pub close: bool,
}

impl Rejection {
    fn of(problem: Problem) -> Rejection {
        Rejection {
            problem,
            shows_limits: false,
            close: false,
        }
    }
}

/// Decide the request `subject`, as `requester` reads it (`asked`: what its body asks a
/// model for, where it was read), on `live`: its route, then its rules, the store's
/// answer and the verdict. `Ok`: let through, with what its answer carries in `d`;
/// `Err`: the answer it gets instead. Either way, what it counts is in `d.counts`.
pub async fn decide<'l: 'p, 'p>(
    live: &'l Live,
    subject: &Subject<'_>,
    requester: &Requester<'p>,
    asked: Option<Asked>,
    d: &mut Decided<'l>,
) -> Result<(), Rejection> {
    let cfg = &*live.config;
    let to = match route::choose(cfg, subject, requester) {
        Ok(Some(to)) => to,
        Ok(None) => return Err(no_route(d, subject)),
        Err(refusal) => {
            d.disposed(Disposition::Refused(refusal));
            return Err(Rejection::of(refused(refusal)));
        }
    };
    d.to = Some(to);
    let fitting = limits::matching(cfg, subject, Some(&to));
    decide_rules(live, fitting, requester, asked, d).await
}

/// Decide the rules at the config positions `fitting` (each of whose match fits the
/// request, or which a caller named) for the request `requester` reads: every step of
/// [`decide`] after the route.
pub async fn decide_rules<'l: 'p, 'p>(
    live: &'l Live,
    fitting: Vec<usize>,
    requester: &Requester<'p>,
    asked: Option<Asked>,
    d: &mut Decided<'l>,
) -> Result<(), Rejection> {
    let cfg = &*live.config;
    let asked = asked.as_ref();
    // A token only a signature check can judge: the rules that need no credential
    // first, and a 429 of theirs before the signature is looked at.
    let mut first = None;
    // The rules decided now: all that fit, unless some were decided first.
    let mut later = None;
    let needs_token = |&i: &usize| needs_token(cfg, &cfg.rules[i]);
    if fitting.iter().any(needs_token) && requester.token_pending() {
        let (free, rest): (Vec<usize>, Vec<usize>) = fitting
            .iter()
            .partition(|&&i| credential_free(&cfg.rules[i]));
        later = Some(rest);
        first = first::decide(live, &free, requester, asked, d).await?;
    }
    let rest = later.as_deref().unwrap_or(&fitting);
    if let Some(refused) = settling::refuse_body(live, rest, requester, asked, d) {
        refused_by_other(first.as_ref(), d);
        return Err(refused);
    }
    let limits = match Limit::all(live, rest, requester, asked, d.cost) {
        Ok(limits) => limits,
        Err(Refused { index, refusal }) => {
            // Refused for its credentials: charged to the rules that need none, and
            // their 429 where they deny (decided now, unless they were first).
            if first.is_none() && refusal.is_charged() {
                let free: Vec<usize> = fitting
                    .iter()
                    .copied()
                    .filter(|&i| credential_free(&cfg.rules[i]))
                    .collect();
                first = first::decide(live, &free, requester, asked, d).await?;
            }
            refused_by_other(first.as_ref(), d);
            return Err(refuse(live, index, refusal, d));
        }
    };
    let (limits, decisions, verdict, leases, local) = match (first, limits.is_empty()) {
        (None, true) => {
            d.disposed(Disposition::Unlimited);
            let_through(live, requester, &fitting, d);
            return Ok(());
        }
        (None, false) => {
            let (decisions, verdict, leases, local) = consult(live, &limits, d.dry_run).await;
            (limits, decisions, verdict, leases, local)
        }
        (Some(first), true) => {
            let verdict = judge(live, &first.limits, &first.decisions);
            (
                first.limits,
                Some(first.decisions),
                verdict,
                None,
                first.local,
            )
        }
        (Some(first), false) => {
            let (decisions, verdict, leases, local) = consult(live, &limits, d.dry_run).await;
            let Some(decisions) = decisions else {
                // The store failed: what it had charged first is given back where the
                // request is not let through.
                if verdict != Verdict::Unlimited && !d.dry_run {
                    give_back(live, &first).await;
                }
                return store_failed(&limits, verdict, d);
            };
            // Denied after the first ones allowed: theirs given back, as one decision
            // for the whole request would never have charged them.
            if matches!(verdict, Verdict::Deny { .. }) && !d.dry_run {
                give_back(live, &first).await;
            }
            // Settled later where the rest were decided: both are the store's unless it
            // failed between the two calls (then the first ones' settlement, if any,
            // goes where the rest went: at worst a charge stands).
            let (limits, decisions) = merge(first, limits, decisions);
            let verdict = judge(live, &limits, &decisions);
            (limits, Some(decisions), verdict, leases, local)
        }
    };
    match (verdict, decisions) {
        (Verdict::Deny { by, jitter_us }, Some(decisions)) => {
            Err(deny(&limits, &decisions, by, jitter_us, d))
        }
        (Verdict::Forward | Verdict::Delay(_), Some(decisions)) => {
            pass(live, limits, &decisions, verdict, leases, local, d);
            let_through(live, requester, &fitting, d);
            Ok(())
        }
        (v, _) => store_failed(&limits, v, d),
    }
}

/// What is found only for a request let through: its pool's balancing hash, its
/// overload priority, the claims its backend gets (each may verify a token no rule asked
/// for; never before the rules were charged).
fn let_through<'a>(
    live: &'a Live,
    requester: &Requester<'a>,
    fitting: &[usize],
    d: &mut Decided<'_>,
) {
    if let Some(to) = d.to {
        let to = to.hashed(&live.config, requester);
        d.priority = priority(live, fitting, requester, &to);
        d.to = Some(to);
    }
    d.claims = requester.forwarded_claims();
}

/// The priority of a request bound for `to`: the highest `priority` among the
/// `[rules.plans.<plan>]` tables of its plan in the rules whose match fits it (`fitting`,
/// found once for its limits too; an exempt plan's table counts as well); 0 without a
/// plan, or where no such table sets one. Read only for a pool with overload protection.
fn priority(live: &Live, fitting: &[usize], requester: &Requester<'_>, to: &Destination) -> u32 {
    let cfg = &*live.config;
    let protected = live
        .pools
        .get(to.pool)
        .is_some_and(|p| p.overload().is_some());
    if !protected || cfg.rules.iter().all(|r| r.priorities.is_empty()) {
        return 0;
    }
    let Some(plan) = requester.plan() else {
        return 0;
    };
    fitting
        .iter()
        .filter_map(|&i| cfg.rules.get(i)?.priorities.get(plan).copied())
        .max()
        .unwrap_or(0)
}

/// What the status page shows of who the request is under the rule at config position
/// `index`: its kind and a part of it, its key's label, its token's claims. Asked only
/// where a denial makes that identity a new heavy hitter.
pub fn named<'a>(cfg: &'a Config, requester: &Requester<'a>, index: usize) -> Named {
    let Some(Ok(identity)) = cfg.rules.get(index).map(|r| requester.identify(&r.key)) else {
        return Named::default();
    };
    let source = &identity.source;
    Named {
        hint: identity.hint(),
        label: requester.label_of(source).map(|l| l.to_string()),
        claims: requester.claims_of(source),
    }
}

/// A request one rule refused before any limit was consulted (its credentials, a
/// malformed key): its answer, counted under that rule.
fn refuse<'l>(live: &'l Live, index: usize, refusal: Refusal, d: &mut Decided<'l>) -> Rejection {
    let share = match refusal.status() {
        StatusCode::BAD_REQUEST => DecisionLabel::BadKey,
        _ => DecisionLabel::Refused,
    };
    d.counts.refused = Some((index, share));
    d.disposed(Disposition::Refused(refusal));
    d.rule = live.config.rules.get(index).map(|r| r.name.as_str());
    Rejection::of(refused(refusal))
}

/// The 404 of a request no route fits when no pool `default` takes the rest: never
/// let through, counted (`ratewall_refusals_total{reason="no_route"}`) and logged.
fn no_route(d: &mut Decided<'_>, subject: &Subject<'_>) -> Rejection {
    tracing::debug!(method = %subject.method, path = subject.uri.path(), "no route matches the request");
    d.disposed(Disposition::NoRoute);
    Rejection::of(Problem::new(
        StatusCode::NOT_FOUND,
        "no route matches this request",
    ))
}

/// A denied request's 429, and the counts it adds.
fn deny<'l>(
    limits: &[Limit<'l, '_>],
    decisions: &[Option<Decision>],
    by: usize,
    jitter_us: u64,
    d: &mut Decided<'l>,
) -> Rejection {
    let first = d.counts.rules.len();
    d.shadow_denied = tally(&mut d.counts, limits, decisions, true);
    (d.applied, d.shadow) = split(limits, decisions);
    let limit = &limits[by];
    d.disposed(Disposition::Denied)
        .by(Some(limit.rule.name.as_str()), Some(limit.identity.digest));
    let problem = Problem::too_many_requests(&d.applied, crate::random::up_to(jitter_us));
    d.counts.judged = Some(Judgement::Denied {
        by: first + by,
        retry_ms: problem.retry_after_ms.unwrap_or(0),
    });
    Rejection {
        problem,
        shows_limits: true,
        close: false,
    }
}

/// An admitted request's decisions, and the counts they add.
fn pass<'l>(
    live: &'l Live,
    limits: Vec<Limit<'l, '_>>,
    decisions: &[Option<Decision>],
    verdict: Verdict,
    leases: Option<Leases>,
    local: bool,
    d: &mut Decided<'l>,
) {
    d.shadow_denied = tally(&mut d.counts, &limits, decisions, false);
    d.counts.judged = Some(Judgement::Admitted);
    (d.applied, d.shadow) = split(&limits, decisions);
    if !d.dry_run {
        d.settling = settling::held(live, &limits, decisions, local);
    }
    let ruled = |k: usize| limits.get(k).map(Limit::ruled);
    let closest = verdict::closest(ruled, decisions).map(|k| &limits[k]);
    d.disposed(verdict.disposition()).by(
        closest.map(|l| l.rule.name.as_str()),
        closest.map(|l| l.identity.digest),
    );
    if let Verdict::Delay(us) = verdict {
        d.waited = Duration::from_micros(us);
    }
    d.messages = limits
        .iter()
        .filter(|l| l.enforced && (l.rule.messages.is_some() || l.rule.bytes.is_some()))
        .map(|l| (l.index, l.identity.digest, l.quota.max_delay_us))
        .collect();
    // Waiting on a rule holds its place in that rule's queue; the others are free.
    d.slots = limits
        .into_iter()
        .zip(decisions)
        .filter(|(_, d)| d.is_some_and(|d| d.allowed && d.retry_after_us > 0))
        .filter_map(|(l, _)| l.slot)
        .collect();
    d.leases = leases;
}

/// The store failed: let through unlimited or answer 503, as `on_error` said.
// The answer is made once and returned at once: boxing it would cost an allocation.
#[allow(clippy::result_large_err)]
fn store_failed<'l>(
    limits: &[Limit<'l, '_>],
    verdict: Verdict,
    d: &mut Decided<'l>,
) -> Result<(), Rejection> {
    let errors = limits
        .iter()
        .map(|l| l.counted(None, Some(DecisionLabel::Error)));
    d.counts.rules.extend(errors);
    d.disposed(verdict.disposition()).by(
        limits.first().map(|l| l.rule.name.as_str()),
        limits.first().map(|l| l.identity.digest),
    );
    if verdict == Verdict::Unlimited {
        return Ok(());
    }
    let p = Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the rate-limit store is unavailable",
    );
    Err(Rejection::of(p.with_retry_after(1)))
}

/// The answer to a request refused before any limit: its status and reason, and a bearer
/// token's challenge (`WWW-Authenticate`) where a token was missing or did not verify.
fn refused(refusal: Refusal) -> Problem {
    let p = Problem::new(refusal.status(), refusal.to_string()).with_challenge(refusal.challenge());
    match refusal {
        Refusal::KeysUnavailable => p.with_retry_after(1),
        Refusal::Throttled(ms) => p.with_retry_after(ms.div_ceil(1000).max(1)),
        _ => p,
    }
}
