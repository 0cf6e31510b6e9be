//! The rules that apply to a request, each as one value built once: the rule, who the
//! request is under it, the quota its plan gives, whether it enforces for this identity,
//! its place among the requests waiting on it, its concurrency lease.

use super::route::Destination;
use super::Subject;
use crate::headers::Applied;
use crate::identity::{Identity, Refusal, Requester};
use crate::limiter::{Algorithm, Check, Decision, Quota};
use crate::rules::{self, Applies, Rule};
use crate::runtime::{Live, WaitSlot};
use crate::settle::max_tokens::{Asked, Unreadable};

/// A request one rule refused before any limit was consulted: the rule's position in
/// the config, and why.
#[derive(Debug, Clone, Copy)]
pub struct Refused {
    pub index: usize,
    pub refusal: Refusal,
}

/// One rule applied to one request.
pub struct Limit<'l, 'p> {
    /// The rule's position in the config (its counters and waiting queue share it).
    pub index: usize,
    pub rule: &'l Rule,
    pub identity: Identity<'p>,
    /// The rule's quota for the request's plan. A rule that may delay but whose waiting
    /// queue is full decides without waiting (`max_delay_us` 0).
    pub quota: Quota,
    /// The plan whose quota applies, as the rule's `[rules.plans.<name>]` names it; none
    /// for the rule's own quota (no plan, or one the rule does not define: a client's
    /// claim or key never names anything here the config does not).
    pub plan: Option<&'l str>,
    /// Whether the rule denies for this identity; if not, it only watches (shadow mode,
    /// or an identity outside `enforce_percent`). A watching check keeps its `max_delay`:
    /// it takes tokens ahead exactly as enforcement would, but nobody waits on it.
    pub enforced: bool,
    /// Held while the request may wait on the tokens it took ahead under this rule.
    pub slot: Option<WaitSlot<'l>>,
    /// Concurrency only: the request's lease number (0 otherwise).
    pub lease: u64,
}

impl<'l: 'p, 'p> Limit<'l, 'p> {
    /// The rules of `live` that apply to the request, in config order, as `requester` is
    /// counted by each; or why it is refused before any is consulted. A rule applies when
    /// its path, method, host and route fit (`fitting`: the request's [`matching`], found
    /// once per request and shared with its overload priority) and then
    /// [`Rule::applies`] says so: what the request carries, its plan. `asked`: what the
    /// request's body asks the model for, read where a rule that fits says `reserve =
    /// "max_tokens"`; such a rule reserves it (at most a burst), or its `default_reserve`.
    /// `cost`: what a caller of the decision service asks to be charged, in place of each
    /// rule's own cost.
    pub fn all(
        live: &'l Live,
        fitting: &[usize],
        requester: &Requester<'p>,
        asked: Option<&Asked>,
        cost: Option<std::num::NonZeroU64>,
    ) -> Result<Vec<Limit<'l, 'p>>, Refused> {
        let cfg = &*live.config;
        fitting
            .iter()
            .copied()
            .filter_map(|index| {
                let rule = &cfg.rules[index];
                let limit = match rule.applies(requester) {
                    Ok(Applies::Limits(quota)) => {
                        let reserved = rule.settle.as_ref().and_then(|p| p.reservation(asked));
                        let quota = match (cost, reserved) {
                            (Some(c), _) => Quota {
                                cost: c.get(),
                                ..*quota
                            },
                            (None, Some(t)) => quota.with_cost(t),
                            (None, None) => *quota,
                        };
                        Self::new(live, index, quota, requester)
                    }
                    Ok(Applies::Unmet(_) | Applies::Exempt) => return None,
                    Err(refusal) => Err(refusal),
                };
                Some(limit.map_err(|refusal| Refused { index, refusal }))
            })
            .collect()
    }

    /// `rule` `index` of `live`, limiting the request with `quota`.
    fn new(
        live: &'l Live,
        index: usize,
        mut quota: Quota,
        requester: &Requester<'p>,
    ) -> Result<Limit<'l, 'p>, Refusal> {
        let rule = &live.config.rules[index];
        let identity = requester.identify(&rule.key)?;
        let enforced = rule.enforces(&identity.digest);
        let plan = (!rule.plans.is_empty())
            .then(|| requester.plan())
            .flatten()
            .and_then(|p| rule.plans.get_key_value(p))
            .map(|(name, _)| name.as_str());
        let mut slot = None;
        if quota.max_delay_us > 0 && enforced {
            slot = WaitSlot::take(&live.waiting[index], rule.max_waiting);
            if slot.is_none() {
                quota.max_delay_us = 0;
            }
        }
        let lease = match quota.algorithm {
            Algorithm::Concurrency => live.limiter.next_lease(),
            _ => 0,
        };
        Ok(Limit {
            index,
            rule,
            identity,
            quota,
            plan,
            enforced,
            slot,
            lease,
        })
    }

    /// What the store needs to decide it.
    pub fn check(&self) -> Check<'_> {
        Check {
            identity: &self.identity.digest,
            rule: &self.rule.name,
            quota: &self.quota,
            shadow: !self.enforced,
            lease: self.lease,
        }
    }
}

