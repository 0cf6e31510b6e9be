//! Calendar periods for `fixed_window` rules (issue 27): `"N/day"`, `"N/week"`,
//! `"N/month"` in a time zone, a window whose edges are the zone's calendar edges.
//!
//! A [`Calendar`] maps an instant (µs since the UNIX epoch) to the period containing it,
//! `[start, end)`, exactly and for every instant: a day runs from one local midnight to
//! the next (23 or 25 hours across a DST change), a week from Monday 00:00 to the next
//! Monday's, a month from its `anchor_day` 00:00 to the same day of the next month (the
//! 1st, unless a billing month says otherwise; 1 to 28, so every month has that day).
//! Where local midnight does not exist (a zone that moved its clocks at 00:00), the day
//! starts at the first instant after the gap, and where it comes twice, at the first.
//!
//! The zone database is the one compiled into the binary (`jiff`'s bundled copy), never
//! the system's, so every gateway of a release cuts the same edges. The gateway computes
//! the edges; with Redis, the script still decides at Redis' time (`lua/fixed_window.lua`).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock, PoisonError};

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

/// A calendar period a rate may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    /// One local calendar day (`"N/day"`; `"N/d"` is 24 hours).
    Day,
    /// Monday 00:00 to Monday 00:00, local.
    Week,
    /// The anchor day 00:00 to the same day of the next month, local.
    Month,
}

impl Period {
    /// How a rate writes it, after the `/`.
    pub fn name(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
        }
    }

    pub fn parse(s: &str) -> Option<Period> {
        match s {
            "day" => Some(Period::Day),
            "week" => Some(Period::Week),
            "month" => Some(Period::Month),
            _ => None,
        }
    }

    /// The longest such period, in seconds (a 25-hour day; a 31-day month with a DST
    /// change in it is shorter): what validation and a rate's nominal period use.
    pub fn longest_secs(self) -> u64 {
        match self {
            Period::Day => 25 * 3600,
            Period::Week => 7 * 86_400 + 3600,
            Period::Month => 31 * 86_400 + 3600,
        }
    }
}

/// The instants past which there is one endless window: 2^53 µs (the year 2255), where
/// Lua's numbers stop being exact. Every window before it is the calendar's own; the one
/// containing it ends there.
pub const LAST_EDGE_US: u64 = 1 << 53;

/// The default zone.
pub static UTC: TimeZone = TimeZone::UTC;

/// A period in a zone: what cuts a calendar rule's windows. `Copy`: the zone is interned
/// once per name for the process ([`zone`]), so a [`Quota`](super::Quota) stays `Copy`.
#[derive(Clone, Copy)]
pub struct Calendar {
    pub period: Period,
    /// Months only: the day of the month each begins on (1..=28; 1 otherwise).
    pub anchor_day: u8,
    pub zone: &'static TimeZone,
}

impl Calendar {
    /// `period` in UTC, months from the 1st.
    pub fn utc(period: Period) -> Calendar {
        Calendar {
            period,
            anchor_day: 1,
            zone: &UTC,
        }
    }

    /// The zone's name as the file gave it ("UTC" by default).
    pub fn zone_name(&self) -> &str {
        self.zone.iana_name().unwrap_or("UTC")
    }

    /// The period containing `at_us` (µs since the UNIX epoch): `[start, end)`, with
    /// `start <= at_us < end` (a start before 1970 is 0). Total: past [`LAST_EDGE_US`]
    /// the window is `[LAST_EDGE_US, u64::MAX)`.
    pub fn window(&self, at_us: u64) -> (u64, u64) {
        if at_us >= LAST_EDGE_US {
            return (LAST_EDGE_US, u64::MAX);
        }
        // Every instant before 2^53 µs is a date jiff holds, and so are the edges around
        // it: the fallback is never taken, but keeps this total without a panic.
        let (start, end) = self
            .edges(at_us)
            .unwrap_or((at_us, at_us.saturating_add(1)));
        (start, end.min(LAST_EDGE_US))
    }

    /// The period after the one containing `at_us`: `[end, next end)`.
    pub fn next_window(&self, at_us: u64) -> (u64, u64) {
        let (_, end) = self.window(at_us);
        self.window(end)
    }

