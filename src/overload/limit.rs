//! The adaptive concurrency limit of a pool: a gradient controller after Netflix
//! concurrency-limits' `Gradient2Limit`, on an injected clock (every method takes `now`).
//!
//! Each answered request is a sample: its latency from send to the answer's head, and how
//! many requests were in flight when it was sent. Samples gather in windows (at least
//! [`WINDOW`] and [`WINDOW_SAMPLES`] samples); at each window's end, its mean latency is
//! the short-term RTT, and
//!
//! ```text
//! long     = long + (short - long) / LONG_WINDOWS      (exponential average, kept within
//!                                                       [floor, floor * LONG_OVER_FLOOR])
//! gradient = clamp(long / short, 0.5, 1)
//! new      = limit * gradient + sqrt(limit)             (the queue the backend may hold)
//! limit    = limit * (1 - SMOOTHING) + new * SMOOTHING, clamped to [min_limit, max_limit]
//! ```
//!
//! unless the window was *app-limited* (fewer than half the limit in flight at its
//! busiest): then nothing about the backend's capacity was learnt, and the limit stays.
//!
//! **The floor** is the backend's latency unloaded: the mean latency of the requests sent
//! while at most `min_limit` were in flight, once [`WINDOW_SAMPLES`] of them are in (a
//! lower mean is taken at once, a higher one at a renewal). Until that many came, the mean
//! of those there are stands in, *provisional*: traffic that stays above `min_limit` in
//! flight (steady load at half capacity) may offer only its first few requests. A mean, as the short-term RTT
//! is: the least single latency would stand below every window's mean for a backend whose
//! latency varies (±50% around 100 ms: a floor of 50 against windows of 100), and the
//! limit would fall below the backend's knee, shedding what it could serve. Gradient2's
//! long-term average alone
//! follows a sustained overload up (it is an average of overloaded windows), and the limit
//! with it; the floor bounds it. The floor is renewed every `probe_interval` (±25%
//! jitter, so that gateways do not renew together) from the last period's low-concurrency
//! requests, kept where there were none. It is measured from the traffic as it comes, and
//! the limit is never lowered to probe it — so a probe sheds nothing (Envoy's adaptive
//! concurrency filter lowers its limit to `min_concurrency` to measure, which sheds
//! requests that would have been served: envoyproxy/envoy#8337). Where the backend became
//! slower for good, the stale floor makes every window look overloaded, the limit falls to
//! `min_limit`, requests then go at low concurrency, and the next renewal takes the new
//! floor.

use std::time::{Duration, Instant};

/// A window lasts at least this long...
pub const WINDOW: Duration = Duration::from_millis(100);
/// ...and holds at least this many samples.
pub const WINDOW_SAMPLES: u32 = 10;
/// The long-term RTT's memory, in windows.
const LONG_WINDOWS: f64 = 20.0;
/// How far above the floor the long-term RTT may go.
const LONG_OVER_FLOOR: f64 = 1.25;
/// The share of each window's new limit taken (Gradient2's `smoothing`).
const SMOOTHING: f64 = 0.2;
/// Where a limit starts (Gradient2's `initialLimit`), within `[min_limit, max_limit]`.
pub const INITIAL: u32 = 20;

/// An adaptive limit's settings (`overload = { adaptive = true, … }`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adaptive {
    pub min_limit: u32,
    pub max_limit: u32,
    pub probe_interval: Duration,
}

/// The controller of one pool.
#[derive(Debug)]
pub struct Gradient {
    settings: Adaptive,
    limit: f64,
    /// The long-term RTT, seconds (none before the first window).
    long: Option<f64>,
    /// The floor now (provisional while fewer than [`WINDOW_SAMPLES`] requests made it),
    /// and the low-concurrency latencies of the current period.
    floor: Option<f64>,
    provisional: bool,
    period: Low,
    /// When the current period ends (the floor is renewed).
    renew_at: Instant,
    window: Window,
}

/// The latencies of the requests sent at low concurrency (at most `min_limit` in flight)
/// in one period: their sum and count.
#[derive(Debug, Default)]
struct Low {
    sum: f64,
    samples: u32,
}

