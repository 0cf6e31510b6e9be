//! A call's descriptors -> the limits that apply to them, and who each is under its rule.
//! Pure: no store, no socket.
//!
//! [`find`] walks a domain's tree as envoyproxy/ratelimit's `GetLimit` does; [`settle`]
//! then applies `unlimited` and `replaces` over the whole call as its
//! `constructLimitsToCheck` does; [`rounds`] groups the rule-made limits into decisions
//! of the core, each rule at most once per decision.

use ring::digest::{Context, SHA256};

use crate::config::{Descriptors, Leaf, Level, Limit, Node};

/// One descriptor entry, as the call gives it.
pub type Entry<'a> = (&'a str, &'a str);

/// The limit where `entries` of `domain` end, if any: at each level the entry's key and
/// value exactly, else the first wildcard value that matches, else the key alone; a
/// limit counts only where the last entry lands; the walk stops where the tree does.
pub fn find<'d>(tree: &'d Descriptors, domain: &str, entries: &[Entry<'_>]) -> Option<&'d Limit> {
    let mut level = tree.domains.get(domain)?;
    let mut found = None;
    for (i, &(key, value)) in entries.iter().enumerate() {
        let node = step(level, key, value)?;
        if i + 1 == entries.len() {
            found = node.limit.as_ref();
        }
        if node.next.is_empty() {
            break;
        }
        level = &node.next;
    }
    found
}

fn step<'d>(level: &'d Level, key: &str, value: &str) -> Option<&'d Node> {
    level
        .exact
        .get(key)
        .and_then(|values| values.get(value))
        .or_else(|| {
            level
                .wildcards
                .iter()
                .find(|w| w.key == key && w.pattern.matches(value))
                .map(|w| &w.node)
        })
        .or_else(|| level.any.get(key))
}

/// What a call's descriptor is limited by, once the call's limits are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applies {
    /// No limit: an unknown domain, no match, or a limit replaced by another's.
    Nothing,
    Unlimited,
    Blocked,
    /// The rule at this index of the config's rules.
    Rule(usize),
}

/// Each descriptor's limit, `found` by [`find`], with envoyproxy/ratelimit's
/// `unlimited` (never counted) and `replaces` (a limit whose name another matched limit
/// replaces is not applied) over the whole call.
pub fn settle(found: &[Option<&Limit>]) -> Vec<Applies> {
    let replaced: Vec<&str> = found
        .iter()
        .flatten()
        .flat_map(|l| l.replaces.iter().map(String::as_str))
        .collect();
    found
        .iter()
        .map(|l| match l {
            None => Applies::Nothing,
            Some(l) if l.what == Leaf::Unlimited => Applies::Unlimited,
            Some(l) if l.name.as_deref().is_some_and(|n| replaced.contains(&n)) => Applies::Nothing,
            Some(l) => match l.what {
                Leaf::Rule(i) => Applies::Rule(i),
                Leaf::Blocked => Applies::Blocked,
                Leaf::Unlimited => Applies::Unlimited,
            },
        })
        .collect()
}

/// What a descriptor's rule reads of the request a round is made into: a header, or the
/// client's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slot {
    Header(http::HeaderName),
    Peer,
}

/// One descriptor the core decides: its rule, its cost, and what its identity writes
/// into the round's request (none for a rule that counts everyone as one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub rule: usize,
    pub cost: u64,
    pub writes: Option<(Slot, String)>,
}

/// The asks (by position) that go to the core together: in each round every rule at
/// most once (the core counts each rule once per decision, for one identity), one cost,
/// and no two asks writing one slot differently. Most calls are one round; a call that
/// names a rule twice, or gives its descriptors different costs, is several, decided one
/// after the other.
pub fn rounds(asks: &[Ask]) -> Vec<Vec<usize>> {
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (at, ask) in asks.iter().enumerate() {
        let fits = |round: &Vec<usize>| {
            round.iter().all(|&j| {
                let other = &asks[j];
                let clash = match (&ask.writes, &other.writes) {
                    (Some((s, v)), Some((t, w))) => s == t && v != w,
                    _ => false,
                };
                other.cost == ask.cost && other.rule != ask.rule && !clash
            })
        };
        match rounds.iter_mut().find(|r| fits(r)) {
            Some(r) => r.push(at),
            None => rounds.push(vec![at]),
        }
    }
    rounds
}