    fn edges(&self, at_us: u64) -> Option<(u64, u64)> {
        let at = Timestamp::from_microsecond(i64::try_from(at_us).ok()?).ok()?;
        let today = self.zone.to_datetime(at).date();
        let (first, next) = match self.period {
            Period::Day => (today, today.tomorrow().ok()?),
            Period::Week => {
                let back = i64::from(today.weekday().to_monday_zero_offset());
                let monday = today.checked_sub(back.days()).ok()?;
                (monday, monday.checked_add(7.days()).ok()?)
            }
            Period::Month => {
                let a = i8::try_from(self.anchor_day.clamp(1, 28)).ok()?;
                let (y, m) = (today.year(), today.month());
                let this = Date::new(y, m, a).ok()?;
                let (y0, m0) = if today >= this { (y, m) } else { prev(y, m) };
                let (y1, m1) = next(y0, m0);
                (Date::new(y0, m0, a).ok()?, Date::new(y1, m1, a).ok()?)
            }
        };
        Some((self.midnight(first)?, self.midnight(next)?))
    }

    /// The first instant of `day` in the zone, µs (0 before the epoch).
    fn midnight(&self, day: Date) -> Option<u64> {
        // `compatible`: in a gap, the first instant after it; in a fold, the earlier one.
        let ts = self.zone.to_timestamp(day.at(0, 0, 0, 0)).ok()?;
        Some(u64::try_from(ts.as_microsecond()).unwrap_or(0))
    }
}

fn prev(y: i16, m: i8) -> (i16, i8) {
    if m == 1 {
        (y - 1, 12)
    } else {
        (y, m - 1)
    }
}

fn next(y: i16, m: i8) -> (i16, i8) {
    if m == 12 {
        (y + 1, 1)
    } else {
        (y, m + 1)
    }
}

impl PartialEq for Calendar {
    fn eq(&self, other: &Calendar) -> bool {
        // Interned: one zone per name; equal zones under two names compare equal too.
        self.period == other.period
            && self.anchor_day == other.anchor_day
            && (std::ptr::eq(self.zone, other.zone) || self.zone == other.zone)
    }
}

impl Eq for Calendar {}

impl fmt::Debug for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Calendar")
            .field("period", &self.period)
            .field("anchor_day", &self.anchor_day)
            .field("zone", &self.zone_name())
            .finish()
    }
}

impl fmt::Display for Calendar {
    /// `in Europe/Berlin from day 15`: what follows a rate in `ratewall check`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "in {}", self.zone_name())?;
        if self.period == Period::Month && self.anchor_day != 1 {
            write!(f, " from day {}", self.anchor_day)?;
        }
        Ok(())
    }
}