impl Low {
    /// Their mean, once there are enough of them to stand for the backend unloaded.
    fn mean(&self) -> Option<f64> {
        (self.samples >= WINDOW_SAMPLES).then(|| self.sum / f64::from(self.samples))
    }
}

#[derive(Debug)]
struct Window {
    started: Instant,
    samples: u32,
    sum: f64,
    /// The most requests in flight any of its samples was sent with.
    busiest: u32,
}

impl Window {
    fn new(now: Instant) -> Window {
        Window {
            started: now,
            samples: 0,
            sum: 0.0,
            busiest: 0,
        }
    }
}

impl Gradient {
    /// A controller starting at [`INITIAL`] at `now`; `jitter` in [0, 1) places its first
    /// renewal within the probe interval's ±25%.
    pub fn new(settings: Adaptive, now: Instant, jitter: f64) -> Gradient {
        Gradient {
            limit: f64::from(INITIAL.clamp(settings.min_limit, settings.max_limit)),
            long: None,
            floor: None,
            provisional: false,
            period: Low::default(),
            renew_at: now + jittered(settings.probe_interval, jitter),
            window: Window::new(now),
            settings,
        }
    }

    /// The limit now: how many requests may be in flight.
    pub fn limit(&self) -> u32 {
        self.limit as u32
    }

    /// The floor now (none before a request went at low concurrency).
    pub fn floor(&self) -> Option<Duration> {
        self.floor.map(Duration::from_secs_f64)
    }

    /// The long-term RTT now.
    pub fn long(&self) -> Option<Duration> {
        self.long.map(Duration::from_secs_f64)
    }

    /// A request sent with `in_flight` requests in flight (itself included) answered in
    /// `rtt`, at `now`. `jitter` in [0, 1): where the next renewal falls, if this sample
    /// ends a period.
    pub fn sample(&mut self, now: Instant, rtt: Duration, in_flight: u32, jitter: f64) {
        let rtt = rtt.as_secs_f64();
        if in_flight <= self.settings.min_limit {
            self.period.sum += rtt;
            self.period.samples += 1;
            // A lower floor is taken at once (the first one included: the first requests,
            // which open connections, are slower, and a floor too high would let the
            // limit settle above the backend's knee); a higher one only at a renewal,
            // from a whole period of low-concurrency requests.
            match self.period.mean() {
                Some(m) => {
                    let lower = self.floor.filter(|_| !self.provisional).map(|f| f.min(m));
                    self.floor = Some(lower.unwrap_or(m));
                    self.provisional = false;
                }
                // Fewer than enough: the mean of those there are, until enough are in.
                None if self.floor.is_none() || self.provisional => {
                    self.floor = Some(self.period.sum / f64::from(self.period.samples));
                    self.provisional = true;
                }
                None => {}
            }
        }
        if now >= self.renew_at {
            // A period with too few low-concurrency requests keeps the floor it had.
            if let Some(m) = std::mem::take(&mut self.period).mean() {
                self.floor = Some(m);
                self.provisional = false;
            }
            self.renew_at = now + jittered(self.settings.probe_interval, jitter);
        }
        let w = &mut self.window;
        w.samples += 1;
        w.sum += rtt;
        w.busiest = w.busiest.max(in_flight);
        if w.samples < WINDOW_SAMPLES || now.duration_since(w.started) < WINDOW {
            return;
        }
        let short = w.sum / f64::from(w.samples);
        let busiest = w.busiest;
        self.window = Window::new(now);
        self.update(short, busiest);
    }

    fn update(&mut self, short: f64, busiest: u32) {
        let Some(floor) = self.floor else {
            // Nothing to judge latency against yet.
            return;
        };
        let long = match self.long {
            None => short,
            Some(l) => l + (short - l) / LONG_WINDOWS,
        };
        let long = long.clamp(floor, floor * LONG_OVER_FLOOR);
        self.long = Some(long);
        if f64::from(busiest) < self.limit / 2.0 {
            return;
        }
        let gradient = if short > 0.0 {
            (long / short).clamp(0.5, 1.0)
        } else {
            1.0
        };
        let new = self.limit * gradient + self.limit.sqrt();
        let smoothed = self.limit * (1.0 - SMOOTHING) + new * SMOOTHING;
        self.limit = smoothed.clamp(
            f64::from(self.settings.min_limit),
            f64::from(self.settings.max_limit),
        );
    }
}

