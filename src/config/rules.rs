//! `[[rules]]`: which requests a rule applies to, who it counts them for, its limit (a
//! rate or a concurrency cap) and its plans, and how it acts (enforce, shadow, rollout).

use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroU64};
use std::ops::Range;
use std::time::Duration;

use http::HeaderName;
use jiff::tz::TimeZone;
use serde::Deserialize;
use toml::Spanned;

use super::matching::{self, Owner, RawMatch};
use super::values::{ByteRate, ByteSize, HumanDuration, KeySpec, Priority, RuleName};
use super::Invalid;
use crate::identity::{Key, KeyKind, MissingKey};
use crate::limiter::calendar::{self, Period};
use crate::limiter::{Algorithm, LocalShare, Quota, QuotaError, QuotaField, Rate};
use crate::rules::{Bytes, Match, Messages, Mode, Plan, Rule};
use crate::settle::policy::{Charge, Drain, MaxTokens, Policy, StatusSet};
use crate::settle::usage::UsageField;

/// Requests wait at most this many per rule, per gateway, unless `max_waiting` says.
pub const DEFAULT_MAX_WAITING: u32 = 1_000;
/// The longest a request may be made to wait for its tokens.
pub const MAX_DELAY: Duration = Duration::from_secs(300);
/// How long a concurrency lease lives in a shared store without renewal, by default.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRule {
    pub(super) name: Spanned<RuleName>,
    #[serde(rename = "match")]
    matcher: Option<Spanned<RawMatch>>,
    key: KeySpec,
    #[serde(default)]
    missing_key: MissingKey,
    algorithm: Option<Spanned<Algorithm>>,
    rate: Option<Spanned<Rate>>,
    timezone: Option<Spanned<String>>,
    anchor_day: Option<Spanned<i64>>,
    burst: Option<Spanned<NonZeroU64>>,
    cost: Option<Spanned<NonZeroU64>>,
    mode: Option<Spanned<Mode>>,
    enforce_percent: Option<Spanned<u8>>,
    max_delay: Option<Spanned<HumanDuration>>,
    max_waiting: Option<Spanned<NonZeroU32>>,
    max_in_flight: Option<Spanned<NonZeroU64>>,
    lease_ttl: Option<Spanned<HumanDuration>>,
    retry_jitter: Option<HumanDuration>,
    settle_within: Option<HumanDuration>,
    messages: Option<Spanned<RawMessages>>,
    bytes: Option<Spanned<RawBytes>>,
    charge: Option<Spanned<RawCharge>>,
    cost_header: Option<Spanned<String>>,
    cost_from: Option<Spanned<CostFrom>>,
    usage: Option<Spanned<UsageField>>,
    reserve: Option<Spanned<Reserve>>,
    default_reserve: Option<Spanned<DefaultReserve>>,
    on_unreadable: Option<Spanned<OnUnreadable>>,
    settle_drain: Option<Spanned<RawDrain>>,
    max_debt: Option<Spanned<u64>>,
    local_share: Option<Spanned<String>>,
    #[serde(default)]
    plans: HashMap<String, Spanned<RawPlanOverride>>,
}

/// `charge = "always"` or `charge = { statuses = ["2xx", "3xx"], attempts = { ... } }`.
/// (Not an untagged enum: its error would hide what is wrong inside the table.)
enum RawCharge {
    Named(String),
    Statuses(RawStatuses),
}

impl<'de> Deserialize<'de> for RawCharge {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawCharge;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "\"always\" or { statuses = [\"2xx\", ...], attempts = { rate, burst } }",
                )
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<RawCharge, E> {
                Ok(RawCharge::Named(s.to_string()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<RawCharge, A::Error> {
                RawStatuses::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(RawCharge::Statuses)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStatuses {
    statuses: Vec<String>,
    attempts: Option<RawAttempts>,
}

/// `attempts = { rate = "100/m", burst = 100 }`: the ceiling on every attempt of a rule
/// that refunds by status, counted whatever the answer and never refunded. (Inside the
/// untagged `charge`, whose span its errors point at: a span of its own is not kept
/// through an untagged enum.)
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAttempts {
    rate: Rate,
    burst: Option<NonZeroU64>,
}

/// `default_reserve`: a whole number of tokens, at least 1.
struct DefaultReserve(u64);

impl<'de> Deserialize<'de> for DefaultReserve {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "default_reserve is a whole number of tokens, at least 1 (e.g. default_reserve = 4096)",
            )
        })?;
        match u64::try_from(n) {
            Ok(n) if n >= 1 => Ok(DefaultReserve(n)),
            _ => Err(serde::de::Error::custom(format!(
                "default_reserve = {n}: a whole number of tokens, at least 1 (e.g. default_reserve = 4096)"
            ))),
        }
    }
}

