//! Request parts -> the rules that apply. Pure, and compiled at load.
//!
//! A request's rules are found through a [`RuleIndex`] built once per config: exact paths
//! by one hash lookup, path prefixes by one walk down a byte trie along the path, so the
//! cost grows with the path's length and the rules that match, not with how many rules
//! the file has. A glob sits in the trie under its literal start (`/v1/` of
//! `/v1/*/export`) and is checked whole when the walk meets it; then the candidates'
//! methods and hosts are checked.

use std::collections::HashMap;
use std::fmt;

use http::Method;

use crate::config::{PathMatch, Rule};

/// A path glob: segments split on `/`; `*` matches any characters within one segment,
/// and a segment that is exactly `**` matches any number of segments (none included).
#[derive(Debug, Clone)]
pub struct Glob {
    pattern: String,
    segments: Vec<Segment>,
}

#[derive(Debug, Clone)]
enum Segment {
    /// `**`.
    Any,
    /// A segment, `*` matching any run of characters in it.
    Pattern(String),
}

impl Glob {
    pub fn new(pattern: &str) -> Result<Glob, String> {
        if !pattern.starts_with('/') {
            return Err(format!("glob {pattern:?} must start with \"/\""));
        }
        let segments = pattern[1..]
            .split('/')
            .map(|seg| match seg {
                "**" => Ok(Segment::Any),
                s if s.contains("**") => Err(format!(
                    "glob {pattern:?}: ** is a whole segment (/**/), not part of one"
                )),
                s => Ok(Segment::Pattern(s.to_string())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Glob {
            pattern: pattern.to_string(),
            segments,
        })
    }

    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Whether `path` (normalised, starting with `/`) matches.
    pub fn matches(&self, path: &str) -> bool {
        match path.strip_prefix('/') {
            Some(rest) => match_segments(&self.segments, Some(rest)),
            None => false,
        }
    }

    /// The literal start of the pattern, up to its first wildcard: every path it matches
    /// starts with this (so the index can find the glob by prefix).
    pub fn literal_prefix(&self) -> &str {
        let end = self.pattern.find('*').unwrap_or(self.pattern.len());
        // Without its last `/`: `/static/**` matches `/static` itself.
        let lit = &self.pattern[..end];
        match lit.strip_suffix('/') {
            Some(l) if !l.is_empty() => l,
            _ => lit,
        }
    }
}

/// `rest`: the path's segments still to match, `/`-separated; `None` once all are used.
fn match_segments(pattern: &[Segment], rest: Option<&str>) -> bool {
    match pattern.split_first() {
        None => rest.is_none(),
        Some((Segment::Any, more_pattern)) => {
            // Skip 0, 1, 2, ... segments.
            let mut r = rest;
            loop {
                if match_segments(more_pattern, r) {
                    return true;
                }
                match r {
                    None => return false,
                    Some(s) => r = s.split_once('/').map(|(_, more)| more),
                }
            }
        }
        Some((Segment::Pattern(p), more_pattern)) => match rest {
            None => false,
            Some(r) => {
                let (seg, more) = match r.split_once('/') {
                    Some((seg, more)) => (seg, Some(more)),
                    None => (r, None),
                };
                wildcard(p.as_bytes(), seg.as_bytes()) && match_segments(more_pattern, more)
            }
        },
    }
}

/// `*` matches any run of bytes; everything else matches itself.
fn wildcard(p: &[u8], s: &[u8]) -> bool {
    // The classic two-pointer match with one backtrack point: linear in practice.
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && p[pi] == s[si] {
            pi += 1;
            si += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&b| b == b'*')
}

/// A `host` of a rule's match: one name, or every subdomain of one (`*.example.com`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    Exact(String),
    /// `.example.com` for `*.example.com`.
    Subdomains(String),
}

impl HostPattern {
    pub fn new(s: &str) -> Result<HostPattern, String> {
        let lower = s.trim().to_ascii_lowercase();
        let (wild, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, lower.as_str()),
        };
        // A name, or a bracketed IPv6 literal; never a port.
        let ok = match name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
            Some(v6) => !wild && v6.parse::<std::net::Ipv6Addr>().is_ok(),
            None => {
                !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
            }
        };
        if !ok {
            return Err(format!(
                "invalid host {s:?}: a host name (api.example.com) or *.example.com, without port"
            ));
        }
        Ok(if wild {
            HostPattern::Subdomains(format!(".{name}"))
        } else {
            HostPattern::Exact(name.to_string())
        })
    }

    /// Whether `host` (without port) matches, ignoring ASCII case.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(h) => host.eq_ignore_ascii_case(h),
            HostPattern::Subdomains(suffix) => {
                host.len() > suffix.len()
                    && host.is_char_boundary(host.len() - suffix.len())
                    && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
            }
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostPattern::Exact(h) => f.write_str(h),
            HostPattern::Subdomains(s) => write!(f, "*{s}"),
        }
    }
}

