//! A config's rules compiled for matching: exact paths by one hash lookup, path prefixes
//! by one walk down a byte trie along the path, so the cost grows with the path's length
//! and the rules that match, not with how many rules the file has. A glob sits in the
//! trie under its literal start (`/v1/` of `/v1/*/export`) and is checked whole when the
//! walk meets it; then the candidates' methods and hosts are checked. What a request
//! carries (`api_key = "absent"`) and its plan are not the index's: [`Rule::applies`]
//! judges those, with the request's identity. Where the backend ignores case
//! (`[server] path_case = "insensitive"`), the rules' paths are lowercased here, once, and
//! each request's path as it is matched ([`RuleIndex::path_of`]).

use std::borrow::Cow;
use std::collections::HashMap;

use http::Method;

use super::{normalize_path, Glob, Match, PathCase, PathMatch};

/// The matches of a config's rules (or of its routes), compiled for matching.
#[derive(Debug, Default)]
pub struct RuleIndex {
    exact: HashMap<String, Vec<usize>>,
    prefixes: Trie,
    /// Rules without a path: they fit every path.
    others: Vec<usize>,
    /// Whether any rule looks at the host (else the host is not even parsed).
    pub uses_host: bool,
    /// Per rule: its match, whose methods, hosts and glob are checked on candidates (its
    /// path folded as `case` says).
    rules: Vec<Match>,
    /// How paths compare: the rules' were folded with it, the requests' are.
    case: PathCase,
    /// The egress gateway's rules (`egress = true`), which the index above leaves out.
    egress: Vec<usize>,
}

/// A byte trie of path prefixes: walking a path down it meets every prefix it starts with.
#[derive(Debug, Default)]
struct Trie {
    nodes: Vec<Node>,
}

#[derive(Debug, Default)]
struct Node {
    /// (byte, child node), sorted by byte.
    children: Vec<(u8, u32)>,
    /// Rules whose prefix ends here.
    rules: Vec<usize>,
}

impl Trie {
    fn insert(&mut self, prefix: &str, rule: usize) {
        if self.nodes.is_empty() {
            self.nodes.push(Node::default());
        }
        let mut at = 0usize;
        for &b in prefix.as_bytes() {
            let next = match self.nodes[at].children.binary_search_by_key(&b, |c| c.0) {
                Ok(i) => self.nodes[at].children[i].1 as usize,
                Err(i) => {
                    let id = self.nodes.len();
                    self.nodes.push(Node::default());
                    self.nodes[at].children.insert(i, (b, id as u32));
                    id
                }
            };
            at = next;
        }
        self.nodes[at].rules.push(rule);
    }

    fn walk(&self, path: &str, out: &mut Vec<usize>) {
        let Some(mut node) = self.nodes.first() else {
            return;
        };
        out.extend_from_slice(&node.rules);
        for &b in path.as_bytes() {
            match node.children.binary_search_by_key(&b, |c| c.0) {
                Ok(i) => node = &self.nodes[node.children[i].1 as usize],
                Err(_) => return,
            }
            out.extend_from_slice(&node.rules);
        }
    }
}

impl RuleIndex {
    /// The index of `matches` (each rule's, or each route's), in order: what
    /// [`RuleIndex::matching`] returns are positions in it.
    pub fn new<'m>(matches: impl IntoIterator<Item = &'m Match>, case: PathCase) -> RuleIndex {
        let mut index = RuleIndex {
            case,
            ..RuleIndex::default()
        };
        for (i, matcher) in matches.into_iter().enumerate() {
            let m = &folded(matcher, case);
            index.rules.push(m.clone());
            if m.egress {
                index.egress.push(i);
            }
            if !m.proxied || m.egress {
                continue;
            }
            match &m.path {
                PathMatch::Exact(p) => index.exact.entry(p.clone()).or_default().push(i),
                PathMatch::Prefix(p) => index.prefixes.insert(p, i),
                // Found by its literal start, then checked whole.
                PathMatch::Glob(g) => index.prefixes.insert(g.literal_prefix(), i),
                PathMatch::Any => index.others.push(i),
            }
            index.uses_host |= !m.hosts.is_empty();
        }
        index
    }

    /// A request's path as the rules are matched against it: normalised
    /// ([`normalize_path`]), and folded as `path_case` says. What `ratewall check` shows.
    pub fn path_of<'a>(&self, raw: &'a str) -> Cow<'a, str> {
        self.case.fold(normalize_path(raw))
    }

    /// The rules (or routes) whose path, method and host fit a request, by their position
    /// in the config, in order. `path` is as [`RuleIndex::path_of`] gives it; `host` is
    /// without port. Neither what the request carries nor its route is looked at here.
    pub fn matching(&self, method: &Method, path: &str, host: Option<&str>) -> Vec<usize> {
        let mut out = Vec::new();
        if let Some(r) = self.exact.get(path) {
            out.extend_from_slice(r);
        }
        self.prefixes.walk(path, &mut out);
        out.extend_from_slice(&self.others);
        out.retain(|&i| {
            let m = &self.rules[i];
            m.fits_method(method)
                && m.fits_host(host)
                && match &m.path {
                    PathMatch::Glob(g) => g.matches(path),
                    _ => true,
                }
        });
        out.sort_unstable();
        out
    }

    /// The egress gateway's rules that fit a call going out, in order: its `path` as
    /// [`RuleIndex::path_of`] gives it, `host` its target's. A `CONNECT` tunnel (`tunnel`)
    /// has no method or path of its own to the rules: every egress rule for its host fits
    /// it (a client cannot leave a path- or method-scoped rule by tunnelling instead).
    pub fn egress_matching(
        &self,
        method: &Method,
        path: &str,
        host: &str,
        tunnel: bool,
    ) -> Vec<usize> {
        let mut out = self.egress.clone();
        out.retain(|&i| {
            let m = &self.rules[i];
            m.fits_host(Some(host)) && (tunnel || (m.fits_method(method) && m.fits_path(path)))
        });
        out
    }
}

