//! What a rule charges for (issues 27 and 41), validated at load: which answers it charges
//! at all (`charge`), where a request's real cost comes from (`cost_header`, `cost_from`),
//! what it reserves on arrival (`reserve`, `default_reserve`, `on_unreadable`), and how
//! long the gateway reads on to settle after a client has gone (`settle_drain`).

use std::time::Duration;

use http::{HeaderName, StatusCode};

use super::usage::UsageField;

/// Which answers a rule's charge stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Charge {
    /// Every admitted request, whatever its answer (the default, and before issue 27 the
    /// only behaviour).
    Always,
    /// Only answers with these statuses: any other status is refunded, and so is a
    /// request that never reached a backend (none could be reached, an overload shed, the
    /// client gone before it was sent). A request a backend received keeps its charge
    /// whatever the client does after. Such a rule carries an attempts ceiling (`attempts`:
    /// a rule of its own, counted on every attempt, never refunded), so that failures are
    /// never free.
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

    fn has(&self, code: u16) -> bool {
        self.0[usize::from(code / 64)] & (1 << (code % 64)) != 0
    }
}

impl std::fmt::Display for StatusSet {
    /// As a file would write it: whole classes as `2xx`, other codes one by one.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut items = Vec::new();
        for class in 1..10u16 {
            let base = class * 100;
            if (base..base + 100).all(|c| self.has(c)) {
                items.push(format!("{class}xx"));
            } else {
                items.extend(
                    (base..base + 100)
                        .filter(|&c| self.has(c))
                        .map(|c| c.to_string()),
                );
            }
        }
        f.write_str(&items.join(", "))
    }
}

/// `reserve = "max_tokens"`: what a request reserves on arrival is the most its own body
/// asks the model for, and what it reserves when its body cannot say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxTokens {
    /// `default_reserve`: the reservation of a body that says no usable `max_tokens`.
    pub default: u64,
    /// `on_unreadable = "reject"`: such a body is refused (400, 411, 413) instead.
    pub reject: bool,
}

/// `settle_drain`: after the client has gone, how much more of the answer the gateway
/// reads, and for how long, to settle the cost its end reports (nginx's
/// `proxy_ignore_client_abort` is the model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    pub bytes: u64,
    pub time: Duration,
}

impl Default for Drain {
    /// 10 MiB, 60 s: a long streamed LLM answer's worth.
    fn default() -> Drain {
        Drain {
            bytes: 10 << 20,
            time: Duration::from_secs(60),
        }
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
    pub max_tokens: Option<MaxTokens>,
    /// What is read on after the client has gone, where a cost comes at the end.
    pub drain: Drain,
}

impl Policy {
    /// Whether the answer's status alone refunds the charge. A 101 (a WebSocket, any
    /// upgrade) never does: the connection it opened is the work.
    pub fn refunds(&self, status: StatusCode) -> bool {
        match &self.charge {
            Charge::Always => false,
            Charge::Statuses(_) if status == StatusCode::SWITCHING_PROTOCOLS => false,
            Charge::Statuses(set) => !set.contains(status),
        }
    }

    /// Whether a request that never reached a backend (none could be reached, shed, the
    /// client gone first) is refunded.
    pub fn refunds_unsent(&self) -> bool {
        matches!(self.charge, Charge::Statuses(_))
    }

    /// What a request reserves under this rule, its plan's quota charging `cost`, when
    /// its body asked for `asked` (`reserve = "max_tokens"`; `None` when the body was not
    /// read): the most it asks the model for — with `usage = "total_tokens"` plus an
    /// estimate of its prompt — or `default_reserve` when it says none. `None`: the
    /// rule's own cost.
    pub fn reservation(&self, asked: Option<&super::max_tokens::Asked>) -> Option<u64> {
        let m = self.max_tokens?;
        let asked = asked?;
        let prompt = |bytes| match self.usage {
            Some(UsageField::TotalTokens) => super::max_tokens::prompt_estimate(bytes),
            _ => 0,
        };
        Some(match *asked {
            super::max_tokens::Asked::Tokens { max, body_bytes } => {
                max.saturating_add(prompt(body_bytes))
            }
            super::max_tokens::Asked::Unreadable(_) => m.default,
        })
    }

    /// What `ratewall check` says of it, one line.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        match &self.charge {
            Charge::Always => {}
            Charge::Statuses(set) => parts.push(format!(
                "charges answers {set} only (others given back; so is a request that never reached a backend)"
            )),
        }
        if let Some(h) = &self.cost_header {
            parts.push(format!(
                "the cost the answer reports in {h} (header or trailer)"
            ));
        }
        if let Some(u) = self.usage {
            parts.push(format!("the {} an OpenAI-style answer reports", u.name()));
        }
        if let Some(m) = self.max_tokens {
            let prompt = match self.usage {
                Some(UsageField::TotalTokens) => " plus a token per 4 bytes of the body",
                _ => "",
            };
            let otherwise = match m.reject {
                true => "a body that says none is refused (400, 411, 413)".to_string(),
                false => format!("{} for a body that says none", m.default),
            };
            parts.push(format!(
                "reserves the request's max_tokens{prompt} ({otherwise})"
            ));
        }
        if self.settles_at_end() {
            let b = self.drain.bytes;
            let bytes = match b {
                _ if b.is_multiple_of(1 << 20) => format!("{}MiB", b >> 20),
                _ if b.is_multiple_of(1 << 10) => format!("{}KiB", b >> 10),
                _ => format!("{b} bytes"),
            };
            parts.push(format!(
                "reads on up to {bytes} or {} after a client leaves",
                humantime::format_duration(self.drain.time)
            ));
        }
        parts.join("; ")
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
    fn a_switch_of_protocols_is_never_refunded() {
        let p = Policy {
            charge: Charge::Statuses(StatusSet::parse(["2xx", "3xx"]).unwrap()),
            cost_header: None,
            usage: None,
            max_tokens: None,
            drain: Drain::default(),
        };
        assert!(!p.refunds(StatusCode::SWITCHING_PROTOCOLS));
        assert!(!p.refunds(StatusCode::OK));
        assert!(p.refunds(StatusCode::NOT_FOUND));
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
