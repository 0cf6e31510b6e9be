//! `[[routes]]`, validated: which pool a request goes to, and the path it is forwarded
//! with. The routes' matches are compiled into a [`RuleIndex`] like the rules', so
//! choosing among 20 routes costs one walk down the path, not 20 checks; the first route
//! (in the file's order) whose match fits wins. A request no route fits goes to the pool
//! `default` if there is one ([`Routes::default_pool`]), else it is answered 404.

use std::borrow::Cow;

use http::Method;

use super::{Match, PathCase, RuleIndex};
use crate::identity::{Refusal, Requester};

/// One `[[routes]]` entry.
#[derive(Debug, Clone)]
pub struct Route {
    /// As the file names it, or `route-<n>` for the n-th route (from 1) when it has no
    /// name: the logs' and metrics' `route`.
    pub name: String,
    /// Never has a `route` condition of its own.
    pub matcher: Match,
    /// The pool it sends requests to: a position in `Config::upstreams`.
    pub pool: usize,
    /// Taken off the front of the forwarded path (starts with `/`).
    pub strip_prefix: Option<String>,
    /// Put in front of the forwarded path, after `strip_prefix` (starts with `/`, without a
    /// trailing `/`).
    pub add_prefix: Option<String>,
}

/// Every route of a config, compiled for choosing.
#[derive(Debug, Default)]
pub struct Routes {
    /// In the file's order: a rule's `route` condition and [`Routes::choose`] give
    /// positions in it.
    pub list: Vec<Route>,
    index: RuleIndex,
    /// The pool named `default`, if any: where requests no route fits go.
    pub default_pool: Option<usize>,
    /// How paths compare (`[server] path_case`): `strip_prefix` ignores case too where
    /// the matches do.
    case: PathCase,
}

impl Routes {
    pub fn new(list: Vec<Route>, default_pool: Option<usize>, case: PathCase) -> Routes {
        Routes {
            index: RuleIndex::new(list.iter().map(|r| &r.matcher), case),
            list,
            default_pool,
            case,
        }
    }

    /// Whether any route looks at the host (else the host need not be parsed for routing).
    pub fn uses_host(&self) -> bool {
        self.index.uses_host
    }

