//! A rule's limit: the rate it is written as ([`Rate`]), the algorithm that keeps it
//! ([`Algorithm`]) and the exact integer form the step functions run on ([`Quota`]).

use std::fmt;
use std::num::NonZeroU64;
use std::time::Duration;

use serde::Deserialize;

use super::calendar::{Calendar, Period};

/// `"N/s"`, `"N/m"`, `"N/h"`, `"N/d"` or `"N/<duration>"`; or a calendar period,
/// `"N/day"`, `"N/week"`, `"N/month"` (a `fixed_window` rule's, in its `timezone`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub count: u64,
    /// The period; for a calendar rate its longest length (what validation and the
    /// nominal figures use: a window's real length is its calendar's).
    pub period: Duration,
    /// A calendar period: windows cut at the calendar's edges, not `period` apart.
    pub calendar: Option<Period>,
}

/// The forms a rate is written in, for errors.
const RATE_FORMS: &str =
    "expected \"N/s\", \"N/m\", \"N/h\", \"N/d\", \"N/<duration>\" (e.g. \"5/10s\") or a calendar \"N/day\", \"N/week\", \"N/month\"";

impl Rate {
    /// `count` per `period`, not a calendar's.
    pub fn every(count: u64, period: Duration) -> Rate {
        Rate {
            count,
            period,
            calendar: None,
        }
    }

    pub fn parse(s: &str) -> Result<Rate, String> {
        let (n, per) = s
            .split_once('/')
            .ok_or_else(|| format!("invalid rate {s:?}: {RATE_FORMS}"))?;
        let count: u64 = n
            .trim()
            .parse()
            .map_err(|_| format!("invalid rate {s:?}: {n:?} is not a whole number"))?;
        if count == 0 {
            return Err(format!("invalid rate {s:?}: the count must be at least 1"));
        }
        let per = per.trim();
        if let Some(p) = Period::parse(per) {
            return Ok(Rate {
                count,
                period: Duration::from_secs(p.longest_secs()),
                calendar: Some(p),
            });
        }
        let period = match per {
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            "d" => Duration::from_secs(86_400),
            other => humantime::parse_duration(other)
                .map_err(|e| format!("invalid rate {s:?}: {}", bad_period(count, other, e)))?,
        };
        if period.is_zero() || period.subsec_nanos() != 0 {
            return Err(format!(
                "invalid rate {s:?}: the period must be a whole number of seconds (RateLimit-Policy's w is in seconds)"
            ));
        }
        Ok(Rate::every(count, period))
    }
}

/// Why `per` (after the `/` of a rate of `count`) is not a period, in the rate's terms: the
/// accepted forms, where in the period it went wrong, and for a unit written without its
/// number (`"10/sec"`, `"10/min"`) the rate it likely means.
fn bad_period(count: u64, per: &str, e: humantime::DurationError) -> String {
    use humantime::DurationError as E;
    if per.is_empty() {
        return format!("the period is missing; {RATE_FORMS}");
    }
    if per.bytes().all(|b| b.is_ascii_alphabetic()) {
        // "10/months", "10/Week": the calendar's periods are written singular, lower case.
        let lower = per.to_ascii_lowercase();
        let singular = lower.strip_suffix('s').unwrap_or(&lower);
        if let Some(p) = Period::parse(singular).filter(|p| *p != Period::Day) {
            let p = p.name();
            return format!(
                "the period {per:?} is not one; {RATE_FORMS}: did you mean \"{count}/{p}\"?"
            );
        }
        if let Ok(one) = humantime::parse_duration(&format!("1{per}")) {
            let meant = match one.as_secs() {
                _ if one.subsec_nanos() != 0 => None,
                1 => Some("s".to_string()),
                60 => Some("m".to_string()),
                3600 => Some("h".to_string()),
                86_400 => Some("d".to_string()),
                _ => Some(format!("1{per}")),
            };
            let hint = meant.map_or(String::new(), |m| {
                format!(": did you mean \"{count}/{m}\"?")
            });
            return format!("the period {per:?} has no number; {RATE_FORMS}{hint}");
        }
    }
    // humantime's offsets are bytes into the period; say where, counted from 1.
    let at = |i: usize| {
        let c = per[i.min(per.len())..].chars().next();
        let n = per[..i.min(per.len())].chars().count() + 1;
        match c {
            Some(c) => format!("{c:?} at character {n} of the period {per:?}"),
            None => format!("the end of the period {per:?}"),
        }
    };
    let why = match e {
        E::InvalidCharacter(i) => format!("unexpected {}", at(i)),
        E::NumberExpected(i) => format!("expected a number at {}", at(i)),
        E::UnknownUnit { unit, .. } => format!(
            "unknown unit {unit:?} in the period {per:?} (s, m, h, d; or ms, min, hours, days, ...)"
        ),
        e => format!("the period {per:?}: {e}"),
    };
    format!("{why}; {RATE_FORMS}")
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(p) = self.calendar {
            return write!(f, "{}/{}", self.count, p.name());
        }
        match self.period.as_secs() {
            1 => write!(f, "{}/s", self.count),
            60 => write!(f, "{}/m", self.count),
            3600 => write!(f, "{}/h", self.count),
            86_400 => write!(f, "{}/d", self.count),
            s => write!(f, "{}/{}s", self.count, s),
        }
    }
}

