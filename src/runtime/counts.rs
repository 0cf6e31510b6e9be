//! What a decision counts, as one event: the decision core fills a [`Counts`] as it
//! decides and returns it (in its `Decided`), and whoever asked for the decision hands it
//! to [`Metrics::decided`] — the core itself reaches into no metric. Per rule, its share
//! of the request (`ratewall_requests_total{rule,decision}`) counted now; the dashboards'
//! judgement of the request (admitted, or denied by one rule, and the wait its answer
//! announced); and for a denial, the status page's heavy hitters.

use super::dashboards::Judged;
use super::requests::{DecisionLabel, FrontEndKind};
use super::{Live, Metrics};
use crate::identity::IdentityDigest;
use crate::limiter::{Decision, Quota};
use crate::telemetry::stats::Named;
use crate::telemetry::Disposition;

/// The counts one decision adds.
#[derive(Default)]
pub struct Counts<'l> {
    /// The rules consulted (or charged), in the order they were: each with its decision
    /// and the share counted now.
    pub rules: Vec<Counted<'l>>,
    /// The rule (its position in the config) that refused the request before any was
    /// consulted, and how it counts it (`refused`, `bad_key`).
    pub refused: Option<(usize, DecisionLabel)>,
    /// How the dashboards judge the request; none where no rule decided it.
    pub judged: Option<Judgement>,
}

/// One rule's part in a decision.
#[derive(Clone, Copy)]
pub struct Counted<'l> {
    /// The rule's position in the config (its counters and its name share it).
    pub index: usize,
    /// Whether it enforces for this request (else it watches).
    pub enforced: bool,
    pub quota: Quota,
    /// Who the request is under it.
    pub digest: IdentityDigest,
    /// Its plan, as the rule's `[rules.plans.<name>]` names it.
    pub plan: Option<&'l str>,
    /// The store's decision (`None`: not known, from the deny cache; or the store failed).
    pub decision: Option<Decision>,
    /// Its share counted now; `None` where there is none yet (a pass counts once the
    /// upstream has answered).
    pub share: Option<DecisionLabel>,
}

/// The dashboards' view of a decided request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Judgement {
    /// Let through (now or after its wait).
    Admitted,
    /// Denied by `rules[by]`, its answer telling it to wait `retry_ms`.
    Denied { by: usize, retry_ms: u64 },
}

impl Judged for Counted<'_> {
    fn index(&self) -> usize {
        self.index
    }

    fn enforced(&self) -> bool {
        self.enforced
    }

    fn quota(&self) -> &Quota {
        &self.quota
    }

    fn digest(&self) -> &IdentityDigest {
        &self.digest
    }

    fn plan(&self) -> Option<&str> {
        self.plan
    }

    fn decision(&self) -> Option<Decision> {
        self.decision
    }
}

impl Metrics {
    /// Count what a decision on `live` returned. `named`: what the status page shows of
    /// the identity the rule at a config position counts the request as, asked only
    /// where a denial makes that identity a new heavy hitter.
    /// `frontend` asked for it, and it was disposed of as `disposition`
    /// (`ratewall_decisions_total`).
    pub fn decided(
        &self,
        live: &Live,
        frontend: FrontEndKind,
        disposition: Disposition,
        counts: &Counts<'_>,
        named: impl FnOnce(usize) -> Named,
    ) {
        self.gateway.count_decision(frontend, disposition);
        let shares = counts
            .rules
            .iter()
            .filter_map(|c| Some((c.index, c.share?)));
        for (index, share) in shares.chain(counts.refused) {
            if let Some(c) = live.counters.get(index) {
                c.of(share).inc();
            }
        }
        let dashboards = &self.gateway.dashboards;
        match counts.judged {
            Some(Judgement::Admitted) => dashboards.admitted(live, &counts.rules),
            Some(Judgement::Denied { by, retry_ms }) => {
                let denier = counts.rules.get(by);
                let rule = denier.and_then(|c| live.config.rules.get(c.index));
                if let (Some(c), Some(rule)) = (denier, rule) {
                    self.stats.limited(c.digest, &rule.name, || named(c.index));
                }
                dashboards.denied(live, &counts.rules, by, retry_ms);
            }
            None => {}
        }
    }
}