/// `on_unreadable`: what a rule with `reserve = "max_tokens"` does with a body that says
/// no usable `max_tokens`.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum OnUnreadable {
    /// Reserve `default_reserve`.
    Reserve,
    /// Refuse the request (411 without a body, 413 over 1 MiB, 400 otherwise).
    Reject,
}

/// `settle_drain = { bytes = "10MiB", time = "60s" }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDrain {
    bytes: Option<ByteSize>,
    time: Option<HumanDuration>,
}

/// `cost_from`: where an answer reports its cost.
#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum CostFrom {
    /// The usage object of an OpenAI-compatible answer (JSON or server-sent events).
    OpenaiUsage,
}

/// `reserve`: what is charged on arrival, before the cost is known.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Reserve {
    /// The rule's `cost`.
    Cost,
    /// The request's own `max_tokens` (bodies up to 1 MiB, whatever their type), else
    /// `default_reserve`.
    MaxTokens,
}

/// `messages = { rate = "50/s", burst = 100, max_bytes = "1MiB" }`: the WebSocket data
/// frames a client may send on the sockets the rule admitted, per identity, and the
/// largest message.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMessages {
    rate: Spanned<Rate>,
    burst: Option<Spanned<NonZeroU64>>,
    max_bytes: Option<Spanned<ByteSize>>,
}

/// `bytes = { rate = "1MiB/s", burst = "4MiB" }`: the WebSocket payload bytes a client
/// may send on the sockets the rule admitted, per identity.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBytes {
    rate: Spanned<ByteRate>,
    burst: Option<Spanned<ByteSize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlanOverride {
    exempt: Option<Spanned<bool>>,
    /// Its requests' place in an overloaded pool's queue (higher first; default 0).
    priority: Option<Priority>,
    rate: Option<Rate>,
    burst: Option<NonZeroU64>,
    algorithm: Option<Algorithm>,
    cost: Option<NonZeroU64>,
    max_in_flight: Option<NonZeroU64>,
}

/// Where in the file a rule is: its table's span, and its index for key paths.
struct At<'r> {
    index: usize,
    span: Range<usize>,
    rule: &'r RawRule,
}

impl At<'_> {
    /// `rules[i].<key>`.
    fn key(&self, key: &str) -> String {
        format!("rules[{}].{key}", self.index)
    }

    fn no(&self, span: Option<Range<usize>>, key: &str, message: impl Into<String>) -> Invalid {
        Invalid::new(span, self.key(key), message)
    }
}

/// The bound a rule's numbers make, before plans: a rate, or a concurrency cap (not
/// `decide::limits::Limit`, a rule applied to one request).
enum Bound {
    Rate(RateLimit),
    Concurrency { max: NonZeroU64, lease: Duration },
}

/// A rate limit's numbers, as a rule (or a plan over it) gives them.
#[derive(Clone, Copy)]
struct RateLimit {
    algorithm: Algorithm,
    rate: Rate,
    burst: Option<NonZeroU64>,
    cost: NonZeroU64,
    max_delay: Option<Duration>,
}

impl Bound {
    fn quota(&self) -> Result<Quota, QuotaError> {
        match *self {
            Bound::Concurrency { max, lease } => Ok(Quota::concurrency(max, lease)),
            Bound::Rate(rate) => rate.quota(),
        }
    }
}

impl RateLimit {
    fn quota(&self) -> Result<Quota, QuotaError> {
        let q = Quota::new(self.algorithm, self.rate, self.burst, self.cost)?;
        match self.max_delay {
            Some(d) => q.with_max_delay(d),
            None => Ok(q),
        }
    }
}

impl RawRule {
    /// The plans this rule has a `[rules.plans.<plan>]` table for.
    pub(super) fn plan_names(&self) -> impl Iterator<Item = &str> {
        self.plans.keys().map(String::as_str)
    }

