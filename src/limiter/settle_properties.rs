//! Property tests of settlements (issue 27; [`super::settle`]): random timelines of
//! decisions, refunds and charges beyond the reservation, exact claims about what each
//! leaves behind. The Lua twins are held to the same answers by tests/it/settle_agree.rs.
//!
//! A settlement here is made as the gateway makes it: a reservation ([`Reserved`]) settled
//! at a real cost through [`adjust`], which times a window's refund from the charged
//! decision's reset and the reservation's age; or, for another request's settlement in the
//! middle of a timeline, a bare [`Adjust`].

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::reservation::{adjust, Reserved};
use super::{
    decide, fixed_window, settle, sliding_window, token_bucket, Adjust, Algorithm, Decision,
    Outcome, Quota, Rate, Settled, State,
};
use crate::identity::digest_api_key;

mod windows;

const BUCKETS: [Algorithm; 2] = [Algorithm::TokenBucket, Algorithm::Gcra];
const WINDOWS: [Algorithm; 2] = [Algorithm::FixedWindow, Algorithm::SlidingWindow];

/// A valid quota: the cost is at most the burst (a window's N), `max_debt` as given.
fn quota(
    algorithm: Algorithm,
    (count, secs): (u64, u64),
    burst: u64,
    cost: u64,
    max_debt: u64,
) -> Quota {
    let burst = algorithm.has_burst().then_some(burst);
    let cost = cost.min(burst.unwrap_or(count));
    Quota::new(
        algorithm,
        Rate::every(count, Duration::from_secs(secs)),
        burst.and_then(NonZeroU64::new),
        NonZeroU64::new(cost).expect("cost > 0"),
    )
    .and_then(|q| q.with_max_debt(max_debt))
    .expect("a valid quota")
}

/// A rate with awkward counts and a few periods (as in `properties.rs`).
fn rate() -> impl Strategy<Value = (u64, u64)> {
    (
        prop_oneof![Just(1u64), Just(3), Just(7), Just(10), Just(999), 1u64..50],
        prop_oneof![Just(1u64), Just(2), Just(10), Just(60)],
    )
}

/// A limit of one of `algorithms`: any rate, burst and cost; no debt allowed, one, a
/// burst's worth (the default) or three.
fn limit(algorithms: &'static [Algorithm]) -> impl Strategy<Value = Quota> {
    (
        prop::sample::select(algorithms),
        rate(),
        1u64..40,
        prop_oneof![3 => Just(1u64), 2 => 1u64..8],
        0u64..4,
    )
        .prop_map(|(alg, rate, burst, cost, debt)| {
            let q = quota(alg, rate, burst, cost, 0);
            let max_debt = [0, 1, q.burst, 3 * q.burst][debt as usize];
            q.with_max_debt(max_debt).expect("a max_debt that fits")
        })
}

/// A bucket limit, with a `max_delay` (1 ms to 10 s) about one time in three.
fn bucket_limit() -> impl Strategy<Value = Quota> {
    (
        limit(&BUCKETS),
        prop_oneof![2 => Just(None), 1 => (1u64..10_000).prop_map(Some)],
    )
        .prop_map(|(q, delay_ms)| {
            delay_ms
                .and_then(|ms| q.with_max_delay(Duration::from_millis(ms)).ok())
                .unwrap_or(q)
        })
}

/// How long after the previous event the next one comes, resolved against the quota.
#[derive(Debug, Clone, Copy)]
enum Gap {
    Micros(u64),
    /// ‰ of one emission interval (period / count): around a token.
    Interval(u64),
    /// ‰ of the period.
    Period(u64),
    /// To the next multiple of the period (where sliding windows turn), less 0 or 1 µs.
    Boundary(u64),
}

impl Gap {
    fn after(self, q: &Quota, now: u64) -> u64 {
        let p = q.period_us();
        match self {
            Gap::Micros(us) => now + us,
            Gap::Interval(permille) => now + p / q.rate.count * permille / 1000,
            Gap::Period(permille) => now + p * permille / 1000,
            Gap::Boundary(early) => (now / p + 1) * p - early,
        }
    }
}

fn gap() -> impl Strategy<Value = Gap> {
    prop_oneof![
        4 => Just(Gap::Micros(0)),
        3 => (1u64..2_000).prop_map(Gap::Micros),
        3 => (0u64..=2_000).prop_map(Gap::Interval),
        2 => (0u64..=1_500).prop_map(Gap::Period),
        1 => (0u64..=1).prop_map(Gap::Boundary),
    ]
}

