//! `[[descriptors]]` and `[decide] envoy_config`: what Envoy's rate limit service asks
//! for (a domain and descriptors, each a list of key/value entries), mapped to rules.
//!
//! Both compile into one [`Descriptors`] tree per domain, walked as envoyproxy/ratelimit
//! walks its config (`src/config/config_impl.go`, `GetLimit`): at each level an entry
//! matches its key and value exactly, else a wildcard value (`foo*`) in the file's
//! order, else its key alone (an entry without `value`, which takes any value); a limit
//! applies only where the descriptor's last entry lands. The walk is
//! `service::rls::matching`'s; this module builds the tree and checks it.
//!
//! A `[[descriptors]]` table names one of the file's `[[rules]]`, which the proxy applies
//! too: the two share the rule's counters. envoyproxy/ratelimit's YAML
//! (`envoy_yaml.rs`) makes a rule of each limit it sets, appended to the config's rules
//! and never applied to proxied requests.

use std::collections::HashMap;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::Invalid;
use crate::identity::KeyKind;
use crate::limiter::{Algorithm, Rate};
use crate::rules::Rule;

/// The entry key whose value Envoy fills with the client's address (its
/// `remote_address` action): counted by the address where the rule counts by
/// `client_ip`, so the proxy and the rate limit service share one bucket per client.
pub const REMOTE_ADDRESS: &str = "remote_address";

/// One `[[descriptors]]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDescriptors {
    domain: Spanned<String>,
    entries: Spanned<Vec<RawEntry>>,
    rule: Spanned<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    key: String,
    value: Option<String>,
}

/// The descriptors the rate limit service knows, per domain.
#[derive(Debug, Default)]
pub struct Descriptors {
    pub domains: HashMap<String, Level>,
}

/// One level of a domain's tree: the entries a descriptor's next entry may match.
#[derive(Debug, Default)]
pub struct Level {
    /// By key, then value: entries with a value, matched exactly.
    pub exact: HashMap<String, HashMap<String, Node>>,
    /// Entries whose value has a `*`, in the file's order: the first that matches wins.
    pub wildcards: Vec<Wildcard>,
    /// Entries without a value, by key: any value.
    pub any: HashMap<String, Node>,
}

#[derive(Debug)]
pub struct Wildcard {
    pub key: String,
    pub pattern: Pattern,
    pub node: Node,
}

/// An entry of the tree: the limit that applies where a descriptor ends on it, and the
/// level below it.
#[derive(Debug, Default)]
pub struct Node {
    pub limit: Option<Limit>,
    pub next: Level,
}

/// What a descriptor that ends on a node is limited by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    pub what: Leaf,
    /// The period the answer's `current_limit` names, where the rule's is one of Envoy's
    /// units (a `"5/10s"` rule's is none).
    pub unit: Option<Unit>,
    /// `rate_limit.name`: what another limit's `replaces` names.
    pub name: Option<String>,
    /// `rate_limit.replaces`: the limits this one sets aside where both match one call.
    pub replaces: Vec<String>,
}

/// The limit itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leaf {
    /// The rule at this index of the config's rules.
    Rule(usize),
    /// `rate_limit: { unlimited: true }`: OK, never counted.
    Unlimited,
    /// `requests_per_unit: 0`: OVER_LIMIT, never counted (no rule can hold a limit of 0).
    Blocked,
}

/// Envoy's `RateLimitResponse.RateLimit.Unit`s a limit can be written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
}

impl Unit {
    /// As envoyproxy/ratelimit's YAML writes it (any case): `second` ... `month`.
    pub fn parse(s: &str) -> Option<Unit> {
        Some(match s.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            _ => return None,
        })
    }

    /// `count` per unit, as a rule's rate: a month is the calendar's (`"N/month"`, fixed
    /// windows only), the others fixed lengths.
    pub fn rate(self, count: u64) -> Result<Rate, String> {
        let secs = match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 604_800,
            Unit::Month => return Rate::parse(&format!("{count}/month")),
        };
        Ok(Rate::every(count, Duration::from_secs(secs)))
    }

    /// The unit a rule's rate is written in, if it is one.
    pub fn of(rate: &Rate) -> Option<Unit> {
        if let Some(p) = rate.calendar {
            return (p == crate::limiter::calendar::Period::Month).then_some(Unit::Month);
        }
        Some(match rate.period.as_secs() {
            1 => Unit::Second,
            60 => Unit::Minute,
            3_600 => Unit::Hour,
            86_400 => Unit::Day,
            604_800 => Unit::Week,
            _ => return None,
        })
    }
}