    /// One rule, validated: its limit, its plans, its match, its mode; and with `charge =
    /// { statuses }` its attempts ceiling, a rule of its own ([`Rule::ceiling_of`]).
    /// `index` and `span`: where the file has it. A plan no key in the files names is no
    /// error: keys are given plans at runtime too (the admin API's directory).
    pub(super) fn validate(
        &self,
        index: usize,
        span: Range<usize>,
        key_header: &HeaderName,
        routes: &[Option<String>],
    ) -> Result<(Rule, Option<Rule>), Invalid> {
        let at = At {
            index,
            span,
            rule: self,
        };
        let limit = at.limit()?;
        let (settle, attempts) = at.settle()?;
        let (zone, anchor_day) = at.calendar(&limit)?;
        let quota = at.with_debt(
            limit
                .quota()
                .map_err(|e| at.blame(e))?
                .in_zone(zone, anchor_day),
        )?;
        let (mode, enforce_percent) = at.mode()?;
        let share = at.local_share()?;
        let quota = Quota {
            local_share: share,
            ..quota
        };
        let mut plans = at.plans(&limit, zone, anchor_day)?;
        for plan in plans.values_mut() {
            if let Plan::Limit(q) = plan {
                *q = Quota {
                    local_share: share,
                    ..at.with_debt(*q)?
                };
            }
        }
        let priorities = self
            .plans
            .iter()
            .filter_map(|(plan, o)| Some((plan.clone(), o.get_ref().priority.as_ref()?.0)))
            .collect();
        let rule = Rule {
            name: self.name.get_ref().0.clone(),
            matcher: match &self.matcher {
                Some(m) => {
                    let owner = Owner::Rule {
                        counted_by: &self.key.0,
                        routes,
                    };
                    matching::validate(m, &format!("rules[{index}]"), &owner, key_header)?
                }
                None => Match::default(),
            },
            key: Key {
                kind: self.key.0.clone(),
                missing: self.missing_key,
            },
            plans,
            priorities,
            quota,
            mode,
            enforce_percent,
            max_waiting: self
                .max_waiting
                .as_ref()
                .map_or(DEFAULT_MAX_WAITING, |w| w.get_ref().get()),
            retry_jitter_us: self
                .retry_jitter
                .as_ref()
                .map_or(0, |j| u64::try_from(j.0.as_micros()).unwrap_or(u64::MAX)),
            messages: at.messages()?,
            bytes: at.bytes()?,
            settle,
            settle_within: self
                .settle_within
                .as_ref()
                .map_or(crate::rules::SETTLE_WITHIN, |d| d.0),
            ceiling_of: None,
        };
        let ceiling = attempts.map(|q| {
            rule.attempts_ceiling(Quota {
                local_share: share,
                ..q
            })
        });
        Ok((rule, ceiling))
    }
}

impl Rule {
    /// The attempts ceiling of this rule (`charge.attempts`): every request it applies to
    /// is counted under `quota`, by the same identity, whatever the answer, and never
    /// refunded. Named `<rule>.attempts`; a plan exempt from the rule is exempt from it
    /// too; it enforces, watches and rolls out as the rule does.
    fn attempts_ceiling(&self, quota: Quota) -> Rule {
        Rule {
            name: format!("{}.attempts", self.name),
            matcher: self.matcher.clone(),
            key: self.key.clone(),
            quota,
            plans: self
                .plans
                .iter()
                .filter(|(_, p)| matches!(p, Plan::Exempt))
                .map(|(name, _)| (name.clone(), Plan::Exempt))
                .collect(),
            priorities: HashMap::new(),
            mode: self.mode,
            enforce_percent: self.enforce_percent,
            max_waiting: DEFAULT_MAX_WAITING,
            retry_jitter_us: self.retry_jitter_us,
            messages: None,
            bytes: None,
            settle: None,
            settle_within: self.settle_within,
            ceiling_of: Some(self.name.clone()),
        }
    }
}

