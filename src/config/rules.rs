//! `[[rules]]`: which requests a rule applies to, who it counts them for, its limit (a
//! rate or a concurrency cap) and its plans, and how it acts (enforce, shadow, rollout).

use std::collections::{HashMap, HashSet};
use std::num::{NonZeroU32, NonZeroU64};
use std::ops::Range;
use std::time::Duration;

use std::fmt;

use http::HeaderName;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use toml::Spanned;

use super::values::{GlobSpec, Hosts, HumanDuration, KeySpec, MethodName, PathPrefix, RuleName};
use super::Invalid;
use crate::identity::{Carried, Key, KeyKind, MissingKey};
use crate::limiter::{Algorithm, Quota, QuotaError, QuotaField, Rate};
use crate::rules::{Condition, Match, Mode, PathMatch, Plan, Rule};

/// Requests wait at most this many per rule, per gateway, unless `max_waiting` says.
pub const DEFAULT_MAX_WAITING: u32 = 1_000;
/// The longest a request may be made to wait for its tokens.
pub const MAX_DELAY: Duration = Duration::from_secs(300);
/// How long a concurrency lease lives in a shared store without renewal, by default.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// `match`. Its `Deserialize` is written out (below) for the `"header:<name>"` keys, and
/// rejects unknown keys at their place in the file as `deny_unknown_fields` would.
#[derive(Default)]
struct RawMatch {
    path_prefix: Option<PathPrefix>,
    path: Option<PathPrefix>,
    glob: Option<GlobSpec>,
    methods: Vec<MethodName>,
    host: Hosts,
    api_key: Option<Spanned<Presence>>,
    /// `"header:<name>" = "present" | "absent"`, as written.
    /// In the file: `header:<name>`
    headers: Vec<(HeaderName, Spanned<Presence>)>,
}

/// The value of an identity condition in `match`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Presence {
    Present,
    Absent,
}

/// A key of `match`.
enum MatchKey {
    PathPrefix,
    Path,
    Glob,
    Methods,
    Host,
    ApiKey,
    Header(HeaderName),
}

const MATCH_KEYS: &[&str] = &[
    "path_prefix",
    "path",
    "glob",
    "methods",
    "host",
    "api_key",
    "header:<name>",
];

impl<'de> Deserialize<'de> for MatchKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(match s.as_str() {
            "path_prefix" => MatchKey::PathPrefix,
            "path" => MatchKey::Path,
            "glob" => MatchKey::Glob,
            "methods" => MatchKey::Methods,
            "host" => MatchKey::Host,
            "api_key" => MatchKey::ApiKey,
            other => match other.strip_prefix("header:") {
                Some(name) => HeaderName::from_bytes(name.trim().as_bytes())
                    .map(MatchKey::Header)
                    .map_err(|_| de::Error::custom(format!("invalid header name in {s:?}")))?,
                None => return Err(de::Error::unknown_field(other, MATCH_KEYS)),
            },
        })
    }
}

