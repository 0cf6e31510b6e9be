//! A request's rules decided, credentials last where they cost.
//!
//! A request is refused for its credentials (no token, one that does not verify, an
//! unknown API key) or counted by the rules that apply to it. Two things keep a client
//! from making the gateway work for free:
//!
//! - **Rules that need no credential are charged first.** Where the request carries a
//!   bearer token neither cache knows — only a signature check can judge it, 43 µs of
//!   CPU on an RSA-2048 key — the rules that count by what needs no credential (the
//!   client IP, a header, everyone, a TLS client certificate: see [`credential_free`])
//!   are decided first, and a request they deny gets its 429 before its signature is
//!   looked at. A request refused for its credentials (401, or 429 once its address
//!   failed too often) is charged to those rules too: a client cannot spend a per-IP
//!   limit's worth of refusals for nothing (nginx's `limit_req` before its auth step
//!   does the same).
//! - **Past a few failures, nothing is checked.** Each client address may fail a few
//!   credentials (`[jwt] failures`, `[keys] failures`; see
//!   [`crate::identity::failures`]), and is answered 429 unchecked past them.
//!
//! Where the rules decided first allowed and a rule decided after denies, the first ones'
//! charges are given back, as a request decided all at once would never have been
//! charged. A request whose credentials need no signature check (none sent, or one a
//! cache knows) is decided all at once, as before: one round trip to the store.

use std::time::Duration;

use http::request::Parts;
use http::{Response, StatusCode};

use super::limits::{self, split, Limit, Refused};
use crate::runtime::Live;
use super::route;
use super::verdict::{self, Ruled};
use super::{
    consult, overload, problem, refused, tally, tokens, Body, Gateway, RequestCtx, Verdict,
};
use crate::telemetry::disposition::Disposition;
use crate::headers::{self, Problem};
use crate::identity::{KeyKind, Refusal, Requester};
use crate::limiter::lease::Leases;
use crate::limiter::store::Settlement;
use crate::limiter::{Adjust, Algorithm, Decision};
use crate::rules::Rule;
use crate::telemetry::stats::Named;

/// Whether `rule` can be decided without the request's credentials: it counts by the
/// client IP, a header, everyone or the TLS client certificate (alone or combined), has
/// no plans (a plan comes from a token or a key), asks nothing of an API key in its
/// `match`, and limits no concurrency (a lease is taken with the others).
pub(super) fn credential_free(rule: &Rule) -> bool {
    fn free(kind: &KeyKind) -> bool {
        match kind {
            KeyKind::ClientIp | KeyKind::Global | KeyKind::Header(_) | KeyKind::ClientCert => true,
            KeyKind::ApiKey | KeyKind::Jwt(_) => false,
            KeyKind::Combined(parts) => parts.iter().all(free),
        }
    }
    free(&rule.key.kind)
        && rule.plans.is_empty()
        && rule.quota.algorithm != Algorithm::Concurrency
        && rule
            .matcher
            .carrying
            .iter()
            .all(|c| !matches!(c.carried, crate::identity::Carried::ApiKey))
}

/// Whether deciding `rule` verifies the request's bearer token: it counts by a claim, or
/// its plans are the token's (`plan_claim`).
fn needs_token(cfg: &crate::config::Config, rule: &Rule) -> bool {
    let plan_claim = cfg
        .jwt
        .as_ref()
        .is_some_and(|j| j.verifier.settings.plan_claim.is_some());
    rule.key.kind.uses_jwt() || (plan_claim && !rule.plans.is_empty())
}

/// Rules decided before the others, and what they said.
struct First<'l, 'p> {
    limits: Vec<Limit<'l, 'p>>,
    decisions: Vec<Option<Decision>>,
    local: bool,
}