/// Largest level a bucket may hold, in its units. Redis runs Lua 5.1, whose numbers are
/// IEEE doubles: every integer the script computes must stay below 2^53 to be exact.
pub const MAX_LEVEL: u64 = 1 << 52;

crate::telemetry::label_enum! {
    #[derive(Default, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum Algorithm {
        #[default]
        TokenBucket,
        Gcra,
        SlidingWindow,
        FixedWindow,
        /// Not a rate: at most N requests in flight per identity (`max_in_flight`, not an
        /// `algorithm` value in the file).
        #[serde(skip_deserializing)]
        Concurrency,
    }
}

impl Algorithm {
    /// Whether `burst` means anything: the windows admit the rate's N per window.
    pub fn has_burst(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::Gcra)
    }

    /// Whether a request may wait for its tokens (`max_delay`): the buckets can take
    /// tokens ahead; a window cannot.
    pub fn can_delay(self) -> bool {
        self.has_burst()
    }

    /// The algorithm's number in the Redis script's arguments (`lua/decide.lua`).
    pub fn code(self) -> u8 {
        match self {
            Algorithm::TokenBucket => 1,
            Algorithm::Gcra => 2,
            Algorithm::FixedWindow => 3,
            Algorithm::SlidingWindow => 4,
            Algorithm::Concurrency => 5,
        }
    }
}

/// A rule's limit, in the exact integer form the step functions use.
///
/// A token bucket (or GCRA) holding `burst` tokens and refilling `rate.count` tokens per
/// `rate.period` is kept in *units*: one token is `unit` units and `per_us` units drip in
/// every microsecond. `unit / per_us` is the period divided by the count, reduced by their
/// greatest common divisor, so no refill is ever rounded. The windows count requests
/// against `rate.count` per `rate.period`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub algorithm: Algorithm,
    pub rate: Rate,
    pub burst: u64,
    pub cost: u64,
    pub unit: u64,
    pub per_us: u64,
    /// How long a request may wait for its tokens instead of being denied, in µs (0: never
    /// waits). Token bucket and GCRA only.
    pub max_delay_us: u64,
    /// Concurrency only: how long a lease in a shared store lives without renewal, in µs.
    pub lease_us: u64,
    /// How far past empty (a window: past N) a request may still be admitted, in cost
    /// units (`max_debt`, on rules that settle by a reported cost; default 0): what an
    /// identity may borrow ahead before it is refused. Settled costs are charged in full
    /// whatever it is, and the debt is paid by waiting.
    pub max_debt: u64,
    /// A calendar rate's periods (`fixed_window` only): its windows are the calendar's,
    /// not `rate.period` from a key's first request.
    pub calendar: Option<Calendar>,
    /// This gateway's share of the limit while the shared store fails and `on_error =
    /// "local"` limits in process (`local_share`; 1/1 by default: the whole limit).
    pub local_share: LocalShare,
}

/// `local_share`: a fixed fraction, or `"auto"`: one part in N, N the gateways seen
/// writing their heartbeat to the shared store lately (`limiter::heartbeat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalShare {
    Fixed(Share),
    Auto,
}

