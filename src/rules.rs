//! Request parts -> the rules that apply. Pure, and compiled at load.

use http::Method;

use crate::config::Rule;

/// Whether `rule` applies to a request with `method` and (normalised) `path`.
pub fn applies(rule: &Rule, method: &Method, path: &str) -> bool {
    let m = &rule.matcher;
    (m.methods.is_empty() || m.methods.contains(method))
        && m.path_prefix.as_deref().is_none_or(|p| path.starts_with(p))
}

/// The path as rules see it: percent-encoded unreserved characters decoded, `.` and `..`
/// segments resolved and repeated slashes folded, as an upstream would resolve them, so
/// `/x/../api/` or `//api/` or `/%61pi/` cannot slip past a rule for `/api/`.
pub fn normalize_path(raw: &str) -> std::borrow::Cow<'_, str> {
    let clean = !raw.contains("//") && !raw.contains("/.") && !raw.contains('%');
    if clean {
        return raw.into();
    }
    let decoded = decode_unreserved(raw);
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

fn decode_unreserved(raw: &str) -> String {
    let b = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                let c = (h * 16 + l) as u8;
                if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                    out.push(c as char);
                    i += 3;
                    continue;
                }
            }
        }
        out.push(b[i] as char);
        i += 1;
    }
    out
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
    let applied: Vec<&Rule> = cfg
        .rules
        .iter()
        .filter(|r| applies(r, method, &path))
        .collect();
    if applied.is_empty() {
        let _ = writeln!(out, "no rule applies: forwarded without limits");
        return out;
    }
    let key = identity::api_key(headers, &cfg.keys.header);
    let plan = match &key {
        Ok(Some(k)) => cfg.keys.plans.get(*k).map(String::as_str),
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
                            && !cfg.keys.plans.contains_key(v);
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
            format!("counted per {who}")
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
        assert_eq!(normalize_path("/api%2Fy"), "/api%2Fy");
        assert_eq!(normalize_path("/../../"), "/");
        assert_eq!(normalize_path("/api/.."), "/");
        assert_eq!(normalize_path("/a%"), "/a%");
        assert_eq!(normalize_path("/a%6"), "/a%6");
    }
}