impl Gateway {
    /// Decide: the request's route, then its rules, as `requester` reads it (`asked`:
    /// what its body asks the model for, where it was read), the store's answer and the
    /// verdict. `Ok`: to be forwarded, with what its answer carries in `ctx`; `Err`: the
    /// gateway's answer.
    pub(super) async fn decide<'l: 'p, 'p>(
        &self,
        ctx: &mut RequestCtx<'l>,
        parts: &Parts,
        requester: &Requester<'p>,
        asked: Option<tokens::Asked>,
    ) -> Result<(), Response<Body>> {
        let live = ctx.live;
        let cfg = &*live.config;
        let to = match route::choose(cfg, parts, requester) {
            Ok(Some(to)) => to,
            Ok(None) => return Err(self.no_route(ctx, parts)),
            Err(refusal) => {
                ctx.disposed(Disposition::Refused(refusal));
                return Err(problem(refused(refusal), cfg, &[], ctx.dialect));
            }
        };
        ctx.going(to);
        let fitting = limits::matching(cfg, parts, Some(&to));
        let asked = asked.as_ref();
        // A token only a signature check can judge: the rules that need no credential
        // first, and a 429 of theirs before the signature is looked at.
        let mut first = None;
        let mut rest = fitting.clone();
        let needs_token = |&i: &usize| needs_token(cfg, &cfg.rules[i]);
        if fitting.iter().any(needs_token) && requester.token_pending() {
            let free: Vec<usize>;
            (free, rest) = fitting
                .iter()
                .partition(|&&i| credential_free(&cfg.rules[i]));
            first = self.first(ctx, &free, requester, asked).await?;
        }
        if let Some(refused) = self.refuse_body(ctx, &rest, requester, asked) {
            refused_by_other(live, first.as_ref());
            return Err(refused);
        }
        let limits = match Limit::all(live, &rest, requester, asked) {
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
                    first = self.first(ctx, &free, requester, asked).await?;
                }
                refused_by_other(live, first.as_ref());
                return Err(self.refuse(ctx, index, refusal));
            }
        };
        let (limits, decisions, verdict, leases, local) = match (first, limits.is_empty()) {
            (None, true) => {
                ctx.disposed(Disposition::Unlimited);
                self.forwarded(ctx, requester, &fitting);
                return Ok(());
            }
            (None, false) => {
                let (decisions, verdict, leases, local) = consult(live, &limits).await;
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
                let (decisions, verdict, leases, local) = consult(live, &limits).await;
                let Some(decisions) = decisions else {
                    // The store failed: what it had charged first is given back where
                    // the request is not forwarded.
                    if verdict != Verdict::Unlimited {
                        give_back(live, &first).await;
                    }
                    return store_failed(ctx, &limits, verdict);
                };
                // Denied after the first ones allowed: theirs given back, as one
                // decision for the whole request would never have charged them.
                if matches!(verdict, Verdict::Deny { .. }) {
                    give_back(live, &first).await;
                }
                // Settled later where the rest were decided: both are the store's unless
                // it failed between the two calls (then the first ones' settlement, if
                // any, goes where the rest went: at worst a charge stands).
                let (limits, decisions) = merge(first, limits, decisions);
                let verdict = judge(live, &limits, &decisions);
                (limits, Some(decisions), verdict, leases, local)
            }
        };
        match (verdict, decisions) {
            (Verdict::Deny { by, jitter_us }, Some(d)) => {
                Err(self.deny(ctx, requester, &limits, &d, by, jitter_us))
            }
            (Verdict::Forward | Verdict::Delay(_), Some(d)) => {
                self.pass(ctx, limits, &d, verdict, leases, local);
                self.forwarded(ctx, requester, &fitting);
                Ok(())
            }
            (v, _) => store_failed(ctx, &limits, v),
        }
    }

    /// What is found only for a request let through: its pool's balancing hash, its
    /// overload priority, the claims its backend gets (each may verify a token no rule
    /// asked for; never before the rules were charged).
    fn forwarded<'l: 'p, 'p>(
        &self,
        ctx: &mut RequestCtx<'l>,
        requester: &Requester<'p>,
        fitting: &[usize],
    ) {
        let live = ctx.live;
        if let Some(to) = ctx.to {
            let to = to.hashed(&live.config, requester);
            ctx.priority = overload::priority(live, fitting, requester, &to);
            ctx.to = Some(to);
        }
        ctx.claims = requester.forwarded_claims();
    }

    /// Decide the rules `free` (each [`credential_free`]) on their own: what they said,
    /// to go on with (none where there are none, or the store failed and `on_error`
    /// forwards); or the request's answer, their 429 where one denies (or the store's
    /// 503).
    async fn first<'l: 'p, 'p>(
        &self,
        ctx: &mut RequestCtx<'l>,
        free: &[usize],
        requester: &Requester<'p>,
        asked: Option<&tokens::Asked>,
    ) -> Result<Option<First<'l, 'p>>, Response<Body>> {
        if free.is_empty() {
            return Ok(None);
        }
        // A rule that refuses on its own (a header it counts by is missing) is left to
        // the whole request's decision, which refuses it.
        let Ok(limits) = Limit::all(ctx.live, free, requester, asked) else {
            return Ok(None);
        };
        if limits.is_empty() {
            return Ok(None);
        }
        let (decisions, verdict, _, local) = consult(ctx.live, &limits).await;
        match (verdict, decisions) {
            (Verdict::Deny { by, jitter_us }, Some(d)) => {
                Err(self.deny(ctx, requester, &limits, &d, by, jitter_us))
            }
            (Verdict::Forward | Verdict::Delay(_), Some(decisions)) => Ok(Some(First {
                limits,
                decisions,
                local,
            })),
            (Verdict::Unlimited, _) => Ok(None),
            (v, _) => store_failed(ctx, &limits, v).map(|()| None),
        }
    }

    /// A request one rule refused before any limit was consulted (its credentials, a
    /// malformed key): its answer, counted under that rule.
    fn refuse(&self, ctx: &mut RequestCtx<'_>, index: usize, refusal: Refusal) -> Response<Body> {
        let cfg = ctx.config();
        if let Some(c) = ctx.live.counters.get(index) {
            match refusal.status() {
                StatusCode::BAD_REQUEST => c.bad_key.inc(),
                _ => c.refused.inc(),
            };
        }
        ctx.disposed(Disposition::Refused(refusal));
        ctx.rule = cfg.rules.get(index).map(|r| r.name.as_str());
        problem(refused(refusal), cfg, &[], ctx.dialect)
    }

    /// The 404 of a request no route fits when no pool `default` takes the rest: never
    /// forwarded, counted (`ratewall_refusals_total{reason="no_route"}`) and logged.
    fn no_route(&self, ctx: &mut RequestCtx<'_>, parts: &Parts) -> Response<Body> {
        tracing::debug!(method = %parts.method, path = parts.uri.path(), "no route matches the request");
        ctx.disposed(Disposition::NoRoute);
        let p = Problem::new(StatusCode::NOT_FOUND, "no route matches this request");
        problem(p, ctx.config(), &[], ctx.dialect)
    }

    /// A denied request's 429, and the counts it adds.
    fn deny<'l>(
        &self,
        ctx: &mut RequestCtx<'l>,
        requester: &Requester<'_>,
        limits: &[Limit<'l, '_>],
        decisions: &[Option<Decision>],
        by: usize,
        jitter_us: u64,
    ) -> Response<Body> {
        let live = ctx.live;
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
        ctx.disposed(Disposition::Denied)
            .by(Some(limit.rule.name.as_str()), Some(limit.identity.digest));
        ctx.shadow_denied = shadow_denied;
        let p = Problem::too_many_requests(&applied, crate::random::up_to(jitter_us));
        let waits_ms = p.retry_after_ms.unwrap_or(0);
        self.metrics
            .gateway
            .dashboards
            .denied(live, limits, decisions, by, waits_ms);
        let mut resp = problem(p, cfg, &applied, ctx.dialect);
        headers::add_shadow(resp.headers_mut(), cfg.response, &shadow);
        resp
    }

    /// An admitted request's decisions, and the counts they add.
    fn pass<'l>(
        &self,
        ctx: &mut RequestCtx<'l>,
        limits: Vec<Limit<'l, '_>>,
        decisions: &[Option<Decision>],
        verdict: Verdict,
        leases: Option<Leases>,
        local: bool,
    ) {
        let live = ctx.live;
        ctx.shadow_denied = tally(live, &limits, decisions, false);
        self.metrics
            .gateway
            .dashboards
            .admitted(live, &limits, decisions);
        (ctx.applied, ctx.shadow) = split(&limits, decisions);
        ctx.settling = self.reserve(live, &limits, decisions, local);
        let ruled: Vec<Ruled> = limits.iter().map(Limit::ruled).collect();
        let closest = verdict::closest(&ruled, decisions).map(|k| &limits[k]);
        ctx.disposed(verdict.disposition()).by(
            closest.map(|l| l.rule.name.as_str()),
            closest.map(|l| l.identity.digest),
        );
        if let Verdict::Delay(us) = verdict {
            ctx.waited = Duration::from_micros(us);
        }
        ctx.messages = limits
            .iter()
            .filter(|l| l.enforced && (l.rule.messages.is_some() || l.rule.bytes.is_some()))
            .map(|l| (l.index, l.identity.digest, l.quota.max_delay_us))
            .collect();
        // Waiting on a rule holds its place in that rule's queue; the others are free.
        ctx.slots = limits
            .into_iter()
            .zip(decisions)
            .filter(|(_, d)| d.is_some_and(|d| d.allowed && d.retry_after_us > 0))
            .filter_map(|(l, _)| l.slot)
            .collect();
        ctx.leases = leases;
    }
}