impl LocalShare {
    /// `"auto"`, or a fraction `"a/b"` ([`Share::parse`]).
    pub fn parse(s: &str) -> Result<LocalShare, String> {
        if s.trim() == "auto" {
            return Ok(LocalShare::Auto);
        }
        Share::parse(s).map(LocalShare::Fixed)
    }

    /// The fraction it is while `gateways` share the store (the last count seen).
    pub fn of(self, gateways: u32) -> Share {
        match self {
            LocalShare::Fixed(s) => s,
            LocalShare::Auto => Share::one_of(gateways),
        }
    }

    pub fn is_auto(self) -> bool {
        self == LocalShare::Auto
    }
}

impl Default for LocalShare {
    fn default() -> LocalShare {
        LocalShare::Fixed(Share::WHOLE)
    }
}

/// A fraction `num / den`, 1 <= num <= den (`local_share = "1/3"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub num: u32,
    pub den: u32,
}

impl Share {
    pub const WHOLE: Share = Share { num: 1, den: 1 };
    /// The most parts a limit is cut into (`"a/b"`: b; `"auto"`: the gateways counted).
    pub const MAX_PARTS: u32 = 1000;

    /// One part in `n` (1 to [`Share::MAX_PARTS`]; 0 counts as 1: the whole limit).
    pub fn one_of(n: u32) -> Share {
        Share {
            num: 1,
            den: n.clamp(1, Share::MAX_PARTS),
        }
    }

    /// `"a/b"`, whole numbers with 1 <= a <= b <= 1000.
    pub fn parse(s: &str) -> Result<Share, String> {
        let bad = || {
            format!("{s:?} is not a share: \"a/b\" with whole numbers 1 <= a <= b <= 1000, e.g. \"1/3\", or \"auto\" (one part per gateway seen)")
        };
        let (a, b) = s.split_once('/').ok_or_else(bad)?;
        let (num, den): (u32, u32) = (
            a.trim().parse().map_err(|_| bad())?,
            b.trim().parse().map_err(|_| bad())?,
        );
        if num == 0 || num > den || den > Share::MAX_PARTS {
            return Err(bad());
        }
        Ok(Share { num, den })
    }
}

impl Default for Share {
    fn default() -> Share {
        Share::WHOLE
    }
}

/// Why a quota cannot be, and which of its settings to blame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct QuotaError {
    pub field: QuotaField,
    pub message: String,
}

crate::telemetry::label_enum! {
    pub enum QuotaField {
        Rate,
        Burst,
        Cost,
        MaxDelay,
        MaxDebt,
    }
}

impl Quota {
    pub fn new(
        algorithm: Algorithm,
        rate: Rate,
        burst: Option<NonZeroU64>,
        cost: NonZeroU64,
    ) -> Result<Quota, QuotaError> {
        let fail = |field, message| QuotaError { field, message };
        let cost = cost.get();
        if rate.calendar.is_some() && algorithm != Algorithm::FixedWindow {
            return Err(fail(
                QuotaField::Rate,
                format!(
                    "rate \"{rate}\" is a calendar period, which only algorithm = \"fixed_window\" counts in, not {}",
                    algorithm.name(),
                ),
            ));
        }
        let period_us = u64::try_from(rate.period.as_micros())
            .ok()
            .filter(|&p| p <= MAX_LEVEL)
            .ok_or_else(|| {
                fail(
                    QuotaField::Rate,
                    format!("rate {rate}: the period is too long"),
                )
            })?;
        let burst = if algorithm.has_burst() {
            burst.map_or(rate.count, NonZeroU64::get)
        } else if let Some(b) = burst {
            return Err(fail(
                QuotaField::Burst,
                format!(
                    "burst = {b} does not apply to {}: a window admits the rate's N ({}) per window",
                    algorithm.name(),
                    rate.count
                ),
            ));
        } else {
            rate.count
        };
        if cost > burst {
            let what = if algorithm.has_burst() {
                "burst"
            } else {
                "the rate's N"
            };
            return Err(fail(
                QuotaField::Cost,
                format!("cost {cost} is more than {what} {burst}: no request could ever pass"),
            ));
        }
        let g = gcd(rate.count, period_us);
        let (unit, per_us) = (period_us / g, rate.count / g);
        // The largest product each algorithm computes must stay exact in Lua's doubles.
        let largest = match algorithm {
            Algorithm::TokenBucket | Algorithm::Gcra => burst.checked_mul(unit),
            // prev·(P-e) + cur·P + cost·P, each term at most N·P.
            Algorithm::SlidingWindow => rate
                .count
                .checked_mul(period_us)
                .and_then(|v| v.checked_mul(3)),
            Algorithm::FixedWindow | Algorithm::Concurrency => Some(rate.count),
        };
        if largest.is_none_or(|v| v > MAX_LEVEL) {
            let field = if algorithm.has_burst() {
                QuotaField::Burst
            } else {
                QuotaField::Rate
            };
            return Err(fail(
                field,
                format!(
                    "rate {rate} with burst {burst} needs more precision than Redis' Lua numbers hold (2^52); lower the burst or use a rounder rate"
                ),
            ));
        }
        Ok(Quota {
            algorithm,
            rate,
            burst,
            cost,
            unit,
            per_us,
            max_delay_us: 0,
            lease_us: 0,
            max_debt: 0,
            calendar: rate.calendar.map(Calendar::utc),
            local_share: LocalShare::default(),
        })
    }

