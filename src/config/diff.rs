//! What a reload changed: the rules, pools and routes added, removed and changed (by
//! name), and the other settings that differ (by key). Names only, never values: a value may be a secret (the
//! admin token, a Redis password, an API key listed with a plan).

use std::fmt;

use super::Config;
use crate::rules::{Match, Route, Rule};

/// The differences between two configurations, in the files' order.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
    /// The pools (`[upstream] url` is the pool `default`, and `[[upstreams]]`), by name:
    /// a changed pool is one with any setting or server changed.
    pub pools: Named,
    /// The routes, by name (an unnamed one's is `route-<n>`: moving it renames it).
    pub routes: Named,
    /// Dotted keys of the settings outside `[[rules]]`, the pools and the routes that
    /// differ (`keys.plans`: the keys listed, or their plans).
    pub settings: Vec<&'static str>,
}

/// What was added, removed and changed among things known by name.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Named {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
}

impl Named {
    /// `old` and `new`, compared by name (`name`) and then by `same`.
    fn between<T>(
        old: &[T],
        new: &[T],
        name: impl Fn(&T) -> &str,
        same: impl Fn(&T, &T) -> bool,
    ) -> Named {
        let find = |list: &[T], n: &str| list.iter().position(|t| name(t) == n);
        let mut c = Named::default();
        for t in new {
            match find(old, name(t)) {
                None => c.added.push(name(t).to_string()),
                Some(i) if !same(&old[i], t) => c.changed.push(name(t).to_string()),
                Some(_) => {}
            }
        }
        for t in old {
            if find(new, name(t)).is_none() {
                c.removed.push(name(t).to_string());
            }
        }
        c
    }

    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }
}

/// For a log field: `+new -gone ~changed`, or `-` when nothing changed.
impl fmt::Display for Named {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("-");
        }
        let marked = [
            ('+', &self.added),
            ('-', &self.removed),
            ('~', &self.changed),
        ];
        let mut first = true;
        for (mark, names) in marked {
            for n in names {
                if !first {
                    f.write_str(" ")?;
                }
                first = false;
                write!(f, "{mark}{n}")?;
            }
        }
        Ok(())
    }
}

