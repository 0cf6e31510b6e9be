//! Settlements of the windows (fixed and sliding): a refund goes back only into the
//! window the charge fell in, while it is open; a charge counts in the window open now,
//! capped at N + `max_debt`.

use super::*;

/// The window a state counts in: a fixed window's start, a sliding window's index.
fn window_of(state: Option<&State>) -> Option<u64> {
    match state {
        Some(State::FixedWindow(f)) => Some(f.start_us),
        Some(State::SlidingWindow(s)) => Some(s.window),
        _ => None,
    }
}

/// The count a window state holds in its own window.
fn count_of(state: Option<&State>) -> u64 {
    match state {
        Some(State::FixedWindow(f)) => f.count,
        Some(State::SlidingWindow(s)) => s.cur,
        _ => 0,
    }
}

#[derive(Default)]
struct WindowTally {
    /// Per algorithm (fixed, sliding): refunds into the open window, refunds after it
    /// closed, and of the latter, those that reached the step told the window was still
    /// open (a sliding window's next one by the gateway's clock; a later window by a
    /// gateway clock running late).
    open: [AtomicUsize; 2],
    closed: [AtomicUsize; 2],
    closed_told_open: [AtomicUsize; 2],
    cleared: AtomicUsize,
}

fn window_refund_case(
    Setup { q, start, before }: Setup,
    charge_gap: Gap,
    between: Vec<Op>,
    refund_gap: Gap,
    real: u64,
    (skew_permille, late): (u64, bool),
    tally: &WindowTally,
) -> Result<(), TestCaseError> {
    let k = usize::from(q.algorithm == Algorithm::SlidingWindow);
    let p = q.period_us();
    let mut w = World::new(q, start);
    for op in before {
        w.step(op)?;
    }
    w.now = charge_gap.after(&q, w.now);
    let (t_k, charged) = w.charge()?;
    let r = reserved(&q, charged.charged.reset_us);
    // Settled at once, the charge was still to be counted: none of the others below takes
    // it back (each settles only its own reservation).
    w.charges.pop();
    let window_k = window_of(Some(&charged.next)).expect("a window state");
    // When the charge's window ends (fixed: its start plus a period; sliding: the next
    // window starts), and the end of what the charged decision's reset names.
    let (ends, reset_at) = match q.algorithm {
        Algorithm::FixedWindow => (window_k + p, window_k + p),
        _ => ((window_k + 1) * p, (window_k + 2) * p),
    };
    prop_assert_eq!(
        t_k + charged.charged.reset_us,
        reset_at,
        "the charged reset"
    );
    for op in between {
        w.step(op)?;
    }
    let t_r = refund_gap.after(&q, w.now);
    let real = real.min(q.cost - 1);
    let refund = q.cost - real;
    let adj = adjust(&r, real, t_r - t_k);
    // A `left` off by less than half a period (the gateway's clock against the store's:
    // latency), late (too long left) or early.
    let skew = i128::from(p * skew_permille / 1000);
    let skewed = |left: i128| {
        let l = if late { left + skew } else { left - skew };
        u64::try_from(l).ok().filter(|&l| l > 0)
    };
    if t_r < ends {
        // Open: the refund goes back into it, exactly.
        prop_assert_eq!(
            adj,
            Some(Adjust {
                delta: -(refund as i64),
                left_us: Some(reset_at - t_r),
            })
        );
        let adj = adj.expect("checked");
        prop_assert_eq!(
            window_of(w.state.as_ref()),
            Some(window_k),
            "the charge's window moved"
        );
        let count = count_of(w.state.as_ref());
        prop_assert!(
            count >= q.cost,
            "the charge is no longer counted: {}",
            count
        );
        let expected = match w.state {
            Some(State::FixedWindow(_)) if count == refund => Settled::Clear,
            Some(State::FixedWindow(f)) => Settled::Write {
                next: State::FixedWindow(fixed_window::State {
                    count: count - refund,
                    ..f
                }),
                ttl_us: ends - t_r,
            },
            Some(State::SlidingWindow(s)) if count == refund && s.prev == 0 => Settled::Clear,
            Some(State::SlidingWindow(s)) => Settled::Write {
                next: State::SlidingWindow(sliding_window::State {
                    cur: count - refund,
                    ..s
                }),
                ttl_us: reset_at - t_r,
            },
            other => return Err(TestCaseError::fail(format!("not a window: {other:?}"))),
        };
        let got = settle(&q, w.state.as_ref(), t_r, adj);
        prop_assert_eq!(got, expected);
        if t_r == t_k {
            // Made at once in the same call's time frame (left unknown): the same.
            let at_once = Adjust {
                left_us: None,
                ..adj
            };
            prop_assert_eq!(settle(&q, w.state.as_ref(), t_r, at_once), got);
        }
        if let Some(left) = skewed(i128::from(reset_at - t_r)) {
            let off = Adjust {
                left_us: Some(left),
                ..adj
            };
            prop_assert_eq!(
                settle(&q, w.state.as_ref(), t_r, off),
                got,
                "left off by {}",
                skew
            );
        }
        if got == Settled::Clear {
            tally.cleared.fetch_add(1, Relaxed);
        }
        tally.open[k].fetch_add(1, Relaxed);
    } else {
        // Closed: the charge stands; nothing changes.
        let got = adj.map_or(Settled::Keep, |a| settle(&q, w.state.as_ref(), t_r, a));
        prop_assert_eq!(
            got,
            Settled::Keep,
            "a refund after its window closed: {:?}",
            adj
        );
        // Told it is still open by a late clock: the window open now is not the charge's.
        let late_left = skewed(i128::from(reset_at) - i128::from(t_r)).filter(|_| late);
        let told: Vec<u64> = [adj.and_then(|a| a.left_us), late_left]
            .into_iter()
            .flatten()
            .collect();
        for &left in &told {
            let off = Adjust {
                delta: -(refund as i64),
                left_us: Some(left),
            };
            prop_assert_eq!(
                settle(&q, w.state.as_ref(), t_r, off),
                Settled::Keep,
                "left {}",
                left
            );
        }
        if !told.is_empty() && count_of(w.state.as_ref()) > 0 {
            tally.closed_told_open[k].fetch_add(1, Relaxed);
        }
        tally.closed[k].fetch_add(1, Relaxed);
    }
    Ok(())
}