impl<'de> Deserialize<'de> for RawMatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = RawMatch;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a table of path_prefix, path, glob, methods, host, api_key, \"header:<name>\"",
                )
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawMatch, A::Error> {
                let mut m = RawMatch::default();
                while let Some(key) = map.next_key::<MatchKey>()? {
                    match key {
                        MatchKey::PathPrefix => m.path_prefix = Some(map.next_value()?),
                        MatchKey::Path => m.path = Some(map.next_value()?),
                        MatchKey::Glob => m.glob = Some(map.next_value()?),
                        MatchKey::Methods => m.methods = map.next_value()?,
                        MatchKey::Host => m.host = map.next_value()?,
                        MatchKey::ApiKey => m.api_key = Some(map.next_value()?),
                        MatchKey::Header(h) => {
                            let value = map.next_value()?;
                            if m.headers.iter().any(|(seen, _)| *seen == h) {
                                return Err(de::Error::custom(format!(
                                    "header {h} is given twice (header names are case-insensitive)"
                                )));
                            }
                            m.headers.push((h, value));
                        }
                    }
                }
                Ok(m)
            }
        }
        d.deserialize_map(Visit)
    }
}

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
    burst: Option<Spanned<NonZeroU64>>,
    cost: Option<Spanned<NonZeroU64>>,
    mode: Option<Spanned<Mode>>,
    enforce_percent: Option<Spanned<u8>>,
    max_delay: Option<Spanned<HumanDuration>>,
    max_waiting: Option<Spanned<NonZeroU32>>,
    max_in_flight: Option<Spanned<NonZeroU64>>,
    lease_ttl: Option<Spanned<HumanDuration>>,
    retry_jitter: Option<HumanDuration>,
    #[serde(default)]
    plans: HashMap<String, Spanned<RawPlanOverride>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlanOverride {
    exempt: Option<Spanned<bool>>,
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

/// The limit a rule's numbers make, before plans: a rate, or a concurrency cap.
enum Limit {
    Rate {
        algorithm: Algorithm,
        rate: Rate,
        burst: Option<NonZeroU64>,
        cost: NonZeroU64,
        max_delay: Option<Duration>,
    },
    Concurrency {
        max: NonZeroU64,
        lease: Duration,
    },
}

impl Limit {
    fn quota(&self) -> Result<Quota, QuotaError> {
        match *self {
            Limit::Concurrency { max, lease } => Ok(Quota::concurrency(max, lease)),
            Limit::Rate {
                algorithm,
                rate,
                burst,
                cost,
                max_delay,
            } => rate_quota(algorithm, rate, burst, cost, max_delay),
        }
    }
}

fn rate_quota(
    algorithm: Algorithm,
    rate: Rate,
    burst: Option<NonZeroU64>,
    cost: NonZeroU64,
    max_delay: Option<Duration>,
) -> Result<Quota, QuotaError> {
    let q = Quota::new(algorithm, rate, burst, cost)?;
    match max_delay {
        Some(d) => q.with_max_delay(d),
        None => Ok(q),
    }
}

impl RawRule {
    /// The plans this rule has a `[rules.plans.<plan>]` table for.
    pub(super) fn plan_names(&self) -> impl Iterator<Item = &str> {
        self.plans.keys().map(String::as_str)
    }

    /// One rule, validated: its limit, its plans (each named by a listed key), its match,
    /// its mode. `index` and `span`: where the file has it.
    pub(super) fn validate(
        &self,
        index: usize,
        span: Range<usize>,
        plan_names: &HashSet<&str>,
        key_header: &HeaderName,
    ) -> Result<Rule, Invalid> {
        let at = At {
            index,
            span,
            rule: self,
        };
        let limit = at.limit()?;
        let quota = limit.quota().map_err(|e| at.blame(e))?;
        let (mode, enforce_percent) = at.mode()?;
        Ok(Rule {
            name: self.name.get_ref().0.clone(),
            matcher: at.matcher(key_header)?,
            key: Key {
                kind: self.key.0.clone(),
                missing: self.missing_key,
            },
            plans: at.plans(&limit, plan_names)?,
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
        })
    }
}

impl At<'_> {
    /// A rule limits a rate or a concurrency, never both; each takes only its own keys.
    fn limit(&self) -> Result<Limit, Invalid> {
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
        let only_rates: [(&str, Option<Range<usize>>); 5] = [
            ("algorithm", r.algorithm.as_ref().map(Spanned::span)),
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
            return Ok(Limit::Concurrency {
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
        Ok(Limit::Rate {
            algorithm: r
                .algorithm
                .as_ref()
                .map_or_else(Algorithm::default, |a| *a.get_ref()),
            rate,
            burst: r.burst.as_ref().map(|b| *b.get_ref()),
            cost: r.cost.as_ref().map_or(NonZeroU64::MIN, |c| *c.get_ref()),
            max_delay: r.max_delay.as_ref().map(|d| d.get_ref().0),
        })
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

    /// A quota error, blamed on the setting it names where the file has it.
    fn blame(&self, e: QuotaError) -> Invalid {
        let r = self.rule;
        let named = match e.field {
            QuotaField::Burst => r.burst.as_ref().map(Spanned::span),
            QuotaField::Cost => r.cost.as_ref().map(Spanned::span),
            QuotaField::MaxDelay => r.max_delay.as_ref().map(Spanned::span),
            QuotaField::Rate => None,
        };
        let fallback = r.rate.as_ref().map_or(self.span.clone(), Spanned::span);
        self.no(named.or(Some(fallback)), e.field.name(), e.message)
    }

    /// Each plan's quota: the rule's, with what the plan changes; or none, if exempt.
    fn plans(
        &self,
        limit: &Limit,
        plan_names: &HashSet<&str>,
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
            if !plan_names.contains(plan.as_str()) {
                return Err(no(
                    "",
                    format!(
                        "plan {plan:?} is not given to any key in [keys.plans] or the keys file"
                    ),
                ));
            }
            let over = o.get_ref();
            if let Some(exempt) = over.exempt.as_ref().filter(|e| *e.get_ref()) {
                let set = [
                    ("rate", over.rate.is_some()),
                    ("burst", over.burst.is_some()),
                    ("algorithm", over.algorithm.is_some()),
                    ("cost", over.cost.is_some()),
                    ("max_in_flight", over.max_in_flight.is_some()),
                ];
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
                Limit::Concurrency { max, lease } => {
                    let extra = [
                        ("rate", over.rate.is_some()),
                        ("burst", over.burst.is_some()),
                        ("algorithm", over.algorithm.is_some()),
                        ("cost", over.cost.is_some()),
                    ];
                    if let Some((k, _)) = extra.iter().find(|(_, set)| *set) {
                        return Err(no(k, format!("{k} does not apply to a max_in_flight rule; a plan may set max_in_flight")));
                    }
                    Quota::concurrency(over.max_in_flight.unwrap_or(max), lease)
                }
                Limit::Rate {
                    algorithm,
                    rate,
                    burst,
                    cost,
                    max_delay,
                } => {
                    if over.max_in_flight.is_some() {
                        return Err(no(
                            "max_in_flight",
                            "max_in_flight applies to concurrency rules only".into(),
                        ));
                    }
                    let alg = over.algorithm.unwrap_or(algorithm);
                    // The rule's burst carries over only to an algorithm that has one.
                    let burst = over.burst.or(burst.filter(|_| alg.has_burst()));
                    let rate = over.rate.unwrap_or(rate);
                    rate_quota(alg, rate, burst, over.cost.unwrap_or(cost), max_delay)
                        .map_err(|e| no(e.field.name(), e.message))?
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

    fn matcher(&self, key_header: &HeaderName) -> Result<Match, Invalid> {
        let Some(m) = &self.rule.matcher else {
            return Ok(Match::default());
        };
        let (span, m) = (m.span(), m.get_ref());
        let path = match (&m.path_prefix, &m.path, &m.glob) {
            (None, None, None) => PathMatch::Any,
            (Some(p), None, None) => PathMatch::Prefix(p.0.clone()),
            (None, Some(p), None) => PathMatch::Exact(p.0.clone()),
            (None, None, Some(g)) => PathMatch::Glob(g.0.clone()),
            _ => {
                return Err(self.no(
                    Some(span),
                    "match",
                    "give one of path_prefix, path and glob",
                ))
            }
        };
        Ok(Match {
            path,
            methods: m.methods.iter().map(|m| m.0.clone()).collect(),
            hosts: m.host.0.clone(),
            carrying: self.carrying(m, key_header)?,
        })
    }

    /// `api_key = …` and `"header:<name>" = …`, refused where they would make a rule that
    /// never counts anyone, or read the API key header as a plain header.
    fn carrying(&self, m: &RawMatch, key_header: &HeaderName) -> Result<Vec<Condition>, Invalid> {
        let written = m.api_key.iter().map(|p| (Carried::ApiKey, p)).chain(
            m.headers
                .iter()
                .map(|(h, p)| (Carried::Header(h.clone()), p)),
        );
        let mut out = Vec::new();
        for (carried, p) in written {
            let present = *p.get_ref() == Presence::Present;
            let key = format!("match.{}", carried.to_string().trim_matches('"'));
            if let Carried::Header(h) = &carried {
                if h == key_header {
                    return Err(self.no(
                        Some(p.span()),
                        &key,
                        format!("{h} is the API key header ([keys] header): write api_key = \"{}\", which reads it as a key", if present { "present" } else { "absent" }),
                    ));
                }
            }
            let counts_by_it = match (&carried, &self.rule.key.0) {
                (Carried::ApiKey, KeyKind::ApiKey) => true,
                (Carried::Header(a), KeyKind::Header(b)) => a == b,
                _ => false,
            };
            if counts_by_it && !present {
                return Err(self.no(
                    Some(p.span()),
                    &key,
                    format!("a rule counting by {} that applies only when it is absent counts nobody by it; count those requests with key = \"client_ip\"", self.rule.key.0),
                ));
            }
            out.push(Condition { carried, present });
        }
        Ok(out)
    }
}
