//! The metrics the dashboards ask for, per rule: denials by rule and plan, the retry delay
//! the 429s gave (a histogram, so that the p95 time to reset can be graphed), admitted
//! requests near their limit, and the good-client SLO — requests from identities within
//! their plan, served or limited ([`super::demand`] says who is within).
//!
//! Counted at two points of a request's way, once each: its 429 ([`Dashboards::denied`])
//! and its admission ([`Dashboards::admitted`]). Requests the store failed on, refused
//! before any limit or limited by no rule reach neither. Label values are bounded: rule
//! names and plan names come from the config, never from a client (a token's plan claim
//! or a key's plan that the rule does not define is `default`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::{MetricType, TypedMetric};

use super::demand::{DemandMeter, Terms};
use super::live::Live;
use crate::limiter::{Algorithm, Decision, Fnv1a};
use crate::rules::{Plan, Rule};
use crate::telemetry::label_enum;

/// One rule of one request, as the dashboards judge it (the decision core's limits).
pub trait Judged {
    /// The rule's position in the config (its counters share it).
    fn index(&self) -> usize;
    /// Whether the rule enforces for this request (a watching one is not judged).
    fn enforced(&self) -> bool;
    /// Its quota for the request's plan.
    fn quota(&self) -> &crate::limiter::Quota;
    /// Who the request is under it.
    fn digest(&self) -> &crate::identity::IdentityDigest;
    /// Its plan, as the rule's `[rules.plans.<name>]` names it.
    fn plan(&self) -> Option<&str>;
    /// The store's decision (`None`: not known, from the deny cache).
    fn decision(&self) -> Option<Decision>;
}

/// The plan label of a rule's own quota.
pub const DEFAULT_PLAN: &str = "default";

crate::telemetry::label_sets! {
    pub struct DenialLabels {
        pub rule: String,
        /// A plan the rule defines (`[rules.plans.<name>]`), or `default`.
        pub plan: String,
    }

    pub struct RuleOnlyLabels {
        pub rule: String,
    }
}

label_enum! {
    /// How a request from an identity within its plan ended (`outcome=`).
    pub enum PlanOutcome {
        /// No 429: it passed every rule.
        Served,
        /// A 429, from this rule or another.
        Limited,
    }
}

crate::telemetry::label_sets! {
    pub struct PlanRequestLabels {
        pub rule: String,
        pub outcome: PlanOutcome,
    }
}

/// The upper bounds of the retry histogram's buckets: 1 ms × 2^i, 1 ms to 49.7 days (a
/// calendar month's reset fits), then `+Inf`.
pub const RETRY_BUCKETS: usize = 33;

fn bound_s(i: usize) -> f64 {
    (1u64 << i) as f64 / 1000.0
}

/// A histogram whose buckets are read as well as exported: lock-free counts by bucket, and
/// the exact sum, in whole milliseconds. Clones share the counts. `/metrics` shows it as a
/// Prometheus histogram in seconds; the status page estimates its quantiles.
#[derive(Clone, Debug, Default)]
pub struct Histogram(Arc<Buckets>);

#[derive(Debug)]
struct Buckets {
    /// By bucket: the observations at most its bound and above the one before it; the
    /// last, those above every bound.
    counts: [AtomicU64; RETRY_BUCKETS + 1],
    sum_ms: AtomicU64,
}