    /// The same limit with its calendar periods in `zone`, months from `anchor_day`
    /// (1..=28, checked at load). A rate of fixed periods has no calendar to change.
    pub fn in_zone(self, zone: &'static jiff::tz::TimeZone, anchor_day: u8) -> Quota {
        Quota {
            calendar: self.calendar.map(|c| Calendar {
                zone,
                anchor_day: if c.period == Period::Month {
                    anchor_day.clamp(1, 28)
                } else {
                    1
                },
                ..c
            }),
            ..self
        }
    }

    /// The window's length at `now_us` (µs since the UNIX epoch, for a calendar rule):
    /// the calendar period containing it, else the rate's period. `RateLimit-Policy`'s `w`.
    pub fn window_us_at(&self, now_us: u64) -> u64 {
        match self.calendar {
            Some(c) => {
                let (start, end) = c.window(now_us);
                end - start
            }
            None => self.period_us(),
        }
    }

    /// A limit of `max` requests in flight; leases in a shared store live `lease` unless
    /// renewed.
    pub fn concurrency(max: NonZeroU64, lease: Duration) -> Quota {
        let max = max.get().min(MAX_LEVEL);
        Quota {
            algorithm: Algorithm::Concurrency,
            // q= in RateLimit-Policy; the period is not used.
            rate: Rate::every(max, Duration::from_secs(1)),
            burst: max,
            cost: 1,
            unit: 1,
            per_us: 1,
            max_delay_us: 0,
            lease_us: u64::try_from(lease.as_micros())
                .unwrap_or(u64::MAX)
                .min(MAX_LEVEL),
            max_debt: 0,
            calendar: None,
            local_share: LocalShare::default(),
        }
    }

    /// The limit this gateway keeps on its own while the shared store fails
    /// (`local_share`, `"auto"` read as one part in `gateways`: the last count of gateways
    /// seen): the rate and burst (a window's N, a concurrency's max) times the share, at
    /// least one request's cost. A token bucket's or GCRA's rate is scaled exactly (N·a
    /// per P·b); a count is rounded down. Where the scaled quota would not fit the
    /// store's precision, the whole limit.
    pub fn for_local_share(&self, gateways: u32) -> Quota {
        let Share { num, den } = self.local_share.of(gateways);
        if num == den {
            return *self;
        }
        let (a, b) = (u64::from(num), u64::from(den));
        let part = |n: u64| (n.saturating_mul(a) / b).max(self.cost).max(1);
        if self.algorithm == Algorithm::Concurrency {
            let max = part(self.burst);
            return Quota {
                burst: max,
                rate: Rate::every(max, self.rate.period),
                ..*self
            };
        }
        let (rate, burst) = if self.algorithm.has_burst() {
            let rate = Rate {
                count: self.rate.count.saturating_mul(a),
                period: self.rate.period.saturating_mul(den),
                calendar: None,
            };
            (rate, NonZeroU64::new(part(self.burst)))
        } else {
            let rate = Rate {
                count: part(self.rate.count),
                ..self.rate
            };
            (rate, None)
        };
        let Some(cost) = NonZeroU64::new(self.cost) else {
            return *self;
        };
        let scaled = Quota::new(self.algorithm, rate, burst, cost).and_then(|q| {
            let q = match self.max_delay_us {
                0 => q,
                us => q.with_max_delay(Duration::from_micros(us))?,
            };
            q.with_max_debt(part(self.max_debt).min(self.max_debt))
        });
        match scaled {
            Ok(q) => Quota {
                calendar: self.calendar,
                local_share: self.local_share,
                ..q
            },
            Err(_) => *self,
        }
    }

