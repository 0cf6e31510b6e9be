//! The good-client SLO's meter: how much each identity asks of each enforcing rule, so that
//! a request can be told to come from an identity within its plan or over it
//! (`ratewall_plan_requests_total`, [`super::dashboards`]).
//!
//! An identity's demand under a rule is every request it sent that the rule applied to —
//! admitted or denied, at the rule's cost — over the last period of the rate of the quota
//! that applied, estimated as [`crate::limiter::sliding_window`] estimates it: windows of
//! one period aligned to the clock's zero, the previous window's count weighted by how much
//! of it still overlaps the last period, plus the current one's. The identity is within
//! its plan when that demand, this request included, is at most `max(N, burst)` of the
//! quota. Unlike the limiter's window, which counts only what it admitted (never more than
//! N), the meter counts what was asked: an abusive client's demand grows past its limit and
//! stays there while it keeps asking, so none of its 429s count against the SLO.
//!
//! Measured in process: with several gateways, each sees its share of an identity's
//! demand.
//!
//! Bounded: [`SHARDS`] shards behind a `std` mutex, each a hashbrown table of at most
//! `MAX_ENTRIES / SHARDS` entries keyed by a `u64` mixed from the rule (a hash of its name,
//! so that an entry outlives a reload that moves the rule) and the identity's digest
//! (already a uniform hash), with a per-process random seed, so that no client can aim at a
//! shard. A request takes one shard's lock per rule and allocates nothing (the table grows
//! to its bound once). A full shard first drops the entries whose windows have passed
//! (demand 0); if that frees less than an eighth of it, it evicts the entries with the
//! smallest demand relative to their limit (light clients, whose restart from zero changes
//! nothing) until an eighth is free, keeping the heavy ones, whose loss would make their
//! next 429s look like a good client's. A sweep is one pass over the shard, at most once
//! per eighth of a shard of new identities.
//!
//! Two (rule, identity) pairs whose keys agree on all 64 bits share one entry: about
//! `n² / 2^65` for `n` entries, 5·10⁻¹⁰ at the bound.

use std::sync::{Arc, Mutex, PoisonError};

use hashbrown::HashTable;

use crate::identity::IdentityDigest;
use crate::limiter::{Clock, MonotonicClock, Quota};

/// Shards of the meter: one lock each.
pub const SHARDS: usize = 16;
/// Entries the meter holds at most, in all its shards.
pub const MAX_ENTRIES: usize = 131_072;
const PER_SHARD: usize = MAX_ENTRIES / SHARDS;
/// What a full shard frees when it sweeps.
const HEADROOM: usize = PER_SHARD / 8;

/// The terms demand is judged by: the period of the quota's rate and `max(N, burst)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terms {
    pub period_us: u64,
    pub limit: u64,
}

impl Terms {
    pub fn of(q: &Quota) -> Terms {
        Terms {
            period_us: q.period_us().max(1),
            limit: q.rate.count.max(q.burst),
        }
    }
}

/// One identity's demand under one rule: the two windows' counts, as
/// [`crate::limiter::sliding_window::State`] keeps them, but of every request asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demand {
    /// The index of the window `cur` counts (`now / period`).
    pub window: u64,
    pub cur: u64,
    pub prev: u64,
}

/// Add one request of `cost` at `now_us` to `state`: whether the demand, this request
/// included, is within `terms`, and the new state. The sliding window's arithmetic,
/// exactly: `prev · (P - e) + cur · P <= limit · P`, in integers (here in `u128`: demand is
/// not bounded by the limit, and saturates instead of wrapping). A clock behind the
/// state's window counts at that window's start, as the limiter's does.
pub fn step(state: Option<&Demand>, terms: Terms, cost: u64, now_us: u64) -> (bool, Demand) {
    let p = terms.period_us.max(1);
    let at = state.map_or(now_us, |s| now_us.max(s.window.saturating_mul(p)));
    let (w, e) = (at / p, at % p);
    let (prev, cur) = match state {
        Some(s) if s.window == w => (s.prev, s.cur),
        Some(s) if s.window.saturating_add(1) == w => (s.cur, 0),
        _ => (0, 0),
    };
    let cur = cur.saturating_add(cost);
    let used = u128::from(prev) * u128::from(p - e) + u128::from(cur) * u128::from(p);
    let within = used <= u128::from(terms.limit) * u128::from(p);
    (
        within,
        Demand {
            window: w,
            cur,
            prev,
        },
    )
}