/// What a reservation really cost, against what it reserved.
#[derive(Debug, Clone, Copy)]
enum Real {
    /// Nothing: a whole refund (an answer its rule does not charge for).
    Nothing,
    /// ‰ of the reserved cost (rounded down): a partial refund.
    Part(u64),
    /// This much more than reserved: a charge beyond it, maybe into debt.
    More(u64),
}

impl Real {
    fn cost(self, reserved: u64) -> u64 {
        match self {
            Real::Nothing => 0,
            Real::Part(permille) => reserved * permille / 1000,
            Real::More(extra) => reserved + extra,
        }
    }
}

fn real() -> impl Strategy<Value = Real> {
    prop_oneof![
        2 => Just(Real::Nothing),
        1 => (1u64..1000).prop_map(Real::Part),
        2 => prop_oneof![1u64..5, 5u64..200].prop_map(Real::More),
    ]
}

#[derive(Debug, Clone, Copy)]
enum Op {
    /// A request of this cost (at most the burst), charged when allowed.
    Decide { gap: Gap, cost: u64 },
    /// One of the charges so far (`pick`, modulo how many are unsettled) settled at its
    /// real cost, as the gateway settles it.
    Settle { gap: Gap, pick: usize, real: Real },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (gap(), 1u64..6).prop_map(|(gap, cost)| Op::Decide { gap, cost }),
        1 => (gap(), any::<usize>(), real()).prop_map(|(gap, pick, real)| Op::Settle { gap, pick, real }),
    ]
}

fn ops(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), len)
}

/// A limit and a timeline of decisions and settlements that brings it to some state.
#[derive(Debug, Clone)]
struct Setup {
    q: Quota,
    start: u64,
    before: Vec<Op>,
}

fn setup(limit: impl Strategy<Value = Quota>, most_ops: usize) -> impl Strategy<Value = Setup> {
    (limit, 0u64..1_000_000_000_000, ops(0..most_ops)).prop_map(|(q, start, before)| Setup {
        q,
        start,
        before,
    })
}

/// A reservation of `q.cost` whose charged decision said `reset_us`.
fn reserved(q: &Quota, reset_us: u64) -> Reserved {
    Reserved {
        identity: digest_api_key(b"settle-properties"),
        rule: Arc::from("r"),
        quota: *q,
        shadow: false,
        reset_us,
    }
}

/// A bare settlement of `delta` cost units (another request's, in a timeline).
fn by(delta: i64) -> Adjust {
    Adjust {
        delta,
        left_us: None,
    }
}

/// `state` after a settlement.
fn apply(state: Option<State>, settled: Settled<State>) -> Option<State> {
    match settled {
        Settled::Keep => state,
        Settled::Clear => None,
        Settled::Write { next, .. } => Some(next),
    }
}

/// One key's timeline, as a store keeps it: the state, the time, and the charges not yet
/// settled (when each was made, and its reservation).
struct World {
    q: Quota,
    state: Option<State>,
    now: u64,
    charges: Vec<(u64, Reserved)>,
}

impl World {
    fn new(q: Quota, now: u64) -> World {
        World {
            q,
            state: None,
            now,
            charges: Vec::new(),
        }
    }

    /// A request of `cost` now, charged when allowed.
    fn decide(&mut self, cost: u64) -> Outcome<State> {
        let q = self.q.with_cost(cost);
        let o = decide(&q, self.state.as_ref(), self.now);
        if o.allowed {
            self.state = Some(o.next);
            self.charges
                .push((self.now, reserved(&q, o.charged.reset_us)));
        }
        o
    }

    /// A charge of the limit's own cost now; if the limit denies it, at the instant its
    /// denial names (where it passes: `retry_after_is_exact_for_every_algorithm`).
    fn charge(&mut self) -> Result<(u64, Outcome<State>), TestCaseError> {
        let before = decide(&self.q, self.state.as_ref(), self.now);
        if !before.allowed {
            self.now += before.uncharged.retry_after_us;
        }
        let o = self.decide(self.q.cost);
        prop_assert!(o.allowed, "not allowed at its retry instant: {:?}", o);
        Ok((self.now, o))
    }

