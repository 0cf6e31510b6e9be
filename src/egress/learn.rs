//! What an external API's answer says about its rate limit (issue 45, "Learn from the API").
//!
//! Pure: one answer's status and header fields in, a [`Reported`] out; nothing here is on
//! the request path yet. Three families of fields are read, each only where the target's
//! `learn` names it ([`Learn`]):
//!
//! - `Retry-After` (RFC 9110 §10.2.3), on a 429 or a 503 only: delta-seconds or an
//!   HTTP-date in the IMF-fixdate form, read by hand. The obsolete RFC 850 and asctime
//!   forms are not read.
//! - The IETF draft's fields (draft-ietf-httpapi-ratelimit-headers): `RateLimit` with
//!   `RateLimit-Policy` (Structured Field lists, RFC 9651), and the older drafts'
//!   `RateLimit-Remaining` and `RateLimit-Reset`.
//! - `X-RateLimit-*` (GitHub and most REST APIs), with the LLM providers' per-requests and
//!   per-tokens fields (OpenAI's `x-ratelimit-remaining-requests`, `-reset-tokens`, …).
//!
//! An API is not trusted: every wait it asks for is capped at one day ([`MAX_WAIT_US`]), a
//! field sent twice with different values is ignored (and `Retry-After` sent twice at all),
//! and a value that is not what its field allows is ignored, never a panic. Where several
//! fields speak of the same requests, the most restrictive wins.

use std::borrow::Cow;
use std::cmp::Reverse;

use http::header::RETRY_AFTER;
use http::{HeaderMap, StatusCode};

/// The longest an answer may pause a key or put off a reset: one day, so that a hostile or
/// broken API cannot stop a key for years.
pub const MAX_WAIT_US: u64 = 86_400 * 1_000_000;

/// A reset above this many seconds is a Unix time (GitHub's `X-RateLimit-Reset`), at or
/// below it seconds from now: 10^9 s is 31 years, far past any window, and 2001 as a date.
const EPOCH_ABOVE: u64 = 1_000_000_000;

/// Which families of fields a target learns from (config: learn = ["retry_after", "ratelimit", "x-ratelimit"]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Learn {
    /// `Retry-After` on a 429 or a 503.
    RetryAfter,
    /// The IETF draft's `RateLimit` and `RateLimit-Policy`, and its older
    /// `RateLimit-Remaining` and `RateLimit-Reset`.
    RateLimit,
    /// `X-RateLimit-Remaining` and `X-RateLimit-Reset`, and the LLM providers'
    /// `x-ratelimit-remaining-requests`, `-tokens` and their resets.
    XRateLimit,
}

impl std::str::FromStr for Learn {
    type Err = String;

    /// The config's names: `"retry_after"`, `"ratelimit"`, `"x-ratelimit"`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "retry_after" => Ok(Learn::RetryAfter),
            "ratelimit" => Ok(Learn::RateLimit),
            "x-ratelimit" => Ok(Learn::XRateLimit),
            _ => Err(format!(
                "unknown learn {s:?}: expected \"retry_after\", \"ratelimit\" or \"x-ratelimit\""
            )),
        }
    }
}

/// What one answer said.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reported {
    /// Pause every call to this key until this many µs from now (a 429 or 503 with Retry-After).
    pub pause_us: Option<u64>,
    /// Requests the API says are left in its current window, and µs until that window resets (if it said).
    pub remaining: Option<u64>,
    /// µs until the window of `remaining` resets: only with `remaining`, and where the
    /// field that said it was readable.
    pub reset_us: Option<u64>,
    /// Tokens left (LLM providers' x-ratelimit-remaining-tokens), and µs until they reset.
    pub remaining_tokens: Option<u64>,
    /// µs until the tokens of `remaining_tokens` are back: only with `remaining_tokens`.
    pub tokens_reset_us: Option<u64>,
}

/// Read `status` and `headers` (http::HeaderMap) of one answer, with the families `learn` names, at `now_unix_us` (for HTTP-dates and epoch-second resets).
pub fn read(
    status: StatusCode,
    headers: &HeaderMap,
    learn: &[Learn],
    now_unix_us: u64,
) -> Reported {
    let mut out = Reported::default();
    if learn.contains(&Learn::RetryAfter)
        && (status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE)
    {
        out.pause_us =
            only(headers, RETRY_AFTER.as_str()).and_then(|v| retry_after(v, now_unix_us));
    }
    let mut requests = None;
    if learn.contains(&Learn::RateLimit) {
        requests = tighter(requests, structured(headers));
        requests = tighter(
            requests,
            window(
                headers,
                "ratelimit-remaining",
                "ratelimit-reset",
                reset_seconds,
                now_unix_us,
            ),
        );
    }
    if learn.contains(&Learn::XRateLimit) {
        requests = tighter(
            requests,
            window(
                headers,
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
                reset_seconds,
                now_unix_us,
            ),
        );
        requests = tighter(
            requests,
            window(
                headers,
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
                reset_duration,
                now_unix_us,
            ),
        );
        if let Some(tokens) = window(
            headers,
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
            reset_duration,
            now_unix_us,
        ) {
            out.remaining_tokens = Some(tokens.remaining);
            out.tokens_reset_us = tokens.reset_us;
        }
    }
    if let Some(w) = requests {
        out.remaining = Some(w.remaining);
        out.reset_us = w.reset_us;
    }
    out
}

/// What is left of one window, as one field or a pair of fields said it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    remaining: u64,
    reset_us: Option<u64>,
}

