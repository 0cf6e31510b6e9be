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
            if !path.starts_with(strip.get_ref().0.as_str()) {
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