/// The zone named `name` in the bundled IANA database, interned: the first lookup of a
/// name loads it and keeps it for the life of the process (a config names a handful;
/// reloads find them again), so a [`Calendar`] holds a `&'static` and stays `Copy`.
pub fn zone(name: &str) -> Result<&'static TimeZone, String> {
    static ZONES: OnceLock<Mutex<HashMap<String, &'static TimeZone>>> = OnceLock::new();
    let zones = ZONES.get_or_init(Mutex::default);
    let mut zones = zones.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(z) = zones.get(name) {
        return Ok(z);
    }
    let tz = jiff::tz::db().get(name).map_err(|_| {
        format!("unknown time zone {name:?}: an IANA name such as \"Europe/Berlin\", \"America/New_York\" or \"UTC\"")
    })?;
    let tz: &'static TimeZone = Box::leak(Box::new(tz));
    zones.insert(name.to_string(), tz);
    Ok(tz)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// µs of a local wall-clock time in `zone` (unambiguous ones only).
    fn local(zone: &str, y: i16, m: i8, d: i8, h: i8) -> u64 {
        let tz = self::zone(zone).unwrap();
        let ts = tz
            .to_ambiguous_timestamp(Date::new(y, m, d).unwrap().at(h, 0, 0, 0))
            .unambiguous()
            .unwrap();
        ts.as_microsecond() as u64
    }

    /// µs of a UTC time.
    fn utc(y: i16, m: i8, d: i8, h: i8) -> u64 {
        local("UTC", y, m, d, h)
    }

    const HOUR: u64 = 3_600_000_000;
    const DAY: u64 = 24 * HOUR;

    fn berlin(period: Period, anchor_day: u8) -> Calendar {
        Calendar {
            period,
            anchor_day,
            zone: zone("Europe/Berlin").unwrap(),
        }
    }

    #[test]
    fn berlin_days_are_23_and_25_hours_across_the_2026_dst_changes() {
        let day = berlin(Period::Day, 1);
        // 29 March 2026: 02:00 CET becomes 03:00 CEST; midnight is 23:00 UTC the day before.
        let (s, e) = day.window(local("Europe/Berlin", 2026, 3, 29, 12));
        assert_eq!((s, e), (utc(2026, 3, 28, 23), utc(2026, 3, 29, 22)));
        assert_eq!(e - s, 23 * HOUR);
        // 25 October 2026: 03:00 CEST becomes 02:00 CET.
        let (s, e) = day.window(local("Europe/Berlin", 2026, 10, 25, 12));
        assert_eq!((s, e), (utc(2026, 10, 24, 22), utc(2026, 10, 25, 23)));
        assert_eq!(e - s, 25 * HOUR);
        // Exactly at an edge: the new day; one µs before it: the old.
        assert_eq!(day.window(e).0, e);
        assert_eq!(day.window(e - 1), (s, e));
        // An ordinary day is 24 hours.
        let (s, e) = day.window(local("Europe/Berlin", 2026, 6, 1, 0));
        assert_eq!((s, e - s), (utc(2026, 5, 31, 22), DAY));
    }

    #[test]
    fn berlin_months_across_both_dst_changes_and_a_month_end() {
        let month = berlin(Period::Month, 1);
        // March 2026 holds the spring change: 31 days less an hour.
        let (s, e) = month.window(local("Europe/Berlin", 2026, 3, 31, 23));
        assert_eq!((s, e), (utc(2026, 2, 28, 23), utc(2026, 3, 31, 22)));
        assert_eq!(e - s, 31 * DAY - HOUR);
        // The month end: 1 April 00:00 CEST is 31 March 22:00 UTC.
        assert_eq!(month.window(e - 1).1, e);
        let (s2, e2) = month.window(e);
        assert_eq!((s2, e2), (e, utc(2026, 4, 30, 22)));
        assert_eq!(e2 - s2, 30 * DAY);
        assert_eq!(month.next_window(e - 1), (s2, e2));
        // October 2026 holds the autumn change: 31 days and an hour.
        let (s, e) = month.window(local("Europe/Berlin", 2026, 10, 25, 12));
        assert_eq!((s, e), (utc(2026, 9, 30, 22), utc(2026, 10, 31, 23)));
        assert_eq!(e - s, 31 * DAY + HOUR);
    }

    #[test]
    fn february_of_a_leap_year_has_29_days() {
        let month = Calendar::utc(Period::Month);
        let (s, e) = month.window(utc(2028, 2, 29, 23));
        assert_eq!((s, e), (utc(2028, 2, 1, 0), utc(2028, 3, 1, 0)));
        assert_eq!(e - s, 29 * DAY);
        let (s, e) = month.window(utc(2026, 2, 14, 0));
        assert_eq!(e - s, 28 * DAY);
        // December rolls into the next year.
        let (s, e) = month.window(utc(2026, 12, 31, 23));
        assert_eq!((s, e), (utc(2026, 12, 1, 0), utc(2027, 1, 1, 0)));
    }

    #[test]
    fn anchored_months_run_from_the_anchor_day_to_the_same_day_next_month() {
        let m15 = berlin(Period::Month, 15);
        // 10 March is before the 15th: February's billing month, 15 Feb to 15 Mar.
        let (s, e) = m15.window(local("Europe/Berlin", 2026, 3, 10, 12));
        assert_eq!(
            (s, e),
            (
                local("Europe/Berlin", 2026, 2, 15, 0),
                local("Europe/Berlin", 2026, 3, 15, 0)
            )
        );
        assert_eq!(e - s, 28 * DAY);
        // 15 March 00:00 local opens the next, to 15 April (across the spring change).
        let (s, e) = m15.window(local("Europe/Berlin", 2026, 3, 15, 0));
        assert_eq!(s, local("Europe/Berlin", 2026, 3, 15, 0));
        assert_eq!(e, local("Europe/Berlin", 2026, 4, 15, 0));
        assert_eq!(e - s, 31 * DAY - HOUR);
        // The 28th: in every month, February included; January's runs into February.
        let m28 = Calendar {
            anchor_day: 28,
            ..Calendar::utc(Period::Month)
        };
        for (at, window) in [
            (
                utc(2026, 2, 27, 23),
                (utc(2026, 1, 28, 0), utc(2026, 2, 28, 0)),
            ),
            (
                utc(2026, 2, 28, 0),
                (utc(2026, 2, 28, 0), utc(2026, 3, 28, 0)),
            ),
            (
                utc(2026, 12, 30, 0),
                (utc(2026, 12, 28, 0), utc(2027, 1, 28, 0)),
            ),
            (
                utc(2027, 1, 3, 0),
                (utc(2026, 12, 28, 0), utc(2027, 1, 28, 0)),
            ),
        ] {
            assert_eq!(m28.window(at), window, "at {at:?}");
        }
    }

    #[test]
    fn weeks_start_on_monday_at_local_midnight() {
        let week = berlin(Period::Week, 1);
        // Sunday 29 March 2026, the spring change: the week of Monday 23 March.
        let (s, e) = week.window(local("Europe/Berlin", 2026, 3, 29, 12));
        assert_eq!(s, local("Europe/Berlin", 2026, 3, 23, 0));
        assert_eq!(e, local("Europe/Berlin", 2026, 3, 30, 0));
        assert_eq!(e - s, 7 * DAY - HOUR);
        // A Monday at midnight opens its week; a Sunday at 23:59 is still the last.
        let monday = local("Europe/Berlin", 2026, 6, 1, 0);
        assert_eq!(week.window(monday).0, monday);
        assert_eq!(week.window(monday - 1).1, monday);
        assert_eq!(week.window(monday).1 - monday, 7 * DAY);
    }

    #[test]
    fn utc_is_the_default_and_has_no_dst() {
        let day = Calendar::utc(Period::Day);
        assert_eq!(day.zone_name(), "UTC");
        let (s, e) = day.window(utc(2026, 3, 29, 12));
        assert_eq!((s, e), (utc(2026, 3, 29, 0), utc(2026, 3, 30, 0)));
        let (s, e) = day.window(utc(2026, 10, 25, 1));
        assert_eq!(e - s, DAY);
        let week = Calendar::utc(Period::Week);
        // 1 January 1970 was a Thursday: its week began on Monday 29 December 1969, cut at 0.
        assert_eq!(week.window(0), (0, 4 * DAY));
    }

    #[test]
    fn every_instant_is_in_its_window_and_windows_tile() {
        for cal in [
            berlin(Period::Day, 1),
            berlin(Period::Week, 1),
            berlin(Period::Month, 28),
            Calendar::utc(Period::Month),
        ] {
            let mut at = utc(2025, 12, 20, 0);
            let (mut s, mut e) = cal.window(at);
            for _ in 0..40 {
                assert!(s <= at && at < e, "{cal}: {at} not in [{s}, {e})");
                let (s2, e2) = cal.window(e);
                assert_eq!(s2, e, "{cal}: windows tile");
                assert!(e2 - s2 <= cal.period.longest_secs() * 1_000_000);
                (at, s, e) = (e + (e2 - e) / 3, s2, e2);
            }
        }
    }

    #[test]
    fn far_instants_have_one_last_window_and_never_panic() {
        let cal = berlin(Period::Month, 1);
        assert_eq!(cal.window(u64::MAX), (LAST_EDGE_US, u64::MAX));
        assert_eq!(cal.window(LAST_EDGE_US), (LAST_EDGE_US, u64::MAX));
        let (s, e) = cal.window(LAST_EDGE_US - 1);
        assert!(s < LAST_EDGE_US && e == LAST_EDGE_US);
    }

    #[test]
    fn zones_are_interned_and_unknown_ones_refused() {
        let a = zone("Europe/Berlin").unwrap();
        let b = zone("Europe/Berlin").unwrap();
        assert!(std::ptr::eq(a, b));
        let e = zone("Europe/Berln").unwrap_err();
        assert!(e.starts_with("unknown time zone \"Europe/Berln\""), "{e}");
        assert!(zone("").is_err());
    }
}
