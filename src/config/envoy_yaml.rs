//! `[decide] envoy_config = "ratelimit.yaml"`: envoyproxy/ratelimit's own config format
//! (its README, "The configuration format"), read as a subset so that a deployment moves
//! over without rewriting it. docs/rls.md lists what is read and what is refused.
//!
//! Each limit the file sets becomes a rule of its own, appended to the config's rules,
//! so the store, the counters, the status page and the metrics know it as any other:
//! named `<domain>.<key>_<value>.<key>...` after the entries that lead to it (or
//! `<domain>.<name>` where `rate_limit.name` gives one), counting by the descriptor it is
//! asked for (every entry's value is part of the identity, as envoyproxy/ratelimit's
//! cache key), never applied to proxied requests. Its algorithm is a fixed window, as
//! envoyproxy/ratelimit's, unless the extension key `algorithm` says otherwise.
//!
//! The file may hold several YAML documents (`---`), one domain each.

use std::collections::HashSet;
use std::num::NonZeroU64;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::descriptors::{Descriptors, Entry, Leaf, Limit, Unit};
use super::Invalid;
use crate::identity::{Key, KeyKind, MissingKey};
use crate::limiter::{Algorithm, Quota};
use crate::rules::{Match, Mode, Rule};

/// The header a YAML rule counts by, `ratewall-rls.<rule>`: the rate limit service
/// writes the digest of the descriptor's domain and entries into it (`service::rls`), so
/// every entry's value is part of the identity, as in envoyproxy/ratelimit's cache keys.
/// One per rule, so that one call's descriptors, each under its own rule, never share
/// it. The decision API may name such a rule with that digest as its key.
pub fn descriptor_header(rule: &str) -> Result<http::HeaderName, String> {
    http::HeaderName::try_from(format!("{DESCRIPTOR_HEADER}.{rule}"))
        .map_err(|_| format!("the rule name {rule:?} makes no header name"))
}

/// [`descriptor_header`]'s prefix.
pub const DESCRIPTOR_HEADER: &str = "ratewall-rls";

