//! The store's answers -> one outcome for the request. Pure: what to do with a request
//! is decided here from the rules' decisions and the store policy, and tested without a
//! store, a clock or a socket; the request path only carries it out.

use crate::identity::Refusal;
use crate::limiter::breaker::StoreAnswer;
use crate::limiter::{Decision, OnError};
use crate::telemetry::disposition::Disposition;

/// What happens to a request whose rules were all consulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every enforcing rule allows: forward now.
    Forward,
    /// Every enforcing rule allows, once the request has waited this many µs for the
    /// tokens it took ahead (`max_delay`): the longest wait among the rules.
    Delay(u64),
    /// The enforcing rule at this position (among the request's rules) denies: 429. The
    /// first such rule speaks for the request; `jitter_us` is the largest `retry_jitter`
    /// of the denying rules (drawn from when the answer is written).
    Deny { by: usize, jitter_us: u64 },
    /// The store failed, and `on_error = "allow"`: forward without limits.
    Unlimited,
    /// The store failed, and `on_error` is `deny` (or `local`, whose own store failed
    /// too): 503.
    Unavailable,
    /// Refused before any rule was consulted: the request does not say who it is as its
    /// rules need (401), or says it malformed (400).
    Refuse(Refusal),
}

impl Verdict {
    /// How a request this verdict answers was disposed of.
    pub fn disposition(self) -> Disposition {
        match self {
            Verdict::Forward => Disposition::Allowed,
            Verdict::Delay(_) => Disposition::Delayed,
            Verdict::Deny { .. } => Disposition::Denied,
            Verdict::Unlimited => Disposition::StoreBypassed,
            Verdict::Unavailable => Disposition::StoreUnavailable,
            Verdict::Refuse(r) => Disposition::Refused(r),
        }
    }
}

/// One rule's share of a request it decided `d` (`ratewall_requests_total{decision}`):
/// `enforced`, whether the rule enforces for this request; `denied`, whether the request
/// as a whole was denied. A watching rule that would have made the request wait counts
/// as delayed, not denied; one that let a denied request through, as denied by another.
pub fn share(enforced: bool, d: &Decision, denied: bool) -> Disposition {
    match (enforced, d.allowed, d.retry_after_us > 0) {
        (_, true, _) if denied => Disposition::DeniedByOther,
        (_, true, true) => Disposition::Delayed,
        (_, true, false) => Disposition::Allowed,
        (true, false, _) => Disposition::Denied,
        (false, false, _) => Disposition::ShadowDenied,
    }
}

/// One rule of the request, as the verdict needs it.
#[derive(Debug, Clone, Copy)]
pub struct Ruled {
    pub enforced: bool,
    /// Its `retry_jitter`, in µs.
    pub jitter_us: u64,
}

// What lets [`decisions`] collect in place.
const _: () = assert!(std::mem::size_of::<Option<Decision>>() == std::mem::size_of::<Decision>());

/// The decisions of an answer, one per rule in order (`None`: not known, from the deny
/// cache), or `None` if the store failed.
pub fn decisions(answer: StoreAnswer) -> Option<Vec<Option<Decision>>> {
    match answer {
        // Collected in place: an `Option<Decision>` is a `Decision` (its `bool` has room
        // for the `None`), so no second list is allocated.
        StoreAnswer::Store(d) | StoreAnswer::Local(d) => Some(d.into_iter().map(Some).collect()),
        StoreAnswer::Cached(d) => Some(d),
        StoreAnswer::Failed(_) => None,
    }
}

/// What to do with a request given its rules and their decisions (`None`: the store
/// failed, and `on_error` decides). `rule` reads the rule at each position (the request's
/// rules as they are, not copied into a list first).
pub fn judge(
    rule: impl Fn(usize) -> Option<Ruled>,
    decisions: Option<&[Option<Decision>]>,
    on_error: OnError,
) -> Verdict {
    let Some(decisions) = decisions else {
        return match on_error {
            OnError::Allow => Verdict::Unlimited,
            OnError::Deny | OnError::Local => Verdict::Unavailable,
        };
    };
    let enforcing = || {
        decisions
            .iter()
            .enumerate()
            .filter_map(|(k, d)| Some((k, rule(k)?, d.as_ref()?)))
            .filter(|(_, r, _)| r.enforced)
    };
    if let Some((by, _, _)) = enforcing().find(|(_, _, d)| !d.allowed) {
        let jitter_us = enforcing()
            .filter(|(_, _, d)| !d.allowed)
            .map(|(_, r, _)| r.jitter_us)
            .max()
            .unwrap_or(0);
        return Verdict::Deny { by, jitter_us };
    }
    match enforcing().map(|(_, _, d)| d.retry_after_us).max() {
        Some(wait) if wait > 0 => Verdict::Delay(wait),
        _ => Verdict::Forward,
    }
}