    /// The route a request goes by: the first, in the file's order, whose path, method
    /// and host fit and whose conditions on what the request carries hold; `None` if no
    /// route fits (the request goes to [`Routes::default_pool`], or gets a 404). `path` is
    /// as [`RuleIndex::path_of`] gives it, `host` without port. A key a condition reads
    /// and refuses (malformed, or unlisted with `unknown = "reject"`) refuses the request,
    /// as it would under a rule.
    pub fn choose(
        &self,
        method: &Method,
        path: &str,
        host: Option<&str>,
        requester: &Requester<'_>,
    ) -> Result<Option<usize>, Refusal> {
        for i in self.index.matching(method, path, host) {
            let mut fits = true;
            for c in &self.list[i].matcher.carrying {
                fits &= requester.carries(&c.carried)? == c.present;
            }
            if fits {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    /// The path (and query) a request sent by route `route` is forwarded with, where the
    /// route has `strip_prefix` or `add_prefix`: the path its match was tried on — as the
    /// backend routes it ([`super::normalize_path`]: percent-decoded, `%2F` a slash, dot
    /// segments resolved from the root as RFC 3986 §5.2.4 does, doubled slashes folded,
    /// `;` parameters dropped) — with `strip_prefix` taken off where that path starts with
    /// it and it ends a segment there (letters' case ignored under `path_case =
    /// "insensitive"`), then `add_prefix` put in front; bytes a path cannot carry as they
    /// are encoded again; a path left empty is `/`; the query as the client sent it.
    /// What follows `add_prefix` never holds a dot segment, so no request climbs out of it
    /// (`/billing/x/%2e%2e/%2e%2e/billing/internal` is `/v2/internal`). A path already in
    /// that form keeps the client's bytes. A route with neither prefix, an unknown
    /// `route`, or a target that is no path (`*` of `OPTIONS *`) leaves the target as
    /// sent: there is no prefix to climb out of, and the backend resolves it itself.
    pub fn forwarded_path<'a>(&self, route: usize, path_and_query: &'a str) -> Cow<'a, str> {
        let Some(r) = self.list.get(route) else {
            return Cow::Borrowed(path_and_query);
        };
        if !path_and_query.starts_with('/') {
            return Cow::Borrowed(path_and_query);
        }
        if r.strip_prefix.is_none() && r.add_prefix.is_none() {
            return Cow::Borrowed(path_and_query);
        }
        let path_end = path_and_query.find('?').unwrap_or(path_and_query.len());
        let (path, query) = path_and_query.split_at(path_end);
        // The one normalisation the rules read paths by: the route matched this path.
        let normal = super::normalize_path(path);
        let rest = match &r.strip_prefix {
            // Not where the prefix ends inside a segment (`/v1` of `/v1x` or `/v1..`):
            // taking it off there would make a new segment of what is left.
            Some(strip) => self
                .strip(&normal, strip)
                .filter(|after| after.is_empty() || after.starts_with('/') || strip.ends_with('/')),
            None => None,
        }
        .unwrap_or(&normal);
        let add = r.add_prefix.as_deref().unwrap_or("");
        let mut out = String::with_capacity(add.len() + rest.len() + query.len() + 8);
        out.push_str(add);
        if !rest.starts_with('/') {
            out.push('/');
        }
        if matches!(normal, Cow::Borrowed(_)) {
            // The path as sent was already normal: its bytes, as the client wrote them.
            out.push_str(rest);
        } else {
            // Decoded: what a path segment cannot carry (`%`, `?`, `#`, spaces, non-ASCII)
            // is encoded again; `/` stays the separator the rules read it as.
            encode_path(&mut out, rest);
        }
        out.push_str(query);
        Cow::Owned(out)
    }

    /// What is left of `path` once `prefix` is taken off its front, if it starts with it
    /// (letters' case ignored under `path_case = "insensitive"`).
    fn strip<'p>(&self, path: &'p str, prefix: &str) -> Option<&'p str> {
        let head = path.get(..prefix.len())?;
        let fits = match self.case {
            PathCase::Sensitive => head == prefix,
            PathCase::Insensitive => head.eq_ignore_ascii_case(prefix),
        };
        fits.then(|| &path[prefix.len()..])
    }
}