/// The host a request is for, without port: the URI's authority (HTTP/2, absolute-form),
/// else the `Host` header. Brackets of an IPv6 literal are kept.
pub fn request_host<'a>(uri: &'a http::Uri, headers: &'a http::HeaderMap) -> Option<&'a str> {
    let raw = match uri.authority() {
        Some(a) => a.as_str(),
        None => headers.get(http::header::HOST)?.to_str().ok()?,
    };
    let raw = raw.rsplit_once('@').map_or(raw, |(_, h)| h);
    let host = if raw.starts_with('[') {
        raw.find(']').map_or(raw, |end| &raw[..=end])
    } else {
        raw.split_once(':').map_or(raw, |(h, _)| h)
    };
    // `api.example.com.` is `api.example.com` (the absolute form of the same name).
    Some(host.strip_suffix('.').unwrap_or(host))
}

/// The rules of a config, compiled for matching.
#[derive(Debug, Default)]
pub struct RuleIndex {
    exact: HashMap<String, Vec<usize>>,
    prefixes: Trie,
    /// Rules without a path: they fit every path.
    others: Vec<usize>,
    /// Whether any rule looks at the host (else the host is not even parsed).
    pub uses_host: bool,
    /// Per rule: its methods and hosts, checked on candidates.
    rules: Vec<Filter>,
}

#[derive(Debug)]
struct Filter {
    methods: Vec<Method>,
    hosts: Vec<crate::rules::HostPattern>,
    glob: Option<Glob>,
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
    pub fn new(rules: &[Rule]) -> RuleIndex {
        let mut index = RuleIndex::default();
        for (i, r) in rules.iter().enumerate() {
            let m = &r.matcher;
            let mut glob = None;
            match &m.path {
                PathMatch::Exact(p) => index.exact.entry(p.clone()).or_default().push(i),
                PathMatch::Prefix(p) => index.prefixes.insert(p, i),
                PathMatch::Glob(g) => {
                    // Found by its literal start, then checked whole.
                    glob = Some(g.clone());
                    index.prefixes.insert(g.literal_prefix(), i);
                }
                PathMatch::Any => index.others.push(i),
            }
            index.uses_host |= !m.hosts.is_empty();
            // A rule for GET counts HEAD too: backends answer a HEAD by running their GET
            // handler (RFC 9110 §9.3.2), so HEAD would otherwise walk around the rule.
            let mut methods = m.methods.clone();
            if methods.contains(&Method::GET) && !methods.contains(&Method::HEAD) {
                methods.push(Method::HEAD);
            }
            index.rules.push(Filter {
                methods,
                hosts: m.hosts.clone(),
                glob,
            });
        }
        index
    }

    /// The rules that apply to a request, by their position in the config, in order.
    /// `path` is normalised ([`normalize_path`]); `host` is without port.
    pub fn matching(&self, method: &Method, path: &str, host: Option<&str>) -> Vec<usize> {
        let mut out = Vec::new();
        if let Some(r) = self.exact.get(path) {
            out.extend_from_slice(r);
        }
        self.prefixes.walk(path, &mut out);
        out.extend_from_slice(&self.others);
        out.retain(|&i| {
            let f = &self.rules[i];
            (f.methods.is_empty() || f.methods.contains(method))
                && (f.hosts.is_empty()
                    || host.is_some_and(|h| f.hosts.iter().any(|p| p.matches(h))))
                && f.glob.as_ref().is_none_or(|g| g.matches(path))
        });
        out.sort_unstable();
        out
    }
}

