//! What a rule charges for (issue 27), validated at load: which answers it charges at all
//! (`charge`), and where a request's real cost comes from (`cost_header`, `cost_from`)
//! and what it reserves on arrival (`reserve`).

use http::{HeaderName, StatusCode};

use super::usage::UsageField;

/// Which answers a rule's charge stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Charge {
    /// Every admitted request, whatever its answer (the default, and before issue 27 the
    /// only behaviour).
    Always,
    /// Only answers with these statuses: any other status, or no answer (the backend
    /// unreachable or too slow, the client gone before the head), is refunded.
    Statuses(StatusSet),
}

/// A set of HTTP statuses (100–999), as written: classes (`"2xx"`) and codes (`"404"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusSet([u64; 16]);

impl StatusSet {
    /// `items` such as `["2xx", "3xx", "404"]`; the first item that is neither, as the
    /// error.
    pub fn parse<'a>(items: impl IntoIterator<Item = &'a str>) -> Result<StatusSet, String> {
        let mut bits = [0u64; 16];
        let mut set = |code: u16| bits[usize::from(code / 64)] |= 1 << (code % 64);
        let mut any = false;
        for item in items {
            let b = item.as_bytes();
            let bad = || {
                format!("{item:?} is not a status: a class (\"2xx\") or a code from 100 to 999 (\"404\")")
            };
            match b {
                [c @ b'1'..=b'9', b'x' | b'X', b'x' | b'X'] => {
                    let base = u16::from(c - b'0') * 100;
                    (base..base + 100).for_each(&mut set);
                }
                [b'1'..=b'9', b'0'..=b'9', b'0'..=b'9'] => {
                    set(item.parse::<u16>().map_err(|_| bad())?);
                }
                _ => return Err(bad()),
            }
            any = true;
        }
        if !any {
            return Err("statuses is empty: no answer would be charged (use charge = \"always\", or list the statuses that are)".into());
        }
        Ok(StatusSet(bits))
    }

    pub fn contains(&self, status: StatusCode) -> bool {
        let code = status.as_u16();
        code < 1024 && self.0[usize::from(code / 64)] & (1 << (code % 64)) != 0
    }
}

/// How one rule settles what it charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub charge: Charge,
    /// The answer's header (or trailer) reporting the request's real cost, removed before
    /// the client sees it.
    pub cost_header: Option<HeaderName>,
    /// The usage count of an OpenAI-compatible answer (`cost_from = "openai_usage"`).
    pub usage: Option<UsageField>,
    /// Reserve the request's own `max_tokens` on arrival (`reserve = "max_tokens"`).
    pub reserve_max_tokens: bool,
}

impl Policy {
    /// Whether the answer's status alone refunds the charge.
    pub fn refunds(&self, status: StatusCode) -> bool {
        match &self.charge {
            Charge::Always => false,
            Charge::Statuses(set) => !set.contains(status),
        }
    }

    /// Whether no answer at all (the backend failed, the client went away) refunds it.
    pub fn refunds_unanswered(&self) -> bool {
        matches!(self.charge, Charge::Statuses(_))
    }

    /// Whether a cost may still come after the head: in a trailer, or in the body's usage.
    pub fn settles_at_end(&self) -> bool {
        self.cost_header.is_some() || self.usage.is_some()
    }
}

/// A reported cost: a whole number at least 0 (leading and trailing spaces allowed), or
/// `None`.
pub fn parse_cost(value: &http::HeaderValue) -> Option<u64> {
    let s = value.to_str().ok()?.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_and_codes_make_one_set() {
        let s = StatusSet::parse(["2xx", "304", "3XX"]).unwrap();
        for code in [200u16, 204, 299, 300, 304, 399] {
            assert!(s.contains(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        for code in [100u16, 199, 400, 404, 500, 503] {
            assert!(!s.contains(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        let only = StatusSet::parse(["404"]).unwrap();
        assert!(only.contains(StatusCode::NOT_FOUND));
        assert!(!only.contains(StatusCode::OK));
    }

    #[test]
    fn anything_else_is_refused_by_name() {
        for bad in ["2x", "2xxx", "0xx", "099", "20a", "ok", "", " 200"] {
            let e = StatusSet::parse([bad]).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
        assert!(StatusSet::parse([]).unwrap_err().contains("empty"));
    }

    #[test]
    fn a_cost_is_a_whole_number() {
        let v = |s: &str| http::HeaderValue::from_str(s).unwrap();
        assert_eq!(parse_cost(&v("40")), Some(40));
        assert_eq!(parse_cost(&v(" 0 ")), Some(0));
        for bad in ["", "-1", "1.5", "4e2", "+3", "x", "99999999999999999999999"] {
            assert_eq!(parse_cost(&v(bad)), None, "{bad:?}");
        }
    }
}
