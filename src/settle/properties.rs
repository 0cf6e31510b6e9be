//! Property tests of settlements (issues 27 and 41; [`crate::limiter::settle`]): random timelines
//! of decisions, refunds and charges beyond the reservation, exact claims about what each
//! leaves behind. The Lua twins are held to the same answers by tests/it/settle_agree.rs.
//!
//! A settlement here is made as the gateway makes it: a reservation ([`Reserved`]) settled
//! at a real cost through [`adjust`], which names the window the charge fell in as the
//! charged decision named it; or, for another request's settlement in the middle of a
//! timeline, a bare [`Adjust`].
//!
//! What issue 41 added, each a property that failed before it: a reported cost is charged
//! in full on every algorithm, so a client reporting far more than it reserves gets no
//! more than the limit (`a_client_reporting_more_than_it_reserved_gets_no_more_than_the_limit`);
//! a clock stepped back and forth between charges and settlements never moves a state's
//! time back nor refills a stretch twice (`a_clock_stepping_back_and_forth_never_refills_twice`);
//! a window's refund goes only into the window its charge fell in (windows.rs).

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::reservation::{adjust, Reserved};
use crate::identity::digest_api_key;
use crate::limiter::properties::{gap_us, rate};
use crate::limiter::{
    decide, token_bucket, Adjust, Algorithm, Decision, Quota, Rate, Ruling, Settled, State,
    MAX_LEVEL,
};

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

/// A limit of one of `algorithms`: any rate, burst and cost; no borrowing (the default),
/// one cost unit, a burst's worth or three.
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

/// A reservation of `q.cost` charged in the window `window` (as its decision named it).
fn reserved(q: &Quota, window: u64) -> Reserved {
    Reserved {
        identity: digest_api_key(b"settle-properties"),
        rule: Arc::from("r"),
        quota: *q,
        shadow: false,
        window,
    }
}

/// A bare settlement of `delta` cost units (another request's, in a timeline; a refund
/// of one names no live window).
fn by(delta: i64) -> Adjust {
    Adjust {
        delta,
        window: u64::MAX,
    }
}