/// The path as rules see it: the path a backend will route. Every percent-escape decoded
/// (`%2F` and `%5C` included: common backends decode them before routing, so `/api%2Fx`
/// reaches their `/api/x`), a backslash read as a slash (as some backends do), `.` and
/// `..` segments resolved and repeated slashes folded. So `/x/../api/`, `//api/`,
/// `/%61pi/`, `/api%2Fx` and `/%2Fapi/x` cannot slip past a rule for `/api/`. Reading more
/// paths as matching a rule than a given backend would is the safe side: a rule then
/// limits more requests, never fewer. The request is still forwarded with its original
/// bytes.
///
/// Decoded once, as backends do: `%252F` is the segment text `%2F`, not a slash.
pub fn normalize_path(raw: &str) -> std::borrow::Cow<'_, str> {
    let clean =
        !raw.contains("//") && !raw.contains("/.") && !raw.contains('%') && !raw.contains('\\');
    if clean {
        return raw.into();
    }
    let decoded = decode_path(raw);
    let mut out: Vec<&str> = Vec::new();
    for seg in decoded.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            s => out.push(s),
        }
    }
    let mut path = String::with_capacity(decoded.len());
    for s in &out {
        path.push('/');
        path.push_str(s);
    }
    if path.is_empty()
        || decoded.ends_with('/')
        || decoded.ends_with("/.")
        || decoded.ends_with("/..")
    {
        path.push('/');
    }
    path.into()
}