/// The store failed: forward unlimited or answer 503, as `on_error` said.
// The answer is made once and returned at once: boxing it would cost an allocation.
#[allow(clippy::result_large_err)]
fn store_failed<'l>(
    ctx: &mut RequestCtx<'l>,
    limits: &[Limit<'l, '_>],
    verdict: Verdict,
) -> Result<(), Response<Body>> {
    for l in limits {
        ctx.live.counters[l.index].error.inc();
    }
    ctx.disposed(verdict.disposition()).by(
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
    Err(problem(
        p.with_retry_after(1),
        ctx.config(),
        &[],
        ctx.dialect,
    ))
}

/// The rules decided first that charged a request another then refused: each counts it
/// (`refused_by_other`).
fn refused_by_other(live: &Live, first: Option<&First<'_, '_>>) {
    let Some(first) = first else { return };
    for (l, d) in first.limits.iter().zip(&first.decisions) {
        if d.is_some_and(|d| d.allowed) {
            if let Some(c) = live.counters.get(l.index) {
                c.refused_by_other.inc();
            }
        }
    }
}

/// The verdict on `limits` decided as `decisions` (each rule's own, however many calls
/// decided them).
fn judge(live: &Live, limits: &[Limit<'_, '_>], decisions: &[Option<Decision>]) -> Verdict {
    let ruled: Vec<_> = limits.iter().map(Limit::ruled).collect();
    verdict::judge(&ruled, Some(decisions), live.config.store.on_error)
}

/// The rules decided first and the others, as one request's: in the config's order.
fn merge<'l, 'p>(
    first: First<'l, 'p>,
    limits: Vec<Limit<'l, 'p>>,
    decisions: Vec<Option<Decision>>,
) -> (Vec<Limit<'l, 'p>>, Vec<Option<Decision>>) {
    let mut all: Vec<(Limit<'l, 'p>, Option<Decision>)> = first
        .limits
        .into_iter()
        .zip(first.decisions)
        .chain(limits.into_iter().zip(decisions))
        .collect();
    all.sort_by_key(|(l, _)| l.index);
    all.into_iter().unzip()
}

/// Give back what the rules decided first charged (best effort: a refund that fails
/// leaves the charge, which can only make a limit stricter).
async fn give_back(live: &Live, first: &First<'_, '_>) {
    let items: Vec<Settlement<'_>> = first
        .limits
        .iter()
        .zip(&first.decisions)
        .filter_map(|(l, d)| {
            let d = d.as_ref().filter(|d| d.allowed)?;
            Some(Settlement {
                check: l.check(),
                adjust: Adjust::refund(l.quota.cost, d),
            })
        })
        .collect();
    if !items.is_empty() {
        let _ = live.limiter.settle(&items, first.local).await;
    }
}