/// The more restrictive of two windows: fewer left, or as many left for longer.
fn tighter(a: Option<Window>, b: Option<Window>) -> Option<Window> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if key(b) < key(a) { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// What orders windows from most to least restrictive.
fn key(w: Window) -> (u64, Reverse<Option<u64>>) {
    (w.remaining, Reverse(w.reset_us))
}

/// A count of what is left (`remaining`) and, where its reset field reads, when it resets.
fn window(
    headers: &HeaderMap,
    remaining: &str,
    reset: &str,
    read_reset: fn(&str, u64) -> Option<u64>,
    now_unix_us: u64,
) -> Option<Window> {
    let remaining = single(headers, remaining).and_then(count)?;
    let reset_us = single(headers, reset).and_then(|v| read_reset(v, now_unix_us));
    Some(Window {
        remaining,
        reset_us,
    })
}

/// The value of a field, trimmed: `None` where it is absent, empty, not visible ASCII, or
/// sent more than once with different values.
fn single<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    if values.any(|v| v != first) {
        return None;
    }
    let value = trim(first.to_str().ok()?);
    (!value.is_empty()).then_some(value)
}

/// The value of a field sent exactly once (`Retry-After`: two, even alike, are ambiguous).
fn only<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let value = trim(first.to_str().ok()?);
    (!value.is_empty()).then_some(value)
}

/// Without the optional whitespace around a field value (RFC 9110 §5.5).
fn trim(s: &str) -> &str {
    s.trim_matches([' ', '\t'])
}

/// Digits only (no sign, no fraction, no exponent), as a number; one too large for a u64
/// saturates.
fn digits(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.bytes().fold(0u64, |n, b| {
        n.saturating_mul(10).saturating_add(u64::from(b - b'0'))
    }))
}

/// A count of requests or tokens left: digits only; a number beyond a u64 is as good as
/// unlimited, and saturates.
fn count(s: &str) -> Option<u64> {
    digits(s)
}

/// Whole seconds as µs, capped at [`MAX_WAIT_US`].
fn seconds_us(seconds: u64) -> u64 {
    seconds.saturating_mul(1_000_000).min(MAX_WAIT_US)
}

/// `Retry-After`: delta-seconds or an HTTP-date, as µs from now; `None` where it is not
/// one of them or asks no wait (0, or a date past).
fn retry_after(value: &str, now_unix_us: u64) -> Option<u64> {
    let us = match digits(value) {
        Some(seconds) => seconds_us(seconds),
        None => http_date_us(value, now_unix_us)?,
    };
    (us > 0).then_some(us)
}