/// Whether a rule that may apply to the request reserves what its body asks for
/// (`reserve = "max_tokens"`): only then is its body read. Decided before the request's
/// route is (routes can need its identity, which is found after the body is read), so
/// a rule's route condition is not looked at: a rule that fits the path, method and host
/// reads the body, whatever its route; a request naming no host, for any such rule.
pub fn may_read_body(live: &Live, subject: &Subject<'_>) -> bool {
    if !live.reserves_max_tokens {
        return false;
    }
    let cfg = &*live.config;
    let Some(host) = rules::request_host(subject.uri, subject.headers) else {
        return true;
    };
    let host = cfg.index.uses_host.then_some(host);
    let path = cfg.index.path_of(subject.uri.path());
    cfg.index
        .matching(subject.method, &path, host)
        .into_iter()
        .any(|i| {
            cfg.rules[i]
                .settle
                .as_ref()
                .is_some_and(|p| p.max_tokens.is_some())
        })
}

/// The first rule that applies to the request and refuses a body that says no usable
/// `max_tokens` (`on_unreadable = "reject"`), with why, where `asked` is such a body.
pub fn refuses_body(
    live: &Live,
    fitting: &[usize],
    requester: &Requester<'_>,
    asked: Option<&Asked>,
) -> Option<(usize, Unreadable)> {
    let Some(Asked::Unreadable(why)) = asked else {
        return None;
    };
    fitting.iter().copied().find_map(|i| {
        let rule = &live.config.rules[i];
        let rejects = rule
            .settle
            .as_ref()
            .and_then(|p| p.max_tokens)
            .is_some_and(|m| m.reject);
        let applies = matches!(rule.applies(requester), Ok(Applies::Limits(_)));
        (rejects && applies).then_some((i, *why))
    })
}

/// The positions of the rules that apply to a request sent by the route `route`, in
/// config order: by its method, its path as a backend will route it, its host (parsed
/// only when a rule looks), and the route (a rule with `match = { route = … }` applies
/// only to that route's requests).
pub fn matching(
    cfg: &crate::config::Config,
    subject: &Subject<'_>,
    to: Option<&Destination>,
) -> Vec<usize> {
    let path = cfg.index.path_of(subject.uri.path());
    let host = if cfg.index.uses_host {
        forwarded_host(cfg, subject, to)
    } else {
        None
    };
    let mut fitting = cfg.index.matching(subject.method, &path, host);
    let route = to.and_then(|t| t.route);
    fitting.retain(|&i| cfg.rules[i].matcher.fits_route(route));
    fitting
}

/// The host a request is forwarded with, as rules match it: its own
/// ([`rules::request_host`]), or, for a request that names none (HTTP/1.0 may), its
/// pool's first server's, which the upstream hop then sends as its `Host` — so a `host`
/// rule for the backend's default vhost applies to what that vhost serves.
pub fn forwarded_host<'a>(
    cfg: &'a crate::config::Config,
    subject: &Subject<'a>,
    to: Option<&Destination>,
) -> Option<&'a str> {
    rules::request_host(subject.uri, subject.headers).or_else(|| {
        let pool = cfg.upstreams.get(to?.pool)?;
        pool.servers.first()?.url.host()
    })
}

/// The rules with a decision, as the headers show them: the enforcing ones, and apart,
/// the watching ones.
pub fn split<'l>(
    limits: &[Limit<'l, '_>],
    decisions: &[Option<Decision>],
) -> (Vec<Applied<'l>>, Vec<Applied<'l>>) {
    let mut applied = Vec::with_capacity(limits.len());
    let mut shadow = Vec::new();
    for (l, d) in limits.iter().zip(decisions) {
        let Some(decision) = *d else { continue };
        let a = Applied {
            rule: l.rule.name.as_str(),
            index: l.index,
            quota: l.quota,
            decision,
        };
        if l.enforced {
            applied.push(a);
        } else {
            shadow.push(a);
        }
    }
    (applied, shadow)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_with_a_route_condition_fits_that_routes_requests_only() {
        let cfg = crate::config::Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n\
             [[routes]]\nname = \"x\"\nmatch = { path_prefix = \"/x/\" }\nupstream = \"default\"\n\
             [[routes]]\nname = \"billing\"\nupstream = \"default\"\n\
             [[rules]]\nname = \"b\"\nkey = \"global\"\nrate = \"1/s\"\nmatch = { route = \"billing\" }\n\
             [[rules]]\nname = \"all\"\nkey = \"global\"\nrate = \"1/s\"\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let (parts, _) = http::Request::get("/billing/pay")
            .body(())
            .unwrap()
            .into_parts();
        let p = Subject {
            method: &parts.method,
            uri: &parts.uri,
            headers: &parts.headers,
            peer: std::net::Ipv4Addr::LOCALHOST.into(),
            client_cert: None,
        };
        let to = |route| Destination {
            route,
            pool: 0,
            hash: None,
        };
        assert_eq!(matching(&cfg, &p, Some(&to(Some(1)))), [0, 1]);
        assert_eq!(matching(&cfg, &p, Some(&to(Some(0)))), [1]);
        assert_eq!(matching(&cfg, &p, Some(&to(None))), [1]);
        assert_eq!(matching(&cfg, &p, None), [1]);
    }
}
