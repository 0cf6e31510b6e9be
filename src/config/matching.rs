//! `match`, as rules and routes write it: the path, methods and host a request must
//! have, what it must carry (`api_key = "absent"`), and for a rule, the route it must
//! have come by. Validated into a [`Match`].

use std::fmt;

use http::HeaderName;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use toml::Spanned;

use super::suggest;
use super::values::{GlobSpec, Hosts, MethodName, PathPrefix};
use super::Invalid;
use crate::identity::{Carried, KeyKind};
use crate::rules::{Condition, Match, PathMatch};

/// `match`. Its `Deserialize` is written out (below) for the `"header:<name>"` keys, and
/// rejects unknown keys at their place in the file as `deny_unknown_fields` would.
#[derive(Default)]
pub(super) struct RawMatch {
    path_prefix: Option<PathPrefix>,
    path: Option<PathPrefix>,
    glob: Option<GlobSpec>,
    methods: Vec<MethodName>,
    host: Hosts,
    api_key: Option<Spanned<Presence>>,
    /// `"header:<name>" = "present" | "absent"`, as written.
    /// In the file: `header:<name>`
    headers: Vec<(HeaderName, Spanned<Presence>)>,
    /// Rules only: the route (by name) a request must have been sent by.
    route: Option<Spanned<String>>,
    /// Rules only: `proxied = false`, a rule asked for by name alone (the decision API,
    /// Envoy's descriptors), never applied to a request the gateway sees.
    proxied: Option<Spanned<bool>>,
    /// Rules only: `egress = true`, a rule of the egress gateway's calls (issue 45),
    /// never applied to a request the proxy sees.
    egress: Option<Spanned<bool>>,
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
    Route,
    Proxied,
    Egress,
}

const MATCH_KEYS: &[&str] = &[
    "path_prefix",
    "path",
    "glob",
    "methods",
    "host",
    "api_key",
    "header:<name>",
    "route",
    "proxied",
    "egress",
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
            "route" => MatchKey::Route,
            "proxied" => MatchKey::Proxied,
            "egress" => MatchKey::Egress,
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
                    "a table of path_prefix, path, glob, methods, host, api_key, \"header:<name>\", route, proxied, egress",
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
                        MatchKey::Route => m.route = Some(map.next_value()?),
                        MatchKey::Proxied => m.proxied = Some(map.next_value()?),
                        MatchKey::Egress => m.egress = Some(map.next_value()?),
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

/// Whose `match` it is, for what it may say.
pub(super) enum Owner<'a> {
    /// A rule counting by `counted_by`, in a file whose routes have these names (`None`
    /// for an unnamed route: a rule cannot name it).
    Rule {
        counted_by: &'a KeyKind,
        routes: &'a [Option<String>],
    },
    /// A route: chosen by its match, it cannot name a route itself.
    Route,
}

impl RawMatch {
    /// The path it names, as written: `path_prefix`, `path`, or a glob's literal start.
    pub(super) fn literal_path(&self) -> Option<&str> {
        match (&self.path_prefix, &self.path, &self.glob) {
            (Some(p), _, _) | (None, Some(p), _) => Some(&p.0),
            (None, None, Some(g)) => Some(g.0.literal_prefix()),
            (None, None, None) => None,
        }
    }
}