/// One domain's file (or document).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlDomain {
    domain: String,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlDescriptor {
    key: String,
    value: Option<String>,
    rate_limit: Option<YamlRateLimit>,
    #[serde(default)]
    shadow_mode: bool,
    /// envoyproxy/ratelimit's per-value statistics: accepted, and without effect here
    /// (ratewall's metrics are per rule, never per descriptor value).
    #[serde(default)]
    #[allow(dead_code)]
    detailed_metric: bool,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRateLimit {
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<YamlReplaces>,
    unit: Option<String>,
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unlimited: bool,
    /// Extension: one of ratewall's four algorithms (default `fixed_window`).
    algorithm: Option<Algorithm>,
    /// Extension: a token bucket's or GCRA's burst (default `requests_per_unit`).
    burst: Option<NonZeroU64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlReplaces {
    name: String,
}

/// The file, read: its domains, and where the config names it (for errors).
pub(super) struct Domains {
    domains: Vec<YamlDomain>,
    /// The file as `envoy_config` names it.
    file: String,
    /// `envoy_config`'s value in limits.toml, where its errors point.
    span: Option<Range<usize>>,
}

/// The key every error of the YAML is reported under.
const KEY: &str = "decide.envoy_config";

/// `text`, the file `file` (as `envoy_config` names it, at `span` of limits.toml), as
/// domains; an error names the file's line and column.
pub(super) fn parse(
    text: &str,
    file: &str,
    span: Option<Range<usize>>,
) -> Result<Domains, Invalid> {
    let mut domains = Vec::new();
    for document in yaml_serde::Deserializer::from_str(text) {
        // yaml_serde's message names the path and ends with where: put where first.
        let d = YamlDomain::deserialize(document).map_err(|e| {
            let said = e.to_string();
            let message = match e.location() {
                Some(l) => {
                    let tail = format!(" at line {} column {}", l.line(), l.column());
                    let said = said.strip_suffix(tail.as_str()).unwrap_or(&said);
                    format!("{file}:{}:{}: {said}", l.line(), l.column())
                }
                None => format!("{file}: {said}"),
            };
            Invalid::new(span.clone(), KEY, message)
        })?;
        domains.push(d);
    }
    Ok(Domains {
        domains,
        file: file.to_owned(),
        span,
    })
}

/// The file `[decide] envoy_config` names in `raw`, relative to `dir` (the folder of
/// limits.toml): what [`super::Inputs`] reads for [`read`].
pub(super) fn file(raw: &super::RawConfig, dir: &Path) -> Option<PathBuf> {
    let d = raw.decide.as_ref()?.get_ref();
    d.envoy_config.as_ref().map(|f| dir.join(f.trim()))
}

/// The file `[decide] envoy_config` names, from `inputs`, parsed; none where the table
/// names none. Errors point at the `[decide]` table.
pub(super) fn read(
    decide: Option<&toml::Spanned<super::decide::RawDecide>>,
    dir: &Path,
    inputs: &super::Inputs,
) -> Result<Option<Domains>, Invalid> {
    let Some(d) = decide else { return Ok(None) };
    let Some(name) = &d.get_ref().envoy_config else {
        return Ok(None);
    };
    let span = Some(d.span());
    let text = inputs.text(&dir.join(name.trim())).map_err(|e| {
        Invalid::new(
            span.clone(),
            KEY,
            format!("cannot read {name:?} (relative to this file's folder): {e}"),
        )
    })?;
    parse(&text, name, span).map(Some)
}

impl Domains {
    /// Every limit into `tree`, each rule-made limit's rule appended to `rules`.
    pub(super) fn compile(
        self,
        tree: &mut Descriptors,
        rules: &mut Vec<Rule>,
    ) -> Result<(), Invalid> {
        let mut names: HashSet<String> = rules.iter().map(|r| r.name.clone()).collect();
        let mut seen = HashSet::new();
        for d in &self.domains {
            if d.domain.is_empty() {
                return Err(self.error("domain: a domain is not empty"));
            }
            if !seen.insert(d.domain.as_str()) {
                return Err(self.error(&format!("domain {:?} is written twice", d.domain)));
            }
            let mut walk = Walk {
                domains: &self,
                domain: &d.domain,
                tree,
                rules,
                names: &mut names,
                path: Vec::new(),
            };
            walk.level(&d.descriptors)?;
        }
        Ok(())
    }

    fn error(&self, message: &str) -> Invalid {
        Invalid::new(self.span.clone(), KEY, format!("{}: {message}", self.file))
    }
}

/// One domain's descriptors, walked depth first.
struct Walk<'a> {
    domains: &'a Domains,
    domain: &'a str,
    tree: &'a mut Descriptors,
    rules: &'a mut Vec<Rule>,
    names: &'a mut HashSet<String>,
    /// The entries that lead to the current level.
    path: Vec<(&'a str, Option<&'a str>)>,
}

impl<'a> Walk<'a> {
    fn level(&mut self, list: &'a [YamlDescriptor]) -> Result<(), Invalid> {
        let mut here = HashSet::new();
        for d in list {
            if d.key.is_empty() {
                return Err(self.fail("a descriptor has an empty key"));
            }
            if !here.insert((d.key.as_str(), d.value.as_deref())) {
                return Err(self.fail(&format!(
                    "duplicate descriptor {}",
                    self.describe_with(&d.key, d.value.as_deref())
                )));
            }
            self.path.push((&d.key, d.value.as_deref()));
            if let Some(rl) = &d.rate_limit {
                self.limit(d, rl)?;
            }
            self.level(&d.descriptors)?;
            self.path.pop();
        }
        Ok(())
    }

    /// The limit `rl` of the descriptor `d` (the last of `path`).
    fn limit(&mut self, d: &YamlDescriptor, rl: &YamlRateLimit) -> Result<(), Invalid> {
        let at = self.describe();
        for r in &rl.replaces {
            if r.name.is_empty() {
                return Err(self.fail(&format!("{at}: replaces has an empty name")));
            }
            if rl.name.as_deref() == Some(r.name.as_str()) {
                return Err(self.fail(&format!("{at}: replaces its own name {:?}", r.name)));
            }
        }
        let unit = match rl.unit.as_deref() {
            Some(u) => Some(Unit::parse(u).ok_or_else(|| {
                self.fail(&format!(
                    "{at}: unit {u:?} is not one of second, minute, hour, day, week, month"
                ))
            })?),
            None => None,
        };
        let what = match (rl.unlimited, unit, rl.requests_per_unit) {
            (true, None, None) if rl.algorithm.is_none() && rl.burst.is_none() => Leaf::Unlimited,
            (true, ..) => {
                return Err(self.fail(&format!(
                "{at}: an unlimited rate_limit has no unit, requests_per_unit, algorithm or burst"
            )))
            }
            (false, Some(_), Some(0)) => Leaf::Blocked,
            (false, Some(unit), Some(n)) => Leaf::Rule(self.rule(d, rl, unit, n)?),
            (false, None, _) => {
                return Err(self.fail(&format!(
                    "{at}: rate_limit needs a unit (or unlimited: true)"
                )))
            }
            (false, Some(_), None) => {
                return Err(self.fail(&format!("{at}: rate_limit needs requests_per_unit")))
            }
        };
        let entries: Vec<Entry<'_>> = self
            .path
            .iter()
            .map(|&(key, value)| Entry { key, value })
            .collect();
        let limit = Limit {
            what,
            unit,
            name: rl.name.clone(),
            replaces: rl.replaces.iter().map(|r| r.name.clone()).collect(),
        };
        self.tree
            .insert(self.domain, &entries, limit)
            .map_err(|m| self.fail(&m))
    }

    /// The rule of a limit of `n` per `unit`: appended to the rules, its index returned.
    fn rule(
        &mut self,
        d: &YamlDescriptor,
        rl: &YamlRateLimit,
        unit: Unit,
        n: u64,
    ) -> Result<usize, Invalid> {
        let at = self.describe();
        let rate = unit.rate(n).map_err(|m| self.fail(&format!("{at}: {m}")))?;
        let algorithm = rl.algorithm.unwrap_or(Algorithm::FixedWindow);
        let one = NonZeroU64::MIN;
        let quota = Quota::new(algorithm, rate, rl.burst, one)
            .map_err(|e| self.fail(&format!("{at}: {}", e.message)))?;
        let name = self.name(rl.name.as_deref());
        self.names.insert(name.clone());
        let header = descriptor_header(&name).map_err(|m| self.fail(&m))?;
        self.rules.push(Rule {
            name,
            // Asked for by name alone: the index leaves it out of the proxy's rules.
            matcher: Match {
                proxied: false,
                ..Match::default()
            },
            // Counted by the descriptor: `service::rls` writes its digest into this header.
            key: Key {
                kind: KeyKind::Header(header),
                missing: MissingKey::Reject,
            },
            quota,
            plans: Default::default(),
            priorities: Default::default(),
            mode: if d.shadow_mode {
                Mode::Shadow
            } else {
                Mode::Enforce
            },
            enforce_percent: 100,
            max_waiting: super::DEFAULT_MAX_WAITING,
            retry_jitter_us: 0,
            messages: None,
            bytes: None,
            settle: None,
            ceiling_of: None,
            settle_within: crate::rules::SETTLE_WITHIN,
        });
        Ok(self.rules.len() - 1)
    }

    /// The rule's name: `<domain>.<name>`, or `<domain>.<key>_<value>.<key>...`; made of
    /// the rule names' alphabet (others written `-`), and where that is longer than a
    /// name may be or taken, cut and told apart by a hash of what it stands for.
    fn name(&self, given: Option<&str>) -> String {
        let mut full = self.domain.to_owned();
        match given {
            Some(n) => {
                full.push('.');
                full.push_str(n);
            }
            None => {
                for (key, value) in &self.path {
                    full.push('.');
                    full.push_str(key);
                    if let Some(v) = value {
                        full.push('_');
                        full.push_str(v);
                    }
                }
            }
        }
        let safe: String = full
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "_-.".contains(c) {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        if safe.len() <= crate::upstream::MAX_NAME && !self.names.contains(&safe) {
            return safe;
        }
        let hash = super::sha256_hex(full.as_bytes());
        let keep = crate::upstream::MAX_NAME - 9;
        format!("{}.{}", &safe[..safe.len().min(keep)], &hash[..8])
    }

    fn describe(&self) -> String {
        let entries: Vec<Entry<'_>> = self
            .path
            .iter()
            .map(|&(key, value)| Entry { key, value })
            .collect();
        format!(
            "{:?} {}",
            self.domain,
            super::descriptors::describe(&entries)
        )
    }

    fn describe_with(&self, key: &str, value: Option<&str>) -> String {
        let mut entries: Vec<Entry<'_>> = self
            .path
            .iter()
            .map(|&(key, value)| Entry { key, value })
            .collect();
        entries.push(Entry { key, value });
        format!(
            "{:?} {}",
            self.domain,
            super::descriptors::describe(&entries)
        )
    }

    fn fail(&self, message: &str) -> Invalid {
        self.domains.error(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(yaml: &str) -> Result<(Descriptors, Vec<Rule>), String> {
        let mut tree = Descriptors::default();
        let mut rules = Vec::new();
        parse(yaml, "ratelimit.yaml", None)
            .and_then(|d| d.compile(&mut tree, &mut rules))
            .map_err(|e| e.message)?;
        Ok((tree, rules))
    }

    #[test]
    fn each_limit_is_a_rule_named_by_its_path() {
        let (tree, rules) = compile(
            "domain: messaging\ndescriptors:\n  - key: message_type\n    value: marketing\n    descriptors:\n      - key: to_number\n        rate_limit:\n          unit: day\n          requests_per_unit: 5\n  - key: to_number\n    rate_limit:\n      unit: day\n      requests_per_unit: 100\n",
        )
        .unwrap();
        let names: Vec<&str> = rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "messaging.message_type_marketing.to_number",
                "messaging.to_number"
            ]
        );
        assert_eq!(rules[0].quota.algorithm, Algorithm::FixedWindow);
        assert_eq!(rules[0].quota.rate.count, 5);
        assert_eq!(rules[1].quota.rate.period.as_secs(), 86_400);
        assert_eq!(tree.len(), 2);
    }

    #[test]
    fn extension_keys_shadow_unlimited_and_zero() {
        let (tree, rules) = compile(
            "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: true\n    rate_limit: { unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 20, name: fast }\n  - key: b\n    rate_limit: { unlimited: true }\n  - key: c\n    value: '/files/*'\n    rate_limit: { unit: minute, requests_per_unit: 0 }\n",
        )
        .unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].name, "d.fast");
        assert_eq!(rules[0].mode, Mode::Shadow);
        assert_eq!(rules[0].quota.algorithm, Algorithm::TokenBucket);
        assert_eq!(rules[0].quota.burst, 20);
        let level = &tree.domains["d"];
        assert_eq!(level.any["b"].limit.as_ref().unwrap().what, Leaf::Unlimited);
        assert_eq!(
            level.wildcards[0].node.limit.as_ref().unwrap().what,
            Leaf::Blocked
        );
    }

    #[test]
    fn names_outside_the_alphabet_or_too_long_are_made_safe() {
        let long = "x".repeat(80);
        let yaml = format!(
            "domain: d\ndescriptors:\n  - key: path\n    value: /api/v1\n    rate_limit: {{ unit: second, requests_per_unit: 1 }}\n  - key: k\n    value: {long}\n    rate_limit: {{ unit: second, requests_per_unit: 1 }}\n"
        );
        let (_, rules) = compile(&yaml).unwrap();
        assert_eq!(rules[0].name, "d.path_-api-v1");
        assert_eq!(rules[1].name.len(), 64);
        assert!(rules[1].name.starts_with("d.k_xxx"), "{}", rules[1].name);
    }

    #[test]
    fn what_is_not_read_is_refused_with_where() {
        let bad = |yaml: &str| compile(yaml).err().unwrap();
        let e = bad("domain: d\ndescriptors:\n  - key: a\n    share_threshold: true\n");
        assert!(
            e.starts_with("ratelimit.yaml:4:5: descriptors[0]: unknown field `share_threshold`"),
            "{e}"
        );
        let e = bad("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n");
        assert!(e.contains("unit \"fortnight\" is not one of"), "{e}");
        let e = bad("domain: d\ndescriptors:\n  - key: a\n  - key: a\n");
        assert!(e.contains("duplicate descriptor \"d\" (\"a\")"), "{e}");
        let e = bad("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unlimited: true, unit: second }\n");
        assert!(e.contains("an unlimited rate_limit has no unit"), "{e}");
        let e = bad("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 5, burst: 9 }\n");
        assert!(
            e.contains("burst = 9 does not apply to fixed_window"),
            "{e}"
        );
        let e = bad("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { name: x, replaces: [{ name: x }], unit: second, requests_per_unit: 5 }\n");
        assert!(e.contains("replaces its own name"), "{e}");
    }

    #[test]
    fn several_documents_are_several_domains() {
        let (tree, rules) = compile(
            "domain: a\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, requests_per_unit: 1 }\n---\ndomain: b\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, requests_per_unit: 2 }\n",
        )
        .unwrap();
        assert_eq!(tree.domains.len(), 2);
        assert_eq!(rules[1].name, "b.k");
    }
}
