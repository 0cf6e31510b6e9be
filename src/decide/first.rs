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

use super::ask::consult;
use super::limits::Limit;
use super::verdict::{self, Verdict};
use super::{store_failed, Rejection};
use crate::identity::{KeyKind, Requester};
use crate::limiter::store::Settlement;
use crate::limiter::{Adjust, Algorithm, Decision};
use crate::rules::Rule;
use crate::runtime::requests::DecisionLabel;
use crate::runtime::Live;
use crate::settle::max_tokens::Asked;

/// Whether `rule` can be decided without the request's credentials: it counts by the
/// client IP, a header, everyone or the TLS client certificate (alone or combined), has
/// no plans (a plan comes from a token or a key), asks nothing of an API key in its
/// `match`, and limits no concurrency (a lease is taken with the others).
pub(super) fn credential_free(rule: &Rule) -> bool {
    fn free(kind: &KeyKind) -> bool {
        match kind {
            KeyKind::ClientIp
            | KeyKind::Global
            | KeyKind::Header(_)
            | KeyKind::ClientCert
            | KeyKind::Target
            | KeyKind::Credential(_)
            | KeyKind::Caller => true,
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
pub(super) fn needs_token(cfg: &crate::config::Config, rule: &Rule) -> bool {
    let plan_claim = cfg
        .jwt
        .as_ref()
        .is_some_and(|j| j.verifier.settings.plan_claim.is_some());
    rule.key.kind.uses_jwt() || (plan_claim && !rule.plans.is_empty())
}

/// Rules decided before the others, and what they said.
pub(super) struct First<'l, 'p> {
    pub(super) limits: Vec<Limit<'l, 'p>>,
    pub(super) decisions: Vec<Option<Decision>>,
    pub(super) local: bool,
}

/// Decide the rules `free` (each [`credential_free`]) on their own: what they said,
/// to go on with (none where there are none, or the store failed and `on_error`
/// forwards); or the request's answer, their 429 where one denies (or the store's
/// 503).
pub(super) async fn decide<'l: 'p, 'p>(
    live: &'l Live,
    free: &[usize],
    requester: &Requester<'p>,
    asked: Option<&Asked>,
    d: &mut super::Decided<'l>,
) -> Result<Option<First<'l, 'p>>, Rejection> {
    if free.is_empty() {
        return Ok(None);
    }
    // A rule that refuses on its own (a header it counts by is missing) is left to
    // the whole request's decision, which refuses it.
    let Ok(limits) = Limit::all(live, free, requester, asked, d.cost) else {
        return Ok(None);
    };
    if limits.is_empty() {
        return Ok(None);
    }
    let (decisions, verdict, _, local) = consult(live, &limits, d.dry_run).await;
    match (verdict, decisions) {
        (Verdict::Deny { by, jitter_us }, Some(decisions)) => {
            Err(super::deny(&limits, &decisions, by, jitter_us, d))
        }
        (Verdict::Forward | Verdict::Delay(_), Some(decisions)) => Ok(Some(First {
            limits,
            decisions,
            local,
        })),
        (Verdict::Unlimited, _) => Ok(None),
        (v, _) => store_failed(&limits, v, d).map(|()| None),
    }
}

/// The rules decided first that charged a request another then refused: each counts it
/// (`refused_by_other`).
pub(super) fn refused_by_other<'l>(first: Option<&First<'l, '_>>, d: &mut super::Decided<'l>) {
    let Some(first) = first else { return };
    let charged = first.limits.iter().zip(&first.decisions);
    let charged = charged.filter(|(_, decision)| decision.is_some_and(|c| c.allowed));
    let counted =
        charged.map(|(l, &decision)| l.counted(decision, Some(DecisionLabel::RefusedByOther)));
    d.counts.rules.extend(counted);
}

/// The verdict on `limits` decided as `decisions` (each rule's own, however many calls
/// decided them).
pub(super) fn judge(
    live: &Live,
    limits: &[Limit<'_, '_>],
    decisions: &[Option<Decision>],
) -> Verdict {
    let ruled = |k: usize| limits.get(k).map(Limit::ruled);
    verdict::judge(ruled, Some(decisions), live.config.store.on_error)
}

/// The rules decided first and the others, as one request's: in the config's order.
pub(super) fn merge<'l, 'p>(
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
pub(super) async fn give_back(live: &Live, first: &First<'_, '_>) {
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