    fn step(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Decide { gap, cost } => {
                self.now = gap.after(&self.q, self.now);
                self.decide(cost);
            }
            Op::Settle { gap, pick, real } => {
                self.now = gap.after(&self.q, self.now);
                if self.charges.is_empty() {
                    return Ok(());
                }
                let (at, r) = self.charges.remove(pick % self.charges.len());
                if let Some(adj) = adjust(&r, real.cost(r.quota.cost), self.now - at) {
                    let s = settle(&self.q, self.state.as_ref(), self.now, adj);
                    self.state = apply(self.state, s);
                }
            }
        }
        self.invariants()
    }

    /// What no timeline of decisions and settlements may break: a bucket is never more
    /// than `max_debt` below empty (nor `max_delay`'s reservations), never above full; a
    /// window never counts more than N + `max_debt`.
    fn invariants(&self) -> Result<(), TestCaseError> {
        let q = &self.q;
        let most = (q.rate.count + q.max_debt) as i128;
        match self.state {
            Some(State::FixedWindow(f)) => {
                prop_assert!(i128::from(f.count) <= most, "{} counted: {:?}", f.count, q);
            }
            Some(State::SlidingWindow(s)) => {
                prop_assert!(i128::from(s.cur) <= most, "{} counted: {:?}", s.cur, q);
            }
            _ if q.algorithm.has_burst() => {
                let l = level(q, self.state.as_ref(), self.now);
                let floor = -i128::from(q.max_debt * q.unit + q.slack());
                prop_assert!(
                    l >= floor && l <= i128::from(q.capacity()),
                    "level {} outside [{}, {}]",
                    l,
                    floor,
                    q.capacity()
                );
            }
            _ => {}
        }
        Ok(())
    }
}

/// A bucket's level at `now`, in units, exactly: a token bucket's, or for GCRA the burst
/// less how far its TAT is ahead of `now`. Full without a state.
fn level(q: &Quota, state: Option<&State>, now: u64) -> i128 {
    let cap = i128::from(q.capacity());
    match state {
        Some(State::TokenBucket(t)) => i128::from(token_bucket::level_at(q, Some(t), now)),
        Some(State::Gcra(g)) if g.tat_us >= now => {
            let ahead = i128::from(g.tat_us - now) * i128::from(q.per_us)
                + i128::from(g.frac.min(q.per_us - 1));
            cap - ahead
        }
        _ => cap,
    }
}

/// Whether a settlement of `delta` on a bucket at `level` is cut short: a charge stopped
/// at `max_debt` below empty, a refund stopped at full, or a delta beyond what the step
/// clamps to (the gateway never sends one).
fn cut_short(q: &Quota, level: i128, delta: i64) -> bool {
    let units = i128::from(delta) * i128::from(q.unit);
    let most = i128::from(q.capacity() + q.max_debt * q.unit);
    let floor = -i128::from(q.max_debt * q.unit);
    units.abs() > most || level - units < floor || level - units > i128::from(q.capacity())
}

/// The times worth asking `state` about after `t`: each probe's, and where its answers
/// flip (the retry instant a denial names, the end of a wait, the reset), and 1 µs before.
fn probe_times(q: &Quota, state: Option<&State>, t: u64, gaps: &[u64]) -> Vec<u64> {
    let o = decide(q, state, t);
    let mut times: Vec<u64> = gaps.iter().map(|g| t + g).collect();
    for d in [o.charged, o.uncharged] {
        for edge in [d.retry_after_us, d.reset_us] {
            times.extend([t + edge, (t + edge).saturating_sub(1).max(t)]);
        }
    }
    times
}

/// The same requests (time, cost), each charged when allowed, on two states: every
/// outcome must be the same.
fn same_from_here(
    q: &Quota,
    a: Option<State>,
    b: Option<State>,
    t: u64,
    probes: &[(u64, u64)],
) -> Result<(), TestCaseError> {
    // Any one next request, at any later time.
    let gaps: Vec<u64> = probes.iter().map(|&(g, _)| g).collect();
    for (k, at) in probe_times(q, b.as_ref(), t, &gaps).into_iter().enumerate() {
        let c = probes.get(k).map_or(q.cost, |&(_, c)| c);
        let qc = q.with_cost(c);
        prop_assert_eq!(
            decide(&qc, a.as_ref(), at),
            decide(&qc, b.as_ref(), at),
            "a request of cost {} at +{} µs",
            c,
            at - t
        );
    }
    // And a whole timeline of them.
    let (mut a, mut b, mut now) = (a, b, t);
    for (k, &(g, c)) in probes.iter().enumerate() {
        now += g;
        let qc = q.with_cost(c);
        let (oa, ob) = (decide(&qc, a.as_ref(), now), decide(&qc, b.as_ref(), now));
        prop_assert_eq!(
            oa,
            ob,
            "request {} of the timeline after, at +{} µs",
            k,
            now - t
        );
        if oa.allowed {
            (a, b) = (Some(oa.next), Some(ob.next));
        }
    }
    Ok(())
}