/// `m` (of the table at `at`, e.g. `rules[0]`), validated for `owner`.
pub(super) fn validate(
    m: &Spanned<RawMatch>,
    at: &str,
    owner: &Owner<'_>,
    key_header: &HeaderName,
) -> Result<Match, Invalid> {
    let (span, m) = (m.span(), m.get_ref());
    let key = |k: &str| format!("{at}.{k}");
    let path = match (&m.path_prefix, &m.path, &m.glob) {
        (None, None, None) => PathMatch::Any,
        (Some(p), None, None) => PathMatch::Prefix(p.0.clone()),
        (None, Some(p), None) => PathMatch::Exact(p.0.clone()),
        (None, None, Some(g)) => PathMatch::Glob(g.0.clone()),
        _ => {
            return Err(Invalid::new(
                Some(span),
                key("match"),
                "give one of path_prefix, path and glob",
            ))
        }
    };
    let route = match (&m.route, owner) {
        (None, _) => None,
        (Some(r), Owner::Route) => {
            return Err(Invalid::new(
                Some(r.span()),
                key("match.route"),
                "a route is chosen by its match alone, so its match cannot name a route (route = ... is for [[rules]])",
            ))
        }
        (Some(r), Owner::Rule { routes, .. }) => Some(route_named(r, routes, &key("match.route"))?),
    };
    let counted_by = match owner {
        Owner::Rule { counted_by, .. } => Some(*counted_by),
        Owner::Route => None,
    };
    let proxied =
        match (&m.proxied, owner) {
            (None, _) => true,
            (Some(p), Owner::Route) => return Err(Invalid::new(
                Some(p.span()),
                key("match.proxied"),
                "proxied = false is for [[rules]] asked for by name (the decision API), not routes",
            )),
            (Some(p), Owner::Rule { .. }) => *p.get_ref(),
        };
    let egress = match (&m.egress, owner) {
        (None, _) => false,
        (Some(e), Owner::Route) => {
            return Err(Invalid::new(
                Some(e.span()),
                key("match.egress"),
                "egress = true is for [[rules]] of the egress gateway's calls, not routes",
            ))
        }
        (Some(e), Owner::Rule { .. }) if *e.get_ref() && !proxied => {
            return Err(Invalid::new(
                Some(e.span()),
                key("match.egress"),
                "egress = true and proxied = false: a rule is either the egress gateway's or asked for by name",
            ))
        }
        (Some(e), Owner::Rule { .. }) => *e.get_ref(),
    };
    Ok(Match {
        proxied,
        egress,
        path,
        methods: m.methods.iter().map(|m| m.0.clone()).collect(),
        hosts: m.host.0.clone(),
        carrying: carrying(m, &key, counted_by, key_header)?,
        route,
    })
}

/// The position of the route a rule's `route = "<name>"` names, among the named ones.
fn route_named(
    r: &Spanned<String>,
    routes: &[Option<String>],
    key: &str,
) -> Result<usize, Invalid> {
    let name = r.get_ref();
    if let Some(i) = routes
        .iter()
        .position(|n| n.as_deref() == Some(name.as_str()))
    {
        return Ok(i);
    }
    let named: Vec<&str> = routes.iter().flatten().map(String::as_str).collect();
    let mut message = format!("unknown route {name:?}: ");
    if named.is_empty() {
        message.push_str("no [[routes]] entry has a name");
    } else {
        let list: Vec<String> = named.iter().map(|n| format!("{n:?}")).collect();
        message.push_str(&format!("the named routes are {}", list.join(", ")));
        if let Some(near) = suggest::closest(name, named.iter().copied()) {
            message.push_str(&format!(" (did you mean {near:?}?)"));
        }
    }
    message.push_str("; a rule names a route by its name (an unnamed one cannot be named)");
    Err(Invalid::new(Some(r.span()), key, message))
}

/// `api_key = …` and `"header:<name>" = …`, refused where they would make a rule that
/// never counts anyone, or read the API key header as a plain header.
fn carrying(
    m: &RawMatch,
    key: &dyn Fn(&str) -> String,
    counted_by: Option<&KeyKind>,
    key_header: &HeaderName,
) -> Result<Vec<Condition>, Invalid> {
    let written = m.api_key.iter().map(|p| (Carried::ApiKey, p)).chain(
        m.headers
            .iter()
            .map(|(h, p)| (Carried::Header(h.clone()), p)),
    );
    let mut out = Vec::new();
    for (carried, p) in written {
        let present = *p.get_ref() == Presence::Present;
        let at = key(&format!("match.{}", carried.to_string().trim_matches('"')));
        if let Carried::Header(h) = &carried {
            if h == key_header {
                return Err(Invalid::new(
                    Some(p.span()),
                    at,
                    format!("{h} is the API key header ([keys] header): write api_key = \"{}\", which reads it as a key", if present { "present" } else { "absent" }),
                ));
            }
        }
        // The rule's key, or a part of its combined key.
        let counts_by_it = counted_by.is_some_and(|k| match &carried {
            Carried::ApiKey => k.uses(&KeyKind::ApiKey),
            Carried::Header(h) => k.uses(&KeyKind::Header(h.clone())),
        });
        if let (true, false, Some(kind)) = (counts_by_it, present, counted_by) {
            return Err(Invalid::new(
                Some(p.span()),
                at,
                format!("a rule counting by {kind} that applies only when it is absent counts nobody by it; count those requests with key = \"client_ip\""),
            ));
        }
        out.push(Condition { carried, present });
    }
    Ok(out)
}