impl Default for Buckets {
    fn default() -> Buckets {
        Buckets {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ms: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    /// Observe `ms` milliseconds.
    pub fn observe_ms(&self, ms: u64) {
        // The smallest i with ms <= 2^i.
        let i = match ms {
            0 | 1 => 0,
            _ => 64 - (ms - 1).leading_zeros() as usize,
        };
        self.0.counts[i.min(RETRY_BUCKETS)].fetch_add(1, Relaxed);
        self.0.sum_ms.fetch_add(ms, Relaxed);
    }

    fn counts(&self) -> [u64; RETRY_BUCKETS + 1] {
        std::array::from_fn(|i| self.0.counts[i].load(Relaxed))
    }

    /// How many were observed.
    pub fn count(&self) -> u64 {
        self.counts().iter().sum()
    }

    /// Their sum, in seconds.
    pub fn sum_s(&self) -> f64 {
        self.0.sum_ms.load(Relaxed) as f64 / 1000.0
    }

    /// The `q` quantile in seconds, estimated from the buckets as Prometheus'
    /// `histogram_quantile` does: linearly within the bucket it falls in (the first from
    /// 0), the largest bound if it falls above all. None before any observation.
    pub fn quantile_s(&self, q: f64) -> Option<f64> {
        let counts = self.counts();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut below = 0u64;
        for (i, &n) in counts.iter().enumerate() {
            if n > 0 && (below + n) as f64 >= rank {
                if i == RETRY_BUCKETS {
                    return Some(bound_s(RETRY_BUCKETS - 1));
                }
                let lower = if i == 0 { 0.0 } else { bound_s(i - 1) };
                let within = (rank - below as f64) / n as f64;
                return Some(lower + (bound_s(i) - lower) * within);
            }
            below += n;
        }
        Some(bound_s(RETRY_BUCKETS - 1))
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let counts = self.counts();
        let buckets: Vec<(f64, u64)> = counts
            .iter()
            .enumerate()
            .map(|(i, &n)| match i {
                RETRY_BUCKETS => (f64::INFINITY, n),
                _ => (bound_s(i), n),
            })
            .collect();
        encoder.encode_histogram::<NoLabelSet>(self.sum_s(), counts.iter().sum(), &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

crate::telemetry::metrics! {
    /// The dashboards' families, and the demand meter behind the SLO (one per process: an
    /// identity's demand outlives reloads).
    pub struct Dashboards {
        denials: Family<DenialLabels, Counter> = ("denials", "Requests denied (429), under the rule that denied them (the first that did) and the plan whose quota applied: one the rule defines ([rules.plans.<name>]), else default"),
        retry: Family<RuleOnlyLabels, Histogram> = ("denial_retry_seconds", "The wait each 429 gave, under the rule that denied it: the longest of the denying rules' waits with retry_jitter, in ms as grpc-retry-pushback-ms carries it, Retry-After being it rounded up to whole seconds. Buckets 1 ms x 2^i up to 49.7 days"),
        near_limit: Family<RuleOnlyLabels, Counter> = ("near_limit", "Admitted requests whose decision left the identity at most 20% of the rule's limit (burst, the window's N, max_in_flight): 80% or more used. Enforcing rules only"),
        plan_requests: Family<PlanRequestLabels, Counter> = ("plan_requests", "Requests from identities within their plan under an enforcing rule, by outcome: served (no 429) or limited (a 429, from any rule). Within its plan: the identity's demand over the last period of the rate, denied requests included, at most max(N, burst), as this gateway saw it"),
        pub demand: DemandMeter = { DemandMeter::default() },
    }
}

impl Dashboards {
    /// `rule`'s handles, its series created at zero: a denial counter for each plan it
    /// limits and for its own quota, its histogram, its near-limit and SLO counters.
    pub fn rule(&self, rule: &Rule) -> RuleDashboard {
        let limited = rule
            .plans
            .iter()
            .filter(|(_, p)| matches!(p, Plan::Limit(_)))
            .map(|(plan, _)| plan.as_str());
        self.rule_named(&rule.name, limited)
    }

    /// The handles of the rule `name` whose plans with a limit are `plans`.
    pub fn rule_named<'a>(
        &self,
        name: &str,
        plans: impl Iterator<Item = &'a str>,
    ) -> RuleDashboard {
        let name = &name.to_string();
        let denial = |plan: &str| {
            self.denials
                .get_or_create(&DenialLabels {
                    rule: name.clone(),
                    plan: plan.to_string(),
                })
                .clone()
        };
        let mut plans: Vec<(Box<str>, Counter)> =
            plans.map(|plan| (plan.into(), denial(plan))).collect();
        plans.sort_by(|a, b| a.0.cmp(&b.0));
        let outcome = |outcome| {
            self.plan_requests
                .get_or_create(&PlanRequestLabels {
                    rule: name.clone(),
                    outcome,
                })
                .clone()
        };
        let mut salt = Fnv1a::new();
        salt.write(name.as_bytes());
        let rule_only = RuleOnlyLabels { rule: name.clone() };
        RuleDashboard {
            // A plan named "default" shares the label of the rule's own quota.
            own: plans
                .iter()
                .find(|(p, _)| &**p == DEFAULT_PLAN)
                .map_or_else(|| denial(DEFAULT_PLAN), |(_, c)| c.clone()),
            plans: plans.into_boxed_slice(),
            retry: self.retry.get_or_create(&rule_only).clone(),
            near_limit: self.near_limit.get_or_create(&rule_only).clone(),
            served: outcome(PlanOutcome::Served),
            limited: outcome(PlanOutcome::Limited),
            salt: salt.finish() as u64,
        }
    }

    /// A request denied (429) by `limits[by]`, told to wait `retry_ms`: its denial and
    /// its wait under that rule, and under every enforcing rule, if its identity is within
    /// its plan there, a limited request.
    pub fn denied(&self, live: &Live, limits: &[impl Judged], by: usize, retry_ms: u64) {
        if let Some(l) = limits.get(by) {
            if let Some(c) = live.counters.get(l.index()) {
                c.dashboard.denial(l.plan()).inc();
                c.dashboard.retry.observe_ms(retry_ms);
            }
        }
        self.judge(live, limits, false);
    }

    /// A request admitted (forwarded, now or after its wait): under every enforcing rule,
    /// whether it left its identity near the limit, and if its identity is within its
    /// plan there, a served request.
    pub fn admitted(&self, live: &Live, limits: &[impl Judged]) {
        self.judge(live, limits, true);
    }

    fn judge(&self, live: &Live, limits: &[impl Judged], served: bool) {
        // Read once for all the request's rules, when one needs it.
        let mut now_us = None;
        for l in limits {
            if !l.enforced() {
                continue;
            }
            let d = l.decision();
            let Some(c) = live.counters.get(l.index()) else {
                continue;
            };
            let c = &c.dashboard;
            let q = l.quota();
            let within = match q.algorithm {
                // Demand is what is in flight: the store's count, this request's included,
                // is what its decision was made on.
                Algorithm::Concurrency => match d {
                    Some(d) => d.allowed,
                    None => continue,
                },
                _ => {
                    let key = self.demand.key(c.salt, l.digest());
                    let now = *now_us.get_or_insert_with(|| self.demand.now_us());
                    self.demand.record(key, Terms::of(q), q.cost, now)
                }
            };
            if within {
                let outcome = if served { &c.served } else { &c.limited };
                outcome.inc();
            }
            if served && d.is_some_and(|d| near_limit(q, &d)) {
                c.near_limit.inc();
            }
        }
    }
}

/// Whether an allowed decision left at most 20% of the limit: `burst` (for the windows
/// their N, for a concurrency limit its max).
fn near_limit(q: &crate::limiter::Quota, d: &Decision) -> bool {
    d.allowed && d.remaining.saturating_mul(5) <= q.burst
}

/// One rule's dashboard handles, resolved at load: counting allocates nothing.
#[derive(Clone)]
pub struct RuleDashboard {
    /// `ratewall_denials_total` by the plans the rule limits, sorted by name, and for its
    /// own quota (`default`).
    plans: Box<[(Box<str>, Counter)]>,
    own: Counter,
    pub retry: Histogram,
    pub near_limit: Counter,
    pub served: Counter,
    pub limited: Counter,
    /// The rule's part of the demand meter's keys: a hash of its name.
    salt: u64,
}

impl RuleDashboard {
    /// The denial counter of `plan` (as [`Judged::plan`] names it).
    fn denial(&self, plan: Option<&str>) -> &Counter {
        plan.and_then(|p| {
            self.plans
                .binary_search_by(|(name, _)| (**name).cmp(p))
                .ok()
        })
        .map_or(&self.own, |i| &self.plans[i].1)
    }

    /// `served / (served + limited)`: the share of requests from identities within their
    /// plan that got no 429, since start. None before any.
    pub fn served_share(&self) -> Option<f64> {
        let (s, l) = (self.served.get(), self.limited.get());
        (s + l > 0).then(|| s as f64 / (s + l) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    #[test]
    fn the_histogram_buckets_by_powers_of_two_milliseconds_and_sums_exactly() {
        let h = Histogram::default();
        for ms in [1, 2, 3, 4, 5, 1_000, 1_024, 1_025] {
            h.observe_ms(ms);
        }
        let c = h.counts();
        // le 1 ms: 1; le 2: 2; le 4: 3, 4; le 8: 5; le 1.024 s: 1000, 1024; le 2.048 s: 1025.
        assert_eq!((c[0], c[1], c[2], c[3], c[10], c[11]), (1, 1, 2, 1, 2, 1));
        assert_eq!(h.count(), 8);
        assert_eq!(h.sum_s(), 3.064);
        // Past the last bound (49.7 days): +Inf.
        h.observe_ms(u64::MAX / 2);
        assert_eq!(h.counts()[RETRY_BUCKETS], 1);
        assert!(bound_s(RETRY_BUCKETS - 1) > 31.0 * 86_400.0);
    }

    #[test]
    fn the_quantile_is_interpolated_within_its_bucket() {
        let h = Histogram::default();
        assert_eq!(h.quantile_s(0.95), None);
        // 95 waits of 1 s (bucket 0.512..1.024 s), 5 of an hour.
        for _ in 0..95 {
            h.observe_ms(1_000);
        }
        for _ in 0..5 {
            h.observe_ms(3_600_000);
        }
        // Rank 95 is the last of the 1 s bucket: its upper bound.
        assert_eq!(h.quantile_s(0.95), Some(1.024));
        // Rank 99: 4/5 into the hour's bucket (2097.152 s .. 4194.304 s).
        let p99 = h.quantile_s(0.99).unwrap_or(0.0);
        assert!((p99 - (2097.152 + 2097.152 * 0.8)).abs() < 1e-6, "{p99}");
        let inf = Histogram::default();
        inf.observe_ms(u64::MAX);
        assert_eq!(inf.quantile_s(0.5), Some(bound_s(RETRY_BUCKETS - 1)));
    }

    #[test]
    fn the_histogram_is_exported_as_seconds() {
        let mut registry = Registry::with_prefix("ratewall");
        let d = Dashboards::register(&mut registry);
        let rule = crate::config::Config::parse(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n\
             [[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"1/s\"\n\
             [rules.plans.pro]\nrate = \"9/s\"\n[rules.plans.free]\nexempt = true\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap()
        .rules
        .remove(0);
        let r = d.rule(&rule);
        r.retry.observe_ms(1_500);
        r.denial(Some("pro")).inc();
        r.denial(Some("no-such-plan")).inc();
        r.denial(None).inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "ratewall_denial_retry_seconds_sum{rule=\"api\"} 1.5",
            "ratewall_denial_retry_seconds_count{rule=\"api\"} 1",
            "ratewall_denial_retry_seconds_bucket{le=\"1.024\",rule=\"api\"} 0",
            "ratewall_denial_retry_seconds_bucket{le=\"2.048\",rule=\"api\"} 1",
            "ratewall_denial_retry_seconds_bucket{le=\"+Inf\",rule=\"api\"} 1",
            "ratewall_denials_total{rule=\"api\",plan=\"pro\"} 1",
            "ratewall_denials_total{rule=\"api\",plan=\"default\"} 2",
            "ratewall_plan_requests_total{rule=\"api\",outcome=\"served\"} 0",
            "ratewall_near_limit_total{rule=\"api\"} 0",
        ] {
            assert!(text.contains(line), "no {line} in:\n{text}");
        }
        assert!(
            !text.contains("plan=\"free\""),
            "an exempt plan is never denied:\n{text}"
        );
        assert!(!text.contains("no-such-plan"), "{text}");
    }
}