/// `path` appended to `out` with every byte a path segment may not carry as it is (RFC
/// 3986 §3.3: pchar is unreserved, sub-delims, `:` and `@`; `/` separates segments)
/// percent-encoded.
fn encode_path(out: &mut String, path: &str) {
    use std::fmt::Write;
    for &b in path.as_bytes() {
        let keep = b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/".contains(&b);
        if keep {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use http::HeaderMap;

    use crate::config::Config;

    fn config(body: &str) -> Config {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:1\"\n[[upstreams]]\nname = \"a\"\nservers = [\"http://127.0.0.1:2\"]\n[[upstreams]]\nname = \"b\"\nservers = [\"http://127.0.0.1:3\"]\n{body}"
        );
        Config::parse(&text, std::path::Path::new("t.toml")).unwrap_or_else(|e| panic!("{e}"))
    }

    fn route(name: &str, matcher: &str, pool: &str) -> String {
        format!("[[routes]]\nname = \"{name}\"\nmatch = {{ {matcher} }}\nupstream = \"{pool}\"\n")
    }

    /// The name of the route `cfg` chooses for the request, or `-`.
    fn chosen(cfg: &Config, method: &str, path: &str, host: Option<&str>, key: bool) -> String {
        let mut headers = HeaderMap::new();
        if key {
            headers.insert("x-api-key", "k".parse().unwrap());
        }
        let requester = Requester::new(
            &headers,
            "10.0.0.1".parse().unwrap(),
            &cfg.keys,
            &cfg.client_ip,
        );
        let m = Method::from_bytes(method.as_bytes()).unwrap();
        let path = cfg.routes.index.path_of(path);
        match cfg.routes.choose(&m, &path, host, &requester).unwrap() {
            Some(i) => cfg.routes.list[i].name.clone(),
            None => "-".into(),
        }
    }

    #[test]
    fn the_first_route_that_fits_wins() {
        let cfg = config(
            &[
                route("login", "path = \"/v1/login\", methods = [\"POST\"]", "b"),
                route("v1", "path_prefix = \"/v1/\"", "a"),
                route("v1-again", "path_prefix = \"/v1/\"", "b"),
                route("keyed", "api_key = \"present\"", "b"),
                route("export", "glob = \"/*/export\"", "a"),
            ]
            .concat(),
        );
        assert_eq!(chosen(&cfg, "POST", "/v1/login", None, false), "login");
        assert_eq!(chosen(&cfg, "GET", "/v1/login", None, false), "v1");
        assert_eq!(chosen(&cfg, "GET", "/v1/x", None, true), "v1");
        assert_eq!(chosen(&cfg, "GET", "/v2/export", None, true), "keyed");
        assert_eq!(chosen(&cfg, "GET", "/v2/export", None, false), "export");
        assert_eq!(chosen(&cfg, "GET", "/v2/x", None, false), "-");
        assert_eq!(cfg.routes.list[1].pool, 0);
        assert_eq!(cfg.routes.list[0].pool, 1);
        assert_eq!(cfg.routes.default_pool, None);
    }

    #[test]
    fn host_and_prefix_route_together() {
        let cfg = config(
            &[
                route(
                    "billing",
                    "host = \"billing.example.com\", path_prefix = \"/v1/\"",
                    "b",
                ),
                route("sub", "host = \"*.example.com\"", "a"),
                route("v1", "path_prefix = \"/v1/\"", "a"),
            ]
            .concat(),
        );
        let host = Some("billing.example.com");
        assert_eq!(chosen(&cfg, "GET", "/v1/pay", host, false), "billing");
        assert_eq!(chosen(&cfg, "GET", "/v2/pay", host, false), "sub");
        assert_eq!(chosen(&cfg, "GET", "/v1/pay", Some("x.test"), false), "v1");
        assert_eq!(chosen(&cfg, "GET", "/v1/pay", None, false), "v1");
        assert!(cfg.routes.uses_host());
    }

    #[test]
    fn twenty_routes_choose_by_the_first_match_in_file_order() {
        // Routes 0..19 take /s<i>/; every odd one also takes one host. A path every route
        // would fit by its prefix goes by the first of them.
        let mut text = String::new();
        for i in 0..20 {
            let m = if i % 2 == 1 {
                format!("path_prefix = \"/s{i}/\", host = \"h{i}.test\"")
            } else {
                format!("path_prefix = \"/s{i}/\"")
            };
            text.push_str(&route(
                &format!("r{i}"),
                &m,
                if i % 3 == 0 { "a" } else { "b" },
            ));
        }
        text.push_str(&route("all", "path_prefix = \"/\"", "a"));
        let cfg = config(&text);
        assert_eq!(cfg.routes.list.len(), 21);
        for i in 0..20 {
            let path = format!("/s{i}/x");
            let want = if i % 2 == 1 { "all" } else { &*format!("r{i}") };
            assert_eq!(chosen(&cfg, "GET", &path, None, false), want, "{path}");
            let host = format!("h{i}.test");
            assert_eq!(
                chosen(&cfg, "GET", &path, Some(&host), false),
                format!("r{i}"),
                "{path} on {host}"
            );
        }
        assert_eq!(chosen(&cfg, "GET", "/s19", None, false), "all");
        assert_eq!(chosen(&cfg, "GET", "/s19/", Some("h19.test"), false), "r19");
    }

    #[test]
    fn the_index_agrees_with_a_scan_for_the_first_fit() {
        let mut text = String::new();
        for i in 0..30 {
            let m = match i % 3 {
                0 => format!("path_prefix = \"/p{}/\"", i % 5),
                1 => format!("path = \"/p{}/{}\"", i % 5, i),
                _ => format!("glob = \"/p{}/*/{}\"", i % 5, i % 4),
            };
            text.push_str(&route(&format!("r{i}"), &m, "a"));
        }
        let cfg = config(&text);
        let get = Method::GET;
        for n in 0..600u32 {
            let path = match n % 3 {
                0 => format!("/p{}/{}", n % 6, n % 31),
                1 => format!("/p{}/q/{}", n % 6, n % 5),
                _ => format!("/p{}/", n % 6),
            };
            let slow = cfg
                .routes
                .list
                .iter()
                .position(|r| r.matcher.fits_path(&path));
            let headers = HeaderMap::new();
            let requester = Requester::new(
                &headers,
                "10.0.0.1".parse().unwrap(),
                &cfg.keys,
                &cfg.client_ip,
            );
            let fast = cfg.routes.choose(&get, &path, None, &requester).unwrap();
            assert_eq!(fast, slow, "{path}");
        }
    }

    fn forwarded(strip: Option<&str>, add: Option<&str>, case: PathCase, pq: &str) -> String {
        let routes = Routes::new(
            vec![Route {
                name: "r".into(),
                matcher: Match::default(),
                pool: 0,
                strip_prefix: strip.map(str::to_string),
                add_prefix: add.map(str::to_string),
            }],
            None,
            case,
        );
        routes.forwarded_path(0, pq).into_owned()
    }

    #[test]
    fn the_forwarded_path_is_the_matched_path_stripped_then_added_to() {
        let s = PathCase::Sensitive;
        for (strip, add, sent, want) in [
            // A path already normal keeps its bytes; the query is always the client's.
            (
                Some("/v1"),
                None,
                "/v1/orders/x?a=%20b&c",
                "/orders/x?a=%20b&c",
            ),
            (Some("/v1"), None, "/v1", "/"),
            (Some("/v1"), None, "/v1?x=1", "/?x=1"),
            (Some("/v1/"), None, "/v1/", "/"),
            (Some("/v1/"), None, "/v1/x", "/x"),
            // The prefix ends a segment, or it is not taken off.
            (Some("/v1"), None, "/v1abc", "/v1abc"),
            (Some("/v1"), Some("/api"), "/v1../x", "/api/v1../x"),
            (Some("/v1"), None, "/v2/x", "/v2/x"),
            // The query is no part of the path: `?` in it is never stripped.
            (Some("/v1"), None, "/a?/v1", "/a?/v1"),
            (Some("/v1"), None, "/V1/x", "/V1/x"),
            (None, Some("/api"), "/", "/api/"),
            (Some("/v1"), Some("/api"), "/v1", "/api/"),
            // Neither prefix: the target as sent, dot segments and all.
            (None, None, "/a//b/../c?x", "/a//b/../c?x"),
            (Some("/v1"), Some("/api"), "*", "*"),
            // Decoded as the rules read it, and encoded again where a path must be.
            (None, Some("/api"), "/x%20y?q", "/api/x%20y?q"),
            (
                Some("/v1"),
                None,
                "/v1/orders/%2F%41?a=%20b&c",
                "/orders/A?a=%20b&c",
            ),
            (Some("/v1"), None, "/v1/a%2Fb", "/a/b"),
            (Some("/v1"), None, "/v1/a%252Fb", "/a%252Fb"),
            (Some("/v1"), None, "/v1/a%3Fb%23c%25", "/a%3Fb%23c%25"),
            (Some("/v1"), None, "/v1/caf%C3%A9", "/caf%C3%A9"),
            (Some("/v1"), Some("/api"), "/v1/x;p=1", "/api/x"),
            // Other spellings of the prefix.
            (Some("/v1"), None, "/%76%31/orders?x=%20", "/orders?x=%20"),
            (Some("/v1"), None, "//v1/orders", "/orders"),
            (Some("/v1"), None, "/./v1/a%20b", "/a%20b"),
            (Some("/v1"), None, "/v1;x/orders", "/orders"),
            (Some("/v1"), None, "/v1%2Forders", "/orders"),
            // Dot segments, plain and encoded in any case, resolved before the prefix is
            // taken off: what is left never climbs out of add_prefix.
            (Some("/v1"), Some("/v2"), "/v1/../v1/x", "/v2/x"),
            (
                Some("/v1"),
                Some("/v2"),
                "/v1/x/%2e%2e/%2E%2e/v1/internal",
                "/v2/internal",
            ),
            (Some("/v1"), Some("/v2"), "/v1/x/.%2e/y", "/v2/y"),
            (Some("/v1"), Some("/v2"), "/v1/./x/.", "/v2/x/"),
            (Some("/v1"), Some("/v2"), "/v1/x/..", "/v2/"),
            (Some("/v1"), Some("/v2"), "/v1//x//", "/v2/x/"),
            (
                Some("/v1"),
                Some("/v2"),
                "/v1/x/..%2F..%2F..%2Fetc",
                "/v2/etc",
            ),
            (Some("/v1"), Some("/v2"), "/v1/x/..%5C..%5Cetc", "/v2/etc"),
            (
                Some("/v1"),
                Some("/v2"),
                "/v1/%2e%2e/%2e%2e/etc?q=/../",
                "/v2/etc?q=/../",
            ),
            (None, Some("/v2"), "/x/../../etc", "/v2/etc"),
        ] {
            assert_eq!(
                forwarded(strip, add, s, sent),
                want,
                "{strip:?} {add:?} {sent}"
            );
        }
        assert_eq!(
            forwarded(Some("/v1"), None, PathCase::Insensitive, "/V1/X?Q"),
            "/X?Q"
        );
        assert_eq!(
            forwarded(Some("/v1"), None, PathCase::Insensitive, "/V1/%2e%2e/V1/X"),
            "/X"
        );
        let routes = Routes::default();
        assert_eq!(routes.forwarded_path(3, "/x?y"), "/x?y");
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// Pieces a path that tries to climb out is made of.
        fn piece() -> impl Strategy<Value = &'static str> {
            prop::sample::select(vec![
                "/", "..", ".", "%2e", "%2E", "%2F", "%2f", "%5C", "\\", ";p", "%3B", "%25",
                "%252e", "v1", "x", "?", "%3F", "%00",
            ])
        }

        crate::proptest_seeds! {
            #![cases(2048)]

            /// Whatever the path, what a route with `strip_prefix = "/v1"` and `add_prefix =
            /// "/v2"` forwards starts with `/v2/`, and stays there for a backend that
            /// resolves it again as the rules read paths: decoded once more (`%252e` is
            /// `%2e` to it), dot segments and all.
            #[test]
            fn no_path_climbs_out_of_add_prefix(pieces in prop::collection::vec(piece(), 0..24)) {
                let sent = format!("/v1/{}", pieces.concat());
                let out = forwarded(Some("/v1"), Some("/v2"), PathCase::Sensitive, &sent);
                let path = out.split('?').next().unwrap_or_default();
                prop_assert!(path.starts_with("/v2/"), "{} -> {}", sent, out);
                prop_assert!(
                    !path.split('/').any(|seg| seg == "." || seg == ".."),
                    "{} -> {}", sent, out
                );
                let resolved = crate::rules::normalize_path(path);
                prop_assert!(resolved.starts_with("/v2/"), "{} -> {} -> {}", sent, out, resolved);
            }
        }
    }

    #[test]
    fn routes_from_the_file_carry_their_prefixes_and_pool() {
        let cfg = config(
            "[[routes]]\nmatch = { path_prefix = \"/v1/\" }\nupstream = \"b\"\nstrip_prefix = \"/v1\"\nadd_prefix = \"/api/\"\n[[routes]]\nupstream = \"a\"\n",
        );
        let r = &cfg.routes.list;
        assert_eq!(
            (r[0].name.as_str(), r[1].name.as_str()),
            ("route-1", "route-2")
        );
        assert_eq!(r[0].pool, 1);
        assert_eq!(cfg.routes.forwarded_path(0, "/v1/x?y=%41"), "/api/x?y=%41");
        assert_eq!(cfg.routes.forwarded_path(1, "/v1/x"), "/v1/x");
    }
}
