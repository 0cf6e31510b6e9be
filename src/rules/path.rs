//! What a request is matched by: its path as a backend will route it
//! ([`normalize_path`]), path globs, and its host.

use std::fmt;

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

/// The host a request is for, without port: exactly the one it is forwarded with, its
/// `Host` header, else the URI's authority (HTTP/2's `:authority`, or an absolute-form
/// target), as the upstream hop picks it. Brackets of an IPv6 literal are kept. The screen
/// has refused hosts that are not `uri-host [ ":" port ]` (userinfo included) and a `Host`
/// that differs from the authority, so every reader of the forwarded host sees this one.
pub fn request_host<'a>(uri: &'a http::Uri, headers: &'a http::HeaderMap) -> Option<&'a str> {
    let raw = match headers.get(http::header::HOST) {
        Some(h) => h.to_str().ok()?,
        None => uri.authority()?.as_str(),
    };
    let host = if raw.starts_with('[') {
        raw.find(']').map_or(raw, |end| &raw[..=end])
    } else {
        raw.split_once(':').map_or(raw, |(h, _)| h)
    };
    // `api.example.com.` is `api.example.com` (the absolute form of the same name).
    Some(host.strip_suffix('.').unwrap_or(host))
}

crate::telemetry::label_enum! {
    /// How a backend compares paths (`[server] path_case`): exactly (most do), or ignoring
    /// case (IIS, some Spring setups), in which case the rules must too, or `/API/x` walks
    /// around a rule for `/api/`.
    #[derive(Default, serde::Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub enum PathCase {
        #[default]
        Sensitive,
        /// Paths (the request's, and the rules') are lowercased before they are compared.
        Insensitive,
    }
}

impl PathCase {
    /// `path` as compared under this setting, where case is ignored: each character
    /// uppercased, then lowercased (the same function for the rules and the requests).
    /// Lowercasing alone is not enough: .NET and IIS compare by uppercase, under which
    /// `ı` (U+0131) is `I` and `ſ` (U+017F) is `S`, so `/ap%C4%B1/` is their `/api/`.
    pub fn fold(self, path: std::borrow::Cow<'_, str>) -> std::borrow::Cow<'_, str> {
        match self {
            PathCase::Sensitive => path,
            PathCase::Insensitive if path.is_ascii() => {
                if path.bytes().any(|b| b.is_ascii_uppercase()) {
                    path.to_ascii_lowercase().into()
                } else {
                    path
                }
            }
            PathCase::Insensitive => path
                .chars()
                .flat_map(char::to_uppercase)
                .flat_map(char::to_lowercase)
                .collect::<String>()
                .into(),
        }
    }
}

/// The path as rules see it: the path a backend will route. Every percent-escape decoded
/// (`%2F` and `%5C` included: common backends decode them before routing, so `/api%2Fx`
/// reaches their `/api/x`), a backslash read as a slash (as some backends do), each
/// segment's `;` parameters dropped (RFC 3986 §3.3's path parameters: Tomcat and Spring
/// route `/api;x/orders` as `/api/orders`, and `/..;/` as `/../`), `.` and `..` segments
/// resolved and repeated slashes folded. So `/x/../api/`, `//api/`, `/%61pi/`, `/api%2Fx`,
/// `/%2Fapi/x` and `/api;v=1/x` cannot slip past a rule for `/api/`. Reading more paths as
/// matching a rule than a given backend would is the safe side: a rule then limits more
/// requests, never fewer (parameters are dropped after decoding, so `%3B` is cut there too,
/// though Tomcat keeps it as text). The request is still forwarded with its original bytes,
/// but by a route that rewrites the path (`strip_prefix`, `add_prefix`), which forwards
/// this one ([`super::Routes::forwarded_path`]).
///
/// Decoded once, as backends do: `%252F` is the segment text `%2F`, not a slash.
pub fn normalize_path(raw: &str) -> std::borrow::Cow<'_, str> {
    let clean = !raw.contains("//") && !raw.contains("/.") && !raw.contains(['%', '\\', ';']);
    if clean {
        return raw.into();
    }
    let decoded = decode_path(raw);
    // Each segment without its parameters: `api;x` is `api`, `..;x` is `..`.
    let segments: Vec<&str> = decoded
        .split('/')
        .map(|seg| seg.split_once(';').map_or(seg, |(s, _)| s))
        .collect();
    let mut out: Vec<&str> = Vec::new();
    for seg in &segments {
        match *seg {
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
    // A path that ends in a slash, or in a dot segment, names a folder: `/api/` stays so.
    if path.is_empty() || matches!(segments.last(), Some(&("" | "." | ".."))) {
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
    fn path_parameters_are_dropped_from_every_segment() {
        assert_eq!(normalize_path("/api;x/orders"), "/api/orders");
        assert_eq!(
            normalize_path("/api;jsessionid=1;v=2/orders"),
            "/api/orders"
        );
        assert_eq!(normalize_path("/api/;x"), "/api/", "still a folder");
        assert_eq!(normalize_path("/x/..;/api/y"), "/api/y", "Tomcat's ..;");
        assert_eq!(normalize_path("/;x/api/y"), "/api/y");
        assert_eq!(normalize_path("/api%3Bx/y"), "/api/y", "the safe side");
        assert_eq!(normalize_path("/a/b;"), "/a/b");
        assert_eq!(normalize_path(";x"), "/");
    }

    #[test]
    fn paths_fold_to_lower_case_only_where_case_is_ignored() {
        let fold = |case: PathCase, p: &str| case.fold(p.into()).into_owned();
        assert_eq!(fold(PathCase::Sensitive, "/API/x"), "/API/x");
        assert_eq!(fold(PathCase::Insensitive, "/API/x"), "/api/x");
        assert_eq!(fold(PathCase::Insensitive, "/CAFÉ"), "/café");
        assert_eq!(fold(PathCase::Insensitive, "/api/x"), "/api/x");
        // Letters whose uppercase is ASCII: the rules' `/api/` is the backend's.
        assert_eq!(fold(PathCase::Insensitive, "/ap\u{131}/x"), "/api/x");
        assert_eq!(fold(PathCase::Insensitive, "/\u{17f}tatic"), "/static");
        assert_eq!(fold(PathCase::Insensitive, "/\u{212a}ey"), "/key");
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
            h("http://a.test:1/x", None).as_deref(),
            Some("a.test"),
            "no Host: the authority, which is forwarded as the Host"
        );
        assert_eq!(
            h("http://a.test:1/x", Some("a.test:1")).as_deref(),
            Some("a.test")
        );
        assert_eq!(h("/x", None), None);
        assert_eq!(
            h("/x", Some("api.example.com.:80")).as_deref(),
            Some("api.example.com")
        );
    }
}