/// A value with `*`s, each standing for zero or more characters (envoyproxy/ratelimit's
/// `wildcardMatch`): `foo*`, `/api/*/action`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    /// The value split at its `*`s: at least two parts.
    parts: Vec<String>,
}

impl Pattern {
    /// `value` as a pattern, where it has a `*`.
    pub fn of(value: &str) -> Option<Pattern> {
        value.contains('*').then(|| Pattern {
            parts: value.split('*').map(str::to_owned).collect(),
        })
    }

    /// Whether `value` starts with the first part, ends with the last, and holds the
    /// others in order between them, none overlapping.
    pub fn matches(&self, value: &str) -> bool {
        let (Some(first), Some(last)) = (self.parts.first(), self.parts.last()) else {
            return false;
        };
        let fixed: usize = self.parts.iter().map(String::len).sum();
        if value.len() < fixed
            || !value.starts_with(first.as_str())
            || !value.ends_with(last.as_str())
        {
            return false;
        }
        let mut rest = &value[first.len()..value.len() - last.len()];
        for part in &self.parts[1..self.parts.len() - 1] {
            match rest.find(part.as_str()) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

/// One entry as the tree is built: its key and, where it has one, its value.
pub(super) struct Entry<'a> {
    pub key: &'a str,
    pub value: Option<&'a str>,
}

impl Descriptors {
    /// Put `limit` where `entries` (of `domain`) end, making the levels on the way.
    /// Errors where a limit is there already.
    pub(super) fn insert(
        &mut self,
        domain: &str,
        entries: &[Entry<'_>],
        limit: Limit,
    ) -> Result<(), String> {
        let Some((last, before)) = entries.split_last() else {
            return Err("a descriptor has at least one entry".into());
        };
        let mut level = self.domains.entry(domain.to_owned()).or_default();
        for e in before {
            level = &mut level.node(e.key, e.value).next;
        }
        let node = level.node(last.key, last.value);
        if node.limit.is_some() {
            return Err(format!(
                "domain {domain:?}: the descriptor {} has a limit already",
                describe(entries)
            ));
        }
        node.limit = Some(limit);
        Ok(())
    }

    /// How many limits there are, over every domain.
    pub fn len(&self) -> usize {
        fn count(l: &Level) -> usize {
            let nodes = l
                .exact
                .values()
                .flat_map(HashMap::values)
                .chain(l.wildcards.iter().map(|w| &w.node))
                .chain(l.any.values());
            nodes
                .map(|n| usize::from(n.limit.is_some()) + count(&n.next))
                .sum()
        }
        self.domains.values().map(count).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Level {
    /// Whether no entry is below: where a descriptor's walk stops.
    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.wildcards.is_empty() && self.any.is_empty()
    }

    /// The node of `key` (and `value`) at this level, made where there is none.
    fn node(&mut self, key: &str, value: Option<&str>) -> &mut Node {
        match value {
            None => self.any.entry(key.to_owned()).or_default(),
            Some(v) => match Pattern::of(v) {
                Some(pattern) => {
                    let at = self
                        .wildcards
                        .iter()
                        .position(|w| w.key == key && w.pattern == pattern);
                    let at = at.unwrap_or_else(|| {
                        self.wildcards.push(Wildcard {
                            key: key.to_owned(),
                            pattern,
                            node: Node::default(),
                        });
                        self.wildcards.len() - 1
                    });
                    &mut self.wildcards[at].node
                }
                None => self
                    .exact
                    .entry(key.to_owned())
                    .or_default()
                    .entry(v.to_owned())
                    .or_default(),
            },
        }
    }
}

/// Whether a descriptor of `entries` says who it is under a rule that counts by `kind`,
/// as a request would (`service::rls` builds that request): the address of its
/// `remote_address` entry (`client_ip`: the proxy's bucket for that client), the value
/// of its entry named as the header (`header:<name>`, or `[keys] header` for `api_key`),
/// or no one (`global`). A rule counting by a header that no entry names counts by the
/// descriptor's entries instead.
fn keyed(
    kind: &KeyKind,
    entries: &[Entry<'_>],
    keys_header: &http::HeaderName,
) -> Result<(), String> {
    let open = |key: &str| {
        entries
            .iter()
            .any(|e| e.key.eq_ignore_ascii_case(key) && e.value.is_none())
    };
    match kind {
        KeyKind::Global | KeyKind::Header(_) => Ok(()),
        KeyKind::ClientIp if open(REMOTE_ADDRESS) => Ok(()),
        KeyKind::ClientIp => Err(format!(
            "the entries need {{ key = \"{REMOTE_ADDRESS}\" }} (without value: the client's address Envoy sends)"
        )),
        KeyKind::ApiKey if open(keys_header.as_str()) => Ok(()),
        KeyKind::ApiKey => Err(format!(
            "the entries need {{ key = \"{keys_header}\" }} (without value: the key, as Envoy's request_headers action sends it)"
        )),
        _ => Err("a descriptor can say who it is for a rule that counts by client_ip, api_key, header:<name> or global only".into()),
    }
}

/// `("key", "value"), ("key")`, as errors name a descriptor.
pub(super) fn describe(entries: &[Entry<'_>]) -> String {
    let each: Vec<String> = entries
        .iter()
        .map(|e| match e.value {
            Some(v) => format!("({:?}, {v:?})", e.key),
            None => format!("({:?})", e.key),
        })
        .collect();
    each.join(", ")
}

/// `[[descriptors]]` and the YAML's limits into `rules` (the YAML's rules appended) and
/// one tree. `rules` holds the file's rules; `yaml`, the envoyproxy/ratelimit YAML
/// already read ([`super::envoy_yaml`]), where `[decide] envoy_config` names one.
pub(super) fn validate(
    raw: &[Spanned<RawDescriptors>],
    yaml: Option<super::envoy_yaml::Domains>,
    rules: &mut Vec<Rule>,
    keys_header: &http::HeaderName,
) -> Result<Descriptors, Invalid> {
    let mut tree = Descriptors::default();
    for (i, spanned) in raw.iter().enumerate() {
        let d = spanned.get_ref();
        let at = |field: &str| format!("descriptors[{i}].{field}");
        if d.domain.get_ref().is_empty() {
            return Err(Invalid::new(
                Some(d.domain.span()),
                at("domain"),
                "a domain is not empty (Envoy's rate limit filter sends one with every call)",
            ));
        }
        let written = d.entries.get_ref();
        if written.is_empty() || written.iter().any(|e| e.key.is_empty()) {
            return Err(Invalid::new(
                Some(d.entries.span()),
                at("entries"),
                "entries = [{ key = \"...\", value = \"...\" }, ...]: at least one entry, each with a key (value optional: without it, any value)",
            ));
        }
        let name = d.rule.get_ref();
        let Some(index) = rules
            .iter()
            .position(|r| &r.name == name && r.ceiling_of.is_none())
        else {
            let defined: Vec<&str> = rules
                .iter()
                .filter(|r| r.ceiling_of.is_none())
                .map(|r| r.name.as_str())
                .collect();
            return Err(Invalid::new(
                Some(d.rule.span()),
                at("rule"),
                format!("no [[rules]] is named {name:?} (defined: {defined:?})"),
            ));
        };
        let rule = &rules[index];
        if rule.quota.algorithm == Algorithm::Concurrency {
            return Err(Invalid::new(
                Some(d.rule.span()),
                at("rule"),
                format!("rule {name:?} limits requests in flight (max_in_flight), which a rate limit service call cannot hold; name a rule with a rate"),
            ));
        }
        let entries: Vec<Entry<'_>> = written
            .iter()
            .map(|e| Entry {
                key: &e.key,
                value: e.value.as_deref(),
            })
            .collect();
        keyed(&rule.key.kind, &entries, keys_header).map_err(|m| {
            Invalid::new(
                Some(d.rule.span()),
                at("rule"),
                format!("rule {name:?} counts by {}: {m}", rule.key.kind),
            )
        })?;
        let limit = Limit {
            what: Leaf::Rule(index),
            unit: Unit::of(&rule.quota.rate),
            name: None,
            replaces: Vec::new(),
        };
        tree.insert(d.domain.get_ref(), &entries, limit)
            .map_err(|m| Invalid::new(Some(spanned.span()), format!("descriptors[{i}]"), m))?;
    }
    if let Some(domains) = yaml {
        domains.compile(&mut tree, rules)?;
    }
    Ok(tree)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_matches_as_envoyproxy_ratelimit_does() {
        let p = |s: &str| Pattern::of(s).unwrap();
        assert!(p("value*").matches("value"));
        assert!(p("value*").matches("valueXYZ"));
        assert!(!p("value*").matches("valu"));
        assert!(p("/api/*/action").matches("/api/123/action"));
        assert!(!p("/api/*/action").matches("/api/123/other"));
        assert!(p("/api/*/resource/*/action").matches("/api/v1/resource/123/action"));
        assert!(!p("/api/*/resource/*/action").matches("/api/v1/action"));
        // The parts never overlap: "ab*ba" needs four characters at least.
        assert!(!p("ab*ba").matches("aba"));
        assert!(p("ab*ba").matches("abba"));
        assert!(Pattern::of("plain").is_none());
    }

    #[test]
    fn units_are_envoys_and_rates_name_them_back() {
        for (s, secs) in [
            ("second", 1),
            ("MINUTE", 60),
            ("hour", 3600),
            ("day", 86_400),
        ] {
            let u = Unit::parse(s).unwrap();
            let r = u.rate(5).unwrap();
            assert_eq!(r.period, Duration::from_secs(secs));
            assert_eq!(Unit::of(&r), Some(u));
        }
        assert_eq!(Unit::of(&Unit::Month.rate(3).unwrap()), Some(Unit::Month));
        assert_eq!(Unit::of(&Rate::every(5, Duration::from_secs(10))), None);
        assert_eq!(Unit::parse("year"), None);
    }

    /// `[[descriptors]]` tables under two rules, or the error of the first bad one.
    fn load(descriptors: &str) -> Result<super::super::Config, String> {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n\
             [[rules]]\nname = \"per_ip\"\nkey = \"client_ip\"\nrate = \"10/s\"\n\
             [[rules]]\nname = \"slots\"\nkey = \"global\"\nmax_in_flight = 4\n{descriptors}"
        );
        super::super::Config::parse(&text, std::path::Path::new("limits.toml"))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_descriptors_table_names_a_rule_it_can_say_who_for() {
        let c = load("[[descriptors]]\ndomain = \"edge\"\nentries = [{ key = \"remote_address\" }, { key = \"path\", value = \"/api/*\" }]\nrule = \"per_ip\"\n").unwrap();
        let level = &c.descriptors.domains["edge"];
        let leaf = level.any["remote_address"].next.wildcards[0]
            .node
            .limit
            .as_ref()
            .unwrap();
        assert_eq!((leaf.what, leaf.unit), (Leaf::Rule(0), Some(Unit::Second)));
        let e = load(
            "[[descriptors]]\ndomain = \"edge\"\nentries = [{ key = \"user\" }]\nrule = \"nope\"\n",
        )
        .unwrap_err();
        assert!(e.ends_with("descriptors[0].rule: no [[rules]] is named \"nope\" (defined: [\"per_ip\", \"slots\"])"), "{e}");
        let e = load("[[descriptors]]\ndomain = \"edge\"\nentries = [{ key = \"user\" }]\nrule = \"per_ip\"\n").unwrap_err();
        assert!(e.contains("rule \"per_ip\" counts by client_ip: the entries need { key = \"remote_address\" }"), "{e}");
        let e = load("[[descriptors]]\ndomain = \"edge\"\nentries = [{ key = \"user\" }]\nrule = \"slots\"\n").unwrap_err();
        assert!(e.contains("limits requests in flight"), "{e}");
        let e = load(
            "[[descriptors]]\ndomain = \"\"\nentries = [{ key = \"user\" }]\nrule = \"per_ip\"\n",
        )
        .unwrap_err();
        assert!(
            e.contains("descriptors[0].domain: a domain is not empty"),
            "{e}"
        );
        let e =
            load("[[descriptors]]\ndomain = \"d\"\nentries = []\nrule = \"per_ip\"\n").unwrap_err();
        assert!(e.contains("descriptors[0].entries: entries = "), "{e}");
        let twice = "[[descriptors]]\ndomain = \"d\"\nentries = [{ key = \"remote_address\" }]\nrule = \"per_ip\"\n";
        let e = load(&format!("{twice}{twice}")).unwrap_err();
        assert!(e.contains("descriptors[1]: domain \"d\": the descriptor (\"remote_address\") has a limit already"), "{e}");
        let e = load("[decide]\nenvoy_config = \"missing.yaml\"\n").unwrap_err();
        assert!(
            e.contains("decide.envoy_config: cannot read \"missing.yaml\""),
            "{e}"
        );
    }

    #[test]
    fn a_second_limit_on_one_descriptor_is_refused() {
        let mut t = Descriptors::default();
        let e = [Entry {
            key: "k",
            value: Some("v"),
        }];
        let l = Limit {
            what: Leaf::Unlimited,
            unit: None,
            name: None,
            replaces: vec![],
        };
        t.insert("d", &e, l.clone()).unwrap();
        let err = t.insert("d", &e, l).unwrap_err();
        assert!(err.contains("(\"k\", \"v\") has a limit already"), "{err}");
        assert_eq!(t.len(), 1);
    }
}