fn probes() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec(
        (
            prop_oneof![
                3 => Just(0u64),
                3 => 1u64..2_000,
                3 => 2_000u64..3_000_000,
                1 => 3_000_000u64..400_000_000,
            ],
            1u64..6,
        ),
        1..30,
    )
}

fn config(test: &str, cases: u32) -> ProptestConfig {
    crate::seed::proptest_config(&format!("limiter::settle_properties::{test}"), cases)
}

// ---------------------------------------------------------------------------------------
// Token bucket and GCRA: refunds are exact.

proptest! {
    #![proptest_config(config("refund_at_once", 400))]

    /// A refund right after its charge (no time passing, as when another rule denies the
    /// request, or the answer is one the rule does not charge for, at once) leaves exactly
    /// what the state meant before the charge: the same answers for any next request, of
    /// any cost, at any later time, and for any timeline after.
    #[test]
    fn a_bucket_refund_right_after_its_charge_undoes_it(
        setup in setup(bucket_limit(), 60),
        gap in gap(),
        after in probes(),
    ) {
        let Setup { q, start, before } = setup;
        let mut w = World::new(q, start);
        for op in before {
            w.step(op)?;
        }
        w.now = gap.after(&q, w.now);
        let was = w.state;
        let (t, o) = w.charge()?;
        // If the limit denied at first, the charge came later: the state before it is the
        // same one, asked at that later time.
        let settled = settle(&q, Some(&o.next), t, Adjust::refund_now(q.cost));
        let refunded = apply(Some(o.next), settled);
        prop_assert_eq!(level(&q, refunded.as_ref(), t), level(&q, was.as_ref(), t));
        if level(&q, was.as_ref(), t) == i128::from(q.capacity()) {
            prop_assert_eq!(settled, Settled::Clear, "a bucket full again is no state");
        }
        same_from_here(&q, refunded, was, t, &after)?;
    }
}

#[derive(Debug, Clone, Copy)]
enum Between {
    Decide {
        gap: Gap,
        cost: u64,
    },
    /// Another request's settlement: `delta` cost units taken (negative: given back).
    Settle {
        gap: Gap,
        delta: i64,
    },
}

fn between() -> impl Strategy<Value = Vec<Between>> {
    prop::collection::vec(
        prop_oneof![
            4 => (gap(), 1u64..6).prop_map(|(gap, cost)| Between::Decide { gap, cost }),
            1 => (gap(), prop_oneof![-6i64..0, 1i64..6, -120i64..120])
                .prop_map(|(gap, delta)| Between::Settle { gap, delta }),
        ],
        0..25,
    )
}

#[derive(Default)]
struct LaterTally {
    exact: AtomicUsize,
    filled: AtomicUsize,
    /// Of the exact ones, with other requests charged in between.
    exact_with_others: AtomicUsize,
}

