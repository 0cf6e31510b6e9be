//! `[[routes]]`: which pool a request goes to, by the rules' `match`, and the prefixes
//! its forwarded path loses and gains. Validated into [`Routes`].

use std::collections::HashSet;

use http::HeaderName;
use serde::Deserialize;
use toml::Spanned;

use super::matching::{self, Owner, RawMatch};
use super::suggest;
use super::values::{RouteName, RoutePrefix};
use super::Invalid;
use crate::rules::{Match, PathCase, Route, Routes};
use crate::upstream::{PoolSettings, DEFAULT_POOL};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    /// Omitted: `route-<n>`, its place among the routes (from 1).
    name: Option<Spanned<RouteName>>,
    #[serde(rename = "match")]
    matcher: Option<Spanned<RawMatch>>,
    upstream: Spanned<String>,
    strip_prefix: Option<Spanned<RoutePrefix>>,
    add_prefix: Option<RoutePrefix>,
}

/// The names of `routes` as the file gives them (`None` for an unnamed one): what a rule's
/// `route` may name.
pub(super) fn written_names(routes: &[Spanned<RawRoute>]) -> Vec<Option<String>> {
    routes
        .iter()
        .map(|r| r.get_ref().name.as_ref().map(|n| n.get_ref().0.clone()))
        .collect()
}

/// Every route, each sending to one of `pools` (the pool `default` first, if any).
pub(super) fn validate(
    routes: &[Spanned<RawRoute>],
    pools: &[PoolSettings],
    key_header: &HeaderName,
    case: PathCase,
) -> Result<Routes, Invalid> {
    let mut list = Vec::with_capacity(routes.len());
    // The names the unnamed routes get: a named route may not take one of them.
    let generated: HashSet<String> = (0..routes.len())
        .filter(|&i| routes[i].get_ref().name.is_none())
        .map(|i| generated_name(i + 1))
        .collect();
    let mut names = HashSet::new();
    for (i, spanned) in routes.iter().enumerate() {
        let r = spanned.get_ref();
        let at = format!("routes[{i}]");
        let name = match &r.name {
            Some(n) => {
                let name = n.get_ref().0.clone();
                let why = if !names.insert(name.clone()) {
                    Some(format!("duplicate route name {name:?}"))
                } else if generated.contains(&name) {
                    Some(format!("{name:?} is the name an unnamed route gets (route-<n>, its place among the routes): name this one otherwise"))
                } else {
                    None
                };
                if let Some(why) = why {
                    return Err(Invalid::new(Some(n.span()), format!("{at}.name"), why));
                }
                name
            }
            None => generated_name(i + 1),
        };
        let matcher = match &r.matcher {
            Some(m) => matching::validate(m, &at, &Owner::Route, key_header)?,
            None => Match::default(),
        };
        let wanted = r.upstream.get_ref();
        let Some(pool) = pools.iter().position(|p| p.name == *wanted) else {
            let mut message = format!("unknown upstream {wanted:?}: the pools are ");
            let list: Vec<String> = pools.iter().map(|p| format!("{:?}", p.name)).collect();
            message.push_str(&list.join(", "));
            if let Some(near) = suggest::closest(wanted, pools.iter().map(|p| p.name.as_str())) {
                message.push_str(&format!(" (did you mean {near:?}?)"));
            }
            return Err(Invalid::new(
                Some(r.upstream.span()),
                format!("{at}.upstream"),
                message,
            ));
        };
        if let (Some(strip), Some(path)) = (
            &r.strip_prefix,
            r.matcher.as_ref().and_then(|m| m.get_ref().literal_path()),
        ) {
            let strip_text = strip.get_ref().0.as_str();
            let fits = match case {
                PathCase::Sensitive => path.starts_with(strip_text),
                // As the request path is stripped: letters' case ignored.
                PathCase::Insensitive => path
                    .get(..strip_text.len())
                    .is_some_and(|head| head.eq_ignore_ascii_case(strip_text)),
            };
            if !fits {
                return Err(Invalid::new(
                    Some(strip.span()),
                    format!("{at}.strip_prefix"),
                    format!(
                        "strip_prefix {:?} is not a prefix of the match's path {path:?}: it would never be stripped",
                        strip.get_ref().0
                    ),
                ));
            }
        }
        list.push(Route {
            name,
            matcher,
            pool,
            strip_prefix: r.strip_prefix.as_ref().map(|s| s.get_ref().0.clone()),
            add_prefix: r
                .add_prefix
                .as_ref()
                .map(|a| a.0.trim_end_matches('/').to_string())
                .filter(|a| !a.is_empty()),
        });
    }
    let default_pool = pools.iter().position(|p| p.name == DEFAULT_POOL);
    Ok(Routes::new(list, default_pool, case))
}