impl Changes {
    pub fn between(old: &Config, new: &Config) -> Changes {
        let rules = Named::between(
            &old.rules,
            &new.rules,
            |r| &r.name,
            |a, b| same_rule((old, a), (new, b)),
        );
        Changes {
            added: rules.added,
            removed: rules.removed,
            changed: rules.changed,
            pools: Named::between(&old.upstreams, &new.upstreams, |p| &p.name, |a, b| a == b),
            routes: Named::between(
                &old.routes.list,
                &new.routes.list,
                |r| &r.name,
                |a, b| same_route((old, a), (new, b)),
            ),
            settings: settings(old, new),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self.changed.is_empty()
            && self.pools.is_empty()
            && self.routes.is_empty()
            && self.settings.is_empty()
    }
}

/// Whether two matches take the same requests. A `match` holds compiled patterns without
/// an equality of their own: it is compared by its debug form, which names every part of
/// it; a rule's route by the route's name (its position may move).
fn same_match((o, a): (&Config, &Match), (n, b): (&Config, &Match)) -> bool {
    let route = |cfg: &Config, m: &Match| {
        m.route
            .and_then(|i| cfg.routes.list.get(i))
            .map(|r| r.name.clone())
    };
    let unrouted = |m: &Match| {
        format!(
            "{:?}",
            Match {
                route: None,
                ..m.clone()
            }
        )
    };
    unrouted(a) == unrouted(b) && route(o, a) == route(n, b)
}

/// Whether two routes of one name send the same requests to the same pool (by its name)
/// with the same path.
fn same_route((o, a): (&Config, &Route), (n, b): (&Config, &Route)) -> bool {
    let pool = |cfg: &Config, r: &Route| cfg.upstreams.get(r.pool).map(|p| p.name.clone());
    same_match((o, &a.matcher), (n, &b.matcher))
        && pool(o, a) == pool(n, b)
        && a.strip_prefix == b.strip_prefix
        && a.add_prefix == b.add_prefix
}

/// Whether two rules of one name limit the same requests the same way (order in the file
/// aside).
fn same_rule((o, a): (&Config, &Rule), (n, b): (&Config, &Rule)) -> bool {
    same_match((o, &a.matcher), (n, &b.matcher))
        && a.key == b.key
        && a.quota == b.quota
        && a.plans == b.plans
        && a.mode == b.mode
        && a.enforce_percent == b.enforce_percent
        && a.max_waiting == b.max_waiting
        && a.retry_jitter_us == b.retry_jitter_us
        && a.messages == b.messages
        && a.bytes == b.bytes
}

/// `[(key, whether the two agree on it)]` for fields of one table read alike from both:
/// `same!("server", os, ns; listen, workers)` gives `("server.listen", os.listen ==
/// ns.listen)`, then `server.workers`'.
macro_rules! same {
    ($table:literal, $o:ident, $n:ident; $($field:ident),+) => {
        [$((concat!($table, ".", stringify!($field)), $o.$field == $n.$field)),+]
    };
}

/// The keys outside `[[rules]]` and the routes whose values differ.
fn settings(o: &Config, n: &Config) -> Vec<&'static str> {
    let (os, ns) = (&o.server, &n.server);
    let (ot, nt) = (&os.timeouts, &ns.timeouts);
    let (ostore, nstore) = (&o.store, &n.store);
    let (oip, nip) = (&o.client_ip, &n.client_ip);
    let (ok, nk) = (&o.keys, &n.keys);
    let mut keys = Vec::new();
    keys.extend(same!("server", os, ns; listen, admin_listen, shutdown_grace, workers));
    keys.extend([
        ("server.header_timeout", ot.header == nt.header),
        ("server.idle_timeout", ot.idle == nt.idle),
        ("server.body_timeout", ot.body == nt.body),
    ]);
    keys.extend(same!(
        "server", os, ns;
        upgrade_idle_timeout, max_connections, max_header_bytes, max_header_fields, backlog,
        tag_secret, path_case, underscores_in_headers
    ));
    keys.extend(tls_settings(os.tls.as_ref(), ns.tls.as_ref()));
    keys.push(("admin.token", o.admin.token == n.admin.token));
    keys.extend(same!(
        "store", ostore, nstore;
        backend, prefix, timeout, on_error, breaker_failures, breaker_cooldown, max_keys
    ));
    keys.extend(same!("client_ip", oip, nip; trusted_proxies, header));
    keys.extend(same!("keys", ok, nk; header, unknown, file));
    keys.extend([
        ("keys.plans", ok.same_plans(nk)),
        ("response.headers", o.response == n.response),
        ("log.client_ip", o.log.client_ip == n.log.client_ip),
    ]);
    keys.into_iter()
        .filter(|(_, same)| !same)
        .map(|(key, _)| key)
        .collect()
}

/// `[server.tls]`'s keys, and whether the two agree on each.
fn tls_settings(
    o: Option<&crate::tls::Settings>,
    n: Option<&crate::tls::Settings>,
) -> [(&'static str, bool); 4] {
    let client_ca = |t: Option<&crate::tls::Settings>| {
        t.and_then(|t| t.client_auth.as_ref().map(|a| (a.ca.clone(), a.required)))
    };
    [
        (
            "server.tls.listen",
            o.map(|t| t.listen) == n.map(|t| t.listen),
        ),
        (
            "server.tls.certificates",
            match (o, n) {
                (Some(a), Some(b)) => a.same_certificates(b),
                (a, b) => a.is_none() == b.is_none(),
            },
        ),
        ("server.tls.client_ca", client_ca(o) == client_ca(n)),
        (
            "server.tls.redirect_https",
            o.is_some_and(|t| t.redirect_https) == n.is_some_and(|t| t.redirect_https),
        ),
    ]
}

/// A list for a log field: `a, b`, or `-` when empty.
pub struct Listed<'a, T>(pub &'a [T]);

