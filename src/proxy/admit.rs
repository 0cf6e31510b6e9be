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

use http::request::Parts;

use super::limits::{self, Limit, Refused};
use super::live::Live;
use super::route::{self, Destination};
use super::{
    consult, overload, problem, refused, store_failed, tokens, Admission, Dialect, Gateway, Note,
    Pass, Verdict,
};
use crate::identity::{KeyKind, Refusal, Requester};
use crate::limiter::store::Settlement;
use crate::limiter::{Adjust, Algorithm, Decision};
use crate::rules::Rule;

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
    /// [`Gateway::admit_as`](super::Gateway), for the request as `requester` reads it;
    /// `asked`: what its body asks the model for, where it was read.
    pub(super) async fn admit_by<'l: 'p, 'p>(
        &self,
        live: &'l Live,
        parts: &Parts,
        dialect: Dialect,
        requester: &Requester<'p>,
        asked: Option<tokens::Asked>,
    ) -> Admission<'l> {
        let cfg = &*live.config;
        let to = match route::choose(cfg, parts, requester) {
            Ok(Some(to)) => to,
            Ok(None) => return self.no_route(cfg, parts, dialect),
            Err(refusal) => {
                self.metrics.gateway.count_refusal(refusal.into());
                let note = Note::gateway(refusal_decision(refusal));
                return Admission::Answer(problem(refused(refusal), cfg, &[], dialect), note);
            }
        };
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
            first = match self
                .first(live, &free, requester, asked, &to, dialect)
                .await
            {
                Ok(first) => first,
                Err(answer) => return answer,
            };
        }
        if let Some(refused) = self.refuse_body(live, &rest, requester, asked, &to, dialect) {
            refused_by_other(live, first.as_ref());
            return refused;
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
                    first = match self
                        .first(live, &free, requester, asked, &to, dialect)
                        .await
                    {
                        Ok(first) => first,
                        Err(answer) => return answer,
                    };
                }
                refused_by_other(live, first.as_ref());
                return self.refuse(live, index, refusal, &to, dialect);
            }
        };
        let (limits, decisions, verdict, leases, local) = match (first, limits.is_empty()) {
            (None, true) => {
                let note = Note::gateway("unlimited").to(&to, cfg);
                let pass = Pass::unlimited(note, to, dialect);
                return Admission::Forward(self.forwarded(live, requester, pass, &fitting));
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
                    return store_failed(live, &limits, verdict, to, dialect);
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
                self.deny(live, requester, &limits, &d, by, jitter_us, &to, dialect)
            }
            (Verdict::Forward | Verdict::Delay(_), Some(d)) => {
                let pass = self.pass(live, limits, &d, verdict, leases, local, to);
                let pass = Pass { dialect, ..pass };
                Admission::Forward(self.forwarded(live, requester, pass, &fitting))
            }
            (v, _) => store_failed(live, &limits, v, to, dialect),
        }
    }

    /// A pass, with what is found only for a request let through: its pool's balancing
    /// hash, its overload priority, the claims its backend gets (each may verify a token
    /// no rule asked for; never before the rules were charged).
    fn forwarded<'l: 'p, 'p>(
        &self,
        live: &'l Live,
        requester: &Requester<'p>,
        pass: Pass<'l>,
        fitting: &[usize],
    ) -> Pass<'l> {
        let cfg = &*live.config;
        let to = pass.to.hashed(cfg, requester);
        Pass {
            priority: overload::priority(live, fitting, requester, &to),
            claims: requester.forwarded_claims(),
            to,
            ..pass
        }
    }

    /// Decide the rules `free` (each [`credential_free`]) on their own: what they said,
    /// to go on with (none where there are none, or the store failed and `on_error`
    /// forwards); or the request's answer, their 429 where one denies (or the store's
    /// 503).
    async fn first<'l: 'p, 'p>(
        &self,
        live: &'l Live,
        free: &[usize],
        requester: &Requester<'p>,
        asked: Option<&tokens::Asked>,
        to: &Destination,
        dialect: Dialect,
    ) -> Result<Option<First<'l, 'p>>, Admission<'l>> {
        if free.is_empty() {
            return Ok(None);
        }
        // A rule that refuses on its own (a header it counts by is missing) is left to
        // the whole request's decision, which refuses it.
        let Ok(limits) = Limit::all(live, free, requester, asked) else {
            return Ok(None);
        };
        if limits.is_empty() {
            return Ok(None);
        }
        let (decisions, verdict, _, local) = consult(live, &limits).await;
        match (verdict, decisions) {
            (Verdict::Deny { by, jitter_us }, Some(d)) => {
                Err(self.deny(live, requester, &limits, &d, by, jitter_us, to, dialect))
            }
            (Verdict::Forward | Verdict::Delay(_), Some(decisions)) => Ok(Some(First {
                limits,
                decisions,
                local,
            })),
            (Verdict::Unlimited, _) => Ok(None),
            (v, _) => Err(store_failed(live, &limits, v, *to, dialect)),
        }
    }

    /// A request one rule refused before any limit was consulted (its credentials, a
    /// malformed key): its answer, counted under that rule.
    fn refuse<'l>(
        &self,
        live: &'l Live,
        index: usize,
        refusal: Refusal,
        to: &Destination,
        dialect: Dialect,
    ) -> Admission<'l> {
        let cfg = &*live.config;
        if let Some(c) = live.counters.get(index) {
            match refusal.status() {
                http::StatusCode::BAD_REQUEST => c.bad_key.inc(),
                _ => c.refused.inc(),
            };
        }
        self.metrics.gateway.count_refusal(refusal.into());
        let resp = problem(refused(refusal), cfg, &[], dialect);
        let note = Note {
            rule: cfg.rules.get(index).map(|r| r.name.as_str()),
            ..Note::gateway(refusal_decision(refusal)).to(to, cfg)
        };
        Admission::Answer(resp, note)
    }
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

/// The access log's `decision` of a refusal.
fn refusal_decision(refusal: Refusal) -> &'static str {
    Verdict::Refuse(refusal).decision()
}

/// The verdict on `limits` decided as `decisions` (each rule's own, however many calls
/// decided them).
fn judge(live: &Live, limits: &[Limit<'_, '_>], decisions: &[Option<Decision>]) -> Verdict {
    let ruled: Vec<_> = limits.iter().map(Limit::ruled).collect();
    super::verdict::judge(&ruled, Some(decisions), live.config.store.on_error)
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