/// The name of the `n`-th route (from 1) when the file gives it none.
fn generated_name(n: usize) -> String {
    format!("route-{n}")
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::{Config, ConfigError};

    const POOLS: &str = "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n[[upstreams]]\nname = \"billing\"\nservers = [\"http://127.0.0.1:3\"]\n";

    fn parse(body: &str) -> Result<Config, ConfigError> {
        Config::parse(&format!("{POOLS}{body}"), Path::new("t.toml"))
    }

    fn message(body: &str) -> String {
        match parse(body) {
            Err(ConfigError::Invalid { key, message, .. }) => format!("{key}: {message}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_rule_names_a_route_by_its_position() {
        let cfg = parse(
            "[[routes]]\nmatch = { path_prefix = \"/x/\" }\nupstream = \"default\"\n\
             [[routes]]\nname = \"billing\"\nmatch = { path_prefix = \"/billing/\" }\nupstream = \"billing\"\n\
             [[rules]]\nname = \"b\"\nkey = \"global\"\nrate = \"1/s\"\nmatch = { route = \"billing\" }\n",
        )
        .unwrap();
        let m = &cfg.rules[0].matcher;
        assert_eq!(m.route, Some(1));
        assert_eq!(cfg.routes.list[1].pool, 1);
        assert!(m.fits_route(Some(1)));
        assert!(!m.fits_route(Some(0)));
        assert!(!m.fits_route(None), "a request no route sent");
        assert!(cfg.routes.list[0].matcher.fits_route(None));
    }

    #[test]
    fn unnamed_routes_are_named_by_their_place() {
        let cfg = parse(
            "[[routes]]\nupstream = \"billing\"\n[[routes]]\nname = \"route-2\"\nupstream = \"default\"\n",
        )
        .unwrap();
        let names: Vec<&str> = cfg.routes.list.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["route-1", "route-2"]);
        assert_eq!(
            message("[[routes]]\nname = \"route-2\"\nupstream = \"billing\"\n[[routes]]\nupstream = \"default\"\n"),
            "routes[0].name: \"route-2\" is the name an unnamed route gets (route-<n>, its place among the routes): name this one otherwise"
        );
        // A rule names a route by the name the file gives it.
        assert_eq!(
            message("[[routes]]\nupstream = \"billing\"\n[[rules]]\nname = \"r\"\nkey = \"global\"\nrate = \"1/s\"\nmatch = { route = \"route-1\" }\n"),
            "rules[0].match.route: unknown route \"route-1\": no [[routes]] entry has a name; a rule names a route by its name (an unnamed one cannot be named)"
        );
    }

    #[test]
    fn prefixes_are_checked_against_the_match() {
        let cfg = parse(
            "[[routes]]\nmatch = { glob = \"/v1/*/x\" }\nupstream = \"billing\"\nstrip_prefix = \"/v1\"\nadd_prefix = \"/\"\n",
        )
        .unwrap();
        assert_eq!(cfg.routes.list[0].strip_prefix.as_deref(), Some("/v1"));
        assert_eq!(cfg.routes.list[0].add_prefix, None, "\"/\" adds nothing");
        assert_eq!(
            message("[[routes]]\nupstream = \"billing\"\nadd_prefix = \"api\"\n"),
            "routes[0].add_prefix: invalid prefix \"api\": a path starting with \"/\", without ? or #"
        );
        assert_eq!(
            message("[[routes]]\nmatch = { path = \"/a\" }\nupstream = \"billing\"\nstrip_prefix = \"/ab\"\n"),
            "routes[0].strip_prefix: strip_prefix \"/ab\" is not a prefix of the match's path \"/a\": it would never be stripped"
        );
        // Without a path in the match, any strip_prefix goes: paths without it keep theirs.
        assert!(parse("[[routes]]\nupstream = \"billing\"\nstrip_prefix = \"/v9\"\n").is_ok());
    }
}