/// `m` with its path folded as `case` says (a folded glob is still a glob: case touches
/// neither `*` nor `/`).
fn folded(m: &Match, case: PathCase) -> Match {
    let fold = |p: &str| case.fold(p.into()).into_owned();
    let path = match &m.path {
        PathMatch::Exact(p) => PathMatch::Exact(fold(p)),
        PathMatch::Prefix(p) => PathMatch::Prefix(fold(p)),
        PathMatch::Glob(g) => {
            PathMatch::Glob(Glob::new(&fold(g.pattern())).unwrap_or_else(|_| g.clone()))
        }
        PathMatch::Any => PathMatch::Any,
    };
    Match { path, ..m.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rules: &str) -> crate::config::Config {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n{rules}"
        );
        crate::config::Config::parse(&text, std::path::Path::new("t.toml")).unwrap()
    }

    fn rule(name: &str, matcher: &str) -> String {
        format!("[[rules]]\nname = \"{name}\"\nkey = \"global\"\nrate = \"1/s\"\nmatch = {{ {matcher} }}\n")
    }

    #[test]
    fn the_index_finds_every_matching_rule_in_config_order() {
        let cfg = config(
            &[
                rule("all", "methods = []"),
                rule("api", "path_prefix = \"/api/\""),
                rule("apiv1", "path_prefix = \"/api/v1/\""),
                rule("login", "path = \"/api/v1/login\", methods = [\"POST\"]"),
                rule("export", "glob = \"/api/*/export\""),
                rule("host", "host = [\"*.example.com\"]"),
                rule("ap", "path_prefix = \"/ap\""),
                rule("static", "glob = \"/static/**\""),
            ]
            .concat(),
        );
        let names = |method: &str, path: &str, host: Option<&str>| -> Vec<String> {
            let m = Method::from_bytes(method.as_bytes()).unwrap();
            cfg.index
                .matching(&m, path, host)
                .into_iter()
                .map(|i| cfg.rules[i].name.clone())
                .collect()
        };
        assert_eq!(
            names("POST", "/api/v1/login", None),
            ["all", "api", "apiv1", "login", "ap"]
        );
        assert_eq!(
            names("GET", "/api/v1/login", None),
            ["all", "api", "apiv1", "ap"]
        );

        assert_eq!(
            names("GET", "/api/v1/login/x", None),
            ["all", "api", "apiv1", "ap"]
        );
        assert_eq!(
            names("GET", "/api/v2/export", Some("x.example.com")),
            ["all", "api", "export", "host", "ap"]
        );
        assert_eq!(names("GET", "/apx", Some("example.com")), ["all", "ap"]);
        assert_eq!(names("GET", "/", None), ["all"]);
        assert_eq!(names("GET", "/static", None), ["all", "static"]);
        assert_eq!(names("GET", "/static/a/b.css", None), ["all", "static"]);
        assert_eq!(names("GET", "/staticx", None), ["all"]);
        assert!(cfg.index.uses_host);
    }

    #[test]
    fn a_rule_for_get_counts_head_too() {
        let cfg = config(
            &[
                rule("get", "path_prefix = \"/g/\", methods = [\"GET\"]"),
                rule("post", "path_prefix = \"/g/\", methods = [\"POST\"]"),
            ]
            .concat(),
        );
        let names = |method: &Method| -> Vec<String> {
            cfg.index
                .matching(method, "/g/x", None)
                .into_iter()
                .map(|i| cfg.rules[i].name.clone())
                .collect()
        };
        assert_eq!(names(&Method::GET), ["get"]);
        assert_eq!(names(&Method::HEAD), ["get"], "HEAD runs the GET handler");
        assert_eq!(names(&Method::POST), ["post"]);
        assert!(names(&Method::PUT).is_empty());
    }

    #[test]
    fn the_index_agrees_with_a_linear_scan_on_many_rules() {
        // 300 prefix, exact and glob rules; every one of 2_000 paths gets, from the index,
        // exactly the rules a one-by-one check of every rule finds.
        let mut text = String::new();
        for i in 0..100 {
            text.push_str(&rule(
                &format!("p{i}"),
                &format!("path_prefix = \"/s{}/{}\"", i % 7, i),
            ));
            text.push_str(&rule(
                &format!("e{i}"),
                &format!("path = \"/s{}/{}\"", i % 7, i),
            ));
            text.push_str(&rule(
                &format!("g{i}"),
                &format!("glob = \"/s{}/*/{}\"", i % 7, i % 10),
            ));
        }
        let cfg = config(&text);
        let get = Method::GET;
        for n in 0..2_000u32 {
            let path = match n % 4 {
                0 => format!("/s{}/{}", n % 7, n % 150),
                1 => format!("/s{}/{}x", n % 7, n % 120),
                2 => format!("/s{}/q/{}", n % 7, n % 13),
                _ => format!("/s{}/{}/", n % 9, n % 100),
            };
            let slow: Vec<usize> = (0..cfg.rules.len())
                .filter(|&i| cfg.rules[i].matcher.fits_path(&path))
                .collect();
            assert_eq!(cfg.index.matching(&get, &path, None), slow, "{path}");
        }
    }
}