/// World A charges request k at `t_k` and refunds it at `t_r`; world B is the same
/// timeline without request k: the other requests A charged, B charges too (B always has
/// at least A's tokens, so it always allows them), and the same settlements of others.
fn refund_later_case(
    Setup { q, start, before }: Setup,
    charge_gap: Gap,
    between: Vec<Between>,
    refund_gap: Gap,
    after: Vec<(u64, u64)>,
    tally: &LaterTally,
) -> Result<(), TestCaseError> {
    let mut w = World::new(q, start);
    for op in before {
        w.step(op)?;
    }
    w.now = charge_gap.after(&q, w.now);
    let mut b = w.state;
    let (t_k, charged) = w.charge()?;
    let mut a = Some(charged.next);
    // The precondition, exactly: in B, which never held request k's charge, the bucket
    // was never full while time passed (its level plus what dripped in since the last
    // event never went above the burst: A, k's cost lower, then got the drip B lost), and
    // no settlement in between was cut short in either world (a charge stopped at
    // max_debt, a refund stopped at full).
    let mut filled = false;
    let (mut last, mut others) = (t_k, 0usize);
    let drip_loss = |b: Option<State>, last: u64, now: u64| {
        level(&q, b.as_ref(), last) + i128::from(now - last) * i128::from(q.per_us)
            > i128::from(q.capacity())
    };
    for op in between {
        match op {
            Between::Decide { gap, cost } => {
                let now = gap.after(&q, last);
                filled |= drip_loss(b, last, now);
                let qc = q.with_cost(cost);
                let oa = decide(&qc, a.as_ref(), now);
                if oa.allowed {
                    let ob = decide(&qc, b.as_ref(), now);
                    prop_assert!(ob.allowed, "B, with more tokens, denied what A allowed");
                    (a, b) = (Some(oa.next), Some(ob.next));
                    others += 1;
                }
                last = now;
            }
            Between::Settle { gap, delta } => {
                let now = gap.after(&q, last);
                filled |= drip_loss(b, last, now);
                for s in [&mut a, &mut b] {
                    filled |= cut_short(&q, level(&q, s.as_ref(), now), delta);
                    *s = apply(*s, settle(&q, s.as_ref(), now, by(delta)));
                }
                last = now;
            }
        }
    }
    let t_r = refund_gap.after(&q, last);
    filled |= drip_loss(b, last, t_r);
    let r = reserved(&q, charged.charged.reset_us);
    let adj = adjust(&r, 0, t_r - t_k).expect("a bucket's refund is always made");
    prop_assert_eq!(adj, Adjust::refund_now(q.cost));
    let a = apply(a, settle(&q, a.as_ref(), t_r, adj));
    let (la, lb) = (level(&q, a.as_ref(), t_r), level(&q, b.as_ref(), t_r));
    if !filled {
        prop_assert_eq!(la, lb, "the refund left another level than never charging");
        same_from_here(&q, a, b, t_r, &after)?;
        tally.exact.fetch_add(1, Relaxed);
        if others > 0 {
            tally.exact_with_others.fetch_add(1, Relaxed);
        }
    } else {
        // The drip B lost while full, A kept: the refund gives it too, but never more
        // than a full bucket, and never less than never charging.
        prop_assert!(
            la <= i128::from(q.capacity()),
            "refunded above full: {}",
            la
        );
        prop_assert!(
            la >= lb,
            "the refund left less ({}) than never charging ({})",
            la,
            lb
        );
        if let Some(State::TokenBucket(t)) = a {
            prop_assert!(
                t.level < q.capacity() as i64,
                "a full bucket kept as a state"
            );
        }
        tally.filled.fetch_add(1, Relaxed);
    }
    Ok(())
}

/// On any timeline, a refunded request leaves every later decision as if it had never
/// been charged, as long as the bucket did not fill up in between; when it did, the
/// bucket is never above full (and never below never having charged it).
#[test]
fn a_bucket_refund_later_is_as_if_never_charged_unless_it_filled_up() {
    let tally = LaterTally::default();
    proptest!(config("refund_later", 500), |(
        setup in setup(bucket_limit(), 40),
        charge_gap in gap(),
        between in between(),
        refund_gap in gap(),
        after in probes(),
    )| {
        refund_later_case(setup, charge_gap, between, refund_gap, after, &tally)?;
    });
    let n = |c: &AtomicUsize| c.load(Relaxed);
    let (exact, filled) = (n(&tally.exact), n(&tally.filled));
    eprintln!(
        "refund later: {exact} exact ({} with others charged in between), {filled} filled up",
        n(&tally.exact_with_others)
    );
    assert!(exact >= 100, "only {exact} exact refunds");
    assert!(
        n(&tally.exact_with_others) >= 50,
        "few exact refunds with others between"
    );
    assert!(
        filled >= 50,
        "only {filled} refunds after the bucket filled up"
    );
}

// ---------------------------------------------------------------------------------------
// Token bucket and GCRA: the same limit, settlements included.

/// `settled`'s shape: kept, cleared, or written with this TTL.
fn shape(settled: &Settled<State>) -> (u8, u64) {
    match settled {
        Settled::Keep => (0, 0),
        Settled::Clear => (1, 0),
        Settled::Write { ttl_us, .. } => (2, *ttl_us),
    }
}