/// Of the enforcing rules with a decision, the one closest to denying (fewest left): it
/// speaks for an admitted request in the access log.
pub fn closest(
    rule: impl Fn(usize) -> Option<Ruled>,
    decisions: &[Option<Decision>],
) -> Option<usize> {
    decisions
        .iter()
        .enumerate()
        .filter(|&(k, _)| rule(k).is_some_and(|r| r.enforced))
        .filter_map(|(k, d)| Some((k, d.as_ref()?.remaining)))
        .min_by_key(|&(_, remaining)| remaining)
        .map(|(k, _)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`super::judge`] of rules in a list.
    fn judge(
        rules: &[Ruled],
        decisions: Option<&[Option<Decision>]>,
        on_error: OnError,
    ) -> Verdict {
        super::judge(|k| rules.get(k).copied(), decisions, on_error)
    }

    /// [`super::closest`] of rules in a list.
    fn closest(rules: &[Ruled], decisions: &[Option<Decision>]) -> Option<usize> {
        super::closest(|k| rules.get(k).copied(), decisions)
    }

    fn d(allowed: bool, remaining: u64, retry_after_us: u64) -> Option<Decision> {
        Some(Decision {
            allowed,
            remaining,
            retry_after_us,
            reset_us: 1_000_000,
            window: 0,
        })
    }

    const ENFORCED: Ruled = Ruled {
        enforced: true,
        jitter_us: 0,
    };
    const WATCHING: Ruled = Ruled {
        enforced: false,
        jitter_us: 0,
    };

    #[test]
    fn every_enforcing_rule_allowing_forwards() {
        let rules = [ENFORCED, ENFORCED];
        assert_eq!(
            judge(&rules, Some(&[d(true, 3, 0), d(true, 0, 0)]), OnError::Deny),
            Verdict::Forward
        );
    }

    #[test]
    fn the_first_denying_rule_speaks_and_the_largest_jitter_counts() {
        let rules = [
            ENFORCED,
            Ruled {
                enforced: true,
                jitter_us: 500,
            },
            Ruled {
                enforced: true,
                jitter_us: 900,
            },
        ];
        let v = judge(
            &rules,
            Some(&[d(true, 1, 0), d(false, 0, 10), d(false, 0, 20)]),
            OnError::Deny,
        );
        assert_eq!(
            v,
            Verdict::Deny {
                by: 1,
                jitter_us: 900
            }
        );
    }

    #[test]
    fn a_watching_rule_never_denies_nor_delays() {
        let rules = [WATCHING, ENFORCED];
        assert_eq!(
            judge(
                &rules,
                Some(&[d(false, 0, 5_000), d(true, 2, 0)]),
                OnError::Deny
            ),
            Verdict::Forward
        );
        assert_eq!(
            judge(
                &rules,
                Some(&[d(true, 0, 5_000), d(true, 2, 0)]),
                OnError::Deny
            ),
            Verdict::Forward
        );
        assert_eq!(
            share(false, &d(false, 0, 1).unwrap(), false),
            Disposition::ShadowDenied
        );
        assert_eq!(
            share(false, &d(true, 0, 1).unwrap(), false),
            Disposition::Delayed
        );
        // A request another rule denied is no rule's pass, enforced or watching; a
        // watching rule that would have denied it still says so.
        for enforced in [true, false] {
            for wait in [0, 1] {
                assert_eq!(
                    share(enforced, &d(true, 0, wait).unwrap(), true),
                    Disposition::DeniedByOther
                );
            }
        }
        assert_eq!(
            share(false, &d(false, 0, 1).unwrap(), true),
            Disposition::ShadowDenied
        );
        assert_eq!(
            share(true, &d(false, 0, 1).unwrap(), true),
            Disposition::Denied
        );
    }

    #[test]
    fn the_longest_wait_delays_the_request() {
        let rules = [ENFORCED, ENFORCED];
        assert_eq!(
            judge(
                &rules,
                Some(&[d(true, 0, 250), d(true, 0, 700)]),
                OnError::Deny
            ),
            Verdict::Delay(700)
        );
    }

    #[test]
    fn rules_the_deny_cache_does_not_know_do_not_count() {
        // A cached denial knows only the denying rules.
        let rules = [ENFORCED, ENFORCED];
        assert_eq!(
            judge(&rules, Some(&[None, d(false, 0, 9)]), OnError::Allow),
            Verdict::Deny {
                by: 1,
                jitter_us: 0
            }
        );
        assert_eq!(closest(&rules, &[None, d(true, 4, 0)]), Some(1));
    }

    #[test]
    fn a_failed_store_is_decided_by_on_error() {
        let rules = [ENFORCED];
        assert_eq!(judge(&rules, None, OnError::Allow), Verdict::Unlimited);
        assert_eq!(judge(&rules, None, OnError::Deny), Verdict::Unavailable);
        // `local` answers from its fallback; a verdict without decisions means that failed too.
        assert_eq!(judge(&rules, None, OnError::Local), Verdict::Unavailable);
    }

    #[test]
    fn the_closest_rule_is_the_enforcing_one_with_fewest_left() {
        let rules = [ENFORCED, WATCHING, ENFORCED];
        assert_eq!(
            closest(&rules, &[d(true, 5, 0), d(true, 0, 0), d(true, 2, 0)]),
            Some(2)
        );
        assert_eq!(closest(&[WATCHING], &[d(true, 0, 0)]), None);
    }
}