impl<T: AsRef<str>> fmt::Display for Listed<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("-");
        }
        for (i, item) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(item.as_ref())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// A config of `[upstream]` with `upstream` added, then `body`.
    fn config_with(upstream: &str, body: &str) -> Config {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n{upstream}{body}"
        );
        Config::parse(&text, Path::new("limits.toml")).expect("a valid config")
    }

    fn config(body: &str) -> Config {
        config_with("", body)
    }

    const RULES: &str = "[[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"10/s\"\n\
        [[rules]]\nname = \"ip\"\nkey = \"client_ip\"\nrate = \"5/s\"\n\
        [[rules]]\nname = \"old\"\nkey = \"global\"\nrate = \"100/s\"\n";

    #[test]
    fn the_same_file_changes_nothing() {
        let c = Changes::between(&config(RULES), &config(RULES));
        assert!(c.is_empty(), "{c:?}");
    }

    #[test]
    fn rules_are_named_as_added_removed_or_changed() {
        let new = "[[rules]]\nname = \"ip\"\nkey = \"client_ip\"\nrate = \"5/s\"\n\
            [[rules]]\nname = \"api\"\nkey = \"api_key\"\nrate = \"20/s\"\n\
            [[rules]]\nname = \"fresh\"\nkey = \"global\"\nrate = \"1/s\"\n";
        let c = Changes::between(&config(RULES), &config(new));
        assert_eq!(c.added, ["fresh"]);
        assert_eq!(c.removed, ["old"]);
        assert_eq!(c.changed, ["api"], "moving `ip` up changes nothing of it");
        assert!(c.settings.is_empty(), "{c:?}");
    }

    #[test]
    fn a_rules_match_plans_and_mode_are_part_of_it() {
        let base = "[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"5/s\"\n";
        for changed in [
            "[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"5/s\"\nmatch = { path_prefix = \"/a/\" }\n",
            "[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"5/s\"\nmode = \"shadow\"\n",
            "[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"5/s\"\nburst = 9\n",
            "[[rules]]\nname = \"r\"\nkey = \"client_ip\"\nrate = \"5/s\"\n",
            "[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"5/s\"\nmessages = { rate = \"50/s\" }\n",
        ] {
            let c = Changes::between(&config(base), &config(changed));
            assert_eq!(c.changed, ["r"], "{changed}");
        }
        let plan = |rate: &str| {
            config(&format!(
                "[keys.plans]\n\"k\" = \"pro\"\n{base}[rules.plans.pro]\nrate = \"{rate}\"\n"
            ))
        };
        let c = Changes::between(&plan("5/s"), &plan("9/s"));
        assert_eq!(c.changed, ["r"], "a plan's limit");
        let messages = |m: &str| config(&format!("{base}messages = {m}\n"));
        let c = Changes::between(
            &messages("{ rate = \"50/s\" }"),
            &messages("{ rate = \"50/s\", burst = 100 }"),
        );
        assert_eq!(c.changed, ["r"], "a messages limit's burst");
        let same = Changes::between(
            &messages("{ rate = \"50/s\" }"),
            &messages("{ rate = \"50/s\", burst = 50 }"),
        );
        assert!(
            same.is_empty(),
            "the default burst is the rate's N: {same:?}"
        );
        assert!(c.settings.is_empty(), "{c:?}");
    }

    #[test]
    fn other_settings_are_named_by_key_never_by_value() {
        let old = config("");
        let new = config_with(
            "timeout = \"3s\"\n",
            "[response]\nheaders = \"legacy\"\n[log]\nclient_ip = false\n\
             [keys.plans]\n\"secret-key-123\" = \"pro\"\n\
             [[rules]]\nname = \"r\"\nkey = \"api_key\"\nrate = \"5/s\"\n[rules.plans.pro]\nrate = \"9/s\"\n",
        );
        let c = Changes::between(&old, &new);
        assert_eq!(
            c.pools.changed,
            ["default"],
            "[upstream] url is the pool default"
        );
        assert_eq!(
            c.settings,
            ["keys.plans", "response.headers", "log.client_ip"],
            "a pool's keys are the pool's change, named in pools only"
        );
        assert_eq!(c.added, ["r"]);
        assert!(!format!("{c:?}").contains("secret-key-123"));
        assert_eq!(Listed(&c.settings[..0]).to_string(), "-");
        assert_eq!(Listed(&c.added).to_string(), "r");
    }

    /// Issue 42: a reload that changed the servers of a pool (the pool `default`,
    /// written as `[[upstreams]]`) names the pool, never `upstream.url`.
    #[test]
    fn a_pools_servers_are_its_change_not_a_setting() {
        let two = |a: &str, b: &str| {
            Config::parse(
                &format!(
                    "[server]\nlisten = \"127.0.0.1:8080\"\n\
                     [[upstreams]]\nname = \"default\"\nservers = [\"{a}\", \"{b}\"]\n"
                ),
                Path::new("x.toml"),
            )
            .unwrap()
        };
        let old = two("http://10.0.0.1", "http://10.0.0.2");
        for new in [
            two("http://10.0.0.9", "http://10.0.0.2"),
            two("http://10.0.0.1", "http://10.0.0.9"),
        ] {
            let c = Changes::between(&old, &new);
            assert_eq!(c.pools.changed, ["default"]);
            assert!(c.settings.is_empty(), "{:?}", c.settings);
        }
    }

    #[test]
    fn pools_and_routes_are_named_as_added_removed_or_changed() {
        let pools = |second: &str, routes: &str| {
            config(&format!(
                "[[upstreams]]\nname = \"a\"\nservers = [\"http://10.0.0.1\"]\n\
                 [[upstreams]]\nname = \"{second}\"\nservers = [\"http://10.0.0.2\"]\n{routes}"
            ))
        };
        // A route matches the paths under its name: `x`, `/x/`.
        let route = |name: &str, pool: &str| {
            format!("[[routes]]\nname = \"{name}\"\nmatch = {{ path_prefix = \"/{name}/\" }}\nupstream = \"{pool}\"\n")
        };
        let old = pools(
            "b",
            &[route("x", "a"), route("y", "b"), route("z", "a")].concat(),
        );
        let new = pools(
            "c",
            &[route("y", "c"), route("x", "a"), route("w", "a")].concat(),
        );
        let c = Changes::between(&old, &new);
        assert_eq!(
            c.pools,
            Named {
                added: vec!["c".into()],
                removed: vec!["b".into()],
                changed: vec![],
            }
        );
        assert_eq!(
            (c.routes.added.as_slice(), c.routes.removed.as_slice()),
            (&["w".to_string()][..], &["z".to_string()][..])
        );
        assert_eq!(
            c.routes.changed,
            ["y"],
            "its pool is another; moving x changes nothing"
        );
        assert_eq!(c.pools.to_string(), "+c -b");
        assert_eq!(Named::default().to_string(), "-");
        assert!(c.settings.is_empty(), "{c:?}");
        // A rule following a route that moved is unchanged; one following another is.
        let rule = |to: &str| {
            format!("[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"1/s\"\nmatch = {{ route = \"{to}\" }}\n")
        };
        let before = pools("b", &[route("x", "a"), route("y", "b"), rule("y")].concat());
        let moved = pools("b", &[route("y", "b"), route("x", "a"), rule("y")].concat());
        let other = pools("b", &[route("x", "a"), route("y", "b"), rule("x")].concat());
        assert!(Changes::between(&before, &moved).changed.is_empty());
        assert_eq!(Changes::between(&before, &other).changed, ["r"]);
    }
}