/// Who a descriptor is under a rule that counts by its entries: the SHA-256 of the
/// domain and every entry, domain-separated from every other identity, in hex (written
/// where the rule reads it: the header of [`crate::config::envoy_yaml::DESCRIPTOR_HEADER`]).
/// Each part is length-prefixed, so no two descriptors write the same bytes.
pub fn digest_hex(domain: &str, entries: &[Entry<'_>]) -> String {
    let mut h = Context::new(&SHA256);
    h.update(b"ratewall/rls\0");
    let mut part = |s: &str| {
        h.update(&(s.len() as u64).to_be_bytes());
        h.update(s.as_bytes());
    };
    part(domain);
    for (k, v) in entries {
        part(k);
        part(v);
    }
    let sum = h.finish();
    let mut out = String::with_capacity(64);
    for b in sum.as_ref() {
        out.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        out.push(char::from(b"0123456789abcdef"[usize::from(b & 0xf)]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tree of a YAML text, and its rules' names.
    fn tree(yaml: &str) -> (Descriptors, Vec<String>) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ratelimit.yaml"), yaml).unwrap();
        let toml = "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n[decide]\nenvoy_config = \"ratelimit.yaml\"\n";
        let path = dir.path().join("limits.toml");
        std::fs::write(&path, toml).unwrap();
        let c = crate::config::Config::load(&path).unwrap();
        let names = c.rules.iter().map(|r| r.name.clone()).collect();
        (c.descriptors, names)
    }

    fn rule_of(t: &(Descriptors, Vec<String>), domain: &str, entries: &[Entry<'_>]) -> Option<String> {
        match find(&t.0, domain, entries)?.what {
            Leaf::Rule(i) => Some(t.1[i].clone()),
            other => Some(format!("{other:?}")),
        }
    }

    #[test]
    fn the_readme_examples_match_as_documented() {
        // envoyproxy/ratelimit README, example 2.
        let t = tree("domain: messaging\ndescriptors:\n  - key: message_type\n    value: marketing\n    descriptors:\n      - key: to_number\n        rate_limit:\n          unit: day\n          requests_per_unit: 5\n  - key: to_number\n    rate_limit:\n      unit: day\n      requests_per_unit: 100\n");
        assert_eq!(
            rule_of(&t, "messaging", &[("message_type", "marketing"), ("to_number", "2061111111")]).as_deref(),
            Some("messaging.message_type_marketing.to_number")
        );
        assert_eq!(rule_of(&t, "messaging", &[("to_number", "2061111111")]).as_deref(), Some("messaging.to_number"));
        // A placeholder with no limit of its own, and a descriptor deeper than the tree.
        assert_eq!(rule_of(&t, "messaging", &[("message_type", "marketing")]), None);
        assert_eq!(rule_of(&t, "messaging", &[("to_number", "1"), ("x", "y")]), None);
        assert_eq!(rule_of(&t, "elsewhere", &[("to_number", "1")]), None);
        // Example 3: key and value before the key alone.
        let t = tree("domain: edge_proxy_per_ip\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n  - key: remote_address\n    value: 50.0.0.5\n    rate_limit:\n      unit: second\n      requests_per_unit: 0\n");
        assert_eq!(rule_of(&t, "edge_proxy_per_ip", &[("remote_address", "50.0.0.5")]).as_deref(), Some("Blocked"));
        assert_eq!(
            rule_of(&t, "edge_proxy_per_ip", &[("remote_address", "50.0.0.1")]).as_deref(),
            Some("edge_proxy_per_ip.remote_address")
        );
        // Example 4: the depth must be the tree's.
        let t = tree("domain: example4\ndescriptors:\n  - key: key\n    value: value\n    rate_limit:\n      requests_per_unit: 300\n      unit: second\n");
        assert_eq!(rule_of(&t, "example4", &[("key", "value"), ("subkey", "subvalue")]), None);
    }

    #[test]
    fn wildcards_come_after_exact_values_and_before_any_value() {
        let t = tree("domain: w\ndescriptors:\n  - key: path\n    value: /files/*\n    rate_limit: { unit: minute, requests_per_unit: 2 }\n  - key: path\n    value: /files/special\n    rate_limit: { unit: minute, requests_per_unit: 9 }\n  - key: path\n    rate_limit: { unit: minute, requests_per_unit: 5 }\n");
        assert_eq!(rule_of(&t, "w", &[("path", "/files/a.pdf")]).as_deref(), Some("w.path_-files--"));
        assert_eq!(rule_of(&t, "w", &[("path", "/files/special")]).as_deref(), Some("w.path_-files-special"));
        assert_eq!(rule_of(&t, "w", &[("path", "/other")]).as_deref(), Some("w.path"));
    }

    #[test]
    fn replaces_and_unlimited_over_a_call() {
        // README example 7: the named limit is set aside where its replacer matched.
        let t = tree("domain: example7\ndescriptors:\n  - key: key_1\n    value: value_1\n    descriptors:\n      - key: user\n        value: bkthomps\n        rate_limit:\n          name: specific_limit\n          requests_per_unit: 5\n          unit: second\n  - key: key_2\n    value: value_2\n    descriptors:\n      - key: user\n        value: bkthomps\n        rate_limit:\n          replaces:\n            - name: specific_limit\n          requests_per_unit: 10\n          unit: second\n  - key: ldap\n    rate_limit:\n      unlimited: true\n");
        let a = find(&t.0, "example7", &[("key_1", "value_1"), ("user", "bkthomps")]);
        let b = find(&t.0, "example7", &[("key_2", "value_2"), ("user", "bkthomps")]);
        let u = find(&t.0, "example7", &[("ldap", "x")]);
        let both = settle(&[a, b, u, None]);
        assert_eq!(both[0], Applies::Nothing);
        assert!(matches!(both[1], Applies::Rule(_)));
        assert_eq!(both[2], Applies::Unlimited);
        assert_eq!(both[3], Applies::Nothing);
        // Alone, the named limit applies.
        assert!(matches!(settle(&[a])[0], Applies::Rule(_)));
    }

    #[test]
    fn a_rule_twice_two_costs_or_one_slot_twice_make_rounds() {
        let ask = |rule, cost, w: Option<&str>| Ask {
            rule,
            cost,
            writes: w.map(|v| (Slot::Peer, v.to_string())),
        };
        assert_eq!(rounds(&[ask(0, 1, None), ask(1, 1, None)]), vec![vec![0, 1]]);
        assert_eq!(
            rounds(&[ask(0, 1, None), ask(0, 1, None), ask(1, 1, None)]),
            vec![vec![0, 2], vec![1]]
        );
        assert_eq!(rounds(&[ask(0, 1, None), ask(1, 3, None)]), vec![vec![0], vec![1]]);
        assert_eq!(
            rounds(&[ask(0, 1, Some("1.2.3.4")), ask(1, 1, Some("1.2.3.4")), ask(2, 1, Some("5.6.7.8"))]),
            vec![vec![0, 1], vec![2]]
        );
        assert!(rounds(&[]).is_empty());
    }

    #[test]
    fn digests_tell_every_descriptor_apart() {
        let d = |dom, e: &[Entry<'_>]| digest_hex(dom, e);
        assert_eq!(d("a", &[("k", "v")]).len(), 64);
        assert_eq!(d("a", &[("k", "v")]), d("a", &[("k", "v")]));
        assert_ne!(d("a", &[("k", "v")]), d("b", &[("k", "v")]));
        assert_ne!(d("a", &[("k", "v")]), d("a", &[("k", "w")]));
        assert_ne!(d("a", &[("kv", "")]), d("a", &[("k", "v")]));
        assert_ne!(d("a", &[("k", "v"), ("x", "y")]), d("a", &[("k", "v")]));
    }
}