impl At<'_> {
    /// A rule limits a rate or a concurrency, never both; each takes only its own keys.
    fn limit(&self) -> Result<Bound, Invalid> {
        let r = self.rule;
        let max = match (&r.rate, &r.max_in_flight) {
            (Some(_), Some(m)) => return Err(self.no(
                Some(m.span()),
                "max_in_flight",
                "a rule has either rate (a rate limit) or max_in_flight (a concurrency limit), not both; make two rules",
            )),
            (None, None) => return Err(self.no(
                Some(self.span.clone()),
                "rate",
                "missing rate (e.g. \"10/s\"), or max_in_flight for a concurrency limit",
            )),
            (None, Some(m)) => Some(*m.get_ref()),
            (Some(_), None) => None,
        };
        let only_rates: [(&str, Option<Range<usize>>); 14] = [
            ("algorithm", r.algorithm.as_ref().map(Spanned::span)),
            ("charge", r.charge.as_ref().map(Spanned::span)),
            ("cost_header", r.cost_header.as_ref().map(Spanned::span)),
            ("cost_from", r.cost_from.as_ref().map(Spanned::span)),
            ("usage", r.usage.as_ref().map(Spanned::span)),
            ("reserve", r.reserve.as_ref().map(Spanned::span)),
            (
                "default_reserve",
                r.default_reserve.as_ref().map(Spanned::span),
            ),
            ("on_unreadable", r.on_unreadable.as_ref().map(Spanned::span)),
            ("settle_drain", r.settle_drain.as_ref().map(Spanned::span)),
            ("max_debt", r.max_debt.as_ref().map(Spanned::span)),
            ("burst", r.burst.as_ref().map(Spanned::span)),
            ("cost", r.cost.as_ref().map(Spanned::span)),
            ("max_delay", r.max_delay.as_ref().map(Spanned::span)),
            ("max_waiting", r.max_waiting.as_ref().map(Spanned::span)),
        ];
        if let Some(max) = max {
            if let Some((key, span)) = only_rates.into_iter().find(|(_, s)| s.is_some()) {
                return Err(self.no(
                    span,
                    key,
                    format!("{key} does not apply to a max_in_flight rule (a concurrency limit)"),
                ));
            }
            return Ok(Bound::Concurrency {
                max,
                lease: self.lease_ttl()?,
            });
        }
        if let Some(l) = &r.lease_ttl {
            return Err(self.no(
                Some(l.span()),
                "lease_ttl",
                "lease_ttl applies to max_in_flight rules only",
            ));
        }
        if let (None, Some(w)) = (&r.max_delay, &r.max_waiting) {
            return Err(self.no(
                Some(w.span()),
                "max_waiting",
                "max_waiting bounds requests waiting under max_delay; set max_delay too",
            ));
        }
        if let Some(d) = r.max_delay.as_ref().filter(|d| d.get_ref().0 > MAX_DELAY) {
            return Err(self.no(
                Some(d.span()),
                "max_delay",
                format!(
                    "max_delay is at most {}: a request held longer has usually been given up on",
                    humantime::format_duration(MAX_DELAY)
                ),
            ));
        }
        let rate = r
            .rate
            .as_ref()
            .map(|r| *r.get_ref())
            .ok_or_else(|| self.no(Some(self.span.clone()), "rate", "missing rate"))?;
        Ok(Bound::Rate(RateLimit {
            algorithm: r
                .algorithm
                .as_ref()
                .map_or_else(Algorithm::default, |a| *a.get_ref()),
            rate,
            burst: r.burst.as_ref().map(|b| *b.get_ref()),
            cost: r.cost.as_ref().map_or(NonZeroU64::MIN, |c| *c.get_ref()),
            max_delay: r.max_delay.as_ref().map(|d| d.get_ref().0),
        }))
    }

    /// `messages`, on any rule: it limits the frames of the sockets the rule admitted, and
    /// their messages' size. Its bucket is checked as the meter will charge it (a batch at
    /// a time).
    fn messages(&self) -> Result<Option<Messages>, Invalid> {
        let Some(raw) = &self.rule.messages else {
            return Ok(None);
        };
        let m = raw.get_ref();
        let rate = *m.rate.get_ref();
        let max_bytes = match &m.max_bytes {
            Some(b) if b.get_ref().0 == 0 => {
                return Err(self.no(
                    Some(b.span()),
                    "messages.max_bytes",
                    "max_bytes is at least 1 byte (e.g. max_bytes = \"1MiB\"); leave it out for no limit",
                ))
            }
            b => b.as_ref().map(|b| b.get_ref().0),
        };
        let messages = Messages {
            rate,
            burst: m.burst.as_ref().map_or(rate.count, |b| b.get_ref().get()),
            max_bytes,
        };
        crate::websocket::meter::quota(messages.rate, messages.burst).map_err(|e| {
            let (key, span) = match e.field {
                QuotaField::Rate => ("rate", m.rate.span()),
                _ => ("burst", m.burst.as_ref().map_or(raw.span(), Spanned::span)),
            };
            self.no(Some(span), &format!("messages.{key}"), e.message)
        })?;
        Ok(Some(messages))
    }

    /// `bytes`, on any rule: it limits the payload bytes of the sockets the rule admitted.
    /// Its bucket is checked as the meter will charge it.
    fn bytes(&self) -> Result<Option<Bytes>, Invalid> {
        let Some(raw) = &self.rule.bytes else {
            return Ok(None);
        };
        let b = raw.get_ref();
        let rate = b.rate.get_ref().0;
        let burst = match &b.burst {
            Some(s) if s.get_ref().0 == 0 => {
                return Err(self.no(
                    Some(s.span()),
                    "bytes.burst",
                    "burst is at least 1 byte (e.g. burst = \"4MiB\"); leave it out for the rate's bytes",
                ))
            }
            s => s.as_ref().map_or(rate.count, |s| s.get_ref().0),
        };
        crate::websocket::meter::quota(rate, burst).map_err(|e| {
            let (key, span) = match e.field {
                QuotaField::Rate => ("rate", b.rate.span()),
                _ => ("burst", b.burst.as_ref().map_or(raw.span(), Spanned::span)),
            };
            self.no(Some(span), &format!("bytes.{key}"), e.message)
        })?;
        Ok(Some(Bytes { rate, burst }))
    }

    /// `charge`, `cost_header`, `cost_from` (with `usage`, `reserve`, `default_reserve`,
    /// `on_unreadable`), `settle_drain` and `max_debt`: how the rule's charges are
    /// settled, or `None` when they stand as taken; and with `charge = { statuses }` its
    /// attempts ceiling's quota.
    fn settle(&self) -> Result<(Option<std::sync::Arc<Policy>>, Option<Quota>), Invalid> {
        let r = self.rule;
        let mut attempts = None;
        let charge = match &r.charge {
            None => Charge::Always,
            Some(c) => match c.get_ref() {
                RawCharge::Named(n) if n == "always" => Charge::Always,
                RawCharge::Named(n) => {
                    return Err(self.no(
                        Some(c.span()),
                        "charge",
                        format!(
                            "charge is \"always\" or {{ statuses = [\"2xx\", ...], attempts = {{ rate, burst }} }}, not {n:?}"
                        ),
                    ))
                }
                RawCharge::Statuses(s) => {
                    let set = StatusSet::parse(s.statuses.iter().map(String::as_str))
                        .map_err(|e| self.no(Some(c.span()), "charge.statuses", e))?;
                    attempts = Some(self.attempts(s.attempts.as_ref(), c.span())?);
                    Charge::Statuses(set)
                }
            },
        };
        let cost_header = match &r.cost_header {
            None => None,
            Some(h) => Some(
                HeaderName::from_bytes(h.get_ref().as_bytes())
                    .ok()
                    .filter(|n| !crate::upstream::is_hop_by_hop(n))
                    .ok_or_else(|| {
                        self.no(
                            Some(h.span()),
                            "cost_header",
                            format!("{:?} is not a header name an answer can carry end to end (e.g. \"x-ratelimit-cost\")", h.get_ref()),
                        )
                    })?,
            ),
        };
        let needs_cost_from = |key: &str, span: Range<usize>| {
            self.no(
                Some(span),
                key,
                format!("{key} applies with cost_from = \"openai_usage\""),
            )
        };
        let usage = match (&r.cost_from, &r.usage) {
            (Some(_), u) => Some(u.as_ref().map_or(UsageField::TotalTokens, |u| *u.get_ref())),
            (None, Some(u)) => return Err(needs_cost_from("usage", u.span())),
            (None, None) => None,
        };
        let max_tokens = self.max_tokens(usage.is_some())?;
        let reads_a_cost = cost_header.is_some() || usage.is_some();
        if let Some(d) = &r.max_debt {
            if !reads_a_cost {
                return Err(self.no(
                    Some(d.span()),
                    "max_debt",
                    "max_debt lets a request borrow ahead of a cost reported later; it applies with cost_header or cost_from",
                ));
            }
        }
        let drain = match &r.settle_drain {
            None => Drain::default(),
            Some(d) if !reads_a_cost => {
                return Err(self.no(
                    Some(d.span()),
                    "settle_drain",
                    "settle_drain bounds how long an answer is read after its client left, to settle the cost its end reports; it applies with cost_header or cost_from",
                ))
            }
            Some(d) => {
                let raw = d.get_ref();
                let default = Drain::default();
                let bytes = raw.bytes.as_ref().map_or(default.bytes, |b| b.0);
                let time = raw.time.as_ref().map_or(default.time, |t| t.0);
                if bytes == 0 || time.is_zero() {
                    return Err(self.no(
                        Some(d.span()),
                        "settle_drain",
                        "settle_drain = { bytes, time } are both above 0 (default 10MiB and 60s): an answer cut at once would leave its cost unread",
                    ));
                }
                Drain { bytes, time }
            }
        };
        if charge == Charge::Always && !reads_a_cost {
            return Ok((None, attempts));
        }
        let policy = Policy {
            charge,
            cost_header,
            usage,
            max_tokens,
            drain,
        };
        Ok((Some(std::sync::Arc::new(policy)), attempts))
    }

    /// `charge.attempts`: required with `statuses`, since a rule that gives back every
    /// answer but those would otherwise make every failure free (a login endpoint that
    /// charges only successes lets a password be guessed without end).
    fn attempts(&self, raw: Option<&RawAttempts>, charge: Range<usize>) -> Result<Quota, Invalid> {
        let Some(attempts) = raw else {
            return Err(self.no(
                Some(charge),
                "charge.attempts",
                "charge = { statuses } gives back every other answer, so without a ceiling every failure would be free (a login that charges only successes lets a password be guessed without end): add attempts = { rate = \"100/m\", burst = 100 }, counted on every attempt and never given back",
            ));
        };
        Quota::new(
            Algorithm::TokenBucket,
            attempts.rate,
            attempts.burst,
            NonZeroU64::MIN,
        )
        .map_err(|e| {
            let key = match e.field {
                QuotaField::Burst => "charge.attempts.burst",
                _ => "charge.attempts.rate",
            };
            self.no(Some(charge), key, e.message)
        })
    }

    /// `reserve`, `default_reserve` and `on_unreadable`. `usage`: whether the rule reads
    /// an LLM answer's usage (`cost_from`), which `reserve` needs.
    fn max_tokens(&self, usage: bool) -> Result<Option<MaxTokens>, Invalid> {
        let r = self.rule;
        let needs_reserve = |key: &str, span: Range<usize>| {
            self.no(
                Some(span),
                key,
                format!("{key} applies with reserve = \"max_tokens\""),
            )
        };
        let reserves = match &r.reserve {
            Some(v) if !usage => {
                return Err(self.no(
                    Some(v.span()),
                    "reserve",
                    "reserve applies with cost_from = \"openai_usage\"",
                ))
            }
            Some(v) => *v.get_ref() == Reserve::MaxTokens,
            None => false,
        };
        if !reserves {
            if let Some(d) = &r.default_reserve {
                return Err(needs_reserve("default_reserve", d.span()));
            }
            if let Some(o) = &r.on_unreadable {
                return Err(needs_reserve("on_unreadable", o.span()));
            }
            return Ok(None);
        }
        let Some(default) = &r.default_reserve else {
            return Err(self.no(
                r.reserve.as_ref().map(Spanned::span),
                "default_reserve",
                "reserve = \"max_tokens\" needs default_reserve: what a request reserves when its body says no usable max_tokens (chunked, another type, none, 0, \"500\" ...), e.g. default_reserve = 4096; or on_unreadable = \"reject\" with it to refuse such bodies",
            ));
        };
        Ok(Some(MaxTokens {
            default: default.get_ref().0,
            reject: r.on_unreadable.as_ref().map(|o| *o.get_ref()) == Some(OnUnreadable::Reject),
        }))
    }

    /// `local_share`: this gateway's part of the limit while the store fails and
    /// `on_error = "local"` limits in process: `"a/b"`, or `"auto"` (one part per gateway
    /// seen writing its heartbeat).
    fn local_share(&self) -> Result<LocalShare, Invalid> {
        match &self.rule.local_share {
            None => Ok(LocalShare::default()),
            Some(s) => LocalShare::parse(s.get_ref())
                .map_err(|e| self.no(Some(s.span()), "local_share", e)),
        }
    }

    /// `q`, with the rule's `max_debt` where it sets one (else 0: no borrowing).
    fn with_debt(&self, q: Quota) -> Result<Quota, Invalid> {
        match &self.rule.max_debt {
            Some(d) => q
                .with_max_debt(*d.get_ref())
                .map_err(|e| self.no(Some(d.span()), "max_debt", e.message)),
            None => Ok(q),
        }
    }

    fn lease_ttl(&self) -> Result<Duration, Invalid> {
        match &self.rule.lease_ttl {
            Some(l) if l.get_ref().0 < Duration::from_secs(1) => Err(self.no(
                Some(l.span()),
                "lease_ttl",
                "lease_ttl is at least 1s (leases are renewed every third of it)",
            )),
            Some(l) => Ok(l.get_ref().0),
            None => Ok(DEFAULT_LEASE_TTL),
        }
    }

    /// `timezone` and `anchor_day`: the zone a calendar rate's periods are cut in (UTC by
    /// default) and the day its months begin (the 1st). Each needs a calendar rate, the
    /// rule's or a plan's, to apply to; an anchor day, that every one of them be a month.
    fn calendar(&self, limit: &Bound) -> Result<(&'static TimeZone, u8), Invalid> {
        let r = self.rule;
        let rule_rate = match limit {
            Bound::Rate(r) => Some(r.rate),
            Bound::Concurrency { .. } => None,
        };
        // Every calendar rate the rule has, with the plan it is a plan's.
        let mut plans: Vec<(&String, Rate)> = r
            .plans
            .iter()
            .filter_map(|(name, o)| o.get_ref().rate.map(|rate| (name, rate)))
            .collect();
        plans.sort_by(|a, b| a.0.cmp(b.0));
        let calendars: Vec<(Option<&String>, Rate)> = rule_rate
            .map(|rate| (None, rate))
            .into_iter()
            .chain(plans.into_iter().map(|(name, rate)| (Some(name), rate)))
            .filter(|(_, rate)| rate.calendar.is_some())
            .collect();
        let zone = match &r.timezone {
            Some(tz) => {
                if calendars.is_empty() {
                    return Err(self.no(
                        Some(tz.span()),
                        "timezone",
                        "timezone applies to a calendar rate (\"N/day\", \"N/week\", \"N/month\"), and this rule has none",
                    ));
                }
                calendar::zone(tz.get_ref()).map_err(|m| self.no(Some(tz.span()), "timezone", m))?
            }
            None => &calendar::UTC,
        };
        let Some(a) = &r.anchor_day else {
            return Ok((zone, 1));
        };
        let day = *a.get_ref();
        let no = |m: String| self.no(Some(a.span()), "anchor_day", m);
        if !(1..=28).contains(&day) {
            return Err(no(format!(
                "anchor_day is 1 to 28 (a day every month has), not {day}"
            )));
        }
        if calendars.is_empty() {
            return Err(no(
                "anchor_day is the day a calendar month begins: it needs rate = \"N/month\"".into(),
            ));
        }
        if let Some((plan, rate)) = calendars
            .iter()
            .find(|(_, rate)| rate.calendar != Some(Period::Month))
        {
            let whose = plan.map_or(String::new(), |p| format!(" of plan {p:?}"));
            return Err(no(format!(
                "anchor_day is the day a calendar month begins, and rate \"{rate}\"{whose} is not a month (weeks begin on Monday, days at midnight)"
            )));
        }
        Ok((zone, day as u8))
    }

    /// A quota error, blamed on the setting it names where the file has it.
    fn blame(&self, e: QuotaError) -> Invalid {
        let r = self.rule;
        let named = match e.field {
            QuotaField::Burst => r.burst.as_ref().map(Spanned::span),
            QuotaField::Cost => r.cost.as_ref().map(Spanned::span),
            QuotaField::MaxDelay => r.max_delay.as_ref().map(Spanned::span),
            QuotaField::MaxDebt => None,
            QuotaField::Rate => None,
        };
        let fallback = r.rate.as_ref().map_or(self.span.clone(), Spanned::span);
        self.no(named.or(Some(fallback)), e.field.name(), e.message)
    }

    /// Each plan's quota: the rule's, with what the plan changes; or none, if exempt.
    fn plans(
        &self,
        limit: &Bound,
        zone: &'static TimeZone,
        anchor_day: u8,
    ) -> Result<HashMap<String, Plan>, Invalid> {
        let mut plans = HashMap::new();
        for (plan, o) in &self.rule.plans {
            let key = self.key(&format!("plans.{plan}"));
            let no = |k: &str, message: String| {
                let key = if k.is_empty() {
                    key.clone()
                } else {
                    format!("{key}.{k}")
                };
                Invalid::new(Some(o.span()), key, message)
            };
            let over = o.get_ref();
            // What the plan sets, the rate's keys first: an exempt plan sets none, a
            // concurrency rule's none of the rate's.
            let set = [
                ("rate", over.rate.is_some()),
                ("burst", over.burst.is_some()),
                ("algorithm", over.algorithm.is_some()),
                ("cost", over.cost.is_some()),
                ("max_in_flight", over.max_in_flight.is_some()),
            ];
            if let Some(exempt) = over.exempt.as_ref().filter(|e| *e.get_ref()) {
                if let Some((k, _)) = set.iter().find(|(_, set)| *set) {
                    return Err(Invalid::new(
                        Some(exempt.span()),
                        format!("{key}.exempt"),
                        format!("exempt = true: plan {plan:?} is not limited by this rule, so a {k} for it means nothing; drop one or the other"),
                    ));
                }
                plans.insert(plan.clone(), Plan::Exempt);
                continue;
            }
            let q = match *limit {
                Bound::Concurrency { max, lease } => {
                    if let Some((k, _)) = set[..4].iter().find(|(_, set)| *set) {
                        return Err(no(k, format!("{k} does not apply to a max_in_flight rule; a plan may set max_in_flight")));
                    }
                    Quota::concurrency(over.max_in_flight.unwrap_or(max), lease)
                }
                Bound::Rate(rule) => {
                    if over.max_in_flight.is_some() {
                        return Err(no(
                            "max_in_flight",
                            "max_in_flight applies to concurrency rules only".into(),
                        ));
                    }
                    let algorithm = over.algorithm.unwrap_or(rule.algorithm);
                    let plan_rate = RateLimit {
                        algorithm,
                        rate: over.rate.unwrap_or(rule.rate),
                        // The rule's burst carries over only to an algorithm that has one.
                        burst: over.burst.or(rule.burst.filter(|_| algorithm.has_burst())),
                        cost: over.cost.unwrap_or(rule.cost),
                        max_delay: rule.max_delay,
                    };
                    plan_rate
                        .quota()
                        .map_err(|e| no(e.field.name(), e.message))?
                        .in_zone(zone, anchor_day)
                }
            };
            plans.insert(plan.clone(), Plan::Limit(q));
        }
        Ok(plans)
    }

    fn mode(&self) -> Result<(Mode, u8), Invalid> {
        let r = self.rule;
        let mode = r.mode.as_ref().map_or(Mode::default(), |m| *m.get_ref());
        let percent = match &r.enforce_percent {
            Some(p) if *p.get_ref() > 100 => {
                return Err(self.no(
                    Some(p.span()),
                    "enforce_percent",
                    format!("enforce_percent is 0 to 100, not {}", p.get_ref()),
                ))
            }
            Some(p) if mode == Mode::Shadow => return Err(self.no(
                Some(p.span()),
                "enforce_percent",
                "enforce_percent rolls out an enforcing rule; with mode = \"shadow\" nothing is enforced",
            )),
            Some(p) if r.key.0 == KeyKind::Global && *p.get_ref() < 100 => return Err(self.no(
                Some(p.span()),
                "enforce_percent",
                "key = \"global\" is one identity: enforce_percent would enforce for everyone or no one; use mode = \"shadow\" or count by api_key or client_ip",
            )),
            Some(p) => *p.get_ref(),
            None => 100,
        };
        Ok((mode, percent))
    }
}