/// One tracked (rule, identity): its key, the terms it was last judged by, its demand.
#[derive(Debug, Clone, Copy)]
struct Entry {
    key: u64,
    terms: Terms,
    demand: Demand,
}

impl Entry {
    /// The two windows' counts as they weigh at `now_us`, and how far into its window
    /// `now_us` is: `(prev, cur, e, P)`.
    fn at(&self, now_us: u64) -> (u64, u64, u64, u64) {
        let p = self.terms.period_us.max(1);
        let d = &self.demand;
        let at = now_us.max(d.window.saturating_mul(p));
        let (w, e) = (at / p, at % p);
        match w - d.window {
            0 => (d.prev, d.cur, e, p),
            1 => (d.cur, 0, e, p),
            _ => (0, 0, e, p),
        }
    }

    /// The demand now as a share of the limit, for ranking only (as the bits of a
    /// non-negative `f64`, which order as the numbers do): 0 exactly when its windows have
    /// passed. One float division, where an exact `u128` one would cost a sweep far more.
    fn share(&self, now_us: u64) -> u64 {
        let (prev, cur, e, p) = self.at(now_us);
        let used = prev as f64 * (p - e) as f64 + cur as f64 * p as f64;
        (used / (self.terms.limit.max(1) as f64 * p as f64)).to_bits()
    }
}

#[derive(Default)]
struct Shard {
    table: HashTable<Entry>,
}

impl Shard {
    fn record(&mut self, key: u64, terms: Terms, cost: u64, now_us: u64) -> bool {
        if let Some(e) = self.table.find_mut(key, |e| e.key == key) {
            // Other terms (a new plan, a reload): the windows mean something else.
            let prior = (e.terms.period_us == terms.period_us).then_some(&e.demand);
            let (within, demand) = step(prior, terms, cost, now_us);
            e.terms = terms;
            e.demand = demand;
            return within;
        }
        let (within, demand) = step(None, terms, cost, now_us);
        if self.table.len() >= PER_SHARD {
            self.make_room(now_us);
        }
        self.table
            .insert_unique(key, Entry { key, terms, demand }, |e| e.key);
        within
    }

    /// Drop the entries whose windows have passed; if that frees less than [`HEADROOM`],
    /// evict the least demanding (relative to their limits) until it is free. Two passes
    /// over the shard: the shares ranked, then the table kept above the cut.
    fn make_room(&mut self, now_us: u64) {
        // Once per HEADROOM new identities at most: the one allocation of a sweep.
        let mut shares: Vec<u64> = self.table.iter().map(|e| e.share(now_us)).collect();
        // A passed window's share is 0, the least: the idle entries come first.
        let idle = shares.iter().filter(|&&s| s == 0).count();
        let evict = idle.max(self.table.len().saturating_sub(PER_SHARD - HEADROOM));
        if evict == 0 {
            return;
        }
        let (below, &mut cut, _) = shares.select_nth_unstable(evict - 1);
        // Every share below the cut goes, and as many at it as make up the count.
        let mut at_cut = evict - below.iter().filter(|&&s| s < cut).count();
        self.table.retain(|e| {
            let s = e.share(now_us);
            if s < cut {
                return false;
            }
            if s == cut && at_cut > 0 {
                at_cut -= 1;
                return false;
            }
            true
        });
    }
}

/// The meter: see the module's documentation.
pub struct DemandMeter {
    shards: Box<[Mutex<Shard>]>,
    clock: Arc<dyn Clock>,
    /// Mixed into every key: which shard an identity lands in is this process's secret.
    seed: u64,
}

impl Default for DemandMeter {
    fn default() -> Self {
        DemandMeter::new(Arc::new(MonotonicClock::new()))
    }
}

impl DemandMeter {
    /// A meter timed by `clock` (tests move a manual one by hand).
    pub fn new(clock: Arc<dyn Clock>) -> DemandMeter {
        DemandMeter {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            clock,
            seed: crate::random::bits(),
        }
    }

