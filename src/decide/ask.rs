//! The store asked about every rule of a request at once, and its answer judged: each
//! rule's share counted, the verdict, the leases a request let through now holds.

use super::limits::Limit;
use super::verdict::{self, Ruled, Verdict};
use crate::limiter::breaker::{Now, StoreAnswer};
use crate::limiter::lease::Leases;
use crate::limiter::{Check, Decision};
use crate::runtime::requests::DecisionLabel;
use crate::runtime::{Counted, Counts, Live};
use crate::telemetry::Disposition;

impl<'l> Limit<'l, '_> {
    pub(super) fn ruled(&self) -> Ruled {
        Ruled {
            enforced: self.enforced,
            jitter_us: self.rule.retry_jitter_us,
        }
    }

    /// Its part in the decision's counts: `decision`, and its `share` counted now.
    pub(super) fn counted(
        &self,
        decision: Option<Decision>,
        share: Option<DecisionLabel>,
    ) -> Counted<'l> {
        Counted {
            index: self.index,
            enforced: self.enforced,
            quota: self.quota,
            digest: self.identity.digest,
            plan: self.plan,
            decision,
            share,
        }
    }
}

/// Ask the store about every limit at once, and judge its answer: the decisions (none if
/// the store failed), the verdict, and the concurrency slots the request now holds.
/// `dry`: what the store would answer, charging nothing and holding no slot (the
/// decision API's `dry_run`).
pub(super) async fn consult(
    live: &Live,
    limits: &[Limit<'_, '_>],
    dry: bool,
) -> (Option<Vec<Option<Decision>>>, Verdict, Option<Leases>, bool) {
    let checks: Vec<Check<'_>> = limits.iter().map(Limit::check).collect();
    if dry {
        let decisions = match live.limiter.peek(&checks).await {
            Ok(d) => Some(d.into_iter().map(Some).collect::<Vec<_>>()),
            Err(_) => None,
        };
        let ruled = |k: usize| limits.get(k).map(Limit::ruled);
        let v = verdict::judge(ruled, decisions.as_deref(), live.config.store.on_error);
        return (decisions, v, None, false);
    }
    let answer = match live.limiter.decide_now(&checks, live.cache_denials) {
        Now::Answered(answer) => answer,
        Now::Ask(asking) => live.limiter.ask(&checks, live.cache_denials, asking).await,
    };
    let local = matches!(answer, StoreAnswer::Local(_));
    let decisions = verdict::decisions(answer);
    let ruled = |k: usize| limits.get(k).map(Limit::ruled);
    let v = verdict::judge(ruled, decisions.as_deref(), live.config.store.on_error);
    let leases = match (&decisions, v) {
        // A call that timed out may still have run: take back any lease it could have
        // written (a no-op where it did not).
        (None, _) => {
            Leases::abandon(&live.limiter, &checks);
            None
        }
        // Every enforcing concurrency check of a request let through took its slot, and
        // the watching ones that allowed (charged as if enforced).
        (Some(d), Verdict::Forward | Verdict::Delay(_)) => {
            Leases::taken(&live.limiter, local, &checks, |k| {
                d[k].is_some_and(|d| d.allowed)
            })
        }
        _ => None,
    };
    (decisions, v, leases, local)
}

/// Each rule's part in the request, into `counts`, with its share counted now
/// (`denied`: another rule, or this one, denied it); the first watching rule that would
/// have denied. The passes (allowed, delayed) count once the upstream has answered (the
/// proxy's `RequestCtx::count_passed`).
pub(super) fn tally<'l>(
    counts: &mut Counts<'l>,
    limits: &[Limit<'l, '_>],
    decisions: &[Option<Decision>],
    denied: bool,
) -> Option<&'l str> {
    let mut shadow_denied = None;
    counts.rules.reserve(limits.len());
    for (l, &d) in limits.iter().zip(decisions) {
        let share = d.and_then(|d| match verdict::share(l.enforced, &d, denied) {
            Disposition::DeniedByOther => Some(DecisionLabel::DeniedByOther),
            Disposition::Denied => Some(DecisionLabel::Denied),
            Disposition::ShadowDenied => {
                shadow_denied.get_or_insert(l.rule.name.as_str());
                Some(DecisionLabel::ShadowDenied)
            }
            _ => None,
        });
        counts.rules.push(l.counted(d, share));
    }
    shadow_denied
}
