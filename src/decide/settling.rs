//! A request's settlement held at its decision (issue 27): the charges of its rules that
//! settle once its answer is known, taken from its decisions ([`held`]); and the refusal
//! of a body a rule that reserves `max_tokens` cannot read ([`refuse_body`]).

use std::sync::Arc;

use super::limits::Limit;
use super::{Decided, Rejection};
use crate::headers::Problem;
use crate::identity::Requester;
use crate::limiter::{Algorithm, Decision};
use crate::runtime::requests::DecisionLabel;
use crate::runtime::Live;
use crate::settle::max_tokens::{Asked, Unreadable};
use crate::settle::reservation::{Reservation, Reserved};
use crate::settle::{Held, Settling, Shown};
use crate::telemetry::Disposition;

/// The answer to a request whose body says no usable `max_tokens` where a rule it
/// meets refuses such bodies (`on_unreadable = "reject"`): 400, 411 or 413, counted
/// and logged under that rule; `None` where none does.
pub(super) fn refuse_body<'l>(
    live: &'l Live,
    fitting: &[usize],
    requester: &Requester<'_>,
    asked: Option<&Asked>,
    d: &mut Decided<'l>,
) -> Option<Rejection> {
    let (index, why) = super::limits::refuses_body(live, fitting, requester, asked)?;
    d.counts.refused = Some((index, DecisionLabel::Refused));
    d.disposed(Disposition::UnreadableBody);
    d.rule = live.config.rules.get(index).map(|r| r.name.as_str());
    Some(Rejection {
        problem: unreadable(why),
        shows_limits: false,
        // The rest of an overlong body was never read.
        close: why == Unreadable::TooLarge,
    })
}

/// The charges of an admitted request's rules that settle once its answer is known:
/// every rule with a settlement policy whose check was charged (allowed), each shown
/// where [`split`] puts its decision. `None` when no rule settles (the common case:
/// nothing is allocated).
pub(super) fn held(
    live: &Live,
    limits: &[Limit<'_, '_>],
    decisions: &[Option<Decision>],
    local: bool,
) -> Option<Settling> {
    if !live.settles {
        return None;
    }
    let (mut applied, mut shadow) = (0, 0);
    let mut items = Vec::new();
    let mut held = Vec::new();
    for (l, d) in limits.iter().zip(decisions) {
        let Some(d) = d else { continue };
        let shown = if l.enforced {
            applied += 1;
            Shown::Applied(applied - 1)
        } else {
            shadow += 1;
            Shown::Shadow(shadow - 1)
        };
        let Some(policy) = &l.rule.settle else {
            continue;
        };
        if !d.allowed || l.quota.algorithm == Algorithm::Concurrency {
            continue;
        }
        items.push(Reserved {
            identity: l.identity.digest,
            rule: Arc::from(l.rule.name.as_str()),
            quota: l.quota,
            shadow: !l.enforced,
            window: d.window,
        });
        held.push(Held::new(policy.clone(), shown));
    }
    if items.is_empty() {
        return None;
    }
    let reservation = Reservation::new(live.limiter.clone(), local, items);
    Some(Settling::new(
        reservation,
        held,
        live.settle_metrics.clone(),
    ))
}

/// The answer of a rule that refuses a request whose body says no usable `max_tokens`
/// (`on_unreadable = "reject"`).
pub fn unreadable(why: Unreadable) -> Problem {
    Problem::new(why.status(), why.detail())
}