/// [`crate::limiter::settle`], its state only; a test of ordinary sizes is never forgiven anything.
fn settle(q: &Quota, state: Option<&State>, now: u64, adj: Adjust) -> Settled<State> {
    let (settled, forgiven) = crate::limiter::settle(q, state, now, adj);
    assert_eq!(forgiven, 0, "forgiven at ordinary sizes: {q:?} {adj:?}");
    settled
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
    fn decide(&mut self, cost: u64) -> Ruling<State> {
        let q = self.q.with_cost(cost);
        let o = decide(&q, self.state.as_ref(), self.now);
        if o.allowed {
            self.state = Some(o.next);
            self.charges
                .push((self.now, reserved(&q, o.charged.window)));
        }
        o
    }

    /// A charge of the limit's own cost now; if the limit denies it, at the instant its
    /// denial names (where it passes: `retry_after_is_exact_for_every_algorithm`).
    fn charge(&mut self) -> Result<(u64, Ruling<State>), TestCaseError> {
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
                let (_, r) = self.charges.remove(pick % self.charges.len());
                if let Some(adj) = adjust(&r, real.cost(r.quota.cost)) {
                    let s = settle(&self.q, self.state.as_ref(), self.now, adj);
                    self.state = apply(self.state, s);
                }
            }
        }
        self.invariants()
    }

    /// What no timeline of decisions and settlements may break: a bucket is never above
    /// full, nor below what Lua's numbers hold; a window's count fits them too.
    fn invariants(&self) -> Result<(), TestCaseError> {
        let q = &self.q;
        match self.state {
            Some(State::FixedWindow(f)) => {
                prop_assert!(f.count <= MAX_LEVEL, "{} counted: {:?}", f.count, q);
            }
            Some(State::SlidingWindow(s)) => {
                prop_assert!(s.cur <= MAX_LEVEL, "{} counted: {:?}", s.cur, q);
            }
            _ if q.algorithm.has_burst() => {
                let l = level(q, self.state.as_ref(), self.now);
                let floor = i128::from(q.capacity()) - i128::from(MAX_LEVEL);
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

/// Whether a settlement of `delta` on a bucket at `level` is cut short: a refund stopped
/// at full (a charge is always taken whole, at these sizes).
fn cut_short(q: &Quota, level: i128, delta: i64) -> bool {
    let units = i128::from(delta) * i128::from(q.unit);
    level - units > i128::from(q.capacity())
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
    prop::collection::vec((gap_us(3_000_000, 400_000_000), 1u64..6), 1..30)
}

// ---------------------------------------------------------------------------------------
// Token bucket and GCRA: refunds are exact.

crate::proptest_seeds! {
    #![cases(400)]

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
        let settled = settle(&q, Some(&o.next), t, Adjust::refund(q.cost, &o.charged));
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
    // a refund stopped at full).
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
    let r = reserved(&q, charged.charged.window);
    let adj = adjust(&r, 0).expect("a bucket's refund is always made");
    prop_assert_eq!(adj, Adjust::refund(q.cost, &charged.charged));
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
    crate::proptest_seeds!("settle::properties::refund_later", 500, |(
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

crate::proptest_seeds! {
    #![cases(300)]

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
                    let ((_, ra), (_, rb)) = (a.charges.remove(k), b.charges.remove(k));
                    prop_assert_eq!(ra.window, rb.window, "step {}", i);
                    let cost = real.cost(ra.quota.cost);
                    let adj = adjust(&ra, cost);
                    prop_assert_eq!(adj, adjust(&rb, cost), "step {}", i);
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
// Debt: a reported cost is charged in full.

#[derive(Default)]
struct DebtTally {
    /// The next admission still passes at once (within what may be borrowed).
    within: AtomicUsize,
    /// It waits: the bucket is in debt past what may be borrowed.
    waits: AtomicUsize,
    /// Of those, charges past a whole burst below empty (forgiven before issue 41).
    past_a_burst: AtomicUsize,
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
    let took = i128::from(delta) * i128::from(q.unit);
    let state = apply(w.state, settle(&q, w.state.as_ref(), t, by(delta)));
    let after = level(&q, state.as_ref(), t);
    // Exactly the delta, however deep: nothing forgiven.
    prop_assert_eq!(after, l - took, "the charge was not taken whole");
    if after < -i128::from(q.capacity()) {
        tally.past_a_burst.fetch_add(1, Relaxed);
    }
    // The next admission passes while it leaves the bucket no deeper than what may be
    // borrowed; else it waits exactly until the bucket has dripped back that far; the
    // bucket is full again once all of it has.
    let d = decide(&q, state.as_ref(), t).uncharged;
    let need = i128::from(q.need());
    let borrow = i128::from(q.borrow());
    let per = i128::from(q.per_us);
    let drip = |units: i128| u64::try_from((units.max(0) + per - 1) / per).expect("a time");
    prop_assert_eq!(
        d.remaining,
        u64::try_from(after.max(0)).expect("a level") / q.unit
    );
    prop_assert_eq!(d.reset_us, drip(i128::from(q.capacity()) - after));
    if after - need < -borrow {
        let retry = drip(need - borrow - after);
        prop_assert!(!d.allowed, "allowed {} units deep", after - need);
        prop_assert_eq!(d.retry_after_us, retry);
        prop_assert!(
            decide(&q, state.as_ref(), t + retry).allowed,
            "not allowed at its retry"
        );
        prop_assert!(
            !decide(&q, state.as_ref(), t + retry - 1).allowed,
            "allowed 1 µs early"
        );
        tally.waits.fetch_add(1, Relaxed);
    } else {
        prop_assert!(d.allowed);
        tally.within.fetch_add(1, Relaxed);
    }
    Ok(())
}

/// A charge beyond the reservation is taken whole, however far below empty it goes (and
/// whatever `max_debt`, which only lets a request borrow ahead), and the next admission
/// waits exactly until the bucket has dripped back (token bucket and GCRA).
#[test]
fn a_bucket_charge_is_taken_whole_and_the_next_admission_waits_it_out() {
    let tally = DebtTally::default();
    crate::proptest_seeds!("settle::properties::bucket_debt", 500, |(
        setup in setup(limit(&BUCKETS), 40),
        gap in gap(),
        delta in prop_oneof![1i64..4, 1i64..200, 200i64..100_000],
    )| {
        debt_case(setup, gap, delta, &tally)?;
    });
    let n = |c: &AtomicUsize| c.load(Relaxed);
    eprintln!(
        "bucket debt: {} within what may be borrowed, {} waiting ({} past a whole burst)",
        n(&tally.within),
        n(&tally.waits),
        n(&tally.past_a_burst)
    );
    assert!(n(&tally.within) >= 50 && n(&tally.waits) >= 150);
    assert!(n(&tally.past_a_burst) >= 50);
}

// ---------------------------------------------------------------------------------------
// The worst a client that reports more than it reserves can do.

/// What a greedy client got over a span: how many requests it was let through, each
/// reported at `report`, and the span.
struct Greedy {
    admitted: u64,
    span_us: u64,
}

/// A client that fires `at_once` requests whenever it may (each reserving the rule's
/// cost), every answer then reporting `report`, settled at once; denied, it comes back at
/// the instant its denial names. For `periods` periods of the rule.
fn greedy(q: &Quota, start: u64, report: u64, at_once: u64, periods: u64) -> Greedy {
    let end = start + periods * q.period_us();
    let (mut state, mut now, mut admitted) = (None::<State>, start, 0u64);
    while now < end {
        let mut charged = Vec::new();
        let mut wait = 1;
        for _ in 0..at_once {
            let o = decide(q, state.as_ref(), now);
            if !o.allowed {
                wait = o.uncharged.retry_after_us.max(1);
                break;
            }
            state = Some(o.next);
            charged.push(o.charged);
        }
        for d in &charged {
            let r = reserved(q, d.window);
            if let Some(adj) = adjust(&r, report) {
                state = apply(state, settle(q, state.as_ref(), now, adj));
            }
        }
        admitted += charged.len() as u64;
        now += wait;
    }
    Greedy {
        admitted,
        span_us: end - start,
    }
}

crate::proptest_seeds! {
    #![cases(120)]

    /// A client that reserves a request's cost and reports far more (a burst and one, ten
    /// bursts), firing several at once and coming back the instant it may: everything it
    /// was charged is what the limit pays for over the span — the burst (a window's N),
    /// what `max_debt` lets it borrow, the rate over the span (a sliding window: one more
    /// period's N, its estimate's bound) — plus the last round's reported costs, which it
    /// still owes when the span ends. Before issue 41 a debt past `max_debt` was dropped:
    /// 10.95× the limit for a client reporting a burst and one with `max_debt = 0`.
    #[test]
    fn a_client_reporting_more_than_it_reserved_gets_no_more_than_the_limit(
        q in limit(&[Algorithm::TokenBucket, Algorithm::Gcra, Algorithm::FixedWindow, Algorithm::SlidingWindow]),
        start in 0u64..1_000_000_000_000,
        report_bursts in prop_oneof![Just(0u64), Just(1), Just(10)],
        at_once in 1u64..4,
    ) {
        let report = q.burst * report_bursts + q.cost + 1;
        let periods = 40;
        let g = greedy(&q, start, report, at_once, periods);
        let n = u128::from(q.rate.count);
        let span_periods = u128::from(g.span_us.div_ceil(q.period_us()));
        let paid = match q.algorithm {
            Algorithm::TokenBucket | Algorithm::Gcra => u128::from(q.burst) + n * span_periods,
            Algorithm::FixedWindow => n * (span_periods + 1),
            _ => n * (span_periods + 2),
        };
        let bound = paid + u128::from(q.max_debt) + u128::from(at_once) * u128::from(report);
        let charged = u128::from(g.admitted) * u128::from(report);
        prop_assert!(
            charged <= bound,
            "{} requests reporting {} each: {} charged, the limit pays for {} ({:?})",
            g.admitted,
            report,
            charged,
            bound,
            q
        );
    }
}

// ---------------------------------------------------------------------------------------
// A clock stepping back and forth.

/// One event of a timeline read on a clock that steps: the true time moves on by `gap`;
/// the clock reads it `back` µs behind (0: right).
#[derive(Debug, Clone, Copy)]
struct Stepped {
    op: Op,
    back: u64,
}

fn stepped() -> impl Strategy<Value = Vec<Stepped>> {
    prop::collection::vec(
        (
            op(),
            prop_oneof![
                3 => Just(0u64),
                1 => 1u64..5_000,
                1 => 5_000u64..3_000_000,
                1 => 3_000_000u64..120_000_000,
            ],
        )
            .prop_map(|(op, back)| Stepped { op, back }),
        1..150,
    )
}

/// The time a state says it was last changed at, where it has one that must never move
/// back while the state lives: a token bucket's last charge, a window's start or index.
fn state_time(state: Option<&State>) -> Option<u64> {
    match state {
        Some(State::TokenBucket(t)) => Some(t.last_us),
        Some(State::FixedWindow(f)) => Some(f.start_us),
        Some(State::SlidingWindow(s)) => Some(s.window),
        _ => None,
    }
}

fn clock_case(q: Quota, start: u64, timeline: Vec<Stepped>) -> Result<(), TestCaseError> {
    let mut w = World::new(q, start);
    let mut truth = start;
    let mut reading = start;
    // While a bucket's state lives: the reading it was made at, the furthest reading
    // since, and the units it rose by between events (its drip, as the step functions
    // judge it). A key whole again (no state) remembers no time: the next starts afresh.
    let mut life: Option<(u64, u64, i128)> = None;
    let mut time = state_time(None);
    for (i, s) in timeline.into_iter().enumerate() {
        let gap = match s.op {
            Op::Decide { gap, .. } | Op::Settle { gap, .. } => gap,
        };
        truth = gap.after(&q, truth);
        let now = truth.saturating_sub(s.back).max(start);
        if let Some((_, furthest, credited)) = life.as_mut() {
            *credited += level(&q, w.state.as_ref(), now) - level(&q, w.state.as_ref(), reading);
            *furthest = (*furthest).max(now);
        }
        reading = now;
        // The op at `now` (its own gap already taken).
        w.now = now;
        let op = match s.op {
            Op::Decide { cost, .. } => Op::Decide {
                gap: Gap::Micros(0),
                cost,
            },
            Op::Settle { pick, real, .. } => Op::Settle {
                gap: Gap::Micros(0),
                pick,
                real,
            },
        };
        w.step(op)?;
        let t = state_time(w.state.as_ref());
        if let (Some(before), Some(after)) = (time, t) {
            prop_assert!(
                after >= before,
                "step {}: the state's time moved back from {} to {}",
                i,
                before,
                after
            );
        }
        time = t;
        life = match (life, w.state.is_some() && q.algorithm.has_burst()) {
            (_, false) => None,
            (None, true) => Some((now, now, 0)),
            (alive, true) => alive,
        };
        if let Some((born, furthest, credited)) = life {
            let most = i128::from(furthest - born) * i128::from(q.per_us);
            prop_assert!(
                credited <= most,
                "step {}: {} units refilled over the {} µs the clock covered ({} at most)",
                i,
                credited,
                furthest - born,
                most
            );
        }
    }
    Ok(())
}

crate::proptest_seeds! {
    #![cases(400)]

    /// On a clock that steps back (a Redis failover to a host behind, an NTP step) and
    /// forward again between decisions and settlements, no state's time ever moves back,
    /// and a bucket never refills the same stretch twice: what it rose by between events,
    /// in all, is at most what drips in over the span the clock actually covered. Before
    /// issue 41 a settlement at a stepped-back time wrote that time into a token bucket's
    /// state, and the stretch was refilled again when the clock caught up.
    #[test]
    fn a_clock_stepping_back_and_forth_never_refills_twice(
        q in prop_oneof![bucket_limit(), limit(&WINDOWS)],
        start in 1_000_000_000u64..1_000_000_000_000,
        timeline in stepped(),
    ) {
        clock_case(q, start, timeline)?;
    }
}

/// A small fixed case of each, read by a person: the numbers the properties hold.
#[test]
fn examples() {
    // Token bucket 10/s, burst 10: a charge of 25 more on a full bucket takes it 15 below
    // empty; the next request waits for 16 tokens: 1.6 s; full again in 2.5 s.
    let q = quota(Algorithm::TokenBucket, (10, 1), 10, 1, 0);
    let s = apply(None, settle(&q, None, 0, by(25)));
    let d: Decision = decide(&q, s.as_ref(), 0).uncharged;
    assert_eq!(
        (d.allowed, d.remaining, d.retry_after_us),
        (false, 0, 1_600_000)
    );
    assert_eq!(d.reset_us, 2_500_000);
    // With max_debt = 5 the request borrows ahead: it passes once 11 tokens are back.
    let q5 = q.with_max_debt(5).expect("fits");
    let d = decide(&q5, s.as_ref(), 0).uncharged;
    assert_eq!((d.allowed, d.retry_after_us), (false, 1_100_000));
    assert!(decide(&q5, s.as_ref(), 1_100_000).allowed);
    // Fixed window 5/10s: a refund into the charge's window gives its unit back; once a
    // new window has opened, it changes nothing there.
    let q = quota(Algorithm::FixedWindow, (5, 10), 0, 1, 0);
    let o = decide(&q, None, 0);
    let r = reserved(&q, o.charged.window);
    let adj = adjust(&r, 0).expect("a refund");
    assert_eq!(settle(&q, Some(&o.next), 3_000_000, adj), Settled::Clear);
    let next = decide(&q, Some(&o.next), 10_000_000);
    assert_eq!(settle(&q, Some(&next.next), 10_000_001, adj), Settled::Keep);
    // A charge of 12 more on a 5/10s window: 13 counted; the next window starts at 8,
    // the one after at 3, and a request passes once 3 + 1 fits: in the third window.
    let s = apply(Some(o.next), settle(&q, Some(&o.next), 1, by(12)));
    let d = decide(&q, s.as_ref(), 1).uncharged;
    assert!(!d.allowed);
    assert_eq!(d.retry_after_us, 10_000_000 - 1 + 10_000_000);
}