    /// The same limit, letting a request wait up to `max_delay` for its tokens.
    pub fn with_max_delay(self, max_delay: Duration) -> Result<Quota, QuotaError> {
        let fail = |message| QuotaError {
            field: QuotaField::MaxDelay,
            message,
        };
        if !self.algorithm.can_delay() {
            return Err(fail(format!(
                "max_delay applies to token_bucket and gcra, not {}",
                self.algorithm.name()
            )));
        }
        let us = u64::try_from(max_delay.as_micros()).unwrap_or(u64::MAX);
        let q = Quota {
            max_delay_us: us,
            ..self
        };
        let fits = us
            .checked_mul(q.per_us)
            .and_then(|s| s.checked_add(q.capacity()))
            .is_some_and(|v| v <= MAX_LEVEL);
        if !fits {
            return Err(fail(format!(
                "max_delay {} with rate {} needs more precision than Redis' Lua numbers hold (2^52); lower it",
                humantime::format_duration(max_delay),
                q.rate
            )));
        }
        Ok(q)
    }

    /// The same limit, admitting a request while it leaves the identity at most
    /// `max_debt` cost units past empty (`max_debt`): borrowing ahead. Every value the
    /// step functions compute then still fits Lua's exact numbers.
    pub fn with_max_debt(self, max_debt: u64) -> Result<Quota, QuotaError> {
        let q = Quota { max_debt, ..self };
        let fits = match q.algorithm {
            Algorithm::TokenBucket | Algorithm::Gcra => max_debt
                .checked_add(q.burst)
                .and_then(|t| t.checked_mul(q.unit))
                .and_then(|v| v.checked_add(q.slack()))
                .is_some_and(|v| v <= MAX_LEVEL),
            // prev·(P-e) + cur·P + cost·P against (N + max_debt)·P: at most (3N + debt)·P.
            Algorithm::SlidingWindow => q
                .rate
                .count
                .checked_mul(3)
                .and_then(|n| n.checked_add(max_debt))
                .and_then(|v| v.checked_mul(q.period_us()))
                .is_some_and(|v| v <= MAX_LEVEL),
            _ => max_debt
                .checked_mul(2)
                .and_then(|d| d.checked_add(q.rate.count.checked_mul(2)?))
                .is_some_and(|v| v <= MAX_LEVEL),
        };
        if !fits {
            return Err(QuotaError {
                field: QuotaField::MaxDebt,
                message: format!(
                    "max_debt {max_debt} with rate {} needs more precision than Redis' Lua numbers hold (2^52); lower it",
                    q.rate
                ),
            });
        }
        Ok(q)
    }

    /// The same limit at another cost per request (a request's own `max_tokens`), at most
    /// what a request may take at all (the burst, or a window's N).
    pub fn with_cost(self, cost: u64) -> Quota {
        Quota {
            cost: cost.clamp(1, self.burst.max(1)),
            ..self
        }
    }

    /// How far below empty a request may take a bucket and still pass at once
    /// (`max_debt`), in units.
    pub fn borrow(&self) -> u64 {
        self.max_debt * self.unit
    }

    /// How far below empty (past what may be borrowed) a bucket may go for requests
    /// waiting on their tokens, in units.
    pub fn slack(&self) -> u64 {
        self.max_delay_us * self.per_us
    }

    /// The period in µs (validated to fit at load).
    pub fn period_us(&self) -> u64 {
        self.rate.period.as_micros() as u64
    }

