//! The settlements' metrics: per rule, what became of the charges it settled.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

crate::telemetry::label_enum! {
    /// What one settlement of one charge did.
    pub enum SettleOutcome {
        /// Given back whole: the answer's status is one the rule does not charge, or
        /// the request never reached a backend (none could be, shed, the client gone
        /// before it was sent).
        Refunded,
        /// The reported cost was below the reservation: the difference given back.
        ChargedLess,
        /// The reported cost was above it: the difference taken (maybe into debt).
        ChargedMore,
        /// A cost the answer reported that is not a whole number at least 0: logged,
        /// and the reservation stands.
        Invalid,
        /// The store did not take the settlement: the reservation stands.
        Failed,
        /// The answer's usage could not be read (a content coding not undone, a corrupt
        /// one, or one decoding past its bound): the reservation stands.
        Unread,
    }
}

crate::telemetry::label_enum! {
    /// How an answer read on after its client left ended (`settle_drain`).
    pub enum DrainResult {
        /// Its end reported a cost, which was settled.
        Settled,
        /// It ended reporting none: the reservations stand.
        Stood,
        /// Cut at `settle_drain`'s bytes or time, or broken by the backend: the
        /// reservations stand.
        Cut,
    }
}

crate::telemetry::label_sets! {
    pub struct DrainLabels {
        pub result: DrainResult,
    }
}

crate::telemetry::label_enum! {
    pub enum SettleDirection {
        Refunded,
        Charged,
    }
}

crate::telemetry::label_sets! {
    pub struct SettleLabels {
        pub rule: String,
        pub outcome: SettleOutcome,
    }

    pub struct CostLabels {
        pub rule: String,
        pub direction: SettleDirection,
    }

    pub struct ForgivenLabels {
        pub rule: String,
    }
}

crate::telemetry::metrics! {
    #[derive(Clone, Default)]
    pub struct SettleMetrics {
        pub settlements: Family<SettleLabels, Counter> = ("settlements", "Charges settled after the answer, per rule and outcome: refunded (the status is not charged, or the request never reached a backend), charged_less / charged_more (the reported cost differed from the reservation), invalid (a reported cost was not a whole number; the reservation stands), failed (the store did not take it), unread (the answer's usage could not be read; the reservation stands)"),
        pub cost: Family<CostLabels, Counter> = ("settled_cost", "Cost units settlements gave back (refunded) or took beyond the reservation (charged), per rule"),
        /// Cost units a store could not charge (docs/algorithms.md, "Reservations and
        /// settlement": past the exact numbers' bound, or a calendar period's worth of debt).
        pub forgiven: Family<ForgivenLabels, Counter> = ("settle_forgiven", "Cost units a settlement could not charge, per rule: past the most a store's state holds exactly (2^52 units), or past one whole period of debt on a calendar quota; zero in any ordinary run"),
        /// Answers read on after their client left, by how that ended.
        pub drains: Family<DrainLabels, Counter> = ("settle_drains", "Answers read on after their client left, to settle the cost their end reports (settle_drain), by result: settled, stood (no cost came: the reservations stand), cut (past settle_drain's bytes or time, or broken by the backend: the reservations stand)",
            zero = DrainResult::ALL.map(|result| DrainLabels { result }),
        ),
    }
}

impl SettleMetrics {
    /// An answer read on after its client left ended this way.
    pub fn drained(&self, result: DrainResult) {
        self.drains.get_or_create(&DrainLabels { result }).inc();
    }

    /// Every series of a rule that settles, at zero (from its load on).
    pub fn create(&self, rule: &str) {
        for outcome in SettleOutcome::ALL {
            let _ = self.settlements.get_or_create(&SettleLabels {
                rule: rule.to_string(),
                outcome,
            });
        }
        for direction in SettleDirection::ALL {
            let _ = self.cost.get_or_create(&CostLabels {
                rule: rule.to_string(),
                direction,
            });
        }
        let _ = self.forgiven.get_or_create(&ForgivenLabels {
            rule: rule.to_string(),
        });
    }

    /// `units` of a reported cost the store could not charge.
    pub fn forgave(&self, rule: &str, units: u64) {
        if units > 0 {
            self.forgiven
                .get_or_create(&ForgivenLabels {
                    rule: rule.to_string(),
                })
                .inc_by(units);
        }
    }

    pub fn count(&self, rule: &str, outcome: SettleOutcome) {
        self.settlements
            .get_or_create(&SettleLabels {
                rule: rule.to_string(),
                outcome,
            })
            .inc();
    }

    pub fn moved(&self, rule: &str, direction: SettleDirection, units: u64) {
        if units > 0 {
            self.cost
                .get_or_create(&CostLabels {
                    rule: rule.to_string(),
                    direction,
                })
                .inc_by(units);
        }
    }
}