/// Every `%XX` escape decoded (a `%` not followed by two hex digits stays as it is), and
/// `\` made `/`. Bytes that do not form UTF-8 become U+FFFD: no rule can name them.
fn decode_path(raw: &str) -> String {
    let b = raw.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let hex = |c: u8| (c as char).to_digit(16);
    while i < b.len() {
        let mut c = b[i];
        i += 1;
        if c == b'%' {
            if let (Some(h), Some(l)) = (
                b.get(i).copied().and_then(hex),
                b.get(i + 1).copied().and_then(hex),
            ) {
                c = (h * 16 + l) as u8;
                i += 2;
            }
        }
        out.push(if c == b'\\' { b'/' } else { c });
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Which rules apply to a sample request, and how each would count it: what
/// `ratewall check --path ... --method ... --header ...` prints. Pure: no store is asked.
pub fn explain(
    cfg: &crate::config::Config,
    method: &Method,
    raw_path: &str,
    headers: &http::HeaderMap,
    peer: std::net::IpAddr,
) -> String {
    use crate::config::{KeyKind, MissingKey, UnknownKeys};
    use crate::identity;
    use std::fmt::Write;

    let path = normalize_path(raw_path);
    let mut out = String::new();
    let _ = writeln!(out, "sample request: {method} {raw_path}");
    if path != raw_path {
        let _ = writeln!(out, "  (rules see the path as {path})");
    }
    let no_uri = http::Uri::default();
    let host = request_host(&no_uri, headers);
    let applied: Vec<&Rule> = cfg
        .index
        .matching(method, &path, host)
        .into_iter()
        .map(|i| &cfg.rules[i])
        .collect();
    if applied.is_empty() {
        let _ = writeln!(out, "no rule applies: forwarded without limits");
        return out;
    }
    let key = identity::api_key(headers, &cfg.keys.header);
    let plan = match &key {
        Ok(Some(k)) => cfg.keys.plan_of(k),
        _ => None,
    };
    let client = identity::client_ip(peer, headers, &cfg.client_ip);
    let _ = writeln!(
        out,
        "{} rule(s) apply; the request passes only if all allow it:",
        applied.len()
    );
    for r in applied {
        let q = r.quota_for(plan);
        let plan_note = match plan {
            Some(p) if r.plans.contains_key(p) => format!(" (plan {p})"),
            _ => String::new(),
        };
        let who = match &r.key {
            KeyKind::Global => "everyone, one shared limit".to_string(),
            KeyKind::ClientIp => format!("client IP {client}"),
            KeyKind::ApiKey | KeyKind::Header(_) => {
                let name = match &r.key {
                    KeyKind::Header(h) => h,
                    _ => &cfg.keys.header,
                };
                match identity::api_key(headers, name) {
                    Err(e) => format!("refused with 400: {e}"),
                    Ok(Some(v)) => {
                        let unknown = matches!(r.key, KeyKind::ApiKey)
                            && cfg.keys.unknown == UnknownKeys::Reject
                            && cfg.keys.plan_of(v).is_none();
                        if unknown {
                            "refused with 401: the API key is not known (unknown = \"reject\")"
                                .to_string()
                        } else {
                            let d = match &r.key {
                                KeyKind::Header(h) => identity::digest_header(h, v),
                                _ => identity::digest_api_key(v),
                            };
                            format!("{name} (identity {})", &d.hex()[..8])
                        }
                    }
                    Ok(None) => match r.missing_key {
                        MissingKey::Reject => format!("refused with 401: no {name} header"),
                        MissingKey::ClientIp => format!("no {name}: client IP {client}"),
                    },
                }
            }
        };
        let how = if who.starts_with("refused") {
            who
        } else {
            let enforced = identity_of(cfg, r, headers, peer).is_none_or(|d| r.enforces(&d));
            let mode = match (r.mode, r.enforce_percent) {
                (crate::config::Mode::Shadow, _) => ", shadow: never denies",
                (_, 100) => "",
                _ if enforced => ", enforced for this identity (enforce_percent)",
                _ => ", shadow for this identity (outside enforce_percent)",
            };
            format!("counted per {who}{mode}")
        };
        let _ = writeln!(
            out,
            "  - {}: {q}{plan_note}, {}; {how}",
            r.name,
            q.algorithm.name()
        );
    }
    out
}

/// The digest a rule would count a sample request under, when it has one.
fn identity_of(
    cfg: &crate::config::Config,
    r: &Rule,
    headers: &http::HeaderMap,
    peer: std::net::IpAddr,
) -> Option<crate::limiter::IdentityDigest> {
    use crate::config::{KeyKind, MissingKey};
    use crate::identity;
    let client = || identity::digest_ip(identity::client_ip(peer, headers, &cfg.client_ip));
    Some(match &r.key {
        KeyKind::Global => identity::digest_global(),
        KeyKind::ClientIp => client(),
        KeyKind::ApiKey => match identity::api_key(headers, &cfg.keys.header).ok()? {
            Some(v) => identity::digest_api_key(v),
            None if r.missing_key == MissingKey::ClientIp => client(),
            None => return None,
        },
        KeyKind::Header(h) => match identity::api_key(headers, h).ok()? {
            Some(v) => identity::digest_header(h, v),
            None if r.missing_key == MissingKey::ClientIp => client(),
            None => return None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_what_could_dodge_a_prefix() {
        assert_eq!(normalize_path("/api/x"), "/api/x");
        assert_eq!(normalize_path("/x/../api/y"), "/api/y");
        assert_eq!(normalize_path("//api//y"), "/api/y");
        assert_eq!(normalize_path("/./api/"), "/api/");
        assert_eq!(normalize_path("/%61pi/y"), "/api/y");
        assert_eq!(normalize_path("/api%2Fy"), "/api/y");
        assert_eq!(normalize_path("/api%2fy"), "/api/y");
        assert_eq!(normalize_path("/%2Fapi/x"), "/api/x");
        assert_eq!(normalize_path("/api%5Cx"), "/api/x");
        assert_eq!(normalize_path("/api\\x"), "/api/x");
        assert_eq!(normalize_path("/x/%2e%2e/api/y"), "/api/y");
        assert_eq!(normalize_path("/x%2F..%2Fapi/y"), "/api/y");
        assert_eq!(normalize_path("/api%252Fy"), "/api%2Fy", "decoded once");
        assert_eq!(normalize_path("/caf%C3%A9"), "/café");
        assert_eq!(normalize_path("/a%FF"), "/a\u{FFFD}");
        assert_eq!(normalize_path("/../../"), "/");
        assert_eq!(normalize_path("/api/.."), "/");
        assert_eq!(normalize_path("/a%"), "/a%");
        assert_eq!(normalize_path("/a%6"), "/a%6");
    }

    #[test]
    fn globs_match_within_segments_and_across_with_double_star() {
        let g = Glob::new("/v1/*/export").unwrap();
        assert!(g.matches("/v1/orders/export"));
        assert!(!g.matches("/v1/export"), "* is one whole segment, not none");
        assert!(!g.matches("/v1/a/b/export"), "* does not cross a /");
        assert!(!g.matches("/v1/a/export/x"));
        assert!(!g.matches("/v1/a/exports"));
        let g = Glob::new("/files/*.csv").unwrap();
        assert!(g.matches("/files/report.csv"));
        assert!(g.matches("/files/.csv"));
        assert!(!g.matches("/files/report.csv.gz"));
        let g = Glob::new("/v1/**/export").unwrap();
        for p in ["/v1/export", "/v1/a/export", "/v1/a/b/c/export"] {
            assert!(g.matches(p), "{p}");
        }
        assert!(!g.matches("/v2/a/export"));
        let g = Glob::new("/static/**").unwrap();
        assert!(g.matches("/static/a/b.js") && g.matches("/static/") && g.matches("/static"));
        assert!(Glob::new("v1/*").is_err());
        assert!(Glob::new("/v1/a**/x").is_err());
        // A pathological pattern stays linear-ish, not exponential.
        let g = Glob::new(&format!("/{}b", "*a".repeat(20))).unwrap();
        assert!(!g.matches(&format!("/{}", "a".repeat(60))));
    }

    #[test]
    fn hosts_match_exactly_or_by_subdomain_ignoring_case() {
        let h = HostPattern::new("API.example.com").unwrap();
        assert!(h.matches("api.example.com") && h.matches("Api.Example.Com"));
        assert!(!h.matches("x.api.example.com"));
        let w = HostPattern::new("*.example.com").unwrap();
        assert!(w.matches("a.example.com") && w.matches("a.b.EXAMPLE.com"));
        assert!(!w.matches("example.com"), "*. needs a subdomain");
        assert!(!w.matches("badexample.com"));
        assert!(HostPattern::new("[::1]").unwrap().matches("[::1]"));
        for bad in ["api.example.com:80", "", "*.", "a b", "*.[::1]", "[zz]"] {
            assert!(HostPattern::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_request_host_drops_the_port() {
        let h = |uri: &str, host: Option<&str>| {
            let uri: http::Uri = uri.parse().unwrap();
            let mut headers = http::HeaderMap::new();
            if let Some(v) = host {
                headers.insert(http::header::HOST, v.parse().unwrap());
            }
            request_host(&uri, &headers).map(str::to_string)
        };
        assert_eq!(
            h("/x", Some("api.example.com:8080")).as_deref(),
            Some("api.example.com")
        );
        assert_eq!(h("/x", Some("[::1]:80")).as_deref(), Some("[::1]"));
        assert_eq!(
            h("http://a.test:1/x", Some("b.test")).as_deref(),
            Some("a.test")
        );
        assert_eq!(h("/x", None), None);
        assert_eq!(
            h("/x", Some("api.example.com.:80")).as_deref(),
            Some("api.example.com")
        );
    }

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
                .filter(|&i| {
                    let r = &cfg.rules[i];
                    match &r.matcher.path {
                        PathMatch::Prefix(p) => path.starts_with(p.as_str()),
                        PathMatch::Exact(p) => path == *p,
                        PathMatch::Glob(g) => g.matches(&path),
                        PathMatch::Any => true,
                    }
                })
                .collect();
            assert_eq!(cfg.index.matching(&get, &path, None), slow, "{path}");
        }
    }
}