/// A window's refund (whole or partial, timed as the gateway times it) goes back into the
/// window the charge fell in, exactly, while that window is open; once it has closed
/// (fixed: its end passed; sliding: the next window started) it changes nothing. Other
/// requests' settlements in between never take back this charge.
#[test]
fn a_window_refund_goes_back_only_into_the_charges_open_window() {
    let tally = WindowTally::default();
    proptest!(config("window_refund", 600), |(
        setup in setup(limit(&WINDOWS), 40),
        charge_gap in gap(),
        between in ops(0..8),
        refund_gap in gap(),
        real in prop_oneof![Just(0u64), 0u64..8],
        skew in (0u64..500, any::<bool>()),
    )| {
        window_refund_case(setup, charge_gap, between, refund_gap, real, skew, &tally)?;
    });
    let load = |c: &[AtomicUsize; 2]| c.each_ref().map(|v| v.load(Relaxed));
    let (open, closed, reached) = (
        load(&tally.open),
        load(&tally.closed),
        load(&tally.closed_told_open),
    );
    eprintln!(
        "window refunds (fixed, sliding): open {open:?}, closed {closed:?} (of which \
         told still open {reached:?}), {} cleared",
        tally.cleared.load(Relaxed)
    );
    for k in 0..2 {
        assert!(open[k] >= 60 && closed[k] >= 30, "{k}: {open:?} {closed:?}");
    }
    // A fixed window is told so only by a late clock; a sliding one by the gateway's too.
    assert!(
        reached[0] >= 5 && reached[1] >= 30,
        "refunds told a closed window is open: {reached:?}"
    );
    assert!(tally.cleared.load(Relaxed) >= 10);
}

fn window_charge_case(
    Setup { q, start, before }: Setup,
    gap: Gap,
    delta: i64,
    left: Option<u64>,
) -> Result<(), TestCaseError> {
    let p = q.period_us();
    let most = q.rate.count + q.max_debt;
    let mut w = World::new(q, start);
    for op in before {
        w.step(op)?;
    }
    let t = gap.after(&q, w.now);
    let add = delta.unsigned_abs();
    let capped = |count: u64| (count + add).min(count.max(most));
    // The window open at `t`, and what it holds.
    let expected = match w.state {
        Some(State::FixedWindow(f)) if t < f.start_us + p => (
            State::FixedWindow(fixed_window::State {
                count: capped(f.count),
                ..f
            }),
            f.start_us + p - t,
        ),
        _ if q.algorithm == Algorithm::FixedWindow => (
            State::FixedWindow(fixed_window::State {
                start_us: t,
                count: capped(0),
            }),
            p,
        ),
        state => {
            let window = t / p;
            let (prev, cur) = match state {
                Some(State::SlidingWindow(s)) if s.window == window => (s.prev, s.cur),
                Some(State::SlidingWindow(s)) if s.window + 1 == window => (s.cur, 0),
                _ => (0, 0),
            };
            (
                State::SlidingWindow(sliding_window::State {
                    window,
                    cur: capped(cur),
                    prev,
                }),
                (window + 2) * p - t,
            )
        }
    };
    let got = settle(
        &q,
        w.state.as_ref(),
        t,
        Adjust {
            delta,
            left_us: left,
        },
    );
    prop_assert_eq!(
        got,
        Settled::Write {
            next: expected.0,
            ttl_us: expected.1
        }
    );
    // Whatever window the reservation fell in: a charge counts in the one open now.
    prop_assert_eq!(got, settle(&q, w.state.as_ref(), t, by(delta)));
    let state = Some(expected.0);
    prop_assert!(
        count_of(state.as_ref()) <= most,
        "counted past N + max_debt"
    );
    // The next admission's retry is exact.
    let d = decide(&q, state.as_ref(), t).uncharged;
    if !d.allowed {
        let at = t + d.retry_after_us;
        prop_assert!(
            decide(&q, state.as_ref(), at).allowed,
            "not allowed at its retry"
        );
        prop_assert!(
            !decide(&q, state.as_ref(), at - 1).allowed,
            "allowed 1 µs early"
        );
    }
    // A debt never outlives its window (a sliding window's: the one it weighs in after).
    let gone = t + expected.1;
    prop_assert_eq!(decide(&q, state.as_ref(), gone), decide(&q, None, gone));
    Ok(())
}

proptest! {
    #![proptest_config(config("window_charge", 500))]

    /// A charge beyond the reservation counts in the window open when it is settled
    /// (a fresh one if none is; whatever window the reservation fell in), up to N +
    /// max_debt and no further; the next admission's retry is exact, and the debt is
    /// gone with the window it counts in.
    #[test]
    fn a_window_charge_counts_in_the_open_window_capped_at_n_plus_max_debt(
        setup in setup(limit(&WINDOWS), 40),
        gap in gap(),
        delta in prop_oneof![1i64..4, 1i64..3_000],
        left in prop_oneof![Just(None), (0u64..200_000_000).prop_map(Some)],
    ) {
        window_charge_case(setup, gap, delta, left)?;
    }
}