    /// The bucket's size, in units.
    pub fn capacity(&self) -> u64 {
        self.burst * self.unit
    }

    /// What one request takes, in units.
    pub fn need(&self) -> u64 {
        self.cost * self.unit
    }
}

impl fmt::Display for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.algorithm == Algorithm::Concurrency {
            return write!(f, "{} in flight", self.burst);
        }
        write!(f, "{}", self.rate)?;
        if let Some(c) = self.calendar {
            write!(f, " {c}")?;
        }
        if self.algorithm.has_burst() {
            write!(f, " burst {}", self.burst)?;
        }
        if self.cost != 1 {
            write!(f, " cost {}", self.cost)?;
        }
        if self.max_delay_us > 0 {
            let d = Duration::from_micros(self.max_delay_us);
            write!(f, " max_delay {}", humantime::format_duration(d))?;
        }
        Ok(())
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(count: u64, secs: u64) -> Rate {
        Rate::every(count, Duration::from_secs(secs))
    }

    #[test]
    fn quota_units_are_reduced_exactly() {
        let q = Quota::new(Algorithm::TokenBucket, rate(3, 1), None, NonZeroU64::MIN).unwrap();
        // 3 tokens per 1_000_000 µs: a token is 1_000_000 units, 3 drip in per µs.
        assert_eq!((q.unit, q.per_us, q.burst), (1_000_000, 3, 3));
        let q = Quota::new(
            Algorithm::TokenBucket,
            rate(1_000_000, 86_400),
            None,
            NonZeroU64::MIN,
        )
        .unwrap();
        assert_eq!((q.unit, q.per_us), (86_400, 1));
        assert_eq!(q.capacity(), 86_400_000_000);
    }

    /// A limit of `algorithm` at `rate` (burst, cost), held with `local_share`.
    fn shared(
        local_share: LocalShare,
        algorithm: Algorithm,
        rate: &str,
        burst: Option<u64>,
        cost: u64,
    ) -> Quota {
        Quota {
            local_share,
            ..crate::limiter::tests::quota(algorithm, rate, burst, cost)
        }
    }

    #[test]
    fn a_local_share_scales_the_limit_exactly_and_never_below_one_request() {
        assert_eq!(Share::parse("1/3"), Ok(Share { num: 1, den: 3 }));
        assert_eq!(Share::parse(" 2 / 5 "), Ok(Share { num: 2, den: 5 }));
        for bad in [
            "0/3", "3/2", "1/1001", "1", "a/b", "1/0", "-1/3", "", "Auto",
        ] {
            assert!(Share::parse(bad).is_err(), "{bad:?}");
            assert!(LocalShare::parse(bad).is_err(), "{bad:?}");
        }
        let third = LocalShare::Fixed(Share { num: 1, den: 3 });
        let tb = shared(third, Algorithm::TokenBucket, "6/m", Some(30), 1);
        // A fixed share does not depend on the gateways counted.
        let local = tb.for_local_share(7);
        assert_eq!(local.burst, 10);
        // 6 a minute, a third: one token every 30 s, exactly.
        assert_eq!(local.unit / local.per_us, 30_000_000);
        assert_eq!(
            local.local_share, third,
            "the share is kept (settlements scale alike)"
        );
        let whole = Quota {
            local_share: LocalShare::default(),
            ..tb
        };
        assert_eq!(whole.for_local_share(3), whole);
        let window = shared(third, Algorithm::FixedWindow, "30/h", None, 1);
        assert_eq!(window.for_local_share(1).rate.count, 10);
        assert_eq!(window.for_local_share(1).period_us(), window.period_us());
        let tenth = LocalShare::Fixed(Share { num: 1, den: 10 });
        let heavy = shared(tenth, Algorithm::Gcra, "10/s", Some(10), 4);
        assert_eq!(
            heavy.for_local_share(1).burst,
            4,
            "at least one request's cost"
        );
        let slots = Quota {
            local_share: third,
            ..Quota::concurrency(NonZeroU64::new(16).unwrap(), Duration::from_secs(10))
        };
        assert_eq!(slots.for_local_share(1).burst, 5);
    }

    #[test]
    fn an_auto_share_is_one_part_per_gateway_seen() {
        assert_eq!(LocalShare::parse("auto"), Ok(LocalShare::Auto));
        assert_eq!(LocalShare::parse(" auto "), Ok(LocalShare::Auto));
        assert_eq!(
            LocalShare::parse("1/3"),
            Ok(LocalShare::Fixed(Share { num: 1, den: 3 }))
        );
        let e = LocalShare::parse("half").unwrap_err();
        assert!(e.contains("or \"auto\""), "{e}");
        let tb = shared(LocalShare::Auto, Algorithm::TokenBucket, "6/m", Some(30), 1);
        // One gateway seen (or none yet): the whole limit.
        assert_eq!(tb.for_local_share(1).burst, 30);
        assert_eq!(tb.for_local_share(1).unit, tb.unit);
        assert_eq!(tb.for_local_share(0).burst, 30, "0 counts as one gateway");
        // Three: a third each, the rate exactly (one token every 30 s).
        let third = tb.for_local_share(3);
        assert_eq!(third.burst, 10);
        assert_eq!(third.unit / third.per_us, 30_000_000);
        assert_eq!(third.local_share, LocalShare::Auto);
        let fixed = Quota {
            local_share: LocalShare::Fixed(Share { num: 1, den: 3 }),
            ..tb
        }
        .for_local_share(1);
        assert_eq!(
            Quota {
                local_share: LocalShare::Auto,
                ..fixed
            },
            third,
            "auto with 3 gateways is \"1/3\""
        );
        // Four: 30 / 4 rounded down.
        assert_eq!(tb.for_local_share(4).burst, 7);
        // Past the most parts a share has: 1/1000, at least one request.
        assert_eq!(Share::one_of(5_000), Share { num: 1, den: 1000 });
        assert_eq!(tb.for_local_share(5_000).burst, 1);
    }

    #[test]
    fn only_a_fixed_window_counts_in_calendar_periods() {
        let month = Rate::parse("100/month").unwrap();
        for alg in [
            Algorithm::TokenBucket,
            Algorithm::Gcra,
            Algorithm::SlidingWindow,
        ] {
            let e = Quota::new(alg, month, None, NonZeroU64::MIN).unwrap_err();
            assert_eq!(e.field, QuotaField::Rate);
            assert!(
                e.message.contains("only algorithm = \"fixed_window\""),
                "{e}"
            );
        }
        let q = Quota::new(Algorithm::FixedWindow, month, None, NonZeroU64::MIN).unwrap();
        assert_eq!(q.calendar, Some(Calendar::utc(Period::Month)));
        let berlin = crate::limiter::calendar::zone("Europe/Berlin").unwrap();
        let q = q.in_zone(berlin, 15);
        let c = q.calendar.unwrap();
        assert_eq!((c.anchor_day, c.zone_name()), (15, "Europe/Berlin"));
        assert_eq!(q.to_string(), "100/month in Europe/Berlin from day 15");
        // An anchor day means nothing to a week; a fixed period has no calendar at all.
        let week = Quota::new(
            Algorithm::FixedWindow,
            Rate::parse("5/week").unwrap(),
            None,
            NonZeroU64::MIN,
        )
        .unwrap()
        .in_zone(berlin, 15);
        assert_eq!(week.calendar.unwrap().anchor_day, 1);
        let fixed = Quota::new(Algorithm::FixedWindow, rate(5, 60), None, NonZeroU64::MIN)
            .unwrap()
            .in_zone(berlin, 15);
        assert_eq!(fixed.calendar, None);
        assert_eq!(fixed.window_us_at(123), 60_000_000);
    }

    #[test]
    fn quota_rejects_cost_above_burst_and_overflow() {
        let c3 = NonZeroU64::new(3).unwrap();
        assert!(Quota::new(Algorithm::TokenBucket, rate(10, 1), NonZeroU64::new(2), c3).is_err());
        assert!(Quota::new(Algorithm::FixedWindow, rate(2, 1), None, c3).is_err());
        assert!(Quota::new(Algorithm::SlidingWindow, rate(3, 1), None, c3).is_ok());
        let burst_on_window = Quota::new(
            Algorithm::SlidingWindow,
            rate(3, 1),
            NonZeroU64::new(3),
            NonZeroU64::MIN,
        );
        assert!(burst_on_window
            .unwrap_err()
            .message
            .contains("does not apply"));
        // 2^52 / 86_400_000_000 µs is about 52_000 per day for a sliding window.
        assert!(Quota::new(
            Algorithm::SlidingWindow,
            rate(60_000, 86_400),
            None,
            NonZeroU64::MIN
        )
        .is_err());
        assert!(Quota::new(
            Algorithm::FixedWindow,
            rate(60_000, 86_400),
            None,
            NonZeroU64::MIN
        )
        .is_ok());
        assert!(Quota::new(
            Algorithm::TokenBucket,
            rate(7, 86_400),
            NonZeroU64::new(u64::MAX / 2),
            NonZeroU64::MIN
        )
        .is_err());
    }

    #[test]
    fn rates_parse() {
        assert_eq!(
            Rate::parse("10/s").unwrap(),
            Rate::every(10, Duration::from_secs(1))
        );
        assert_eq!(
            Rate::parse("5/10s").unwrap(),
            Rate::every(5, Duration::from_secs(10))
        );
        assert_eq!(
            Rate::parse("100/d").unwrap().period,
            Duration::from_secs(86_400)
        );
        assert_eq!(
            Rate::parse("3/2m").unwrap().period,
            Duration::from_secs(120)
        );
        for bad in [
            "0/s", "10", "10/", "10/500ms", "-1/s", "1.5/s", "10/x", "0/month",
        ] {
            assert!(Rate::parse(bad).is_err(), "{bad} was accepted");
        }
        // The calendar's periods, and "N/d" that stays 24 hours.
        let month = Rate::parse("100000/month").unwrap();
        assert_eq!(
            (month.count, month.calendar),
            (100_000, Some(Period::Month))
        );
        assert_eq!(month.to_string(), "100000/month");
        assert_eq!(Rate::parse("7/week").unwrap().calendar, Some(Period::Week));
        assert_eq!(Rate::parse("7/day").unwrap().calendar, Some(Period::Day));
        assert_eq!(
            Rate::parse("7/d").unwrap(),
            Rate::every(7, Duration::from_secs(86_400))
        );
        assert_eq!(Rate::parse("7/1day").unwrap().calendar, None);
    }

    #[test]
    fn a_bad_period_says_the_accepted_forms_and_where() {
        const FORMS: &str = "expected \"N/s\", \"N/m\", \"N/h\", \"N/d\", \"N/<duration>\" (e.g. \"5/10s\") or a calendar \"N/day\", \"N/week\", \"N/month\"";
        for (bad, says) in [
            (
                "10/sec",
                format!("invalid rate \"10/sec\": the period \"sec\" has no number; {FORMS}: did you mean \"10/s\"?"),
            ),
            (
                "10/min",
                format!("invalid rate \"10/min\": the period \"min\" has no number; {FORMS}: did you mean \"10/m\"?"),
            ),
            (
                "5/weeks",
                format!("invalid rate \"5/weeks\": the period \"weeks\" is not one; {FORMS}: did you mean \"5/week\"?"),
            ),
            (
                "5/Month",
                format!("invalid rate \"5/Month\": the period \"Month\" is not one; {FORMS}: did you mean \"5/month\"?"),
            ),
            (
                "10/ms",
                format!("invalid rate \"10/ms\": the period \"ms\" has no number; {FORMS}"),
            ),
            ("10/", format!("invalid rate \"10/\": the period is missing; {FORMS}")),
            (
                "10/5 minutez",
                format!("invalid rate \"10/5 minutez\": unknown unit \"minutez\" in the period \"5 minutez\" (s, m, h, d; or ms, min, hours, days, ...); {FORMS}"),
            ),
            (
                "10/1h x",
                format!("invalid rate \"10/1h x\": expected a number at 'x' at character 4 of the period \"1h x\"; {FORMS}"),
            ),
            (
                "10/1h!",
                format!("invalid rate \"10/1h!\": unexpected '!' at character 3 of the period \"1h!\"; {FORMS}"),
            ),
            ("10", format!("invalid rate \"10\": {FORMS}")),
        ] {
            assert_eq!(Rate::parse(bad).unwrap_err(), says, "{bad}");
        }
    }
}