    /// The key of `identity` under the rule whose name hashes to `rule_salt`.
    pub fn key(&self, rule_salt: u64, identity: &IdentityDigest) -> u64 {
        let [lo, hi] = [0, 8].map(|at| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&identity.0[at..at + 8]);
            u64::from_le_bytes(b)
        });
        mix(lo ^ self.seed ^ mix(hi ^ rule_salt))
    }

    /// Now, on the meter's clock (read once per request, for all its rules).
    pub fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    /// Add one request of `cost` at `now_us` ([`DemandMeter::now_us`]) to the demand of
    /// `key` under `terms`: whether it is within them.
    pub fn record(&self, key: u64, terms: Terms, cost: u64, now_us: u64) -> bool {
        // Bits the table's hash does not use to place the key (hashbrown takes the low bits
        // for the bucket, the top 7 for its tags).
        let shard = (key >> 32) as usize % SHARDS;
        let mut s = self.shards[shard]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        s.record(key, terms, cost, now_us)
    }

    /// Entries held now, in all shards.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).table.len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// SplitMix64's finaliser: every input bit moves every output bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{sliding_window, Algorithm, ManualClock};
    use proptest::prelude::*;

    const SECOND: u64 = 1_000_000;

    fn terms(limit: u64, period_s: u64) -> Terms {
        Terms {
            period_us: period_s * SECOND,
            limit,
        }
    }

    /// A digest as uniform as the real ones (SHA-256 based).
    fn digest(n: u64) -> IdentityDigest {
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&mix(n).to_le_bytes());
        d[8..].copy_from_slice(&mix(!n).to_le_bytes());
        IdentityDigest(d)
    }

    /// One request, at the meter's (manual) clock's now.
    fn rec(m: &DemandMeter, key: u64, t: Terms, cost: u64) -> bool {
        m.record(key, t, cost, m.now_us())
    }

    fn meter() -> (DemandMeter, Arc<ManualClock>) {
        let clock = ManualClock::new(1_000 * SECOND);
        (DemandMeter::new(clock.clone()), clock)
    }

    #[test]
    fn terms_are_the_rate_s_period_and_the_larger_of_n_and_burst() {
        let q = crate::limiter::tests::quota(Algorithm::TokenBucket, "10/m", Some(25), 1);
        assert_eq!(Terms::of(&q), terms(25, 60));
        let q = crate::limiter::tests::quota(Algorithm::TokenBucket, "10/s", Some(4), 1);
        assert_eq!(Terms::of(&q), terms(10, 1));
        let q = crate::limiter::tests::quota(Algorithm::SlidingWindow, "30/h", None, 2);
        assert_eq!(Terms::of(&q), terms(30, 3600));
    }

    #[test]
    fn within_the_plan_up_to_the_limit_then_over_until_the_demand_slides_out() {
        let (m, clock) = meter();
        let key = m.key(7, &digest(1));
        let t = terms(10, 60);
        // Ten in the window are within; every one after is over, denied or not.
        for i in 0..10 {
            assert!(rec(&m, key, t, 1), "request {i}");
        }
        for i in 10..15 {
            assert!(!rec(&m, key, t, 1), "request {i}");
        }
        // Half a period into the next window the previous one's 15 (the denied ones
        // included) weigh 7.5: 8.5 and 9.5 are within, 10.5 is over.
        let p = 60 * SECOND;
        let w = clock.now_us() / p;
        clock.set((w + 1) * p + p / 2);
        assert!(rec(&m, key, t, 1));
        assert!(rec(&m, key, t, 1));
        assert!(!rec(&m, key, t, 1));
        // Two windows on, nothing is left.
        clock.set((w + 3) * p);
        assert!(
            rec(&m, key, t, 10),
            "a whole limit at once, after the windows passed"
        );
        assert!(!rec(&m, key, t, 1));
    }

    #[test]
    fn cost_counts_and_rules_and_identities_are_apart() {
        let (m, _) = meter();
        let t = terms(10, 1);
        let (a, b) = (m.key(1, &digest(1)), m.key(1, &digest(2)));
        let a2 = m.key(2, &digest(1));
        assert_ne!(a, b);
        assert_ne!(a, a2);
        assert!(rec(&m, a, t, 6));
        assert!(!rec(&m, a, t, 6), "12 > 10");
        assert!(rec(&m, b, t, 10), "another identity has its own demand");
        assert!(
            rec(&m, a2, t, 10),
            "so has the same identity under another rule"
        );
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn an_abusive_client_stays_over_its_plan_while_it_keeps_asking() {
        let (m, clock) = meter();
        let key = m.key(3, &digest(9));
        let t = terms(100, 1);
        let mut within = 0;
        // 1,000 requests a second for 10 s: only the first 100 are within the plan; the
        // previous window's 1,000 weigh more than 100 all through the next.
        for _ in 0..10 {
            for _ in 0..1_000 {
                within += u32::from(rec(&m, key, t, 1));
                clock.advance(1_000);
            }
        }
        assert_eq!(within, 100);
    }

    #[test]
    fn other_terms_start_the_demand_afresh() {
        let (m, _) = meter();
        let key = m.key(3, &digest(4));
        assert!(rec(&m, key, terms(5, 1), 5));
        assert!(!rec(&m, key, terms(5, 1), 1));
        // The same period, a larger plan: the demand is kept, judged by the new limit.
        assert!(rec(&m, key, terms(50, 1), 1));
        // Another period: the windows mean something else.
        assert!(rec(&m, key, terms(5, 60), 5));
    }

    #[test]
    fn the_bound_holds_under_a_million_distinct_identities() {
        let (m, clock) = meter();
        let t = terms(10, 3600);
        for n in 0..1_000_000u64 {
            let key = m.key(1, &digest(n));
            assert!(rec(&m, key, t, 1));
            if n % 1_000 == 0 {
                clock.advance(1_000);
            }
        }
        let held = m.len();
        assert!(held <= MAX_ENTRIES, "{held} entries");
        // Each shard sweeps to 7/8 of its bound and fills again: most of the room is used.
        assert!(held > MAX_ENTRIES * 3 / 4, "{held} entries");
    }

    #[test]
    fn a_full_shard_drops_passed_windows_first_then_evicts_the_lightest() {
        let mut s = Shard::default();
        let t = terms(100, 1);
        // Entries whose windows have passed, then a full shard of live ones.
        for key in 0..(PER_SHARD as u64) {
            s.record(key, t, 1, 0);
        }
        assert_eq!(s.table.len(), PER_SHARD);
        // Two seconds on, every window has passed: the next new key drops them all.
        s.record(u64::MAX, t, 1, 2 * SECOND);
        assert_eq!(s.table.len(), 1);

        // A full shard of live entries: one heavy (its demand over the limit), the rest
        // light, one request each.
        let now = 10 * SECOND;
        let heavy = 1u64 << 40;
        for _ in 0..500 {
            s.record(heavy, t, 1, now);
        }
        let mut key = 0u64;
        while s.table.len() < PER_SHARD {
            s.record(key, t, 1, now);
            key += 1;
        }
        s.record(u64::MAX - 1, t, 1, now);
        // An eighth evicted, the newcomer added; the heavy one kept, over its plan still.
        assert_eq!(s.table.len(), PER_SHARD - HEADROOM + 1);
        assert!(s.table.find(heavy, |e| e.key == heavy).is_some());
        assert!(!s.record(heavy, t, 1, now));
        assert!(s
            .table
            .find(u64::MAX - 1, |e| e.key == u64::MAX - 1)
            .is_some());
    }

    crate::proptest_seeds! {
        #![cases(256)]

        /// Where the limiter admits everything asked (every request within), the meter and
        /// `sliding_window::decide` agree request for request, state for state; where the
        /// limiter first denies, the meter says over.
        #[test]
        fn the_meter_judges_as_the_sliding_window_decides(
            n in 1u64..50,
            period_s in 1u64..120,
            cost in 1u64..5,
            gaps in proptest::collection::vec(0u64..3_000_000, 1..60),
        ) {
            let cost = cost.min(n);
            let q = crate::limiter::tests::quota(
                Algorithm::SlidingWindow,
                &format!("{n}/{period_s}s"),
                None,
                cost,
            );
            let t = Terms::of(&q);
            let (mut now, mut demand, mut window) = (5 * SECOND, None, None);
            for gap in gaps {
                now += gap;
                let (within, next) = step(demand.as_ref(), t, cost, now);
                let o = sliding_window::decide(&q, window.as_ref(), now);
                prop_assert_eq!(within, o.allowed, "at {}", now);
                if !o.allowed {
                    break;
                }
                let s = o.next;
                prop_assert_eq!(
                    next,
                    Demand { window: s.window, cur: s.cur, prev: s.prev }
                );
                demand = Some(next);
                window = Some(s);
            }
        }
    }
}