proptest! {
    #![proptest_config(config("same_limit", 300))]

    /// For the same rate, burst, max_delay and max_debt, token bucket and GCRA admit the
    /// same requests and tell the same numbers on any timeline of decisions and
    /// settlements (refunds, partial refunds, charges beyond the reservation into debt,
    /// and bare deltas either way); each settlement clears or writes alike, with the same
    /// TTL, and leaves the same level to the unit.
    #[test]
    fn token_bucket_and_gcra_are_the_same_limit_with_settlements(
        q in bucket_limit(),
        start in 0u64..1_000_000_000_000,
        timeline in prop::collection::vec(
            prop_oneof![
                4 => op().prop_map(Ok),
                1 => (gap(), -120i64..120).prop_map(Err),
            ],
            1..200,
        ),
    ) {
        let qa = Quota { algorithm: Algorithm::TokenBucket, ..q };
        let qb = Quota { algorithm: Algorithm::Gcra, ..q };
        let (mut a, mut b) = (World::new(qa, start), World::new(qb, start));
        for (i, step) in timeline.into_iter().enumerate() {
            match step {
                Ok(Op::Decide { gap, cost }) => {
                    a.now = gap.after(&q, a.now);
                    b.now = a.now;
                    let (oa, ob) = (a.decide(cost), b.decide(cost));
                    prop_assert_eq!(oa.allowed, ob.allowed, "step {}", i);
                    prop_assert_eq!(oa.charged, ob.charged, "step {}", i);
                    prop_assert_eq!(oa.uncharged, ob.uncharged, "step {}", i);
                    prop_assert_eq!(oa.ttl_us, ob.ttl_us, "step {}", i);
                }
                Ok(Op::Settle { gap, pick, real }) => {
                    a.now = gap.after(&q, a.now);
                    b.now = a.now;
                    if a.charges.is_empty() {
                        continue;
                    }
                    let k = pick % a.charges.len();
                    let ((at, ra), (_, rb)) = (a.charges.remove(k), b.charges.remove(k));
                    prop_assert_eq!(ra.reset_us, rb.reset_us, "step {}", i);
                    let cost = real.cost(ra.quota.cost);
                    let adj = adjust(&ra, cost, a.now - at);
                    prop_assert_eq!(adj, adjust(&rb, cost, a.now - at), "step {}", i);
                    if let Some(adj) = adj {
                        let sa = settle(&qa, a.state.as_ref(), a.now, adj);
                        let sb = settle(&qb, b.state.as_ref(), b.now, adj);
                        prop_assert_eq!(shape(&sa), shape(&sb), "step {}: {:?} vs {:?}", i, sa, sb);
                        a.state = apply(a.state, sa);
                        b.state = apply(b.state, sb);
                    }
                }
                Err((gap, delta)) => {
                    a.now = gap.after(&q, a.now);
                    b.now = a.now;
                    let adj = by(delta);
                    let sa = settle(&qa, a.state.as_ref(), a.now, adj);
                    let sb = settle(&qb, b.state.as_ref(), b.now, adj);
                    prop_assert_eq!(shape(&sa), shape(&sb), "step {}: {:?} vs {:?}", i, sa, sb);
                    a.state = apply(a.state, sa);
                    b.state = apply(b.state, sb);
                }
            }
            a.invariants()?;
            b.invariants()?;
            let now = a.now;
            prop_assert_eq!(
                level(&qa, a.state.as_ref(), now),
                level(&qb, b.state.as_ref(), now),
                "step {}: the levels differ", i
            );
            // What the next request would be told (a store's answer to a settlement).
            prop_assert_eq!(
                decide(&qa, a.state.as_ref(), now).uncharged,
                decide(&qb, b.state.as_ref(), now).uncharged,
                "step {}", i
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Debt.

#[derive(Default)]
struct DebtTally {
    capped: AtomicUsize,
    exact: AtomicUsize,
    denied_after: AtomicUsize,
}

/// A charge beyond the reservation (the backend reported more) on a bucket without
/// `max_delay`.
fn debt_case(
    Setup { q, start, before }: Setup,
    gap: Gap,
    delta: i64,
    tally: &DebtTally,
) -> Result<(), TestCaseError> {
    let mut w = World::new(q, start);
    for op in before {
        w.step(op)?;
    }
    let t = gap.after(&q, w.now);
    let l = level(&q, w.state.as_ref(), t);
    let floor = -i128::from(q.max_debt * q.unit);
    let took = i128::from(delta) * i128::from(q.unit);
    let settled = settle(&q, w.state.as_ref(), t, by(delta));
    let state = apply(w.state, settled);
    let after = level(&q, state.as_ref(), t);
    // Exactly the delta while that stays within max_debt below empty; else exactly
    // max_debt below empty: never further.
    if l - took >= floor {
        prop_assert_eq!(after, l - took, "the charge was not taken exactly");
        tally.exact.fetch_add(1, Relaxed);
    } else {
        prop_assert_eq!(after, floor, "the debt is not capped at max_debt");
        tally.capped.fetch_add(1, Relaxed);
    }
    // The next admission waits exactly until the debt and its own tokens have dripped
    // back, and the bucket is full again when all of it has.
    let d = decide(&q, state.as_ref(), t).uncharged;
    let need = i128::from(q.need());
    let per = i128::from(q.per_us);
    let drip = |units: i128| u64::try_from((units.max(0) + per - 1) / per).expect("a time");
    prop_assert_eq!(
        d.remaining,
        u64::try_from(after.max(0)).expect("a level") / q.unit
    );
    prop_assert_eq!(d.reset_us, drip(i128::from(q.capacity()) - after));
    if after < need {
        let retry = drip(need - after);
        prop_assert!(
            !d.allowed,
            "allowed with {} units of {} needed",
            after,
            need
        );
        prop_assert_eq!(d.retry_after_us, retry);
        prop_assert!(
            decide(&q, state.as_ref(), t + retry).allowed,
            "not allowed at its retry"
        );
        prop_assert!(
            !decide(&q, state.as_ref(), t + retry - 1).allowed,
            "allowed 1 µs early"
        );
        tally.denied_after.fetch_add(1, Relaxed);
    } else {
        prop_assert!(d.allowed);
    }
    Ok(())
}

/// A charge never takes a bucket more than max_debt below empty, and the next admission
/// waits exactly until the bucket has dripped back (token bucket and GCRA).
#[test]
fn a_bucket_debt_is_capped_at_max_debt_and_the_next_admission_waits_it_out() {
    let tally = DebtTally::default();
    proptest!(config("bucket_debt", 500), |(
        setup in setup(limit(&BUCKETS), 40),
        gap in gap(),
        delta in prop_oneof![1i64..4, 1i64..200],
    )| {
        debt_case(setup, gap, delta, &tally)?;
    });
    let n = |c: &AtomicUsize| c.load(Relaxed);
    eprintln!(
        "bucket debt: {} exact, {} capped, {} denied after",
        n(&tally.exact),
        n(&tally.capped),
        n(&tally.denied_after)
    );
    assert!(n(&tally.exact) >= 100 && n(&tally.capped) >= 100);
    assert!(n(&tally.denied_after) >= 100);
}

/// A small fixed case of each, read by a person: the numbers the properties hold.
#[test]
fn examples() {
    // Token bucket 10/s, burst 10, max_debt 10: a charge of 25 more on a full bucket
    // stops 10 below empty; the next request waits for 11 tokens: 1.1 s.
    let q = quota(Algorithm::TokenBucket, (10, 1), 10, 1, 10);
    let s = apply(None, settle(&q, None, 0, by(25)));
    let d: Decision = decide(&q, s.as_ref(), 0).uncharged;
    assert_eq!(
        (d.allowed, d.remaining, d.retry_after_us),
        (false, 0, 1_100_000)
    );
    assert_eq!(d.reset_us, 2_000_000);
    // Fixed window 5/10s: a refund 3 s into the window gives its unit back; 10 s after
    // the charge the window has closed and the refund is not made.
    let q = quota(Algorithm::FixedWindow, (5, 10), 0, 1, 5);
    let o = decide(&q, None, 0);
    let r = reserved(&q, o.charged.reset_us);
    let adj = adjust(&r, 0, 3_000_000).expect("open");
    assert_eq!(settle(&q, Some(&o.next), 3_000_000, adj), Settled::Clear);
    assert_eq!(adjust(&r, 0, 10_000_000), None);
}