/// An HTTP-date as µs from now (0 where it is past), capped at [`MAX_WAIT_US`].
fn http_date_us(value: &str, now_unix_us: u64) -> Option<u64> {
    let at = i128::from(imf_fixdate(value)?) * 1_000_000;
    let ahead = at - i128::from(now_unix_us);
    Some(ahead.clamp(0, i128::from(MAX_WAIT_US)) as u64)
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`, RFC 9110 §5.6.7) as Unix seconds:
/// exactly that shape, case and all, a day that exists and the weekday that is its own.
/// Read by hand rather than as RFC 2822 (jiff), which takes more shapes and no date past
/// 9999-12-30, where a hostile year 9999 must still be read (and capped).
fn imf_fixdate(value: &str) -> Option<i64> {
    const DAYS: [&[u8]; 7] = [b"Thu", b"Fri", b"Sat", b"Sun", b"Mon", b"Tue", b"Wed"];
    const MONTHS: [&[u8]; 12] = [
        b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov",
        b"Dec",
    ];
    let b = value.as_bytes();
    if b.len() != 29
        || &b[3..5] != b", "
        || b[7] != b' '
        || b[11] != b' '
        || b[16] != b' '
        || b[19] != b':'
        || b[22] != b':'
        || &b[25..] != b" GMT"
    {
        return None;
    }
    let number = |range: std::ops::Range<usize>| -> Option<i64> {
        let digits = &b[range];
        digits
            .iter()
            .all(u8::is_ascii_digit)
            .then(|| digits.iter().fold(0, |n, d| n * 10 + i64::from(d - b'0')))
    };
    let (day, year) = (number(5..7)?, number(12..16)?);
    let (hour, minute, second) = (number(17..19)?, number(20..22)?, number(23..25)?);
    let month = MONTHS.iter().position(|m| *m == &b[8..11])? as i64 + 1;
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let month_days = match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    // Second 60: a leap second (RFC 9110 allows it), read as the next one.
    if !(1..=month_days).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    // Days since 1970-01-01 (H. Hinnant's days_from_civil; the year is 0 to 9999).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    // 1970-01-01 was a Thursday.
    if DAYS[days.rem_euclid(7) as usize] != &b[0..3] {
        return None;
    }
    Some(days * 86_400 + hour * 3_600 + minute * 60 + second)
}

/// A reset in whole seconds (`X-RateLimit-Reset`, `RateLimit-Reset`): above 10^9 a Unix
/// time (GitHub's), else seconds from now; as µs from now, 0 where past, capped.
fn reset_seconds(value: &str, now_unix_us: u64) -> Option<u64> {
    let seconds = digits(value)?;
    Some(if seconds > EPOCH_ABOVE {
        seconds
            .saturating_mul(1_000_000)
            .saturating_sub(now_unix_us)
            .min(MAX_WAIT_US)
    } else {
        seconds_us(seconds)
    })
}

/// An LLM provider's reset (`x-ratelimit-reset-tokens: 6m0s`): a Go duration, or plain
/// digits read as [`reset_seconds`] does.
fn reset_duration(value: &str, now_unix_us: u64) -> Option<u64> {
    reset_seconds(value, now_unix_us).or_else(|| go_duration_us(value))
}

/// A Go duration (`1s`, `6m0s`, `0.5s`, `20ms`, `1m30.5s`, `1h2m`): numbers with a unit
/// each of h, m, s, ms, us, ns; no sign. As µs, rounded up, capped at [`MAX_WAIT_US`].
fn go_duration_us(s: &str) -> Option<u64> {
    const FRACTION_DIGITS: u128 = 1_000_000_000_000_000_000;
    let b = s.as_bytes();
    if b.is_empty() {
        return None;
    }
    let mut ns: u128 = 0;
    let mut i = 0;
    while i < b.len() {
        let start = i;
        let mut whole: u128 = 0;
        while let Some(d) = b.get(i).filter(|c| c.is_ascii_digit()) {
            whole = whole
                .saturating_mul(10)
                .saturating_add(u128::from(d - b'0'));
            i += 1;
        }
        let mut numerals = i - start;
        let (mut fraction, mut scale) = (0u128, 1u128);
        if b.get(i) == Some(&b'.') {
            i += 1;
            while let Some(d) = b.get(i).filter(|c| c.is_ascii_digit()) {
                // Digits past the 18th are below a nanosecond of any unit: read, not kept.
                if scale < FRACTION_DIGITS {
                    fraction = fraction * 10 + u128::from(d - b'0');
                    scale *= 10;
                }
                numerals += 1;
                i += 1;
            }
        }
        if numerals == 0 {
            return None;
        }
        let unit = i;
        while b.get(i).is_some_and(|c| !c.is_ascii_digit() && *c != b'.') {
            i += 1;
        }
        let per: u128 = match &b[unit..i] {
            b"h" => 3_600_000_000_000,
            b"m" => 60_000_000_000,
            b"s" => 1_000_000_000,
            b"ms" => 1_000_000,
            b"us" => 1_000,
            b"ns" => 1,
            // Go's one duration without a unit.
            b"" if s == "0" => 0,
            _ => return None,
        };
        ns = ns
            .saturating_add(whole.saturating_mul(per))
            .saturating_add(fraction * per / scale);
    }
    Some(u64::try_from(ns.div_ceil(1_000)).map_or(MAX_WAIT_US, |us| us.min(MAX_WAIT_US)))
}

/// The draft's `RateLimit` field, its items of quotas in requests (by `RateLimit-Policy`'s
/// `qu`, requests where it does not say): the one with the fewest left (`r`), with its `t`.
/// A field that is not a Structured Field list is ignored whole (RFC 9651 §4.2); an item
/// without a non-negative integer `r`, or with a `t` that is not one, is skipped.
/// Several lines of one field are one list (RFC 9651 §4.2).
fn structured(headers: &HeaderMap) -> Option<Window> {
    let limits = list(headers, "ratelimit")?;
    let policies = list(headers, "ratelimit-policy").unwrap_or_default();
    let mut tightest = None;
    for item in &limits {
        let requests = policies
            .iter()
            .rev()
            .find(|p| p.name().is_some() && p.name() == item.name())
            .is_none_or(|p| match p.param("qu") {
                None => true,
                Some(Bare::String(u)) => u == "requests",
                Some(Bare::Token(u)) => *u == "requests",
                Some(_) => false,
            });
        if !requests {
            continue;
        }
        let Some(Bare::Integer(r)) = item.param("r") else {
            continue;
        };
        let Ok(remaining) = u64::try_from(*r) else {
            continue;
        };
        let reset_us = match item.param("t") {
            None => None,
            Some(Bare::Integer(t)) => match u64::try_from(*t) {
                Ok(t) => Some(seconds_us(t)),
                Err(_) => continue,
            },
            Some(_) => continue,
        };
        tightest = tighter(
            tightest,
            Some(Window {
                remaining,
                reset_us,
            }),
        );
    }
    tightest
}

/// Every line of a Structured Field list, as one list; `None` where the field is absent or
/// any line is not one.
fn list<'h>(headers: &'h HeaderMap, name: &str) -> Option<Vec<Item<'h>>> {
    let mut items = Vec::new();
    let mut any = false;
    for value in headers.get_all(name) {
        any = true;
        items.extend(Parser::new(value.to_str().ok()?).list()?);
    }
    any.then_some(items)
}

/// A Structured Field bare item (RFC 9651 §3.3), as much of it as is needed here.
#[derive(Debug, Clone, PartialEq)]
enum Bare<'a> {
    Integer(i64),
    Decimal,
    String(Cow<'a, str>),
    Token(&'a str),
    Boolean(bool),
    Bytes,
}

/// One item of a list: its bare item and its parameters, in order.
#[derive(Debug, Clone, PartialEq)]
struct Item<'a> {
    bare: Bare<'a>,
    params: Vec<(&'a str, Bare<'a>)>,
}

impl<'a> Item<'a> {
    /// A parameter's value: the last where a key repeats (RFC 9651 §4.2.3.2).
    fn param(&self, key: &str) -> Option<&Bare<'a>> {
        self.params
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }

    /// The item's name: a string, or a token (as some implementations send it).
    fn name(&self) -> Option<&str> {
        match &self.bare {
            Bare::String(s) => Some(s),
            Bare::Token(t) => Some(t),
            _ => None,
        }
    }
}

/// A hand-written reader of Structured Field lists (RFC 9651 §4.2), tolerant of spaces and
/// tabs around `,`, `;` and `=`; no inner lists, dates or display strings.
struct Parser<'a> {
    s: &'a str,
    at: usize,
}

impl<'a> Parser<'a> {
    fn new(s: &'a str) -> Self {
        Parser { s, at: 0 }
    }

    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.at).copied()
    }

    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.at += 1;
        }
    }

    /// The bytes from `start` to here, while `keep` holds for each.
    fn take(&mut self, keep: impl Fn(u8) -> bool) -> &'a str {
        let start = self.at;
        while self.peek().is_some_and(&keep) {
            self.at += 1;
        }
        // Only ASCII bytes are ever kept, so both ends are on a char boundary.
        self.s.get(start..self.at).unwrap_or("")
    }

    fn list(mut self) -> Option<Vec<Item<'a>>> {
        let mut items = Vec::new();
        self.skip_space();
        if self.peek().is_none() {
            return Some(items);
        }
        loop {
            items.push(self.item()?);
            self.skip_space();
            match self.peek() {
                None => return Some(items),
                Some(b',') => self.at += 1,
                Some(_) => return None,
            }
            self.skip_space();
            // A trailing comma is not a list.
            self.peek()?;
        }
    }

    fn item(&mut self) -> Option<Item<'a>> {
        let bare = self.bare()?;
        let mut params = Vec::new();
        loop {
            self.skip_space();
            if self.peek() != Some(b';') {
                return Some(Item { bare, params });
            }
            self.at += 1;
            self.skip_space();
            let key = self.key()?;
            self.skip_space();
            let value = if self.peek() == Some(b'=') {
                self.at += 1;
                self.skip_space();
                self.bare()?
            } else {
                Bare::Boolean(true)
            };
            params.push((key, value));
        }
    }

    /// A parameter's key: a lowercase letter or `*`, then lowercase letters, digits, `_-.*`.
    fn key(&mut self) -> Option<&'a str> {
        if !self
            .peek()
            .is_some_and(|c| c.is_ascii_lowercase() || c == b'*')
        {
            return None;
        }
        Some(self.take(|c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'-' | b'.' | b'*')
        }))
    }

    fn bare(&mut self) -> Option<Bare<'a>> {
        match self.peek()? {
            b'-' | b'0'..=b'9' => self.number(),
            b'"' => self.string(),
            c if c.is_ascii_alphabetic() || c == b'*' => {
                Some(Bare::Token(self.take(|c| {
                    c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&c)
                })))
            }
            b':' => {
                self.at += 1;
                self.take(|c| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'='));
                (self.peek() == Some(b':')).then(|| {
                    self.at += 1;
                    Bare::Bytes
                })
            }
            b'?' => {
                self.at += 1;
                let value = match self.peek()? {
                    b'0' => false,
                    b'1' => true,
                    _ => return None,
                };
                self.at += 1;
                Some(Bare::Boolean(value))
            }
            _ => None,
        }
    }

    /// An integer (at most 15 digits) or a decimal (at most 12 digits, a dot, 1 to 3).
    fn number(&mut self) -> Option<Bare<'a>> {
        let negative = self.peek() == Some(b'-');
        if negative {
            self.at += 1;
        }
        let whole = self.take(|c| c.is_ascii_digit());
        if whole.is_empty() {
            return None;
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            let fraction = self.take(|c| c.is_ascii_digit());
            return (whole.len() <= 12 && (1..=3).contains(&fraction.len()))
                .then_some(Bare::Decimal);
        }
        if whole.len() > 15 {
            return None;
        }
        let n: i64 = whole.parse().ok()?;
        Some(Bare::Integer(if negative { -n } else { n }))
    }

    /// A string: printable ASCII between quotes, `\"` and `\\` its only escapes.
    fn string(&mut self) -> Option<Bare<'a>> {
        self.at += 1;
        let start = self.at;
        let mut unescaped: Option<String> = None;
        loop {
            let c = self.peek()?;
            match c {
                b'"' => {
                    let raw = self.s.get(start..self.at)?;
                    self.at += 1;
                    return Some(Bare::String(match unescaped {
                        Some(s) => Cow::Owned(s),
                        None => Cow::Borrowed(raw),
                    }));
                }
                b'\\' => {
                    let next = self.s.as_bytes().get(self.at + 1).copied()?;
                    if next != b'"' && next != b'\\' {
                        return None;
                    }
                    unescaped
                        .get_or_insert_with(|| self.s.get(start..self.at).unwrap_or("").to_string())
                        .push(char::from(next));
                    self.at += 2;
                }
                0x20..=0x7e => {
                    if let Some(s) = unescaped.as_mut() {
                        s.push(char::from(c));
                    }
                    self.at += 1;
                }
                _ => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    /// 2023-11-14T22:13:20Z.
    const NOW: u64 = 1_700_000_000_000_000;
    const ALL: &[Learn] = &[Learn::RetryAfter, Learn::RateLimit, Learn::XRateLimit];

    fn headers(fields: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in fields {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    fn at(status: u16, fields: &[(&str, &str)], now: u64) -> Reported {
        read(
            StatusCode::from_u16(status).unwrap(),
            &headers(fields),
            ALL,
            now,
        )
    }

    fn pause(status: u16, value: &str) -> Option<u64> {
        at(status, &[("retry-after", value)], NOW).pause_us
    }

    fn requests(fields: &[(&str, &str)]) -> (Option<u64>, Option<u64>) {
        let r = at(200, fields, NOW);
        (r.remaining, r.reset_us)
    }

    #[test]
    fn learn_reads_the_configs_three_names() {
        assert_eq!("retry_after".parse::<Learn>(), Ok(Learn::RetryAfter));
        assert_eq!("ratelimit".parse::<Learn>(), Ok(Learn::RateLimit));
        assert_eq!("x-ratelimit".parse::<Learn>(), Ok(Learn::XRateLimit));
        assert_eq!(
            "RateLimit".parse::<Learn>(),
            Err(
                "unknown learn \"RateLimit\": expected \"retry_after\", \"ratelimit\" or \"x-ratelimit\""
                    .to_string()
            )
        );
        assert_eq!(
            "".parse::<Learn>(),
            Err(
                "unknown learn \"\": expected \"retry_after\", \"ratelimit\" or \"x-ratelimit\""
                    .to_string()
            )
        );
    }

    #[test]
    fn retry_after_seconds_pause_on_429_and_503_only() {
        assert_eq!(pause(429, "120"), Some(120_000_000));
        assert_eq!(pause(503, "120"), Some(120_000_000));
        assert_eq!(pause(429, " 7 "), Some(7_000_000));
        assert_eq!(pause(429, "007"), Some(7_000_000));
        for status in [200, 301, 400, 500, 502, 504] {
            assert_eq!(pause(status, "120"), None, "{status}");
        }
        // "Retry now" asks no pause.
        assert_eq!(pause(429, "0"), None);
    }

    #[test]
    fn retry_after_is_capped_at_one_day() {
        assert_eq!(pause(429, "86400"), Some(86_400_000_000));
        assert_eq!(pause(429, "86401"), Some(MAX_WAIT_US));
        assert_eq!(pause(429, "31536000000"), Some(MAX_WAIT_US));
        assert_eq!(pause(429, "18446744073709551616"), Some(MAX_WAIT_US));
        assert_eq!(
            pause(429, "99999999999999999999999999999999999999999"),
            Some(MAX_WAIT_US)
        );
    }

    #[test]
    fn retry_after_http_date() {
        // RFC 9110's example; 1445412480 is 2015-10-21T07:28:00Z.
        let date = "Wed, 21 Oct 2015 07:28:00 GMT";
        let r = at(429, &[("retry-after", date)], 1_445_412_390_000_000);
        assert_eq!(r.pause_us, Some(90_000_000));
        let r = at(503, &[("retry-after", date)], 1_445_412_479_999_999);
        assert_eq!(r.pause_us, Some(1));
        // Past, or now: no pause.
        assert_eq!(
            at(429, &[("retry-after", date)], 1_445_412_480_000_000).pause_us,
            None
        );
        assert_eq!(pause(429, date), None);
        // Year 9999: one day.
        assert_eq!(
            pause(429, "Fri, 31 Dec 9999 23:59:59 GMT"),
            Some(MAX_WAIT_US)
        );
        // Two days ahead of NOW: one day.
        assert_eq!(
            pause(429, "Thu, 16 Nov 2023 22:13:20 GMT"),
            Some(MAX_WAIT_US)
        );
        assert_eq!(
            pause(429, "Tue, 14 Nov 2023 22:13:30 GMT"),
            Some(10_000_000)
        );
        // Not on a 200.
        assert_eq!(pause(200, "Tue, 14 Nov 2023 22:13:30 GMT"), None);
    }

    #[test]
    fn imf_fixdates() {
        for (value, unix) in [
            ("Sun, 06 Nov 1994 08:49:37 GMT", 784_111_777),
            ("Thu, 01 Jan 1970 00:00:00 GMT", 0),
            ("Tue, 29 Feb 2000 12:00:00 GMT", 951_825_600),
            ("Fri, 31 Dec 9999 23:59:59 GMT", 253_402_300_799),
            ("Mon, 01 Jan 0001 00:00:00 GMT", -62_135_596_800),
            ("Thu, 01 Jan 1970 23:59:60 GMT", 86_400),
        ] {
            assert_eq!(imf_fixdate(value), Some(unix), "{value:?}");
        }
        for bad in [
            "Sun, 06 Nov 1994 08:49:37 gmt",
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 06 Nov 1994 08:49:37 +0000",
            "sun, 06 Nov 1994 08:49:37 GMT",
            "Sun, 06 nov 1994 08:49:37 GMT",
            "Sun, 6 Nov 1994 08:49:37 GMT",
            "Sun,  06 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 94 08:49:37 GMT",
            "06 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 24:00:00 GMT",
            "Sun, 06 Nov 1994 08:60:00 GMT",
            "Sun, 06 Nov 1994 08:49:61 GMT",
            "Sun, 00 Nov 1994 08:49:37 GMT",
            "Mon, 31 Nov 1994 08:49:37 GMT",
            "Mon, 29 Feb 2100 00:00:00 GMT",
            "Sun, 06 Nov 1994 08:49:37 GMT ",
            "Sun, -6 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov +994 08:49:37 GMT",
            "Sun, 06 Nov 1994 08:49:3\u{e9}GMT",
            "Sun, 06 Nov 1994 08:49:37 GM\u{3a4}",
            "Sun, 06 Nov 1994 08:49:37 G\u{e9}",
            "",
        ] {
            assert_eq!(imf_fixdate(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn retry_after_refuses_what_is_neither() {
        for value in [
            "-1",
            "+5",
            "1.5",
            "1e9",
            "0x10",
            "5 s",
            "1 2",
            "120, 60",
            "soon",
            // A wrong weekday, a year past 9999, a date that does not exist.
            "Thu, 21 Oct 2015 07:28:00 GMT",
            "Sat, 01 Jan 10000 00:00:00 GMT",
            "Wed, 21 Oct 2015 07:28:00 +0000",
            "21 Oct 2015 07:28:00 GMT",
            "Wed, 31 Feb 2024 07:28:00 GMT",
            // RFC 850 and asctime, obsolete: not read.
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            assert_eq!(pause(429, value), None, "{value:?}");
        }
        let empty = headers(&[("retry-after", "")]);
        assert_eq!(
            read(StatusCode::TOO_MANY_REQUESTS, &empty, ALL, NOW).pause_us,
            None
        );
        let blank = headers(&[("retry-after", "  ")]);
        assert_eq!(
            read(StatusCode::TOO_MANY_REQUESTS, &blank, ALL, NOW).pause_us,
            None
        );
        // Not ASCII: Arabic-Indic digits, a UTF-8 "٣٠", raw obs-text.
        let mut map = HeaderMap::new();
        map.insert(RETRY_AFTER, HeaderValue::from_str("٣٠").unwrap());
        assert_eq!(
            read(StatusCode::TOO_MANY_REQUESTS, &map, ALL, NOW).pause_us,
            None
        );
        map.insert(RETRY_AFTER, HeaderValue::from_bytes(b"3\xff0").unwrap());
        assert_eq!(
            read(StatusCode::TOO_MANY_REQUESTS, &map, ALL, NOW).pause_us,
            None
        );
    }

    #[test]
    fn several_retry_after_fields_are_ignored_even_alike() {
        let twice = [("retry-after", "5"), ("retry-after", "5")];
        assert_eq!(at(429, &twice, NOW).pause_us, None);
        let differ = [("retry-after", "5"), ("Retry-After", "50")];
        assert_eq!(at(429, &differ, NOW).pause_us, None);
    }

    #[test]
    fn names_are_case_insensitive() {
        let r = at(
            429,
            &[
                ("RETRY-AFTER", "3"),
                ("X-RateLimit-Remaining", "12"),
                ("X-RATELIMIT-RESET", "60"),
            ],
            NOW,
        );
        assert_eq!(r.pause_us, Some(3_000_000));
        assert_eq!(r.remaining, Some(12));
        assert_eq!(r.reset_us, Some(60_000_000));
    }

    #[test]
    fn nothing_is_read_for_a_family_not_learned() {
        let map = headers(&[
            ("retry-after", "30"),
            ("ratelimit", "\"default\";r=50;t=30"),
            ("ratelimit-remaining", "40"),
            ("x-ratelimit-remaining", "4999"),
            ("x-ratelimit-reset", "60"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        let status = StatusCode::TOO_MANY_REQUESTS;
        assert_eq!(read(status, &map, &[], NOW), Reported::default());
        assert_eq!(
            read(status, &map, &[Learn::RetryAfter], NOW),
            Reported {
                pause_us: Some(30_000_000),
                ..Reported::default()
            }
        );
        assert_eq!(
            read(status, &map, &[Learn::RateLimit], NOW),
            Reported {
                remaining: Some(40),
                reset_us: None,
                ..Reported::default()
            }
        );
        assert_eq!(
            read(status, &map, &[Learn::XRateLimit], NOW),
            Reported {
                remaining: Some(4999),
                reset_us: Some(60_000_000),
                remaining_tokens: Some(149_984),
                tokens_reset_us: Some(360_000_000),
                ..Reported::default()
            }
        );
    }

    #[test]
    fn the_ietf_drafts_example() {
        // draft-ietf-httpapi-ratelimit-headers, "Examples".
        assert_eq!(
            requests(&[
                ("RateLimit-Policy", "\"default\";q=100;w=60"),
                ("RateLimit", "\"default\";r=50;t=30"),
            ]),
            (Some(50), Some(30_000_000))
        );
        // Without its policy, or without `t`.
        assert_eq!(
            requests(&[("RateLimit", "\"default\";r=50;t=30")]),
            (Some(50), Some(30_000_000))
        );
        assert_eq!(
            requests(&[("RateLimit", "\"default\";r=0")]),
            (Some(0), None)
        );
        // A partition key and a parameter not known: read past.
        assert_eq!(
            requests(&[(
                "RateLimit",
                "\"peruser\";r=3;t=10;pk=:cHsdsRa894==:;x-new=?1;f=1.5;n=tok/en"
            )]),
            (Some(3), Some(10_000_000))
        );
    }

    #[test]
    fn several_items_the_most_restrictive() {
        let policy = (
            "RateLimit-Policy",
            "\"hour\";q=100;w=3600, \"day\";q=1000;w=86400",
        );
        assert_eq!(
            requests(&[
                policy,
                ("RateLimit", "\"hour\";r=40;t=1800, \"day\";r=20;t=50000")
            ]),
            (Some(20), Some(50_000_000_000))
        );
        assert_eq!(
            requests(&[
                policy,
                ("RateLimit", "\"hour\";r=4;t=1800,\"day\";r=20;t=50000")
            ]),
            (Some(4), Some(1_800_000_000))
        );
        // As many left: the one that lasts longer.
        assert_eq!(
            requests(&[("RateLimit", "\"a\";r=5;t=10, \"b\";r=5;t=20, \"c\";r=5")]),
            (Some(5), Some(20_000_000))
        );
        // Two lines of the field are one list.
        assert_eq!(
            requests(&[
                ("RateLimit", "\"hour\";r=40;t=1800"),
                ("RateLimit", "\"day\";r=20;t=50000"),
            ]),
            (Some(20), Some(50_000_000_000))
        );
    }

    #[test]
    fn items_of_quotas_in_other_units_are_skipped() {
        let policy = (
            "RateLimit-Policy",
            "\"bytes\";q=65536;qu=\"content-bytes\";w=10, \"conc\";q=5;qu=\"concurrent-requests\", \"req\";q=100;qu=\"requests\";w=60",
        );
        assert_eq!(
            requests(&[
                policy,
                (
                    "RateLimit",
                    "\"bytes\";r=1;t=10, \"conc\";r=0, \"req\";r=70;t=30"
                )
            ]),
            (Some(70), Some(30_000_000))
        );
        assert_eq!(
            requests(&[policy, ("RateLimit", "\"bytes\";r=1;t=10")]),
            (None, None)
        );
        // A unit as a token.
        assert_eq!(
            requests(&[
                ("RateLimit-Policy", "\"b\";q=10;qu=content-bytes"),
                ("RateLimit", "\"b\";r=1, \"other\";r=9")
            ]),
            (Some(9), None)
        );
    }

    #[test]
    fn structured_fields_tolerate_spaces_and_tokens() {
        assert_eq!(
            requests(&[(
                "RateLimit",
                "  \"default\" ; r = 50 ;\tt=30 ,  \"x\";r=60  "
            )]),
            (Some(50), Some(30_000_000))
        );
        assert_eq!(
            requests(&[("RateLimit", "default;r=7;t=1")]),
            (Some(7), Some(1_000_000))
        );
        // Escapes in a name; the policy found through them.
        assert_eq!(
            requests(&[
                ("RateLimit-Policy", "\"a\\\"b\";q=1;qu=\"content-bytes\""),
                ("RateLimit", "\"a\\\"b\";r=1, \"a\\\\b\";r=2")
            ]),
            (Some(2), None)
        );
        // A reset beyond a day: one day.
        assert_eq!(
            requests(&[("RateLimit", "\"d\";r=1;t=999999999999999")]),
            (Some(1), Some(MAX_WAIT_US))
        );
    }

    #[test]
    fn structured_garbage_is_refused() {
        // Items skipped: no usable r, or a t that is not a non-negative integer.
        for value in [
            "\"default\";r=abc;t=30",
            "\"default\";r=-5;t=30",
            "\"default\";r=1.5;t=30",
            "\"default\";r=\"5\"",
            "\"default\";r;t=30",
            "\"default\";r=5;t=-1",
            "\"default\";r=5;t=1.0",
            "\"default\";r=5;t=?1",
            "\"default\";t=30",
            "\"default\"",
        ] {
            assert_eq!(requests(&[("RateLimit", value)]), (None, None), "{value:?}");
        }
        // Whole fields refused: not a list.
        for value in [
            "\"default\";r=50;t=30,",
            ",\"default\";r=50",
            "\"default\";R=50",
            "\"default\";r=50;t=30 \"x\";r=1",
            "\"default;r=50",
            "\"default\";r=1e9",
            "\"default\";r=1234567890123456",
            "\"default\";r=50;=1",
            "(\"a\" \"b\");r=1",
            "\"a\\x\";r=1",
            "\"default\";r=--1",
            "\"default\";r=50, \"x\";r=5;t=30;;",
            "@1659578233;r=1",
            "r=50, t=30",
        ] {
            assert_eq!(requests(&[("RateLimit", value)]), (None, None), "{value:?}");
        }
        // An empty field is an empty list; nothing learned.
        assert_eq!(requests(&[("RateLimit", "")]), (None, None));
        assert_eq!(requests(&[("RateLimit", "   ")]), (None, None));
        // One bad line spoils the field.
        assert_eq!(
            requests(&[("RateLimit", "\"a\";r=5"), ("RateLimit", "\"b\";r=")]),
            (None, None)
        );
        // Not ASCII.
        let mut map = HeaderMap::new();
        map.insert(
            "ratelimit",
            HeaderValue::from_str("\"défaut\";r=5").unwrap(),
        );
        assert_eq!(read(StatusCode::OK, &map, ALL, NOW).remaining, None);
        // A policy that is garbage is no policy: the items count as requests.
        assert_eq!(
            requests(&[("RateLimit-Policy", "}{"), ("RateLimit", "\"d\";r=5")]),
            (Some(5), None)
        );
    }

    #[test]
    fn the_older_drafts_fields() {
        assert_eq!(
            requests(&[
                ("RateLimit-Limit", "100"),
                ("RateLimit-Remaining", "50"),
                ("RateLimit-Reset", "30"),
            ]),
            (Some(50), Some(30_000_000))
        );
        assert_eq!(requests(&[("RateLimit-Remaining", "50")]), (Some(50), None));
        // A reset without what is left says nothing.
        assert_eq!(requests(&[("RateLimit-Reset", "30")]), (None, None));
        assert_eq!(
            requests(&[("RateLimit-Remaining", "50"), ("RateLimit-Reset", "-30")]),
            (Some(50), None)
        );
        // With the newer form: the more restrictive.
        assert_eq!(
            requests(&[
                ("RateLimit", "\"d\";r=10;t=5"),
                ("RateLimit-Remaining", "3"),
                ("RateLimit-Reset", "9"),
            ]),
            (Some(3), Some(9_000_000))
        );
    }

    #[test]
    fn githubs_fields() {
        // GitHub's REST API docs, "Rate limits for the REST API".
        let fields = [
            ("x-ratelimit-limit", "5000"),
            ("x-ratelimit-remaining", "4999"),
            ("x-ratelimit-used", "1"),
            ("x-ratelimit-reset", "1691591363"),
            ("x-ratelimit-resource", "core"),
        ];
        let r = at(200, &fields, (1_691_591_363 - 1_200) * 1_000_000);
        assert_eq!(r.remaining, Some(4999));
        assert_eq!(r.reset_us, Some(1_200_000_000));
        // Half a second before.
        let r = at(200, &fields, 1_691_591_362_500_000);
        assert_eq!(r.reset_us, Some(500_000));
        // Past: 0.
        let r = at(200, &fields, 1_691_591_400_000_000);
        assert_eq!((r.remaining, r.reset_us), (Some(4999), Some(0)));
        // The older docs' example, from far before: a day.
        let r = at(
            200,
            &[
                ("X-RateLimit-Remaining", "56"),
                ("X-RateLimit-Reset", "1372700873"),
            ],
            1_000_000_000_000_000,
        );
        assert_eq!((r.remaining, r.reset_us), (Some(56), Some(MAX_WAIT_US)));
    }

    #[test]
    fn x_ratelimit_reset_in_seconds_from_now() {
        let reset = |v: &str| requests(&[("x-ratelimit-remaining", "9"), ("x-ratelimit-reset", v)]);
        assert_eq!(reset("60"), (Some(9), Some(60_000_000)));
        assert_eq!(reset("0"), (Some(9), Some(0)));
        assert_eq!(reset("86401"), (Some(9), Some(MAX_WAIT_US)));
        // 10^9 is not yet a date: a billion seconds, a day.
        assert_eq!(reset("1000000000"), (Some(9), Some(MAX_WAIT_US)));
        // The year 2286, and past any u64 of µs.
        assert_eq!(reset("9999999999"), (Some(9), Some(MAX_WAIT_US)));
        assert_eq!(reset("99999999999999999999"), (Some(9), Some(MAX_WAIT_US)));
        for bad in ["-60", "60.5", "1e9", "+60", "60s", "1 0"] {
            assert_eq!(reset(bad), (Some(9), None), "{bad:?}");
        }
    }

    #[test]
    fn counts_refuse_what_is_not_digits() {
        for bad in ["-1", "+1", "1.0", "1e9", "4,999", "0x10", "five", "1 2"] {
            assert_eq!(
                requests(&[("x-ratelimit-remaining", bad)]),
                (None, None),
                "{bad:?}"
            );
        }
        assert_eq!(requests(&[("x-ratelimit-remaining", "")]), (None, None));
        assert_eq!(requests(&[("x-ratelimit-remaining", "  ")]), (None, None));
        assert_eq!(
            requests(&[("x-ratelimit-remaining", " 0 ")]),
            (Some(0), None)
        );
        // Beyond a u64: as good as unlimited.
        assert_eq!(
            requests(&[("x-ratelimit-remaining", "99999999999999999999999")]),
            (Some(u64::MAX), None)
        );
        let mut map = HeaderMap::new();
        map.insert(
            "x-ratelimit-remaining",
            HeaderValue::from_bytes(b"4\xe2\x80\x8b9").unwrap(),
        );
        assert_eq!(read(StatusCode::OK, &map, ALL, NOW).remaining, None);
        map.insert(
            "x-ratelimit-remaining",
            HeaderValue::from_str("４９").unwrap(),
        );
        assert_eq!(read(StatusCode::OK, &map, ALL, NOW).remaining, None);
    }

    #[test]
    fn a_field_twice_with_different_values_is_ignored() {
        assert_eq!(
            requests(&[
                ("x-ratelimit-remaining", "10"),
                ("X-RateLimit-Remaining", "20"),
                ("x-ratelimit-reset", "60"),
            ]),
            (None, None)
        );
        assert_eq!(
            requests(&[
                ("x-ratelimit-remaining", "10"),
                ("x-ratelimit-remaining", "10"),
                ("x-ratelimit-reset", "60"),
                ("x-ratelimit-reset", "30"),
            ]),
            (Some(10), None)
        );
        assert_eq!(
            requests(&[
                ("x-ratelimit-remaining", "10"),
                ("x-ratelimit-remaining", "10"),
                ("x-ratelimit-reset", "60"),
                ("x-ratelimit-reset", "60"),
            ]),
            (Some(10), Some(60_000_000))
        );
    }

    #[test]
    fn openais_fields() {
        // OpenAI's docs, "Rate limits": rate limits in headers.
        let r = at(
            200,
            &[
                ("x-ratelimit-limit-requests", "60"),
                ("x-ratelimit-limit-tokens", "150000"),
                ("x-ratelimit-remaining-requests", "59"),
                ("x-ratelimit-remaining-tokens", "149984"),
                ("x-ratelimit-reset-requests", "1s"),
                ("x-ratelimit-reset-tokens", "6m0s"),
            ],
            NOW,
        );
        assert_eq!(
            r,
            Reported {
                pause_us: None,
                remaining: Some(59),
                reset_us: Some(1_000_000),
                remaining_tokens: Some(149_984),
                tokens_reset_us: Some(360_000_000),
            }
        );
        // Fractions, as OpenAI-compatible providers send them.
        let r = at(
            200,
            &[
                ("x-ratelimit-remaining-requests", "14399"),
                ("x-ratelimit-remaining-tokens", "5980"),
                ("x-ratelimit-reset-requests", "2m59.56s"),
                ("x-ratelimit-reset-tokens", "200ms"),
            ],
            NOW,
        );
        assert_eq!((r.remaining, r.reset_us), (Some(14399), Some(179_560_000)));
        assert_eq!(
            (r.remaining_tokens, r.tokens_reset_us),
            (Some(5980), Some(200_000))
        );
        // Tokens' reset unreadable: the tokens still count.
        let r = at(
            200,
            &[
                ("x-ratelimit-remaining-tokens", "0"),
                ("x-ratelimit-reset-tokens", "-6m"),
            ],
            NOW,
        );
        assert_eq!((r.remaining_tokens, r.tokens_reset_us), (Some(0), None));
        assert_eq!((r.remaining, r.reset_us), (None, None));
    }

    #[test]
    fn per_requests_and_plain_fields_the_more_restrictive() {
        assert_eq!(
            requests(&[
                ("x-ratelimit-remaining", "30"),
                ("x-ratelimit-reset", "60"),
                ("x-ratelimit-remaining-requests", "59"),
                ("x-ratelimit-reset-requests", "1s"),
            ]),
            (Some(30), Some(60_000_000))
        );
        // Across families too.
        assert_eq!(
            requests(&[
                ("ratelimit", "\"d\";r=2;t=5"),
                ("x-ratelimit-remaining", "30"),
                ("x-ratelimit-reset", "60"),
            ]),
            (Some(2), Some(5_000_000))
        );
    }

    #[test]
    fn go_durations() {
        for (value, us) in [
            ("1s", 1_000_000),
            ("6m0s", 360_000_000),
            ("0.5s", 500_000),
            ("20ms", 20_000),
            ("1m30.5s", 90_500_000),
            ("1h2m3s", 3_723_000_000),
            ("1h", 3_600_000_000),
            (".5s", 500_000),
            ("1.s", 1_000_000),
            ("0s", 0),
            ("0", 0),
            ("1500us", 1_500),
            ("1ns", 1),
            ("1001ns", 2),
            ("0.0000001s", 1),
            ("1.123456789123456789123s", 1_123_457),
            ("24h", MAX_WAIT_US),
            ("25h", MAX_WAIT_US),
            ("99999999999999999999999999999999999999999h", MAX_WAIT_US),
        ] {
            assert_eq!(go_duration_us(value), Some(us), "{value:?}");
        }
        for bad in [
            "", "1", "s", ".s", "-1s", "+1s", "1x", "1S", "1 s", " 1s", "1s2", "1e3s", "1..5s",
            "ms", "1µs", "∞s",
        ] {
            assert_eq!(go_duration_us(bad), None, "{bad:?}");
        }
        // Plain digits in a reset field: seconds, as X-RateLimit-Reset reads them.
        assert_eq!(reset_duration("2", NOW), Some(2_000_000));
        assert_eq!(reset_duration("1700000010", NOW), Some(10_000_000));
    }
}