/// `interval` moved by up to ±25%, `jitter` in [0, 1) saying where.
fn jittered(interval: Duration, jitter: f64) -> Duration {
    interval.mul_f64(0.75 + 0.5 * jitter.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn settings() -> Adaptive {
        Adaptive {
            min_limit: 4,
            max_limit: 1000,
            probe_interval: Duration::from_secs(30),
        }
    }

    /// One window of `WINDOW_SAMPLES` samples of `rtt` sent at `in_flight`, ending a
    /// window's length after `*now`.
    fn window(g: &mut Gradient, now: &mut Instant, rtt: Duration, in_flight: u32) {
        for i in 0..WINDOW_SAMPLES {
            let t = *now + WINDOW * (i + 1) / WINDOW_SAMPLES;
            g.sample(t, rtt, in_flight, 0.5);
        }
        *now += WINDOW;
    }

    /// A backend of 16 servers of 20 ms each: at `c` in flight, a request takes 20 ms up
    /// to 16, then waits its turn (20 ms · c/16).
    fn knee(c: u32) -> Duration {
        MS * 20 * c.max(16) / 16
    }

    #[test]
    fn it_starts_at_the_initial_limit_within_its_bounds() {
        let t = Instant::now();
        assert_eq!(Gradient::new(settings(), t, 0.0).limit(), INITIAL);
        let low = Adaptive {
            max_limit: 8,
            ..settings()
        };
        assert_eq!(Gradient::new(low, t, 0.0).limit(), 8);
        let high = Adaptive {
            min_limit: 50,
            ..settings()
        };
        assert_eq!(Gradient::new(high, t, 0.0).limit(), 50);
    }

    #[test]
    fn the_limit_grows_while_latency_stays_at_the_floor() {
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now, 0.0);
        window(&mut g, &mut now, 20 * MS, 1);
        assert_eq!(g.floor(), Some(20 * MS));
        let mut last = g.limit();
        for _ in 0..20 {
            // Busy (the limit in flight), latency unchanged: the backend is not the
            // bottleneck.
            let limit = g.limit();
            window(&mut g, &mut now, 20 * MS, limit);
            assert!(g.limit() >= last, "{} fell below {last}", g.limit());
            last = g.limit();
        }
        assert!(last > 40, "grew only to {last}");
    }

    #[test]
    fn the_gradient_is_long_over_short_clamped_and_smoothed() {
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now, 0.0);
        // The floor 10 ms (the first window's, app-limited: long = 10 ms), then a window
        // at 20 in flight twice as slow: long = 10 + (20 - 10)/20 = 10.5 ms, gradient
        // 10.5/20 = 0.525; new = 20·0.525 + √20 = 14.97; limit = 20·0.8 + 14.97·0.2.
        window(&mut g, &mut now, 10 * MS, 2);
        let before = g.limit;
        assert_eq!(before, 20.0);
        window(&mut g, &mut now, 20 * MS, 20);
        let expected = 20.0 * 0.8 + (20.0 * 0.525 + 20f64.sqrt()) * 0.2;
        assert!(
            (g.limit - expected).abs() < 1e-9,
            "{} vs {expected}",
            g.limit
        );
        assert_eq!(g.long(), Some(Duration::from_secs_f64(0.0105)));
        // Ten times slower: the gradient is clamped at 0.5.
        let l = g.limit;
        window(&mut g, &mut now, 200 * MS, 20);
        let expected = l * 0.8 + (l * 0.5 + l.sqrt()) * 0.2;
        assert!(
            (g.limit - expected).abs() < 1e-9,
            "{} vs {expected}",
            g.limit
        );
    }

    #[test]
    fn an_app_limited_window_leaves_the_limit_alone() {
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now, 0.0);
        window(&mut g, &mut now, 10 * MS, 1);
        // Slow, but with 9 in flight of 20 (< half): the slowness is not the limit's doing.
        for _ in 0..10 {
            window(&mut g, &mut now, 100 * MS, 9);
        }
        assert_eq!(g.limit(), INITIAL);
    }

    #[test]
    fn behind_a_knee_backend_the_limit_settles_near_the_knee() {
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now, 0.0);
        window(&mut g, &mut now, knee(1), 1);
        // Demand far above capacity: the limit is always full.
        for _ in 0..600 {
            let c = g.limit();
            window(&mut g, &mut now, knee(c), c);
        }
        let l = g.limit();
        assert!((16..=32).contains(&l), "settled at {l}, knee 16");
    }

    #[test]
    fn the_limit_stays_within_min_and_max() {
        let mut now = Instant::now();
        let s = Adaptive {
            min_limit: 6,
            max_limit: 30,
            ..settings()
        };
        let mut g = Gradient::new(s, now, 0.0);
        window(&mut g, &mut now, MS, 1);
        for _ in 0..200 {
            let c = g.limit();
            window(&mut g, &mut now, MS, c);
        }
        assert_eq!(g.limit(), 30);
        for _ in 0..200 {
            let c = g.limit();
            window(&mut g, &mut now, 1000 * MS, c);
        }
        assert_eq!(g.limit(), 6);
    }

    /// `WINDOW_SAMPLES` samples of `rtt` sent at `in_flight`, all answered at `at`: enough
    /// low-concurrency requests for a floor.
    fn burst(g: &mut Gradient, at: Instant, rtt: Duration, in_flight: u32) {
        for _ in 0..WINDOW_SAMPLES {
            g.sample(at, rtt, in_flight, 0.5);
        }
    }

    #[test]
    fn the_floor_is_renewed_each_probe_interval_from_low_concurrency_requests_only() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // jitter 0.5: every period is exactly the interval (30 s).
        let mut g = Gradient::new(settings(), t0, 0.5);
        burst(&mut g, t0, 10 * MS, 1);
        assert_eq!(g.floor(), Some(10 * MS));
        // The backend became slower for good: 30 ms unloaded. Within the period the old
        // floor holds; its end (the sample at 31 s) renews it from the period's mean,
        // 10 ms × 10 and 30 ms × 10 in it: 20 ms.
        burst(&mut g, at(10), 30 * MS, 2);
        assert_eq!(g.floor(), Some(10 * MS));
        g.sample(at(31), 30 * MS, 40, 0.5);
        assert_eq!(g.floor(), Some(20 * MS));
        // The next period has only slow requests; requests at high concurrency say
        // nothing of the floor, however fast.
        burst(&mut g, at(40), 35 * MS, 3);
        burst(&mut g, at(45), 5 * MS, 50);
        g.sample(at(62), 90 * MS, 40, 0.5);
        assert_eq!(g.floor(), Some(35 * MS));
        // A period with too few at low concurrency keeps the floor it had.
        g.sample(at(80), 90 * MS, 4, 0.5);
        burst(&mut g, at(85), 90 * MS, 40);
        g.sample(at(93), 90 * MS, 40, 0.5);
        assert_eq!(g.floor(), Some(35 * MS));
    }

    #[test]
    fn a_lower_floor_is_taken_at_once_and_a_higher_one_only_at_a_renewal() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut g = Gradient::new(settings(), t0, 0.5);
        // Too few requests at low concurrency for a floor yet: their mean stands in,
        // provisional, higher or lower as they come.
        g.sample(at(0), 90 * MS, 1, 0.5);
        assert_eq!(g.floor(), Some(90 * MS));
        for _ in 2..WINDOW_SAMPLES {
            g.sample(at(0), 67 * MS + MS / 2, 1, 0.5);
        }
        assert_eq!(g.floor(), Some(70 * MS), "(90 + 8 × 67.5) / 9");
        g.sample(at(10), 70 * MS, 1, 0.5);
        assert_eq!(g.floor(), Some(70 * MS));
        // Ten more at 50 ms: the period's mean, 60 ms, is lower: taken at once.
        burst(&mut g, at(100), 50 * MS, 2);
        assert_eq!(g.floor(), Some(60 * MS), "a lower floor at once");
        // Fast at high concurrency says nothing; slower at low concurrency waits for the
        // renewal (30 s).
        burst(&mut g, at(200), 20 * MS, 40);
        burst(&mut g, at(300), 200 * MS, 3);
        assert_eq!(g.floor(), Some(60 * MS));
    }

    #[test]
    fn behind_a_knee_backend_whose_latency_varies_the_limit_does_not_fall_below_the_knee() {
        // A backend of 16 servers whose requests take 100 ms ± 50% (a fixed sequence,
        // uniform over [50, 150] ms), waiting their turn past 16: the least latency is half
        // the mean. A floor of the least would make every window look twice as slow as
        // the floor, and the limit would fall to min_limit; the floor is a mean.
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now, 0.0);
        let mut x: u32 = 1;
        let mut hold = move || {
            // A small LCG: deterministic, spread over [0, 1).
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            f64::from(x >> 8) / f64::from(1u32 << 24)
        };
        let mut window_at = |g: &mut Gradient, now: &mut Instant, c: u32| {
            for i in 0..WINDOW_SAMPLES {
                let h = 0.05 + 0.1 * hold();
                let rtt = Duration::from_secs_f64(h * f64::from(c.max(16)) / 16.0);
                g.sample(*now + WINDOW * (i + 1) / WINDOW_SAMPLES, rtt, c, 0.5);
            }
            *now += WINDOW;
        };
        for _ in 0..3 {
            window_at(&mut g, &mut now, 1);
        }
        let floor = g.floor().expect("a floor from 30 low-concurrency requests");
        assert!(
            (80 * MS..=120 * MS).contains(&floor),
            "floor {floor:?}: the mean, about 100 ms"
        );
        let mut least = u32::MAX;
        for i in 0..600 {
            let c = g.limit();
            window_at(&mut g, &mut now, c);
            if i >= 100 {
                least = least.min(g.limit());
            }
        }
        let l = g.limit();
        assert!((16..=32).contains(&l), "settled at {l}, knee 16");
        assert!(
            least >= 14,
            "fell to {least} once settled, below the knee of 16"
        );
    }

    #[test]
    fn behind_a_knee_backend_a_first_slow_request_does_not_raise_where_the_limit_settles() {
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now, 0.0);
        // The first request is 40% slow (a connection opened), the next at low
        // concurrency is not; then demand far above capacity.
        g.sample(now, knee(1) * 14 / 10, 1, 0.0);
        window(&mut g, &mut now, knee(1), 2);
        for _ in 0..600 {
            let c = g.limit();
            window(&mut g, &mut now, knee(c), c);
        }
        let l = g.limit();
        assert!((16..=28).contains(&l), "settled at {l}, knee 16");
    }

    #[test]
    fn a_backend_slower_for_good_is_followed_after_one_renewal() {
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now, 0.5);
        window(&mut g, &mut now, knee(1), 1);
        // Now 3x slower at every concurrency. The limit falls (the floor is stale), requests
        // then go at low concurrency, and once a whole period of them renewed the floor
        // (the first renewal, at 30 s, still saw the fast start) the limit recovers above
        // the knee's 16.
        let slow = |c: u32| knee(c) * 3;
        for _ in 0..(75 * 10) {
            let c = g.limit();
            window(&mut g, &mut now, slow(c), c);
        }
        let floor = g.floor().map(|f| f.as_secs_f64()).unwrap_or(0.0);
        assert!(
            (floor - slow(4).as_secs_f64()).abs() < 1e-9,
            "floor {floor} s, not {:?}",
            slow(4)
        );
        let l = g.limit();
        assert!((16..=32).contains(&l), "limit {l} after the new floor");
    }

    #[test]
    fn the_probe_never_lowers_the_limit() {
        // Steady, unloaded-latency traffic across many renewals: the limit never dips at
        // a renewal (nothing is shed to measure the floor).
        let mut now = Instant::now();
        let s = Adaptive {
            probe_interval: Duration::from_secs(1),
            ..settings()
        };
        let mut g = Gradient::new(s, now, 0.3);
        window(&mut g, &mut now, 20 * MS, 1);
        let mut last = g.limit();
        for _ in 0..100 {
            let c = g.limit();
            window(&mut g, &mut now, 20 * MS, c);
            assert!(g.limit() >= last);
            last = g.limit();
        }
    }

    #[test]
    fn jitter_moves_a_renewal_within_a_quarter_of_the_interval() {
        let i = Duration::from_secs(40);
        assert_eq!(jittered(i, 0.0), Duration::from_secs(30));
        assert_eq!(jittered(i, 0.5), Duration::from_secs(40));
        assert!(jittered(i, 0.999) < Duration::from_secs(50));
    }
}
